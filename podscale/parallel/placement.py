"""A step's placement: each mesh axis's role, and where every state leaf and batch leaf lives.

A :class:`~podscale.Strategy` is resolved once, against the mesh (:meth:`Roles.of`), and then
against the abstract state and an example global batch (``DataParallelStep.prepare``), into one
immutable :class:`Placement`:

- **roles**, by name: the data axes (the batch's rows; podscale's own partitioner is manual over
  them), the space axis (each image's height), the model axis (the weights the sharding rules
  name) and the batch-norm group axis. The space and model axes are left to XLA's partitioner
  (``Roles.partitions``). A new role (an embedding table's axis, a pipeline stage) is one more
  field here and its own rules, read where the placement is read;
- **the state's layout** (:class:`~podscale.parallel.state_layout.StateLayout`): per leaf a
  ``PartitionSpec`` over named axes (a rule's split over the model axis) and, with the sharded
  update, its flat 1/N chunk;
- **embedding tables** (``looked_up``): weights the step looks up by rows; those with at least
  ``min_table_rows`` rows are split by rows over the data axes (a state leaf stored as ``stored.Rows``);
- **the batch's layout** (:class:`BatchPlacement`): which leaves are images, split by height over
  the space axis, besides rows over the data axes; the step's windows and the layers a space axis
  does not divide.

The engine's partitioner, the weight-update replay, checkpoints (through the state layout), the
plan and the projection (``podscale.projection``) read the placement; nothing changes it once made.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from podscale.parallel import spatial
from podscale.parallel.mesh import BN_GROUP
from podscale.parallel.state_layout import StateLayout


@dataclasses.dataclass(frozen=True)
class Roles:
    """Each mesh axis's role, by name."""

    data: tuple[str, ...]
    """The axes the batch's rows are split over (mesh order), manual in podscale's partitioner."""
    space: str | None = None
    """The axis each image's height is split over, or ``None``."""
    model: str | None = None
    """The axis the sharding rules split weights over, or ``None``."""
    group: str | None = None
    """The batch-norm group axis (``make_mesh(bn_group_size=k)``), one of the data axes, or ``None``."""
    chunks: tuple[str, ...] | None = None
    """The data axes a leaf stored in chunks along a dimension is chunked over (mesh order):
    ``None``, every data axis; with ``Strategy(fsdp_axes=...)`` (data x FSDP) those only, the
    other data axes holding whole copies of the chunks."""

    @classmethod
    def of(cls, strategy, mesh: Mesh) -> Roles:
        """The roles ``strategy`` gives ``mesh``'s axes (refused, naming the axis, where they clash)."""
        data = strategy.axes(mesh)
        chunks = strategy.chunk_axes(mesh)
        return cls(
            data=data,
            space=strategy.space_of(mesh),
            model=strategy.model_of(mesh),
            group=BN_GROUP if BN_GROUP in mesh.axis_names else None,
            chunks=None if chunks == data else chunks,
        )

    @property
    def chunk_axes(self) -> tuple[str, ...]:
        return self.data if self.chunks is None else self.chunks

    @property
    def partitions(self) -> tuple[str, ...]:
        """The axes left to XLA's partitioner (space, model): every axis but the data axes."""
        return tuple(a for a in (self.space, self.model) if a is not None)

    def split(self, mesh: Mesh) -> int:
        """Devices each replica is split over: the space and model axes' (1 for neither)."""
        return math.prod(mesh.shape[a] for a in self.partitions)

    def replicas(self, mesh: Mesh) -> int:
        """Data-parallel replicas: the devices of the data axes."""
        return math.prod(mesh.shape[a] for a in self.data)


@dataclasses.dataclass(frozen=True)
class BatchPlacement:
    """How one batch signature (tree, shapes, dtypes) is split: rows over the data axes and, with a
    space axis, each image's height over it."""

    images: tuple[bool, ...] = ()
    """Per batch leaf, whether it is an image whose height the space axis splits (its height and
    width are a window's input); all ``False`` without a space axis."""
    windows: tuple[spatial.Window, ...] = ()
    """The step's convolutions and pooling windows at this signature."""
    uneven: tuple[str, ...] = ()
    """The layers whose height the space axis does not divide (XLA pads them)."""


