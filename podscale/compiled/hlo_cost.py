"""Costing the ops of a compiled module: what one HLO instruction, or one fusion, does per run.

An op's FLOPs (dots and convolutions at 2 per multiply-add, counting only the window taps a
convolution's input covers; one per element of elementwise arithmetic and reductions, summed over
a fusion's body and the fusions nested in it) and bytes (operands read and the result written; a
fusion's parameters as they are read, slices only where read through slices, an in-place
dynamic-update-slice's update), the sizes of HLO types they are counted from, the :class:`Op`
record that carries them, and XLA:CPU's converts around bf16 matrix products (``mark_upcasts``).
XLA:GPU's calls into cuBLAS and cuDNN are costed as the dots and convolutions they run
(:mod:`podscale.compiled.hlo_library`), on every path a dot or a convolution is: FLOPs, matmul
FLOPs and dtype, convolution FLOPs and channels, the matrix shapes (``Op.matmuls``).
:mod:`podscale.compiled.hlo` reads the module and calls these for each op that does work.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

import numpy as np

from podscale.compiled.hlo_library import as_product, written_type

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


def type_bytes(type_text: str) -> tuple[int, str, list[int]]:
    """Total bytes of an HLO type (array or tuple), the first array's dtype, and each array's bytes."""
    sizes, first = [], ""
    for dtype, dims in _ARRAY.findall(type_text):
        first = first or dtype
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        sizes.append(int(n * _DTYPE_BYTES[dtype]))
    return sum(sizes), first, sizes


_TILED = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\](?:\{([\d,]*)(?::([^}]*))?\})?")


def memory_bytes(type_text: str) -> int:
    """Bytes an HLO type takes in memory: as :func:`type_bytes`, but an array with a tiled layout
    (XLA:TPU's ``{3,0,2,1:T(8,128)(2,1)}``: its minor-to-major order, then tiles over its most
    minor dimensions) is counted with those dimensions rounded up to its first tile, as the chip
    stores and streams it (a 3-channel image whose channels are the minor dimension takes 128 lanes
    of 3). Without a tile (XLA:CPU, XLA:GPU) it is :func:`type_bytes`."""
    total = 0
    for dtype, dims, order, tiling in _TILED.findall(type_text):
        shape = [int(d) for d in dims.split(",") if d]
        tile = re.match(r"T\(([\d,]+)\)", tiling or "")
        if tile and shape:
            minor = [int(d) for d in order.split(",") if d] or list(range(len(shape)))[::-1]
            for size, dim in zip(reversed([int(t) for t in tile.group(1).split(",")]), minor, strict=False):
                shape[dim] = -(-shape[dim] // size) * size
        total += int(math.prod(shape) * _DTYPE_BYTES[dtype]) if shape else int(_DTYPE_BYTES[dtype])
    return total


NO_COST = frozenset(
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
        "send",
        "recv",
        "send-done",
        "recv-done",
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
TRANSCENDENTAL_OPS = _TRANSCENDENTAL | {"divide"}
"""The opcodes whose elements :attr:`Op.transcendentals` counts: the transcendental functions and
``divide`` (which a TPU computes with a reciprocal on its transcendental unit, as GPUs do with
their special-function units), each element of their result once."""


_SCALAR_MEMORY = re.compile(r"\w+\[[\d,]*\]\{[^}]*S\(6\)\}")
"""An array in XLA:TPU's scalar memory (memory space 6; in its modules, scalars and one-element
arrays only)."""


def scalar_unit(type_text: str, operand_types) -> bool:
    """An op of a TPU core's scalar unit (:attr:`Op.scalar`): one element in XLA:TPU's scalar
    memory, computed from one-element operands (a reduction of an array into such a scalar is a
    kernel)."""
    one = _elements(type_text) == 1 and all(_elements(t) == 1 for t in operand_types)
    return one and _SCALAR_MEMORY.fullmatch(type_text) is not None


_LAYOUT = re.compile(r"\{([^}]*)\}")
_MEMORY_SPACE = re.compile(r":?S\(\d+\)")


def relayout(opcode: str, type_text: str, operand_types) -> bool:
    """A copy that changes its operand's layout (:attr:`Op.relayout`): the minor-to-major order or
    the tiles differ (``{1,0:T(8,128)}`` -> ``{0,1:T(8,128)}``); a memory space alone does not."""

    def layout(t: str) -> str:
        m = _LAYOUT.search(t)
        return _MEMORY_SPACE.sub("", m.group(1)) if m else ""

    known = bool(operand_types) and bool(operand_types[0])
    return opcode == "copy" and known and layout(type_text) != layout(operand_types[0])


def op_kind(platform: str, opcode: str, type_text: str, operand_types) -> dict[str, bool]:
    """:attr:`Op.scalar` (XLA:TPU's modules only) and :attr:`Op.relayout` of an op."""
    scalar = platform == "tpu" and scalar_unit(type_text, operand_types)
    return {"scalar": scalar, "relayout": relayout(opcode, type_text, operand_types)}


@dataclasses.dataclass(frozen=True)
class Op:
    """One op of the compiled module that does work: a fusion, a dot, a convolution, a copy, ...
    (collectives are :class:`~podscale.compiled.hlo.Collective`). Figures are per device per run."""

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
    accelerator runs the product in bf16 and has no such op (see ``mark_upcasts``)."""
    conv_flops: float = 0.0
    """The part of ``matmul_flops`` in convolutions."""
    conv_channels: int = 0
    """The smaller of its (first) convolution's input and output feature counts."""
    matmuls: tuple[tuple[int, int, int, int], ...] = ()
    """``(batch, m, n, k)`` of each matrix product it runs, in the order of the module: each dot,
    convolution and cuBLAS/cuDNN custom-call of the op or of its fusion body (nested fusions too),
    see :func:`op_matmuls`."""
    transcendentals: float = 0.0
    """Elements computed by transcendental ops and divides (``TRANSCENDENTAL_OPS``), summed over a
    fusion's body (nested fusions too); see :func:`op_transcendentals`."""
    estimated_cycles: float = 0.0
    """XLA:TPU's own estimate of one run's cycles (its ``backend_config``'s ``estimated_cycles``);
    0 where the module gives none (XLA:CPU, XLA:GPU)."""
    scalar: bool = False
    """XLA:TPU put its result in the core's scalar memory (``S(6)`` in its layout: the scalars and
    one-element arrays of control flow, replica indices and random keys): it runs on the scalar
    unit, no kernel of the vector or matrix units."""
    relayout: bool = False
    """A ``copy`` into another layout (:func:`relayout`); a copy in its operand's own layout is a
    buffer XLA could not write in place: on XLA:TPU, each collective's result that the step returns
    (the sharded update's gathered weights), and a donated input it cannot update in place."""


def _elements(type_text: str) -> int:
    m = _ARRAY.search(type_text)
    if not m:
        return 0
    return math.prod(int(d) for d in m.group(2).split(",") if d) if m.group(2) else 1


def type_dims(type_text: str) -> list[int]:
    m = _ARRAY.search(type_text)
    return [int(d) for d in m.group(2).split(",") if d] if m and m.group(2) else []


def _instr_flops(opcode: str, type_text: str, operand_types: list[str], attrs: str) -> tuple[float, float, str]:
    """(FLOPs, matmul FLOPs, matmul operand dtype) of one instruction; a cuBLAS or cuDNN custom-call
    counts as the dot or convolution it runs, its dtype its first operand's."""
    if opcode == "custom-call":
        product = as_product(opcode, type_text, operand_types, attrs)
        if product is None:
            return 0.0, 0.0, ""
        f, g, _ = _instr_flops(*product)
        return f, g, type_bytes(operand_types[0])[1]
    out = _elements(type_text)
    if opcode == "dot":
        lhs = type_dims(operand_types[0]) if operand_types else []
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", attrs)
        k = math.prod(lhs[int(d)] for d in m.group(1).split(",") if d) if m and lhs else 1
        f = 2.0 * out * k
        return f, f, type_bytes(operand_types[0])[1] if operand_types else ""
    if opcode == "convolution":
        f = _conv_instr_flops(type_text, operand_types, attrs)
        return f, f, type_bytes(operand_types[0])[1] if operand_types else ""
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
    lhs = type_dims(operand_types[0]) if operand_types else []
    kernel = type_dims(operand_types[1]) if len(operand_types) > 1 else []
    m = re.search(r"dim_labels=([^_]+)_([^-]+)->(\w+)", attrs)
    if not m or not kernel or not lhs:
        return 2.0 * out * (math.prod(kernel[:-1]) if kernel else 1)
    lhs_l, rhs_l, out_l = m.groups()
    outs = type_dims(type_text)
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


def op_conv_flops(comps, types, opcode, type_text, operand_types, attrs) -> tuple[float, int]:
    """(FLOPs in convolutions, the smaller feature count of the first) of a top-level op."""
    convs = [p[1:] for p in _products(comps, types, opcode, type_text, operand_types, attrs) if p[0] == "convolution"]
    flops = float(sum(_conv_instr_flops(t, ots, a) for t, ots, a in convs))
    channels = 0
    if convs:
        _, ots, a = convs[0]
        kernel = type_dims(ots[1]) if len(ots) > 1 else []
        m = re.search(r"dim_labels=[^_]+_([^-]+)->", a)
        if kernel and m and "i" in m.group(1) and "o" in m.group(1):
            channels = min(kernel[m.group(1).index("i")], kernel[m.group(1).index("o")])
    return flops, channels


def _instructions(comps, types, opcode, type_text, operand_types, attrs, depth: int = 0):
    """(opcode, type, operand types, attributes) of each instruction a top-level op runs: the op
    itself, or each of a fusion's body (a nested fusion's body in its place)."""
    if opcode != "fusion":
        yield opcode, type_text, operand_types, attrs
        return
    m = re.search(r"calls=%?([\w.\-]+)", attrs)
    if not m or depth > 16:
        return
    btypes = types.get(m.group(1), {})
    for _, t, opc, operands, a, _ in comps.get(m.group(1), []):
        yield from _instructions(comps, types, opc, t, [btypes.get(o, "") for o in operands], a, depth + 1)


def _products(comps, types, opcode, type_text, operand_types, attrs):
    """(opcode, type, operand types, attributes) of each dot and convolution a top-level op runs,
    a cuBLAS or cuDNN custom-call as the dot or convolution it computes."""
    for ins in _instructions(comps, types, opcode, type_text, operand_types, attrs):
        if ins[0] in ("dot", "convolution"):
            yield ins
        elif (product := as_product(*ins)) is not None:
            yield product


def _dim_list(attrs: str, key: str) -> list[int]:
    m = re.search(rf"\b{key}=\{{([\d,]*)\}}", attrs)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def matmul_shape(opcode: str, type_text: str, operand_types: list[str], attrs: str) -> tuple[int, int, int, int]:
    """``(batch, m, n, k)`` of a ``dot`` or ``convolution``. A dot: the product of its batch
    dimensions, of the lhs's other non-contracting dimensions, of the rhs's, and of the contracting
    dimensions. A convolution, as the matrix product it is: batch 1, ``m`` the output's batch times
    its spatial positions, ``n`` its output features, ``k`` the input features per group times the
    kernel's window taps (all of them, those on padding too)."""
    out = _elements(type_text)
    lhs = type_dims(operand_types[0]) if operand_types else []
    rhs = type_dims(operand_types[1]) if len(operand_types) > 1 else []
    if opcode == "dot":
        lb, lc = _dim_list(attrs, "lhs_batch_dims"), _dim_list(attrs, "lhs_contracting_dims")
        rb, rc = _dim_list(attrs, "rhs_batch_dims"), _dim_list(attrs, "rhs_contracting_dims")
        batch = math.prod(lhs[d] for d in lb if d < len(lhs))
        k = math.prod(lhs[d] for d in lc if d < len(lhs))
        m = math.prod(s for d, s in enumerate(lhs) if d not in lb and d not in lc)
        n = math.prod(s for d, s in enumerate(rhs) if d not in rb and d not in rc) if rhs else out // max(1, batch * m)
        return batch, m, n, k
    labels = re.search(r"dim_labels=[^_]+_([^-]+)->(\w+)", attrs)
    outs = type_dims(type_text)
    if not labels or not rhs or "f" not in labels.group(2) or "i" not in labels.group(1):
        n = rhs[-1] if rhs else 1
        return 1, out // max(1, n), n, math.prod(rhs[:-1]) if rhs else 1
    kernel_l, out_l = labels.groups()
    n = outs[out_l.index("f")]
    taps = math.prod(rhs[kernel_l.index(d)] for d in kernel_l if d.isdigit())
    return 1, out // max(1, n), n, rhs[kernel_l.index("i")] * taps


def op_matmuls(comps, types, opcode, type_text, operand_types, attrs) -> tuple[tuple[int, int, int, int], ...]:
    """:func:`matmul_shape` of each matrix product a top-level op runs (see :attr:`Op.matmuls`)."""
    return tuple(matmul_shape(*p) for p in _products(comps, types, opcode, type_text, operand_types, attrs))


def op_transcendentals(comps, types, opcode, type_text, operand_types, attrs) -> float:
    """Elements a top-level op computes with ``TRANSCENDENTAL_OPS`` (a fusion: over its body)."""
    ins = _instructions(comps, types, opcode, type_text, operand_types, attrs)
    return float(sum(_elements(t) for opc, t, _, _ in ins if opc in TRANSCENDENTAL_OPS))


_NARROW = ("bf16", "f16")
_SHAPE_ONLY = frozenset({"parameter", "convert", "bitcast", "copy", "transpose", "reshape", "broadcast"})


def convert_from_dtype(comps, opcode, attrs, operand_types, out_dtype) -> str | None:
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
    source = type_bytes(operand_types[0])[1]
    if (source in _NARROW and out_dtype == "f32") or (source == "f32" and out_dtype in _NARROW):
        return source
    return None


@dataclasses.dataclass
class Draft:
    """An op while its module is read: what :func:`mark_upcasts` needs beside it."""

    op: Op
    operands: list[str]
    operand_types: list[str]
    converts_from: str | None
    """The dtype it converts from, when it is a convert-only op (see :func:`convert_from_dtype`)."""


def mark_upcasts(raw: dict[str, Draft]) -> None:
    """XLA:CPU has no bf16 matrix products: it converts their operands to f32 and the result back.
    A matmul op all of whose float32 operands are such converts (from bf16 or f16) is marked with
    the program's dtype and its bytes at that width, and the converts around it as ``upcast``
    (ops an accelerator does not run). A product with a genuine float32 operand keeps float32."""
    narrow: set[str] = set()
    for name, r in raw.items():
        if not r.op.matmul_flops:
            continue
        wide = [(o, t) for o, t in zip(r.operands, r.operand_types, strict=False) if type_bytes(t)[1] == "f32"]
        if not wide or any(o not in raw or raw[o].converts_from not in _NARROW for o, _ in wide):
            continue
        saved = sum(type_bytes(t)[0] / 2 for _, t in wide)
        for o, _ in wide:
            raw[o].op = dataclasses.replace(raw[o].op, upcast=True)
        r.op = dataclasses.replace(r.op, matmul_dtype=raw[wide[0][0]].converts_from, bytes=max(0.0, r.op.bytes - saved))
        narrow.add(name)
    for r in raw.values():
        if r.converts_from == "f32" and r.operands and r.operands[0] in narrow:
            r.op = dataclasses.replace(r.op, upcast=True)
            mm = raw[r.operands[0]]
            mm.op = dataclasses.replace(mm.op, bytes=max(0.0, mm.op.bytes - type_bytes(r.operand_types[0])[0] / 2))


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


def op_cost(comps, types, opcode, type_text, operand_types, attrs) -> tuple[float, float, str, float]:
    """(FLOPs, matmul FLOPs, matmul dtype, bytes) of a top-level op; a fusion sums its body."""
    if opcode != "fusion":
        flops, mm, dtype = _instr_flops(opcode, type_text, operand_types, attrs)
        if opcode in ("slice", "dynamic-slice"):
            return flops, mm, dtype, 2.0 * memory_bytes(type_text)
        if opcode == "dynamic-update-slice":
            return flops, mm, dtype, 2.0 * memory_bytes(operand_types[1]) if len(operand_types) > 1 else 0.0
        written = memory_bytes(written_type(opcode, type_text, attrs))  # a library call's, not its workspace
        return flops, mm, dtype, float(written + sum(memory_bytes(t) for t in operand_types))
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
            converts[name] = type_bytes(btypes.get(operands[0], ""))[1]
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
        return float(memory_bytes(type_text) + sum(memory_bytes(t) for t in operand_types))
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
            nbytes += 2.0 * memory_bytes(types.get(body_name, {}).get(ins[3][1], ""))  # the update, read and written
        elif ins is not None:
            nbytes += memory_bytes(written_type(ins[2], by_name[e][1], ins[4]))

    read = fusion_reader(comps, types, body_name)
    for index, pname in params.items():
        if pname in in_place:
            continue
        nbytes += read(pname, depth) if pname in by_name else memory_bytes(operand_types[index])
    return nbytes


def fusion_reader(comps, types, body_name: str, measure=memory_bytes):
    """The ``read`` of :func:`_fusion_bytes` for a nested fusion's body: bytes as ``measure``
    counts a type's (default: as the chip stores them, tiles and all)."""
    body = comps.get(body_name, [])
    by_name = {ins[0]: ins for ins in body}
    readers: dict[str, list[tuple[tuple, int]]] = defaultdict(list)
    for ins in body:
        for pos, o in enumerate(ins[3]):
            readers[o].append((ins, pos))

    def read(name: str, level: int) -> float:
        full = float(measure(by_name[name][1]))
        total = 0.0
        for ins, pos in readers.get(name, []):
            if ins[2] in ("slice", "dynamic-slice") and pos == 0:
                total += measure(ins[1])
            elif ins[2] == "dynamic-update-slice" and pos == 0:
                continue  # updated in place: its update is counted with the result
            elif ins[2] in _SHAPE:
                total += read(ins[0], level)
            elif ins[2] == "fusion" and level < 8:
                m = re.search(r"calls=%?([\w.\-]+)", ins[4])
                inner = comps.get(m.group(1) if m else "", [])
                names = [i for i in inner if i[2] == "parameter" and re.match(rf"{pos}\)", i[5])]
                total += fusion_reader(comps, types, m.group(1), measure)(names[0][0], level + 1) if names else full
            else:
                return full
        return min(full, total)

    return read
