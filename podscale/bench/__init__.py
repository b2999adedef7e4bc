"""Benchmarks: each measures on this machine and prints the command that reproduces it.

``podscale bench WHICH`` takes the flags of :data:`FLAGS`; :func:`check_flags` checks them all
for the chosen benchmark before any work (a flag another benchmark takes is refused, naming the
ones that take it), so that a bad value fails in a second, not after minutes of compiling.
"""

from __future__ import annotations

import math
import os
import re

BENCHMARKS = ("wus", "gradsum", "spatial", "tp", "checkpoint", "embedding")
FLAGS = {
    "model": ("wus", "checkpoint"),
    "config": ("checkpoint",),
    "sizes": ("gradsum",),
    "width": ("wus", "tp"),
    "depth": ("wus", "tp"),
    "vocab": ("wus", "tp"),
}
"""The flags (``argparse`` names) that only some benchmarks take; ``--steps``, ``--replicas`` and
``--json`` apply to every one."""
EMBEDDING_BATCH = 512
"""``bench embedding``'s global batch (``bench_embedding``'s ``batch``), which the replicas divide."""
DEFAULT_SIZES = (1.0, 16.0, 128.0)
"""``bench gradsum``'s gradient sizes, MiB per device."""
WUS_HEADS = 8
"""The attention heads of ``bench wus``'s decoder: its width must be a multiple."""
TP_HEADS, TP_WAYS = 8, (1, 2, 4)
"""``bench tp``'s attention heads and the ways it splits the weights."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def size_problem(mib: float) -> str | None:
    """Why ``mib`` MiB per device is no gradient size for ``bench gradsum``, or ``None``."""
    if not (math.isfinite(mib) and mib > 0):
        return f"every size must be a finite number of MiB above 0, got {mib:g}"
    if mib * 2**20 < 4:
        return f"{mib:g} MiB is less than one float32 per device; give at least 4 bytes = {4 / 2**20:.2g} MiB"
    need = mib * 2**20 * GRADSUM_DEVICES * GRADSUM_COPIES
    memory = _host_memory()
    if memory and need > memory:
        return (
            f"{mib:g} MiB per device needs about {need / 2**30:.1f} GiB on this host ({GRADSUM_DEVICES} devices x "
            f"{GRADSUM_COPIES} buffers: gradients, their sum, reference and result), which has {memory / 2**30:.1f} GiB; "
            f"give at most {memory / (2**20 * GRADSUM_DEVICES * GRADSUM_COPIES):.0f} MiB"
        )
    return None


GRADSUM_DEVICES = 8
"""``bench gradsum`` runs on 8 CPU devices of this host."""
GRADSUM_COPIES = 4


def _host_memory() -> int | None:
    """This host's physical memory in bytes, where the OS says (``None`` elsewhere)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_sizes(sizes_mib) -> list[float]:
    """``bench_gradsum``'s ``sizes_mib``: numbers of MiB per device, each at least one float32."""
    from podscale.parallel import checks

    if isinstance(sizes_mib, str) or not isinstance(sizes_mib, tuple | list) or not sizes_mib:
        raise TypeError(
            f"sizes_mib={sizes_mib!r}: give a non-empty tuple of sizes in MiB per device, e.g. (1, 16, 128)"
        )
    out = []
    for mib in sizes_mib:
        mib = checks.positive_number("sizes_mib", mib, " (MiB per device)")
        problem = size_problem(mib)
        if problem:
            raise ValueError(f"sizes_mib={tuple(sizes_mib)!r}: {problem}")
        out.append(mib)
    return out


def tp_problem(width: int, heads: int, vocab: int, ways: int) -> str | None:
    """Why ``bench tp``'s Transformer cannot split ``ways`` ways, or ``None``."""
    if width % heads:
        return f"width={width} must be a multiple of the {heads} heads"
    if heads % ways or vocab % ways or (4 * width) % ways:
        return (
            f"width={width} and vocab={vocab} must split {ways} ways: the {heads} heads, the vocabulary and the "
            f"MLP's {4 * width} units divisible by {ways}"
        )
    return None


