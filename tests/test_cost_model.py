"""The per-op cost model of ``podscale project`` (issue 44), against hand-computed figures: the
matrix unit's tiles, the vector and transcendental rates, the bandwidth reached for a size, the
fixed cost of a kernel, every figure sourced or assumed with a range."""

import dataclasses

import pytest

from podscale.compiled import hlo, hlo_cost, systems
from podscale.projection import cost


def _op(**fields) -> hlo_cost.Op:
    base = dict(name="f", opcode="fusion", flops=0.0, matmul_flops=0.0, bytes=0.0, matmul_dtype="", count=1)
    return hlo_cost.Op(**{**base, "phase": "forward", **fields})


def test_an_op_is_its_kernel_start_plus_its_slowest_unit_by_hand():
    v3 = systems.get("tpu-v3")  # per device: one of the chip's two cores
    core_peak, core_bw = 123e12 / 2, 900e9 / 2
    # A [1024, 1024] @ [1024, 1024] bf16 product: tiles exact, the matrix unit bounds it.
    flops = 2 * 1024**3
    mm = _op(
        flops=flops, matmul_flops=flops, matmul_dtype="bf16", bytes=3 * 2 * 1024**2, matmuls=((1, 1024, 1024, 1024),)
    )
    terms = cost.op_terms(v3, mm)
    assert terms["mxu"] == pytest.approx(flops / core_peak)
    b = 3 * 2 * 1024**2
    assert terms["memory"] == pytest.approx(b / (core_bw * 0.85 * b / (b + 128 * 2**10)))
    assert terms["fixed"] == 1e-6
    assert cost.op_time(v3, mm) == pytest.approx(1e-6 + flops / core_peak)
    # An elementwise op of 1M f32 elements, 4 FLOPs each, one of them an exp: bytes bound it.
    n = 2**20
    ew = _op(flops=4 * n, bytes=2 * 4 * n, transcendentals=n)
    clock = 123e12 / (2 * 2 * 128 * 128 * 2)  # 0.94 GHz: the bf16 peak over 2 cores x 2 MXUs
    vpu, eup = 8 * 128 * 2 * clock, 8 * 128 * clock  # per core: 2 ALUs per lane; 1 result per lane
    t = cost.op_terms(v3, ew)
    assert t["vector"] == pytest.approx(3 * n / vpu + n / eup)
    assert cost.op_time(v3, ew) == pytest.approx(1e-6 + max(t["vector"], t["memory"]))
    # Many small kernels: their fixed cost, not their bytes, is the step.
    tiny = _op(flops=8, bytes=64, count=500)
    assert cost.op_time(v3, tiny) == pytest.approx(1e-6 + 64 / (core_bw * 0.85 * 64 / (64 + 128 * 2**10)))


def test_a_64_feature_product_is_charged_as_128_on_the_mxu():
    v3, v6e = systems.get("tpu-v3"), systems.get("tpu-v6e")
    # [4096, 576] @ [576, 64]: a 3x3 convolution's 64 output features; the contraction 576 -> 640.
    flops = 2 * 4096 * 576 * 64
    op = _op(flops=flops, matmul_flops=flops, matmul_dtype="bf16", matmuls=((1, 4096, 64, 576),))
    assert cost.padded_matmul_flops(op, v3.matmul_tile) == pytest.approx(2 * 4096 * 128 * 640)
    assert cost.padded_matmul_flops(op, v6e.matmul_tile) == pytest.approx(2 * 4096 * 256 * 768)
    # A GPU's Tensor Cores pad to 8 only; a product of tile-sized dimensions is charged as it is.
    assert cost.padded_matmul_flops(op, systems.get("h100").matmul_tile) == flops
    # A dot of two vectors leaves the matrix unit idle (1 of its 8 x 128 rows and columns): it runs
    # at the vector units' rate, where that is quicker than the padded tiles.
    dot = _op(flops=2 * 4096, matmul_flops=2 * 4096, matmul_dtype="bf16", matmuls=((1, 1, 1, 4096),))
    assert cost.padded_matmul_flops(dot, v3.matmul_tile) == 2 * 8 * 128 * 4096
    assert cost.op_terms(v3, dot)["mxu"] == pytest.approx(dot.matmul_flops / v3.device_rate("vector_rate"))
    # A matrix-vector product still runs faster on the matrix unit, its 8 rows padded.
    mv = _op(flops=2 * 4096**2, matmul_flops=2 * 4096**2, matmul_dtype="bf16", matmuls=((1, 1, 4096, 4096),))
    assert cost.op_terms(v3, mv)["mxu"] == pytest.approx(8 * mv.matmul_flops / v3.device_peak("bf16"))


