"""The layouts a value can have on the replicas (see the package docstring): a block of rows
(:class:`Split`), a block of a stored tensor (:class:`Chunked`), the whole value (``REPLICATED``),
a share of a sum (``PARTIAL``) or a batch-norm group's value (``GROUP``), and the layout two values
of one place can share (:func:`join`).

Vocabulary: a *dim* is a tensor's dimension; an *axis* is the mesh's. Every layout here is over the
data axes (the axes the partitioner's ``shard_map`` is manual over); the space and model axes are
XLA's."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Split:
    """This replica's contiguous block of dimension ``dim``."""

    dim: int

    def __repr__(self) -> str:
        return f"split({self.dim})"


@dataclasses.dataclass(frozen=True)
class Chunked:
    """This replica's contiguous block of dimension ``dim`` of a tensor the placement *stores* split
    (FSDP: a weight, its gradient, its optimizer state, 1/N per replica between uses; N the
    replicas of ``Partitioner.chunk_axes``, copies over the other data axes). The same
    pieces as :class:`Split`, with another rule for what to do with them: a split value (the
    batch's rows) is computed on row by row wherever a rule can, whereas a chunk is computed on only
    by elementwise ops and reductions (the update, on 1/N of the weights) and is all-gathered for
    any other use (a weight for its layer), then dropped. A partial sum meeting a chunk is
    reduce-scattered into it."""

    dim: int

    def __repr__(self) -> str:
        return f"chunked({self.dim})"


TILE = (8, 128)
"""The tile XLA:TPU lays a tensor's last two dimensions in (``{1,0:T(8,128)}``, 32-bit types): a
chunk with fewer rows or columns than a tile still occupies whole tiles."""


def chunk_dim(shape, n: int, tiles: bool = True) -> int | None:
    """The dimension a tensor of ``shape`` is chunked along over ``n`` replicas, or ``None`` where
    they divide none. A pure function of the shape that commutes with stacking: a leading layer
    dimension (``nn.scan``'s stacked weights) is never chosen where a layer's own dimension can be,
    and ``chunk_dim((L, *s)) == 1 + chunk_dim(s)``, so each iteration of a scan over the layers
    reads a chunk of its own layer, and the layer's gradient, reduce-scattered inside the loop,
    stacks into the stored layout. Of a matrix (a tensor's last two dimensions), the one whose
    chunk fills the most of its tiles (:data:`TILE`), the rows where both do: a chunk of 2 columns
    of a ``[512, 512]`` kernel over 256 replicas fills 2 of each tile's 128 lanes, and is as large
    in memory as the whole kernel once tiled, where a chunk of 2 rows fills 2 of 8. A matrix of
    fewer than 128 rows is read as a stack of vectors (a scan's biases and scales, ``[layers, d]``)
    and chunked along its vectors, so that it commutes with stacking (a stack of 128 vectors or
    more may be chunked along its layers: the scan then gathers it, exact but not per layer; so
    does an attention kernel's ``[heads, head_dim]``, read as such a stack). Of a vector, its one
    dimension. Without ``tiles`` (a placement with a model axis, which may split the same
    dimension: FSDP x tensor), the last dimension the replicas divide, as before tiles were read."""
    shape = tuple(shape)
    if len(shape) >= 3:
        inner = chunk_dim(shape[1:], n, tiles)
        if inner is not None:
            return inner + 1
        return 0 if shape[0] % n == 0 and shape[0] >= n else None
    dims = [d for d in range(len(shape)) if shape[d] % n == 0 and shape[d] >= n]
    if not dims:
        return None
    if not tiles or shape[0] < TILE[1]:  # a stack of vectors (a scan's biases and scales): its vectors'
        return dims[-1]
    tile = TILE[-len(shape) :]
    return min(dims, key=lambda d: (tile[d] / min(tile[d], shape[d] // n), d))


class _Named:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


REPLICATED = _Named("replicated")
PARTIAL = _Named("partial")
GROUP = _Named("group")
"""Batch norm over groups of replicas (opt-in): a whole value that is the same within a group
and differs between groups (the group's statistics). It computes like a replicated value."""

Layout = Any  # REPLICATED | PARTIAL | GROUP | Split | Chunked


def join(a: Layout, b: Layout) -> Layout:
    """The layout two values of one place (a loop carry, the branches of a cond) can share."""
    if a == b:
        return a
    if a is REPLICATED:
        return b
    if b is REPLICATED:
        return a
    return REPLICATED