def check_flags(which: str, flags: dict) -> dict:
    """Checks ``podscale bench WHICH``'s flags (``flags``: the parsed ``argparse`` values, ``None``
    where not given) and returns the keyword arguments of the benchmark's function; refuses
    with a ``ValueError`` naming the flag."""
    if which not in BENCHMARKS:
        raise ValueError(f"bench {which!r}: choose one of {', '.join(BENCHMARKS)}")
    for name, takers in FLAGS.items():
        if flags.get(name) is not None and which not in takers:
            own = [_flag(f) for f, t in FLAGS.items() if which in t]
            raise ValueError(
                f"{_flag(name)} is for bench {' and '.join(takers)}; bench {which} does not take it (its own flags: "
                f"{', '.join([*own, '--steps']) if own else '--steps'}); drop it"
            )
    for name in ("steps", "width", "depth", "vocab"):
        value = flags.get(name)
        if value is not None and value < 1:
            raise ValueError(f"{_flag(name)} must be a whole number of at least 1, got {value}")
    steps = flags.get("steps", 4)
    if which == "gradsum":
        text = flags.get("sizes")
        if text is None:
            return {"sizes_mib": list(DEFAULT_SIZES), "repeats": steps}
        try:
            sizes = [float(s) for s in text.split(",")]
        except ValueError:
            raise ValueError(f"--sizes {text!r}: write MiB per device as numbers, e.g. 1,16,128") from None
        for size in sizes:
            problem = size_problem(size)
            if problem:
                raise ValueError(f"--sizes {text!r}: {problem}")
        return {"sizes_mib": sizes, "repeats": steps}
    if which == "embedding":
        replicas = flags.get("replicas")
        if replicas is not None and replicas >= 1 and EMBEDDING_BATCH % replicas:
            fits = ", ".join(str(2**k) for k in range(4) if EMBEDDING_BATCH % 2**k == 0)
            raise ValueError(
                f"--replicas {replicas}: bench embedding splits its global batch of {EMBEDDING_BATCH} ids over the "
                f"replicas, and {replicas} does not divide it; give --replicas that does ({fits}, ...)"
            )
    if which in ("spatial", "embedding"):
        return {"steps": steps}
    if which == "checkpoint":
        from podscale import workloads

        model, config = flags.get("model") or "transformer-big", flags.get("config") or "full"
        if model not in workloads.NAMES:
            raise ValueError(
                f"--model {model!r}: bench checkpoint takes an MLPerf workload: {', '.join(workloads.NAMES)}"
            )
        if config not in ("full", "tiny"):
            raise ValueError(f"--config {config!r}: choose full or tiny")
        return {"steps": steps, "model": model, "config": config, "replicas": flags.get("replicas")}
    sizes = {name: flags[name] for name in ("width", "depth", "vocab") if flags.get(name) is not None}
    if which == "tp":
        problem = tp_problem(sizes.get("width", 256), TP_HEADS, sizes.get("vocab", 512), max(TP_WAYS))
        if problem:
            raise ValueError(f"bench tp: {_as_flags(problem)}")
        return {"steps": steps, **sizes}
    model = flags.get("model")
    if model is not None:
        from podscale import workloads

        if model not in workloads.NAMES:
            raise ValueError(f"--model {model!r}: bench wus takes an MLPerf workload: {', '.join(workloads.NAMES)}")
        if sizes:
            given = " and ".join(_flag(n) for n in sizes)
            raise ValueError(
                f"{given} {'sets' if len(sizes) == 1 else 'set'} the size of bench wus's own decoder; with --model "
                f"{model} the workload's tiny config sets it: drop {given} or --model"
            )
        return {"steps": steps, "model": model}
    width = sizes.get("width", 512)
    if width % WUS_HEADS:
        raise ValueError(f"--width {width} must be a multiple of the decoder's {WUS_HEADS} attention heads")
    return {"steps": steps, "width": width, "depth": sizes.get("depth", 8), "vocab": sizes.get("vocab", 8192)}


def _as_flags(message: str) -> str:
    """``width=100`` (a benchmark's parameter) as ``--width 100`` (its flag)."""
    return re.sub(r"\b(width|vocab|depth|steps)=(\S+?)(?=[\s,;:]|$)", lambda m: f"--{m[1]} {m[2]}", message)
