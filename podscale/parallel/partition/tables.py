"""Embedding tables split by rows over the data axes: the lookup and its gradient, on pieces.

A table the placement splits by rows (:mod:`podscale.parallel.tables`) enters the step as
``Split(0)``: this replica's block of ``local_rows`` consecutive rows (the last block padded with
zero rows where the replicas do not divide the table). Two rules run the single device's ops on
it, with no dense collective of the table's size:

- **the lookup** (``gather`` of rows by ids): the batch's ids are all-gathered over the data
  axes, each replica gathers the rows it holds (an id outside its block reads a zero row), and a
  ``psum_scatter`` of the looked-up rows returns to each replica the rows of its own examples.
  Every row is one replica's value plus zeros: the single device's bits. Ids the step holds whole
  (not split by rows) give a partial sum instead, summed where it is read;
- **its gradient** (``scatter-add`` of the rows' cotangents into a zero table): the cotangent rows
  and their ids are all-gathered, and each replica adds, in the single device's order, the rows
  whose ids fall in its block into its own zero block. The gradient stays ``Split(0)``, so the
  optimizer updates each replica's rows where they live.

Out-of-range ids follow the op's mode as one device does: clamped (``clip``, ``promise_in_bounds``
for a gather), dropped (a scatter's), or the fill value (a gather's ``fill``).

Per step and table, each replica moves ``B x 4`` bytes of ids and ``B x d`` values each way (the
batch's rows), where a replicated table all-reduces its whole ``R x d`` gradient.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax.numpy as jnp
from jax import lax
from jax.extend import core

from podscale._jax import all_gather_invariant
from podscale.parallel.partition.jaxprs import global_shape
from podscale.parallel.partition.layouts import PARTIAL, REPLICATED, Split

if TYPE_CHECKING:
    from podscale.parallel.partition.core import Partitioner

_CLAMPED = ("CLIP", "PROMISE_IN_BOUNDS")


def _mode(eqn) -> str:
    return getattr(eqn.params["mode"], "name", str(eqn.params["mode"]))


def _whole(p: Partitioner, x, layout, why: str):
    """``x`` whole: all-gathered over the data axes when split by rows (recorded for the plan)."""
    if layout is REPLICATED or p.one:
        return x
    key = (id(x), layout, "table rows")
    hit = p._memo.get(key)
    if hit is not None and hit[0] is x:  # the ids of a lookup, gathered again for its gradient
        return hit[1]
    p.communications += 1
    p.record("all-gather", p.axes, x, why)
    out = all_gather_invariant(x, p.axes, axis=layout.dim, tiled=True)
    p._memo[key] = (x, out)
    return out


def _local_ids(p: Partitioner, ids, rows: int, local_rows: int, clamp: bool):
    """Ids into this replica's block of ``local_rows``; ids outside the block (or outside the
    table's ``rows``, unless clamped) point one past it (a gather in fill mode reads a zero row
    there, a scatter drops the update)."""
    if clamp:
        ids = jnp.clip(ids, 0, rows - 1)
    local = ids - p.index() * local_rows
    inside = (local >= 0) & (local < local_rows) & (ids >= 0) & (ids < rows)
    return jnp.where(inside, local, local_rows).astype(ids.dtype)


def lookup(p: Partitioner, eqn, ins):
    """``gather`` of rows of a table split by rows (``Split(0)`` on the indexed dimension), or
    ``None`` where the op is not such a lookup."""
    (table, tl), (ids, il) = ins
    dn = eqn.params["dimension_numbers"]
    shape, ishape = global_shape(eqn.invars[0]), global_shape(eqn.invars[1])
    if not (isinstance(tl, Split) and tl.dim == 0 and tuple(dn.start_index_map) == (0,)):
        return None
    if 0 not in dn.collapsed_slice_dims or dn.operand_batching_dims or ishape[-1] != 1:
        return None
    if il is not REPLICATED and not (isinstance(il, Split) and il.dim < len(ishape) - 1):
        return None
    local_rows = table.shape[0]
    mode = _mode(eqn)
    whole = _whole(p, ids, il, "ids of a table split by rows, for the lookup and its gradient")
    local = _local_ids(p, whole, shape[0], local_rows, clamp=mode in _CLAMPED)
    (rows,) = p.bind(eqn, [table, p.vary(local)], mode=lax.GatherScatterMode.FILL_OR_DROP, fill_value=0)
    if mode not in _CLAMPED:  # fill: an id outside the table reads the fill value on one device
        valid = (whole >= 0) & (whole < shape[0])
        fill = eqn.params["fill_value"]
        fill = jnp.nan if fill is None and jnp.issubdtype(rows.dtype, jnp.inexact) else (fill or 0)
        rows = jnp.where(_broadcast_rows(valid, rows, dn), rows, jnp.where(p.index() == 0, fill, 0).astype(rows.dtype))
    if il is REPLICATED:
        return [(rows, PARTIAL)]
    out_rank = len(global_shape(eqn.outvars[0]))
    batch_out = [d for d in range(out_rank) if d not in dn.offset_dims]
    dim = batch_out[il.dim]
    if p.one:
        return [(rows, Split(dim))]
    p.record("reduce-scatter", p.axes, rows, "looked-up rows of a table split by rows, to their examples")
    p.communications += 1
    return [(lax.psum_scatter(rows, p.axes, scatter_dimension=dim, tiled=True), Split(dim))]


def _broadcast_rows(valid, rows, dn):
    """``valid`` ([..., 1] per looked-up row) broadcast over the rows' offset dimensions."""
    v = valid[..., 0]
    for d in sorted(dn.offset_dims):
        v = jnp.expand_dims(v, d)
    return jnp.broadcast_to(v, rows.shape)


def gradient(p: Partitioner, eqn, ins, local_rows: int):
    """``scatter-add`` of rows into a zero table the placement splits by rows (the lookup's
    transpose): the result ``Split(0)``, or ``None`` where the op is not such a gradient."""
    (_, ol), (ids, il), (upd, ul) = ins
    dn = eqn.params["dimension_numbers"]
    shape, ishape, ushape = (global_shape(v) for v in eqn.invars)
    if tuple(dn.scatter_dims_to_operand_dims) != (0,) or 0 not in dn.inserted_window_dims:
        return None
    if dn.operand_batching_dims or ishape[-1] != 1 or ol is not REPLICATED:
        return None
    if isinstance(eqn.invars[0], core.Literal) or eqn.invars[0] not in p._zeros:
        return None
    upd_scatter = [d for d in range(len(ushape)) if d not in dn.update_window_dims]
    if not (ul is REPLICATED or (isinstance(ul, Split) and ul.dim in upd_scatter)):
        return None
    whole_ids = _whole(p, ids, il, "ids of a table split by rows, for the lookup and its gradient")
    whole_upd = _whole(p, upd, ul, "cotangents of looked-up rows, to the replicas holding them")
    local = _local_ids(p, whole_ids, shape[0], local_rows, clamp=_mode(eqn) == "CLIP")
    zeros = p.vary(jnp.zeros((local_rows, *shape[1:]), eqn.outvars[0].aval.dtype))
    (out,) = p.bind(eqn, [zeros, p.vary(local), p.vary(whole_upd)], mode=lax.GatherScatterMode.FILL_OR_DROP)
    return [(out, Split(0))]
