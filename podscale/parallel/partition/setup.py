"""What a :class:`~podscale.parallel.partition.core.Partitioner` is built from: one value, made from
the step's placement (``compile_step.partitioner``), not a row of keyword arguments."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class Setup:
    """The data axes and roles of a placement, and the strategy's choices, as the partitioner reads
    them."""

    axes: tuple[str, ...]
    """The data axes (mesh order), manual in the partitioner."""
    n: int
    """Their replicas."""
    chunk_axes: tuple[str, ...] | None = None
    """The data axes a ``Chunked`` value is chunked over (``None``: every data axis; data x FSDP:
    some, whole copies of the chunks over the others)."""
    chunk_size: int | None = None
    """Their replicas (``None``: ``n``)."""
    group_axis: str | None = None
    """The batch-norm group axis (``make_mesh(bn_group_size=k)``), or ``None``."""
    group_size: int = 1
    batch_rows: int | None = None
    """The global batch's rows: a random draw with this many leading rows is drawn row-split."""
    platform: str = "cpu"
    conv_axes: tuple[str, ...] = ()
    """The axes left to XLA that the convolutions are split over (space, model)."""
    conv_size: int = 1
    region_axes: Mapping[str, tuple[str, int]] = dataclasses.field(default_factory=dict)
    """Per role a region can be partitioned over (``space``, ``model``): its axis and size."""
    table_leaves: Mapping[int, int] = dataclasses.field(default_factory=dict)
    """``{input index: rows per replica}`` of the state leaves that are tables split by rows."""
    fsdp: bool = False
    min_chunk: int = 1
    """A partial sum of fewer elements is not reduce-scattered into chunks."""
    chunk_partials: bool | None = None
    """Whether a partial sum the update reads elementwise is reduce-scattered into chunks
    (``None``: with ``fsdp``)."""
    independent_rng: bool = False
