"""Where a run's wall time went (its goodput), and its model FLOPs utilization (MFU).

``podscale train`` splits its wall time into :data:`PARTS`: start-up (flags to the first step:
devices, model, state, checkpoint restore), compilation (the first step, compiled and run once),
input wait (the loop waiting for the loader's next batch), training steps, evaluation,
checkpointing, time lost to interruptions (the steps a resumed run redoes: those an earlier
segment logged past the checkpoint it resumes from, at this run's mean step time), and the rest
(the summary, the export). Goodput is training steps over wall time.

MFU is the compiled step's FLOPs per device (:meth:`podscale.compiled.hlo.Module.flops`, loops counted
with their trip counts) over the mean step time and the device's dense bf16 peak, where
:data:`podscale.compiled.systems.SYSTEMS` knows the device kind (TPU v3 to v6e, A100, H100, H200); on
any other device (a CPU) there is no peak, and the run says so instead of a figure.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

from podscale.compiled import systems

PARTS = (
    "startup",
    "compilation",
    "input_wait",
    "training",
    "evaluation",
    "checkpointing",
    "lost_to_interruptions",
    "other",
)
LABELS = {
    "startup": "start-up",
    "compilation": "compilation (first step)",
    "input_wait": "input wait",
    "training": "training steps",
    "evaluation": "evaluation",
    "checkpointing": "checkpointing",
    "lost_to_interruptions": "lost to interruptions",
    "other": "other",
}

# JAX's device_kind (lower case) -> the system whose figures apply, most specific first.
_KINDS = (
    ("tpu v5 lite", "tpu-v5e"),
    ("tpu v5e", "tpu-v5e"),
    ("tpu v6 lite", "tpu-v6e"),
    ("tpu v6e", "tpu-v6e"),
    ("tpu v5p", "tpu-v5p"),
    ("tpu v5", "tpu-v5p"),
    ("tpu v4", "tpu-v4"),
    ("tpu v3", "tpu-v3"),
    ("a100", "a100"),
    ("h100", "h100"),
    ("h200", "h200"),
)


def system_of(device_kind: str) -> systems.System | None:
    """The system whose peak applies to a JAX ``device_kind`` ("TPU v4", "NVIDIA H100 80GB HBM3"), or None."""
    kind = device_kind.lower()
    for needle, name in _KINDS:
        if needle in kind:
            return systems.SYSTEMS[name]
    return None


class Clock:
    """Seconds per part of a run, from ``start`` (``time.perf_counter()`` when the run began)."""

    def __init__(self, start: float):
        self.start = start
        self.seconds = dict.fromkeys(PARTS, 0.0)

    @contextlib.contextmanager
    def part(self, name: str):
        began = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - began

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds

    def waiting(self, iterable):
        """``iterable``'s items, the time spent waiting for each counted as input wait."""
        it = iter(iterable)
        while True:
            with self.part("input_wait"):
                try:
                    item = next(it)
                except StopIteration:
                    return
            yield item

    def loop_ended(self, loop_s: float) -> None:
        """The training loop took ``loop_s``: its training steps are what its other parts leave."""
        s = self.seconds
        s["training"] = max(loop_s - (s["compilation"] + s["input_wait"] + s["evaluation"] + s["checkpointing"]), 0.0)

    def summary(self, redone: int, steps: int, step_s: float | None, mfu: dict) -> dict[str, Any]:
        """The goodput record: ``redone`` steps redone after a resume, ``steps`` steps timed at
        ``step_s`` seconds each on average (after :meth:`loop_ended`)."""
        s = self.seconds
        training = s["training"]
        lost = min(redone * (step_s or 0.0), training)
        s["training"], s["lost_to_interruptions"] = training - lost, lost
        wall = time.perf_counter() - self.start
        s["other"] = max(wall - sum(v for k, v in s.items() if k != "other"), 0.0)
        return {
            "wall_s": wall,
            "seconds": dict(s),
            "goodput": s["training"] / wall if wall > 0 else None,
            "redone_steps": redone,
            "timed_steps": steps,
            "step_s": step_s,
            **mfu,
        }


def redone_steps(metrics_path: str | None, start: int) -> int:
    """Steps an earlier segment of this run logged past ``start`` (the checkpoint a resumed run
    continues from): the run trains them again."""
    if not metrics_path or not os.path.exists(metrics_path):
        return 0
    last = start
    with open(metrics_path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:  # a line cut short by a kill
                continue
            if isinstance(record, dict) and "examples" in record and isinstance(record.get("step"), int):
                last = max(last, record["step"])
    return last - start


def mfu(step_flops: float | None, step_s: float | None, device_kind: str) -> dict[str, Any]:
    """MFU of a step of ``step_flops`` FLOPs per device taking ``step_s`` seconds on ``device_kind``."""
    system = system_of(device_kind)
    if system is None:
        return {
            "flops_per_step": step_flops,
            "mfu": None,
            "peak_flops": None,
            "mfu_note": f"no peak FLOP/s is known for device kind {device_kind!r} (podscale/compiled/systems.py): no MFU",
        }
    peak = system.device_peak("bf16")
    value = step_flops / (step_s * peak) if step_flops and step_s else None
    return {
        "flops_per_step": step_flops,
        "mfu": value,
        "peak_flops": peak,
        "mfu_note": f"of {system.name}'s dense bf16 peak, {peak:.3g} FLOP/s per device",
    }


def lines(record: dict[str, Any]) -> list[str]:
    """What a run prints at its end: the parts of its wall time, goodput, MFU."""
    wall = record["wall_s"]
    parts = ", ".join(
        f"{LABELS[k]} {v:.2f} s ({100 * v / wall:.0f}%)" if wall > 0 else f"{LABELS[k]} {v:.2f} s"
        for k, v in record["seconds"].items()
    )
    out = [f"wall time {wall:.2f} s: {parts}"]
    redone = f", {record['redone_steps']} steps redone after the resume" if record["redone_steps"] else ""
    out.append(f"goodput {100 * (record['goodput'] or 0):.1f}% (training steps over wall time{redone})")
    if record["mfu"] is not None:
        out.append(
            f"MFU {100 * record['mfu']:.1f}%: {record['flops_per_step']:.3g} FLOPs per device per step, "
            f"{record['step_s'] * 1e3:.1f} ms per step, {record['mfu_note']}"
        )
    else:
        out.append(f"MFU: {record['mfu_note']}")
    return out


def shapes_of(batch):
    """A placed batch's shapes and shardings (what :func:`step_flops` compiles for), holding no data."""
    import jax

    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), batch)


def step_flops(dp, batch_shapes) -> float:
    """FLOPs per device of one step of ``dp`` for a batch of ``batch_shapes``, read from the compiled
    module (one more compile of the step, which JAX's compilation cache may serve)."""
    from podscale.compiled import hlo

    return hlo.read(dp.lower(dp.placement.stored_shapes(), batch_shapes).compile(), dp.mesh).flops()
