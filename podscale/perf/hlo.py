"""Reading a compiled module: its collectives (with mesh axes, bytes and loop trip counts) and memory.

``compiled.as_text()`` is the optimized HLO that runs, so a plan read from it is the plan that runs
(XLA may have combined, split or removed the collectives the program asked for). A computation
reached from a ``while`` body runs once per trip: each collective is counted with the product of
the known trip counts of the loops around it (XLA's ``known_trip_count`` backend config; a loop
without one counts once and is reported in ``unknown_trip_counts``). ``cost_analysis()`` counts a
loop body once, which is why this reader does not use it for bytes.

A collective's ``buffer_bytes`` is the buffer each device contributes, as in podscale's plan: an
all-reduce's operand, a reduce-scatter's input, an all-gather's input shard, an all-to-all's or a
collective-permute's operand. Bytes sent per device follow the ring algorithms (scaling-book,
"All-reduce, all-gather, reduce-scatter"; the same formulas as ``podscale.parallel.gradsum``):
over a group of ``n`` devices, for an ``S``-byte buffer, all-reduce ``2 (n - 1) / n * S``,
reduce-scatter and all-to-all ``(n - 1) / n * S``, all-gather ``(n - 1) * S``, collective-permute
``S``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")

_DTYPE_BYTES = {
    "pred": 1,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][a-z0-9\-]*)\((.*)$")
_CALLED = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation|branch_computations)="
    r"(\{[^}]*\}|%?[\w.\-]+)"
)
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of the compiled module."""

    kind: str
    """One of ``KINDS``."""
    name: str
    """The instruction's name in the module."""
    axes: tuple[str, ...]
    """The mesh axes its groups span (``()`` when the mesh is not known or the groups are irregular)."""
    group_size: int
    dtype: str
    """The dtype of its (first) buffer: ``f32`` for a gradient summed in float32."""
    buffer_bytes: int
    """The buffer each device contributes (see the module docstring)."""
    count: int
    """How many times one step runs it (the trip counts of the loops around it)."""
    op_name: str = ""
    """The op it came from (``metadata={op_name=...}``: the user's name stack, e.g.
    ``jit(body)/shard_map/jvp(Transformer)/DecoderBlock_0/Dense_1/dot_general``)."""

    @property
    def layer(self) -> str:
        """The layer of ``op_name`` (its module path, without transforms and the primitive), and
        whether the forward or the backward pass runs it: ``DecoderBlock_0/Dense_1 (forward)``."""
        return layer_of(self.op_name)

    @property
    def moved_bytes(self) -> float:
        """Bytes each device sends per run on a ring (see the module docstring)."""
        return ring_bytes(self.kind, self.group_size, self.buffer_bytes)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "moved_bytes": self.moved_bytes, "layer": self.layer}


@dataclasses.dataclass(frozen=True)
class Module:
    """What a compiled step does per device per step: its collectives and its memory."""

    collectives: list[Collective]
    unknown_trip_counts: list[str]
    """``while`` loops whose trip count XLA did not record (their collectives counted once)."""
    memory: dict[str, int]
    """``memory_analysis()``: ``arguments``, ``outputs``, ``aliased``, ``temporaries`` and
    ``peak`` (= arguments + outputs + temporaries - aliased) bytes per device."""

    def moved_bytes(self, kinds: Sequence[str] = KINDS) -> float:
        """Bytes each device sends in one step (loops counted with their trip counts)."""
        return sum(c.moved_bytes * c.count for c in self.collectives if c.kind in kinds)

    def by_kind(self) -> dict[str, int]:
        """Buffer bytes per device per step of each kind of collective."""
        out: dict[str, int] = {}
        for c in self.collectives:
            out[c.kind] = out.get(c.kind, 0) + c.buffer_bytes * c.count
        return out

    def totals(self) -> list[dict]:
        """Per (kind, axes, dtype): runs per step, buffer bytes and moved bytes per step."""
        out: dict[tuple, dict] = {}
        for c in self.collectives:
            row = out.setdefault(
                (c.kind, c.axes, c.dtype),
                {
                    "kind": c.kind,
                    "axes": list(c.axes),
                    "dtype": c.dtype,
                    "runs": 0,
                    "buffer_bytes": 0,
                    "moved_bytes": 0.0,
                },
            )
            row["runs"] += c.count
            row["buffer_bytes"] += c.buffer_bytes * c.count
            row["moved_bytes"] += c.moved_bytes * c.count
        return list(out.values())

    def to_dict(self) -> dict:
        return {
            "collectives": self.totals(),
            "unknown_trip_counts": self.unknown_trip_counts,
            "memory": self.memory,
            "moved_bytes": self.moved_bytes(),
        }


def ring_bytes(kind: str, n: int, buffer_bytes: float) -> float:
    """Bytes each device sends in one ring collective of ``kind`` over ``n`` devices, for a buffer
    of ``buffer_bytes`` per device (see the module docstring)."""
    if kind == "collective-permute":
        return float(buffer_bytes)
    if n <= 1:
        return 0.0
    if kind == "all-gather":
        return float((n - 1) * buffer_bytes)
    return (2 if kind == "all-reduce" else 1) * (n - 1) / n * buffer_bytes


