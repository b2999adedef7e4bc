"""The MLPerf reference workloads, by ``--model`` name. See ``base.Workload``.

:data:`NAMES` is the registry every list of workloads is read from (the command line's help
included), so importing it loads neither flax nor a workload: ``base`` is loaded on first use."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from podscale.workloads.base import Reference, Workload

_MODULES = {
    "resnet50": "podscale.workloads.resnet50",
    "transformer-big": "podscale.workloads.transformer_big",
    "bert-large": "podscale.workloads.bert_large",
    "gnmt": "podscale.workloads.gnmt",
    "ssd": "podscale.workloads.ssd",
    "maskrcnn": "podscale.workloads.maskrcnn",
    "dlrm": "podscale.workloads.dlrm",
    "llama3-8b": "podscale.workloads.llama3:LLAMA3_8B",
    "llama3-70b": "podscale.workloads.llama3:LLAMA3_70B",
}
"""``--model`` name -> the module defining it, and the attribute when it is not ``WORKLOAD``."""
NAMES = tuple(_MODULES)


def get(name: str) -> Workload:
    if name not in _MODULES:
        raise ValueError(f"unknown workload {name!r}; choose one of: {', '.join(NAMES)}")
    module, _, attribute = _MODULES[name].partition(":")
    return getattr(importlib.import_module(module), attribute or "WORKLOAD")


def __getattr__(name: str):
    if name in ("Reference", "Workload"):
        from podscale.workloads import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["NAMES", "Reference", "Workload", "get"]
