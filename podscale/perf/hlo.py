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
PHASES = ("forward", "backward", "update")

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
    ops: list[Op] = dataclasses.field(default_factory=list)
    """The ops that do work, each with its FLOPs, bytes and runs per step (see :class:`Op`)."""
    schedule: dict[str, list[tuple]] = dataclasses.field(default_factory=dict)
    """Each computation that runs (not a fusion's body), its instructions in the compiled order
    (a scheduled module's text is its schedule): ``("op", i)`` (``ops[i]``), ``("sync", i)``
    (``collectives[i]`` for each ``i`` of a tuple of indices: one all-reduce of XLA:TPU may be an
    all-reduce and a reduce-scatter; the next instruction waits for it), ``("start", i)`` and
    ``("done", i)`` (an asynchronous collective: what runs between them can hide it), ``("call",
    computation, trips)`` (a loop body, a called computation)."""
    entry: str = ""
    """The entry computation's name (where :attr:`schedule` starts)."""

    def flops(self, phases: Sequence[str] = PHASES) -> float:
        """FLOPs per device per step (loops counted with their trip counts)."""
        return sum(o.flops * o.count for o in self.ops if o.phase in phases)

    def op_bytes(self, phases: Sequence[str] = PHASES) -> float:
        """Bytes the ops read and write per device per step."""
        return sum(o.bytes * o.count for o in self.ops if o.phase in phases)

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
            "flops": {p: self.flops([p]) for p in PHASES},
            "op_bytes": {p: self.op_bytes([p]) for p in PHASES},
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


def _groups(attrs: str) -> list[list[int]] | None:
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


UPDATE_SCOPE = "podscale_update"
"""The name scope of the gradient sums and of everything downstream of them (the optimizer update,
the weight gather), which :mod:`podscale.parallel.weight_update` opens: compiled ops carry it in
their ``op_name``, so the update's cost is told from the forward and backward passes'."""

GRAD_SUM_SCOPE = "grad_sum"
"""Nested in ``UPDATE_SCOPE``: the gradient sums themselves (not the norms' partial sums, not the
weight gather), the collectives that may overlap the backward pass."""

_SCOPES = frozenset(
    {"shard_map", "while", "body", "cond", "closed_call", "checkpoint", "remat", "pjit", UPDATE_SCOPE, GRAD_SUM_SCOPE}
)
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


_NO_COST = frozenset(
    {
        "parameter",
        "constant",
        "get-tuple-element",
        "tuple",
        "bitcast",
        "while",
        "conditional",
        "call",
        "after-all",
        "partition-id",
        "replica-id",
        "opt-barrier",
        "add-dependency",
        "async-update",
        "iota",
    }
)
_FLOP_PER_ELEMENT = frozenset(
    {
        "add",
        "subtract",
        "multiply",
        "divide",
        "maximum",
        "minimum",
        "negate",
        "abs",
        "exponential",
        "exponential-minus-one",
        "log",
        "log-plus-one",
        "tanh",
        "logistic",
        "sqrt",
        "rsqrt",
        "cbrt",
        "power",
        "remainder",
        "atan2",
        "sine",
        "cosine",
        "erf",
        "compare",
        "select",
        "clamp",
        "floor",
        "ceil",
        "round-nearest-even",
        "round-nearest-afz",
        "sign",
        "and",
        "or",
        "xor",
        "not",
    }
)
_TRANSCENDENTAL = frozenset(
    {"exponential", "exponential-minus-one", "log", "log-plus-one", "tanh", "logistic", "sqrt", "rsqrt", "power"}
)


