"""How gradients are summed over the replicas: one collective over every mesh axis (``"1d"``), or
the 2-D scheme of Kumar et al. 2019 (``"2d"``) on a 2-D mesh, in fused, pipelined chunks.

On a 2-D torus a single ring over all chips uses one link direction per chip and is as long as the
pod. The 2-D scheme reduce-scatters along one axis (``first``), all-reduces the 1/|first| pieces
along the other (``second``), then all-gathers along ``first``: both axes' links work and every
ring is short. With the sharded weight update the all-reduce becomes a second reduce-scatter, the
update runs on a 1/(x*y) shard, and the weights are all-gathered along ``second``, then ``first``.

Each fused buffer is cut into ``chunks`` pieces whose collectives are independent, so the phase
on one axis of chunk i can run while chunk i-1 is in its phase on the other axis (the schedule is
XLA's; on CPU, collectives run one at a time). Results do not depend on ``chunks``: every element
is summed in the same order whatever the chunking.

The axis order's cost model (:class:`AxisCost`, :func:`choose_order`, :func:`parse_axis_costs`) is
:mod:`podscale.compiled.gradsum_cost`; :func:`calibrate`, which measures the figures by running
collectives on the mesh, stays here.

On a TPU the 2-D sum is sent, by default, as one collective over both axes (``phases="xla"``):
XLA:TPU runs a collective whose group spans several torus dimensions dimension by dimension, every
dimension's links working at once (the scaling-book's multi-axis collectives), which is the 2-D
scheme without its three synchronous phases, its fused flat buffers and their relayouts.
``phases="explicit"`` sends podscale's own three phases (the default elsewhere: XLA:CPU and XLA:GPU
run a collective over several axes as one ring or tree through all of them).

Row convention: a buffer of ``n`` rows has its rows ordered by ``lax.axis_index(order)``, i.e.
row ``i_first * |second| + i_second``; the sharded update's chunk layout uses the same order.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from podscale._jax import all_gather_invariant

# The cost model is podscale.compiled's (pure arithmetic, no collectives); its names stay importable from here.
from podscale.compiled.gradsum_cost import AxisCost as AxisCost
from podscale.compiled.gradsum_cost import choose_order as choose_order
from podscale.compiled.gradsum_cost import modelled_seconds as modelled_seconds
from podscale.compiled.gradsum_cost import parse_axis_costs as parse_axis_costs
from podscale.parallel.collectives import Collective
from podscale.parallel.mesh import BN_GROUP

MODES = ("1d", "2d")
PHASES = ("xla", "explicit")
"""How the 2-D sum's phases are sent: ``"xla"``, one collective over both axes whose phases over
the torus XLA lays out; ``"explicit"``, podscale's reduce-scatter, all-reduce and all-gather."""
PHASES_BY_XLA_PLATFORMS = ("tpu",)
"""The platforms whose compiler runs a collective over two mesh axes as the 2-D sum would (over
each torus dimension's links at once): the 2-D sum's phases default to ``"xla"`` there."""
DEFAULT_CHUNKS = 4
MAX_CHUNKS = 64
"""At most this many pipelined chunks per fused buffer: each chunk is a collective of its own that
pays the links' latency, and each is traced and compiled; paper 1 pipelines a few per buffer."""
"""Pipelined chunks per fused buffer with ``grad_sum="2d"`` (``"1d"`` sends each buffer whole)."""

_TEST_ONLY_DIVIDE: dict[str, int] = {}
"""TEST ONLY: a deliberately broken sum, for the tests that show :func:`podscale.verify` catches
one. ``{"2d": 2}`` divides every gradient sum of the ``"2d"`` mode by 2 after the collective (a
gradient divided by a wrong replica count). Read when a step is traced; empty, as it must stay
outside tests, it changes nothing."""


