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
"All-reduce, all-gather, reduce-scatter"; the same formulas as ``podscale.compiled.gradsum_cost``):
over a group of ``n`` devices, for an ``S``-byte buffer, all-reduce ``2 (n - 1) / n * S``,
reduce-scatter and all-to-all ``(n - 1) / n * S``, all-gather ``(n - 1) * S``, collective-permute
``S``.

Costing each op (its FLOPs and bytes, the :class:`~podscale.compiled.hlo_cost.Op` record) is
:mod:`podscale.compiled.hlo_cost`; a collective's replica groups and mesh axes,
:mod:`podscale.compiled.hlo_groups`; a loop's trip count, :mod:`podscale.compiled.hlo_loops`.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from collections.abc import Sequence

from podscale.compiled import hlo_async
from podscale.compiled.hlo_cost import (
    NO_COST,
    Draft,
    Op,
    convert_from_dtype,
    fusion_reader,
    mark_upcasts,
    op_conv_flops,
    op_cost,
    op_kind,
    op_matmuls,
    op_transcendentals,
    type_bytes,
)
from podscale.compiled.hlo_groups import group_axes, pair_axes, replica_groups
from podscale.compiled.hlo_loops import trip_count
from podscale.compiled.hlo_memory import device_bytes as device_bytes
from podscale.compiled.hlo_memory import memory_of as memory_of

KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
PHASES = ("forward", "backward", "update")

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][a-z0-9\-]*)\((.*)$")
_CALLED = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation|branch_computations)="
    r"(\{[^}]*\}|%?[\w.\-]+)"
)
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_MEGASCALE = re.compile(r'_xla_host_transfer_handler_name="xla_megascale_runtime"')
_RENDEZVOUS = re.compile(r'_xla_host_transfer_rendezvous="([^"]*)"')
DCN = "dcn"
"""The axes of a collective across slices: XLA:TPU's multislice module sends each buffer a
collective sums (or gathers) across slices to the megascale runtime (a ``send`` to the host),
which runs it over the data-centre network; the module's own collective is the slice's part."""


def _megascale_kind(key: str) -> str:
    key = key.lower()
    if "gather" in key:
        return "all-gather"
    if "scatter" in key:
        return "reduce-scatter"
    return "all-to-all" if "all_to_all" in key or "all-to-all" in key else "all-reduce"


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
    ``peak`` (= arguments + outputs + temporaries - aliased) bytes per device; ``allocated``, the
    compiler's own peak of its buffer assignment, where it gives one; ``host_temporaries``, buffers
    a remat policy offloads to host memory, where there are any."""
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

    def copy_bytes(self, phases: Sequence[str] = PHASES, relayouts: bool | None = None) -> float:
        """Bytes the module's ``copy`` instructions read and write per device per step, or those that
        change a layout (``relayouts=True``) or not (``False``): see :attr:`Op.relayout`. A copy
        fused with other work (XLA:GPU fuses relayouts) is not counted."""
        ops = [o for o in self.ops if o.phase in phases and o.opcode == "copy"]
        return sum(o.bytes * o.count for o in ops if relayouts in (None, o.relayout))

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
            "copy_bytes": {p: self.copy_bytes([p]) for p in PHASES},
            "relayout_bytes": {p: self.copy_bytes([p], relayouts=True) for p in PHASES},
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


UPDATE_SCOPE = "podscale_update"
"""The name scope of the gradient sums and of everything downstream of them (the optimizer update,
the weight gather), which :mod:`podscale.parallel.weight_update` opens: compiled ops carry it in
their ``op_name``, so the update's cost is told from the forward and backward passes'."""

GRAD_SUM_SCOPE = "grad_sum"
"""Nested in ``UPDATE_SCOPE``: the gradient sums themselves (not the norms' partial sums, not the
weight gather), the collectives that may overlap the backward pass."""

CHUNK_GATHER_SCOPE = "podscale_chunk_gather"
"""The name scope of a stored chunk's all-gather for its use (FSDP's per-layer gathers): its
buffer is the chunk, smaller at a target with more replicas of the chunks' axes."""

