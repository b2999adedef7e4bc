"""Device meshes over all devices of all processes."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from podscale.parallel import checks

DATA = "data"
BN_GROUP = "bn_group"
"""The mesh axis of ``make_mesh(..., bn_group_size=k)`` that batch-norm statistics are averaged over."""
MAX_CPU_DEVICES = 2048
"""The most devices a program of one process's JAX CPU client runs over: past 2048 it refuses
("Multiprocess computations aren't implemented on the CPU backend"), and far more devices only
cost time and memory to create (``jax_num_cpu_devices`` 100000 grows by about 1 GB every 30 s).
:func:`podscale.train.distributed.setup` refuses more per process; ``podscale project`` compiles on at most this many."""
_DEFAULT_NAMES = {1: (DATA,)}
"""Default axis names: ``data`` for a 1-D mesh; ``x, y, z, w`` for 2 to 4 dimensions, and
``a4, a5, ...`` after ``w`` for more (see :func:`default_axis_names`)."""


def default_axis_names(rank: int) -> tuple[str, ...]:
    """The axis names of a ``rank``-D mesh when none are given: ``("data",)``, ``("x", "y")``,
    ``("x", "y", "z")``, ``("x", "y", "z", "w")``, then ``"a4"``, ``"a5"``, ..."""
    if rank in _DEFAULT_NAMES:
        return _DEFAULT_NAMES[rank]
    return ("x", "y", "z", "w")[:rank] + tuple(f"a{i}" for i in range(4, rank))


def auto_axes(mesh: Mesh) -> Mesh:
    """``mesh`` with every axis ``Auto`` (the same devices and names). podscale partitions the step
    itself: manual over the data axes, XLA's partitioner over a space or model axis. A mesh from
    ``jax.make_mesh``, whose axes are ``Explicit`` by default, is taken so; its sharding-in-types
    would type the step's values as split where podscale splits them by hand."""
    types = getattr(mesh, "axis_types", None)
    if types is None or all(t == AxisType.Auto for t in types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def parse_shape(text: str) -> tuple[int, ...]:
    """Parses a mesh shape written as ``8`` or ``4x2``."""
    try:
        shape = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--mesh {text!r}: write the mesh shape as 8 or 4x2") from None
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"--mesh {text!r}: every mesh dimension must be a positive integer")
    return shape


def mesh_advice(n: int, k: int, field: str) -> str:
    """How to get a mesh of ``n`` devices whose last axis has ``k`` (``field=k``, a space or model
    axis) after a data axis: checked to work, not guessed. Either ``make_mesh((n // k, k))``, or
    the values of ``field`` that ``n`` devices allow, each with its mesh."""
    if n % k == 0:
        return f"make one with make_mesh(({n // k}, {k}))"
    valid = [d for d in range(2, n + 1) if n % d == 0]
    why = f"{k} does not divide the {n} devices"
    if not valid:
        return f"{why}, and no {field} above 1 fits {n} devices; run on more devices"
    return f"{why}; choose one that fits: " + "; ".join(f"{field}={d} with make_mesh(({n // d}, {d}))" for d in valid)


def _shape(shape) -> tuple[int, ...] | None:
    """``make_mesh``'s ``shape``, checked: ``None``, an int or a tuple or list of ints."""
    if shape is None:
        return None
    if isinstance(shape, str):
        raise TypeError(
            f"make_mesh: shape={shape!r} is a str; give a tuple of ints such as (4, 2) "
            f"(podscale.parallel.mesh.parse_shape reads the text form {shape!r})"
        )
    if isinstance(shape, numbers.Integral) and not isinstance(shape, bool | np.bool_):
        shape = (shape,)
    if not isinstance(shape, tuple | list):
        raise TypeError(
            f"make_mesh: shape={shape!r} is {checks.described(shape)}; give None, an int or a tuple of ints such as (4, 2)"
        )
    for i, s in enumerate(shape):
        if isinstance(s, bool | np.bool_) or not isinstance(s, numbers.Integral):
            raise TypeError(
                f"make_mesh: shape={tuple(shape)!r}: dimension {i} ({s!r}) is {checks.described(s)}; every dimension is an "
                "int (devices along that axis), e.g. shape=(4, 2)"
            )
    shape = tuple(int(s) for s in shape)
    if not shape:
        raise ValueError("make_mesh: shape=(): give at least one dimension, or None for a 1-D mesh over all devices")
    if any(s < 1 for s in shape):
        raise ValueError(f"make_mesh: shape={shape}: every mesh dimension must be at least 1")
    return shape


