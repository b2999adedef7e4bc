"""The performance model: collective formulas by hand, op costs with trip counts, the projection's
collectives against the compiled module, the command line."""

import json
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import podscale_main

from podscale import Strategy, data_parallel
from podscale.compiled import hlo, hlo_cost, network, systems, tpu
from podscale.compiled.network import Topology, ring_time
from podscale.projection import cost as project_cost
from podscale.projection import mesh as project_mesh
from podscale.projection import project, validate
from podscale.projection import rows as project_rows

W, A = 1e11, 1e-6  # one-way bytes/s per link, seconds per hop


def test_ring_formulas_by_hand():
    mb = 1e6
    # All-reduce of 1 MB over a ring of 4 with wrap-around: two counter-rotating rings, each with
    # half the data: reduce-scatter (3/4 MB at 2e11 B/s, 2 steps) then all-gather (the same).
    assert ring_time("all-reduce", 4, mb, W, A, True) == pytest.approx(2 * (0.75 * mb / (2 * W) + 2 * A))
    # Without wrap-around (a line): one direction's bandwidth and n - 1 steps each way.
    assert ring_time("all-reduce", 4, mb, W, A, False) == pytest.approx(2 * (0.75 * mb / W + 3 * A))
    # An all-gather of a 0.25 MB shard moves what the reduce-scatter of 1 MB moves.
    assert ring_time("all-gather", 4, mb / 4, W, A, True) == pytest.approx(
        ring_time("reduce-scatter", 4, mb, W, A, True)
    )
    # All-to-all on a line of 4: the middle link carries 2 x 2 / 4 of each device's buffer.
    assert ring_time("all-to-all", 4, mb, W, A, False) == pytest.approx(mb / W + 3 * A)
    assert ring_time("collective-permute", 2, mb, W, A, False) == pytest.approx(mb / W + A)
    assert ring_time("all-reduce", 1, mb, W, A, True) == 0.0
    with pytest.raises(ValueError, match="unknown collective kind"):
        ring_time("broadcast", 4, mb, W, A, True)


def test_torus_slices_and_wrap_around():
    v3, v4, v5e = systems.get("tpu-v3"), systems.get("tpu-v4"), systems.get("tpu-v5e")
    assert v3.torus(1024) == ((32, 32), (True, True))
    assert v3.torus(16) == ((4, 4), (False, False))
    assert v3.torus(4096) == ((128, 32), (False, True))  # the multipod: wrap-around along the 32 only
    assert v4.torus(64) == ((4, 4, 4), (True, True, True))
    assert v4.torus(16) == ((2, 2, 4), (False, False, False))  # less than a cube: no optical wrap
    assert v5e.torus(256) == ((16, 16), (True, True))
    with pytest.raises(ValueError, match="holds at most 256 chips"):
        v5e.torus(512)
    with pytest.raises(ValueError, match="powers of two"):
        v3.torus(24)
    with pytest.raises(ValueError, match="'tpu-v9': unknown system"):
        systems.get("tpu-v9")


def test_2d_torus_groups_by_hand():
    mb = 1e6
    pod = Topology(systems.get("tpu-v3"), 1024)  # 32x32 chips, 2 cores each: 2048 devices
    row = [list(range(64 * r, 64 * (r + 1))) for r in range(32)]  # a row of chips, both cores
    t, path = pod.time("all-reduce", row, mb)
    on_chip = 2 * (0.5 * mb / pod.system.device_hbm_bandwidth)  # the chip's two cores first
    assert path.bidirectional and path.chips == 32 and path.on_chip == 2
    assert t == pytest.approx(on_chip + 2 * (31 / 32 * mb / (2 * W) + 16 * A))
    # The same along a 4x4 slice's row: no wrap-around, a line.
    small = Topology(systems.get("tpu-v3"), 16)
    t, path = small.time("all-reduce", [list(range(8 * r, 8 * (r + 1))) for r in range(4)], mb)
    assert not path.bidirectional and path.chips == 4
    assert t == pytest.approx(on_chip + 2 * (3 / 4 * mb / W + 3 * A))
    # Every other chip along a row (a replica spans two chips): links shared two ways, two links
    # a hop, and each chip's two cores are in two groups at once.
    every_other = [[4 * j + c for j in range(16)] for c in range(4)]
    t, path = pod.time("all-reduce", every_other, mb)
    assert path.chips == 16 and path.on_chip == 1 and path.bandwidth == W / (2 * 2) and path.latency == 2 * A
    assert t == pytest.approx(2 * (15 / 16 * mb / (2 * W / 4) + 8 * 2 * A))
    # A group over the whole pod: dimension by dimension, both dimensions' links at once, the
    # latency of half of each ring (scaling-book's multi-axis all-reduce) ...
    t, path = pod.time("all-reduce", [list(range(2048))], mb)
    assert path.chips == 1024 and path.bidirectional and path.steps == 16 + 16
    assert t == pytest.approx(on_chip + 2 * (1023 / 1024 * mb / (2 * 2 * W) + 32 * A))
    # A whole 4x4 slice: both dimensions are lines (no wrap-around), each adds half a ring's bandwidth.
    t, path = small.time("all-reduce", [list(range(32))], mb)
    assert path.chips == 16 and path.steps == 3 + 3 and path.bandwidth == W
    assert t == pytest.approx(on_chip + 2 * (15 / 16 * mb / (2 * W) + 6 * A))
    # ... or one ring through both dimensions (paper 1's 1-D sum).
    t, path = Topology(systems.get("tpu-v3"), 1024, multi_axis="ring").time("all-reduce", [list(range(2048))], mb)
    assert path.chips == 1024 and path.bidirectional and path.steps is None
    assert t == pytest.approx(on_chip + 2 * (1023 / 1024 * mb / (2 * W) + 512 * A))


