"""Projecting the user's own compiled step to a pod: ``podscale project``.

For each chip count and strategy the step is compiled here, on CPU devices, for the target's own
device count and mesh (so the collectives, their groups and bytes, the sharded update's shard
sizes and the memory per device are the ones XLA produces for that pod), then costed on the system
(:mod:`podscale.compiled.systems`).

:func:`project` compiles: with XLA:TPU for the slice (libtpu's compile-only devices,
:mod:`podscale.compiled.tpu`) or XLA:GPU for the GPUs (the CUDA plugin's,
:mod:`podscale.compiled.gpu`), once per distinct program, or with XLA:CPU, once per row. The strategies
and the meshes compiled for them are :mod:`podscale.projection.mesh`; the costing of a compiled
step, :mod:`podscale.projection.cost`; the rows, their table and plot,
:mod:`podscale.projection.rows`.
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

from podscale.compiled import hlo
from podscale.compiled.network import Topology
from podscale.compiled.systems import System
from podscale.parallel import checks
from podscale.parallel.mesh import MAX_CPU_DEVICES  # JAX's CPU client's limit, also setup's
from podscale.parallel.strategy import Strategy
from podscale.projection.cost import cost, scale_update, terms, update_seconds
from podscale.projection.mesh import (
    DEFAULT_STRATEGIES,
    applicability,
    compile_mesh,
    compile_shape,
    shrink,
    strategy_for,
    target_shape,
)
from podscale.projection.rows import Row, draft_row, mark_fastest, not_applicable_row
from podscale.report import elapsed, heartbeat


@contextlib.contextmanager
def accelerator_lowerings():
    """Lowers as for TPU and GPU while compiling here: JAX lowers its threefry random bits (dropout)
    on CPU as a rolled loop, whose every round writes the whole state to memory, and on
    accelerators unrolled into one fusion. Without this, a step with dropout would be costed with
    the CPU's loop (a third of transformer-big's bytes). Uses JAX's lowering registry (private)."""
    from podscale._jax import mlir, platform_lowerings, threefry2x32_lowering_rule
    from podscale._jax import threefry2x32 as threefry

    rules = platform_lowerings["cpu"]
    old = rules.get(threefry.threefry2x32_p)
    mlir.register_lowering(threefry.threefry2x32_p, threefry2x32_lowering_rule, platform="cpu")
    try:
        yield
    finally:
        if old is None:
            rules.pop(threefry.threefry2x32_p, None)
        else:
            rules[threefry.threefry2x32_p] = old


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
    bn_group_size: int = 1,
    tokens_per_example: int | None = None,
    slices: int | None = None,
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
    (:data:`podscale.compiled.network.MULTI_AXIS`). ``progress`` gets a line as each compile starts
    and ends (with the time taken) and every ``heartbeat_s`` seconds while one runs.
    ``compiler``: ``tpu`` (XLA:TPU for the target slice, with libtpu's compile-only devices: a TPU
    system only), ``gpu`` (XLA:GPU for the target's GPUs, with JAX's CUDA plugin's compile-only
    devices: a GPU system only), ``cpu`` (XLA:CPU on this machine's CPU devices, one compile per
    row), or ``auto``: ``tpu`` or ``gpu`` for a TPU or GPU system where its compiler is installed,
    else ``cpu`` (``progress`` is told why when a system falls back).
    ``bn_group_size``: replicas per batch-norm group. Above 1 every mesh gets the innermost data
    axis :data:`~podscale.parallel.mesh.BN_GROUP` of that many neighbouring replicas (as
    ``make_mesh(bn_group_size=...)``), and ``step``'s batch norm must average over it (a workload
    built with ``bn_axis=BN_GROUP``); a strategy whose mesh cannot take the groups is a row saying
    why.
    ``slices``: TPU slices each chip count is split into, joined by the data-centre network
    (default: one up to the system's largest slice; :func:`~podscale.compiled.network.slices_of`).
    ``tokens_per_example``: for a language model, the tokens one example predicts; rows then give
    ``tokens_per_s_per_chip``.
    """
    from podscale.compiled import systems
    from podscale.parallel.engine import data_parallel

    system = systems.get(system) if isinstance(system, str) else system
    base = base or Strategy()
    chips = list(chips)
    bn_group_size = checks.whole("bn_group_size", bn_group_size, what=" (replicas per batch-norm group)")
    if tokens_per_example is not None:
        tokens_per_example = checks.whole(
            "tokens_per_example", tokens_per_example, what=" (tokens one example predicts)"
        )

    def finished(rows: list[Row]) -> list[Row]:
        return mark_fastest(
            [
                dataclasses.replace(
                    r,
                    bn_group_size=bn_group_size,
                    tokens_per_s_per_chip=(
                        r.examples_per_s * tokens_per_example / r.chips
                        if tokens_per_example and r.examples_per_s
                        else None
                    ),
                )
                for r in rows
            ]
        )

    target_of = functools.partial(target_shape, bn_group_size=bn_group_size)
    reasons = applicability(system, chips, strategies, base, multi_axis, bn_group_size=bn_group_size, slices=slices)
    if isinstance(strategies, dict):
        resolved = dict(strategies)
    else:
        resolved = {
            s: strategy_for(base, s, multi_axis, system.kind)
            for s in (DEFAULT_STRATEGIES if strategies is None else strategies)
        }
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
    topologies = [Topology(system, n_chips, multi_axis, slices) for n_chips in chips]
    say = progress or (lambda message: None)
    started = time.perf_counter()
    chosen = compiler_for(system, compiler, say)
    if chosen != "cpu":
        target = _target(chosen)
        job = _Job(
            data_parallel,
            step,
            shapes,
            make_batch,
            per_chips,
            system,
            say,
            progress,
            heartbeat_s,
            started,
            target,
            target_of,
        )
        rows = _project_tpu(job, topologies, resolved, reasons)
        return finished(rows)
    cpus = len(jax.devices("cpu"))
    for topology in topologies:  # every mesh is checked before anything is compiled
        for name, strategy in resolved.items():
            if reasons[topology.chips, name] is not None:
                continue
            need = min(math.prod(target_of(topology, strategy).values()), MAX_CPU_DEVICES)
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
                rows.append(not_applicable_row(topology, name, strategy, per_chips[n_chips], reason))
                continue
            one = time.perf_counter()
            say(f"{what}: compiling for {topology.devices} devices ({elapsed(started)} since the start)")
            with heartbeat(progress, f"{what}: still compiling", heartbeat_s):
                row = _project_one(
                    data_parallel,
                    step,
                    shapes,
                    make_batch,
                    per_chips[n_chips],
                    system,
                    topology,
                    name,
                    strategy,
                    target_of(topology, strategy),
                )
            row = dataclasses.replace(row, compile_s=time.perf_counter() - one)
            say(f"{what}: done in {elapsed(one)}, step {row.step_s * 1e3:.3f} ms ({elapsed(started)} since the start)")
            rows.append(row)
    return finished(rows)


COMPILERS = ("auto", "tpu", "gpu", "cpu")
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
    return compiler_for(system, compiler, say) == "tpu"


def compiler_for(system: System, compiler: str = "auto", say: Callable[[str], None] | None = None) -> str:
    """Whose module ``system`` is projected from: ``tpu``, ``gpu`` or ``cpu`` (see :func:`project`'s
    ``compiler``). Raises for ``tpu`` or ``gpu`` on a system of the other kind, or where that
    compiler is not installed."""
    checks.one_of("compiler", compiler, COMPILERS)
    if compiler == "cpu":
        return "cpu"
    kind = system.kind if system.kind in ("tpu", "gpu") else None
    if compiler in ("tpu", "gpu") and compiler != kind:
        other = f"--compiler {kind}, cpu or auto" if kind else "its module is XLA:CPU's: --compiler cpu or auto"
        raise ValueError(f"--compiler {compiler}: {system.name!r} is not a {compiler.upper()} system ({other})")
    if kind is None:
        return "cpu"
    target = _target(kind)
    if not target.available():
        if compiler == kind:
            raise ValueError(f"--compiler {kind}: {target.NEEDED}; or --compiler auto to cost XLA:CPU's module")
        if say is not None:
            say(target.MISSING)
        return "cpu"
    return kind


def _target(kind: str):
    """The compile-only devices' module of ``kind``: :mod:`podscale.compiled.tpu` or
    :mod:`podscale.compiled.gpu` (``available``, ``topology_name``, ``devices``, ``LABEL``)."""
    from podscale.compiled import gpu, tpu

    return {"tpu": tpu, "gpu": gpu}[kind]


def _compile(data_parallel, step, shapes, make_batch, replica_batch: int, k: int, strategy, shape, devices=None):
    """The step compiled for ``shape``: on this machine's CPU devices (with the accelerators'
    lowerings), or on ``devices`` (compile-only TPU or GPU devices: XLA:TPU, XLA:GPU with
    :data:`podscale.compiled.gpu.COMPILER_OPTIONS`)."""
    mesh = compile_mesh(shape, devices)
    dp = data_parallel(step, mesh, strategy)  # the state donated, as train runs it (its memory: aliased)
    batch = make_batch(replica_batch * (mesh.size // k))
    with accelerator_lowerings() if devices is None else _no_persistent_cache():
        dp.prepare(shapes, batch)
        compiled = dp.lower(dp.placement.stored_shapes(), batch).compile(_options(devices))
    return dp, hlo.read(compiled, mesh)


def _options(devices) -> dict | None:
    """XLA options of a compile on ``devices``: XLA:GPU's for compile-only GPUs, the run's own
    ``LIBTPU_INIT_ARGS`` for compile-only TPUs (:func:`podscale.compiled.tpu.compile_options`)."""
    from podscale.compiled import gpu, tpu

    if devices and devices[0].platform == "gpu":
        return dict(gpu.COMPILER_OPTIONS)
    return tpu.options_for(devices) if devices else None


def _no_persistent_cache():
    """JAX's persistent compilation cache cannot hold a compile-only client's executables (reading
    one back warns): XLA:TPU's compiles here skip it."""
    from podscale._jax import jax_config

    return jax_config.enable_compilation_cache(False)


