"""The strategies a projection compiles, and the meshes it compiles them on: the strategy names
(``STRATEGIES``), the check of a request before anything is compiled (which strategies apply at
which chip counts), the mesh a strategy runs on the target's devices, and the smaller mesh compiled
in its place (past this machine's CPU devices, or XLA:TPU's per-replica program).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from podscale.compiled.network import Topology
from podscale.compiled.systems import System
from podscale.parallel import checks
from podscale.parallel.gradsum import PHASES_BY_XLA_PLATFORMS, default_phases
from podscale.parallel.mesh import BN_GROUP, MAX_CPU_DEVICES  # JAX's CPU client's limit, also setup's
from podscale.parallel.strategy import Strategy

DEFAULT_STRATEGIES = ("replicated", "sharded", "sharded-2d")
STRATEGIES = {
    "replicated": {"weight_update": "replicated", "grad_sum": "1d"},
    "sharded": {"weight_update": "sharded", "grad_sum": "1d"},
    "replicated-2d": {"weight_update": "replicated", "grad_sum": "2d"},
    "sharded-2d": {"weight_update": "sharded", "grad_sum": "2d"},
    "fsdp": {"weight_update": "fsdp", "grad_sum": "1d"},
    "fsdp-2d": {"weight_update": "fsdp", "grad_sum": "2d"},
    # FSDP within the first torus dimension (a node of GPUs), data parallelism across the rest:
    # MaxText's ici_fsdp x ici_data, PyTorch's hybrid sharding; over several slices, FSDP within
    # each slice and data parallelism across them (ici_fsdp x dcn_data)
    "data-x-fsdp": {"weight_update": "fsdp", "grad_sum": "1d", "fsdp_axes": ("y",)},
}


def strategy_for(base: Strategy, name: str, multi_axis: str = "torus", kind: str | None = None) -> Strategy:
    """``base`` (spatial or tensor partitioning, the other fields) with the weight update and the
    gradient sum of ``STRATEGIES[name]``; the 2-D sum's own knobs (``grad_sum_chunks``,
    ``grad_sum_phases``, ``axis_costs``) apply to the 2-D strategies only.

    How the 2-D sum is sent, unless ``base`` says: for a TPU system (``kind="tpu"``) as a TPU
    sends it, whichever compiler compiles the row (one collective over both axes; podscale's own
    phases where ``base`` gives their knobs, chunks or axis costs); with ``multi_axis="ring"`` (a
    collective over several torus dimensions runs as one ring through them: paper 1's machine)
    podscale's own phases; otherwise as the compiling platform's default."""
    fields = {"fsdp_axes": None, **STRATEGIES[name]}
    if fields["grad_sum"] != "2d":
        fields.update(grad_sum_chunks=None, grad_sum_phases=None, axis_costs=None)
    elif base.grad_sum_phases is None and multi_axis == "ring":
        fields.update(grad_sum_phases="explicit")
    elif base.grad_sum_phases is None and kind in PHASES_BY_XLA_PLATFORMS:  # as that system sends it
        fields.update(grad_sum_phases=default_phases(kind, base.grad_sum_chunks, base.axis_costs))
    return dataclasses.replace(base, **fields)


def two_data_axes(strategy: Strategy) -> bool:
    """Whether ``strategy`` runs on two data axes (``x``, ``y``: the first torus dimension's
    devices, or a GPU node's, innermost): the 2-D sum's, and data x FSDP's (chunks over ``y``)."""
    return strategy.grad_sum == "2d" or strategy.fsdp_axes is not None


def _names(strategies, what: str) -> list[str]:
    return checks.some_of(what, strategies, tuple(STRATEGIES), "strategy")


def applicability(
    system: System | str,
    chips: Sequence[int],
    strategies: Sequence[str] | dict[str, Strategy] | None = None,
    base: Strategy | None = None,
    multi_axis: str = "torus",
    what: str = "strategies",
    bn_group_size: int | Mapping[int, int] = 1,
    slices: int | None = None,
) -> dict[tuple[int, str], str | None]:
    """Checks a projection's request before anything is compiled, and says which strategies apply
    at which chip counts: ``{(chips, name): None, or why the strategy does not apply there}`` (its
    mesh cannot be made on that slice, or not compiled on this machine's CPU devices).

    Raises ``ValueError`` for an unknown system, a chip count the system cannot hold, an empty,
    unknown or repeated strategy, when nothing applies at all, and when a strategy given
    explicitly (``strategies`` not ``None``) applies at none of the chip counts; ``what`` names
    the strategies in the messages (the CLI's ``--strategies``). ``None`` means
    :data:`DEFAULT_STRATEGIES`, where a strategy that applies nowhere is a row saying why.
    ``bn_group_size``: replicas per batch-norm group (:func:`target_shape`), or ``{chips: size}``."""
    from podscale.compiled import systems

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
        topology = Topology(system, n_chips, multi_axis, slices)  # a size the system cannot hold: refused
        for name, strategy in resolved.items():
            try:
                group = bn_group_size.get(n_chips, 1) if isinstance(bn_group_size, Mapping) else bn_group_size
                target = target_shape(topology, strategy, group)
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


def target_shape(topology: Topology, strategy: Strategy, bn_group_size: int = 1) -> dict[str, int]:
    """The mesh (axis -> size) a strategy runs on ``topology``'s devices: the space or model axis
    (``k``) last and innermost (a replica's devices are neighbours); with the 2-D sum, the data
    axes are the rest of the first torus dimension's devices (GPU: of a node) and the others.
    ``bn_group_size`` > 1 splits the last data axis as ``make_mesh(bn_group_size=...)`` does:
    an innermost data axis ``BN_GROUP`` of that many neighbouring replicas, which a model's batch
    norm averages its statistics over (the 2-D sum runs its phases over the first axis and over
    the last with its groups: :func:`~podscale.parallel.gradsum.phase_groups`)."""
    s = topology.system
    k = strategy.spatial or strategy.model_parallel or 1
    n = topology.devices
    if n % k:
        raise ValueError(
            f"{topology.describe()}: its {n} devices do not divide into replicas of {k} devices (spatial or tensor "
            "partitions)"
        )
    replicas = n // k
    if two_data_axes(strategy):
        inner = topology.shape[0] * s.devices_per_chip if s.kind == "tpu" else min(n, s.node_size)
        if strategy.fsdp_axes is not None and topology.slices > 1:
            inner = topology.slice_devices  # FSDP within each slice, data parallelism across them (DCN)
        what = "the 2-D gradient sum" if strategy.grad_sum == "2d" else "data x FSDP"
        if inner % k or inner // k < 2 or replicas // (inner // k) < 2:
            where = "a slice's" if strategy.fsdp_axes is not None and topology.slices > 1 else "the first dimension's"
            raise ValueError(
                f"{what} on {topology.describe()} with replicas of {k} device(s): needs two data axes "
                f"of at least 2 ({where} {inner} devices / {k}, and the rest)"
            )
        shape: tuple[int, ...] = (replicas // (inner // k), inner // k)
    else:
        shape = (replicas,)
    data = len(shape)
    if k > 1:
        shape = (*shape, k)
    names = {1: ("data",), 2: ("x", "y"), 3: ("x", "y", "z")}[len(shape)]
    if bn_group_size > 1:
        if strategy.fsdp_axes is not None:
            raise ValueError(
                f"data x FSDP with batch-norm groups of {bn_group_size} replicas: they do not combine yet "
                "(a group would be a third data axis); project it with --bn-group-size 1"
            )
        last = shape[data - 1]
        if last % bn_group_size:
            if data == 2:  # the 2-D sum's mesh: the groups split its inner axis y
                raise ValueError(
                    f"{topology.describe()}: the 2-D sum's inner axis y has {last} replicas, which do not divide into "
                    f"batch-norm groups of {bn_group_size}; give a --bn-group-size that divides {last}, or project the "
                    "1-D strategies"
                )
            raise ValueError(
                f"{topology.describe()}: its {last} replicas do not divide into batch-norm groups of {bn_group_size}"
            )
        shape = (*shape[: data - 1], last // bn_group_size, bn_group_size, *shape[data:])
        names = (*names[:data], BN_GROUP, *names[data:])
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


def shrink(target: dict[str, int], devices: int) -> tuple[dict[str, int], str | None, int]:
    """The mesh XLA:TPU compiles for ``target``: its first (outermost data) axis halved while the
    mesh has more than ``devices`` devices and the axis stays at least 2 (the per-replica program
    is the same; only the groups of the data axis's collectives, and the sharded update's shards,
    differ, and :func:`~podscale.projection.cost.cost` and
    :func:`~podscale.projection.cost.scale_update` scale those). Returns (mesh, reduced axis or
    None, factor)."""
    shape = dict(target)
    first = next(iter(shape))
    factor = 1
    while math.prod(shape.values()) > devices and shape[first] % 2 == 0 and shape[first] >= 4:
        shape[first] //= 2
        factor *= 2
    return shape, (first if factor > 1 else None), factor


def compile_mesh(shape: dict[str, int], devices: Sequence | None = None) -> Mesh:
    """A mesh of ``shape`` (axis name -> size, Auto axes) over this process's CPU devices, or over
    ``devices`` (a TPU slice's compile-only ones): the target's mesh, or a shrunk one, to compile for."""
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
