"""Regions of the step that podscale partitions by hand over a space or model axis.

XLA's SPMD partitioner keeps a convolution split by height with a halo exchange, but a gather from
a split map (RoIAlign's bilinear samples, an embedding lookup in a split table) it partitions by
all-reducing every gathered element: more bytes than the map itself. Where the user's function is
a *sum over blocks* of its input, each partition can compute its own block's share and one sum of
the results crosses the axis. :func:`sum_over_blocks` marks such a function:

    pooled = podscale.sum_over_blocks(pool_rows, maps, boxes, dim=1, name="roi_align")

``pool_rows(blocks, starts, *args)`` is the contribution of the rows ``[start, start + n)`` of
``dim`` that each leaf of ``blocks`` holds (``n`` its size along ``dim``), with ``starts`` the same
tree of int32 scalars. The contract: the contributions of the blocks of any split of ``x`` along
``dim`` sum to ``fn(x, zeros, *args)``, and rows of zeros past ``x``'s end contribute nothing (a
function linear in ``x`` meets it; RoIAlign never reads past the map's last row).

On one device, and on any mesh without the axis named by ``over``, the region is
``fn(x, zeros, *args)``: the specification. Under a placement whose ``over`` role has an axis of
``k > 1`` partitions, podscale's partitioner replaces it (forward and backward) by a ``shard_map``
manual over that axis: each partition runs ``fn`` on its own rows of ``x`` (a leaf whose ``dim``
``k`` does not divide is padded with zero rows to a multiple of ``k``), the results are summed over
the axis (one all-reduce of the output's bytes), and the backward pass gives each partition the
gradient of its own rows, with no communication (the arguments' gradients are summed). The
partitioned result equals one device's up to the order of that sum. Over the data axes the region
runs on each replica's rows, as the partitioner's own rules find; where they would need a
collective, the region is left to XLA and the plan says why.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from podscale.parallel.interpret import varying_axes

ROLES = ("space", "model")
_PREFIX = "podscale_region_"
_REGIONS: dict[int, Region] = {}
_COUNT = itertools.count()
_BY_HAND: contextvars.ContextVar[dict[str, tuple[str, int]] | None] = contextvars.ContextVar("by_hand", default=None)


@contextlib.contextmanager
def by_hand(axes: dict[str, tuple[str, int]]):
    """Regions traced inside run by hand over ``axes`` (per role, its mesh axis and size) at once:
    for a program traced inside a ``shard_map`` manual over the data axes that podscale's
    partitioner does not replay (the evaluation step, which runs the model on each replica's rows)."""
    token = _BY_HAND.set(dict(axes))
    try:
        yield
    finally:
        _BY_HAND.reset(token)


@dataclasses.dataclass(frozen=True, eq=False)
class Region:
    """One call of :func:`sum_over_blocks`, as traced (its shapes are those ``fn`` saw)."""

    name: str
    fn: Callable
    dim: int
    over: str
    x_tree: Any
    x_shapes: tuple[tuple[int, ...], ...]
    arg_tree: Any
    arg_shapes: tuple[tuple[int, ...], ...]
    differentiable: tuple[bool, ...]
    """Per leaf of ``x`` then of ``args``: whether it is a float (has a gradient)."""

    @property
    def rule(self) -> str:
        return f"sum over blocks of dim {self.dim}"

    @property
    def n_x(self) -> int:
        return len(self.x_shapes)


def sum_over_blocks(fn: Callable, x, *args, dim: int, name: str, over: str = "space"):
    """``fn(x, starts=0, *args)``, partitioned over the ``over`` axis by blocks of ``x``'s ``dim``
    where the placement has one: see the module docstring."""
    if not callable(fn):
        raise TypeError(
            f"sum_over_blocks: fn must be a function fn(blocks, starts, *args), got {type(fn).__name__} {fn!r}"
        )
    if over not in ROLES:
        raise ValueError(
            f"sum_over_blocks: over={over!r} is not a role podscale partitions by hand; use one of {ROLES}"
        )
    if not isinstance(name, str) or not name:
        raise ValueError("sum_over_blocks: give the region a name (name='roi_align'), which the plan lists")
    x_leaves, x_tree = jax.tree.flatten(x)
    arg_leaves, arg_tree = jax.tree.flatten(args)
    if not x_leaves:
        raise ValueError(f"sum_over_blocks {name!r}: x has no arrays to split")
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
        raise TypeError(f"sum_over_blocks {name!r}: dim must be an int (a dimension of x's leaves), got {dim!r}")
    ranks = {np.ndim(leaf) for leaf in x_leaves}
    if dim < 0 and len(ranks) > 1:
        raise ValueError(
            f"sum_over_blocks {name!r}: dim={dim} counts from the end, and x's leaves have ranks {sorted(ranks)}, "
            "so it names a different dimension in each: give it from the front (dim >= 0)"
        )
    given, dim = dim, int(dim) + (ranks.pop() if dim < 0 else 0)
    for path, leaf in jax.tree_util.tree_leaves_with_path(x):
        if not 0 <= dim < np.ndim(leaf):
            raise ValueError(
                f"sum_over_blocks {name!r}: dim={given!r} is not a dimension of x{jax.tree_util.keystr(path)} "
                f"(shape {list(np.shape(leaf))})"
            )
    leaves = [*x_leaves, *arg_leaves]
    region = Region(
        name,
        fn,
        dim,
        over,
        x_tree,
        tuple(tuple(np.shape(v)) for v in x_leaves),
        arg_tree,
        tuple(tuple(np.shape(v)) for v in arg_leaves),
        tuple(bool(jnp.issubdtype(jnp.result_type(v), jnp.inexact)) for v in leaves),
    )
    _check_contract(region, x_leaves, arg_leaves)
    role = (_BY_HAND.get() or {}).get(over)
    if role is not None and role[1] > 1:
        shapes = [np.shape(v) for v in leaves]
        with jax.named_scope(name):
            outs, _ = partitioned(region, "fwd", role[0], role[1], leaves, shapes)
        return jax.tree.unflatten(_out_tree(region, leaves), outs)
    key = next(_COUNT)
    _REGIONS[key] = region
    return jax.tree.unflatten(_out_tree(region, leaves), _call(region, key)(*leaves))


_CHECKED: set = set()
"""Regions checked (function, dim, ranks, types), and (region, shapes) whose check was refused for
its memory: neither is compiled again."""
CHECK_MEMORY = 4 * 2**30
"""The most host memory the contract check of a region may take (its arguments at full shape)."""
_SHAPES_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("shapes_only", default=False)


@contextlib.contextmanager
def shapes_only():
    """Within it, regions are traced for their shapes alone (``jax.eval_shape`` of a model's init,
    to count or label its parameters): nothing ``fn`` computes is used, so its contract is not
    checked there (a full config's check compiles ``fn`` on the whole feature maps, seconds). The
    first trace of the region whose result is used checks it (JAX reuses a trace of the same jitted
    function for the same shapes: trace what computes in a function of its own, as
    :meth:`~podscale.workloads.base.Workload.param_count` does)."""
    token = _SHAPES_ONLY.set(True)
    try:
        yield
    finally:
        _SHAPES_ONLY.reset(token)


def _last_rows(v, dim: int, rng) -> tuple[np.ndarray, int]:
    """The last rows of ``x``'s leaf ``v`` along ``dim`` (at most 4) and the first one's index: ``v``'s
    own where it is concrete, else normal draws of their shape and type (floats; integers zero).
    Drawn on the host: a few rows."""
    n = np.shape(v)[dim]
    t = max(n - 4, 0)
    if not isinstance(v, jax.core.Tracer):
        return np.asarray(v)[(slice(None),) * dim + (slice(t, n),)], t
    shape = list(np.shape(v))
    shape[dim] = n - t
    dtype = jnp.result_type(v)
    if jnp.issubdtype(dtype, jnp.inexact):
        return np.asarray(rng.standard_normal(size=shape), dtype=dtype), t
    return np.zeros(shape, dtype), t


def _check_contract(region: Region, x_leaves, arg_leaves) -> None:
    """Refuses, naming the region, a function that is not a sum over blocks, on the first trace
    (then once per function and shapes): on the last rows of each leaf of ``x`` (at most 4, from
    ``start = n - 4``), ``fn`` on that block must equal the sum of ``fn`` on its two halves, each
    with its own start, the second half with a row of zeros past ``x``'s end. Where ``x`` is traced,
    its rows are normal draws of their shape; a traced argument is drawn uniform on [0, 1)
    (integers zero) inside the check's program. The check is one compiled program, run outside the
    step: the arguments may be a full config's feature maps (Mask R-CNN's RoIAlign), too large for
    a host copy or an op-by-op run."""
    if _SHAPES_ONLY.get():
        return
    dtypes = tuple(str(jnp.result_type(v)) for v in (*x_leaves, *arg_leaves))
    ranks = tuple(len(s) for s in (*region.x_shapes, *region.arg_shapes))
    # The contract is the function's: checked once per function, dimension, types and ranks (a
    # full config's call after the tiny config's is not checked again).
    key = (getattr(region.fn, "__code__", id(region.fn)), region.dim, ranks, dtypes)
    too_large = (key, region.x_shapes, region.arg_shapes)
    if key in _CHECKED or too_large in _CHECKED:
        return
    d = region.dim
    rng = np.random.default_rng(0)
    blocks = [_last_rows(v, d, rng) for v in x_leaves]
    traced = [isinstance(v, jax.core.Tracer) for v in arg_leaves]
    concrete = [None if t else v for v, t in zip(arg_leaves, traced, strict=True)]
    specs = [(tuple(np.shape(v)), jnp.result_type(v)) for v in arg_leaves]

    def outputs(draw_key, rows, given):
        keys = jax.random.split(draw_key, max(len(specs), 1))
        leaves = []
        for k, (shape, dtype), c in zip(keys, specs, given, strict=False):
            if c is not None:
                leaves.append(c)
            elif jnp.issubdtype(dtype, jnp.inexact):
                leaves.append(jax.random.uniform(k, shape, dtype))
            else:
                leaves.append(jnp.zeros(shape, dtype))
        args = jax.tree.unflatten(region.arg_tree, leaves)

        def run(parts):
            x = jax.tree.unflatten(region.x_tree, [b for b, _ in parts])
            starts = jax.tree.unflatten(region.x_tree, [jnp.asarray(s, jnp.int32) for _, s in parts])
            return jax.tree.leaves(region.fn(x, starts, *args))

        block, first, second = [], [], []
        for v, (_, t) in zip(rows, blocks, strict=True):
            m = v.shape[d]
            h = max(m // 2, 1)
            cut = lambda a, b, v=v: lax.slice_in_dim(v, a, b, axis=d)  # noqa: E731
            pad = [(0, 1 if j == d else 0) for j in range(v.ndim)]
            block.append((v, t))
            first.append((cut(0, h), t))
            second.append((jnp.pad(cut(h, m), pad), t + h))
        return run(block), run(first), run(second)

    with jax.ensure_compile_time_eval():  # values, not the step's tracers
        inputs = (jax.random.key(0), [jnp.asarray(v) for v, _ in blocks], concrete)
        compiled = jax.jit(outputs).lower(*inputs).compile()
        memory = compiled.memory_analysis()
        need = getattr(memory, "temp_size_in_bytes", 0) + getattr(memory, "output_size_in_bytes", 0)
        if need > CHECK_MEMORY:
            warnings.warn(
                f"region {region.name!r}: checking that its function is a sum over blocks would take "
                f"{need / 2**30:.1f} GiB on this host at these shapes (its arguments {[list(s) for s in region.arg_shapes]}), "
                f"over {CHECK_MEMORY / 2**30:.0f} GiB: not checked here. It is checked where it first runs at smaller "
                "shapes in a process (a tiny config, say); run it once so before trusting a partitioned result.",
                RuntimeWarning,
                stacklevel=3,
            )
            _CHECKED.add(too_large)  # not compiled again at these shapes
            return
        whole, a, b = compiled(*inputs)
        shapes = [[list(np.shape(o)) for o in outs] for outs in (whole, a, b)]
        if not shapes[0] == shapes[1] == shapes[2]:
            raise ValueError(
                f"region {region.name!r}: its function gives {shapes[1]} and {shapes[2]} on two blocks of rows but "
                f"{shapes[0]} on both together: the results of a sum over blocks must have one shape whatever the "
                "block (sum_over_blocks)"
            )
        for i, (w, p, q) in enumerate(zip(whole, a, b, strict=True)):
            w, total = np.asarray(w, np.float64), np.asarray(p, np.float64) + np.asarray(q, np.float64)
            scale = max(float(np.max(np.abs(w), initial=0.0)), float(np.max(np.abs(total), initial=0.0)), 1e-30)
            eps = float(jnp.finfo(jnp.result_type(p)).eps) if jnp.issubdtype(jnp.result_type(p), jnp.inexact) else 0
            off = float(np.max(np.abs(w - total), initial=0.0))
            if not off <= max(1e-4, 64 * eps) * scale:
                starts = [(s, s + np.shape(b_)[d]) for b_, s in blocks]
                raise ValueError(
                    f"region {region.name!r} is not a sum over blocks of dim {d}: its function on rows {starts} "
                    f"differs from the sum of its results on the two halves of those rows (each with its own "
                    f"start) by {off:.3g} (output {i}, largest {scale:.3g}). sum_over_blocks needs fn(blocks, starts, "
                    "*args) to be a block's share of a sum: the shares of any split of x add up to the whole's, a "
                    "row's place read from starts, rows of zeros past x's end adding nothing. Write the function "
                    "so, or call it without sum_over_blocks."
                )
    _CHECKED.add(key)


def _whole(region: Region, leaves):
    """``fn`` on the whole of ``x`` (every start 0): the region on one device."""
    x = jax.tree.unflatten(region.x_tree, leaves[: region.n_x])
    args = jax.tree.unflatten(region.arg_tree, leaves[region.n_x :])
    return region.fn(x, jax.tree.map(lambda _: jnp.zeros((), jnp.int32), x), *args)


def _out_tree(region: Region, leaves):
    return jax.tree.structure(jax.eval_shape(lambda *v: _whole(region, v), *leaves))


def _named(fn: Callable, name: str) -> Callable:
    fn.__name__ = fn.__qualname__ = name
    return jax.jit(fn)


def _call(region: Region, key: int) -> Callable:
    """The region as a ``custom_vjp`` whose forward and backward are named ``jit`` calls, which the
    partitioner finds in the traced step (``partition.control._region``)."""
    forward = _named(lambda *v: jax.tree.leaves(_whole(region, v)), f"{_PREFIX}{key}_fwd")

    def backward_whole(*v):
        leaves, g = v[: len(region.differentiable)], v[len(region.differentiable) :]
        return _vjp_leaves(region, lambda ls: _whole(region, ls), leaves, g)

    backward = _named(backward_whole, f"{_PREFIX}{key}_bwd")

    @jax.custom_vjp
    def call(*leaves):
        return forward(*leaves)

    def fwd(*leaves):
        return forward(*leaves), leaves

    def bwd(leaves, g):
        cts = iter(backward(*leaves, *g))
        return tuple(next(cts) if d else None for d in region.differentiable)

    call.defvjp(fwd, bwd)
    return call


def _vjp_leaves(region: Region, f: Callable, leaves, g) -> list:
    """The cotangents of ``f``'s differentiable input leaves, given its output leaves' ``g``."""
    dif = [i for i, d in enumerate(region.differentiable) if d]
    g = list(g)

    def on(floats):
        full = list(leaves)
        for i, v in zip(dif, floats, strict=True):
            full[i] = v
        # Typed per replica as their cotangents are (which may vary over the data axes where an
        # output does not), so the two match.
        return [_vary_as(o, gi) for o, gi in zip(jax.tree.leaves(f(full)), g, strict=True)]

    outs, vjp = jax.vjp(on, [leaves[i] for i in dif])
    return list(vjp([_vary_as(gi, o) for gi, o in zip(g, outs, strict=True)])[0])


def _vma(x) -> frozenset:
    return varying_axes(jax.typeof(x))


def _vary_over(x, axes: frozenset):
    missing = tuple(sorted(axes - _vma(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


def _vary_as(x, like):
    """``x`` typed as varying over every axis ``like`` varies over, too."""
    return _vary_over(x, _vma(like))


# -- the partitioner's side ---------------------------------------------------------------------


def parse(name: str) -> tuple[Region, str] | None:
    """The region and ``"fwd"``/``"bwd"`` of a ``jit`` equation's name, or ``None``."""
    if not name.startswith(_PREFIX):
        return None
    key, kind = name[len(_PREFIX) :].rsplit("_", 1)
    region = _REGIONS.get(int(key))
    return None if region is None else (region, kind)


def batch_dims(region: Region, avals) -> list[int]:
    """Per input leaf of an equation (``avals``: its global shapes), the leading dimensions ``vmap``
    added to what ``fn`` saw: all the same where present, else refused naming the region."""
    shapes = [*region.x_shapes, *region.arg_shapes]
    extra = []
    for shape, aval in zip(shapes, avals, strict=False):
        lead = len(aval) - len(shape)
        if lead < 0 or tuple(aval[lead:]) != tuple(shape):
            raise ValueError(
                f"region {region.name!r}: an input traced as {list(shape)} arrives as {list(aval)}; call "
                "sum_over_blocks on the batched arrays, or vmap it over their leading axes (in_axes=0)"
            )
        extra.append(lead)
    if len({e for e in extra if e}) > 1:
        raise ValueError(f"region {region.name!r}: its inputs are batched by vmap to different depths {extra}")
    return extra


def partitioned(region: Region, kind: str, axis: str, k: int, vals: list, avals: list) -> tuple[list, list[bool]]:
    """The region's forward (``kind="fwd"``) or backward on ``vals`` (one replica's local values),
    manual over ``axis`` of ``k`` partitions: each partition's blocks, one sum over the axis. With
    the outputs, which of them were summed over the axis. A leaf whose split dimension ``k`` does
    not divide is padded with zero rows to a multiple of ``k`` (rows past its end, which the
    contract says contribute nothing), and its gradient cut back."""
    n_in = len(region.differentiable)
    lead = batch_dims(region, avals[:n_in])
    depth = max(lead, default=0)
    split_dims = [lead[i] + region.dim for i in range(region.n_x)]
    sizes = [np.shape(vals[i])[d] for i, d in enumerate(split_dims)]
    padded = [-(-n // k) * k for n in sizes]
    x_vals = [
        v if n == m else jnp.pad(v, [(0, m - n if j == d else 0) for j in range(np.ndim(v))])
        for v, d, n, m in zip(vals[: region.n_x], split_dims, sizes, padded, strict=True)
    ]
    arg_vals = list(vals[region.n_x : n_in])

    def fn_on(x_leaves, arg_leaves, starts):
        def one(xs, rest):
            x = jax.tree.unflatten(region.x_tree, xs)
            return jax.tree.leaves(region.fn(x, jax.tree.unflatten(region.x_tree, starts), *rest))

        f = one
        for _ in range(depth):
            f = jax.vmap(
                f,
                in_axes=(
                    [0 if lead[i] else None for i in range(region.n_x)],
                    [0 if e else None for e in lead[region.n_x :]],
                ),
            )
        outs = f(list(x_leaves), list(arg_leaves))
        if want is not None and [tuple(o.shape) for o in outs] != want:
            raise ValueError(
                f"region {region.name!r}: its function gives {[list(o.shape) for o in outs]} on a block of "
                f"{[list(np.shape(v)) for v in x_leaves]} but {[list(w) for w in want]} on the whole: the results "
                "of a sum over blocks must have one shape whatever the block (sum_over_blocks)"
            )
        return outs

    def starts_of():
        i = lax.axis_index(axis)
        return [(i * (m // k)).astype(jnp.int32) for m in padded]

    want = [tuple(np.shape(g)) for g in vals[n_in:]] if kind == "bwd" else None
    x_specs = [P(*([None] * d), axis) for d in split_dims]
    arg_specs = [P()] * len(arg_vals)
    mesh = jax.sharding.get_abstract_mesh()
    if kind == "fwd":

        def inner(x_leaves, arg_leaves):
            return [lax.psum(o, axis) for o in fn_on(x_leaves, arg_leaves, starts_of())]

        mapped = jax.shard_map(inner, mesh=mesh, in_specs=(x_specs, arg_specs), out_specs=P(), axis_names={axis})
        outs = list(mapped(x_vals, arg_vals))
        return outs, [True] * len(outs)

    dif = [i for i, d in enumerate(region.differentiable) if d]

    def inner_bwd(x_leaves, arg_leaves, g):
        starts = starts_of()

        def f(ls):
            return fn_on(ls[: region.n_x], ls[region.n_x :], starts)

        # Typed as varying over the data axes (as the cotangents are), so that the gradient of a
        # value the same on every replica stays this replica's share (a partial sum, which the
        # partitioner sums once), not summed over the replicas here by the transpose.
        outer = frozenset().union(*(_vma(gi) for gi in g)) - {axis}
        x_leaves = [_vary_over(v, outer) for v in x_leaves]
        arg_leaves = [_vary_over(v, outer) for v in arg_leaves]

        # A block's gradient stays with its rows; the arguments' (the same on every partition)
        # are summed over the axis: the transpose of their use by every partition, as their
        # invariant type over it has ``jax.vjp`` take it.
        return _vjp_leaves(region, f, [*x_leaves, *arg_leaves], g)

    out_specs = [x_specs[i] if i < region.n_x else P() for i in dif]
    mapped = jax.shard_map(
        inner_bwd, mesh=mesh, in_specs=(x_specs, arg_specs, P()), out_specs=out_specs, axis_names={axis}
    )
    outs = list(mapped(x_vals, arg_vals, list(vals[n_in:])))
    for j, i in enumerate(dif):  # a padded leaf's gradient, cut back to its rows
        if i < region.n_x and padded[i] != sizes[i]:
            outs[j] = lax.slice_in_dim(outs[j], 0, sizes[i], axis=split_dims[i])
    return outs, [i >= region.n_x for i in dif]
