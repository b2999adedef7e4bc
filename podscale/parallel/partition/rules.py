"""The rules for split values: elementwise ops, reductions, ops along one dimension, pooling
windows, and the table (``RULES``) of every op's rule, with the shape ops' of :mod:`.shape_rules`
and the contractions' and indexing ops' of :mod:`.contract_rules`. A rule runs an equation on the
local pieces and gives its output layouts, or returns ``None`` (the equation is then computed on
whole values)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax.numpy as jnp
from jax import lax

from podscale.parallel.interpret import KEY_OPS
from podscale.parallel.partition.contract_rules import conv, dot_general, gather, scatter
from podscale.parallel.partition.jaxprs import global_shape
from podscale.parallel.partition.layouts import PARTIAL, REPLICATED, Split
from podscale.parallel.partition.shape_rules import (
    broadcast_in_dim,
    concatenate,
    dynamic_slice,
    dynamic_update_slice,
    pad,
    reshape,
    rev,
    slice_op,
    split_op,
    squeeze,
    stack,
    transpose,
    unstack,
)
from podscale.parallel.partition.sums import narrow_float, widen

if TYPE_CHECKING:
    from podscale.parallel.partition.core import Partitioner


def elementwise(p: Partitioner, eqn, ins):
    name = eqn.primitive.name
    shape = global_shape(eqn.outvars[0])
    dims = {lay.dim for _, lay in ins if isinstance(lay, Split)}
    if len(dims) != 1:
        return None
    (dim,) = dims
    if name in KEY_OPS and name != "random_fold_in" and dim >= len(eqn.invars[0].aval.shape):
        return None  # random-key ops extend their key's shape; only the key's dimensions split
    # (fold_in broadcasts a key against its data, position by position: it extends nothing.)
    if name == "bitcast_convert_type" and dim >= min(len(shape), len(eqn.invars[0].aval.shape)) - (
        len(shape) != len(eqn.invars[0].aval.shape)
    ):
        return None  # a change of width adds or drops the last dimension
    vals = []
    for (v, lay), var in zip(ins, eqn.invars, strict=True):
        vshape = tuple(getattr(var.aval, "shape", ()))
        if isinstance(lay, Split):
            vals.append(v)
        elif vshape == ():
            vals.append(v)
        elif len(vshape) > dim and vshape[dim] == 1:
            vals.append(v)  # a size-1 dimension broadcasts (jaxprs allow it in elementwise ops)
        elif len(vshape) > dim and vshape[dim] == shape[dim] and p.splittable(vshape, dim):
            vals.append(p.slice_rows(v, dim))
        else:
            return None
    return [(o, Split(dim)) for o in p.bind(eqn, vals)]


def _reduce(p: Partitioner, eqn, ins):
    ((v, lay),) = ins
    axes = tuple(eqn.params["axes"])
    name = eqn.primitive.name
    local = p.bind(eqn, [v], **({"out_sharding": None} if "out_sharding" in eqn.params else {}))[0]
    if lay.dim not in axes:
        return [(local, Split(lay.dim - sum(a < lay.dim for a in axes)))]
    if p.padded_rows(v, lay) is not None and name in ("reduce_max", "reduce_min"):  # padding rows: the identity
        big = jnp.inf if jnp.issubdtype(v.dtype, jnp.inexact) else jnp.iinfo(v.dtype).max
        v = p.mask_padding(v, lay, -big if name == "reduce_max" else big)
        local = p.bind(eqn, [v], **({"out_sharding": None} if "out_sharding" in eqn.params else {}))[0]
    if name == "reduce_sum":
        if narrow_float(v.dtype):  # accumulated in float32, rounded after the sum over the replicas
            local = p.bind(eqn, [widen(v)], **({"out_sharding": None} if "out_sharding" in eqn.params else {}))[0]
        return [(local, PARTIAL)]
    collective = {"reduce_max": lax.pmax, "reduce_min": lax.pmin}.get(name)
    if collective is None:
        return None
    if p.one:
        return [(local, REPLICATED)]
    p.record("all-reduce", p.axes, local, f"{name} over the rows")
    return [(collective(local, p.axes), REPLICATED)]


def _reduce_or_and(p: Partitioner, eqn, ins):
    ((v, lay),) = ins
    axes = tuple(eqn.params["axes"])
    local = p.bind(eqn, [v])[0]
    if lay.dim not in axes:
        return [(local, Split(lay.dim - sum(a < lay.dim for a in axes)))]
    if p.padded_rows(v, lay) is not None:  # padding rows: the identity (False for any, True for all)
        local = p.bind(eqn, [p.mask_padding(v, lay, eqn.primitive.name == "reduce_and")])[0]
    if p.one:
        return [(local, REPLICATED)]
    as_int = local.astype(jnp.int32)
    combined = lax.pmax(as_int, p.axes) if eqn.primitive.name == "reduce_or" else lax.pmin(as_int, p.axes)
    p.record("all-reduce", p.axes, combined, f"{eqn.primitive.name} over the rows")
    return [(combined.astype(local.dtype), REPLICATED)]


def _along_other_dim(param: str):
    """Ops along one dimension (``argmax``, ``cumsum``, ``sort``...): split elsewhere, they run
    on the local rows."""

    def rule(p: Partitioner, eqn, ins):
        dims = {lay.dim for _, lay in ins if isinstance(lay, Split)}
        if len(dims) != 1:
            return None
        (dim,) = dims
        value = eqn.params[param]
        along = tuple(value) if isinstance(value, (tuple, list)) else (value,)
        rank = len(global_shape(eqn.invars[0]))
        if dim in tuple(a % rank for a in along):
            return None
        vals = [v if isinstance(lay, Split) else p.slice_rows(v, dim) for v, lay in ins]
        out_dim = dim
        if eqn.primitive.name in ("argmax", "argmin"):
            out_dim = dim - sum(a < dim for a in along)
        return [(o, Split(out_dim)) for o in p.bind(eqn, vals)]

    return rule


def _windowed(p: Partitioner, eqn, ins):
    """Pooling (``reduce_window_*``, and ``select_and_scatter_add``/``select_and_gather_add`` of
    its derivative): a window of size 1, stride 1, no padding along the split dimension runs on
    the local rows."""
    dims = {lay.dim for _, lay in ins if isinstance(lay, Split)}
    if len(dims) != 1:
        return None
    (dim,) = dims
    prm = eqn.params
    if prm["window_dimensions"][dim] != 1 or prm["window_strides"][dim] != 1 or tuple(prm["padding"][dim]) != (0, 0):
        return None
    for key in ("base_dilation", "window_dilation"):
        if key in prm and prm[key][dim] != 1:
            return None
    vals = []
    for (v, lay), var in zip(ins, eqn.invars, strict=True):
        shape = global_shape(var)
        if shape == ():
            vals.append(v)  # an init value
        elif isinstance(lay, Split) or p.splittable(shape, dim):
            vals.append(p.convert(v, lay, Split(dim)))
        else:
            return None
    return [(o, Split(dim)) for o in p.bind(eqn, vals)]


def _optimization_barrier(p: Partitioner, eqn, ins):
    outs = p.bind(eqn, [v for v, _ in ins])
    return list(zip(outs, [lay for _, lay in ins], strict=True))


RULES = {
    "broadcast_in_dim": broadcast_in_dim,
    "reshape": reshape,
    "transpose": transpose,
    "squeeze": squeeze,
    "reduce_sum": _reduce,
    "reduce_max": _reduce,
    "reduce_min": _reduce,
    "reduce_prod": _reduce,
    "reduce_or": _reduce_or_and,
    "reduce_and": _reduce_or_and,
    "argmax": _along_other_dim("axes"),
    "argmin": _along_other_dim("axes"),
    "cumsum": _along_other_dim("axis"),
    "cumprod": _along_other_dim("axis"),
    "cummax": _along_other_dim("axis"),
    "cummin": _along_other_dim("axis"),
    "cumlogsumexp": _along_other_dim("axis"),
    "sort": _along_other_dim("dimension"),
    "top_k": _along_other_dim("axis"),
    "dot_general": dot_general,
    "conv_general_dilated": conv,
    "gather": gather,
    "scatter-add": scatter,
    "scatter_add": scatter,
    "scatter": scatter,
    "slice": slice_op,
    "dynamic_slice": dynamic_slice,
    "dynamic_update_slice": dynamic_update_slice,
    "pad": pad,
    "concatenate": concatenate,
    "rev": rev,
    "stack": stack,
    "unstack": unstack,
    "split": split_op,
    "optimization_barrier": _optimization_barrier,
    "reduce_window_max": _windowed,
    "reduce_window_min": _windowed,
    "reduce_window_sum": _windowed,
    "reduce_window": _windowed,
    "select_and_scatter_add": _windowed,
    "select_and_gather_add": _windowed,
}
