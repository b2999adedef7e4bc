"""Costing one compiled step on a system (:mod:`podscale.compiled.systems`), as
:func:`podscale.projection.project.project` does for each chip count and strategy:

* **compute**: each op of the compiled module (:mod:`podscale.compiled.hlo`, loop bodies times their
  trip counts) by the chip's structure (:func:`op_terms`): a fixed cost per kernel plus the
  slowest of its matrix products at the matrix unit's padded tiles, its elementwise and
  transcendental work at the vector units' rates, and its bytes at the bandwidth reached for
  their size. Ops in podscale's update scope are the *update*; the rest, forward and backward.
* **communication**: each collective by :mod:`podscale.compiled.network` on the groups it runs over,
  times its runs per step.
* **overlap** (only where the schedule allows it, and only on systems with asynchronous
  collectives): podscale sends a gradient buffer as soon as the backward pass has filled it, so
  the gradient sums (the update scope's reduce-scatters and all-reduces) but the last can run
  while the backward pass continues: up to the backward pass's compute time of them is hidden.
  The last sum, the sharded update's weight gather (the next forward pass needs it), the norms'
  all-reduces and the model's own collectives (batch-norm statistics, halo exchanges, tensor
  partitioning's all-reduces: the next op waits for each) are exposed.

``step = compute + update + exposed communication``; examples/s is the global batch over it; MFU is
the forward and backward matmul FLOPs per device over the step time at the chip's bf16 peak; memory
per chip is the compiled module's peak per device times the chip's devices, against its HBM.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from podscale.compiled import hlo, hlo_cost
from podscale.compiled.systems import System


def _groups(shape: dict[str, int], axes: tuple[str, ...], size: int) -> list[list[int]]:
    """The device groups (positions in the mesh) of a collective over ``axes``."""
    names = list(shape)
    ids = np.arange(math.prod(shape.values())).reshape(tuple(shape.values()))
    if not axes:  # groups that follow no mesh axes: take consecutive devices
        return ids.reshape(-1, size).tolist()
    order = [names.index(a) for a in names if a not in axes] + [names.index(a) for a in axes]
    return ids.transpose(order).reshape(-1, math.prod(shape[a] for a in axes)).tolist()


TERMS = ("mxu", "vector", "memory", "fixed")
"""What one op's time is charged to: the matrix units, the vector units, HBM, or the fixed cost of
starting a kernel (with ``communication``, what each row's ``terms`` splits its step into)."""


def _round_up(n: int, tile: int) -> int:
    return -(-n // tile) * tile


def padded_matmul_flops(op: hlo_cost.Op, tile: tuple[int, int, int]) -> float:
    """``op.matmul_flops`` with each matrix product's dimensions rounded up to the matrix unit's
    ``tile`` (m, n, k): a product ``[m, k] @ [k, n]`` runs as ``[ceil(m), ceil(k)] @ [ceil(k),
    ceil(n)]``. A convolution is the product of its output positions by its output features,
    contracting its input features times its window taps (:attr:`~podscale.compiled.hlo_cost.Op.matmuls`):
    XLA:TPU folds a few-feature convolution's taps into the contraction, so its output features
    are what the tiles pad (a 64-feature convolution is charged as 128 on a 128-wide MXU). An op
    without shapes is charged as it is."""
    if not op.matmul_flops or not op.matmuls or tile == (1, 1, 1):
        return op.matmul_flops
    real = padded = 0.0
    tm, tn, tk = tile
    for batch, m, n, k in op.matmuls:
        real += batch * m * n * k
        padded += batch * _round_up(m, tm) * _round_up(n, tn) * _round_up(k, tk)
    return op.matmul_flops * padded / real if real else op.matmul_flops


def op_terms(system: System, op: hlo_cost.Op) -> dict[str, float]:
    """Seconds of one run of ``op`` on one device, per term (:data:`TERMS`); the op takes
    ``fixed + max(mxu, vector, memory)``:

    * ``mxu``: its matrix products at the tiles' padded size (:func:`padded_matmul_flops`) over the
      peak of their operand dtype; or, where that is slower (shapes that leave the matrix unit
      idle), their FLOPs at the vector units' rate;
    * ``vector``: its elementwise work and reductions at the vector units' rate, its
      transcendentals at the transcendental unit's (``System.vector_rate``,
      ``transcendental_rate``; 0: not charged);
    * ``memory``: its bytes at the HBM bandwidth reached for its size (``hbm_efficiency``,
      ``half_bandwidth_bytes``);
    * ``fixed``: the kernel's start (``kernel_overhead``).

    The converts XLA:CPU adds around bf16 products (``op.upcast``) cost nothing: accelerators have
    none. An op of a TPU core's scalar unit (``op.scalar``) is no kernel: it costs
    ``scalar_op_cycles`` of the core's clock, counted as vector work."""
    if op.upcast:
        return dict.fromkeys(TERMS, 0.0)
    if op.scalar and system.scalar_op_cycles and system.clock:
        return {**dict.fromkeys(TERMS, 0.0), "vector": system.scalar_op_cycles / system.clock}
    mxu = 0.0
    if op.matmul_flops:
        mxu = padded_matmul_flops(op, system.matmul_tile) / system.device_peak(op.matmul_dtype)
        if system.vector_rate:
            mxu = min(mxu, op.matmul_flops / system.device_rate("vector_rate"))
    vector = 0.0
    if system.vector_rate:
        transcendental = min(op.transcendentals, op.flops - op.matmul_flops)
        elementwise = max(0.0, op.flops - op.matmul_flops - transcendental)
        rate = system.device_rate("transcendental_rate") or system.device_rate("vector_rate")
        vector = elementwise / system.device_rate("vector_rate") + transcendental / rate
    bandwidth = system.device_hbm_bandwidth * system.hbm_efficiency
    if system.half_bandwidth_bytes and op.bytes:
        bandwidth *= op.bytes / (op.bytes + system.half_bandwidth_bytes)
    memory = op.bytes / bandwidth if op.bytes else 0.0
    return {"mxu": mxu, "vector": vector, "memory": memory, "fixed": system.kernel_overhead}


def op_time(system: System, op: hlo_cost.Op) -> float:
    """Seconds for one run of ``op`` on one device (:func:`op_terms`)."""
    t = op_terms(system, op)
    return t["fixed"] + max(t["mxu"], t["vector"], t["memory"])


def terms(system: System, module: hlo.Module, phases: Sequence[str] = ("forward", "backward", "update")) -> dict:
    """Seconds per step of the ops of ``phases``, by the term each op is bound by (:data:`TERMS`):
    an op's time less its fixed cost counts to its largest term."""
    out = dict.fromkeys(TERMS, 0.0)
    for op in module.ops:
        if op.phase not in phases:
            continue
        t = op_terms(system, op)
        bound = max(("mxu", "vector", "memory"), key=lambda k: t[k])
        out[bound] += t[bound] * op.count
        out["fixed"] += t["fixed"] * op.count
    return out


def cost(
    system: System,
    topology,
    module: hlo.Module,
    shape: dict[str, int],
    op_cost: Callable | None = None,
    reduced: str | None = None,
    factor: int = 1,
    scheduled: bool = False,
):
    """(phase seconds, collective rows, exposed, hidden) of one compiled step on ``system``.

    ``shape`` is the target mesh. When the module was compiled on a mesh whose axis ``reduced`` is
    ``factor`` times smaller (past this machine's CPU devices), the update scope's collective
    buffers are scaled to the target: each shrinks ``factor`` times except a sum over the reduced
    axis (the 2-D sum's first phase, the 1-D sum: their input is the whole gradient); so does a
    stored chunk's gather for its use over the reduced axis (FSDP's: its buffer is the chunk). The update's
    ops are scaled by :func:`podscale.projection.project.project` (from two compiled sizes).

    ``scheduled``: overlap is read from the module's schedule (:func:`timeline`; XLA:TPU's
    module), not by the rule for XLA:CPU's module (gradient sums but the last behind the backward
    pass)."""
    op_cost = op_cost or (lambda op: op_time(system, op))
    phases = {p: 0.0 for p in hlo.PHASES}
    for op in module.ops:
        phases[op.phase] += op_cost(op) * op.count
    rows: dict[tuple, dict[str, Any]] = {}
    sums: list[float] = []  # the gradient sums, in program order
    exposed = 0.0
    seconds: list[float] = []  # each collective's time per run, in the module's order
    for c in module.collectives:
        update = hlo.UPDATE_SCOPE in c.op_name
        size, nbytes = c.group_size, c.buffer_bytes
        if reduced in c.axes:
            size = math.prod(shape[a] for a in c.axes)
        chunk = hlo.CHUNK_GATHER_SCOPE in c.op_name and reduced in c.axes  # FSDP's gather of a smaller chunk there
        if factor > 1 and (update or chunk) and not (reduced in c.axes and c.kind in ("reduce-scatter", "all-reduce")):
            nbytes = nbytes / factor
        if c.axes == (hlo.DCN,):  # a collective's part across slices (XLA:TPU's multislice module)
            size = topology.slices
            groups = [[i * topology.slice_devices for i in range(topology.slices)]]
        elif c.kind == "collective-permute":  # neighbours along its axes (the space axis: innermost)
            groups = _groups(shape, c.axes, math.prod(shape[a] for a in c.axes)) if c.axes else [[0, 1]]
        else:
            groups = _groups(shape, c.axes, size)
        t, path = topology.time(c.kind, groups, nbytes)
        row = rows.setdefault(
            (c.kind, c.axes, update),
            {
                "kind": c.kind,
                "axes": list(c.axes),
                "group_size": size,
                "role": "update" if update else "model",
                "runs": 0,
                "buffer_bytes": 0,
                "seconds": 0.0,
                "path": path.where,
            },
        )
        row["runs"] += c.count
        row["buffer_bytes"] += nbytes * c.count
        row["seconds"] += t * c.count
        seconds.append(t)
        if f"{hlo.UPDATE_SCOPE}/{hlo.GRAD_SUM_SCOPE}" in c.op_name and size > 1:
            sums += [t] * c.count
        else:
            exposed += t * c.count
    if scheduled:
        exposed = timeline(module, [op_cost(op) for op in module.ops], seconds)
        hidden = sum(t * c.count for t, c in zip(seconds, module.collectives, strict=True)) - exposed
        return phases, list(rows.values()), exposed, max(0.0, hidden)
    hideable = sum(sums[:-1]) if system.overlaps else 0.0
    hidden = min(hideable, phases["backward"])
    exposed += sum(sums) - hidden
    return phases, list(rows.values()), exposed, hidden


def timeline(module: hlo.Module, op_seconds: Sequence[float], collective_seconds: Sequence[float]) -> float:
    """Seconds of communication one step waits for, read from the compiled schedule
    (:attr:`podscale.compiled.hlo.Module.schedule`): ops run one after another; collectives run one at
    a time on the links, each starting when it is issued and the one before it is done; a
    synchronous collective stops the ops until it is done; an asynchronous one (``start`` ...
    ``done``) runs while the ops between its start and its done run, and only the rest of it is
    waited for at its done. A loop body is simulated once and counted times its trip count."""
    memo: dict[str, tuple[float, float]] = {}

    def run(comp: str, depth: int = 0) -> tuple[float, float]:
        if comp in memo:
            return memo[comp]
        if depth > 64:
            raise ValueError(f"computation nesting deeper than 64 at {comp}")
        t = link = waited = 0.0
        ends: dict[int, float] = {}
        for event in module.schedule.get(comp, ()):
            what = event[0]
            if what == "op":
                t += op_seconds[event[1]]
            elif what == "sync":
                end = max(t, link) + sum(collective_seconds[i] for i in event[1])
                waited += end - t
                t = link = end
            elif what == "start":
                link = ends[event[1]] = max(t, link) + sum(collective_seconds[i] for i in event[1])
            elif what == "done":
                end = ends.pop(event[1], t)
                if end > t:
                    waited, t = waited + end - t, end
            else:  # a loop body or a called computation, ``trips`` times
                d, w = run(event[1], depth + 1)
                t, waited = t + d * event[2], waited + w * event[2]
        for end in ends.values():  # still in flight at the end
            if end > t:
                waited, t = waited + end - t, end
        memo[comp] = (t, waited)
        return memo[comp]

    return run(module.entry)[1]


def update_seconds(system: System, module: hlo.Module) -> float:
    """The update phase's op seconds of one compiled step."""
    return sum(op_time(system, op) * op.count for op in module.ops if op.phase == "update")


def scale_update(points: Sequence[tuple[int, float]], own: tuple[int, float], devices: int) -> float:
    """The sharded update's op seconds on ``devices`` devices, from ``own`` (devices, seconds) of
    the module costed and ``points`` compiled at other device counts: the update costs ``a + b / n``
    on ``n`` devices (whole small leaves; shards), ``b`` by least squares over the points (two or
    more device counts), ``a`` from ``own``."""
    xs = np.array([1.0 / n for n, _ in points])
    ys = np.array([u for _, u in points])
    if len(set(xs.tolist())) < 2:
        return own[1]
    b = max(0.0, float(np.polyfit(xs, ys, 1)[0]))
    return max(0.0, own[1] - b / own[0]) + b / devices
