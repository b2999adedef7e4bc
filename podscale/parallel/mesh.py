"""Device meshes over all devices of all processes."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

DATA = "data"
BN_GROUP = "bn_group"
"""The mesh axis of ``make_mesh(..., bn_group_size=k)`` that batch-norm statistics are averaged over."""
_DEFAULT_NAMES = {1: (DATA,), 2: ("x", "y"), 3: ("x", "y", "z")}


def parse_shape(text: str) -> tuple[int, ...]:
    """Parses a mesh shape written as ``8`` or ``4x2``."""
    try:
        shape = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--mesh {text!r}: write the mesh shape as 8 or 4x2") from None
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"--mesh {text!r}: every mesh dimension must be a positive integer")
    return shape


def make_mesh(
    shape: int | Sequence[int] | None = None,
    axis_names: Sequence[str] | None = None,
    bn_group_size: int = 1,
    spatial: int | None = None,
) -> Mesh:
    """Builds a mesh over every device of every process.

    Args:
      shape: the mesh shape; ``None`` means a 1-D mesh over all devices. Its product must equal
        ``jax.device_count()``.
      axis_names: one name per dimension. Defaults: ``("data",)`` for 1-D, ``("x", "y")`` for 2-D.
      bn_group_size: k > 1 splits the last dimension into (last / k, k) and names the new, innermost
        axis ``BN_GROUP``: its k devices are neighbouring replicas, and a model whose batch norm
        averages its statistics over ``BN_GROUP`` normalizes over the group's combined batch.
      spatial: with ``Strategy(spatial=k)`` the last dimension (k) is the space axis, and
        ``bn_group_size`` splits the dimension before it instead: a group is neighbouring
        replicas, each with its k partitions, and the space axis stays last.

    Devices are ordered by (process, id), so each process owns a contiguous block of the
    flattened mesh: the rows of a batch sharded over all axes that a process feeds are contiguous.
    """
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    n = len(devices)
    if shape is None:
        shape = (n,)
    elif isinstance(shape, int):
        shape = (shape,)
    shape = tuple(int(s) for s in shape)
    if axis_names is None:
        if len(shape) not in _DEFAULT_NAMES:
            raise ValueError(f"mesh shape {shape}: pass axis_names for a {len(shape)}-D mesh")
        axis_names = _DEFAULT_NAMES[len(shape)]
    axis_names = tuple(axis_names)
    if len(axis_names) != len(shape):
        raise ValueError(
            f"mesh shape {shape} has {len(shape)} dimensions but axis_names {axis_names} has {len(axis_names)}"
        )
    if len(set(axis_names)) != len(axis_names):
        raise ValueError(f"mesh axis_names {axis_names} repeat a name; give each axis its own name")
    if any(s < 1 for s in shape) or int(np.prod(shape)) != n:
        raise ValueError(
            f"mesh shape {shape} needs {int(np.prod(shape))} devices, but there are {n} "
            f"({jax.process_count()} process(es) x {jax.local_device_count()} local devices). "
            f"Pass a shape whose product is {n}, for example ({n},)."
        )
    if bn_group_size != 1:
        split = -2 if spatial not in (None, 1) else -1  # the last data axis
        if len(shape) < -split:
            raise ValueError(
                f"bn_group_size={bn_group_size} with spatial={spatial} needs a data axis before the space axis, "
                f"got mesh {shape}"
            )
        if bn_group_size < 1 or shape[split] % bn_group_size:
            which = "last data" if split == -2 else "last"
            raise ValueError(
                f"bn_group_size={bn_group_size} must be a positive divisor of the {which} mesh dimension "
                f"({axis_names[split]}={shape[split]} of mesh {shape}); groups are neighbouring replicas along it"
            )
        if BN_GROUP in axis_names:
            raise ValueError(f"mesh axis_names {axis_names} already use {BN_GROUP!r}, the batch-norm group axis")
        at = len(shape) + split + 1  # just after the split dimension
        shape = (*shape[: at - 1], shape[at - 1] // bn_group_size, bn_group_size, *shape[at:])
        axis_names = (*axis_names[:at], BN_GROUP, *axis_names[at:])
    grid = np.array(devices, dtype=object).reshape(shape)
    return Mesh(grid, axis_names, axis_types=(AxisType.Auto,) * len(shape))


def replica_count(mesh: Mesh) -> int:
    """Number of data-parallel replicas: every device of the mesh is one replica."""
    return int(np.prod(list(mesh.shape.values())))