def _project_one(
    data_parallel, step, shapes, make_batch, replica_batch, system, topology, name, strategy, target
) -> Row:
    compiled_shape, reduced, factor = compile_shape(target, min(len(jax.devices("cpu")), MAX_CPU_DEVICES))
    k = strategy.spatial or strategy.model_parallel or 1
    compile_ = functools.partial(_compile, data_parallel, step, shapes, make_batch, replica_batch, k, strategy)
    dp, module = compile_(compiled_shape)
    partner = None
    if (
        factor > 1
        and strategy.state_scales(reduced)
        and compiled_shape[reduced] >= 4
        and compiled_shape[reduced] % 2 == 0
    ):
        # The sharded update costs a + b / n on n devices (whole small leaves, shards): a and b
        # from this compile and one on a mesh half as large, then evaluated at the target.
        smaller = dict(compiled_shape)
        smaller[reduced] //= 2
        partner = (math.prod(smaller.values()), compile_(smaller)[1])
    priced = price(topology, module, target, reduced, factor, strategy, partner, scheduled=False)
    return (
        draft_row(system, topology, name, strategy, replica_batch, target, compiled_shape, factor, dp, module)
        ._replace(**priced, compiler="XLA:CPU")
        .build()
    )


def price(topology, module, target, reduced, factor, strategy, partner, scheduled: bool) -> dict:
    """A row's costed figures from its compiled ``module``: the phases, collectives, exposed and
    hidden communication at the system's nominal figures; the step by term
    (:func:`~podscale.projection.cost.terms`); and the step time at both ends of the assumed
    figures' ranges (:meth:`~podscale.compiled.systems.System.at`). ``partner``: ``(devices,
    module)`` of the same program compiled on another mesh size, for the sharded update's
    ``a + b / n`` (:func:`~podscale.projection.cost.scale_update`), or ``None``."""
    n = math.prod(compile_mesh_shape(module, target, reduced, factor).values())
    out: dict[str, Any] = {}
    for end in ("nominal", "fast", "slow"):
        system = topology.system if end == "nominal" else topology.system.at(end)
        where = topology if end == "nominal" else Topology(system, topology.chips, topology.multi_axis, topology.slices)
        # data x FSDP's chunks are over the inner axis: its update's buffers are the target's already
        buffers = factor if reduced is None or strategy.chunked_over(reduced) else 1
        phases, collectives, exposed, hidden = cost(
            system, where, module, target, reduced=reduced, factor=buffers, scheduled=scheduled
        )
        if partner is not None:
            points = sorted([(n, phases["update"]), (partner[0], update_seconds(system, partner[1]))])
            phases["update"] = scale_update(points, (n, phases["update"]), topology.devices)
        step_s = phases["forward"] + phases["backward"] + phases["update"] + exposed
        if end == "nominal":
            out.update(phases=phases, collectives=collectives, exposed=exposed, hidden=hidden)
            split = terms(system, module)
            if partner is not None and split:  # the update's ops as scaled to the target
                own = update_seconds(system, module)
                scale = phases["update"] / own if own else 1.0
                update_split = terms(system, module, ("update",))
                for key, value in update_split.items():
                    split[key] += value * (scale - 1.0)
            split["communication"] = exposed
            out["terms"] = split
        else:
            out[f"step_{end}_s"] = step_s
    return out