@dataclasses.dataclass(frozen=True)
class Op:
    """One op of the compiled module that does work: a fusion, a dot, a convolution, a copy, ...
    (collectives are :class:`Collective`). Figures are per device per run."""

    name: str
    opcode: str
    flops: float
    """Dot and convolution FLOPs (2 per multiply-add) plus one per element of elementwise
    arithmetic, reductions and transcendentals, summed over a fusion's body."""
    matmul_flops: float
    """The part of ``flops`` in dots and convolutions (the part a matrix unit runs)."""
    bytes: float
    """Operands read plus the result written (a fusion: its parameters and its result; a parameter
    read only through slices counts the slices; an in-place dynamic-update-slice counts the update)."""
    matmul_dtype: str
    """The operand dtype of its (first) dot or convolution; ``""`` without one."""
    count: int
    """Runs per step (the trip counts of the loops around it)."""
    phase: str
    """``forward``, ``backward`` (a ``transpose(...)`` in its ``op_name``) or ``update`` (podscale's
    update scope: the gradient sums' consumers, the optimizer, the weight gather)."""
    op_name: str = ""
    dtype: str = ""
    """The dtype of its (first) result."""
    upcast: bool = False
    """A convert XLA:CPU adds around a bf16 matrix product (which it computes in f32); an
    accelerator runs the product in bf16 and has no such op (see ``_mark_upcasts``)."""
    conv_flops: float = 0.0
    """The part of ``matmul_flops`` in convolutions."""
    conv_channels: int = 0
    """The smaller of its (first) convolution's input and output feature counts."""


def _phase(op_name: str) -> str:
    if UPDATE_SCOPE in op_name:
        return "update"
    return "backward" if "transpose(" in op_name else "forward"


def _split_operands(rest: str) -> tuple[list[str], str]:
    """``rest`` starts after an instruction's ``(``: its operand names and the attributes after."""
    depth, i = 1, 0
    while i < len(rest) and depth:
        depth += {"(": 1, ")": -1}.get(rest[i], 0)
        i += 1
    inner, attrs = rest[: i - 1], rest[i:]
    return re.findall(r"%([\w.\-]+)", inner), attrs


def _elements(type_text: str) -> int:
    m = _ARRAY.search(type_text)
    if not m:
        return 0
    return math.prod(int(d) for d in m.group(2).split(",") if d) if m.group(2) else 1


def _dims(type_text: str) -> list[int]:
    m = _ARRAY.search(type_text)
    return [int(d) for d in m.group(2).split(",") if d] if m and m.group(2) else []


