"""Projecting the user's own compiled step to a pod: ``podscale project``.

For each chip count and strategy the step is compiled here, on CPU devices, for the target's own
device count and mesh (so the collectives, their groups and bytes, the sharded update's shard
sizes and the memory per device are the ones XLA produces for that pod), then costed on the system
(:mod:`podscale.perf.systems`):

* **compute**: each op of the compiled module (:mod:`podscale.perf.hlo`, loop bodies times their
  trip counts) by a roofline, ``max(matmul FLOPs / peak, bytes / HBM bandwidth)`` with the peak of
  the matmul's operand dtype; elementwise FLOPs are taken as bound by their bytes. Ops in
  podscale's update scope are the *update*; the rest, forward and backward.
* **communication**: each collective by :mod:`podscale.perf.network` on the groups it runs over,
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

import concurrent.futures
import contextlib
import dataclasses
import functools
import math
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from podscale.parallel import checks
from podscale.parallel.mesh import MAX_CPU_DEVICES  # JAX's CPU client's limit, also setup's
from podscale.parallel.strategy import Strategy
from podscale.perf import hlo
from podscale.perf.network import Topology
from podscale.perf.systems import System
from podscale.report import elapsed, heartbeat

DEFAULT_STRATEGIES = ("replicated", "sharded", "sharded-2d")
STRATEGIES = {
    "replicated": {"weight_update": "replicated", "grad_sum": "1d"},
    "sharded": {"weight_update": "sharded", "grad_sum": "1d"},
    "replicated-2d": {"weight_update": "replicated", "grad_sum": "2d"},
    "sharded-2d": {"weight_update": "sharded", "grad_sum": "2d"},
}


@dataclasses.dataclass(frozen=True)
class Row:
    """One chip count and strategy, projected; or, with ``not_applicable`` set, a strategy that
    does not apply at that chip count (its mesh cannot be made there): the reason, and the
    figures ``None``."""

    chips: int
    strategy: str
    devices: int
    topology: str
    mesh: dict[str, int] = dataclasses.field(default_factory=dict)
    global_batch: int | None = None
    replica_batch: int | None = None
    compute_s: float | None = None
    update_s: float | None = None
    communication_s: float | None = None
    """Every collective's time, hidden or not."""
    exposed_s: float | None = None
    hidden_s: float | None = None
    step_s: float | None = None
    examples_per_s: float | None = None
    mfu: float | None = None
    memory_per_chip: float | None = None
    hbm_per_chip: float | None = None
    fits: bool | None = None
    collectives: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Per (kind, axes, update or model): runs, buffer bytes, seconds per step, the path."""
    flops_per_device: float | None = None
    compiled_mesh: dict[str, int] = dataclasses.field(default_factory=dict)
    """The mesh the step was compiled on: the target's, or (past this machine's CPU devices) one
    with a smaller first axis, scaled as :func:`cost` says."""
    compiler: str = ""
    """Which compiler made the module costed: ``XLA:TPU v3:4x4`` (the slice compiled for) or ``XLA:CPU``."""
    compile_s: float | None = None
    """Seconds the compile of :attr:`compiled_mesh` took (``None``: reused from another row)."""
    does_not_fit: str | None = None
    """The TPU compiler's refusal when the program does not fit the chip's memory (the row's
    figures are then ``None`` but for memory)."""
    fastest: bool = False
    not_applicable: str | None = None
    """Why this strategy does not apply at this chip count (``None``: it does, the row is projected)."""

    @property
    def applicable(self) -> bool:
        return self.not_applicable is None

    @property
    def costed(self) -> bool:
        """Whether the row has a step time (it applies, and its program fits the chip)."""
        return self.applicable and self.does_not_fit is None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def strategy_for(base: Strategy, name: str) -> Strategy:
    """``base`` (spatial or tensor partitioning, the other fields) with the weight update and the
    gradient sum of ``STRATEGIES[name]``; the 2-D sum's own knobs (``grad_sum_chunks``,
    ``axis_costs``) apply to the 2-D strategies only."""
    fields = dict(STRATEGIES[name])
    if fields["grad_sum"] != "2d":
        fields.update(grad_sum_chunks=None, axis_costs=None)
    return dataclasses.replace(base, **fields)


def _names(strategies, what: str) -> list[str]:
    return checks.some_of(what, strategies, tuple(STRATEGIES), "strategy")


def applicability(
    system: System | str,
    chips: Sequence[int],
    strategies: Sequence[str] | dict[str, Strategy] | None = None,
    base: Strategy | None = None,
    multi_axis: str = "torus",
    what: str = "strategies",
) -> dict[tuple[int, str], str | None]:
    """Checks a projection's request before anything is compiled, and says which strategies apply
    at which chip counts: ``{(chips, name): None, or why the strategy does not apply there}`` (its
    mesh cannot be made on that slice, or not compiled on this machine's CPU devices).

    Raises ``ValueError`` for an unknown system, a chip count the system cannot hold, an empty,
    unknown or repeated strategy, when nothing applies at all, and when a strategy given
    explicitly (``strategies`` not ``None``) applies at none of the chip counts; ``what`` names
    the strategies in the messages (the CLI's ``--strategies``). ``None`` means
    :data:`DEFAULT_STRATEGIES`, where a strategy that applies nowhere is a row saying why."""
    from podscale.perf import systems

    system = systems.get(system) if isinstance(system, str) else system
    base = base or Strategy()
    explicit = strategies is not None
    if isinstance(strategies, dict):
        resolved = dict(strategies)
        if not resolved:
            raise ValueError(f"{what}: no strategy given; choose from {', '.join(STRATEGIES)}")
    else:
        resolved = {
            s: strategy_for(base, s) for s in _names(DEFAULT_STRATEGIES if strategies is None else strategies, what)
        }
    chips = list(chips)
    if not chips:
        raise ValueError("chips: give at least one chip count")
    bad = [c for c in chips if isinstance(c, bool) or not isinstance(c, int | np.integer) or c < 1]
    if bad:
        raise ValueError(f"chips {bad}: chip counts are whole numbers of at least 1")
    twice = sorted({c for c in chips if chips.count(c) > 1})
    if twice:
        raise ValueError(f"chips: {', '.join(map(str, twice))} given twice; give each chip count once")
    reasons: dict[tuple[int, str], str | None] = {}
    for n_chips in chips:
        topology = Topology(system, n_chips, multi_axis)  # a size the system cannot hold: refused
        for name, strategy in resolved.items():
            try:
                target = target_shape(topology, strategy)
                compile_shape(target, MAX_CPU_DEVICES)
                reasons[n_chips, name] = None
            except ValueError as e:
                reasons[n_chips, name] = str(e)
    if all(r is not None for r in reasons.values()):
        why = "; ".join(f"{c} chips, {s}: {r}" for (c, s), r in reasons.items())
        raise ValueError(
            f"{what if explicit else 'the strategies'} {','.join(resolved)}: none applies at chips {','.join(map(str, chips))} ({why}); project other "
            "chip counts or strategies"
        )
    if explicit:
        for name in resolved:
            mine = {c: reasons[c, name] for c in chips}
            if all(r is not None for r in mine.values()):
                why = "; ".join(f"{c} chips: {r}" for c, r in mine.items())
                fits = [s for s in resolved if any(reasons[c, s] is None for c in chips)]
                raise ValueError(
                    f"{what} {name}: applies at none of the chip counts {','.join(map(str, chips))} ({why}); drop it "
                    f"(these apply: {', '.join(fits)}) or project other chip counts"
                )
    return reasons


def target_shape(topology: Topology, strategy: Strategy) -> dict[str, int]:
    """The mesh (axis -> size) a strategy runs on ``topology``'s devices: the space or model axis
    (``k``) last and innermost (a replica's devices are neighbours); with the 2-D sum, the data
    axes are the rest of the first torus dimension's devices (GPU: of a node) and the others."""
    s = topology.system
    k = strategy.spatial or strategy.model_parallel or 1
    n = topology.devices
    if n % k:
        raise ValueError(
            f"{topology.describe()}: its {n} devices do not divide into replicas of {k} devices (spatial or tensor "
            "partitions)"
        )
    replicas = n // k
    if strategy.grad_sum == "2d":
        inner = topology.shape[0] * s.devices_per_chip if s.kind == "tpu" else min(n, s.node_size)
        if inner % k or inner // k < 2 or replicas // (inner // k) < 2:
            raise ValueError(
                f"the 2-D gradient sum on {topology.describe()} with replicas of {k} device(s): needs two data axes "
                f"of at least 2 (the first dimension's {inner} devices / {k}, and the rest)"
            )
        shape: tuple[int, ...] = (replicas // (inner // k), inner // k)
    else:
        shape = (replicas,)
    if k > 1:
        shape = (*shape, k)
    names = {1: ("data",), 2: ("x", "y"), 3: ("x", "y", "z")}[len(shape)]
    return dict(zip(names, shape, strict=True))


def compile_shape(target: dict[str, int], available: int) -> tuple[dict[str, int], str | None, int]:
    """The mesh to compile on: the target, or, past ``available`` devices, the target with its
    first (outermost data) axis halved until it fits. Returns (mesh, reduced axis or None, factor
    by which the reduced axis is smaller)."""
    shape = dict(target)
    first = next(iter(shape))
    factor = 1
    while math.prod(shape.values()) > available:
        if shape[first] % 2 or shape[first] < 4:
            raise ValueError(
                f"mesh {target}: too large to compile on {available} CPU devices, and its axis {first!r} cannot "
                "be halved to fit; project fewer chips"
            )
        shape[first] //= 2
        factor *= 2
    return shape, (first if factor > 1 else None), factor


def make_mesh(shape: dict[str, int], devices: Sequence | None = None) -> Mesh:
    available = list(devices if devices is not None else jax.devices("cpu"))
    n = math.prod(shape.values())
    if len(available) < n:
        raise ValueError(
            f"compiling for mesh {shape} needs {n} CPU devices, but this process has {len(available)}: start "
            f"Python with jax.config.update('jax_num_cpu_devices', {min(n, MAX_CPU_DEVICES)}) before using JAX "
            "(podscale project does)"
        )
    grid = np.array(available[:n], dtype=object).reshape(tuple(shape.values()))
    return Mesh(grid, tuple(shape), axis_types=(AxisType.Auto,) * len(shape))


def _groups(shape: dict[str, int], axes: tuple[str, ...], size: int) -> list[list[int]]:
    """The device groups (positions in the mesh) of a collective over ``axes``."""
    names = list(shape)
    ids = np.arange(math.prod(shape.values())).reshape(tuple(shape.values()))
    if not axes:  # groups that follow no mesh axes: take consecutive devices
        return ids.reshape(-1, size).tolist()
    order = [names.index(a) for a in names if a not in axes] + [names.index(a) for a in axes]
    return ids.transpose(order).reshape(-1, math.prod(shape[a] for a in axes)).tolist()


@contextlib.contextmanager
def accelerator_lowerings():
    """Lowers as for TPU and GPU while compiling here: JAX lowers its threefry random bits (dropout)
    on CPU as a rolled loop, whose every round writes the whole state to memory, and on
    accelerators unrolled into one fusion. Without this, a step with dropout would be costed with
    the CPU's loop (a third of transformer-big's bytes). Uses JAX's lowering registry (private)."""
    from podscale._jax import mlir
    from podscale._jax import threefry2x32 as threefry

    rules = mlir._platform_specific_lowerings["cpu"]
    old = rules.get(threefry.threefry2x32_p)
    mlir.register_lowering(threefry.threefry2x32_p, threefry._threefry2x32_lowering_rule, platform="cpu")
    try:
        yield
    finally:
        if old is None:
            rules.pop(threefry.threefry2x32_p, None)
        else:
            rules[threefry.threefry2x32_p] = old


def op_time(system: System, op: hlo.Op) -> float:
    """Seconds for one run of ``op`` on one device (the roofline; see the module docstring). The
    converts XLA:CPU adds around bf16 products (``op.upcast``) cost nothing: accelerators have none."""
    if op.upcast:
        return 0.0
    compute = op.matmul_flops / system.device_peak(op.matmul_dtype) if op.matmul_flops else 0.0
    return max(compute, op.bytes / system.device_hbm_bandwidth)


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
    axis (the 2-D sum's first phase, the 1-D sum: their input is the whole gradient). The update's
    ops are scaled by :func:`project` (from two compiled sizes).

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
        if factor > 1 and update and not (reduced in c.axes and c.kind in ("reduce-scatter", "all-reduce")):
            nbytes = nbytes / factor
        if c.kind == "collective-permute":  # neighbours along its axes (the space axis: innermost)
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
    (:attr:`podscale.perf.hlo.Module.schedule`): ops run one after another; collectives run one at
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


def project(
    step,
    state,
    batch: Callable[[int], Any] | Any,
    *,
    system: System | str,
    chips: Sequence[int],
    strategies: Sequence[str] | dict[str, Strategy] | None = None,
    base: Strategy | None = None,
    replica_batch: int | Mapping[int, int] | None = None,
    multi_axis: str = "torus",
    progress: Callable[[str], None] | None = None,
    heartbeat_s: float = 10.0,
    compiler: str = "auto",
) -> list[Row]:
    """Projects ``step(state, batch)`` (the single-device step, as for ``podscale.data_parallel``)
    to each of ``chips`` chips of ``system``, for each strategy.

    ``batch``: a function from the global batch size to the batch (arrays or ``ShapeDtypeStruct``),
    or one replica's batch (its leading dimension is the replica's batch; the global batch is it
    times the replicas). ``replica_batch`` is the per-replica batch when ``batch`` is a function:
    one for every chip count, or ``{chips: batch}``.
    ``strategies``: names of ``STRATEGIES`` (applied over ``base``, which carries spatial or
    tensor partitioning and the other fields; default :data:`DEFAULT_STRATEGIES`) or
    ``{name: Strategy}``. A strategy that does not apply at a chip count is a row saying why
    (``Row.not_applicable``); what :func:`applicability` refuses is refused before anything is
    compiled. ``multi_axis``: how a collective over several torus dimensions is costed
    (:data:`podscale.perf.network.MULTI_AXIS`). ``progress`` gets a line as each compile starts
    and ends (with the time taken) and every ``heartbeat_s`` seconds while one runs.
    ``compiler``: ``tpu`` (XLA:TPU for the target slice, with libtpu's compile-only devices: a TPU
    system only), ``cpu`` (XLA:CPU on this machine's CPU devices, one compile per row), or
    ``auto``: ``tpu`` for a TPU system where libtpu is installed, else ``cpu`` (``progress`` is told
    why when a TPU system falls back).
    """
    from podscale.parallel.engine import data_parallel
    from podscale.perf import systems

    system = systems.get(system) if isinstance(system, str) else system
    base = base or Strategy()
    chips = list(chips)
    reasons = applicability(system, chips, strategies, base, multi_axis)
    if isinstance(strategies, dict):
        resolved = dict(strategies)
    else:
        resolved = {s: strategy_for(base, s) for s in (DEFAULT_STRATEGIES if strategies is None else strategies)}
    for name, strategy in {"base": base, **resolved}.items():
        named = [
            f"{f}={getattr(strategy, f)!r}" for f in ("space_axis", "model_axis", "data_axes") if getattr(strategy, f)
        ]
        if named:
            raise ValueError(
                f"project(): strategy {name!r} names mesh axes ({', '.join(named)}), and project builds each pod's "
                "mesh itself (the space or model axis last and innermost); give the counts instead: spatial=k or "
                "model_parallel=k"
            )
    if callable(batch):
        if replica_batch is None:
            raise ValueError("project(..., batch=FUNCTION): pass replica_batch, the batch of one replica")
        per_chips = dict(replica_batch) if isinstance(replica_batch, Mapping) else dict.fromkeys(chips, replica_batch)
        missing = [c for c in chips if c not in per_chips]
        if missing:
            raise ValueError(f"project(..., replica_batch): no batch for chips {missing}")
        bad = {
            c: b for c, b in per_chips.items() if isinstance(b, bool) or not isinstance(b, int | np.integer) or b < 1
        }
        if bad:
            raise ValueError(f"project(..., replica_batch={bad}): a replica's batch is a whole number of at least 1")
        make_batch = batch
    else:
        leaves = jax.tree.leaves(batch)
        if not leaves or not np.shape(leaves[0]) or not np.shape(leaves[0])[0]:
            raise ValueError("project(..., batch): one replica's batch, every leaf with a leading batch dimension")
        per_chips = dict.fromkeys(chips, int(np.shape(leaves[0])[0]))

        def make_batch(n, example=batch):
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct((n, *np.shape(x)[1:]), x.dtype), example)

    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), state)
    topologies = [Topology(system, n_chips, multi_axis) for n_chips in chips]
    say = progress or (lambda message: None)
    started = time.perf_counter()
    if use_tpu_compiler(system, compiler, say):
        job = _Job(data_parallel, step, shapes, make_batch, per_chips, system, say, progress, heartbeat_s, started)
        rows = _project_tpu(job, topologies, resolved, reasons)
        return mark_fastest(rows)
    cpus = len(jax.devices("cpu"))
    for topology in topologies:  # every mesh is checked before anything is compiled
        for name, strategy in resolved.items():
            if reasons[topology.chips, name] is not None:
                continue
            need = min(math.prod(target_shape(topology, strategy).values()), MAX_CPU_DEVICES)
            if cpus < need:
                raise ValueError(
                    f"projecting to {topology.describe()} compiles for {need} CPU devices, but this process has "
                    f"{cpus}: start Python with jax.config.update('jax_num_cpu_devices', {need}) before using JAX "
                    "(podscale project does)"
                )
    rows: list[Row] = []
    for topology in topologies:
        n_chips = topology.chips
        for name, strategy in resolved.items():
            what = f"{system.name} {n_chips} chips, {name}"
            reason = reasons[n_chips, name]
            if reason is not None:
                say(f"{what}: not applicable: {reason}")
                rows.append(_not_applicable(topology, name, strategy, per_chips[n_chips], reason))
                continue
            one = time.perf_counter()
            say(f"{what}: compiling for {topology.devices} devices ({elapsed(started)} since the start)")
            with heartbeat(progress, f"{what}: still compiling", heartbeat_s):
                row = _project_one(
                    data_parallel, step, shapes, make_batch, per_chips[n_chips], system, topology, name, strategy
                )
            row = dataclasses.replace(row, compile_s=time.perf_counter() - one)
            say(f"{what}: done in {elapsed(one)}, step {row.step_s * 1e3:.3f} ms ({elapsed(started)} since the start)")
            rows.append(row)
    return mark_fastest(rows)


COMPILERS = ("auto", "tpu", "cpu")
MAX_PARALLEL_COMPILES = 4
"""XLA:TPU compiles of one projection run side by side on at most this many threads (and no more
than the machine's cores): each compile is one program on one core."""
MAX_TPU_COMPILE_DEVICES = 256
"""XLA:TPU compiles a projection's program for about this many devices or fewer (the first data
axis halved while it stays even and at least 2, see :func:`shrink`; the sharded update's second
size doubles it): the per-replica program is the same on a larger slice, and the compile stays
within minutes."""


def use_tpu_compiler(system: System, compiler: str = "auto", say: Callable[[str], None] | None = None) -> bool:
    """Whether ``system`` is projected from XLA:TPU's module (see :func:`project`'s ``compiler``).
    Raises for ``tpu`` on a system that is not a TPU, or without libtpu."""
    from podscale.perf import tpu

    checks.one_of("compiler", compiler, COMPILERS)
    if compiler == "cpu":
        return False
    if system.kind != "tpu":
        if compiler == "tpu":
            raise ValueError(
                f"--compiler tpu: {system.name!r} is not a TPU system; its module is XLA:CPU's (--compiler cpu or auto)"
            )
        return False
    if not tpu.available():
        if compiler == "tpu":
            raise ValueError(f"--compiler tpu: {tpu.MISSING}")
        if say is not None:
            say(tpu.MISSING)
        return False
    return True


def _not_applicable(topology, name: str, strategy: Strategy, replica_batch: int, reason: str) -> Row:
    k = strategy.spatial or strategy.model_parallel or 1
    replicas = topology.devices // k if topology.devices % k == 0 else None
    return Row(
        chips=topology.chips,
        strategy=name,
        devices=topology.devices,
        topology=topology.describe(),
        global_batch=replica_batch * replicas if replicas else None,
        replica_batch=replica_batch,
        hbm_per_chip=float(topology.system.hbm_bytes),
        not_applicable=reason,
    )


def _compile(data_parallel, step, shapes, make_batch, replica_batch: int, k: int, strategy, shape, devices=None):
    """The step compiled for ``shape``: on this machine's CPU devices (with the accelerators'
    lowerings), or on ``devices`` (compile-only TPU devices: XLA:TPU)."""
    mesh = make_mesh(shape, devices)
    dp = data_parallel(step, mesh, strategy, donate_state=False)
    batch = make_batch(replica_batch * (mesh.size // k))
    with accelerator_lowerings() if devices is None else _no_persistent_cache():
        dp.prepare(shapes, batch)
        compiled = dp.lower(dp.layout.stored_shapes(), batch).compile()
    return dp, hlo.read(compiled, mesh)


def _no_persistent_cache():
    """JAX's persistent compilation cache cannot hold a compile-only client's executables (reading
    one back warns): XLA:TPU's compiles here skip it."""
    from podscale._jax import jax_config

    return jax_config.enable_compilation_cache(False)


def _project_one(data_parallel, step, shapes, make_batch, replica_batch, system, topology, name, strategy) -> Row:
    target = target_shape(topology, strategy)
    compiled_shape, reduced, factor = compile_shape(target, min(len(jax.devices("cpu")), MAX_CPU_DEVICES))
    k = strategy.spatial or strategy.model_parallel or 1
    compile_ = functools.partial(_compile, data_parallel, step, shapes, make_batch, replica_batch, k, strategy)
    dp, module = compile_(compiled_shape)
    phases, collectives, exposed, hidden = cost(system, topology, module, target, reduced=reduced, factor=factor)
    if (
        factor > 1
        and strategy.weight_update == "sharded"
        and compiled_shape[reduced] >= 4
        and compiled_shape[reduced] % 2 == 0
    ):
        # The sharded update costs a + b / n on n devices (whole small leaves, shards): a and b
        # from this compile and one on a mesh half as large, then evaluated at the target.
        smaller = dict(compiled_shape)
        smaller[reduced] //= 2
        points = [(math.prod(compiled_shape.values()), phases["update"])]
        points.append((math.prod(smaller.values()), update_seconds(system, compile_(smaller)[1])))
        phases["update"] = scale_update(points, points[0], topology.devices)
    return (
        _row(system, topology, name, strategy, replica_batch, target, compiled_shape, factor, dp, module)
        ._replace(phases=phases, collectives=collectives, exposed=exposed, hidden=hidden, compiler="XLA:CPU")
        .build()
    )


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


class _Draft(dict):
    """A row's figures while they are gathered (see :func:`_row`)."""

    def _replace(self, **fields):
        self.update(fields)
        return self

    def build(self) -> Row:
        system, topology, module, dp = self["system"], self["topology"], self["module"], self["dp"]
        phases, factor = self["phases"], self["factor"]
        compute = phases["forward"] + phases["backward"]
        step_s = compute + phases["update"] + self["exposed"]
        model_flops = sum(o.matmul_flops * o.count for o in module.ops if o.phase != "update")
        per_device = module.memory.get("peak", 0)
        if factor > 1 and self["strategy"].weight_update == "sharded":
            # the sharded state's shards are ``factor`` times smaller at the target
            shards = sum(leaf.bytes_per_device() for leaf in dp.layout.leaves if leaf.sharded)
            per_device -= shards * (1 - 1 / factor)
        memory = per_device * system.devices_per_chip
        global_batch = self["replica_batch"] * self["replicas"]
        return Row(
            chips=topology.chips,
            strategy=self["name"],
            devices=topology.devices,
            mesh=self["target"],
            topology=topology.describe(),
            global_batch=global_batch,
            replica_batch=self["replica_batch"],
            compute_s=compute,
            update_s=phases["update"],
            communication_s=sum(c["seconds"] for c in self["collectives"]),
            exposed_s=self["exposed"],
            hidden_s=self["hidden"],
            step_s=step_s,
            examples_per_s=global_batch / step_s if step_s else 0.0,
            mfu=model_flops / (step_s * system.device_peak("bf16")) if step_s else 0.0,
            memory_per_chip=float(memory),
            hbm_per_chip=float(system.hbm_bytes),
            fits=memory <= system.hbm_bytes,
            collectives=self["collectives"],
            flops_per_device=module.flops(),
            compiled_mesh=self["compiled_shape"],
            compiler=self["compiler"],
            compile_s=self.get("compile_s"),
        )


def _row(system, topology, name, strategy, replica_batch, target, compiled_shape, factor, dp, module) -> _Draft:
    k = strategy.spatial or strategy.model_parallel or 1
    return _Draft(
        system=system,
        topology=topology,
        name=name,
        strategy=strategy,
        replica_batch=replica_batch,
        replicas=topology.devices // k,
        target=target,
        compiled_shape=compiled_shape,
        factor=factor,
        dp=dp,
        module=module,
    )


def shrink(target: dict[str, int], devices: int) -> tuple[dict[str, int], str | None, int]:
    """The mesh XLA:TPU compiles for ``target``: its first (outermost data) axis halved while the
    mesh has more than ``devices`` devices and the axis stays at least 2 (the per-replica program
    is the same; only the groups of the data axis's collectives, and the sharded update's shards,
    differ, and :func:`cost` and :func:`scale_update` scale those). Returns (mesh, reduced axis or
    None, factor)."""
    shape = dict(target)
    first = next(iter(shape))
    factor = 1
    while math.prod(shape.values()) > devices and shape[first] % 2 == 0 and shape[first] >= 4:
        shape[first] //= 2
        factor *= 2
    return shape, (first if factor > 1 else None), factor


@dataclasses.dataclass
class _Compiled:
    dp: Any
    module: hlo.Module | None
    seconds: float
    slice_name: str
    error: str | None = None
    used: bool = False


_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _out_of_memory(message: str) -> bool:
    """Whether XLA:TPU refused the program for the chip's memory (HBM), not another resource."""
    return "Ran out of memory" in message or ("RESOURCE_EXHAUSTED" in message and "hbm" in message.lower())


def _required(message: str, system: System) -> float | None:
    """The memory per chip XLA:TPU's refusal says the program needs (per device: ``required ...
    (70.00G)`` or ``Used 20.95G of 15.48G hbm``), or ``None`` when it gives none."""
    m = re.search(r"\((\d+(?:\.\d+)?)([KMGT])\)", message) or re.search(r"Used (\d+(?:\.\d+)?)([KMGT])\b", message)
    return float(m.group(1)) * _UNITS[m.group(2)] * system.devices_per_chip if m else None


@dataclasses.dataclass(frozen=True)
class _Job:
    """What every compile of one projection shares."""

    data_parallel: Callable
    step: Callable
    shapes: Any
    make_batch: Callable
    per_chips: dict[int, int]
    system: System
    say: Callable[[str], None]
    progress: Callable[[str], None] | None
    heartbeat_s: float
    started: float


def _project_tpu(job: _Job, topologies, resolved, reasons) -> list[Row]:
    """The rows on XLA:TPU's modules: one compile per distinct program (see :func:`shrink`), a
    second for a sharded update whose rows need its ``a + b / n`` scaling."""
    from podscale.perf import tpu

    system, say = job.system, job.say
    cache: dict[tuple, _Compiled] = {}

    def compiled(name: str, strategy: Strategy, shape: dict[str, int], replica_batch: int) -> _Compiled:
        key = (name, tuple(shape.items()), replica_batch)
        if key in cache:
            return cache[key]
        k = strategy.spatial or strategy.model_parallel or 1
        slice_name = tpu.topology_name(system, math.prod(shape.values()) // system.devices_per_chip)
        what = f"{system.name} {name}, mesh {'x'.join(map(str, shape.values()))} ({slice_name})"
        say(f"{what}: compiling with XLA:TPU ({elapsed(job.started)} since the start)")
        one = time.perf_counter()
        try:
            with heartbeat(job.progress, f"{what}: still compiling", job.heartbeat_s):
                dp, module = _compile(
                    job.data_parallel,
                    job.step,
                    job.shapes,
                    job.make_batch,
                    replica_batch,
                    k,
                    strategy,
                    shape,
                    devices=tpu.devices(system.name, slice_name),
                )
            entry = _Compiled(dp, module, time.perf_counter() - one, slice_name)
        except Exception as e:
            if not _out_of_memory(str(e)):
                raise
            lines = str(e).strip().splitlines()
            message = next((line for line in lines if _out_of_memory(line)), lines[0])
            entry = _Compiled(None, None, time.perf_counter() - one, slice_name, error=message)
        say(f"{what}: done in {elapsed(one)}" + (f": does not fit: {entry.error}" if entry.error else ""))
        cache[key] = entry
        return entry

    def compile_shape_of(topology, name, strategy) -> tuple[dict[str, int], str | None, int]:
        live = [t for t in topologies if reasons[t.chips, name] is None]
        smallest = min(math.prod(target_shape(t, strategy).values()) for t in live)
        return shrink(target_shape(topology, strategy), min(smallest, MAX_TPU_COMPILE_DEVICES))

    # Every distinct program first, compiled side by side (XLA compiles one program on one core):
    # a strategy's meshes, and for a sharded update whose rows are scaled, a second size.
    wanted: dict[tuple, tuple] = {}
    for topology in topologies:
        for name, strategy in resolved.items():
            if reasons[topology.chips, name] is None:
                shape, _, factor = compile_shape_of(topology, name, strategy)
                replica_batch = job.per_chips[topology.chips]
                wanted[name, tuple(shape.items()), replica_batch] = (name, strategy, shape, replica_batch, factor)
    for (name, _, replica_batch), (_, strategy, shape, _, factor) in list(wanted.items()):
        sizes = {math.prod(dict(k[1]).values()) for k in wanted if k[0] == name and k[2] == replica_batch}
        if factor > 1 and strategy.weight_update == "sharded" and len(sizes) < 2:
            more = dict(shape)
            more[next(iter(more))] *= 2
            wanted[name, tuple(more.items()), replica_batch] = (name, strategy, more, replica_batch, 1)
    for _, _, shape, _, _ in wanted.values():  # libtpu loads here, in this thread, once
        tpu.devices(system.name, tpu.topology_name(system, math.prod(shape.values()) // system.devices_per_chip))
    workers = max(1, min(len(wanted), os.cpu_count() or 1, MAX_PARALLEL_COMPILES))
    pool = concurrent.futures.ThreadPoolExecutor(workers)
    try:
        for future in [pool.submit(compiled, *w[:4]) for w in wanted.values()]:
            future.result()
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)  # an error or Ctrl-C: no queued compile starts
        raise
    pool.shutdown()

    rows: list[Row] = []
    for topology in topologies:
        n_chips = topology.chips
        for name, strategy in resolved.items():
            replica_batch = job.per_chips[n_chips]
            reason = reasons[n_chips, name]
            if reason is not None:
                say(f"{system.name} {n_chips} chips, {name}: not applicable: {reason}")
                rows.append(_not_applicable(topology, name, strategy, replica_batch, reason))
                continue
            target = target_shape(topology, strategy)
            shape, reduced, factor = compile_shape_of(topology, name, strategy)
            entry = compiled(name, strategy, shape, replica_batch)
            common = dict(compiler=f"XLA:TPU {entry.slice_name}", compile_s=None if entry.used else entry.seconds)
            entry.used = True
            if entry.error:
                rows.append(
                    dataclasses.replace(
                        _not_applicable(topology, name, strategy, replica_batch, None),
                        mesh=target,
                        compiled_mesh=shape,
                        fits=False,
                        does_not_fit=entry.error,
                        memory_per_chip=_required(entry.error, system),
                        **common,
                    )
                )
                continue
            phases, collectives, exposed, hidden = cost(
                system, topology, entry.module, target, reduced=reduced, factor=factor, scheduled=True
            )
            n = math.prod(shape.values())
            if factor > 1 and strategy.weight_update == "sharded":
                points = [  # every compiled size of the strategy, in a fixed order
                    (math.prod(dict(key[1]).values()), update_seconds(system, cache[key].module))
                    for key in sorted(cache, key=repr)
                    if key[0] == name and key[2] == replica_batch and cache[key].module is not None
                ]
                phases["update"] = scale_update(points, (n, phases["update"]), topology.devices)
            draft = _row(system, topology, name, strategy, replica_batch, target, shape, factor, entry.dp, entry.module)
            row = draft._replace(
                phases=phases, collectives=collectives, exposed=exposed, hidden=hidden, **common
            ).build()
            say(f"{system.name} {n_chips} chips, {name}: step {row.step_s * 1e3:.3f} ms")
            rows.append(row)
    return rows


def mark_fastest(rows: list[Row]) -> list[Row]:
    """The rows, with ``fastest`` set on the quickest strategy that fits at each chip count (rows
    that do not apply are never the fastest)."""
    best: dict[int, Row] = {}
    for r in rows:
        if r.costed and r.fits and (r.chips not in best or r.step_s < best[r.chips].step_s):
            best[r.chips] = r
    return [dataclasses.replace(r, fastest=best.get(r.chips) is r) for r in rows]


def render(rows: list[Row], system: System, what: str, console=None) -> None:
    from rich.console import Console

    from podscale import report

    console = console or Console()
    numbers = ("compute ms", "update ms", "comm ms (hidden)", "step ms", "examples/s", "MFU", "GiB/chip")
    table = report.table(
        "chips",
        "strategy",
        *numbers,
        "fits",
        "compiled (mesh, seconds)",
        title=f"{what} projected to {system.name} (per step; * fastest that fits; n/a: does not apply, see below)",
        numbers=("chips", *numbers),
    )
    for r in rows:
        if not r.costed:
            memory = f"{r.memory_per_chip / 2**30:.2f}/{r.hbm_per_chip / 2**30:.0f}" if r.memory_per_chip else "-"
            fits = "n/a" if not r.applicable else "NO"
            table.add_row(str(r.chips), r.strategy, *(["-"] * (len(numbers) - 1)), memory, fits, compiled_text(r))
            continue
        table.add_row(
            str(r.chips),
            r.strategy + (" *" if r.fastest else ""),
            f"{r.compute_s * 1e3:.3f}",
            f"{r.update_s * 1e3:.3f}",
            f"{r.exposed_s * 1e3:.3f} ({r.hidden_s * 1e3:.3f})",
            f"{r.step_s * 1e3:.3f}",
            f"{r.examples_per_s:,.0f}",
            f"{r.mfu:.1%}",
            f"{r.memory_per_chip / 2**30:.2f}/{r.hbm_per_chip / 2**30:.0f}",
            "yes" if r.fits else "NO",
            compiled_text(r),
        )
    report.show(table, console)
    seen = set()
    for r in rows:
        if r.chips in seen:
            continue
        seen.add(r.chips)
        batch = next((x for x in rows if x.chips == r.chips and x.global_batch is not None), r)
        console.print(
            f"{r.chips} chips: {r.topology}; global batch {batch.global_batch} ({batch.replica_batch} per replica)"
        )
    for r in rows:
        if not r.applicable:
            console.print(f"  {r.chips} chips, {r.strategy}: not applicable: {r.not_applicable}", markup=False)
        elif r.does_not_fit:
            console.print(f"  {r.chips} chips, {r.strategy}: does not fit: {r.does_not_fit}", markup=False)
        elif r.compiled_mesh != r.mesh:
            console.print(f"  {r.chips} chips, {r.strategy}: compiled on mesh {r.compiled_mesh}, scaled to {r.mesh}")
    console.print(
        "comm = exposed communication; (hidden) = communication overlapped with compute (XLA:TPU's module: by its "
        "schedule, between each collective's start and done; XLA:CPU's: the gradient sums but the last, behind the "
        "backward pass). "
        "Costs and sources: podscale project --list-systems; formulas: docs/benchmarks.md"
    )


def compiled_text(row: Row) -> str:
    """Which compiler made a row's module, for which mesh, and how long it took:
    ``XLA:TPU v3:4x4 32 (74 s)``; ``(reused)`` when another row's compile is costed again."""
    if not row.compiler:
        return "-"
    mesh = "x".join(map(str, row.compiled_mesh.values()))
    took = "reused" if row.compile_s is None else f"{row.compile_s:.0f} s"
    return f"{row.compiler} {mesh} ({took})"


def plot_formats() -> dict[str, str]:
    """The file suffixes (without the dot) matplotlib writes here -> their description."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    return Figure().canvas.get_supported_filetypes()


def check_plot_path(path: str, what: str = "--plot") -> None:
    """Refuses, before any work, a plot path that cannot be written: a suffix matplotlib does not
    write, a folder that does not exist or is not writable (probed by creating a file there, as
    permission bits say nothing to root), a folder given as the file. ``what`` names it."""
    import os
    import tempfile

    formats = plot_formats()
    choices = ", ".join(f".{f}" for f in sorted(formats))
    if not path or not path.strip():
        raise ValueError(f"{what} {path!r}: give a file name, e.g. scaling.png")
    if os.path.isdir(path):
        raise ValueError(f"{what} {path!r}: a folder; give a file name in it, e.g. {os.path.join(path, 'scaling.png')}")
    suffix = os.path.splitext(path)[1].lower().lstrip(".")
    if suffix not in formats:
        said = f"the suffix .{suffix}" if suffix else "no suffix"
        raise ValueError(f"{what} {path!r}: {said}; name a file matplotlib can write: {choices}")
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"{what} {path!r}: {folder} is a file, not a folder; write elsewhere")
    if not os.path.isdir(folder):
        raise ValueError(f"{what} {path!r}: the folder {folder} does not exist; create it or write elsewhere")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".podscale-plot-probe-"):
            pass
    except OSError as e:
        raise ValueError(f"{what} {path!r}: cannot write in {folder} ({e.strerror or e}); write elsewhere") from None


def plot(rows: list[Row], path: str, title: str = "") -> None:
    """Step time and throughput against chips, a line per strategy (rows that do not apply are
    left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    applicable = [r for r in rows if r.costed]
    for name in dict.fromkeys(r.strategy for r in applicable):
        mine = sorted((r for r in applicable if r.strategy == name), key=lambda r: r.chips)
        chips = [r.chips for r in mine]
        left.plot(chips, [r.step_s * 1e3 for r in mine], marker="o", label=name)
        right.plot(chips, [r.examples_per_s for r in mine], marker="o", label=name)
    for ax, label in ((left, "step time (ms)"), (right, "examples / s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("chips")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    right.set_yscale("log")
    left.legend()
    fig.suptitle(title)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)
