"""The 1/N chunk layout of the sharded weight update.

:func:`chunk_layout` is the one rule for cutting a tensor into one chunk per data replica (the
stored optimizer state, the reduce-scattered gradients, the sliced weights all follow it);
:class:`Sharded` is a value held as this replica's chunk; :class:`Layout` is the chunking of one
step (the replica count, which tensors are sharded, the buckets gradients are summed in) with the
chunk arithmetic: a tensor's padded rows, this replica's slice of a full value, the mask of a
chunk's real elements.

A tensor split over a model axis (tensor partitioning) is chunked per model partition, then over
the replicas (:class:`ByPartition`): each replica's chunk is ``k`` pieces, piece ``m`` a 1/N run of
model partition ``m``'s own slice of the tensor. XLA splits a chunk over the model axis into those
pieces, so each device's piece lies in the slice it already holds, and the reduce-scatter, the
update and the all-gather move nothing over the model axis (flattened whole, a split tensor's
chunks cut across the partitions' slices, and XLA reshuffled them with all-to-alls).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

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
class ByPartition:
    """Chunks laid out per model partition, then over the replicas: a tensor of ``shape`` whose
    dimension ``dim`` a model axis of ``k`` devices splits (a sharding rule's) has its ``k``
    slices along ``dim`` (each flattened row-major, as the dimension moved first) cut into ``N``
    chunks each, of :func:`chunk_layout`'s length for the slice's size; replica ``r``'s chunk is
    piece ``r`` of slice 0, then piece ``r`` of slice 1, ... (``[N, k, c]`` in the stored flat
    vector, which the stored sharding ``P((data..., model))`` gives device ``(r, m)`` as piece
    ``(m, r)``). A value reshaped on its shards keeps the chunking of ``shape``."""

    shape: tuple[int, ...]
    dim: int
    k: int

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def piece(self, chunks: int) -> int:
        """The length ``c`` of one partition's piece of a chunk (a chunk is ``k * c``)."""
        return chunk_layout(self.size // self.k, chunks)[0]


def by_partition_layout(by: ByPartition, chunks: int) -> tuple[int, int]:
    """(chunk length, padding) of :class:`ByPartition` chunking over ``chunks`` replicas."""
    length = by.k * by.piece(chunks)
    return length, length * chunks - by.size


def to_rows(x, chunks: int, by: ByPartition, xp=jnp):
    """A full tensor (any shape of ``by.size`` elements) as its ``[chunks, k * c]`` rows, row ``r``
    replica ``r``'s chunk in ``by``'s layout; ``xp``: ``jax.numpy`` or ``numpy``. Every step moves
    or pads within one partition's slice (XLA keeps the model axis's split through them)."""
    k, c = by.k, by.piece(chunks)
    x = xp.moveaxis(xp.reshape(x, by.shape), by.dim, 0).reshape(k, -1)  # [k, size / k]: a slice a row
    pad = chunks * c - x.shape[1]
    if pad:
        x = xp.pad(x, ((0, 0), (0, pad)))
    return x.reshape(k, chunks, c).transpose(1, 0, 2).reshape(chunks, k * c)


def from_rows(rows, by: ByPartition, xp=jnp):
    """The inverse of :func:`to_rows`: the tensor of ``by.shape`` from its ``[chunks, k * c]`` rows."""
    chunks, k = rows.shape[0], by.k
    x = rows.reshape(chunks, k, -1).transpose(1, 0, 2).reshape(k, -1)[:, : by.size // k]
    moved = (by.shape[by.dim], *(s for i, s in enumerate(by.shape) if i != by.dim))
    return xp.moveaxis(x.reshape(moved), 0, by.dim)


def local_rows(x, chunks: int, by: ByPartition) -> jax.Array:
    """One model partition's slice of a tensor (its dimension ``by.dim`` 1/k of ``by.shape``'s) as
    its ``[chunks, c]`` pieces: row ``r`` is its piece of replica ``r``'s chunk (:func:`to_rows`'s
    ``[:, m * c : (m + 1) * c]`` on partition ``m``). Run manual over the model axis."""
    c = by.piece(chunks)
    flat = jnp.moveaxis(x, by.dim, 0).reshape(-1)
    pad = chunks * c - flat.size
    return (jnp.pad(flat, (0, pad)) if pad else flat).reshape(chunks, c)


def local_unrows(rows, by: ByPartition) -> jax.Array:
    """The inverse of :func:`local_rows`: a model partition's slice from its ``[chunks, c]`` pieces."""
    moved = (by.shape[by.dim] // by.k, *(s for i, s in enumerate(by.shape) if i != by.dim))
    return jnp.moveaxis(rows.reshape(-1)[: math.prod(moved)].reshape(moved), 0, by.dim)


@dataclasses.dataclass(frozen=True)
class Chunking:
    """How a gradient sum is chunked, from the state leaves it is kin to (``Rewriter.chunking``)."""

    by: ByPartition | None = None
    """Per model partition, or ``None``: flat."""
    split: bool = False
    """Kin to a weight split over a model axis: summed alone and unflattened when all-reduced, so
    that XLA keeps its split (flattened into a fused buffer, it would first be gathered over the
    model axis)."""


FLAT = Chunking()
"""Flat chunks, kin to no split weight."""


def agreed_dim(dims) -> int | None:
    """The dimension to chunk per model partition along, from the dimensions a model axis splits
    the state leaves a value is kin to (``None`` for a leaf it does not split): the one they all
    agree on, else ``None`` (flat chunks). The stored state (``state_layout.partition_dims``) and
    the replay's gradients (``Rewriter.chunking``) are chunked by this one rule."""
    dims = set(dims)
    return next(iter(dims)) if len(dims) == 1 and None not in dims else None


@dataclasses.dataclass(frozen=True)
class Sharded:
    """This replica's chunk of a tensor of shape ``shape``: flat, padded, 1/N of the elements;
    chunked per model partition when ``by`` says so (:class:`ByPartition`), else row-major."""

    shard: Any
    shape: tuple[int, ...]
    by: ByPartition | None = None

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def unpadded(rows, shape, by: ByPartition | None = None) -> jax.Array:
    """The tensor of ``shape`` back from its padded rows ``[n, chunk]`` (the inverse of
    :meth:`Layout.rows_padded`): flattened, the padding cut off, reshaped."""
    if by is not None:
        return from_rows(rows, by).reshape(shape)
    return rows.reshape(-1)[: math.prod(shape)].reshape(shape)


UNFLATTENED_PLATFORMS = ("tpu",)
"""The platforms on which the replicated update's 1-D gradient sums keep each gradient's shape
(:attr:`Layout.unflattened`)."""


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
        split: int = 1,
        model_split: int = 1,
        model_axis: str | None = None,
        platform: str = "cpu",
    ):
        self.grad_sum, self.axes, self.n = grad_sum, grad_sum.order, grad_sum.n
        self.unflattened = platform in UNFLATTENED_PLATFORMS and grad_sum.one_collective
        """Whether the 1-D all-reduces of gradients (the replicated update's, the sharded update's
        small tensors) keep each gradient's own shape (one
        collective each, sent together, which XLA:TPU's combiner fuses): on a TPU, whose tiled
        layouts make flattening a tensor into a fused buffer a relayout copy of it, and back
        another. Elsewhere they are flattened into fused buffers (:mod:`.fusion`)."""
        self.min_shard_size, self.scatter, self.bucket_bytes = min_shard_size, scatter, bucket_bytes
        self.split = split
        """Devices each replica's chunk is split over (the space or model axis): chunk lengths are
        multiples of it, as the stored state's are (:func:`chunk_layout`)."""
        self.model_split, self.model_axis = model_split, model_axis
        """The model axis (of ``model_split`` devices) when it is the one axis a chunk is split over
        besides the data axes: chunks are then made and summed manual over it (:meth:`per_partition`)."""

    @property
    def chunks_per_partition(self) -> bool:
        """Whether a sharded tensor that a model axis splits is chunked per model partition
        (:class:`ByPartition`), as the stored state is (``state_layout.decide``): the sharded
        update with the model axis the one axis besides the data axes."""
        return self.scatter and self.model_axis is not None

    def per_partition(
        self, f, args: list, in_dims: list[int | None], out_dims: list[int], out_ndims: list[int]
    ) -> list:
        """``f(*pieces) -> tuple`` on each model partition's own pieces of ``args`` (dimension
        ``in_dims[i]`` of ``args[i]`` split over the model axis, ``None``: whole on each; the
        results' ``out_dims``, of ranks ``out_ndims``): a
        region manual over the model axis too (a nested ``shard_map``), in which chunks per model
        partition are made, summed, gathered and unmade. Left to XLA, the reshapes and pads that
        interleave the partitions' pieces, and a reduce-scatter or all-gather over the data axes
        of a value split over the model axis, were partitioned with all-to-alls,
        collective-permutes and all-gathers over the model axis."""

        def spec(dim, ndim):  # dim None: whole on every partition
            return P(*[self.model_axis if d == dim else None for d in range(ndim)])

        return list(
            jax.shard_map(
                f,
                mesh=jax.sharding.get_abstract_mesh(),
                in_specs=tuple(spec(d, a.ndim) for a, d in zip(args, in_dims, strict=True)),
                out_specs=tuple(spec(d, nd) for d, nd in zip(out_dims, out_ndims, strict=True)),
                axis_names={self.model_axis},
                check_vma=self.n > 1,
            )(*args)
        )

    def alone(self, nbytes: int) -> bool:
        """Whether a tensor is large enough to get a collective of its own (a quarter bucket)."""
        return nbytes >= self.bucket_bytes // 4

    def shard_len(self, size: int, by: ByPartition | None = None) -> int:
        return self._geometry(size, by)[0]

    def padding(self, size: int, by: ByPartition | None = None) -> int:
        return self._geometry(size, by)[1]

    def _geometry(self, size: int, by: ByPartition | None) -> tuple[int, int]:
        return chunk_layout(size, self.n, self.split) if by is None else by_partition_layout(by, self.n)

    def index(self):
        """This replica's chunk (0 with one replica, where no collective over the data axes runs)."""
        return jnp.zeros((), jnp.int32) if self.n == 1 else lax.axis_index(self.axes)

    def shards(self, shape, dtype) -> bool:
        return math.prod(shape) >= self.min_shard_size and jnp.issubdtype(dtype, jnp.inexact)

    def rows_padded(self, x, by: ByPartition | None = None) -> jax.Array:
        """``x`` as ``[replicas, chunk]`` rows, padded to whole chunks (``by``: per model partition)."""
        if by is not None:
            return to_rows(x, self.n, by)
        flat = jnp.ravel(x)
        pad = self.padding(flat.size)
        return (jnp.pad(flat, (0, pad)) if pad else flat).reshape(self.n, -1)

    def slice(self, x, by: ByPartition | None = None) -> Sharded:
        """A full value's chunk on this replica (no communication), chunked as ``by`` says (per
        model partition, or ``None``: flat)."""
        shape = tuple(np.shape(x))
        if by is not None:  # each model partition's piece of this replica's chunk, from its own slice
            (piece,) = self.per_partition(
                lambda xl: (lax.dynamic_index_in_dim(local_rows(xl, self.n, by), self.index(), 0, keepdims=False),),
                [jnp.reshape(x, by.shape)],
                [by.dim],
                [0],
                [1],
            )
            return Sharded(piece, shape, by)
        rows = self.rows_padded(x)
        index = self.index()
        return Sharded(lax.dynamic_index_in_dim(rows, index, 0, keepdims=False), shape, by)

    def valid(self, s: Sharded) -> jax.Array:
        """Mask of the shard's real (not padding) elements."""
        length = s.shard.shape[0]
        if s.by is not None:  # k pieces of c, piece m the replica's run of partition m's slice
            c = length // s.by.k
            return self.index() * c + lax.iota(jnp.int32, length) % c < s.by.size // s.by.k
        start = self.index() * length
        return start + lax.iota(jnp.int32, length) < s.size
