"""The rules for ops that pair the dimensions of their operands: contractions (``dot_general``,
convolutions), which give a partial sum where they contract the split rows, and indexing
(``gather``, ``scatter``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
from jax.extend import core
from jax.sharding import PartitionSpec as P

from podscale.parallel.partition import tables
from podscale.parallel.partition.jaxprs import global_shape, source_at
from podscale.parallel.partition.layouts import PARTIAL, REPLICATED, Split
from podscale.parallel.partition.sums import narrow_float

if TYPE_CHECKING:
    from podscale.parallel.partition.core import Partitioner


def split_spatially(eqn, x, spec, axes: tuple[str, ...]):
    """``x``, an operand or the result of the convolution ``eqn`` with dimension spec ``spec``
    (batch, feature, spatial...), constrained to be split over ``axes``, the mesh axes left to
    XLA's partitioner, by its spatial dimensions in order (the height over the first, the width
    over the second). XLA's partitioner (JAX 0.10.2, Shardy and GSPMD alike) returns a
    convolution's kernel gradient times the size of an auto axis its input is not split over
    (tests/test_compose.py holds the gap in plain JAX). With the input, the kernel (or, in a
    kernel's gradient, the output's cotangent) and the result all split by every axis, each
    convolution is one device's up to summation order, whatever the rules split the kernel by and
    whether or not the axes divide the map (XLA pads an uneven split). Measured, the input alone
    was not enough once a rule split a kernel by its input features, nor input and kernel for a
    convolution after a strided stem."""
    spatial = spec[2:]
    if len(spatial) < len(axes):
        raise ValueError(
            f"conv_general_dilated{source_at(eqn)}: a convolution with {len(spatial)} spatial dimension(s) cannot be split over "
            f"the {len(axes)} mesh axes {axes} podscale leaves to XLA (one per spatial dimension); split "
            "images (space_axis) or weights (model_axis), not both"
        )
    dims: list[str | None] = [None] * len(spec)
    for d, axis in zip(spatial, axes, strict=False):
        dims[d] = axis
    return jax.lax.with_sharding_constraint(x, P(*dims))


def dot_general(p: Partitioner, eqn, ins):
    (lhs, ll), (rhs, rl) = ins
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lc, rc, lb, rb = map(tuple, (lc, rc, lb, rb))
    lshape, rshape = global_shape(eqn.invars[0]), global_shape(eqn.invars[1])
    lfree = [d for d in range(len(lshape)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(rshape)) if d not in rc and d not in rb]
    nb = len(lb)
    changes = {"out_sharding": None} if "out_sharding" in eqn.params else {}

    def done(l_val, r_val, layout):
        if layout is PARTIAL and narrow_float(eqn.outvars[0].aval.dtype):  # accumulated in float32
            return [(o, layout) for o in p.wide_bind(eqn, [l_val, r_val], **changes)]
        return [(o, layout) for o in p.bind(eqn, [l_val, r_val], **changes)]

    if isinstance(ll, Split) and isinstance(rl, Split):
        d, e = ll.dim, rl.dim
        if d in lc and e == rc[lc.index(d)]:
            return done(lhs, rhs, PARTIAL)
        if d in lb and e == rb[lb.index(d)]:
            return done(lhs, rhs, Split(lb.index(d)))
        return None
    if isinstance(ll, Split):
        d = ll.dim
        if d in lc:
            e = rc[lc.index(d)]
            return done(lhs, p.slice_rows(rhs, e), PARTIAL) if p.splittable(rshape, e) else None
        if d in lb:
            e = rb[lb.index(d)]
            return done(lhs, p.slice_rows(rhs, e), Split(lb.index(d))) if p.splittable(rshape, e) else None
        return done(lhs, rhs, Split(nb + lfree.index(d)))
    e = rl.dim
    if e in rc:
        d = lc[rc.index(e)]
        return done(p.slice_rows(lhs, d), rhs, PARTIAL) if p.splittable(lshape, d) else None
    if e in rb:
        d = lb[rb.index(e)]
        return done(p.slice_rows(lhs, d), rhs, Split(rb.index(e))) if p.splittable(lshape, d) else None
    return done(lhs, rhs, Split(nb + len(lfree) + rfree.index(e)))


def conv(p: Partitioner, eqn, ins):
    (lhs, ll), (rhs, rl) = ins
    prm = eqn.params
    dn = prm["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    if prm["batch_group_count"] != 1:
        return None  # a grouped convolution's kernel gradient: groups of the batch
    if isinstance(ll, Split) and rl is REPLICATED and ll.dim == lhs_spec[0]:
        return [(o, Split(out_spec[0])) for o in p.bind(eqn, [lhs, rhs])]  # the batch: row by row
    if prm["feature_group_count"] != 1:
        return None
    if isinstance(ll, Split) and isinstance(rl, Split) and ll.dim == lhs_spec[1] and rl.dim == rhs_spec[1]:
        # contracts the split batch (a kernel's gradient), accumulated in float32 for a narrow type
        if narrow_float(eqn.outvars[0].aval.dtype):
            return [(o, PARTIAL) for o in p.wide_bind(eqn, [lhs, rhs])]
        return [(o, PARTIAL) for o in p.bind(eqn, [lhs, rhs])]
    return None


def gather(p: Partitioner, eqn, ins):
    (op, ol), (idx, il) = ins
    dn = eqn.params["dimension_numbers"]
    oshape, ishape = global_shape(eqn.invars[0]), global_shape(eqn.invars[1])
    out_rank = len(global_shape(eqn.outvars[0]))
    offset_dims = tuple(dn.offset_dims)
    batch_out = [d for d in range(out_rank) if d not in offset_dims]  # one per index dim but the last
    obatch, ibatch = tuple(dn.operand_batching_dims), tuple(dn.start_indices_batching_dims)
    window = [d for d in range(len(oshape)) if d not in dn.collapsed_slice_dims and d not in obatch]
    slice_sizes = list(eqn.params["slice_sizes"])
    if isinstance(ol, Split) and ol.dim in dn.start_index_map:  # a table split by rows, looked up
        return tables.lookup(p, eqn, ins)
    # Batching dimensions (take_along_axis): operand rows pair with index rows.
    for d, i in zip(obatch, ibatch, strict=True):
        if ol in (Split(d), REPLICATED) and il in (Split(i), REPLICATED) and (ol == Split(d) or il == Split(i)):
            if not (p.splittable(oshape, d) and p.splittable(ishape, i)):
                return None
            vals = [p.convert(op, ol, Split(d)), p.convert(idx, il, Split(i))]
            return [(o, Split(batch_out[i])) for o in p.bind(eqn, vals)]
    if ol is REPLICATED and isinstance(il, Split) and il.dim < len(ishape) - 1 and il.dim not in ibatch:
        return [(o, Split(batch_out[il.dim])) for o in p.bind(eqn, [op, idx])]
    if isinstance(ol, Split) and il is REPLICATED:
        d = ol.dim
        if d in window and d not in dn.start_index_map and slice_sizes[d] == oshape[d]:
            slice_sizes[d] = p.block(slice_sizes[d])
            out = p.bind(eqn, [op, idx], slice_sizes=tuple(slice_sizes))
            return [(out[0], Split(offset_dims[window.index(d)]))]
    return None


def scatter(p: Partitioner, eqn, ins):
    (op, ol), (idx, il), (upd, ul) = ins
    dn = eqn.params["dimension_numbers"]
    oshape, ishape, ushape = (global_shape(v) for v in eqn.invars)
    obatch, ibatch = tuple(dn.operand_batching_dims), tuple(dn.scatter_indices_batching_dims)
    window = [d for d in range(len(oshape)) if d not in dn.inserted_window_dims and d not in obatch]
    upd_scatter = [d for d in range(len(ushape)) if d not in dn.update_window_dims]  # one per index dim but the last
    if ol is PARTIAL:
        return None
    # A window dimension that no index addresses: rows go to the same rows.
    for d in window:
        ud = dn.update_window_dims[window.index(d)]
        if d in dn.scatter_dims_to_operand_dims or ushape[ud] != oshape[d] or il is not REPLICATED:
            continue
        if ol in (Split(d), REPLICATED) and ul in (Split(ud), REPLICATED) and (ol == Split(d) or ul == Split(ud)):
            if not p.splittable(oshape, d):
                return None
            vals = [p.convert(op, ol, Split(d)), idx, p.convert(upd, ul, Split(ud))]
            return [(o, Split(d)) for o in p.bind(eqn, vals)]
    # Batching dimensions: operand rows, index rows and update rows pair up.
    for d, i in zip(obatch, ibatch, strict=True):
        if i >= len(ishape) - 1:
            continue
        ud = upd_scatter[i]
        lays = (ol, il, ul)
        if all(lay in (want, REPLICATED) for lay, want in zip(lays, (Split(d), Split(i), Split(ud)))) and any(
            isinstance(lay, Split) for lay in lays
        ):
            if not (p.splittable(oshape, d) and p.splittable(ishape, i) and p.splittable(ushape, ud)):
                return None
            vals = [p.convert(op, ol, Split(d)), p.convert(idx, il, Split(i)), p.convert(upd, ul, Split(ud))]
            return [(o, Split(d)) for o in p.bind(eqn, vals)]
    if eqn.primitive.name not in ("scatter-add", "scatter_add"):
        return None
    rows = p.table_rows_of(eqn.outvars[0])
    if rows:  # the gradient of a table split by rows: it stays split by rows
        out = tables.gradient(p, eqn, ins, rows)
        if out is not None:
            return out
    # Rows of updates scattered into a whole operand (an embedding's gradient): each replica adds
    # its rows; the operand is counted once (on replica 0), so the result is a partial sum.
    if isinstance(il, Split) and il.dim < len(ishape) - 1 and il.dim not in ibatch:
        i = il.dim
    elif isinstance(ul, Split) and ul.dim in upd_scatter:
        i = upd_scatter.index(ul.dim)
    else:
        return None
    ud = upd_scatter[i]
    if ol is not REPLICATED or il not in (Split(i), REPLICATED) or ul not in (Split(ud), REPLICATED):
        return None
    if not (p.splittable(ishape, i) and p.splittable(ushape, ud)):
        return None
    zero = not isinstance(eqn.invars[0], core.Literal) and eqn.invars[0] in p._zeros
    operand = op if zero else p.convert(op, REPLICATED, PARTIAL)
    vals = [operand, p.convert(idx, il, Split(i)), p.convert(upd, ul, Split(ud))]
    if narrow_float(vals[0].dtype):  # added up in float32, rounded after the sum over the replicas
        return [(o, PARTIAL) for o in p.wide_bind(eqn, vals)]
    return [(o, PARTIAL) for o in p.bind(eqn, vals)]