@dataclasses.dataclass(frozen=True)
class Placement:
    """One step's placement on one mesh, for one state signature: see the module docstring."""

    mesh: Mesh
    roles: Roles
    state: StateLayout
    batch: BatchPlacement
    """The example batch's (a batch of another signature gets its own, from the same step)."""
    model_dims: tuple[int | None, ...] | None = None
    """With a model axis: per state leaf, the dimension its rule splits (``tensor.assign``)."""
    rule_notes: tuple[str, ...] = ()
    """With a model axis: what the sharding rules left undone."""
    looked_up: tuple[int, ...] = ()
    """The state leaves the step looks up by rows (embedding tables), split by rows over the data
    axes or not (``state.leaves[i].table``; :mod:`podscale.parallel.tables`)."""
    min_table_rows: tuple[int, ...] = ()
    """Per leaf of ``looked_up``: the rows from which it is split by rows (the strategy's, or the
    ids a step looks up from it, at least the global batch's rows: ``tables.thresholds``)."""

    @property
    def replicas(self) -> int:
        return self.roles.replicas(self.mesh)

    @property
    def split(self) -> int:
        return self.roles.split(self.mesh)

    @property
    def batch_sharding(self) -> NamedSharding:
        """How the batch's rows are split (over the data axes)."""
        return batch_sharding(self.mesh, self.roles)

    def batch_shardings(self, batch, windows: tuple[spatial.Window, ...] | None = None):
        """Each leaf of ``batch`` (global or one process's rows): rows over the data axes and, with
        a space axis, the height of every image over it (a leaf shaped as a window's input of
        ``windows``, the example batch's by default)."""
        return batch_shardings(self.mesh, self.roles, batch, self.batch.windows if windows is None else windows)

    def batch_specs(self, batch: BatchPlacement | None = None) -> tuple[P, ...]:
        """Per leaf of a batch signature (the example batch's by default), its ``PartitionSpec``:
        rows over the data axes, and an image's height over the space axis."""
        batch = self.batch if batch is None else batch
        image = P(self.roles.data, self.roles.space)
        return tuple(image if im else P(self.roles.data) for im in batch.images)

    def stored_shapes(self):
        """The stored state as ``ShapeDtypeStruct`` leaves with their shardings (for lowering)."""
        return self.state.stored_shapes()


def batch_sharding(mesh: Mesh, roles: Roles) -> NamedSharding:
    return NamedSharding(mesh, P(roles.data))


def local_rows(mesh: Mesh, roles: Roles, global_batch: int) -> slice:
    """The rows of a global batch that this process feeds (contiguous by mesh construction)."""
    replicas = roles.replicas(mesh)
    if global_batch % replicas:
        raise ValueError(
            f"global batch size {global_batch} is not divisible by the {replicas} replicas; "
            f"use a multiple of {replicas}"
        )
    index_map = batch_sharding(mesh, roles).addressable_devices_indices_map((global_batch,))
    starts = sorted({idx[0].start or 0 for idx in index_map.values()})
    stops = sorted({idx[0].stop if idx[0].stop is not None else global_batch for idx in index_map.values()})
    rows = slice(starts[0], stops[-1])
    if (rows.stop - rows.start) != global_batch // replicas * len(starts):
        raise ValueError(
            "this process's devices do not hold a contiguous block of the batch; build the mesh "
            "with podscale.make_mesh, which orders devices by process"
        )
    return rows


def batch_shardings(mesh: Mesh, roles: Roles, batch, windows) -> Any:
    rows = batch_sharding(mesh, roles)
    if roles.space is None:
        return jax.tree.map(lambda _: rows, batch)
    image = NamedSharding(mesh, P(roles.data, roles.space))
    return jax.tree.map(lambda x: image if spatial.is_image(np.shape(x), list(windows)) else rows, batch)