def test_slices_joined_by_the_data_centre_network_by_hand():
    """Past a system's largest slice, chips are slices joined by DCN: a group with one device per
    slice is a ring over DCN at each chip's share of it; a group within a slice is the slice's own
    torus, as for a slice alone; one over both runs in two levels."""
    v5e = systems.get("tpu-v5e")
    two = Topology(v5e, 8, slices=2)
    assert (two.slices, two.slice_devices, two.shape) == (2, 4, (2, 2))
    across, path = two.time("all-reduce", [[0, 4], [1, 5], [2, 6], [3, 7]], 1e6)
    assert across == pytest.approx(network.ring_time("all-reduce", 2, 1e6, v5e.dcn_bandwidth, v5e.dcn_latency, False))
    assert path.where == "DCN (2 slices)"
    assert two.time("all-reduce", [[4, 5, 6, 7]], 1e6)[0] == Topology(v5e, 4).time("all-reduce", [[0, 1, 2, 3]], 1e6)[0]
    both, path = two.time("all-reduce", [list(range(8))], 1e6)
    dcn = network.ring_time("all-reduce", 2, 1e6 / 4, v5e.dcn_bandwidth, v5e.dcn_latency, False)
    assert both == pytest.approx(Topology(v5e, 4).time("all-reduce", [[0, 1, 2, 3]], 1e6)[0] + dcn)
    assert Topology(v5e, 512).slices == 2 and Topology(systems.get("tpu-v5p"), 8192).slices == 2  # past 6144
    with pytest.raises(ValueError, match="no data-centre network bandwidth is published for joining tpu-v6e"):
        Topology(systems.get("tpu-v6e"), 512)
    with pytest.raises(ValueError, match="do not divide into 3 slices"):
        Topology(v5e, 8, slices=3)
    with pytest.raises(ValueError, match="is no TPU"):
        Topology(systems.get("h100"), 16, slices=2)
    hsdp = project_mesh.strategy_for(Strategy(), "data-x-fsdp")
    assert project_mesh.target_shape(two, hsdp) == {"x": 2, "y": 4}  # FSDP within each slice
    assert project_mesh.target_shape(Topology(v5e, 8), hsdp) == {"x": 4, "y": 2}  # one slice: its first dim


def test_gpu_groups_by_hand():
    h100 = systems.get("h100")
    nodes = Topology(h100, 64)
    mb = 1e6
    t, path = nodes.time("all-reduce", [list(range(8 * i, 8 * i + 8)) for i in range(8)], mb)
    assert path.where == "NVLink"
    assert t == pytest.approx(2 * (7 / 8 * mb / h100.nvlink_bandwidth + 7 * h100.hop_latency))
    t, path = nodes.time("all-reduce", [list(range(i, 64, 8)) for i in range(8)], mb)
    assert path.where == "network"
    assert t == pytest.approx(2 * (7 / 8 * mb / h100.network_bandwidth + 7 * h100.network_latency))
    with pytest.raises(ValueError, match="multiple of it"):
        Topology(h100, 12)


def _matmul_chain(unroll):
    def f(w, x):
        def body(h, _):
            return jnp.tanh(h @ w), None

        return jax.lax.scan(body, x, None, length=5, unroll=unroll)[0]

    return f


def test_op_costs_count_loop_bodies_with_their_trip_counts():
    args = (jnp.ones((64, 64)), jnp.ones((32, 64)))
    scanned = jax.jit(_matmul_chain(1)).lower(*args).compile()
    unrolled = jax.jit(_matmul_chain(5)).lower(*args).compile()
    expected = 5 * 2 * 32 * 64 * 64
    for compiled in (scanned, unrolled):
        module = hlo.read(compiled)
        assert sum(o.matmul_flops * o.count for o in module.ops) == expected
        assert {o.matmul_dtype for o in module.ops if o.matmul_flops} == {"f32"}
    # cost_analysis() counts the loop body once; the unrolled step agrees with it.
    assert scanned.cost_analysis()["flops"] < expected / 2
    assert unrolled.cost_analysis()["flops"] == pytest.approx(hlo.read(unrolled).flops(), rel=0.05)
    assert unrolled.cost_analysis()["bytes accessed"] == pytest.approx(hlo.read(unrolled).op_bytes(), rel=0.1)


def test_op_costs_of_a_convolution_and_its_phases():
    def loss(k, x):
        y = jax.lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.sum(y**2)

    args = (jnp.ones((3, 3, 4, 8)), jnp.ones((2, 8, 8, 4)))
    module = hlo.read(jax.jit(jax.grad(loss)).lower(*args).compile())
    # 2 x batch x output features x input features x the window taps that fall on the input (not
    # on SAME's padding: 8 x 3 - 2 = 22 per spatial dimension), as XLA's cost analysis counts.
    one = 2 * 2 * 8 * 4 * 22 * 22
    (conv,) = [o for o in module.ops if o.op_name.endswith("jvp()/conv_general_dilated")]
    assert conv.phase == "forward" and conv.matmul_flops == conv.conv_flops == one and conv.conv_channels == 4
    # The kernel's gradient is a convolution of the input with the output's gradient: as many FLOPs.
    assert sum(o.matmul_flops * o.count for o in module.ops) == 2 * one
    without_padding = 2 * (2 * 8 * 8 * 8) * (3 * 3 * 4)
    assert one < without_padding
    assert any(o.phase == "backward" for o in module.ops)