def _instr_flops(opcode: str, type_text: str, operand_types: list[str], attrs: str) -> tuple[float, float, str]:
    """(FLOPs, matmul FLOPs, matmul operand dtype) of one instruction."""
    out = _elements(type_text)
    if opcode == "dot":
        lhs = _dims(operand_types[0]) if operand_types else []
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", attrs)
        k = math.prod(lhs[int(d)] for d in m.group(1).split(",") if d) if m and lhs else 1
        f = 2.0 * out * k
        return f, f, _bytes(operand_types[0])[1] if operand_types else ""
    if opcode == "convolution":
        f = _conv_instr_flops(type_text, operand_types, attrs)
        return f, f, _bytes(operand_types[0])[1] if operand_types else ""
    if opcode in ("reduce", "reduce-window"):
        return float(sum(_elements(t) for t in operand_types[: max(1, len(operand_types) // 2)])), 0.0, ""
    if opcode in _FLOP_PER_ELEMENT:
        return float(out), 0.0, ""
    return 0.0, 0.0, ""


def _window(attrs: str) -> dict[str, list[str]]:
    m = re.search(r"window=\{([^}]*)\}", attrs)
    return {k: v.split("x") for k, v in re.findall(r"(\w+)=(\S+)", m.group(1))} if m else {}


def _conv_instr_flops(type_text: str, operand_types: list[str], attrs: str) -> float:
    """2 x multiply-adds of a convolution, counting only the window taps that fall on the input
    (not on padding), as XLA's cost analysis does: XLA:TPU writes some matrix products as
    convolutions whose padded window touches one input position (heads as a spatial dimension)."""
    out = _elements(type_text)
    lhs = _dims(operand_types[0]) if operand_types else []
    kernel = _dims(operand_types[1]) if len(operand_types) > 1 else []
    m = re.search(r"dim_labels=([^_]+)_([^-]+)->(\w+)", attrs)
    if not m or not kernel or not lhs:
        return 2.0 * out * (math.prod(kernel[:-1]) if kernel else 1)
    lhs_l, rhs_l, out_l = m.groups()
    outs = _dims(type_text)
    taps = float(kernel[rhs_l.index("i")]) if "i" in rhs_l else 1.0
    per_out = out / max(1, math.prod(outs[out_l.index(d)] for d in out_l if d.isdigit()))
    window = _window(attrs)
    spatial = sorted(d for d in rhs_l if d.isdigit())
    for n, d in enumerate(spatial):
        size, in_size, out_size = kernel[rhs_l.index(d)], lhs[lhs_l.index(d)], outs[out_l.index(d)]

        def field(key, default, n=n):
            v = window.get(key)
            return v[n] if v and n < len(v) else default

        stride, lo = int(field("stride", 1)), int(field("pad", "0_0").split("_")[0])
        lhs_dil, rhs_dil = int(field("lhs_dilate", 1)), int(field("rhs_dilate", 1))
        o = np.arange(out_size)[:, None]
        w = np.arange(size)[None, :]
        pos = o * stride + w * rhs_dil - lo  # in the (lhs-dilated) input
        valid = (pos >= 0) & (pos % lhs_dil == 0) & (pos // lhs_dil < in_size)
        taps *= float(valid.sum())
    return 2.0 * per_out * taps


def read_text(
    text: str, mesh_shape: dict[str, int] | None = None, memory: dict | None = None, platform: str = "cpu"
) -> Module:
    """Parses optimized HLO text. ``mesh_shape`` (axis -> size, in the mesh's order) names the axes.
    ``platform``: the compiler's (``tpu``: an all-reduce of which each device keeps one share is
    the reduce-scatter XLA:TPU runs it as, see :func:`_scattered`; XLA:CPU emits reduce-scatters)."""
    comps: dict[str, list[tuple]] = {}
    roots: dict[str, str] = {}
    entry, current = None, None
    devices = 0
    m = re.search(r"num_partitions=(\d+)", text)
    if m:
        devices = int(m.group(1))
    for line in text.splitlines():
        h = _HEADER.match(line)
        if h:
            current = h.group(2)
            comps[current] = []
            if h.group(1):
                entry = current
            continue
        if current is None:
            continue
        i = _INSTR.match(line)
        if not i:
            continue
        name, type_text, opcode, rest = i.groups()
        operands, attrs = _split_operands(rest)
        comps[current].append((name, type_text, opcode, operands, attrs, rest))
        if line.lstrip().startswith("ROOT "):
            roots[current] = name
    if entry is None:
        raise ValueError("no ENTRY computation in the module text")
    for comp, root in roots.items():  # each computation's root last, where the readers below look
        instrs = comps[comp]
        instrs.append(instrs.pop(next(i for i, ins in enumerate(instrs) if ins[0] == root)))
    calls: dict[str, list[tuple[str, int]]] = defaultdict(list)
    fusion_bodies: set[str] = set()  # a fusion's body, an async op's wrapped computation: not run on their own
    unknown: list[str] = []
    loop_trips: dict[tuple[str, str], int] = {}  # (computation, while) -> trips
    for comp, instrs in comps.items():
        for name, _, opcode, operands, attrs, rest in instrs:
            trips = 1
            if opcode == "while":
                trips = _trip_count(comps, comp, operands, attrs, rest)
                if trips is None:
                    unknown.append(name)
                    trips = 1
                loop_trips[comp, name] = trips
            for role, target in _CALLED.findall(attrs):
                for callee in re.findall(r"%?([\w.\-]+)", target):
                    if role == "to_apply" and opcode != "call":
                        continue  # a reducer, costed by its reduce
                    if opcode == "fusion" or (opcode == "async-start" and _wrapped_collective(comps, attrs)):
                        fusion_bodies.add(callee)
                        continue
                    calls[comp].append((callee, trips if role in ("body", "condition") else 1))
    runs: dict[str, int] = defaultdict(int)

    def visit(comp: str, times: int, depth: int = 0) -> None:
        if depth > 64:
            raise ValueError(f"computation nesting deeper than 64 at {comp}")
        runs[comp] += times
        for callee, trips in calls.get(comp, ()):
            if callee in comps:
                visit(callee, times * trips, depth + 1)

    visit(entry, 1)
    types = {c: {ins[0]: ins[1] for ins in instrs} for c, instrs in comps.items()}
    out, ops = [], []
    schedule: dict[str, list[tuple]] = {}
    for comp, instrs in comps.items():
        if not runs.get(comp) or comp in fusion_bodies:
            continue
        raw = {}
        events: list[tuple] = []
        started: dict[str, tuple[int, ...]] = {}  # an async collective's start -> its indices in ``out``
        readers: dict[str, list[tuple[tuple, int]]] = defaultdict(list)
        done_of: dict[str, str] = {}  # an async start -> its done
        for ins in instrs:
            for pos, o in enumerate(ins[3]):
                readers[o].append((ins, pos))
            if ins[2].endswith("-done") and ins[3]:
                done_of[ins[3][0]] = ins[0]
        for name, type_text, opcode, operands, attrs, rest in instrs:
            base = opcode.removesuffix("-start")
            op = _OP_NAME.search(rest)
            op_name = op.group(1) if op else ""
            if opcode == "async-start":
                wrapped = _wrapped_collective(comps, attrs)
                if wrapped is not None:
                    kind, w_type, w_rest = wrapped
                    op = _OP_NAME.search(w_rest)
                    w_name = op.group(1) if op else op_name
                    out.append(_collective(name, kind, kind, w_type, w_rest, mesh_shape, devices, runs[comp], w_name))
                    started[name] = (len(out) - 1,)
                    events.append(("start", started[name]))
                    continue
            if base in KINDS:
                if opcode.endswith("-done"):
                    continue
                c = _collective(name, base, opcode, type_text, rest, mesh_shape, devices, runs[comp], op_name)
                first = len(out)
                if base == "all-reduce" and platform == "tpu":
                    result = done_of.get(name, name) if opcode.endswith("-start") else name
                    out += _split_scatter(c, _scattered(comps, types, comp, readers, result, c.group_size))
                else:
                    out.append(c)
                indices = tuple(range(first, len(out)))
                if opcode.endswith("-start"):
                    started[name] = indices
                    events.append(("start", indices))
                else:
                    events.append(("sync", indices))
                continue
            if opcode.endswith("-done"):
                if operands and operands[0] in started:
                    events.append(("done", started[operands[0]]))
                continue
            if opcode in ("while", "call", "conditional", "async-start"):  # async-start here: not a collective
                trips = loop_trips.get((comp, name), 1)
                for role, target in _CALLED.findall(attrs):
                    if role == "to_apply" and opcode != "call":
                        continue
                    for callee in re.findall(r"%?([\w.\-]+)", target):
                        if callee in comps:
                            events.append(("call", callee, trips if role in ("body", "condition") else 1))
                continue
            if opcode in _NO_COST or opcode.endswith("-start"):
                continue
            operand_types = [types[comp].get(o, "") for o in operands]
            flops, mm, dtype, nbytes = _op_cost(comps, types, opcode, type_text, operand_types, attrs)
            out_dtype = _bytes(type_text)[1]
            conv, channels = _conv_flops(comps, types, opcode, type_text, operand_types, attrs)
            op = Op(name, opcode, flops, mm, nbytes, dtype, runs[comp], _phase(op_name), op_name, out_dtype)
            raw[name] = _Draft(
                dataclasses.replace(op, conv_flops=conv, conv_channels=channels),
                operands,
                operand_types,
                _converts(comps, opcode, attrs, operand_types, out_dtype),
            )
            events.append(("op", name))
        _mark_upcasts(raw)
        index = {name: len(ops) + i for i, name in enumerate(raw)}
        ops += [r.op for r in raw.values()]
        schedule[comp] = [("op", index[e[1]]) if e[0] == "op" else e for e in events]
    return Module(out, unknown, memory or {}, ops, schedule, entry)


_PASS_THROUGH = frozenset({"bitcast", "reshape", "copy"})


def _scattered(comps, types, comp: str, readers, result: str, n: int) -> list[int]:
    """The bytes of each buffer of an all-reduce (its ``result``; a combined all-reduce has
    several) of which each device keeps only its ``1/n`` share: every use reads only a slice of at
    most ``1/n`` of it (a dynamic slice by partition, directly or in a fusion). That is a
    reduce-scatter: XLA:TPU writes ``jax.lax.psum_scatter`` as an all-reduce and a dynamic slice
    of it, and runs the pair as a reduce-scatter. A buffer used in full counts 0."""
    if n <= 1:
        return []
    type_text = types.get(comp, {}).get(result, "")
    sizes = _bytes(type_text)[2]
    if not sizes:
        return []
    if type_text.lstrip().startswith("("):
        elements: dict[int, list[str]] = defaultdict(list)
        for ins, _ in readers.get(result, []):
            index = re.search(r"index=(\d+)", ins[4])
            if ins[2] != "get-tuple-element" or not index:
                return [0] * len(sizes)  # the tuple used whole
            elements[int(index.group(1))].append(ins[0])
        values = [elements.get(i, []) for i in range(len(sizes))]
    else:
        values = [[result]]
    out = []
    for size, names in zip(sizes, values, strict=False):
        read = max((_read_of(comps, types, readers, name, size) for name in names), default=size)
        out.append(size if read <= size / n * 1.01 else 0)
    return out


def _read_of(comps, types, readers, name: str, full: float, depth: int = 0) -> float:
    """The bytes of ``name`` a device reads: its static slices added up, and the most one dynamic
    slice (or fusion, reading through slices) reads, since several uses of a device's share read
    the same share; ``full`` for any other use, or none (a result of the computation)."""
    uses = readers.get(name, [])
    if not uses:
        return full  # a result of the computation: every device keeps all of it
    most = static = 0.0
    for ins, pos in uses:
        if ins[2] == "slice" and pos == 0:
            static += _bytes(ins[1])[0]  # different static slices of one buffer add up
            continue
        if ins[2] == "dynamic-slice" and pos == 0:
            read = _bytes(ins[1])[0]
        elif ins[2] in _PASS_THROUGH and depth < 8:
            read = _read_of(comps, types, readers, ins[0], full, depth + 1)
        elif ins[2] == "fusion":
            m = re.search(r"calls=%?([\w.\-]+)", ins[4])
            inner = comps.get(m.group(1), []) if m else []
            params = [i for i in inner if i[2] == "parameter" and re.match(rf"{pos}\)", i[5])]
            read = _fusion_reader(comps, types, m.group(1))(params[0][0], 0) if params else full
        else:
            return full
        most = max(most, read)
    return most + static


def _split_scatter(c: Collective, scattered: list[int]) -> list[Collective]:
    """``c``, an all-reduce, as XLA:TPU runs it: the buffers kept whole an all-reduce, the buffers
    of which each device keeps its share a reduce-scatter (see :func:`_scattered`)."""
    part = sum(scattered)
    if not part:
        return [c]
    out = []
    if c.buffer_bytes - part > 0:
        out.append(dataclasses.replace(c, buffer_bytes=c.buffer_bytes - part))
    out.append(dataclasses.replace(c, kind="reduce-scatter", name=c.name + ".scatter", buffer_bytes=part))
    return out


def _wrapped_collective(comps, attrs: str) -> tuple[str, str, str] | None:
    """(kind, result type, attributes) of the collective an ``async-start`` wraps (XLA:TPU runs a
    reduce-scatter or an all-to-all asynchronously this way); ``None`` for other async ops."""
    m = re.search(r"calls=%?([\w.\-]+)", attrs)
    for _, t, opc, _, _, rest in comps.get(m.group(1), []) if m else []:
        if opc in KINDS:
            return opc, t, rest
    return None


_CONSTANT = re.compile(r"^(-?\d+)\)")


def _trip_count(comps, comp: str, operands: list[str], attrs: str, rest: str) -> int | None:
    """A ``while`` loop's trip count: XLA's ``known_trip_count`` (XLA:CPU records it), else read
    from the loop (XLA:TPU does not record it): a condition ``i < N`` on a tuple element whose
    initial value is a constant (through copies), as ``jax.lax.scan`` and ``fori_loop`` lower."""
    t = _TRIP.search(rest)
    if t:
        return int(t.group(1))
    m = re.search(r"condition=%?([\w.\-]+)", attrs)
    cond = comps.get(m.group(1), []) if m else []
    if not cond or not operands:
        return None
    by_name = {ins[0]: ins for ins in cond}
    root = cond[-1]
    direction = re.search(r"direction=(\w+)", root[4])
    if root[2] != "compare" or not direction or direction.group(1) not in ("LT", "GT") or len(root[3]) != 2:
        return None
    counter, bound = root[3] if direction.group(1) == "LT" else root[3][::-1]
    limit = _constant_of(by_name, bound)
    element = by_name.get(counter)
    if limit is None or element is None or element[2] != "get-tuple-element":
        return None
    index = re.search(r"index=(\d+)", element[4])
    caller = {ins[0]: ins for ins in comps.get(comp, [])}
    init = caller.get(operands[0])
    if not index or init is None or init[2] != "tuple" or int(index.group(1)) >= len(init[3]):
        return None
    start = _constant_of(caller, init[3][int(index.group(1))])
    step = _loop_step(comps, attrs, int(index.group(1)))
    if start is None or step is None or limit < start:
        return None
    return -(-(limit - start) // step)


def _loop_step(comps, attrs: str, index: int) -> int | None:
    """What a loop's body adds to its counter (tuple element ``index``) each trip: the body's
    result element must be ``counter + constant``; ``None`` otherwise."""
    m = re.search(r"body=%?([\w.\-]+)", attrs)
    body = comps.get(m.group(1), []) if m else []
    if not body or body[-1][2] != "tuple" or index >= len(body[-1][3]):
        return None
    by_name = {ins[0]: ins for ins in body}
    add = by_name.get(body[-1][3][index])
    while add is not None and add[2] in ("copy", "bitcast") and add[3]:
        add = by_name.get(add[3][0])
    if add is None or add[2] != "add" or len(add[3]) != 2:
        return None
    for counter, constant in (add[3], add[3][::-1]):
        element = by_name.get(counter)
        step = _constant_of(by_name, constant)
        if element is not None and element[2] == "get-tuple-element" and step is not None and step > 0:
            if re.search(rf"index={index}\b", element[4]):
                return step
    return None


def _constant_of(by_name: dict, name: str, depth: int = 0) -> int | None:
    """The integer value of ``name``: a scalar ``constant``, through copies and bitcasts."""
    ins = by_name.get(name)
    if ins is None or depth > 8:
        return None
    if ins[2] == "constant":
        m = _CONSTANT.match(ins[5])
        return int(m.group(1)) if m and not _dims(ins[1]) else None
    if ins[2] in ("copy", "bitcast", "convert") and ins[3]:
        return _constant_of(by_name, ins[3][0], depth + 1)
    return None


def _conv_flops(comps, types, opcode, type_text, operand_types, attrs) -> tuple[float, int]:
    """(FLOPs in convolutions, the smaller feature count of the first) of a top-level op."""
    if opcode == "convolution":
        convs = [(type_text, operand_types, attrs)]
    elif opcode == "fusion":
        convs = _body_convs(comps, types, attrs)
    else:
        return 0.0, 0
    flops = sum(_instr_flops("convolution", t, ots, a)[1] for t, ots, a in convs)
    channels = 0
    if convs:
        _, ots, a = convs[0]
        kernel = _dims(ots[1]) if len(ots) > 1 else []
        m = re.search(r"dim_labels=[^_]+_([^-]+)->", a)
        if kernel and m and "i" in m.group(1) and "o" in m.group(1):
            channels = min(kernel[m.group(1).index("i")], kernel[m.group(1).index("o")])
    return flops, channels


_NARROW = ("bf16", "f16")
_SHAPE_ONLY = frozenset({"parameter", "convert", "bitcast", "copy", "transpose", "reshape", "broadcast"})


def _converts(comps, opcode, attrs, operand_types, out_dtype) -> str | None:
    """The dtype a convert-only op (a ``convert``, or a fusion of a convert and shape-only ops)
    converts from, when it changes bf16/f16 to f32 or back; else ``None``."""
    if opcode == "fusion":
        m = re.search(r"calls=%?([\w.\-]+)", attrs)
        body = comps.get(m.group(1), []) if m else []
        if not body or any(ins[2] not in _SHAPE_ONLY for ins in body) or not any(ins[2] == "convert" for ins in body):
            return None
    elif opcode != "convert":
        return None
    if len(operand_types) != 1:
        return None
    source = _bytes(operand_types[0])[1]
    if (source in _NARROW and out_dtype == "f32") or (source == "f32" and out_dtype in _NARROW):
        return source
    return None


@dataclasses.dataclass
class _Draft:
    """An op while its module is read: what :func:`_mark_upcasts` needs beside it."""

    op: Op
    operands: list[str]
    operand_types: list[str]
    converts_from: str | None
    """The dtype it converts from, when it is a convert-only op (see :func:`_converts`)."""


def _mark_upcasts(raw: dict[str, _Draft]) -> None:
    """XLA:CPU has no bf16 matrix products: it converts their operands to f32 and the result back.
    A matmul op all of whose float32 operands are such converts (from bf16 or f16) is marked with
    the program's dtype and its bytes at that width, and the converts around it as ``upcast``
    (ops an accelerator does not run). A product with a genuine float32 operand keeps float32."""
    narrow: set[str] = set()
    for name, r in raw.items():
        if not r.op.matmul_flops:
            continue
        wide = [(o, t) for o, t in zip(r.operands, r.operand_types, strict=False) if _bytes(t)[1] == "f32"]
        if not wide or any(o not in raw or raw[o].converts_from not in _NARROW for o, _ in wide):
            continue
        saved = sum(_bytes(t)[0] / 2 for _, t in wide)
        for o, _ in wide:
            raw[o].op = dataclasses.replace(raw[o].op, upcast=True)
        r.op = dataclasses.replace(r.op, matmul_dtype=raw[wide[0][0]].converts_from, bytes=max(0.0, r.op.bytes - saved))
        narrow.add(name)
    for r in raw.values():
        if r.converts_from == "f32" and r.operands and r.operands[0] in narrow:
            r.op = dataclasses.replace(r.op, upcast=True)
            mm = raw[r.operands[0]]
            mm.op = dataclasses.replace(mm.op, bytes=max(0.0, mm.op.bytes - _bytes(r.operand_types[0])[0] / 2))


def _nested_flops(comps, types, attrs: str, depth: int = 0) -> tuple[float, float, str]:
    """(FLOPs, matmul FLOPs, matmul dtype) of a fusion nested in a fusion's body."""
    m = re.search(r"calls=%?([\w.\-]+)", attrs)
    if not m or depth > 16:
        return 0.0, 0.0, ""
    btypes = types.get(m.group(1), {})
    flops = mm = 0.0
    dtype = ""
    for _, t, opc, operands, a, _ in comps.get(m.group(1), []):
        if opc == "fusion":
            f, g, d = _nested_flops(comps, types, a, depth + 1)
        else:
            f, g, d = _instr_flops(opc, t, [btypes.get(o, "") for o in operands], a)
        flops, mm, dtype = flops + f, mm + g, dtype or d
    return flops, mm, dtype


def _body_convs(comps, types, attrs: str, depth: int = 0) -> list[tuple]:
    """(result type, operand types, attributes) of each convolution in a fusion's body, nested
    fusions included."""
    m = re.search(r"calls=%?([\w.\-]+)", attrs)
    if not m or depth > 16:
        return []
    btypes = types.get(m.group(1), {})
    out = []
    for _, t, opc, operands, a, _ in comps.get(m.group(1), []):
        if opc == "convolution":
            out.append((t, [btypes.get(o, "") for o in operands], a))
        elif opc == "fusion":
            out += _body_convs(comps, types, a, depth + 1)
    return out


def _op_cost(comps, types, opcode, type_text, operand_types, attrs) -> tuple[float, float, str, float]:
    """(FLOPs, matmul FLOPs, matmul dtype, bytes) of a top-level op; a fusion sums its body."""
    if opcode != "fusion":
        flops, mm, dtype = _instr_flops(opcode, type_text, operand_types, attrs)
        if opcode in ("slice", "dynamic-slice"):
            return flops, mm, dtype, 2.0 * _bytes(type_text)[0]
        if opcode == "dynamic-update-slice":
            return flops, mm, dtype, 2.0 * _bytes(operand_types[1])[0] if len(operand_types) > 1 else 0.0
        return flops, mm, dtype, float(_bytes(type_text)[0] + sum(_bytes(t)[0] for t in operand_types))
    m = re.search(r"calls=%?([\w.\-]+)", attrs)
    body = comps.get(m.group(1), []) if m else []
    btypes = types.get(m.group(1), {}) if m else {}
    flops = mm = 0.0
    dtype = ""
    converts: dict[str, str] = {}  # a convert's name -> its operand's dtype
    for name, _, opc, operands, a, _ in body:
        if opc == "parameter":
            continue
        if opc == "fusion":  # XLA:TPU nests fusions (a matmul's operand fusion): their work counts here
            f, g, d = _nested_flops(comps, types, a)
        else:
            f, g, d = _instr_flops(opc, btypes.get(name, ""), [btypes.get(o, "") for o in operands], a)
        if g and operands and operands[0] in converts:
            d = converts[operands[0]]  # XLA:CPU computes a bf16 product in f32: the program's dtype is the input's
        if opc == "convert" and operands:
            converts[name] = _bytes(btypes.get(operands[0], ""))[1]
        flops, mm, dtype = flops + f, mm + g, dtype or d
    return flops, mm, dtype, _fusion_bytes(comps, types, m.group(1) if m else "", type_text, operand_types)


_SHAPE = frozenset({"bitcast", "get-tuple-element"})


def _fusion_bytes(comps, types, body_name: str, type_text: str, operand_types: list[str], depth: int = 0) -> float:
    """Bytes a fusion moves to and from memory: each parameter as it is read (only the slices a
    parameter read through slices or dynamic slices, in nested fusions too; nothing of the buffer a
    dynamic-update-slice updates in place), and each result as written (an in-place update: the
    update, read and written)."""
    body = comps.get(body_name, [])
    if not body:
        return float(_bytes(type_text)[0] + sum(_bytes(t)[0] for t in operand_types))
    by_name = {ins[0]: ins for ins in body}
    params: dict[int, str] = {}
    for ins in body:
        if ins[2] == "parameter":
            m = re.match(r"(\d+)", ins[5])
            params[int(m.group(1)) if m else len(params)] = ins[0]
    root = body[-1]

    def through(name: str) -> tuple | None:  # the instruction behind bitcasts
        ins = by_name.get(name)
        while ins is not None and ins[2] == "bitcast" and ins[3]:
            ins = by_name.get(ins[3][0])
        return ins

    in_place: set[str] = set()
    nbytes = 0.0
    for e in root[3] if root[2] == "tuple" else [root[0]]:
        ins = through(e)
        if ins is not None and ins[2] == "dynamic-update-slice" and len(ins[3]) > 1:
            target = through(ins[3][0])
            if target is not None and target[2] == "parameter":
                in_place.add(target[0])
            nbytes += 2.0 * _bytes(types.get(body_name, {}).get(ins[3][1], ""))[0]  # the update, read and written
        else:
            nbytes += _bytes(by_name[e][1] if e in by_name else "")[0]

    read = _fusion_reader(comps, types, body_name)
    for index, pname in params.items():
        if pname in in_place:
            continue
        nbytes += read(pname, depth) if pname in by_name else _bytes(operand_types[index])[0]
    return nbytes


def _fusion_reader(comps, types, body_name: str):
    """The ``read`` of :func:`_fusion_bytes` for a nested fusion's body."""
    body = comps.get(body_name, [])
    by_name = {ins[0]: ins for ins in body}
    readers: dict[str, list[tuple[tuple, int]]] = defaultdict(list)
    for ins in body:
        for pos, o in enumerate(ins[3]):
            readers[o].append((ins, pos))

    def read(name: str, level: int) -> float:
        full = float(_bytes(by_name[name][1])[0])
        total = 0.0
        for ins, pos in readers.get(name, []):
            if ins[2] in ("slice", "dynamic-slice") and pos == 0:
                total += _bytes(ins[1])[0]
            elif ins[2] == "dynamic-update-slice" and pos == 0:
                continue  # updated in place: its update is counted with the result
            elif ins[2] in _SHAPE:
                total += read(ins[0], level)
            elif ins[2] == "fusion" and level < 8:
                m = re.search(r"calls=%?([\w.\-]+)", ins[4])
                inner = comps.get(m.group(1) if m else "", [])
                names = [i for i in inner if i[2] == "parameter" and re.match(rf"{pos}\)", i[5])]
                total += _fusion_reader(comps, types, m.group(1))(names[0][0], level + 1) if names else full
            else:
                return full
        return min(full, total)

    return read


def _collective(name, kind, opcode, type_text, rest, mesh_shape, devices, count, op_name) -> Collective:
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
    return Collective(kind, name, axes, size, dtype, int(total), count, op_name)


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
    platform = mesh.devices.flat[0].platform if mesh is not None else "cpu"
    return read_text(compiled.as_text(), shape, memory_of(compiled), platform)
