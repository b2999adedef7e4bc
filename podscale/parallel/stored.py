"""How a state leaf is stored over the data axes between steps: one value per leaf, of four forms.

- ``WHOLE`` (:class:`Whole`): every replica holds the leaf whole.
- :class:`Flat`: the sharded update's flat chunks. The leaf is a flat vector of ``N * length``
  elements, its ``padding`` zeros at the end, each replica holding one run of ``length``. With
  tensor partitioning the runs are laid out per model partition (``by``), each partition's piece
  padded at its own end. A chunk is split over the
  space and model axes too (``split`` devices).
- :class:`Rows`: an embedding table split by rows (:mod:`podscale.parallel.tables`), and its
  optimizer state. Each replica holds ``rows`` of them, and the last block is padded with zero rows.
- :class:`Along`: chunked along one of its own dimensions over the ``n`` replicas, keeping the
  rest whole. This is FSDP's form, and the sharded update's where the replicas divide a dimension.
  XLA:TPU's tiled layout of such a chunk is the whole tensor's, so it needs no relayout.

A split over a model axis (a sharding rule's) is a separate fact and stays on
:class:`~podscale.parallel.state_layout.LeafLayout`. Each form answers every question a placement
asks of it: its stored shape, its elements per device, the layout the step's partitioner reads it
in (:mod:`podscale.parallel.partition.layouts`), and the conversions to and from the user's shape
(``store`` and ``unstore``).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from podscale.parallel.partition.layouts import REPLICATED, Chunked, Split
from podscale.parallel.weight_update.chunks import ByPartition, from_rows, to_rows


@dataclasses.dataclass(frozen=True)
class Whole:
    """Held whole by every replica (a model axis may still split it: ``LeafLayout.model_dim``)."""

    partition_layout = REPLICATED
    padding = 0

    def stored_shape(self, shape, n: int) -> tuple[int, ...]:
        return tuple(shape)

    def per_device(self, shape, model_split: int = 1) -> int:
        """Elements each device holds."""
        return math.prod(shape) // model_split

    def local_shape(self, shape, model_dim: int | None = None, model_split: int = 1) -> list[int]:
        """The shape of each device's piece."""
        out = list(shape)
        if model_dim is not None:
            out[model_dim] //= model_split
        return out

    def store(self, x, shape, n: int, xp=jnp):
        return x

    def unstore(self, x, shape, n: int, xp=jnp):
        return x


WHOLE = Whole()


@dataclasses.dataclass(frozen=True)
class Flat:
    """The sharded update's flat chunks: ``length`` elements per replica (``split`` devices each)."""

    length: int
    padding: int
    split: int = 1
    by: ByPartition | None = None
    """Laid out per model partition, then over the replicas; ``None``: row-major."""

    partition_layout = REPLICATED  # the weight update's replay reads the chunks, not the partitioner

    def stored_shape(self, shape, n: int) -> tuple[int, ...]:
        return (self.length * n,)

    def per_device(self, shape, model_split: int = 1) -> int:
        return self.length // self.split

    def local_shape(self, shape, model_dim: int | None = None, model_split: int = 1) -> list[int]:
        return [self.length // self.split]

    def store(self, x, shape, n: int, xp=jnp):
        """The leaf in its own shape -> its stored flat, padded vector."""
        if self.by is not None:
            return to_rows(x, n, self.by, xp).reshape(-1)
        flat = xp.ravel(x)
        return xp.pad(flat, (0, self.padding)) if self.padding else flat

    def unstore(self, x, shape, n: int, xp=jnp):
        if self.by is not None:
            return from_rows(xp.reshape(x, (n, -1)), self.by, xp)
        return x[: math.prod(shape)].reshape(shape)


@dataclasses.dataclass(frozen=True)
class Rows:
    """A table's rows: ``rows`` per replica, in ``N`` equal blocks (zero rows pad the last)."""

    rows: int

    partition_layout = Split(0)
    padding = 0  # the padding rows are not the flat chunks' padding (the plan counts those)

    def stored_shape(self, shape, n: int) -> tuple[int, ...]:
        return (self.rows * n, *shape[1:])

    def per_device(self, shape, model_split: int = 1) -> int:
        return self.rows * math.prod(shape[1:])

    def local_shape(self, shape, model_dim: int | None = None, model_split: int = 1) -> list[int]:
        return [self.rows, *shape[1:]]

    def store(self, x, shape, n: int, xp=jnp):
        extra = self.rows * n - shape[0]
        return xp.pad(x, [(0, extra)] + [(0, 0)] * (len(shape) - 1)) if extra else x

    def unstore(self, x, shape, n: int, xp=jnp):
        return x[: shape[0]]


@dataclasses.dataclass(frozen=True)
class Along:
    """Chunked along dimension ``dim`` of its own over ``n`` data replicas (mesh order): over the
    data axes ``axes``, or every data axis (``None``); with fewer axes (data x FSDP), the other
    data axes hold whole copies of the chunks."""

    dim: int
    n: int
    axes: tuple[str, ...] | None = None
    split: int = 1
    """Devices each replica's chunk is split over along ``dim`` too (the space axis, left to XLA:
    the sharded update's chunks under spatial partitioning, where ``n * split`` divides the dim)."""

    padding = 0

    @property
    def partition_layout(self):
        return Chunked(self.dim)

    def stored_shape(self, shape, n: int) -> tuple[int, ...]:
        return tuple(shape)

    def per_device(self, shape, model_split: int = 1) -> int:
        return math.prod(shape) // model_split // self.n // self.split

    def local_shape(self, shape, model_dim: int | None = None, model_split: int = 1) -> list[int]:
        out = WHOLE.local_shape(shape, model_dim, model_split)
        out[self.dim] //= self.n * self.split
        return out

    def chunk_shape(self, shape) -> list[int]:
        """A replica's chunk (what the step sees of it, manual over the data axes only)."""
        out = list(shape)
        out[self.dim] //= self.n
        return out

    def store(self, x, shape, n: int, xp=jnp):
        return x  # a global value in its own shape: its sharding chunks it

    def unstore(self, x, shape, n: int, xp=jnp):
        return x


Stored = Whole | Flat | Rows | Along
