"""podscale: run an unmodified single-device JAX training step across a pod of accelerators.

The public names load on first use (PEP 562), so ``podscale launch`` and the supervisor of each
process of a multi-process run (:mod:`podscale.train.supervise`) start without loading JAX."""

from __future__ import annotations

import importlib

from podscale.compiled.tpu import quiet_platforms

quiet_platforms()  # libtpu installed on a host without a TPU: JAX on the CPU, without libtpu's start-up errors

_PUBLIC = {
    "DataParallelStep": "podscale.parallel.engine",
    "PodscaleWarning": "podscale.parallel.checks",
    "Strategy": "podscale.parallel.strategy",
    "data_parallel": "podscale.parallel.engine",
    "distributed_eval": "podscale.train.evaluate",
    "make_mesh": "podscale.parallel.mesh",
    "sum_over_blocks": "podscale.parallel.regions",
    "verify": "podscale.verification",
}
__all__ = sorted(_PUBLIC)
__version__ = "0.1.0"


_SUBPACKAGES = ("bench", "compiled", "parallel", "projection", "train", "workloads")


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
    elif name in _SUBPACKAGES:  # podscale.parallel.tensor.Rules after a plain ``import podscale``:
        for module in sorted(set(_PUBLIC.values())):  # the modules ``import podscale`` loaded before
            importlib.import_module(module)
        value = importlib.import_module(f"podscale.{name}")
    else:
        raise AttributeError(f"module 'podscale' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