def _bytes(type_text: str) -> tuple[int, str, list[int]]:
    """Total bytes of an HLO type (array or tuple), the first array's dtype, and each array's bytes."""
    sizes, first = [], ""
    for dtype, dims in _ARRAY.findall(type_text):
        first = first or dtype
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        sizes.append(int(n * _DTYPE_BYTES[dtype]))
    return sum(sizes), first, sizes


def _groups(attrs: str) -> list[list[int]] | None:
    """``replica_groups``, listed (``{{0,1},{2,3}}``) or in iota form (``[2,4]<=[4,2]T(1,0)``)."""
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


def _pair_axes(attrs: str, mesh_shape: dict[str, int] | None) -> tuple:
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


def _axes(groups: list[list[int]] | None, mesh_shape: dict[str, int] | None, devices: int) -> tuple[int, tuple]:
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


_SCOPES = frozenset({"shard_map", "while", "body", "cond", "closed_call", "checkpoint", "remat", "pjit"})
_METHOD = re.compile(r"^[A-Z]\w*\.\w+$|:")  # a module's method scope (``Transformer.decode``)


def layer_of(op_name: str) -> str:
    """``jit(body)/shard_map/transpose(jvp(Transformer))/DecoderBlock_0/Dense_0/dot_general`` ->
    ``DecoderBlock_0/Dense_0 (backward)``; ``""`` when ``op_name`` names no layer."""
    parts = [p for p in op_name.split("/") if p]
    backward = any(p.startswith("transpose(") for p in parts)
    names = [p for p in parts[:-1] if "(" not in p and p not in _SCOPES and not _METHOD.match(p)]
    if not names:
        return ""
    return "/".join(names) + (" (backward)" if backward else " (forward)")


def read_text(text: str, mesh_shape: dict[str, int] | None = None, memory: dict | None = None) -> Module:
    """Parses optimized HLO text. ``mesh_shape`` (axis -> size, in the mesh's order) names the axes."""
    bodies: dict[str, list[tuple]] = {}
    calls: dict[str, list[tuple[str, int]]] = defaultdict(list)
    unknown: list[str] = []
    entry, current = None, None
    devices = 0
    m = re.search(r"num_partitions=(\d+)", text)
    if m:
        devices = int(m.group(1))
    for line in text.splitlines():
        h = _HEADER.match(line)
        if h:
            current = h.group(2)
            bodies[current] = []
            if h.group(1):
                entry = current
            continue
        if current is None:
            continue
        i = _INSTR.match(line)
        if not i:
            continue
        name, type_text, opcode, rest = i.groups()
        trips = 1
        if opcode == "while":
            t = _TRIP.search(rest)
            if t:
                trips = int(t.group(1))
            else:
                unknown.append(name)
        for role, target in _CALLED.findall(rest):
            for callee in re.findall(r"%?([\w.\-]+)", target):
                calls[current].append((callee, trips if role in ("body", "condition") else 1))
        base = opcode.removesuffix("-start")
        if base in KINDS and not opcode.endswith("-done"):
            bodies[current].append((name, base, opcode, type_text, rest))
    if entry is None:
        raise ValueError("no ENTRY computation in the module text")
    runs: dict[str, int] = defaultdict(int)

    def visit(comp: str, times: int, depth: int = 0) -> None:
        if depth > 64:
            raise ValueError(f"computation nesting deeper than 64 at {comp}")
        runs[comp] += times
        for callee, trips in calls.get(comp, ()):
            if callee in bodies:
                visit(callee, times * trips, depth + 1)

    visit(entry, 1)
    out = []
    for comp, instrs in bodies.items():
        if not runs.get(comp):
            continue
        for name, kind, opcode, type_text, rest in instrs:
            total, dtype, sizes = _bytes(type_text)
            if kind == "collective-permute":
                size, axes = 2, _pair_axes(rest, mesh_shape)
            else:
                size, axes = _axes(_groups(rest), mesh_shape, devices)
            if opcode == "all-gather-start":  # (operands..., results...)
                total = sum(sizes[len(sizes) // 2 :])
            elif opcode == "collective-permute-start" and len(sizes) > 1:  # (operand, result, contexts)
                total = sizes[1]
            if kind == "reduce-scatter":
                total *= size  # the output is one shard of the input
            elif kind == "all-gather":
                total //= size  # the output is every device's input
            op = _OP_NAME.search(rest)
            out.append(Collective(kind, name, axes, size, dtype, int(total), runs[comp], op.group(1) if op else ""))
    return Module(out, unknown, memory or {})


def memory_of(compiled) -> dict[str, int]:
    m = compiled.memory_analysis()
    if m is None:
        return {}
    fields = {
        "arguments": m.argument_size_in_bytes,
        "outputs": m.output_size_in_bytes,
        "aliased": m.alias_size_in_bytes,
        "temporaries": m.temp_size_in_bytes,
    }
    fields["peak"] = fields["arguments"] + fields["outputs"] + fields["temporaries"] - fields["aliased"]
    return {k: int(v) for k, v in fields.items()}


def read(compiled, mesh=None) -> Module:
    """The collectives and memory of ``jax.jit(...).lower(...).compile()`` (one device's program)."""
    shape = dict(mesh.shape) if mesh is not None else None
    return read_text(compiled.as_text(), shape, memory_of(compiled))
