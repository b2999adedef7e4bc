"""Which devices a collective spans: an instruction's ``replica_groups`` (listed, in iota form or
in XLA:TPU's mesh form) or a collective-permute's ``source_target_pairs``, and the mesh axes they
follow. :mod:`podscale.compiled.hlo` reads each collective with these."""

from __future__ import annotations

import math
import re

import numpy as np

_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[([^\]]*)\](?:,?\s*device_ids=\(((?:\[[\d,]*\](?:T\([\d,]*\))?)|[\d,\s]*)\))?\s*\{([^}]*)\}"
)
_MESH_AXIS = re.compile(r"'([^']+)'=(\d+)")
_MESH_PICK = re.compile(r"'([^']+)'(?::\((\d+)\)(\d+))?")


def _mesh_groups(m: re.Match) -> list[list[int]]:
    """Groups in the mesh form XLA:TPU prints: ``mesh['axis_0'=4,'axis_1'=8] {'axis_1'}`` (devices
    numbered over the mesh, row-major, or as ``device_ids=(...)`` lists them; a group spans the
    listed axes; ``'axis_0':(2)2`` is the sub-axis of size 2 after a first factor of 2)."""
    dims: list[tuple[str, int]] = [(name, int(size)) for name, size in _MESH_AXIS.findall(m.group(1))]
    picked = _MESH_PICK.findall(m.group(3))
    if any(sum(p == name and bool(n) for p, _, n in picked) > 1 for name, _ in dims):
        raise ValueError(f"replica groups {m.group(0)!r}: two sub-axes of one mesh axis are not read yet")
    split: list[tuple[str, int]] = []  # the mesh with each picked sub-axis split out
    chosen: list[str] = []
    for name, size in dims:
        subs = [(int(pre), int(n)) for p, pre, n in picked if p == name and n]
        if not subs:
            split.append((name, size))
            if any(p == name and not n for p, _, n in picked):
                chosen.append(name)
            continue
        pre, n = subs[0]
        parts = [(f"{name}.pre", pre), (f"{name}.sub", n), (f"{name}.post", size // (pre * n))]
        split += [p for p in parts if p[1] > 1 or p[0].endswith(".sub")]
        chosen.append(f"{name}.sub")
    names = [n for n, _ in split]
    count = math.prod(size for _, size in split)
    ids = np.arange(count) if not m.group(2) else _device_ids(m.group(2))
    if ids.size != count:
        raise ValueError(f"replica groups {m.group(0)!r}: {ids.size} device ids for a mesh of {count}")
    ids = ids.reshape([size for _, size in split] or [1])
    order = [names.index(n) for n in names if n not in chosen] + [names.index(n) for n in chosen]
    size = math.prod(dict(split)[n] for n in chosen) if chosen else 1
    return ids.transpose(order).reshape(-1, size).tolist()


def _device_ids(text: str) -> np.ndarray:
    """A mesh form's ``device_ids``: listed (``0,2,1,3``) or in iota form (``[4,2]T(1,0)``: the
    ids 0..7 as a 4x2 array, transposed, flattened)."""
    m = re.fullmatch(r"\[([\d,]*)\](?:T\(([\d,]*)\))?", text.strip())
    if not m:
        return np.array([int(d) for d in text.split(",") if d.strip()])
    dims = [int(d) for d in m.group(1).split(",") if d]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(2):
        ids = ids.transpose([int(p) for p in m.group(2).split(",")])
    return ids.reshape(-1)


def replica_groups(attrs: str) -> list[list[int]] | None:
    """``replica_groups``, listed (``{{0,1},{2,3}}``), in iota form (``[2,4]<=[4,2]T(1,0)``) or in
    XLA:TPU's mesh form (see :func:`_mesh_groups`)."""
    m = _MESH_GROUPS.search(attrs)
    if m:
        return _mesh_groups(m)
    if "replica_groups=mesh[" in attrs:
        raise ValueError(f"replica groups in {attrs[:200]!r}: a mesh form this reader does not know")
    m = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)?\}", attrs)
    if m:
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1) or "")]
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:
        count, size = int(m.group(1)), int(m.group(2))
        dims = [int(d) for d in m.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(p) for p in m.group(4).split(",")])
        return ids.reshape(count, size).tolist()
    return None


def pair_axes(attrs: str, mesh_shape: dict[str, int] | None) -> tuple:
    """The mesh axes a collective-permute's ``source_target_pairs`` move data along (a halo
    exchange: the space axis)."""
    m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attrs)
    if not m or not mesh_shape:
        return ()
    names, dims = list(mesh_shape), list(mesh_shape.values())
    varying = set()
    for src, dst in re.findall(r"\{(\d+),(\d+)\}", m.group(1)):
        a, b = np.unravel_index(int(src), dims), np.unravel_index(int(dst), dims)
        varying |= {n for n, x, y in zip(names, a, b, strict=True) if x != y}
    return tuple(n for n in names if n in varying)


def group_axes(groups: list[list[int]] | None, mesh_shape: dict[str, int] | None, devices: int) -> tuple[int, tuple]:
    """(group size, the mesh axes a group spans). Device ids are positions in the mesh's
    flattened device order (the program's device assignment)."""
    if not groups:  # empty replica_groups: one group of every device
        groups = [list(range(devices))] if devices else [[0]]
    size = len(groups[0])
    if not mesh_shape:
        return size, ()
    names, dims = list(mesh_shape), list(mesh_shape.values())
    coords = np.array(np.unravel_index(np.asarray(groups[0]), dims)).T  # [group, axes]
    varying = tuple(n for i, n in enumerate(names) if len(set(coords[:, i])) > 1)
    if math.prod(mesh_shape[a] for a in varying) != size:
        return size, ()
    return size, varying