def test_a_bf16_product_is_costed_in_bf16_though_this_cpu_computes_it_in_f32():
    a = jnp.ones((256, 512), jnp.bfloat16)
    module = hlo.read(jax.jit(lambda a, b: jnp.tanh(a @ b)).lower(a, a.T).compile())
    (mm,) = [o for o in module.ops if o.matmul_flops]
    assert mm.matmul_dtype == "bf16" and mm.matmul_flops == 2 * 256 * 512 * 256
    upcasts = [o for o in module.ops if o.upcast]
    assert upcasts and all(o.opcode in ("convert", "fusion") for o in upcasts)
    assert all(project_cost.op_time(systems.get("h100"), o) == 0 for o in upcasts)


def test_a_product_with_a_float32_operand_stays_float32():
    a, w = jnp.ones((256, 512), jnp.bfloat16), jnp.ones((512, 256), jnp.float32)
    module = hlo.read(jax.jit(lambda a, w: a.astype(jnp.float32) @ w).lower(a, w).compile())
    (mm,) = [o for o in module.ops if o.matmul_flops]
    assert mm.matmul_dtype == "f32"  # the user's promotion: a TPU or GPU multiplies in f32 too


def _mlp_step(tx):
    def step(state, batch):
        params, opt = state

        def loss(p):
            h = jnp.tanh(batch["x"] @ p["w1"]) @ p["w2"]
            return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(h, batch["y"]))

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), {"loss": value}

    return step


def _mlp(hidden: int = 256):
    tx = optax.adam(1e-3)
    params = {"w1": jnp.zeros((64, hidden)), "w2": jnp.zeros((hidden, 10))}
    batch = {"x": jax.ShapeDtypeStruct((4, 64), jnp.float32), "y": jax.ShapeDtypeStruct((4,), jnp.int32)}
    return _mlp_step(tx), (params, tx.init(params)), batch


@pytest.mark.parametrize("strategy", ["replicated", "sharded", "sharded-2d", "data-x-fsdp"])
def test_projection_for_eight_devices_uses_the_compiled_modules_collectives(strategy):
    """XLA:CPU's module (XLA:TPU's: tests/test_tpu_project.py)."""
    step, state, batch = _mlp()
    (row,) = project.project(step, state, batch, system="tpu-v5e", chips=[8], strategies=[strategy], compiler="cpu")
    target = project_mesh.target_shape(
        Topology(systems.get("tpu-v5e"), 8), Strategy(**project_mesh.STRATEGIES[strategy])
    )
    assert row.mesh == row.compiled_mesh == target
    # the row's own strategy: a TPU system's 2-D sum as a TPU sends it, one collective over both axes
    dp = data_parallel(
        step, project_mesh.compile_mesh(target), project_mesh.strategy_for(Strategy(), strategy, kind="tpu")
    )
    global_batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct((4 * 8, *x.shape[1:]), x.dtype), batch)
    plan = dp.plan(state, global_batch, compile=True)
    compiled = {(c["kind"], tuple(c["axes"])): (c["runs"], c["buffer_bytes"]) for c in plan.compiled["collectives"]}
    projected: dict = {}
    for c in row.collectives:
        runs, nbytes = projected.get((c["kind"], tuple(c["axes"])), (0, 0))
        projected[c["kind"], tuple(c["axes"])] = (runs + c["runs"], nbytes + c["buffer_bytes"])
    assert projected == compiled
    assert row.step_s == pytest.approx(row.compute_s + row.update_s + row.exposed_s)
    assert row.communication_s >= row.exposed_s > 0 and row.fits and row.global_batch == 32


def test_the_sharded_update_costs_less_per_device_as_the_pod_grows():
    # weights of 3 MB: the update's bytes, not its dozen kernels' starts, are its time (with 64 KB,
    # fixed costs are all of it, and a module of 8 devices has a kernel more than one of 2)
    step, state, batch = _mlp(hidden=12288)
    rows = project.project(step, state, batch, system="tpu-v5e", chips=[2, 8], strategies=["replicated", "sharded"])
    by = {(r.chips, r.strategy): r for r in rows}
    assert by[8, "sharded"].update_s < by[2, "sharded"].update_s
    assert by[8, "replicated"].update_s == pytest.approx(by[2, "replicated"].update_s, rel=0.05)
    assert by[8, "sharded"].memory_per_chip < by[8, "replicated"].memory_per_chip
    assert sum(r.fastest for r in rows if r.chips == 8) == 1


