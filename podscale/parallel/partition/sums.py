"""Partial sums: the ops a partial sum stays partial through, the equations on the way to a
batch-norm group's sum, and the wide form (float32) a partial sum of a narrow float type is held in."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core

from podscale.parallel.partition.layouts import PARTIAL, Split

# Ops through which a partial sum stays partial: the sum of their results over the replicas is
# their result on the sum. Shape-only ops and sums; nothing that multiplies, so that the arithmetic
# after the sum is the single device's.
LINEAR_UNARY = frozenset(
    "neg reshape transpose squeeze expand_dims slice broadcast_in_dim reduce_sum rev copy copy_p name".split()
)
LINEAR_SUMS = frozenset("add add_any sub".split())
IDENTITY = frozenset("reshard sharding_constraint mesh_cast".split())


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)


def narrow_float(dtype) -> bool:
    """A float type narrower than float32 (float16, bfloat16, the float8s): a partial sum in it is
    held in float32."""
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating) and np.dtype(dtype).itemsize < 4


@jax.jit
def one_replica_sum(x):
    """The sum over one replica: ``x`` itself. A named call in the program, so that
    ``weight_update.replay.forward_used`` sees where a sum over the replicas would be (what is
    computed after it is the same on every replica, as after a real sum)."""
    return x


WIDE = np.dtype(np.float32)
"""The type a partial sum in a narrow float type is held in until it is summed and rounded."""


def widen(x):
    """``x`` in float32 where it is of a narrow float type (exact: every 16-bit float is a float32),
    its 16-bit rounding kept. XLA drops a round trip through a narrow type (float32 to bfloat16 and
    back: ``xla_allow_excess_precision``), so widening a value the program had just rounded would
    hand the float32 value before the rounding on: a bfloat16 activation or input cast unrounded
    into a weight's gradient, where one device rounds it (measured on XLA:CPU, ~1 step of
    bfloat16 in 40% of a gradient's elements). The barrier keeps the 16-bit value as it is."""
    if not narrow_float(getattr(x, "dtype", None)):
        return x
    return jax.lax.optimization_barrier(x).astype(WIDE)


def linear_in_partial(eqn, layouts) -> bool:
    """Whether ``eqn`` is linear in its one partial operand, the others whole."""
    if layouts.count(PARTIAL) != 1 or any(isinstance(lay, Split) for lay in layouts):
        return False
    name = eqn.primitive.name
    if name in ("mul", "dot_general", "conv_general_dilated", "neg", "convert_element_type", *LINEAR_UNARY):
        return True
    return name == "div" and layouts[0] is PARTIAL


_GROUP_FEEDERS = frozenset(
    "div mul stack concatenate reshape broadcast_in_dim convert_element_type squeeze slice transpose neg add add_any sub "
    "reduce_sum pad".split()
)


def feeding_group_sums(jaxpr, axis: str) -> set:
    """ids of the equations whose results reach a ``psum`` over ``axis`` only through scalings
    and shape ops (a mean's division by its count, flax's stacking of mean and mean square)."""
    found: set = set()
    wanted: set = set()
    for eqn in reversed(jaxpr.eqns):
        if eqn.primitive.name == "psum" and set(eqn.params["axes"]) == {axis}:
            wanted.update(v for v in eqn.invars if not isinstance(v, core.Literal))
            continue
        if eqn.primitive.name in _GROUP_FEEDERS and any(v in wanted for v in eqn.outvars):
            found.add(id(eqn))
            wanted.update(v for v in eqn.invars if not isinstance(v, core.Literal))
    return found
