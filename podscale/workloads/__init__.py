"""The MLPerf reference workloads, by ``--model`` name. See ``base.Workload``."""

from __future__ import annotations

import importlib

from podscale.workloads.base import Reference, Workload

_MODULES = {
    "resnet50": "podscale.workloads.resnet50",
    "transformer-big": "podscale.workloads.transformer_big",
    "bert-large": "podscale.workloads.bert_large",
    "gnmt": "podscale.workloads.gnmt",
    "ssd": "podscale.workloads.ssd",
    "maskrcnn": "podscale.workloads.maskrcnn",
    "dlrm": "podscale.workloads.dlrm",
}
NAMES = tuple(_MODULES)


def get(name: str) -> Workload:
    if name not in _MODULES:
        raise ValueError(f"unknown workload {name!r}; choose one of: {', '.join(NAMES)}")
    return importlib.import_module(_MODULES[name]).WORKLOAD


__all__ = ["NAMES", "Reference", "Workload", "get"]