def make_mesh(
    shape: int | Sequence[int] | None = None,
    axis_names: Sequence[str] | None = None,
    bn_group_size: int = 1,
    spatial: int | None = None,
    *,
    devices: Sequence | None = None,
) -> Mesh:
    """Builds a mesh over every device of every process (or over ``devices``).

    Args:
      shape: the mesh shape (an int or a tuple of ints); ``None`` means a 1-D mesh over all
        devices. Its product must equal ``jax.device_count()``.
      axis_names: one name per dimension. Defaults (:func:`default_axis_names`): ``("data",)`` for
        1-D, ``("x", "y")`` for 2-D, ``("x", "y", "z")``, ``("x", "y", "z", "w")``, then ``a4``, ...
      bn_group_size: k > 1 splits the last dimension into (last / k, k) and names the new, innermost
        axis ``BN_GROUP``: its k devices are neighbouring replicas, and a model whose batch norm
        averages its statistics over ``BN_GROUP`` normalizes over the group's combined batch.
      spatial: with ``Strategy(spatial=k)`` the last dimension (k) is the space axis (checked), and
        ``bn_group_size`` splits the dimension before it instead: a group is neighbouring
        replicas, each with its k partitions, and the space axis stays last.

      devices: the devices to place the mesh over instead of JAX's, e.g. the compile-only devices
        of a TPU slice (``podscale.compiled.tpu.devices``), to compile for it without running.

    Devices are ordered by (process, id), so each process owns a contiguous block of the
    flattened mesh: the rows of a batch sharded over all axes that a process feeds are contiguous.
    Arguments of the wrong type raise ``TypeError``, values out of range ``ValueError``.
    """
    shape = _shape(shape)
    if axis_names is not None:
        axis_names = checks.names("axis_names", axis_names, "axis names, one per mesh dimension", "('x', 'y')")
    bn_group_size = checks.whole("bn_group_size", bn_group_size, what=" (replicas per batch-norm group)")
    spatial = checks.whole("spatial", spatial, optional=True, what=" (devices per image)")
    given = devices is not None
    if given and not len(devices):
        raise ValueError(
            "make_mesh(devices=[]): no devices to place a mesh over; give at least one device, or leave devices out "
            "for every device of every process"
        )
    devices = sorted(jax.devices() if devices is None else devices, key=lambda d: (d.process_index, d.id))
    n = len(devices)
    if shape is None:
        shape = (n,)
    if axis_names is None:
        axis_names = default_axis_names(len(shape))
    if len(axis_names) != len(shape):
        raise ValueError(
            f"mesh shape {shape} has {len(shape)} dimensions but axis_names {axis_names} has {len(axis_names)}"
        )
    if len(set(axis_names)) != len(axis_names):
        raise ValueError(f"mesh axis_names {axis_names} repeat a name; give each axis its own name")
    if int(np.prod(shape)) != n:
        raise ValueError(
            f"mesh shape {shape} needs {int(np.prod(shape))} devices, but there are {n} "
            + (
                "(the devices given). "
                if given
                else f"({jax.process_count()} process(es) x {jax.local_device_count()} local devices). "
            )
            + f"Pass a shape whose product is {n}, for example make_mesh(({n},))"
            + (f" or make_mesh({_two_axes(n)})" if _two_axes(n) else "")
            + "."
        )
    if spatial not in (None, 1) and (len(shape) < 2 or shape[-1] != spatial):
        raise ValueError(
            f"spatial={spatial} needs a mesh whose last axis has {spatial} devices (the space axis) after at least "
            f"one data axis, got mesh shape {shape}; " + mesh_advice(n, spatial, "spatial")
        )
    if bn_group_size != 1:
        split = -2 if spatial not in (None, 1) else -1  # the last data axis
        if len(shape) < -split:
            raise ValueError(
                f"bn_group_size={bn_group_size} with spatial={spatial} needs a data axis before the space axis, "
                f"got mesh {shape}"
            )
        if shape[split] % bn_group_size:
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


def _two_axes(n: int) -> tuple[int, int] | None:
    """A 2-D shape of ``n`` devices with both axes at least 2, the squarest, or ``None``."""
    pairs = [(n // d, d) for d in range(2, n // 2 + 1) if n % d == 0 and n // d >= d]
    return pairs[-1] if pairs else None
