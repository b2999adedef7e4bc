"""The rules of partial sums (``PARTIAL``): the equations a partial sum stays partial through
(:func:`partial_rule`), those through which one held in float32 for a 16-bit type stays so
(:func:`wide_rule`) or a cast one (a float32 master weight's gradient of a 16-bit product) does
(:func:`cast_rule`), and terms of a sum one device rounds apart (:func:`sums_apart`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np
from jax import lax

from podscale.parallel.partition.jaxprs import is_zero, var_dtype
from podscale.parallel.partition.layouts import GROUP, PARTIAL, REPLICATED
from podscale.parallel.partition.sums import (
    IDENTITY,
    LINEAR_SUMS,
    LINEAR_UNARY,
    WIDE,
    linear_in_partial,
    widen,
)

if TYPE_CHECKING:
    from podscale.parallel.partition.core import Partitioner

_MOVES = frozenset("neg reshape transpose squeeze expand_dims slice broadcast_in_dim rev copy copy_p".split())
"""Ops that only move (or negate) elements: they commute with rounding each element."""


def wide_rule(p: Partitioner, eqn, ins):
    """Equations through which a partial sum held in float32 stays partial (and in float32:
    the ops a partial sum stays partial through are sums and shape ops, so no rounding is
    skipped that one device would make before the sum), or ``None``."""
    name = eqn.primitive.name
    layouts = [lay for _, lay in ins]
    if name == "psum" and p.group_axis is not None and set(eqn.params["axes"]) == {p.group_axis}:
        return [p.group_sum(v, lay) for v, lay in ins]
    if name in IDENTITY and len(ins) == 1:
        return [ins[0]]
    if any(p.cast_type(v) is not None for v, _ in ins):
        return cast_rule(p, eqn, ins)
    vals = [v for v, _ in ins]
    if name == "convert_element_type" and len(ins) == 1 and p.narrow_type(vals[0]) is not None:
        new = np.dtype(eqn.params["new_dtype"])
        if jnp.issubdtype(new, jnp.floating) and new.itemsize >= WIDE.itemsize:
            # A 16-bit partial sum the program casts to a wide type (a float32 master weight's
            # gradient of a 16-bit product): still partial, its sum rounded to the 16-bit type
            # before the cast, as one device rounds the sum to the product's type whatever the
            # program casts it to afterwards (a float16 sum past 65504 is inf). A new value, so
            # that the 16-bit one (if read elsewhere) keeps its own registration.
            out = lax.copy_p.bind(vals[0]) if new == WIDE else vals[0].astype(new)
            return [(p.hold_cast(out, p.narrow_type(vals[0]), new), PARTIAL)]
    keeps = (name in LINEAR_UNARY and len(ins) == 1) or (
        name in (*LINEAR_SUMS, "concatenate", "stack") and all(lay is PARTIAL for lay in layouts)
    )
    keeps |= name == "pad" and layouts[1] is REPLICATED and is_zero(eqn.invars[1])
    keeps |= name == "dynamic_slice" and all(lay is REPLICATED for lay in layouts[1:])
    keeps |= GROUP in layouts and PARTIAL in layouts and linear_in_partial(eqn, layouts)
    if PARTIAL in layouts and id(eqn) in p.feeds_group_sum:
        keeps |= name in ("div", "mul") and layouts[1] is REPLICATED
        keeps |= name == "mul" and layouts[0] is REPLICATED
    if name in ("scatter-add", "scatter_add") and layouts[1] is REPLICATED:
        vals = [p.convert(vals[0], layouts[0], PARTIAL), vals[1], p.convert(vals[2], layouts[2], PARTIAL)]
        keeps = True
    if not keeps:
        return None
    if name in ("scatter-add", "scatter_add", "dot_general", "conv_general_dilated"):
        return [(o, PARTIAL) for o in p.wide_bind(eqn, vals)]
    vals = [widen(v) for v in vals]
    return [(o, PARTIAL) for o in p.bind(eqn, vals)]


def sums_apart(p: Partitioner, eqn, ins) -> bool:
    """Whether ``eqn`` adds terms of a sum that one device rounds apart: cast 16-bit partial sums
    (a weight used twice in 16-bit products, each use's gradient rounded to 16 bits, then
    added in float32), each summed over the replicas on its own. Their bytes past one term's
    are counted in :attr:`summed_apart_bytes`."""
    if eqn.primitive.name not in LINEAR_SUMS:
        return False
    apart = [v for v, _ in ins if p.cast_type(v) is not None or p._apart.get(id(v)) is v]
    terms = [v for v, lay in ins if lay is PARTIAL or p._apart.get(id(v)) is v]
    if not apart or len(terms) < 2:
        return False
    var = eqn.outvars[0]
    p.summed_apart_bytes += (len(terms) - 1) * math.prod(var.aval.shape) * WIDE.itemsize
    return True


def cast_rule(p: Partitioner, eqn, ins):
    """Equations through which a cast 16-bit partial sum (:meth:`cast_type`) stays partial, or
    ``None`` (then it is summed first): only those that move its elements, which commute with
    the rounding one device makes before the cast; its type goes with it."""
    name = eqn.primitive.name
    layouts = [lay for _, lay in ins]
    vals = [v for v, _ in ins]
    if name in _MOVES and len(ins) == 1:
        keeps = True
    elif name == "pad" or name == "dynamic_slice":
        keeps = p.cast_type(vals[0]) is not None and all(lay is REPLICATED for lay in layouts[1:])
        keeps &= name != "pad" or is_zero(eqn.invars[1])
    elif name == "concatenate":
        tags = {(p.narrow_type(v), p.cast_type(v)) for v in vals}
        keeps = len(tags) == 1 and None not in tags.pop() and all(lay is PARTIAL for lay in layouts)
    else:
        keeps = False
    if not keeps:
        return None
    narrow = p.narrow_type(vals[0])
    outs = p.bind(eqn, vals)
    return [(p.hold_cast(o, narrow, var_dtype(var)), PARTIAL) for o, var in zip(outs, eqn.outvars, strict=True)]


def partial_rule(p: Partitioner, eqn, ins):
    """Equations through which a partial sum stays partial, or ``None``."""
    name = eqn.primitive.name
    layouts = [lay for _, lay in ins]
    vals = [v for v, _ in ins]
    if name in LINEAR_UNARY and len(ins) == 1:
        return [(o, PARTIAL) for o in p.bind(eqn, vals)]
    if name in LINEAR_SUMS and all(lay is PARTIAL for lay in layouts):
        return [(o, PARTIAL) for o in p.bind(eqn, vals)]
    if name == "convert_element_type" and np.dtype(eqn.params["new_dtype"]) == np.dtype(vals[0].dtype):
        return [(o, PARTIAL) for o in p.bind(eqn, vals)]  # a weak type made strong: no rounding
    if name == "pad" and layouts[1] is REPLICATED and is_zero(eqn.invars[1]):
        return [(o, PARTIAL) for o in p.bind(eqn, vals)]
    if name == "dynamic_slice" and all(lay is REPLICATED for lay in layouts[1:]):
        return [(o, PARTIAL) for o in p.bind(eqn, vals)]
    if name == "dynamic_update_slice" and all(lay is REPLICATED for lay in layouts[2:]):
        # Linear in operand and update together (the gradient of a weight sliced at a start,
        # put back into a zero weight): a whole one counts once, on replica 0.
        if all(lay in (PARTIAL, REPLICATED) for lay in layouts[:2]):
            vals = [p.convert(v, lay, PARTIAL) for v, lay in zip(vals[:2], layouts[:2], strict=True)] + vals[2:]
            return [(o, PARTIAL) for o in p.bind(eqn, vals)]
    if name in ("concatenate", "stack") and all(lay is PARTIAL for lay in layouts):
        return [(o, PARTIAL) for o in p.bind(eqn, vals)]
    if name == "scatter-add" and layouts[1] is REPLICATED:
        operand = p.convert(vals[0], layouts[0], PARTIAL)
        updates = p.convert(vals[2], layouts[2], PARTIAL)
        return [(o, PARTIAL) for o in p.bind(eqn, [operand, vals[1], updates])]
    return None
