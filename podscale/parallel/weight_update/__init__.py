"""Cross-replica weight-update sharding of an unmodified traced step (Xu et al., arXiv 2004.13336).

The replicated data-parallel step sums each gradient over the replicas (``psum_invariant``), then
every replica runs the same optimizer update on the full weights. Here the traced step is replayed
with values in one of two layouts:

* *full*: an ordinary value, the same on every replica (weights, scalars, small tensors);
* :class:`Sharded`: this replica's 1/N chunk of a tensor flattened in row-major order and padded
  with zeros to N chunks of :func:`chunk_layout`'s length. Every tensor of a given size uses the
  same chunking (a stored optimizer-state chunk, a reduce-scattered gradient, a sliced weight,
  alone or in a fused buffer), so two sharded operands of one shape line up element for element.

The gradient sums become one fused reduce-scatter (gradients of at least ``min_shard_size``
elements) and one fused all-reduce (the rest). Ops downstream then run on shards where that is
exact: elementwise ops (a full operand of the same shape is sliced, a scalar broadcasts), reshapes,
and reductions over a whole tensor (a local partial reduction, padding masked, plus a small
all-reduce: the per-layer norms of LARS and LAMB, global-norm clipping). Any other op that meets a
shard gets its operands all-gathered first and is recorded in the plan as computed on gathered
values, so nothing is silently wrong. Optimizer-state leaves (large float leaves the forward pass
never reads) stay sharded between steps; updated weights are all-gathered in one fused collective.

Its three ideas, one module each:

* :mod:`~podscale.parallel.weight_update.chunks`: the 1/N chunk layout (:func:`chunk_layout`,
  :class:`Sharded`, :class:`Layout`);
* :mod:`~podscale.parallel.weight_update.fusion`: the collectives and their fusion (deferred sums,
  fused reduce-scatters, all-reduces and all-gathers, :func:`gather`, the :class:`Trace` of them);
* :mod:`~podscale.parallel.weight_update.replay`: the replay of the traced step (:class:`Rewriter`,
  :func:`forward_used`).
"""

from podscale.parallel.weight_update.chunks import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_MIN_SHARD_SIZE,
    ByPartition,
    Layout,
    Sharded,
    chunk_layout,
)
from podscale.parallel.weight_update.fusion import Collective, Trace, gather
from podscale.parallel.weight_update.replay import Rewriter, forward_used

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_MIN_SHARD_SIZE",
    "ByPartition",
    "Collective",
    "Layout",
    "Rewriter",
    "Sharded",
    "Trace",
    "chunk_layout",
    "forward_used",
    "gather",
]
