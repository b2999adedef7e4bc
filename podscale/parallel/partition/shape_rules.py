"""The rules for shape ops on split values: broadcasts, reshapes, transposes, squeezes, slices,
pads, joins (concatenate, stack), reversals and splits."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from podscale.parallel.partition.jaxprs import global_shape
from podscale.parallel.partition.layouts import REPLICATED, Split

if TYPE_CHECKING:
    from podscale.parallel.partition.core import Partitioner


def _local_shape(p: Partitioner, shape, dim: int):
    shape = list(shape)
    shape[dim] = p.block(shape[dim])
    return tuple(shape)


def broadcast_in_dim(p: Partitioner, eqn, ins):
    (v, lay), *dyn = ins
    if dyn or not isinstance(lay, Split):
        return None
    out_dim = eqn.params["broadcast_dimensions"][lay.dim]
    in_shape, shape = global_shape(eqn.invars[0]), eqn.params["shape"]
    if in_shape[lay.dim] != shape[out_dim]:
        return None
    out = p.bind(eqn, [v], shape=_local_shape(p, shape, out_dim), sharding=None)
    return [(out[0], Split(out_dim))]


def broadcast_block(p: Partitioner, eqn, operand, dim: int):
    """This replica's block of ``dim`` of a whole value that ``eqn`` (a ``broadcast_in_dim``)
    made from ``operand``: the broadcast itself at the block's size (of the operand's block where
    the operand has that dimension), so the whole broadcast (a causal mask or a ``-inf`` filler
    the size of the global batch's attention logits, 275 GB per device at 1024 replicas of 4
    sequences of 8192 tokens) is never made. Exact: a block of a broadcast is a broadcast."""
    shape, dims = list(eqn.params["shape"]), tuple(eqn.params["broadcast_dimensions"])
    if dim in dims and np.shape(operand)[dims.index(dim)] != 1:
        operand = p.slice_rows(operand, dims.index(dim))
    shape[dim] = p.block(shape[dim])
    return p.bind(eqn, [operand], shape=tuple(shape), sharding=None)[0]


def _reshape_dim(in_shape, out_shape, dim: int, n: int):
    """The output dimension a split of input ``dim`` becomes under a row-major reshape, if the
    blocks stay contiguous: the dimensions before it keep their product, and ``dim`` is merged
    with later ones, split into a leading factor, or kept."""
    before = math.prod(in_shape[:dim])
    acc = 1
    for j, size in enumerate(out_shape):
        if acc == before:
            # out dim j starts where input dim `dim` starts
            if size == in_shape[dim]:
                return j
            if size > in_shape[dim] and size % in_shape[dim] == 0:  # merged with later dims
                rest = size // in_shape[dim]
                if math.prod(in_shape[dim + 1 :]) % rest == 0 and _prefix_product(in_shape[dim + 1 :], rest):
                    return j
                return None
            if size < in_shape[dim] and in_shape[dim] % size == 0 and size % n == 0:  # leading factor
                return j
            return None
        acc *= size
        if acc > before:
            return None
    return None


def _prefix_product(dims, target) -> bool:
    acc = 1
    for d in dims:
        if acc == target:
            return True
        acc *= d
    return acc == target


def reshape(p: Partitioner, eqn, ins):
    (v, lay), *dyn = ins
    if dyn or not isinstance(lay, Split) or eqn.params.get("dimensions") is not None:
        return None
    in_shape, out_shape = global_shape(eqn.invars[0]), tuple(eqn.params["new_sizes"])
    out_dim = _reshape_dim(in_shape, out_shape, lay.dim, p.n)
    if out_dim is not None and (
        out_shape[out_dim] == in_shape[lay.dim] or (p.divides(in_shape, lay.dim) and p.divides(out_shape, out_dim))
    ):  # (a dimension split in padded blocks, a table's rows, keeps its blocks only whole)
        out = p.bind(eqn, [v], new_sizes=_local_shape(p, out_shape, out_dim), sharding=None)
        if lay.dim == 0 and out_dim == 0 and len(out_shape) > 1 and out_shape[0] * out_shape[1] == in_shape[0]:
            p.microbatches[id(out[0])] = out[0]  # rows cut into microbatches, each replica's whole ones
        return [(out[0], Split(out_dim))]
    return regrouped(p, eqn, v, lay, out_shape)


def regrouped(p: Partitioner, eqn, v, lay: Split, out_shape):
    """A reshape that regroups the split rows so that no replica's block stays one block of the
    result (the global batch of 32 as 2 microbatches of 16 on 8 replicas: a replica's 4 rows are
    half of one microbatch). The rows are gathered (a collective of the input's size), reshaped,
    and each replica keeps its block of the first dimension of the result that the replicas divide
    (each microbatch's 16 rows, 2 per replica), so the work after it stays split; ``None`` where
    no dimension is divided (the reshape then runs whole)."""
    dim = next((d for d in range(len(out_shape)) if p.divides(out_shape, d)), None)
    if dim is None:
        return None
    (whole,) = p.bind(eqn, [p.whole(v, lay)])
    return [(p.slice_rows(whole, dim), Split(dim))]


def transpose(p: Partitioner, eqn, ins):
    ((v, lay),) = ins
    perm = tuple(eqn.params["permutation"])
    return [(p.bind(eqn, [v])[0], Split(perm.index(lay.dim)))]


def squeeze(p: Partitioner, eqn, ins):
    ((v, lay),) = ins
    dims = tuple(d % len(global_shape(eqn.invars[0])) for d in eqn.params["dimensions"])
    if lay.dim in dims:
        return None
    return [(p.bind(eqn, [v])[0], Split(lay.dim - sum(d < lay.dim for d in dims)))]


def slice_op(p: Partitioner, eqn, ins):
    ((v, lay),) = ins
    shape = global_shape(eqn.invars[0])
    d = lay.dim
    start, limit = list(eqn.params["start_indices"]), list(eqn.params["limit_indices"])
    strides = eqn.params["strides"]
    if start[d] != 0 or limit[d] != shape[d] or (strides and strides[d] != 1):
        return None
    limit[d] = p.block(limit[d])
    return [(p.bind(eqn, [v], limit_indices=tuple(limit))[0], lay)]


def dynamic_slice(p: Partitioner, eqn, ins):
    (v, lay), *idx = ins
    if any(il is not REPLICATED for _, il in idx) or not isinstance(lay, Split):
        return None
    sizes = list(eqn.params["slice_sizes"])
    if sizes[lay.dim] != global_shape(eqn.invars[0])[lay.dim]:
        return None
    sizes[lay.dim] = p.block(sizes[lay.dim])
    return [(p.bind(eqn, [v, *[i for i, _ in idx]], slice_sizes=tuple(sizes))[0], lay)]


def dynamic_update_slice(p: Partitioner, eqn, ins):
    (op, ol), (upd, ul), *idx = ins
    if any(il is not REPLICATED for _, il in idx):
        return None
    dim = ol.dim if isinstance(ol, Split) else ul.dim if isinstance(ul, Split) else None
    if dim is None:
        return None
    oshape, ushape = global_shape(eqn.invars[0]), global_shape(eqn.invars[1])
    if ushape[dim] != oshape[dim] or not p.splittable(oshape, dim):
        return None
    op, upd = p.convert(op, ol, Split(dim)), p.convert(upd, ul, Split(dim))
    return [(p.bind(eqn, [op, upd, *[i for i, _ in idx]])[0], Split(dim))]


def pad(p: Partitioner, eqn, ins):
    (v, lay), (pv, pl) = ins
    if not isinstance(lay, Split) or pl is not REPLICATED:
        return None
    config = eqn.params["padding_config"]
    if tuple(config[lay.dim]) != (0, 0, 0):
        return None
    return [(p.bind(eqn, [v, pv])[0], lay)]


def _split_operands(p: Partitioner, eqn, ins, along: int):
    """The one split dimension of ``ins`` (not ``along``) and every operand split on it, or
    ``None``: for ops that join operands along another dimension."""
    dims = {lay.dim for _, lay in ins if isinstance(lay, Split)}
    if len(dims) != 1 or along in dims:
        return None
    (dim,) = dims
    vals = []
    for (v, lay), var in zip(ins, eqn.invars, strict=True):
        if not (isinstance(lay, Split) or p.splittable(global_shape(var), dim)):
            return None
        vals.append(p.convert(v, lay, Split(dim)))
    return dim, vals


def concatenate(p: Partitioner, eqn, ins):
    found = _split_operands(p, eqn, ins, eqn.params["dimension"])
    if found is None:
        return None
    dim, vals = found
    return [(p.bind(eqn, vals)[0], Split(dim))]


def stack(p: Partitioner, eqn, ins):
    found = _split_operands(p, eqn, ins, -1)  # the new axis is not an operand's
    if found is None:
        return None
    dim, vals = found
    return [(p.bind(eqn, vals)[0], Split(dim + 1 if eqn.params["axis"] <= dim else dim))]


def unstack(p: Partitioner, eqn, ins):
    """The transpose of ``stack``: each piece keeps the split, one dimension lower past the axis."""
    ((v, lay),) = ins
    if not isinstance(lay, Split) or lay.dim == eqn.params["axis"]:
        return None
    return [(o, Split(lay.dim - 1 if eqn.params["axis"] < lay.dim else lay.dim)) for o in p.bind(eqn, [v])]


def rev(p: Partitioner, eqn, ins):
    ((v, lay),) = ins
    if lay.dim in eqn.params["dimensions"]:
        return None
    return [(p.bind(eqn, [v])[0], lay)]


def split_op(p: Partitioner, eqn, ins):
    ((v, lay),) = ins
    if lay.dim == eqn.params["axis"]:
        return None
    return [(o, lay) for o in p.bind(eqn, [v])]