def compile_mesh_shape(module, target, reduced, factor) -> dict[str, int]:
    """The mesh a module was compiled on: ``target`` with ``reduced`` ``factor`` times smaller."""
    shape = dict(target)
    if reduced is not None:
        shape[reduced] //= factor
    return shape


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
    (70.00G)`` or ``Used 20.95G of 15.48G hbm``), or ``None`` when it gives none or the memory it ran
    out of is another (a core's vector memory, ``vmem``: the chip's HBM is not what is short)."""
    space = re.search(r"memory space (\w+)", message)
    if space and space.group(1) != "hbm":
        return None
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
    target: Any  # podscale.compiled.tpu or podscale.compiled.gpu: whose compile-only devices
    target_of: Callable  # (topology, strategy) -> the mesh the row runs on (target_shape with the batch-norm groups)


def _project_tpu(job: _Job, topologies, resolved, reasons) -> list[Row]:
    """The rows on XLA:TPU's (or XLA:GPU's: ``job.target``) modules: one compile per distinct
    program (see :func:`shrink`), a second for a sharded update whose rows need its ``a + b / n``
    scaling."""
    tpu = job.target  # podscale.compiled.tpu, or .gpu: the same interface (the name kept for the lines below)

    system, say = job.system, job.say
    cache: dict[tuple, _Compiled] = {}

    def devices_for(shape: dict[str, int], slices: int) -> tuple[str, tuple]:
        """The compile-only devices of a compile mesh over ``slices`` slices, and their name."""
        name = tpu.topology_name(system, math.prod(shape.values()) // system.devices_per_chip // slices)
        if slices == 1:  # (XLA:GPU's targets have no slices)
            return name, tpu.devices(system.name, name)
        return f"{name} x {slices} slices", tpu.devices(system.name, name, slices)

    def compiled(
        name: str, strategy: Strategy, shape: dict[str, int], replica_batch: int, slices: int = 1
    ) -> _Compiled:
        key = (name, tuple(shape.items()), replica_batch, slices)
        if key in cache:
            return cache[key]
        k = strategy.spatial or strategy.model_parallel or 1
        slice_name, devices = devices_for(shape, slices)
        what = f"{system.name} {name}, mesh {'x'.join(map(str, shape.values()))} ({slice_name})"
        say(f"{what}: compiling with {tpu.LABEL} ({elapsed(job.started)} since the start)")
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
                    devices=devices,
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
        # the row's own target alone decides (one figure per row, whatever else is asked for)
        return shrink(job.target_of(topology, strategy), MAX_TPU_COMPILE_DEVICES)

    def slices_for(topology, shape: dict[str, int]) -> int:
        """The slices a compile mesh spans (the target's first ones, slice-major): XLA:TPU compiles
        for that many at once, its collectives across them as it makes them for several; one where
        the mesh fits a slice."""
        n = math.prod(shape.values())
        return n // topology.slice_devices if n > topology.slice_devices and n % topology.slice_devices == 0 else 1

    def partner_of(shape: dict[str, int], strategy: Strategy, factor: int) -> dict[str, int] | None:
        """The second mesh of a row whose sharded update is scaled (``a + b / n``): its first
        axis halved (or, where it cannot be, doubled)."""
        if factor == 1 or not strategy.state_scales(next(iter(shape))):
            return None
        other = dict(shape)
        first = next(iter(other))
        other[first] = other[first] // 2 if other[first] >= 4 and other[first] % 2 == 0 else other[first] * 2
        return other

    # Every distinct program first, compiled side by side (XLA compiles one program on one core):
    # each row's mesh, and for a sharded update whose rows are scaled, its second size.
    wanted: dict[tuple, tuple] = {}
    for topology in topologies:
        for name, strategy in resolved.items():
            if reasons[topology.chips, name] is None:
                shape, _, factor = compile_shape_of(topology, name, strategy)
                replica_batch = job.per_chips[topology.chips]
                for mesh in (shape, partner_of(shape, strategy, factor)):
                    if mesh is not None:
                        n = slices_for(topology, mesh)
                        wanted.setdefault(
                            (name, tuple(mesh.items()), replica_batch, n), (name, strategy, mesh, replica_batch, n)
                        )
    for _, _, shape, _, n in wanted.values():  # libtpu (or the CUDA plugin) loads here, in this thread, once
        devices_for(shape, n)
    workers = max(1, min(len(wanted), os.cpu_count() or 1, MAX_PARALLEL_COMPILES))
    pool = concurrent.futures.ThreadPoolExecutor(workers)
    try:
        for future in [pool.submit(compiled, *w) for w in wanted.values()]:
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
                rows.append(not_applicable_row(topology, name, strategy, replica_batch, reason))
                continue
            target = job.target_of(topology, strategy)
            shape, reduced, factor = compile_shape_of(topology, name, strategy)
            entry = compiled(name, strategy, shape, replica_batch, slices_for(topology, shape))
            common = dict(compiler=f"{tpu.LABEL} {entry.slice_name}", compile_s=None if entry.used else entry.seconds)
            checked = tpu.CHECKS_MEMORY  # a program XLA:TPU compiled fits the chip by its own count
            entry.used = True
            if entry.error:
                rows.append(
                    dataclasses.replace(
                        not_applicable_row(topology, name, strategy, replica_batch, None),
                        mesh=target,
                        compiled_mesh=shape,
                        fits=False,
                        does_not_fit=entry.error,
                        memory_per_chip=_required(entry.error, system),
                        **common,
                    )
                )
                continue
            other = partner_of(shape, strategy, factor)
            partner = None
            if other is not None:
                partner_entry = compiled(name, strategy, other, replica_batch, slices_for(topology, other))
                if partner_entry.module is not None:
                    partner = (math.prod(other.values()), partner_entry.module)
            priced = price(topology, entry.module, target, reduced, factor, strategy, partner, scheduled=True)
            draft = draft_row(
                system, topology, name, strategy, replica_batch, target, shape, factor, entry.dp, entry.module
            )
            row = draft._replace(**priced, **common, memory_checked=checked).build()
            say(f"{system.name} {n_chips} chips, {name}: step {row.step_s * 1e3:.3f} ms")
            rows.append(row)
    return rows