_SCOPES = frozenset(
    "shard_map while body cond closed_call checkpoint remat pjit".split()
    + [UPDATE_SCOPE, GRAD_SUM_SCOPE, CHUNK_GATHER_SCOPE]
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


_ALLOCATES = re.compile(r'custom_call_target="AllocateBuffer"')
"""XLA:TPU's buffer allocation: it moves no data (its result is written by the ops after it)."""
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')


def unnamed_phases(comps: dict[str, list[tuple]]):
    """The phase of an instruction without an ``op_name`` (XLA:TPU's relayouts, loops and buffers it
    adds around a collective or a reshape): its consumers' (through other unnamed instructions),
    else the phase of the instruction that calls its computation (a loop's body), else its
    producers'; ``update`` wins where they differ, ``forward`` where none has one. Returns
    ``phase(computation, name)``."""
    by = {c: {ins[0]: ins for ins in instrs} for c, instrs in comps.items()}
    readers: dict[str, dict[str, list[str]]] = {c: defaultdict(list) for c in comps}
    caller: dict[str, tuple[str, str]] = {}
    for c, instrs in comps.items():
        for ins in instrs:
            for o in ins[3]:
                readers[c][o].append(ins[0])
            for _, target in _CALLED.findall(ins[4]):
                for callee in re.findall(r"%?([\w.\-]+)", target):
                    caller.setdefault(callee, (c, ins[0]))
    memo: dict[tuple[str, str], str | None] = {}

    def named(c: str, name: str) -> str | None:
        m = _OP_NAME.search(by[c][name][5])
        return _phase(m.group(1)) if m and m.group(1) else None

    def search(c: str, start: str, step) -> list[str]:
        seen, frontier, found = {start}, [start], []
        while frontier and not found:
            following = []
            for n in frontier:
                for m in step(c, n):
                    if m in seen or m not in by[c]:
                        continue
                    seen.add(m)
                    q = named(c, m)
                    (found.append(q) if q else following.append(m))
            frontier = following
        return found

    def phase(c: str, name: str, depth: int = 0) -> str:
        if (c, name) in memo:
            return memo[c, name] or "forward"
        memo[c, name] = None  # a cycle through callers: no answer from there
        found = search(c, name, lambda c, n: readers[c].get(n, ()))
        if not found and c in caller and depth < 64:
            cc, cn = caller[c]
            found = [named(cc, cn) or phase(cc, cn, depth + 1)]
        if not found:
            found = search(c, name, lambda c, n: by[c][n][3])
        memo[c, name] = "update" if "update" in found else (found[0] if found else "forward")
        return memo[c, name]

    return phase


_UNNAMED = {"update": f"{UPDATE_SCOPE}/(unnamed)", "backward": "transpose((unnamed))", "forward": ""}
"""The ``op_name`` an unnamed instruction is read with, for the phase :func:`unnamed_phases` gives it."""


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


def read_text(
    text: str,
    mesh_shape: dict[str, int] | None = None,
    memory: dict | None = None,
    platform: str = "cpu",
    slices: int = 1,
) -> Module:
    """Parses optimized HLO text. ``mesh_shape`` (axis -> size, in the mesh's order) names the axes.
    ``platform``: the compiler's (``tpu``: an all-reduce of which each device keeps one share is
    the reduce-scatter XLA:TPU runs it as, see :func:`_scattered`; XLA:CPU emits reduce-scatters).
    ``slices``: the TPU slices the module spans; each buffer it sends to the megascale runtime is a
    collective over them (axes ``(DCN,)``)."""
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
                trips = trip_count(comps, comp, operands, attrs, rest)
                if trips is None:
                    unknown.append(name)
                    trips = 1
                loop_trips[comp, name] = trips
            for role, target in _CALLED.findall(attrs):
                for callee in re.findall(r"%?([\w.\-]+)", target):
                    if role == "to_apply" and opcode != "call":
                        continue  # a reducer, costed by its reduce
                    if opcode == "fusion" or hlo_async.wrapped_collective(comps, opcode, attrs):
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
    unnamed = unnamed_phases(comps)
    out, ops = [], []
    schedule: dict[str, list[tuple]] = {}
    for comp, instrs in comps.items():
        if not runs.get(comp) or comp in fusion_bodies:
            continue
        raw = {}
        events: list[tuple] = []
        started: dict[str, tuple[int, ...]] = {}  # an async collective's start -> its indices in ``out``
        readers: dict[str, list[tuple[tuple, int]]] = defaultdict(list)
        done_of: dict[str | None, str] = {}  # an async start -> its done
        by_name = {ins[0]: ins for ins in instrs}
        for ins in instrs:
            for pos, o in enumerate(ins[3]):
                readers[o].append((ins, pos))
            if ins[2].endswith("-done") and ins[3]:
                done_of[ins[3][0]] = ins[0]
        wrapped_of = {ins[0]: w for ins in instrs if (w := hlo_async.wrapped_collective(comps, ins[2], ins[4]))}
        dones = [ins for ins in instrs if hlo_async.is_done(comps, ins[2], ins[4])]
        for ins in dones:
            done_of[hlo_async.start_of(by_name, ins[3], wrapped_of)] = ins[0]
        done_start = {done: start for start, done in done_of.items()}
        dones = {ins[0] for ins in dones}
        for name, type_text, opcode, operands, attrs, rest in instrs:
            base = opcode.removesuffix("-start")
            op = _OP_NAME.search(rest)
            op_name = op.group(1) if op else ""
            if opcode == "send" and _MEGASCALE.search(rest):  # a collective's part across slices
                key = _RENDEZVOUS.search(rest)
                _, dtype, sizes = type_bytes(type_text)
                source = operands[0] if operands else None
                for _ in range(6):  # the collective it sends: its name scope (the phase)
                    if source not in by_name or op_name:
                        break
                    found = _OP_NAME.search(by_name[source][5])
                    op_name = found.group(1) if found else ""
                    source = by_name[source][3][0] if by_name[source][3] else None
                kind = _megascale_kind(key.group(1) if key else "")
                out.append(Collective(kind, name, (DCN,), slices, dtype, int(sizes[0]), runs[comp], op_name))
                started[name] = (len(out) - 1,)  # runs while the ops up to its send-done run
                events.append(("start", started[name]))
                continue
            if not op_name and opcode not in NO_COST:
                op_name = _UNNAMED[unnamed(comp, name)]
            wrapped = wrapped_of.get(name)
            kind_opcode = opcode  # the collective's own opcode (a wrapped one's: its result type is plain)
            if wrapped is not None:  # an async-start of a collective, or XLA:TPU's async collective fusion
                base, type_text, rest = wrapped
                kind_opcode, opcode = base, base + "-start"
                op = _OP_NAME.search(rest)
                op_name = op.group(1) if op else op_name
            elif name in dones:
                if done_start.get(name) in started:
                    events.append(("done", started.pop(done_start[name])))
                continue
            if base in KINDS:
                if opcode.endswith("-done"):
                    continue
                c = _collective(name, base, kind_opcode, type_text, rest, mesh_shape, devices, runs[comp], op_name)
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
                    events.append(("done", started.pop(operands[0])))
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
            if opcode in NO_COST or opcode.endswith("-start") or _ALLOCATES.search(attrs):
                continue
            operand_types = [types[comp].get(o, "") for o in operands]
            flops, mm, dtype, nbytes = op_cost(comps, types, opcode, type_text, operand_types, attrs)
            out_dtype = type_bytes(type_text)[1]
            args = (comps, types, opcode, type_text, operand_types, attrs)
            conv, channels = op_conv_flops(*args)
            op = Op(name, opcode, flops, mm, nbytes, dtype, runs[comp], _phase(op_name), op_name, out_dtype)
            shapes = {"matmuls": op_matmuls(*args), "transcendentals": op_transcendentals(*args)}
            shapes |= op_kind(platform, opcode, type_text, operand_types)
            cycles = _CYCLES.search(attrs)
            if cycles:
                shapes["estimated_cycles"] = float(cycles.group(1))
            raw[name] = Draft(
                dataclasses.replace(op, conv_flops=conv, conv_channels=channels, **shapes),
                operands,
                operand_types,
                convert_from_dtype(comps, opcode, attrs, operand_types, out_dtype),
            )
            events.append(("op", name))
        mark_upcasts(raw)
        index = {name: len(ops) + i for i, name in enumerate(raw)}
        ops += [r.op for r in raw.values()]
        events += [("done", indices) for indices in started.values()]  # no done found: waited for at the end
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
    sizes = type_bytes(type_text)[2]
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
            static += type_bytes(ins[1])[0]  # different static slices of one buffer add up
            continue
        if ins[2] == "dynamic-slice" and pos == 0:
            read = type_bytes(ins[1])[0]
        elif ins[2] in _PASS_THROUGH and depth < 8:
            read = _read_of(comps, types, readers, ins[0], full, depth + 1)
        elif ins[2] == "fusion":
            m = re.search(r"calls=%?([\w.\-]+)", ins[4])
            inner = comps.get(m.group(1), []) if m else []
            params = [i for i in inner if i[2] == "parameter" and re.match(rf"{pos}\)", i[5])]
            logical = lambda t: type_bytes(t)[0]  # noqa: E731  (a share, not its tiles' padding)
            read = fusion_reader(comps, types, m.group(1), logical)(params[0][0], 0) if params else full
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


def _collective(name, kind, opcode, type_text, rest, mesh_shape, devices, count, op_name) -> Collective:
    total, dtype, sizes = type_bytes(type_text)
    if kind == "collective-permute":
        size, axes = 2, pair_axes(rest, mesh_shape)
    else:
        size, axes = group_axes(replica_groups(rest), mesh_shape, devices)
    if opcode == "all-gather-start":  # (operands..., results...)
        total = sum(sizes[len(sizes) // 2 :])
    elif opcode == "collective-permute-start" and len(sizes) > 1:  # (operand, result, contexts)
        total = sizes[1]
    if kind == "reduce-scatter":
        total *= size  # the output is one shard of the input
    elif kind == "all-gather":
        total //= size  # the output is every device's input
    return Collective(kind, name, axes, size, dtype, int(total), count, op_name)


def read(compiled, mesh=None) -> Module:
    """The collectives and memory of ``jax.jit(...).lower(...).compile()`` (one device's program)."""
    shape = dict(mesh.shape) if mesh is not None else None
    platform = mesh.devices.flat[0].platform if mesh is not None else "cpu"
    slices = len({getattr(d, "slice_index", 0) for d in mesh.devices.flat}) if mesh is not None else 1
    return read_text(compiled.as_text(), shape, memory_of(compiled), platform, slices)
