"""The 1/N chunk layout of the sharded weight update.

:func:`chunk_layout` is the one rule for cutting a tensor into one chunk per data replica (the
stored optimizer state, the reduce-scattered gradients, the sliced weights all follow it);
:class:`Sharded` is a value held as this replica's chunk; :class:`Layout` is the chunking of one
step (the replica count, which tensors are sharded, the buckets gradients are summed in) with the
chunk arithmetic: a tensor's padded rows, this replica's slice of a full value, the mask of a
chunk's real elements.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from podscale.parallel.gradsum import GradSum

DEFAULT_MIN_SHARD_SIZE = 2048
"""Tensors with fewer elements stay replicated: at 8 KiB in float32, the latency of a collective
on its own costs more than updating it redundantly saves (it is fused with the others anyway)."""

DEFAULT_BUCKET_BYTES = 16 * 2**20
"""Gradients are summed in fused buffers of about this size (Horovod's tensor fusion): a buffer
is sent as soon as the backward pass has filled it, so its local gradients can be freed and its
collective can overlap the rest of the backward pass. Results do not depend on it."""


def chunk_layout(size: int, chunks: int, split: int = 1) -> tuple[int, int]:
    """(chunk length, padding) of a tensor of ``size`` elements cut into ``chunks`` chunks, one
    per data replica, each chunk split further over ``split`` devices (a spatial strategy's space
    axis or tensor partitioning's model axis; XLA partitions a replica's chunk over them): the
    length is ``ceil(size / chunks)`` rounded up to a multiple of ``split``, the padding what
    ``chunks`` such chunks hold beyond ``size``. The one rule for every chunk of a tensor: the
    stored state (:func:`podscale.parallel.state_layout.decide`), the gradient sums and slices
    (:class:`Layout`), whatever ``size``, ``chunks`` and ``split``."""
    if size < 0 or chunks < 1 or split < 1:
        raise ValueError(f"chunk_layout({size}, {chunks}, {split}): a size of at least 0, chunks and split at least 1")
    length = -(-size // chunks)
    length = -(-length // split) * split
    return length, length * chunks - size


@dataclasses.dataclass(frozen=True)
class Sharded:
    """This replica's chunk of a tensor of shape ``shape``: flat, padded, 1/N of the elements."""

    shard: Any
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def unpadded(rows, shape) -> jax.Array:
    """The tensor of ``shape`` back from its padded rows ``[n, chunk]`` (the inverse of
    :meth:`Layout._padded_rows`): flattened, the padding cut off, reshaped."""
    return rows.reshape(-1)[: math.prod(shape)].reshape(shape)


class Layout:
    """The chunking of tensors over the replicas, and how gradients are summed (``grad_sum``).

    Chunks are ordered by ``lax.axis_index(grad_sum.order)``, the order of the 2-D sum's phases.
    """

    def __init__(
        self,
        grad_sum: GradSum,
        min_shard_size: int,
        scatter: bool = True,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        split_shapes: frozenset = frozenset(),
        split: int = 1,
    ):
        self.grad_sum, self.axes, self.n = grad_sum, grad_sum.order, grad_sum.n
        self.min_shard_size, self.scatter, self.bucket_bytes = min_shard_size, scatter, bucket_bytes
        self.split = split
        """Devices each replica's chunk is split over (the space or model axis): chunk lengths are
        multiples of it, as the stored state's are (:func:`chunk_layout`)."""
        self.split_shapes = split_shapes
        """Shapes of the weights split over a model axis (tensor partitioning): an all-reduced
        gradient of such a shape is summed alone and unflattened, so that XLA keeps its split
        (flattened into a fused buffer, it would first be gathered over the model axis)."""

    def alone(self, nbytes: int) -> bool:
        """Whether a tensor is large enough to get a collective of its own (a quarter bucket)."""
        return nbytes >= self.bucket_bytes // 4

    def shard_len(self, size: int) -> int:
        return chunk_layout(size, self.n, self.split)[0]

    def padding(self, size: int) -> int:
        return chunk_layout(size, self.n, self.split)[1]

    def index(self):
        """This replica's chunk (0 with one replica, where no collective over the data axes runs)."""
        return jnp.zeros((), jnp.int32) if self.n == 1 else lax.axis_index(self.axes)

    def shards(self, shape, dtype) -> bool:
        return math.prod(shape) >= self.min_shard_size and jnp.issubdtype(dtype, jnp.inexact)

    def _padded_rows(self, x) -> jax.Array:
        flat = jnp.ravel(x)
        pad = self.padding(flat.size)
        return (jnp.pad(flat, (0, pad)) if pad else flat).reshape(self.n, -1)

    def slice(self, x) -> Sharded:
        """A full value's chunk on this replica (no communication)."""
        rows = self._padded_rows(x)
        index = self.index()
        return Sharded(lax.dynamic_index_in_dim(rows, index, 0, keepdims=False), tuple(np.shape(x)))

    def valid(self, s: Sharded) -> jax.Array:
        """Mask of the shard's real (not padding) elements."""
        length = s.shard.shape[0]
        start = self.index() * length
        return start + lax.iota(jnp.int32, length) < s.size
