"""Costing matrix products in module text: XLA:GPU's cuBLAS and cuDNN custom-calls as the dots and
convolutions they run, each op's matrix shapes (``Op.matmuls``) and its transcendentals."""

import jax
import jax.numpy as jnp
import pytest

from podscale.compiled import hlo, hlo_cost


def module(*lines: str, bodies: str = "") -> str:
    return "HloModule m\n\n" + bodies + "\nENTRY %main () -> f32[] {\n" + "\n".join(f"  {x}" for x in lines) + "\n}\n"


def ops(text: str) -> dict[str, hlo_cost.Op]:
    return {o.name: o for o in hlo.read_text(text).ops}


GEMM_CONFIG = (
    'backend_config={"operation_queue_id":"0","gemm_backend_config":{"alpha_real":1,"beta":0,'
    '"dot_dimension_numbers":{"lhs_contracting_dimensions":["0"],"rhs_contracting_dimensions":["1"],'
    '"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"epilogue":"DEFAULT"}}'
)


def test_a_cublas_lt_matmul_is_costed_as_its_dot_without_the_workspace():
    text = module(
        "%lhs = bf16[768,2304]{1,0} parameter(0)",
        "%rhs = bf16[8192,768]{1,0} parameter(1)",
        "%mm = (bf16[2304,8192]{1,0}, s8[4194304]{0}) custom-call(%lhs, %rhs), "
        f'custom_call_target="__cublas$lt$matmul", {GEMM_CONFIG}',
        "ROOT %r = bf16[2304,8192]{1,0} get-tuple-element(%mm), index=0",
    )
    op = ops(text)["mm"]
    flops = 2.0 * 2304 * 8192 * 768
    assert (op.flops, op.matmul_flops, op.matmul_dtype, op.conv_flops) == (flops, flops, "bf16", 0.0)
    assert op.bytes == 2 * (768 * 2304 + 8192 * 768 + 2304 * 8192)  # no s8[4194304] scratch
    assert op.matmuls == ((1, 2304, 8192, 768),)
    assert op.transcendentals == 0.0


def test_a_batched_cublas_gemm_with_an_escaped_backend_config_and_a_bias():
    config = (
        r'backend_config="{\"alpha_real\":1,\"beta\":1,\"dot_dimension_numbers\":{'
        r"\"lhs_contracting_dimensions\":[\"2\"],\"rhs_contracting_dimensions\":[\"1\"],"
        r'\"lhs_batch_dimensions\":[\"0\"],\"rhs_batch_dimensions\":[\"0\"]}}"'
    )
    text = module(
        "%a = f32[4,16,32]{2,1,0} parameter(0)",
        "%b = f32[4,32,8]{2,1,0} parameter(1)",
        "%c = f32[4,16,8]{2,1,0} parameter(2)",
        f'ROOT %g = f32[4,16,8]{{2,1,0}} custom-call(%a, %b, %c), custom_call_target="__cublas$gemm", {config}',
    )
    op = ops(text)["g"]
    assert (op.matmul_flops, op.matmul_dtype) == (2.0 * 4 * 16 * 8 * 32, "f32")
    assert op.matmuls == ((4, 16, 8, 32),)
    assert op.bytes == 4 * (4 * 16 * 32 + 4 * 32 * 8 + 2 * 4 * 16 * 8)  # the bias read, the result written


def test_an_f8_matmul_counts_its_first_two_operands_and_their_dtype():
    text = module(
        "%a = f8e4m3fn[64,128]{1,0} parameter(0)",
        "%b = f8e4m3fn[32,128]{1,0} parameter(1)",
        "%s = f32[] parameter(2)",
        "ROOT %f = (bf16[64,32]{1,0}, s8[1024]{0}) custom-call(%a, %b, %s, %s, %s, %s), "
        'custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{'
        '"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"],'
        '"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}',
    )
    op = ops(text)["f"]
    assert (op.matmul_flops, op.matmul_dtype, op.matmuls) == (2.0 * 64 * 32 * 128, "f8e4m3fn", ((1, 64, 32, 128),))