def test_a_compile_mesh_smaller_than_the_target_scales_the_update():
    assert project_mesh.compile_shape({"data": 16}, 8) == ({"data": 8}, "data", 2)
    assert project_mesh.compile_shape({"x": 8, "y": 4}, 8) == ({"x": 2, "y": 4}, "x", 4)
    with pytest.raises(ValueError, match="cannot be halved"):
        project_mesh.compile_shape({"x": 3, "y": 4}, 8)
    g = 1 << 20
    module = hlo.Module(
        [
            hlo.Collective("reduce-scatter", "rs", ("data",), 8, "f32", g, 1, "jit/podscale_update/reduce_scatter"),
            hlo.Collective("all-gather", "ag", ("data",), 8, "f32", g // 8, 1, "jit/podscale_update/all_gather"),
            hlo.Collective("all-reduce", "bn", ("data",), 8, "f32", 64, 1, "jit/jvp(Net)/BatchNorm/psum"),
            # FSDP's per-layer gather of a stored chunk for its use, 3 layers
            hlo.Collective("all-gather", "cg", ("data",), 8, "f32", g // 8, 3, "jit/podscale_chunk_gather/all_gather"),
            hlo.Collective("all-gather", "rows", ("data",), 8, "f32", 256, 1, "jit/jvp(Net)/all_gather"),
        ],
        [],
        {},
    )
    topo = Topology(systems.get("tpu-v5e"), 16)
    _, rows, _, _ = project_cost.cost(topo.system, topo, module, {"data": 16}, reduced="data", factor=2)
    by = {(r["kind"], r["role"]): r for r in rows}
    assert by["reduce-scatter", "update"]["buffer_bytes"] == g and by["reduce-scatter", "update"]["group_size"] == 16
    assert by["all-gather", "update"]["buffer_bytes"] == g // 16  # each device's shard at 16 devices
    assert by["all-reduce", "model"]["buffer_bytes"] == 64
    # the chunks are 1/16 at the target (3 runs), the batch rows' gather keeps its buffer (a replica's rows)
    assert by["all-gather", "model"]["buffer_bytes"] == 3 * g // 16 + 256
    assert by["all-gather", "model"]["group_size"] == 16


def test_data_x_fsdp_compiled_on_fewer_copies_is_not_scaled_as_a_sharded_state():
    """Data x FSDP's chunks are over ``y``; compiled with its copies' axis ``x`` halved, they are
    the target's already: a reduce-scatter over ``y`` keeps its buffer (the sharded update's 1/N
    chunks would shrink), and the chunks' all-reduce over ``x`` spans the target's copies."""
    g = 1 << 20
    scope = "jit/podscale_update/grad_sum"
    module = hlo.Module(
        [
            hlo.Collective("reduce-scatter", "rs", ("y",), 4, "f32", g, 1, f"{scope}/reduce_scatter"),
            hlo.Collective("all-reduce", "ar", ("x",), 2, "f32", g // 4, 1, f"{scope}/psum"),
        ],
        [],
        {},
    )
    topo = Topology(systems.get("tpu-v5e"), 16)
    target = {"x": 4, "y": 4}
    hsdp, fsdp = (project_mesh.strategy_for(Strategy(), name) for name in ("data-x-fsdp", "fsdp"))
    assert hsdp.fsdp_axes == ("y",) and fsdp.fsdp_axes is None
    assert not hsdp.state_scales("x") and fsdp.state_scales("x") and hsdp.state_scales("y")
    for strategy, shrinks in ((hsdp, 1), (fsdp, 2)):
        priced = project.price(topo, module, target, "x", 2, strategy, None, scheduled=False)
        by = {r["kind"]: r for r in priced["collectives"]}
        assert by["reduce-scatter"]["buffer_bytes"] == g / shrinks and by["reduce-scatter"]["group_size"] == 4
        assert by["all-reduce"]["buffer_bytes"] == g // 4 and by["all-reduce"]["group_size"] == 4


def test_overlap_hides_gradient_sums_but_the_last_behind_the_backward_pass():
    sums = [
        hlo.Collective("all-reduce", f"g{i}", ("data",), 8, "f32", 1 << 22, 1, "jit/podscale_update/grad_sum/psum")
        for i in range(3)
    ]
    # A norm's partial sums (LAMB, clipping) are the update's too, but nothing hides them.
    sums.append(hlo.Collective("all-reduce", "norm", ("data",), 8, "f32", 64, 1, "jit/podscale_update/psum"))
    backward = hlo_cost.Op("dot", "d", 1e15, 1e15, 0.0, "bf16", 1, "backward")
    module = hlo.Module(sums, [], {}, [backward])
    topo = Topology(systems.get("tpu-v5e"), 8)
    phases, _, exposed, hidden = project_cost.cost(topo.system, topo, module, {"data": 8})
    one = topo.time("all-reduce", [list(range(8))], 1 << 22)[0]
    norm = topo.time("all-reduce", [list(range(8))], 64)[0]
    assert hidden == pytest.approx(2 * one) and exposed == pytest.approx(one + norm)
    no_overlap = systems.System(**{**topo.system.__dict__, "overlaps": False})
    _, _, exposed, hidden = project_cost.cost(no_overlap, topo, module, {"data": 8})
    assert hidden == 0 and exposed == pytest.approx(3 * one + norm)


def test_the_measured_cpu_predicts_a_step():
    measured = validate.measure(2)
    assert measured.matmul_flops["f32"] > 0 and measured.bandwidth > 0 and measured.overhead > 0
    assert set(measured.collectives) == set(network.KINDS)
    step, state, batch = _mlp()
    mesh = project_mesh.compile_mesh({"data": 2})
    dp = data_parallel(step, mesh, weight_update="sharded", donate_state=False)
    global_batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct((8, *x.shape[1:]), x.dtype), batch)
    dp.prepare(state, global_batch)
    module = hlo.read(dp.lower(dp.layout.stored_shapes(), global_batch).compile(), mesh)
    predicted = validate.predict(measured, module, {"data": 2})
    assert predicted["step_s"] == pytest.approx(sum(predicted[k] for k in ("compute_s", "update_s", "communication_s")))
    assert predicted["communication_s"] > 0 and predicted["update_s"] > 0


def _cli(*args, check=True):
    proc = subprocess.run(
        [sys.executable, "-m", "podscale.cli", "project", *args], capture_output=True, text=True, timeout=600
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_cli_projects_a_model_and_plots_it(tmp_path, capsys):
    png = tmp_path / "p.png"
    proc = _cli("--model", "mlp", "--system", "tpu-v3", "--chips", "16,64", "--json", "--plot", str(png))
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = out["rows"]
    assert [(r["chips"], r["strategy"]) for r in rows] == [
        (c, s) for c in (16, 64) for s in ("replicated", "sharded", "sharded-2d")
    ]
    for chips in (16, 64):
        mine = [r for r in rows if r["chips"] == chips]
        assert sum(r["fastest"] for r in mine) == 1
        assert all(r["devices"] == 2 * chips and r["global_batch"] == 32 * 2 * chips for r in mine)
        assert all(r["step_s"] > 0 and 0 < r["mfu"] < 1 and r["memory_per_chip"] > 0 for r in mine)
    assert png.stat().st_size > 10_000
    bad = [
        (("--system", "tpu-v9"), "unknown system"),
        (("--system", "tpu-v6e", "--chips", "1024"), "no data-centre network bandwidth is published"),
        (("--chips", "16", "--global-batch", "100"), "do not divide it"),
        (("--chips", "sixteen"), "comma-separated whole numbers"),
        (("--chips", "1", "--strategies", "sharded-2d"), "the 2-D gradient sum on 1 chips"),
        (("--chips", "1", "--model-parallel", "4", "--model", "transformer"), "do not divide into replicas of 4"),
    ]
    for args, message in bad:  # refused before any work: in this process
        assert podscale_main(["project", "--model", "mlp", *args]) == 2, args
        err = capsys.readouterr().err
        assert message in err, (args, err[-2000:])


def test_systems_cite_their_figures():
    for s in systems.SYSTEMS.values():
        assert s.sources and s.peak_flops > 0 and s.hbm_bandwidth > 0 and s.hbm_bytes > 0
        assert (s.link_bandwidth > 0) if s.kind == "tpu" else (s.nvlink_bandwidth > 0 and s.network_bandwidth > 0)
    assert math.isclose(systems.get("tpu-v3").device_peak("bf16"), 61.5e12)
    assert np.isclose(systems.get("a100").device_peak("f32"), 156e12)


# -- issue 23: strategies that do not apply, flags checked before any work -----------------------


def test_a_strategy_that_does_not_apply_at_a_chip_count_is_a_row_saying_why(tmp_path):
    """A real (tiny) projection: the 2-D sum needs two data axes of at least 2, which 2 chips of a
    TPU v5e (2 devices) cannot give; 4 chips can. The row says why; it is never the fastest, the
    table shows it, the plot leaves it out."""
    step, state, batch = _mlp()
    rows = project.project(step, state, batch, system="tpu-v5e", chips=[2, 4])
    by = {(r.chips, r.strategy): r for r in rows}
    assert set(by) == {(c, s) for c in (2, 4) for s in project_mesh.DEFAULT_STRATEGIES}
    na = by[2, "sharded-2d"]
    assert not na.applicable and "needs two data axes of at least 2" in na.not_applicable
    assert na.step_s is None and na.collectives == [] and not na.fastest and na.to_dict()["not_applicable"]
    assert all(r.applicable and r.step_s > 0 for k, r in by.items() if k != (2, "sharded-2d"))
    assert sum(r.fastest for r in rows if r.chips == 2) == 1 and sum(r.fastest for r in rows if r.chips == 4) == 1
    from rich.console import Console

    console = Console(record=True, width=200)
    project_rows.render(rows, systems.get("tpu-v5e"), "mlp", console)
    text = console.export_text()
    assert "n/a" in text and "2 chips, sharded-2d: not applicable: the 2-D gradient sum" in text
    project_rows.plot(rows, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000
    json.dumps([r.to_dict() for r in rows])  # n/a rows are plain JSON (null figures), no NaN


def test_applicability_refuses_what_cannot_be_projected_and_notes_what_does_not_apply():
    v5e = systems.get("tpu-v5e")
    reasons = project_mesh.applicability(v5e, [2, 4])  # the default strategies: n/a is a row
    assert reasons[2, "sharded-2d"] and reasons[4, "sharded-2d"] is None and reasons[2, "replicated"] is None
    bad = [
        (dict(chips=[2], strategies=["replicated", "sharded-2d"]), "sharded-2d: applies at none of the chip counts 2"),
        (dict(chips=[1, 2], strategies=["sharded-2d"]), "none applies at chips 1,2"),
        (dict(chips=[4], strategies=[]), "no strategy given"),
        (dict(chips=[4], strategies={}), "no strategy given"),
        (dict(chips=[4], strategies=["sharded", "sharded"]), "sharded given twice"),
        (dict(chips=[4], strategies=["zero3"]), "unknown; choose from replicated, sharded"),
        (dict(chips=[]), "at least one chip count"),
        (dict(chips=[0, 4]), "chips \\[0\\]: chip counts are whole numbers of at least 1"),
        (dict(chips=[4, 4]), "4 given twice"),
        (dict(chips=[2.5]), "whole numbers"),
        (dict(chips=[640]), "give a multiple of 256 \\(slices of 256 chips\\)"),
    ]
    for kw, message in bad:
        with pytest.raises(ValueError, match=message):
            project_mesh.applicability(v5e, **kw)
    # The 2-D sum's own knobs go with the 2-D strategies only (a 1-D sum refuses chunks).
    base = Strategy(grad_sum_chunks=2, spatial=2)
    assert project_mesh.strategy_for(base, "sharded").grad_sum_chunks is None
    assert project_mesh.strategy_for(base, "sharded-2d").grad_sum_chunks == 2
    assert project_mesh.strategy_for(base, "replicated").spatial == 2
    # A TPU system's 2-D sum is sent as a TPU sends it (XLA:TPU's collective over both torus
    # dimensions), whichever compiler compiles the row; on paper 1's machine (--multi-axis ring),
    # and where the base gives the knobs of podscale's own phases, as podscale's phases; on other
    # systems, the compiling platform's default; the base's own choice wins.
    assert project_mesh.strategy_for(Strategy(), "sharded-2d", "torus", "tpu").grad_sum_phases == "xla"
    assert project_mesh.strategy_for(Strategy(), "sharded-2d", "ring", "tpu").grad_sum_phases == "explicit"
    assert project_mesh.strategy_for(base, "sharded-2d", "torus", "tpu").grad_sum_phases == "explicit"  # chunks
    assert project_mesh.strategy_for(Strategy(), "sharded-2d", "torus", "gpu").grad_sum_phases is None
    assert project_mesh.strategy_for(Strategy(), "sharded", "ring", "tpu").grad_sum_phases is None
    xla = Strategy(grad_sum="2d", grad_sum_phases="xla")
    assert project_mesh.strategy_for(xla, "replicated-2d", "ring", "tpu").grad_sum_phases == "xla"
    assert project_mesh.strategy_for(xla, "replicated", "torus", "tpu").grad_sum_phases is None


def test_project_refuses_bad_replica_batches_before_compiling():
    step, state, batch = _mlp()
    for replica_batch, message in (
        (0, "at least 1"),
        ({2: 4}, "no batch for chips \\[4\\]"),
        (None, "pass replica_batch"),
    ):
        with pytest.raises(ValueError, match=message):
            project.project(step, state, lambda n: batch, system="tpu-v5e", chips=[2, 4], replica_batch=replica_batch)


def test_a_long_compile_reports_progress_while_it_runs():
    """A heartbeat repeats its line until the block ends (waits on events: no timing assumption)."""
    import threading

    from podscale.report import heartbeat

    said, beats = [], threading.Event()

    def record(message):
        said.append(message)
        if len(said) >= 2:
            beats.set()

    with heartbeat(record, "compiling", 0.01):
        assert beats.wait(60)  # two beats while the block runs
    n = len(said)
    assert all(m.startswith("compiling (") and m.endswith(" s)") for m in said)
    threading.Event().wait(0.05)
    assert len(said) == n  # stopped with the block


def _main(capsys, *args):
    """``podscale project`` in this process, for what is refused before JAX's devices are set."""
    from podscale import cli

    code = cli.main(["project", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "args,message",
    [
        # numbers (issue 23, finding 7)
        (("--per-chip-batch", "0"), "--per-chip-batch 0: examples, a whole number of at least 1"),
        (("--per-chip-batch", "-2"), "--per-chip-batch -2: examples"),
        (("--global-batch", "0"), "--global-batch 0: examples"),
        (("--global-batch", "-64"), "--global-batch -64: examples"),
        (("--learning-rate", "0"), "--learning-rate 0.0: a positive number"),
        (("--learning-rate", "nan"), "--learning-rate nan: a positive number"),
        (("--chips", "0"), "--chips '0': chip counts are whole numbers of at least 1"),
        (("--chips", "16,-1"), "--chips '16,-1': chip counts"),
        (("--chips", ","), "--chips ',': an empty item"),
        (("--chips", "16,,64"), "--chips '16,,64': an empty item"),
        (("--chips", "16,16"), "16 given twice"),
        (("--chips", "1.5"), "comma-separated whole numbers"),
        (("--validate", "--steps", "0"), "--steps 0: timed steps per run, a whole number of at least 1"),
        (("--validate", "--steps", "-3"), "--steps -3: timed steps"),
        # lists (finding 15)
        (("--strategies", ","), "--strategies ',': an empty item"),
        (("--strategies", ""), "--strategies '': an empty item"),
        (("--strategies", "sharded,"), "--strategies 'sharded,': an empty item"),
        (("--strategies", "sharded,sharded"), "sharded given twice"),
        (("--strategies", "zero3"), "--strategies \\['zero3'\\]: unknown; choose from replicated"),
        (("--validate", "--validate-models", ","), "--validate-models ',': an empty item"),
        (("--validate", "--validate-models", "gnmt,gnmt"), "gnmt given twice"),
        # flags the chosen mode would ignore (finding 15)
        (("--validate-models", "gnmt"), "--validate-models: only with --validate"),
        (("--steps", "3"), "--steps: only with --validate"),
        (("--validate", "--list-systems"), "--validate and --list-systems: give one"),
        (("--validate", "--chips", "16"), "--chips with --validate: .* would be ignored"),
        (("--validate", "--model", "ssd", "--spatial", "4"), "--model, --spatial with --validate: .* would be ignored"),
        (("--validate", "--plot", "x.png"), "--plot with --validate"),
        (("--list-systems", "--system", "h100"), "--system with --list-systems"),
        (("--list-systems", "--steps", "2"), "--steps with --list-systems"),
        (("--weight-update", "replicated"), "--weight-update replicated: podscale project sets the weight update"),
        (("--grad-sum", "2d"), "--grad-sum 2d: podscale project sets"),
        (("--grad-sum-chunks", "2", "--strategies", "replicated,sharded"), "--grad-sum-chunks applies to the 2-D"),
        (("--grad-sum-phases", "xla", "--strategies", "sharded"), "--grad-sum-phases applies to the 2-D"),
        (("--min-shard-size", "64", "--strategies", "replicated"), "--min-shard-size applies to the sharded"),
        (("--axis-costs", "calibrate", "--strategies", "sharded-2d"), "--axis-costs calibrate measures this machine"),
        # strategies that apply nowhere (finding 1): still an error when asked for
        (("--chips", "1", "--strategies", "sharded-2d"), "none applies at chips 1 .*the 2-D gradient sum on 1 chips"),
        (
            ("--system", "tpu-v5e", "--chips", "1,2", "--strategies", "replicated,sharded-2d"),
            "--strategies sharded-2d: applies at none",
        ),
    ],
)
def test_project_refuses_bad_flags_before_any_work(capsys, args, message):
    code, out, err = _main(capsys, *args)
    assert code == 2 and out == "" and err.startswith("podscale: error: ") and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and re.search(message, err), err
    code, out, err = _main(capsys, *args, "--json")
    assert code == 2 and re.search(message, json.loads(out)["error"]) and json.loads(out)["exit_code"] == 2


def test_the_plot_path_is_checked_before_any_work(capsys, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("")
    cases = [
        (tmp_path / "missing" / "p.png", "the folder .*missing does not exist"),
        (tmp_path / "p.txt", "the suffix .txt; name a file matplotlib can write: .*\\.png"),
        (tmp_path / "p", "no suffix"),
        (tmp_path, "a folder; give a file name in it"),
        (a_file / "p.png", ".*file is a file, not a folder"),  # a file where the folder should be
        ("", "give a file name"),
    ]
    for path, message in cases:
        code, out, err = _main(capsys, "--model", "mlp", "--chips", "16", "--plot", str(path))
        assert code == 2 and re.search(f"--plot '.*': {message}", err), (path, err)
    for name in ("p.png", "p.PDF", "p.svg"):
        project_rows.check_plot_path(str(tmp_path / name))
    assert not list(tmp_path.glob(".podscale-plot-probe-*"))  # the probe cleans up after itself


_STUB = """
import sys
from podscale.projection import project, mesh as project_mesh, rows as project_rows

def one(data_parallel, step, shapes, make_batch, replica_batch, system, topology, name, strategy, mesh):
    k = strategy.spatial or strategy.model_parallel or 1
    step_s = 0.01 * (1 + (name == "replicated"))
    return project_rows.Row(
        chips=topology.chips, strategy=name, devices=topology.devices, topology=topology.describe(), mesh=mesh,
        global_batch=replica_batch * topology.devices // k, replica_batch=replica_batch, compute_s=step_s,
        update_s=0.0, communication_s=0.0, exposed_s=0.0, hidden_s=0.0, step_s=step_s,
        examples_per_s=replica_batch * topology.devices / k / step_s, mfu=0.1, memory_per_chip=1.0,
        hbm_per_chip=2.0, fits=True, collectives=[], flops_per_device=1.0, compiled_mesh=mesh,
    )

project._project_one = one  # the compile and its cost: what this test does not run
project.compiler_for = lambda system, compiler="auto", say=None: "cpu"  # every row through the stub
if sys.argv[1] == "plot-fails":
    def fail(*args, **kwargs):
        raise OSError("No space left on device")
    project_rows.plot = fail
from podscale.cli import main
sys.exit(main(["project", *sys.argv[2:]]))
"""


def _stubbed(*args, plot="plots"):
    """``podscale project`` in a fresh process (it sets JAX's device count), every row's compile
    replaced by a stub: the argument handling, the checks, the rows, the output and the plot."""
    return subprocess.run([sys.executable, "-c", _STUB, plot, *args], capture_output=True, text=True, timeout=600)


def test_the_readmes_commands_get_rows_that_say_why_a_strategy_does_not_apply(tmp_path):
    """README: resnet50 on 8, 64, 512 H100s (one node of 8 has no two data axes for the 2-D sum)
    and SSD on 2 TPU v3 chips with each image over 4 cores (one replica): the default strategies'
    sharded-2d is a row saying why, not the end of the command."""
    png = tmp_path / "scaling.png"
    proc = _stubbed(
        "--model",
        "resnet50",
        "--config",
        "full",
        "--system",
        "h100",
        "--chips",
        "8,64,512",
        "--json",
        "--plot",
        str(png),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = proc.stdout.strip().splitlines()  # one JSON object on stdout; progress on stderr
    rows = json.loads(line)["rows"]
    na = [(r["chips"], r["strategy"]) for r in rows if r["not_applicable"]]
    assert na == [(8, "sharded-2d")], na
    assert "needs two data axes of at least 2" in rows[2]["not_applicable"] and rows[2]["step_s"] is None
    assert [r["chips"] for r in rows if r["fastest"]] == [8, 64, 512] and not rows[2]["fastest"]
    assert png.stat().st_size > 1000
    assert "8 chips, sharded-2d: not applicable" in proc.stderr and "512 chips, sharded: done in" in proc.stderr

    proc = _stubbed(
        "--model",
        "ssd",
        "--config",
        "full",
        "--system",
        "tpu-v3",
        "--chips",
        "2",
        "--global-batch",
        "4",
        "--spatial",
        "4",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 chips, sharded-2d: not applicable: the 2-D gradient sum" in proc.stdout
    assert "replicated" in proc.stdout and "n/a" in proc.stdout


def test_the_table_is_kept_when_the_plot_fails_at_the_end(tmp_path):
    for extra in ((), ("--json",)):
        proc = _stubbed("--model", "mlp", "--chips", "16", "--plot", str(tmp_path / "p.png"), *extra, plot="plot-fails")
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert "podscale: error: --plot" in proc.stderr and "No space left on device" in proc.stderr
        if extra:
            assert len(json.loads(proc.stdout)["rows"]) == 3
        else:
            assert "16 chips: " in proc.stdout and "sharded-2d" in proc.stdout


def test_validate_refuses_bad_steps_and_workloads_before_measuring():
    for kw, message in (
        (dict(steps=0), "--steps 0: timed steps per run"),
        (dict(steps=-1), "--steps -1"),
        (dict(models=[]), "--validate-models: no workload given"),
        (dict(models=["gnmt", "gnmt"]), "gnmt given twice"),
        (dict(models=["nope"]), "unknown; choose from"),
    ):
        with pytest.raises(ValueError, match=message):
            validate.validate(progress=False, **kw)


def test_halo_and_model_axis_bytes_are_the_partition_axis_collectives():
    """A projected row's halo bytes are the collective-permutes over the space or model axis (the
    mesh's last), its model-axis bytes the other collectives over that axis (alone, with a data
    axis, or in groups within a replica that follow no axis); the data axes' sums count in
    neither. The table shows both columns for a partitioned row."""
    import io

    from rich.console import Console

    collectives = [
        {"kind": "collective-permute", "axes": ["y"], "group_size": 4, "buffer_bytes": 3e6},
        {"kind": "all-reduce", "axes": ["y"], "group_size": 4, "buffer_bytes": 2e6},
        {"kind": "all-reduce", "axes": ["x", "y"], "group_size": 8, "buffer_bytes": 5e6},
        {"kind": "all-gather", "axes": [], "group_size": 2, "buffer_bytes": 7e6},
        {"kind": "all-reduce", "axes": ["x"], "group_size": 2, "buffer_bytes": 11e6},
        {"kind": "all-gather", "axes": [], "group_size": 8, "buffer_bytes": 13e6},
    ]
    assert project_rows.partition_bytes(collectives, {"x": 2, "y": 4}, 4) == (3e6, 2e6 + 5e6 + 7e6)
    assert project_rows.partition_bytes(collectives, {"data": 8}, 1) == (None, None)
    figures = dict(
        chips=4, strategy="replicated", devices=8, topology="t", mesh={"x": 2, "y": 4}, global_batch=8,
        replica_batch=4, compute_s=0.01, update_s=0.0, communication_s=0.0, exposed_s=0.0, hidden_s=0.0,
        step_s=0.01, examples_per_s=800.0, mfu=0.1, memory_per_chip=1.0, hbm_per_chip=2.0, fits=True,
    )  # fmt: skip
    row = project_rows.Row(**figures, halo_bytes=3e6, model_axis_bytes=14e6)
    out = io.StringIO()
    project_rows.render([row], systems.get("tpu-v3"), "m", Console(file=out, width=300))
    text = out.getvalue()
    assert "halo MB" in text and "model-axis MB" in text and "3.00" in text and "14.00" in text
    out = io.StringIO()
    project_rows.render([project_rows.Row(**figures)], systems.get("tpu-v3"), "m", Console(file=out, width=300))
    assert "halo MB" not in out.getvalue()


def test_batch_norm_groups_default_to_the_recipes_and_are_checked_before_compiling(capsys):
    """``--bn-group-size``: MLPerf's groups by default (SSD: 4 replicas; ResNet-50: 8 from 2048
    replicas up, none below), named on stderr; the 2-D sum's rows take them (the group axis splits
    its inner axis), data x FSDP's say why they do not; a model without grouped batch norm, or a
    size the replicas do not divide, is refused."""
    from podscale.cli import main

    def dry_run(*args):  # in this process: a dry run compiles nothing
        code = main(["project", *args, "--dry-run"])
        out = capsys.readouterr()
        return code, out.out + out.err, out.err

    code, said, err = dry_run("--model", "ssd", "--config", "full", "--chips", "1024", "--spatial", "4")
    assert code == 0 and "1024 chips: 4" in err and "sharded-2d would compile" in said
    hybrid = ["--model", "ssd", "--config", "full", "--chips", "1024", "--spatial", "4"]
    code, _, err = dry_run(*hybrid, "--strategies", "sharded-2d,data-x-fsdp")
    assert code == 2 and "data x FSDP with batch-norm groups of 4" in err
    code, _, err = dry_run("--model", "resnet50", "--config", "full", "--chips", "16,1024")
    assert code == 0 and "1024 chips: 8" in err and "16 chips: 8" not in err
    code, said, err = dry_run("--model", "resnet50", "--config", "full", "--chips", "1024", "--bn-group-size", "1")
    assert code == 0 and "groups" not in err and "sharded-2d would compile" in said
    code, _, err = dry_run("--model", "transformer-big", "--config", "full", "--bn-group-size", "4")
    assert code != 0 and "--bn-group-size 4: batch-norm groups are for" in err
    code, _, err = dry_run("--model", "resnet50", "--config", "full", "--chips", "16", "--bn-group-size", "3")
    assert code != 0 and "do not divide into batch-norm groups of 3" in err


def test_libtpu_options_are_checked_before_compiling_and_only_for_xla_tpu(capsys, monkeypatch):
    """``--libtpu-args`` (a run's ``LIBTPU_INIT_ARGS``): refused for a module that is not XLA:TPU's,
    and a malformed option named, before anything is compiled; an inherited malformed
    ``LIBTPU_INIT_ARGS`` too, naming it. The variable is as it was after."""
    from podscale.cli import main

    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    assert main(["project", "--model", "mlp", "--compiler", "cpu", "--libtpu-args=--xla_a=1", "--dry-run"]) == 2
    assert "--libtpu-args: XLA:TPU's options" in capsys.readouterr().err
    assert main(["project", "--model", "mlp", "--libtpu-args", "--xla_a=1 xla_b", "--dry-run"]) == 2
    assert "--libtpu-args='--xla_a=1 xla_b': 'xla_b' is not an option" in capsys.readouterr().err
    assert "LIBTPU_INIT_ARGS" not in os.environ
    if tpu.available():  # else the projection falls back to XLA:CPU's module, which takes no such options
        monkeypatch.setenv("LIBTPU_INIT_ARGS", "xla_c")
        assert main(["project", "--model", "mlp", "--dry-run"]) == 2
        assert "LIBTPU_INIT_ARGS='xla_c': 'xla_c' is not an option" in capsys.readouterr().err


def test_a_refusal_for_a_core_s_vector_memory_is_no_hbm_figure():
    """XLA:TPU refuses a program over the chip's HBM or over a core's vector memory (``vmem``); only
    the first is a memory per chip (the row's GiB/chip)."""
    v3 = systems.get("tpu-v3")
    hbm = "Ran out of memory in memory space hbm. Used 20.95G of 15.48G hbm. Exceeded hbm capacity by 5.47G."
    vmem = "Ran out of memory in memory space vmem. Used 16.02M of 16.00M vmem. Exceeded vmem capacity by 24.0K."
    assert project._required(hbm, v3) == pytest.approx(20.95 * 2**30 * 2)
    assert project._required(vmem, v3) is None