def test_every_figure_is_cited_or_assumed_with_a_range():
    for s in systems.SYSTEMS.values():
        rows = systems.figures(s)
        assert {f for f, _, _ in rows} >= {"matmul_tile", "vector_rate", "hbm_efficiency", "kernel_overhead"}
        for field, _, source in rows:
            assert source and source != "-", (s.name, field)
        for field, low, high in s.assumed:
            assert low <= getattr(s, field) <= high, (s.name, field)
        fast, slow = s.at("fast"), s.at("slow")
        assert fast.kernel_overhead <= s.kernel_overhead <= slow.kernel_overhead
        assert fast.hbm_efficiency >= s.hbm_efficiency >= slow.hbm_efficiency
    with pytest.raises(ValueError, match="fast or slow"):
        systems.get("h100").at("middle")


def test_the_range_brackets_the_nominal_step():
    v5e = systems.get("tpu-v5e")
    ops = [_op(flops=1e6, bytes=4e6, transcendentals=1e5, count=3), _op(bytes=1e3, count=100)]
    times = {
        end: sum(cost.op_time(s, o) * o.count for o in ops)
        for end, s in (("fast", v5e.at("fast")), ("nominal", v5e), ("slow", v5e.at("slow")))
    }
    assert times["fast"] < times["nominal"] < times["slow"]
    # the roofline of old is the structure with its assumed figures at peak and no fixed costs
    peak = dataclasses.replace(v5e, hbm_efficiency=1.0, half_bandwidth_bytes=0.0, kernel_overhead=0.0, vector_rate=0.0)
    assert cost.op_time(peak, ops[0]) == pytest.approx(4e6 / v5e.hbm_bandwidth)


def test_an_op_of_the_tpu_scalar_unit_is_cycles_not_a_kernel():
    """XLA:TPU keeps the replica index and random keys in the core's scalar memory (``S(6)``): the
    scalar unit computes them in a few cycles, where a kernel start (1 us) each made a 2-D mesh's
    replica index (x * ny + y, per dropout layer) cost transformer-big 87 us a step (issue 45)."""
    text = """HloModule m, num_partitions=2

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (x: f32[1024,128]) -> f32[1024,128] {
  %x = f32[1024,128]{1,0:T(8,128)} parameter(0)
  %zero = f32[]{:T(256)} constant(0)
  %id = u32[]{:T(256)S(6)} partition-id(), metadata={op_name="jit(step)/Dropout_0/axis_index"}
  %two = u32[]{:T(256)S(6)} constant(2)
  %i = u32[]{:T(256)S(6)} multiply(%id, %two), metadata={op_name="jit(step)/Dropout_0/mul"}
  %key = u32[1]{0:T(256)S(6)} bitcast(%i)
  %k = u32[1]{0:T(256)S(6)} add(%key, %key), metadata={op_name="jit(step)/Dropout_0/add"}
  %big = f32[]{:T(256)S(6)} reduce(%x, %zero), dimensions={0,1}, to_apply=%sum, metadata={op_name="jit(step)/norm"}
  ROOT %y = f32[1024,128]{1,0:T(8,128)} add(%x, %x), metadata={op_name="jit(step)/dense/add"}
}
"""
    v3 = systems.get("tpu-v3")
    ops = {op.name: op for op in hlo.read_text(text, {"data": 2}, platform="tpu").ops}
    assert ops["i"].scalar and ops["k"].scalar and not ops["y"].scalar
    # a reduction of a whole array into a scalar there reads the array: a kernel of its bytes
    assert not ops["big"].scalar and cost.op_time(v3, ops["big"]) > v3.kernel_overhead
    cycle = 1 / v3.clock  # ~1.06 ns at 0.94 GHz
    assert cost.op_time(v3, ops["i"]) == pytest.approx(cycle)
    assert cost.op_terms(v3, ops["k"]) == {"mxu": 0.0, "vector": pytest.approx(cycle), "memory": 0.0, "fixed": 0.0}
    assert cost.op_time(v3, ops["y"]) > v3.kernel_overhead  # a vector kernel: its start and its bytes
    assert cost.op_time(v3.at("slow"), ops["i"]) == pytest.approx(20 * cycle)
    # XLA:CPU's module has no scalar memory: the same text read as XLA:CPU's charges kernels
    cpu = {op.name: op for op in hlo.read_text(text, {"data": 2}).ops}
    assert not cpu["i"].scalar and cost.op_time(v3, cpu["i"]) > v3.kernel_overhead
    # a GPU has no scalar unit figure: its scalar ops stay kernels
    assert cost.op_time(systems.get("h100"), ops["i"]) >= systems.get("h100").kernel_overhead