def test_other_custom_calls_are_not_products():
    text = module(
        "%x = f32[8,8]{1,0} parameter(0)",
        'ROOT %t = (f32[8,8]{1,0}, s8[16]{0}) custom-call(%x, %x), custom_call_target="__cublas$triangularSolve"',
    )
    op = ops(text)["t"]
    assert (op.flops, op.matmul_flops, op.matmuls) == (0.0, 0.0, ())
    assert op.bytes == 3 * 256 + 16  # not a library product: its whole result


CONV = "window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_o01i->b01f"
IMAGES, KERNEL, GRAD = "bf16[4,32,32,64]{3,2,1,0}", "bf16[32,3,3,64]{3,2,1,0}", "bf16[4,32,32,32]{3,2,1,0}"


@pytest.mark.parametrize(
    ("target", "operands", "result"),
    [
        ("__cudnn$convForward", (IMAGES, KERNEL), GRAD),
        ("__cudnn$convBiasActivationForward", (IMAGES, KERNEL, "bf16[32]{0}"), GRAD),
        ("__cudnn$convBackwardInput", (GRAD, KERNEL), IMAGES),
        ("__cudnn$convBackwardFilter", (IMAGES, GRAD), KERNEL),
    ],
)
def test_a_cudnn_convolution_costs_the_forward_convolution_it_transposes(target, operands, result):
    params = [f"%p{i} = {t} parameter({i})" for i, t in enumerate(operands)]
    names = ", ".join(f"%p{i}" for i in range(len(operands)))
    call = module(
        *params, f'ROOT %c = ({result}, u8[0]{{0}}) custom-call({names}), {CONV}, custom_call_target="{target}"'
    )
    plain = module(
        f"%x = {IMAGES} parameter(0)",
        f"%k = {KERNEL} parameter(1)",
        f"ROOT %c = {GRAD} convolution(%x, %k), {CONV}",
    )
    op, conv = ops(call)["c"], ops(plain)["c"]
    assert op.matmul_flops == conv.matmul_flops == 2.0 * (4 * 32) * 64 * 94 * 94  # taps on the input only
    assert (op.conv_flops, op.conv_channels, op.matmul_dtype) == (op.matmul_flops, 32, "bf16")
    assert op.matmuls == conv.matmuls == ((1, 4 * 32 * 32, 32, 64 * 9),)  # all 9 taps
    assert op.bytes == sum(hlo_cost.type_bytes(t)[0] for t in (*operands, result))


def test_matrix_shapes_of_dots_and_grouped_convolutions():
    text = module(
        "%a = f32[4,16,32]{2,1,0} parameter(0)",
        "%b = f32[4,32,8]{2,1,0} parameter(1)",
        "%d = f32[4,16,8]{2,1,0} dot(%a, %b), lhs_batch_dims={0}, lhs_contracting_dims={2}, "
        "rhs_batch_dims={0}, rhs_contracting_dims={1}",
        "%x = f32[2,8,8,16]{3,2,1,0} parameter(2)",
        "%k = f32[3,3,1,16]{3,2,1,0} parameter(3)",
        "%dw = f32[2,8,8,16]{3,2,1,0} convolution(%x, %k), window={size=3x3 pad=1_1x1_1}, "
        "dim_labels=b01f_01io->b01f, feature_group_count=16",
        "%v = f32[6,5]{1,0} parameter(4)",
        "%w = f32[7,5]{1,0} parameter(5)",
        "ROOT %m = f32[6,7]{1,0} dot(%v, %w), lhs_contracting_dims={1}, rhs_contracting_dims={1}",
    )
    by = ops(text)
    assert by["d"].matmuls == ((4, 16, 8, 32),)
    assert by["dw"].matmuls == ((1, 2 * 8 * 8, 16, 1 * 9),)
    assert by["m"].matmuls == ((1, 6, 7, 5),)
    assert by["m"].matmul_flops == 2.0 * 6 * 7 * 5