@dataclasses.dataclass(frozen=True)
class GradSum:
    """The summation scheme of a step. Build it with :func:`make_grad_sum`."""

    mode: str
    order: tuple[str, ...]
    """Mesh axes in the order the reduce-scatter goes: ``order[0]`` first."""
    sizes: Mapping[str, int]
    chunks: int = 1
    dtype: Any = None
    """Gradients are summed in this dtype (``None``: their own); results come back in theirs."""
    reason: str = ""
    phases: str = "explicit"
    """With ``mode="2d"``: ``"xla"`` sends each sum as one collective over both axes
    (:data:`PHASES`); ``"explicit"`` as podscale's phases; ``"axes"`` (:meth:`by_axis`, for small
    sums) as one all-reduce along each axis in turn."""
    phase_axes: tuple[tuple[str, ...], ...] = ()
    """With ``mode="2d"``: the mesh axes of each phase, in ``order``'s order (empty: each axis of
    ``order`` alone). A batch-norm group axis (``make_mesh(bn_group_size=k)``) joins the axis it
    was split from: the 2-D sum of mesh ``(x, y / k, bn_group)`` runs over ``x`` and over
    ``(y / k, bn_group)``, whose devices are the 2-D mesh's ``y``."""

    @property
    def n(self) -> int:
        return math.prod(self.sizes[a] for a in self.order)

    @property
    def groups(self) -> tuple[tuple[str, ...], ...]:
        """The mesh axes of each phase of the 2-D sum, first phase first (:attr:`phase_axes`)."""
        return self.phase_axes or tuple((a,) for a in self.order)

    def size(self, axes: tuple[str, ...]) -> int:
        return math.prod(self.sizes[a] for a in axes)

    def by_axis(self) -> GradSum:
        """This scheme for small, latency-bound sums read whole (batch statistics, per-layer
        norms): one collective over every axis where that is how the sum is sent anyway, else
        (podscale's explicit 2-D phases) an all-reduce along each axis in turn, each a short ring:
        the three phases and their chunks would multiply the latency (ResNet-50 on XLA:TPU: 98
        batch statistics, 404 all-gathers of their chunks), and one collective over both axes
        is, on a machine that runs it as one ring, as long as the pod."""
        if self.one_collective:
            return dataclasses.replace(self, mode="1d", chunks=1)
        return dataclasses.replace(self, phases="axes", chunks=1)

    @property
    def small_sum_groups(self) -> tuple[tuple[str, ...], ...]:
        """The axes of each all-reduce of a small sum read whole (:meth:`by_axis`): every axis at
        once where the sum is one collective, else each axis in turn."""
        return (self.order,) if self.one_collective else self.groups

    @property
    def one_collective(self) -> bool:
        """Whether each sum is one collective over every axis of ``order``: the 1-D sum, and the
        2-D sum whose phases XLA lays out over the torus (``phases="xla"``)."""
        return self.mode == "1d" or self.phases == "xla"

    # -- the three collectives, on values typed as differing per replica -------------------
    def all_reduce(self, x, phases: list[Collective]) -> jax.Array:
        """The sum over every replica of ``x`` (any shape); the result is the same everywhere."""
        if self.n == 1:  # one replica (a 1xk mesh): its value is the sum; no collective
            return x
        shape, dtype = x.shape, x.dtype
        x = self._to_sum_dtype(x)
        if self.one_collective:
            phases.append(Collective("all-reduce", self.order, _nbytes(x), chunks=1))
            return self._broken(lax.psum(x, self.order)).astype(dtype).reshape(shape)
        if x.size == 0:
            return x.astype(dtype)
        if self.phases == "axes":  # not a gradient sum: the test hook leaves it alone
            for axes in self.small_sum_groups:
                x = lax.psum(x, axes)
                phases.append(Collective("all-reduce", axes, _nbytes(x), chunks=1))
            return x.astype(dtype).reshape(shape)
        first, second = self.groups
        nx = self.size(first)
        flat = jnp.ravel(x)
        pad = -flat.size % nx
        rows = (jnp.pad(flat, (0, pad)) if pad else flat).reshape(nx, -1)
        outs = []
        for cols in self._column_chunks(rows.shape[1]):
            piece = lax.psum_scatter(rows[:, cols], first, scatter_dimension=0, tiled=True)
            piece = lax.psum(piece, second)
            outs.append(all_gather_invariant(piece[0], first, axis=0, tiled=False))
        total = jnp.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]
        nbytes = _nbytes(rows)
        phases += [
            Collective("reduce-scatter", first, nbytes, chunks=len(outs)),
            Collective("all-reduce", second, nbytes // nx, chunks=len(outs)),
            Collective("all-gather", first, nbytes // nx, chunks=len(outs)),
        ]
        return self._broken(total.reshape(-1)[: math.prod(shape)]).astype(dtype).reshape(shape)

    def reduce_scatter(self, rows, phases: list[Collective]) -> jax.Array:
        """``rows``: ``[n, m]``; returns this replica's row of the sum, ``[m]``."""
        if self.n == 1:
            return rows[0]
        dtype = rows.dtype
        rows = self._to_sum_dtype(rows)
        if self.one_collective:
            phases.append(Collective("reduce-scatter", self.order, _nbytes(rows), chunks=1))
            return self._broken(lax.psum_scatter(rows, self.order, scatter_dimension=0, tiled=True)[0]).astype(dtype)
        if rows.shape[1] == 0:
            return rows[0].astype(dtype)
        first, second = self.groups
        nx, ny = self.size(first), self.size(second)
        outs = []
        for cols in self._column_chunks(rows.shape[1]):
            part = rows[:, cols]
            width = part.shape[1]
            part = lax.psum_scatter(part.reshape(nx, ny * width), first, scatter_dimension=0, tiled=True)
            part = lax.psum_scatter(part.reshape(ny, width), second, scatter_dimension=0, tiled=True)
            outs.append(part[0])
        nbytes = _nbytes(rows)
        phases += [
            Collective("reduce-scatter", first, nbytes, chunks=len(outs)),
            Collective("reduce-scatter", second, nbytes // nx, chunks=len(outs)),
        ]
        return self._broken(jnp.concatenate(outs) if len(outs) > 1 else outs[0]).astype(dtype)

    def all_gather(self, shard, phases: list[Collective]) -> jax.Array:
        """``shard``: ``[m]``, this replica's row; returns all rows, ``[n, m]`` (never in the
        summation dtype: these are weights)."""
        if self.n == 1:
            return shard[None]
        if self.one_collective:
            phases.append(Collective("all-gather", self.order, _nbytes(shard), chunks=1))
            return all_gather_invariant(shard, self.order, axis=0, tiled=False)
        if shard.shape[0] == 0:
            return jnp.zeros((self.n, 0), shard.dtype)
        first, second = self.groups
        outs = []
        for cols in self._column_chunks(shard.shape[0]):
            part = all_gather_invariant(shard[cols], second, axis=0, tiled=False)  # [ny, w]
            part = all_gather_invariant(part, first, axis=0, tiled=False)  # [nx, ny, w]
            outs.append(part.reshape(self.n, -1))
        nbytes = _nbytes(shard)
        phases += [
            Collective("all-gather", second, nbytes, chunks=len(outs)),
            Collective("all-gather", first, nbytes * self.size(second), chunks=len(outs)),
        ]
        return jnp.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]

    # -- helpers ----------------------------------------------------------------------------
    def _broken(self, total):
        """``total`` divided by the test hook's wrong count (:data:`_TEST_ONLY_DIVIDE`; none outside tests)."""
        wrong = _TEST_ONLY_DIVIDE.get(self.mode)
        return total if wrong is None else total / wrong

    def _to_sum_dtype(self, x):
        return x.astype(self.dtype) if self.dtype is not None and jnp.issubdtype(x.dtype, jnp.floating) else x

    def _column_chunks(self, width: int) -> list[slice]:
        k = max(1, min(self.chunks, width))
        bounds = np.linspace(0, width, k + 1).round().astype(int)
        return [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]


def _nbytes(x) -> int:
    return int(x.size) * x.dtype.itemsize


def calibrate(mesh: Mesh, small: int = 2**12, large: int = 2**22, repeats: int = 5) -> dict[str, AxisCost]:
    """Measures each mesh axis: an all-reduce of a small and a large float32 buffer per device,
    fitted to the ring model (best of ``repeats``). All processes use process 0's figures."""
    from jax.experimental import multihost_utils

    costs = {}
    for axis in mesh.axis_names:
        size = mesh.shape[axis]
        if size == 1:
            costs[axis] = AxisCost(bandwidth=float("inf"), latency=0.0)
            continue
        times = []
        for nbytes in (small, large):
            spec = P(tuple(mesh.axis_names))
            f = jax.jit(jax.shard_map(lambda v, a=axis: lax.psum(v, a), mesh=mesh, in_specs=spec, out_specs=spec))
            rows = math.prod(mesh.shape.values())
            x = jax.jit(
                lambda n=nbytes: jnp.ones((rows, n // 4), jnp.float32),  # made in place, on every device
                out_shardings=jax.sharding.NamedSharding(mesh, spec),
            )()
            jax.block_until_ready(f(x))
            best = math.inf
            for _ in range(repeats):
                start = time.perf_counter()
                jax.block_until_ready(f(x))
                best = min(best, time.perf_counter() - start)
            times.append(best)
        steps = 2 * (size - 1)
        per_byte = max((times[1] - times[0]) / (large - small), 1e-15)  # seconds per byte of buffer
        bandwidth = steps / size / per_byte
        latency = max(times[0] / steps - small / size / bandwidth, 0.0)
        costs[axis] = AxisCost(bandwidth=bandwidth, latency=latency)
    if jax.process_count() > 1:
        flat = np.array([[costs[a].bandwidth, costs[a].latency] for a in mesh.axis_names])
        flat = np.asarray(multihost_utils.broadcast_one_to_all(flat))
        costs = {a: AxisCost(float(bw), float(lat)) for a, (bw, lat) in zip(mesh.axis_names, flat, strict=True)}
    return costs


def make_grad_sum(
    mesh: Mesh,
    mode: str = "1d",
    chunks: int | None = None,
    dtype: Any = None,
    axis_costs: Mapping[str, AxisCost] | str | None = None,
    nbytes: float = 2**24,
    axes: tuple[str, ...] | None = None,
    phases: str | None = None,
) -> GradSum:
    """Checks the knobs against the mesh and picks the 2-D axis order.

    Args:
      mode: ``"1d"`` (one collective over all axes) or ``"2d"`` (needs a mesh with two axes).
      chunks: pipelined chunks per buffer (default :data:`DEFAULT_CHUNKS` for 2-D, 1 for 1-D).
        On a TPU the 2-D default is 1: XLA:TPU combines the chunks' reduce-scatters and
        all-reduces back into one collective per phase, runs its collectives synchronously (no
        phase overlaps another), and sends the chunks' all-gathers one by one, each paying the
        links' latency: the chunks pipeline nothing there.
      dtype: sum gradients in this dtype, e.g. ``jnp.bfloat16`` (opt-in; default their own).
      axis_costs: ``{axis: AxisCost}`` from a topology, ``"calibrate"`` to measure, or ``None``
        (:class:`podscale.compiled.gradsum_cost.AxisCost`).
      nbytes: the buffer size the order is chosen for (the fusion bucket size).
      axes: the data axes the sum runs over (default every mesh axis; a spatial strategy's space
        axis is not one).
      phases: how the 2-D sum is sent (:data:`PHASES`): ``"xla"``, one collective over both axes,
        which XLA:TPU runs over each torus dimension's links at once, the 2-D scheme's own
        decomposition; ``"explicit"``, podscale's phases, in ``chunks``, the first axis from
        ``axis_costs``. Default ``"xla"`` on a TPU unless ``chunks`` or ``axis_costs`` is given,
        ``"explicit"`` elsewhere.
    """
    data_only = axes is not None and tuple(axes) != tuple(mesh.axis_names)
    axes = tuple(mesh.axis_names) if axes is None else tuple(axes)
    sizes = {a: mesh.shape[a] for a in axes}
    if mode not in MODES:
        raise ValueError(f"grad_sum={mode!r}: choose one of {', '.join(MODES)}")
    if chunks is not None and chunks < 1:
        raise ValueError(f"grad_sum_chunks must be at least 1, got {chunks}")
    if chunks is not None and chunks > MAX_CHUNKS:
        raise ValueError(
            f"grad_sum_chunks={chunks}: at most {MAX_CHUNKS} pipelined chunks per fused buffer (each is a collective "
            f"that pays the links' latency, and each is compiled); use {DEFAULT_CHUNKS} (the default) to {MAX_CHUNKS}"
        )
    if dtype is not None:
        dtype = jnp.dtype(dtype)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"grad_sum_dtype must be a float type such as bfloat16, got {dtype.name}")
    check_phases(phases, mode, chunks, axis_costs)
    if mode == "1d":
        if chunks not in (None, 1):
            raise ValueError(f"grad_sum_chunks={chunks} pipelines the 2-D sum; with grad_sum='1d' leave it at 1")
        return GradSum("1d", axes, sizes, 1, dtype, "one collective over all mesh axes")
    groups = phase_groups(axes)
    named = [" and ".join(g) for g in groups]
    counted = f" (the batch-norm group axis {BN_GROUP!r} counts with the axis it was split from)"
    counted = counted if len(groups) < len(axes) else ""
    if data_only and len(groups) != 2:
        raise ValueError(
            f"grad_sum='2d' sums over the mesh's data axes, and mesh {dict(mesh.shape)} has {len(groups)}{counted} "
            f"besides its last (the space or model axis): {axes}; make one with two, e.g. "
            + _three_axis_example(math.prod(mesh.shape.values()), mesh.shape[mesh.axis_names[-1]])
        )
    one = [name for name, g in zip(named, groups, strict=True) if math.prod(sizes[a] for a in g) < 2]
    if len(groups) == 2 and one:
        n = math.prod(sizes.values())
        two = [(n // d, d) for d in range(2, n // 2 + 1) if n % d == 0 and n // d >= d]  # squarest last
        raise ValueError(
            f"grad_sum='2d' sums along two mesh axes, and axis {one[0]!r} of mesh {dict(mesh.shape)} has one device: "
            "there is no second sum; "
            + (f"make a mesh of two axes of at least 2, e.g. make_mesh({two[-1]})" if two else "use grad_sum='1d'")
        )
    if len(groups) != 2:
        n = math.prod(sizes.values())
        if len(groups) > 2:
            two = (n // sizes[axes[-1]], sizes[axes[-1]])
            raise ValueError(
                f"grad_sum='2d' sums along two mesh axes, one after the other, and mesh {dict(mesh.shape)} has "
                f"{len(groups)}{counted}; make a 2-D one with the same devices, e.g. make_mesh({two})"
            )
        two = [(n // d, d) for d in range(2, n // 2 + 1) if n % d == 0 and n // d >= d]  # squarest last
        raise ValueError(
            f"grad_sum='2d' needs a mesh with exactly two axes, got {dict(mesh.shape)}; "
            + (
                f"make one of its {n} devices, e.g. make_mesh({two[-1]})"
                if two
                else f"{n} devices make no mesh of two axes of at least 2 each: use grad_sum='1d', or more devices"
            )
        )
    platform = mesh.devices.flat[0].platform
    phases = phases or default_phases(platform, chunks, axis_costs)
    if phases == "xla":  # one collective: the axes in mesh order, as the 1-D sum's
        how = " and ".join(axes)
        reason = (
            f"sent as one collective over {how}, which XLA:TPU runs over each torus dimension's links at once: the "
            "2-D sum's own decomposition, without its three synchronous phases and flat buffers "
            "(grad_sum_phases='explicit' sends podscale's phases)"
            if platform in PHASES_BY_XLA_PLATFORMS
            else f"sent as one collective over {how} (grad_sum_phases='xla'): its phases are XLA:{platform.upper()}'s"
        )
        return GradSum("2d", axes, sizes, 1, dtype, reason, "xla", groups)
    costs = calibrate(mesh) if axis_costs == "calibrate" else axis_costs
    if isinstance(costs, str):
        raise ValueError(f"axis_costs={costs!r}: pass a dict of AxisCost per mesh axis, 'calibrate' or None")
    if costs is not None:
        # The group axis's links are those of the axis it was split from, unless given.
        costs = {**{a: costs[g[0]] for g in groups for a in g[1:] if g[0] in costs}, **costs}
        missing = [a for a in axes if a not in costs]
        if missing:
            raise ValueError(
                f"axis_costs has no entry for mesh axis {missing[0]!r}; give one AxisCost per axis of "
                f"{tuple(g[0] for g in groups)}{counted}"
            )
        costs = {name: group_cost([costs[a] for a in g]) for name, g in zip(named, groups, strict=True)}
    by_name = dict(zip(named, groups, strict=True))
    group_sizes = {name: math.prod(sizes[a] for a in g) for name, g in by_name.items()}
    named_order, reason = choose_order(mesh, costs, nbytes, tuple(named), sizes=group_sizes)
    groups = tuple(by_name[name] for name in named_order)
    reason += counted
    if axis_costs == "calibrate":
        reason = "calibrated: " + reason
    if chunks is None and platform == "tpu":
        chunks = 1
        reason += "; one chunk per phase (XLA:TPU combines a buffer's chunks back into one collective per phase)"
    order = tuple(a for g in groups for a in g)
    return GradSum("2d", order, sizes, DEFAULT_CHUNKS if chunks is None else chunks, dtype, reason, "explicit", groups)


def phase_groups(axes: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """The mesh axes of each phase of the 2-D sum over the data axes ``axes``: each axis alone,
    but the batch-norm group axis (:data:`~podscale.parallel.mesh.BN_GROUP`, which
    ``make_mesh(bn_group_size=k)`` splits off the axis before it) with the axis before it, so
    that a 2-D mesh with batch-norm groups still sums along its two dimensions. Of two axes, each
    alone: a 1-D mesh with groups (``data``, ``bn_group``) is a 2-D mesh of its own."""
    groups: list[tuple[str, ...]] = []
    for a in axes:
        if a == BN_GROUP and groups and len(axes) > 2:
            groups[-1] = (*groups[-1], a)
        else:
            groups.append((a,))
    return tuple(groups)


def group_cost(costs: list[AxisCost]) -> AxisCost:
    """One ring over several mesh axes' devices: as slow as its slowest links."""
    return AxisCost(bandwidth=min(c.bandwidth for c in costs), latency=max(c.latency for c in costs))


def default_phases(platform: str, chunks: int | None, axis_costs: Any) -> str:
    """How the 2-D sum is sent where ``grad_sum_phases`` is not given: as one collective where the
    compiler runs one over two torus dimensions at once (:data:`PHASES_BY_XLA_PLATFORMS`), unless
    the knobs of podscale's own phases (chunks, axis costs) ask for those; else podscale's phases."""
    explicit = chunks is not None or axis_costs is not None
    return "xla" if platform in PHASES_BY_XLA_PLATFORMS and not explicit else "explicit"


def check_phases(phases: str | None, mode: str, chunks: int | None, axis_costs: Any) -> None:
    """Refuses a ``grad_sum_phases`` that the other settings of the sum would contradict or ignore
    (for :class:`~podscale.parallel.strategy.Strategy` and :func:`make_grad_sum`, before any work)."""
    if phases is None:
        return
    if phases not in PHASES:
        raise ValueError(f"grad_sum_phases={phases!r}: choose one of {', '.join(PHASES)}")
    if mode != "2d":
        raise ValueError(
            f"grad_sum_phases={phases!r} says how the 2-D gradient sum is sent, and grad_sum is {mode!r}: it would "
            "be ignored; add grad_sum='2d', or leave grad_sum_phases out"
        )
    if phases == "xla" and chunks not in (None, 1):
        raise ValueError(
            f"grad_sum_chunks={chunks} pipelines podscale's own phases of the 2-D sum, and grad_sum_phases='xla' "
            "sends each sum as one collective: add grad_sum_phases='explicit', or leave grad_sum_chunks out"
        )
    if phases == "xla" and axis_costs is not None:
        raise ValueError(
            "axis_costs choose which axis podscale's own phases of the 2-D sum go along first, and "
            "grad_sum_phases='xla' sends each sum as one collective over both: add grad_sum_phases='explicit', or "
            "leave axis_costs out"
        )


def _three_axis_example(n: int, k: int) -> str:
    """``make_mesh((x, y, k))`` for ``n`` devices, with ``x, y`` at least 2, or why there is none."""
    rest = n // k
    ys = [d for d in range(2, rest // 2 + 1) if rest % d == 0 and rest // d >= 2]
    if not ys:
        return f"there is none on {n} devices with a last axis of {k}: use grad_sum='1d', or more devices"
    return f"make_mesh(({rest // ys[0]}, {ys[0]}, {k}))"
