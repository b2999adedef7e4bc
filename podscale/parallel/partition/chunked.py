"""The rules for :class:`~.layouts.Chunked` values: a tensor stored 1/N per replica (FSDP), its
gradient and its optimizer state; N the replicas of the chunks' axes (``Partitioner.chunk_axes``:
every data axis, or with data x FSDP some, whole copies of the chunks over the others).

A chunk is computed on where that is its own piece of the result: elementwise ops (the update:
Adam's moments, the new weight) and reductions (a norm: a partial sum over the chunks). Anything
else reads it whole: it is all-gathered for that use and dropped after (:func:`gather` is not
memoised: a weight read by the forward and the backward pass is gathered for each). A partial sum
that meets a chunk, or that an elementwise op of the update reads (``g * g``), is reduce-scattered
into chunks (:func:`scatter`), where the replicated update all-reduces it whole.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
from jax import lax

from podscale._jax import all_gather_invariant
from podscale.compiled.hlo import CHUNK_GATHER_SCOPE, GRAD_SUM_SCOPE, UPDATE_SCOPE
from podscale.parallel.interpret import ELEMENTWISE
from podscale.parallel.partition.jaxprs import global_shape
from podscale.parallel.partition.layouts import PARTIAL, REPLICATED, Chunked, Layout, chunk_dim
from podscale.parallel.partition.sums import IDENTITY, narrow_float, one_replica_sum, widen

if TYPE_CHECKING:
    from podscale.parallel.partition.core import Partitioner

_REDUCTIONS = {"reduce_sum": None, "reduce_max": lax.pmax, "reduce_min": lax.pmin}


def gather(p: Partitioner, x, layout: Chunked):
    """The whole tensor of the chunk ``x`` (an all-gather over the axes it is chunked over, along
    its dim)."""
    if p.one:
        return x
    p.communications += 1
    if p.leaving:  # the update's (compiled.hlo's phases), with the relayouts XLA adds around it
        p.record("all-gather", p.chunk_axes, x, "updated chunks gathered into the whole weight", update=True)
        with jax.named_scope(UPDATE_SCOPE):
            return all_gather_invariant(x, p.chunk_axes, axis=layout.dim, tiled=True)
    p.record("all-gather", p.chunk_axes, x, "a stored chunk gathered for its use")
    with jax.named_scope(CHUNK_GATHER_SCOPE):  # its buffer is the chunk (projection.cost scales it)
        return all_gather_invariant(x, p.chunk_axes, axis=layout.dim, tiled=True)


def scatter(p: Partitioner, x, dim: int):
    """This replica's chunk along ``dim`` of the sum over the replicas of the partial sum ``x``
    (a reduce-scatter; with data x FSDP, over the chunks' axes, then an all-reduce of the chunk
    over the others), rounded as one device rounds the whole sum (:meth:`Partitioner.rounded`)."""
    if p.one:
        return p.rounded(one_replica_sum(x), x)
    p.communications += 1
    p.record("reduce-scatter", p.chunk_axes, x, "a partial sum reduce-scattered into chunks", update=True)
    with jax.named_scope(UPDATE_SCOPE), jax.named_scope(GRAD_SUM_SCOPE):  # a gradient sum (compiled.hlo)
        chunk = lax.psum_scatter(x, p.chunk_axes, scatter_dimension=dim, tiled=True)
        if p.outer_axes:  # the copies' partial chunks, summed across them
            p.record("all-reduce", p.outer_axes, chunk, "chunks summed across their copies (data x FSDP)", update=True)
            chunk = lax.psum(chunk, p.outer_axes)
        return p.rounded(chunk, x)


def convert(p: Partitioner, x, src: Layout, dst: Layout):
    """``x`` from ``src`` to ``dst`` where either is a chunk."""
    if isinstance(src, Chunked):
        whole = gather(p, x, src)
        return whole if dst is REPLICATED else p.convert(whole, REPLICATED, dst)
    if src is PARTIAL:
        return scatter(p, x, dst.dim)
    if src is not REPLICATED:  # a split value, or a batch-norm group's (averaged over the groups)
        x = p.whole(x, src)
    size = x.shape[dst.dim] // p.chunk_n
    return lax.dynamic_slice_in_dim(x, p.chunk_index() * size, size, dst.dim)


def chunk_of(p: Partitioner, shape) -> Chunked | None:
    """The chunked layout FSDP sums a partial value of ``shape`` into, or ``None`` (small, or no
    dimension the replicas divide): as :mod:`~podscale.parallel.state_layout` stores such a leaf."""
    if not p.chunk_partials or math.prod(shape) < p.min_chunk:
        return None
    dim = chunk_dim(shape, p.chunk_n, tiles="model" not in p.setup.region_axes)
    return None if dim is None else Chunked(dim)


def settle(p: Partitioner, eqn, ins, i: int):
    """Where the partial sum ``ins[i]`` that ``eqn`` reads must be summed: into chunks where ``eqn`` is
    elementwise, of the shape of its result, and reads a chunk (its dim) or, with ``p.fsdp``, no
    split value (the update's ``g * g``: ``chunk_dim`` of the shape, as the weights are stored);
    else whole. Returns ``(value, layout)`` after the sum."""
    value, layout = ins[i]
    target = REPLICATED
    shape = global_shape(eqn.invars[i])
    if eqn.primitive.name in ELEMENTWISE and shape == global_shape(eqn.outvars[0]):
        dims = {lay.dim for _, lay in ins if isinstance(lay, Chunked)}
        others = [lay for _, lay in ins if lay not in (REPLICATED, PARTIAL) and not isinstance(lay, Chunked)]
        if len(dims) == 1 and not others:
            target = Chunked(dims.pop())
        elif not dims and not others and (p.fsdp or p.only_updated(eqn.outvars[0])):
            target = chunk_of(p, shape) or REPLICATED
    return p.convert(value, layout, target), target


def equation(p: Partitioner, eqn, ins):
    """``eqn``, which reads a chunk, on the chunks where it can be, else on gathered values."""
    name = eqn.primitive.name
    if name in IDENTITY and len(ins) == 1:
        return [ins[0]]
    with jax.named_scope(UPDATE_SCOPE):  # work on chunks is the update's (compiled.hlo's phases)
        out = _elementwise(p, eqn, ins) if name in ELEMENTWISE else None
        if out is None and name in _REDUCTIONS and len(ins) == 1:
            out = _reduce(p, eqn, ins[0])
    if out is not None:
        return out
    if name == "optimization_barrier":
        return list(zip(p.bind(eqn, [v for v, _ in ins]), [lay for _, lay in ins], strict=True))
    whole = [(gather(p, v, lay), REPLICATED) if isinstance(lay, Chunked) else (v, lay) for v, lay in ins]
    return p.equation(eqn, whole)


def whole_sum(p: Partitioner, eqn, arg):
    """A sum over every element of a large replicated value computed from the state alone, whose
    elementwise family nothing but such sums reads (:meth:`Partitioner.only_updated`: ``sum(w * w)``,
    a weight's norm for LARS or LAMB, which the sharded update keeps whole), on this replica's chunk
    of it: a partial sum, summed with the other small sums, so that each replica reads 1/N of the
    weight where it read all of it (paper 3: a reduction over a whole tensor becomes a local partial
    reduction and a small all-reduce). Who reads the sum is not checked: a norm the forward pass
    reads (weight normalisation, a penalty in the loss) is summed so too, one small all-reduce more
    in that pass, the same within the summation order's tolerance. ``None`` with one replica, where
    the value is small, has no dimension the replicas divide, or is not summed over every
    dimension."""
    shape = global_shape(eqn.invars[0])
    if p.one or p.outer_axes or len(eqn.params["axes"]) != len(shape) or not p.only_updated(eqn.invars[0]):
        return None
    target = chunk_of(p, shape)
    if target is None:
        return None
    with jax.named_scope(UPDATE_SCOPE):
        return _reduce(p, eqn, (p.convert(arg[0], REPLICATED, target), target))


def _elementwise(p: Partitioner, eqn, ins):
    shape = global_shape(eqn.outvars[0])
    dims = {lay.dim for _, lay in ins if isinstance(lay, Chunked)}
    if len(dims) != 1:
        return None
    (dim,) = dims
    if _extends_shape(eqn):
        return None
    vals = []
    for (v, lay), var in zip(ins, eqn.invars, strict=True):
        vshape = tuple(getattr(var.aval, "shape", ()))
        if isinstance(lay, Chunked):
            vals.append(v)
        elif vshape == () or (len(vshape) > dim and vshape[dim] == 1 and len(vshape) == len(shape)):
            if lay is PARTIAL:
                v = p.whole(v, lay)
            elif lay is not REPLICATED:  # a group's value: each group's own, not a chunk's
                return None
            vals.append(v)
        elif vshape == shape and lay in (REPLICATED, PARTIAL):
            vals.append(p.convert(v, lay, Chunked(dim)))
        else:
            return None
    return [(o, Chunked(dim)) for o in p.bind(eqn, vals)]


def _extends_shape(eqn) -> bool:
    """An elementwise-listed op whose result's shape is not its operands' (random-key ops extend
    the key's shape, a bitcast to another width adds or drops a dimension)."""
    shapes = {tuple(getattr(v.aval, "shape", ())) for v in eqn.invars}
    shapes.discard(())
    return any(tuple(v.aval.shape) not in shapes | {()} for v in eqn.outvars) and bool(shapes)


def _reduce(p: Partitioner, eqn, arg):
    v, lay = arg
    name = eqn.primitive.name
    axes = tuple(eqn.params["axes"])
    changes = {"out_sharding": None} if "out_sharding" in eqn.params else {}
    if lay.dim not in axes:  # along other dims: still this replica's chunk
        local = p.bind(eqn, [v], **changes)[0]
        return [(local, Chunked(lay.dim - sum(a < lay.dim for a in axes)))]
    if name == "reduce_sum" and not p.outer_axes:
        if narrow_float(v.dtype):  # accumulated in float32, rounded after the sum over the replicas
            v = widen(v)
        return [(p.bind(eqn, [v], **changes)[0], PARTIAL)]
    narrow = narrow_float(v.dtype) and name == "reduce_sum"
    local = p.bind(eqn, [widen(v) if narrow else v], **changes)[0]
    if p.one:
        return [(local.astype(v.dtype) if narrow else local, REPLICATED)]
    # Over the chunks' axes only (data x FSDP: the other data axes hold the same chunks, so a
    # partial sum over every replica would count each chunk once per copy).
    p.record("all-reduce", p.chunk_axes, local, f"{name} over chunks")
    p.communications += 1
    total = (_REDUCTIONS[name] or lax.psum)(local, p.chunk_axes)
    return [(total.astype(v.dtype) if narrow else total, REPLICATED)]
