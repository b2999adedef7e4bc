"""Partitions the single-device step, traced at the *global* batch shape, over the data axes.

The specification is the user's step run on one device on the whole batch. podscale traces that
program (``jax.make_jaxpr`` at the global shapes, loops kept as loops) and evaluates it inside a
``shard_map`` that is manual over the data axes, carrying a *layout* with every value:

* ``REPLICATED``: the whole value, the same on every replica (weights, scalars, optimizer state);
* :class:`Split` ``(dim)``: this replica's contiguous block of ``dim`` (the batch and everything
  computed row by row from it), in the order of ``lax.axis_index(axes)``;
* ``PARTIAL``: a value of the whole shape whose *sum over the replicas* is the true value: what a
  reduction over a split dimension leaves (a weight's gradient, a token count, a loss's sum).

An equation with a rule runs on the local pieces and says its output layout (an elementwise op on
split rows stays split, a ``dot_general`` contracting the split batch gives a partial sum, ...).
A partial sum stays partial through sums and shape-only ops (so a weight used at every time step
of a loop, or in two places, is summed once) and is resolved by one ``psum`` (bound as
``psum_invariant``, which :mod:`podscale.parallel.weight_update` defers, fuses and, with the
sharded update, turns into a reduce-scatter) when something nonlinear reads it. An equation
without a rule gets its operands made whole (all-gathered or summed), which is always correct, and
is listed in ``Partitioner.whole_ops`` for the plan. Nothing is rescaled: a mean over the batch divides by the
global count because the program says so, and a sum, a weighted mean or a per-example gradient
comes out as on one device.

A partial sum in a 16-bit float type is held in float32 (its *wide* form): the local reduction
that makes it (a ``dot_general``, a convolution, a ``reduce_sum``, a ``scatter-add``) accumulates
in float32, the sum over the replicas is taken in float32, and the result is rounded to the
program's type once, after that sum. One device rounds the whole batch's sum once too, so the
result is its rounding up to summation order: a float16 gradient overflows (and a loss-scaled
step is skipped) exactly where one device's does, not where one replica's share happens to.
"""

from podscale.parallel.interpret import ELEMENTWISE
from podscale.parallel.partition.core import Partitioner
from podscale.parallel.partition.layouts import GROUP, PARTIAL, REPLICATED, Layout, Split, join
from podscale.parallel.partition.setup import Setup
from podscale.parallel.partition.sums import WIDE, one_replica_sum

__all__ = [
    "ELEMENTWISE",
    "GROUP",
    "PARTIAL",
    "REPLICATED",
    "WIDE",
    "Layout",
    "Partitioner",
    "Setup",
    "Split",
    "join",
    "one_replica_sum",
]