BODIES = """%inner (q: f32[16,32]) -> f32[16,32] {
  %q = f32[16,32]{1,0} parameter(0)
  ROOT %l = f32[16,32]{1,0} log(%q)
}

%outer (p0: f32[16,32], p1: f32[32,8]) -> f32[16,8] {
  %p0 = f32[16,32]{1,0} parameter(0)
  %p1 = f32[32,8]{1,0} parameter(1)
  %e = f32[16,32]{1,0} exponential(%p0)
  %n = f32[16,32]{1,0} fusion(%e), kind=kLoop, calls=%inner
  %dv = f32[16,32]{1,0} divide(%n, %p0)
  %s = f32[16,32]{1,0} add(%dv, %p0)
  ROOT %d = f32[16,8]{1,0} dot(%s, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%sliced (w: bf16[4,256,512], i: s32[], x: bf16[64,256]) -> bf16[64,512] {
  %w = bf16[4,256,512]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %x = bf16[64,256]{1,0} parameter(2)
  %z = s32[] constant(0)
  %ds = bf16[1,256,512]{2,1,0} dynamic-slice(%w, %i, %z, %z), dynamic_slice_sizes={1,256,512}
  %b = bf16[256,512]{1,0} bitcast(%ds)
  %cc = (bf16[64,512]{1,0}, s8[65536]{0}) custom-call(%x, %b), custom_call_target="__cublas$lt$matmul", \
backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],\
"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  ROOT %g = bf16[64,512]{1,0} get-tuple-element(%cc), index=0
}
""".replace("\\\n", "")


def test_fusions_sum_their_bodies_nested_fusions_and_wrapped_library_calls():
    text = module(
        "%a = f32[16,32]{1,0} parameter(0)",
        "%b = f32[32,8]{1,0} parameter(1)",
        "%f = f32[16,8]{1,0} fusion(%a, %b), kind=kOutput, calls=%outer",
        "%t = f32[16,32]{1,0} tanh(%a)",
        "%w = bf16[4,256,512]{2,1,0} parameter(2)",
        "%i = s32[] parameter(3)",
        "%x = bf16[64,256]{1,0} parameter(4)",
        "ROOT %s = bf16[64,512]{1,0} fusion(%w, %i, %x), kind=kCustom, calls=%sliced",
        bodies=BODIES,
    )
    by = ops(text)
    f = by["f"]
    assert f.matmuls == ((1, 16, 8, 32),)
    assert f.transcendentals == 3 * 16 * 32  # exponential, the nested log, divide (not add)
    assert by["t"].transcendentals == 16 * 32
    s = by["s"]
    assert (s.matmul_flops, s.matmul_dtype, s.matmuls) == (2.0 * 64 * 512 * 256, "bf16", ((1, 64, 512, 256),))
    assert s.bytes == 2 * (256 * 512 + 64 * 256 + 64 * 512) + 4  # one slice of the weights read, no scratch


def test_a_fusion_whose_root_is_a_library_call_writes_no_workspace():
    bodies = """%gemm (x: bf16[64,256], y: bf16[256,512]) -> (bf16[64,512], s8[65536]) {
  %x = bf16[64,256]{1,0} parameter(0)
  %y = bf16[256,512]{1,0} parameter(1)
  ROOT %cc = (bf16[64,512]{1,0}, s8[65536]{0}) custom-call(%x, %y), custom_call_target="__cublas$gemm", """
    bodies += (
        'backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],'
        '"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}\n}\n'
    )
    text = module(
        "%x = bf16[64,256]{1,0} parameter(0)",
        "%y = bf16[256,512]{1,0} parameter(1)",
        "ROOT %f = (bf16[64,512]{1,0}, s8[65536]{0}) fusion(%x, %y), kind=kCustom, calls=%gemm",
        bodies=bodies,
    )
    op = ops(text)["f"]
    assert op.bytes == 2 * (64 * 256 + 256 * 512 + 64 * 512)
    assert op.matmuls == ((1, 64, 512, 256),)


def test_op_keeps_its_positional_fields_and_defaults():
    op = hlo_cost.Op("f", "fusion", 1.0, 0.0, 8.0, "", 1, "forward")
    assert (op.matmuls, op.transcendentals, op.conv_flops, op.conv_channels) == ((), 0.0, 0.0, 0)


def test_an_xla_cpu_module_has_its_matrix_shapes_and_transcendentals():
    def f(x, w):
        return jnp.tanh(x @ w).sum()

    compiled = jax.jit(f).lower(jnp.ones((8, 16)), jnp.ones((16, 4))).compile()
    module = hlo.read(compiled)
    assert [m for o in module.ops for m in o.matmuls] == [(1, 8, 4, 16)]
    assert sum(o.transcendentals * o.count for o in module.ops) == 8 * 4
