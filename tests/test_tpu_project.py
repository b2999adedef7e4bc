"""``podscale project`` on XLA:TPU's module (libtpu's compile-only topologies), on tiny steps."""

import math
import re

import jax
import jax.numpy as jnp
import optax
import pytest

from podscale import Strategy, cli, data_parallel
from podscale.compiled import hlo, hlo_cost, hlo_groups, network, systems, tpu
from podscale.projection import cost as project_cost
from podscale.projection import mesh as project_mesh
from podscale.projection import project

needs_libtpu = pytest.mark.skipif(not tpu.available(), reason="libtpu not installed (pip install 'podscale[tpu]')")

TX = optax.adam(1e-3)


def _state(width: int = 128):
    def init():
        params = {"w1": jnp.zeros((64, width)), "w2": jnp.zeros((width, 8))}
        return {"params": params, "opt": TX.init(params)}

    return jax.eval_shape(init)


def _step(state, batch):
    def loss(params):
        hidden = jnp.tanh(batch["x"] @ params["w1"])
        return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)

    grads = jax.grad(loss)(state["params"])
    updates, opt = TX.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {}


def _batch(n: int):
    return {"x": jax.ShapeDtypeStruct((n, 64), jnp.float32), "y": jax.ShapeDtypeStruct((n, 8), jnp.float32)}


def _compiled(system: str, chips: int, strategy: Strategy, replica_batch: int = 2):
    """The step as the projection compiles it for ``chips`` chips: (compiled, mesh)."""
    s = systems.get(system)
    devices = tpu.devices(system, tpu.topology_name(s, chips))
    mesh = project_mesh.compile_mesh({"data": len(devices)}, devices)
    dp = data_parallel(_step, mesh, strategy)  # the state donated, as a run and the projection donate it
    batch = _batch(replica_batch * mesh.size)
    dp.prepare(_state(), batch)
    return dp.lower(dp.layout.stored_shapes(), batch).compile(), mesh


@needs_libtpu
@pytest.mark.parametrize(("system", "chips", "slice_name"), [("tpu-v3", 16, "v3:4x4"), ("tpu-v4", 8, "v4:2x2x2")])
@pytest.mark.parametrize("update", ["replicated", "sharded"])
def test_the_tpu_compiler_costs_its_own_module(system, chips, slice_name, update):
    s = systems.get(system)
    lines = []
    (row,) = project.project(
        _step, _state(), _batch(2), system=system, chips=[chips], strategies=[update], progress=lines.append
    )
    assert row.compiler == f"XLA:TPU {slice_name}" and row.compiled_mesh == row.mesh == {
        "data": chips * s.devices_per_chip
    }
    assert row.compile_s is not None and row.step_s > 0 and row.flops_per_device > 0
    assert any("compiling with XLA:TPU" in line for line in lines)
    compiled, mesh = _compiled(system, chips, Strategy(weight_update=update))
    module = hlo.read(compiled, mesh)
    # The collectives costed are the TPU module's, one for one: kinds, runs and bytes.
    assert module.collectives, "a data-parallel step sums its gradients"
    for kind in hlo.KINDS:
        mine = [c for c in row.collectives if c["kind"] == kind]
        theirs = [c for c in module.collectives if c.kind == kind]
        assert sum(c["runs"] for c in mine) == sum(c.count for c in theirs)
        assert sum(c["buffer_bytes"] for c in mine) == sum(c.buffer_bytes * c.count for c in theirs)
    # The memory is the TPU compiler's allocation (the peak of its buffer assignment), per device
    # times the chip's devices.
    assert row.memory_per_chip == compiled.memory_analysis().peak_memory_in_bytes * s.devices_per_chip > 0
    assert row.fits


@needs_libtpu
def test_a_program_xla_tpu_compiled_fits_whatever_the_datasheet_says(monkeypatch):
    """XLA:TPU checks a program against the chip's memory as it compiles (its own limit, not the
    datasheet's round figure): a row it compiled fits, one it refused does not (below)."""
    import dataclasses

    s = systems.get("tpu-v3")
    monkeypatch.setitem(systems.SYSTEMS, "tpu-v3", dataclasses.replace(s, hbm_bytes=1024.0))
    (row,) = project.project(_step, _state(), _batch(2), system="tpu-v3", chips=[4], strategies=["replicated"])
    assert row.memory_per_chip > row.hbm_per_chip == 1024.0
    assert row.fits and row.costed


@needs_libtpu
def test_each_row_compiles_its_own_slice_and_gets_one_figure_whatever_else_is_asked(monkeypatch):
    """A row's figure depends on its own target only (issue 44): XLA:TPU's module changes with the
    slice (its relayouts of a buffer split N ways depend on N's alignment), so each row compiles
    its own slice up to MAX_TPU_COMPILE_DEVICES, larger ones shrunk to it and scaled. The row of
    16 chips is the same asked alone or beside other chip counts and strategies."""
    monkeypatch.setattr(project, "MAX_TPU_COMPILE_DEVICES", 64)
    lines = []
    rows = project.project(
        _step,
        _state(),
        _batch(2),
        system="tpu-v3",
        chips=[16, 32, 256],
        strategies=["replicated", "sharded"],
        progress=lines.append,
    )
    replicated = [r for r in rows if r.strategy == "replicated"]
    assert [r.compiled_mesh for r in replicated] == [{"data": 32}, {"data": 64}, {"data": 64}]
    assert [r.mesh for r in replicated] == [{"data": 32}, {"data": 64}, {"data": 512}]
    assert replicated[1].compile_s is not None and replicated[2].compile_s is None  # the same program
    # The same module, its gradient sum over ever more devices: the same bytes, longer rings.
    assert replicated[1].compute_s == replicated[2].compute_s
    groups = [max(c["group_size"] for c in r.collectives) for r in replicated]
    assert groups == [32, 64, 512]
    assert replicated[1].communication_s < replicated[2].communication_s
    (alone,) = project.project(_step, _state(), _batch(2), system="tpu-v3", chips=[16], strategies=["replicated"])
    for field in ("step_s", "compute_s", "update_s", "exposed_s", "step_fast_s", "step_slow_s"):
        assert getattr(alone, field) == pytest.approx(getattr(replicated[0], field), rel=0.02), field
    # compile_s is seconds, as the progress line says
    done = [float(line.split("done in ")[1].split(" s")[0]) for line in lines if "done in" in line]
    assert replicated[0].compile_s == pytest.approx(done[0], abs=0.1) or replicated[0].compile_s in [
        pytest.approx(d, abs=0.1) for d in done
    ]
    # every costed row says what bounds it, and the range its assumed figures leave
    for r in rows:
        assert r.step_fast_s < r.step_s < r.step_slow_s
        assert r.dominant in ("mxu", "vector", "memory", "fixed", "communication")
        assert sum(r.terms.values()) == pytest.approx(r.step_s, rel=1e-6)


@needs_libtpu
def test_the_sharded_update_is_scaled_from_two_compiled_sizes(monkeypatch):
    monkeypatch.setattr(project, "MAX_TPU_COMPILE_DEVICES", 32)
    lines = []
    rows = project.project(
        _step, _state(2**17), _batch(2), system="tpu-v3", chips=[16, 256], strategies=["sharded"], progress=lines.append
    )
    # 32 devices (the 16 chips' own, and the 256 chips' shrunk), and 16 for its a + b / n
    assert sum("compiling with XLA:TPU" in line for line in lines) == 2
    small, large = rows
    assert large.update_s < small.update_s  # shards 16x smaller (32 MiB weights: bytes, not kernel starts)
    assert large.memory_per_chip < small.memory_per_chip


@needs_libtpu
def test_a_state_too_large_for_the_chip_is_a_row_that_does_not_fit():
    def init():
        params = {"w1": jnp.zeros((64, 2**25)), "w2": jnp.zeros((2**25, 8))}  # 9 GiB, and Adam's two moments
        return {"params": params, "opt": TX.init(params)}

    huge = jax.eval_shape(init)
    with jax.default_device(jax.devices("cpu")[0]):
        rows = project.project(_step, huge, _batch(2), system="tpu-v5e", chips=[4], strategies=["replicated"])
    (row,) = rows
    assert row.fits is False and not row.fastest
    # XLA:TPU refuses it: the row carries the compiler's message and its figure, no step time.
    assert "memory" in row.does_not_fit.lower() and row.step_s is None
    assert row.memory_per_chip > systems.get("tpu-v5e").hbm_bytes


@needs_libtpu
def test_the_cli_says_which_compiler_made_each_row(capsys):
    from podscale import cli

    assert (
        cli.main(["project", "--model", "mlp", "--system", "tpu-v3", "--chips", "16,64", "--strategies", "replicated"])
        == 0
    )
    out = capsys.readouterr().out
    assert "XLA:TPU v3:4x4 32" in out and "XLA:TPU v3:8x8 128" in out


def test_without_libtpu_a_tpu_system_falls_back_to_the_cpu_module_and_says_so(monkeypatch):
    monkeypatch.setattr(tpu, "available", lambda: False)
    lines = []
    (row,) = project.project(
        _step, _state(), _batch(2), system="tpu-v3", chips=[4], strategies=["replicated"], progress=lines.append
    )
    assert row.compiler == "XLA:CPU" and row.step_s > 0
    assert sum("libtpu is not installed" in line for line in lines) == 1
    with pytest.raises(ValueError, match=r"XLA:TPU needs libtpu, which is not installed; install the tpu extra"):
        project.use_tpu_compiler(systems.get("tpu-v3"), "tpu")
    with pytest.raises(ValueError, match="not a TPU system"):
        project.use_tpu_compiler(systems.get("h100"), "tpu")
    assert not project.use_tpu_compiler(systems.get("h100"), "auto")


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
def test_compiler_tpu_without_libtpu_is_one_refusal_naming_the_extra(monkeypatch, capsys, dry_run):
    """XLA:TPU asked for by name: no fallback notice (it falls back to nothing), one line, exit code 2."""
    monkeypatch.setattr(tpu, "available", lambda: False)
    argv = ["project", "--model", "mlp", "--system", "tpu-v3", "--chips", "16", "--compiler", "tpu", *dry_run]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("podscale: error: --compiler tpu: XLA:TPU needs libtpu"), line
    assert "pip install 'podscale[tpu]'" in line and "costing" not in line and "instead" not in line
    assert captured.out == ""
    assert cli.main(["plan", "--model", "mlp", "--system", "tpu-v3", "--chips", "4", *dry_run]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "pip install 'podscale[tpu]'" in line and "costing" not in line, line


def test_xla_tpu_replica_groups_in_mesh_form():
    groups = hlo_groups.replica_groups(
        "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, use_global_device_ids=true"
    )
    assert groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    groups = hlo_groups.replica_groups("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}")
    assert groups == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert hlo_groups.replica_groups("replica_groups=mesh['axis_0'=8] {'axis_0'}") == [list(range(8))]


def _module(schedule, ops, collectives):
    return hlo.Module(collectives, [], {}, ops, schedule, "main")


def test_the_schedule_decides_what_communication_hides():
    op = hlo_cost.Op("f", "fusion", 0.0, 0.0, 0.0, "", 1, "backward")
    c = hlo.Collective("all-reduce", "ar", ("data",), 4, "f32", 1024, 1)
    ops, seconds = [op, op, op], [1.0, 1.0, 1.0]
    # Synchronous: the ops wait for all of it.
    assert (
        project_cost.timeline(_module({"main": [("op", 0), ("sync", (0,)), ("op", 1)]}, ops, [c]), seconds, [2.5])
        == 2.5
    )
    # Asynchronous: the two ops between its start and done hide two of its 2.5 seconds.
    async_ = [("start", (0,)), ("op", 0), ("op", 1), ("done", (0,)), ("op", 2)]
    assert project_cost.timeline(_module({"main": async_}, ops, [c]), seconds, [2.5]) == pytest.approx(0.5)
    # One link: a second collective started at once waits for the first.
    two = [("start", (0,)), ("start", (1,)), ("op", 0), ("done", (0,)), ("done", (1,))]
    assert project_cost.timeline(_module({"main": two}, ops, [c, c]), seconds, [1.0, 1.0]) == pytest.approx(1.0)
    # A loop body counts its trip count times.
    loop = {"main": [("call", "body", 3)], "body": [("op", 0), ("sync", (0,))]}
    assert project_cost.timeline(_module(loop, ops, [c]), seconds, [0.5]) == pytest.approx(1.5)


@needs_libtpu
def test_scanned_loops_on_tpu_count_their_trip_counts():
    devices = tpu.devices("tpu-v5e", "v5e:2x2")

    def body(x, w):
        def layer(h, _):
            return jnp.tanh(h @ w), None

        return jax.lax.scan(layer, x, None, length=5)[0]

    mesh = project_mesh.compile_mesh({"data": 1}, devices[:1])
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    x = jax.ShapeDtypeStruct((128, 256), jnp.bfloat16, sharding=whole)
    w = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16, sharding=whole)
    compiled = jax.jit(body).lower(x, w).compile()
    module = hlo.read(compiled)
    assert not module.unknown_trip_counts
    assert sum(o.matmul_flops * o.count for o in module.ops) == 5 * 2 * 128 * 256 * 256
    assert math.isclose(module.flops(), compiled.cost_analysis()["flops"] * 5, rel_tol=0.2)


@needs_libtpu
def test_plan_shows_the_tpu_compiled_module_for_a_named_slice(capsys):
    import json

    from podscale import cli

    assert cli.main(["plan", "--model", "mlp", "--system", "tpu-v4", "--chips", "8", "--mesh", "4x2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["compiler"] == "XLA:TPU for tpu-v4 8 chips (8 devices)"
    assert plan["compiled"]["collectives"] and plan["compiled"]["memory"]["peak"] > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--system", "tpu-v3"], "--system needs --chips"),
        (["--chips", "16"], "--chips needs --system"),
        (["--system", "h100", "--chips", "8"], "TPU systems only"),
        (["--system", "tpu-v3", "--chips", "16", "--replicas", "8"], "--replicas with --system"),
    ],
)
def test_plan_refuses_an_incomplete_slice_before_any_work(capsys, args, message):
    from podscale import cli

    assert cli.main(["plan", "--model", "mlp", *args]) == 2
    assert message in capsys.readouterr().err


@needs_libtpu
def test_an_all_reduce_each_device_keeps_a_share_of_is_a_reduce_scatter():
    """XLA:TPU writes ``psum_scatter`` as an all-reduce and a dynamic slice; it is costed as the
    reduce-scatter it runs as. A ``psum`` used whole stays an all-reduce."""
    from jax.sharding import NamedSharding, PartitionSpec

    devices = tpu.devices("tpu-v5e", "v5e:2x4")
    mesh = project_mesh.compile_mesh({"data": 8}, devices)
    x = jax.ShapeDtypeStruct((8 * 4096,), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec()))

    def both(v):
        return jax.lax.psum_scatter(v, "data", scatter_dimension=0, tiled=True), jax.lax.psum(v * 2, "data")

    f = jax.shard_map(both, mesh=mesh, in_specs=PartitionSpec(), out_specs=(PartitionSpec("data"), PartitionSpec()))
    module = hlo.read(jax.jit(f).lower(x).compile(), mesh)
    kinds = {(c.kind, c.buffer_bytes) for c in module.collectives}
    assert kinds == {("reduce-scatter", 8 * 4096 * 4), ("all-reduce", 8 * 4096 * 4)}


_SLICED = """HloModule m, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p: f32[1024], i: s32[]) -> (f32[256], f32[256], f32[1024], f32[256]) {
  %p = f32[1024] parameter(0)
  %i = s32[] parameter(1)
  %halves = f32[1024] all-reduce(%p), replica_groups={{0,1,2,3}}, to_apply=%add
  %s0 = f32[256] slice(%halves), slice={[0:256]}
  %s1 = f32[256] slice(%halves), slice={[256:512]}
  %whole = f32[1024] all-reduce(%p), replica_groups={{0,1,2,3}}, to_apply=%add
  %share = f32[1024] all-reduce(%p), replica_groups={{0,1,2,3}}, to_apply=%add
  %mine = f32[256] dynamic-slice(%share, %i), dynamic_slice_sizes={256}
  ROOT %t = (f32[256], f32[256], f32[1024], f32[256]) tuple(%s0, %s1, %whole, %mine)
}
"""


def test_only_an_all_reduce_each_device_keeps_one_share_of_is_a_reduce_scatter():
    assert {c.kind for c in hlo.read_text(_SLICED).collectives} == {"all-reduce"}  # XLA:CPU's: as written
    module = hlo.read_text(_SLICED, platform="tpu")
    kinds = {c.name: c.kind for c in module.collectives}
    # Two static slices (half the buffer) and a result used whole: all-reduces. One dynamic slice
    # of a quarter: the device keeps its share, a reduce-scatter.
    assert kinds == {"halves": "all-reduce", "whole": "all-reduce", "share.scatter": "reduce-scatter"}


_STRIDED = """HloModule m

%cond (c: (s32[], f32[8])) -> pred[] {
  %c = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(10)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (b: (s32[], f32[8])) -> (s32[], f32[8]) {
  %b = (s32[], f32[8]) parameter(0)
  %j = s32[] get-tuple-element(%b), index=0
  %x = f32[8] get-tuple-element(%b), index=1
  %two = s32[] constant(2)
  %k = s32[] add(%j, %two)
  ROOT %r = (s32[], f32[8]) tuple(%k, %y)
  %y = f32[8] exponential(%x)
}

ENTRY %main (p: f32[8]) -> (s32[], f32[8]) {
  %p = f32[8] parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]) tuple(%zero, %p)
  ROOT %w = (s32[], f32[8]) while(%init), condition=%cond, body=%body
}
"""


_TILED_SHARE = """HloModule m, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%take (q: f32[4,65536], j: u32[]) -> f32[1,65536] {
  %q = f32[4,65536]{1,0:T(4,128)} parameter(0)
  %j = u32[]{:T(256)} parameter(1)
  %z = u32[]{:T(256)} constant(0)
  ROOT %row = f32[1,65536]{1,0:T(2,128)} dynamic-slice(%q, %j, %z), dynamic_slice_sizes={1,65536}
}

ENTRY %main (p: f32[4,65536], i: u32[]) -> f32[1,65536] {
  %p = f32[4,65536]{1,0:T(4,128)} parameter(0)
  %i = u32[]{:T(256)} parameter(1)
  %rows = f32[4,65536]{1,0:T(4,128)} all-reduce(%p), replica_groups={{0,1,2,3}}, to_apply=%add
  ROOT %mine = f32[1,65536]{1,0:T(2,128)} fusion(%rows, %i), kind=kLoop, calls=%take
}
"""


def test_a_share_read_through_a_fusion_is_a_reduce_scatter_whatever_its_tiles():
    """The 2-D sum's first phase as XLA:TPU writes it: an all-reduce over ``x`` of ``[x, w]`` rows
    and a fusion that keeps one row. The row's tiles hold 2 rows (``T(2,128)``): as the chip stores
    it, twice its share, but the device keeps a quarter of the sum, a reduce-scatter."""
    (c,) = hlo.read_text(_TILED_SHARE, platform="tpu").collectives
    assert (c.kind, c.buffer_bytes) == ("reduce-scatter", 4 * 65536 * 4)


def test_a_loop_without_a_recorded_trip_count_is_read_with_its_step():
    module = hlo.read_text(_STRIDED)  # i = 0, 2, ..., 8: five trips (the ROOT is not the last line)
    (exp,) = [o for o in module.ops if o.opcode == "exponential"]
    assert exp.count == 5 and not module.unknown_trip_counts
    unknown = hlo.read_text(_STRIDED.replace("add(%j, %two)", "multiply(%j, %two)"))
    assert unknown.unknown_trip_counts == ["w"]


def test_replica_groups_in_mesh_form_with_device_ids_and_sub_axes():
    assert hlo_groups.replica_groups("replica_groups=mesh['x'=2,'y'=2], device_ids=(0,2,1,3) {'y'}") == [[0, 2], [1, 3]]
    assert hlo_groups.replica_groups("replica_groups=mesh['x'=8] {'x':(2)2}") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    # XLA:CPU writes the device ids in iota form: 0..7 as 4x2, transposed: 0,2,4,6,1,3,5,7.
    groups = hlo_groups.replica_groups(
        "replica_groups=mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'a'}, dimensions={0}"
    )
    assert groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="mesh form"):
        hlo_groups.replica_groups("replica_groups=mesh['x'=2] <unknown>")


def test_the_host_s_tpu_check_reads_jax_s_own_without_importing_jax():
    """``tpu.has_tpu`` runs JAX's PCI scan from its file (so that ``podscale launch`` and the
    supervisors never load JAX); a JAX upgrade that moves it fails here, not silently."""
    from podscale.compiled import tpu

    assert callable(tpu._hardware_utils().num_available_tpu_chips_and_device_id)


@needs_libtpu
def test_sigterm_after_libtpu_loads_ends_the_process_without_a_stack_trace():
    """libtpu installs absl's failure handler for SIGTERM; podscale puts the process's own back, so
    a stopped compile ends as a shell reports it (143), not with libtpu's C++ stack trace."""
    import signal
    import subprocess
    import sys

    code = (
        "import sys, time\n"
        "from podscale.compiled import tpu\n"
        "tpu.devices('tpu-v3', 'v3:2x2')\n"
        "print('loaded', flush=True)\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "loaded"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM and "stack trace" not in err and "FailureSignalHandler" not in err, err


@needs_libtpu
def test_a_64_feature_convolution_is_charged_as_128_on_xla_tpus_module():
    """Issue 44: a convolution's output features are padded to the MXU's 128 (its taps folded into
    the contraction), read from XLA:TPU's own module; its bytes as the tiled layouts store them."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = tpu.devices("tpu-v3", "v3:2x2")
    whole = NamedSharding(Mesh(devices[:1], ("d",)), P())

    def conv(x, w):
        y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return y.sum()

    args = [
        jax.ShapeDtypeStruct((8, 32, 32, 64), jnp.bfloat16, sharding=whole),
        jax.ShapeDtypeStruct((3, 3, 64, 64), jnp.bfloat16, sharding=whole),
    ]
    module = hlo.read_text(jax.jit(conv).lower(*args).compile().as_text(), platform="tpu")
    (op,) = [o for o in module.ops if o.matmul_flops]
    assert op.matmuls == ((1, 8 * 32 * 32, 64, 9 * 64),)
    v3 = systems.get("tpu-v3")
    assert project_cost.padded_matmul_flops(op, v3.matmul_tile) == pytest.approx(op.matmul_flops * 128 / 64 * 640 / 576)
    assert op.estimated_cycles > 0  # XLA:TPU's own estimate, read beside
    # a 3-feature image whose features are a tiled minor dimension takes 128 lanes of 3
    assert hlo_cost.memory_bytes("bf16[8,32,32,3]{3,2,1,0:T(8,128)(2,1)}") == 8 * 32 * 32 * 128 * 2


def _bn_model_step(bn_axis):
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(128)(x)
            x = nn.BatchNorm(use_running_average=False, axis_name=bn_axis)(x)
            return nn.Dense(8)(jnp.tanh(x))

    return _batch_norm_step(Net(), TX, 64)


def _batch_norm_step(net, tx, features: int):
    """The training step of the flax module ``net`` (with batch statistics) under ``tx``, and its
    state's shapes."""
    variables = jax.eval_shape(lambda: net.init(jax.random.key(0), jnp.zeros((2, features))))
    state = {"params": variables["params"], "stats": variables["batch_stats"]}
    state["opt"] = jax.eval_shape(tx.init, state["params"])

    def step(state, batch):
        def loss(params):
            out, new = net.apply({"params": params, "batch_stats": state["stats"]}, batch["x"], mutable=["batch_stats"])
            return jnp.mean((out - batch["y"]) ** 2), new["batch_stats"]

        grads, stats = jax.grad(loss, has_aux=True)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "stats": stats, "opt": opt}, {}

    return step, state


@needs_libtpu
def test_batch_norm_groups_are_summed_over_their_replicas_only():
    """``bn_group_size=4`` (MLPerf's batch-norm groups): the mesh gets an innermost group axis of 4
    neighbouring replicas, and XLA:TPU's module sums the statistics over groups of 4 devices while
    the gradients are still summed over all 32. Under the 2-D sum the group axis splits the torus
    dimension's axis ``y``, and the gradients are still summed over all 32."""
    from podscale.parallel.mesh import BN_GROUP

    step, state = _bn_model_step(BN_GROUP)
    grouped, two_d = project.project(
        step, state, _batch(2), system="tpu-v3", chips=[16], strategies=["replicated", "sharded-2d"], bn_group_size=4
    )
    assert grouped.mesh == {"data": 8, BN_GROUP: 4} and grouped.bn_group_size == 4
    assert two_d.mesh == {"x": 4, "y": 2, BN_GROUP: 4} and two_d.bn_group_size == 4
    for row in (grouped, two_d):
        sizes = {c["group_size"] for c in row.collectives if c["kind"] == "all-reduce"}
        assert sizes == {4, 32}, row.collectives
    # Whole-batch batch norm (the default): every sum over the 32 devices.
    step, state = _bn_model_step(None)
    (whole,) = project.project(step, state, _batch(2), system="tpu-v3", chips=[16], strategies=["replicated"])
    assert whole.mesh == {"data": 32} and whole.bn_group_size == 1
    assert {c["group_size"] for c in whole.collectives if c["kind"] == "all-reduce"} == {32}
    with pytest.raises(ValueError, match="do not divide into batch-norm groups of 3"):
        project.project(step, state, _batch(2), system="tpu-v3", chips=[16], strategies=["replicated"], bn_group_size=3)


def _tanh_layers(layers: int, width: int, rows: int, tx=TX):
    """``tx`` (default Adam) on ``layers`` square tanh layers of ``width``: (step, state shapes, a
    batch of ``rows``)."""

    def init():
        params = {f"w{i}": jnp.zeros((width, width)) for i in range(layers)}
        return {"params": params, "opt": tx.init(params)}

    def step(state, batch):
        def loss(params):
            h = batch["x"]
            for i in range(layers):
                h = jnp.tanh(h @ params[f"w{i}"])
            return jnp.mean((h - batch["y"]) ** 2)

        grads = jax.grad(loss)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {}

    batch = {k: jax.ShapeDtypeStruct((rows, width), jnp.float32) for k in ("x", "y")}
    return step, jax.eval_shape(init), batch


def _lars_step(layers: int):
    """``layers`` dense layers of 128x128 (each stored in chunks by the sharded update) under LARS."""
    step, state, _ = _tanh_layers(layers, 128, 8, optax.lars(0.1))
    return step, state


def _sharded_on_v3_2x2(step, state):
    """The step (16 rows of 128 features) under the sharded update, compiled by XLA:TPU for
    ``v3:2x2``: ``(dp, the module read)``."""
    devices = tpu.devices("tpu-v3", tpu.topology_name(systems.get("tpu-v3"), 4))
    mesh = project_mesh.compile_mesh({"data": len(devices)}, devices)
    dp = data_parallel(step, mesh, Strategy(weight_update="sharded"), donate_state=False)
    batch = {k: jax.ShapeDtypeStruct((16, 128), jnp.float32) for k in ("x", "y")}
    dp.prepare(state, batch)
    return dp, hlo.read(dp.lower(dp.layout.stored_shapes(), batch).compile(), mesh)


@needs_libtpu
def test_lars_norms_are_fused_whatever_the_layer_count_in_xla_tpus_module():
    """LARS's trust ratios read a norm of each weight and of its update: on chunks, partial sums
    summed over the replicas (the weight too, kept whole by the sharded update: each replica sums
    its chunk's squares). They go out fused, not one all-reduce per layer (issue 45: ResNet-50's
    module had 52): podscale's program sums every layer's weight norms in one all-reduce and their
    updates' in another, and XLA:TPU's module has as many all-reduces for 3 layers as for 6. Twice
    each, because optax's ``safe_norm`` takes a second norm that reads the first."""
    counts = {}
    for layers in (3, 6):
        dp, module = _sharded_on_v3_2x2(*_lars_step(layers))
        counts[layers] = sum(c.count for c in module.collectives if c.kind == "all-reduce")
        norms = [c for c in dp.trace.collectives if "norms" in c.why]  # podscale's own program
        assert [c.tensors for c in norms] == [layers] * 4, dp.trace.collectives
        gathers = sum(c.count for c in module.collectives if c.kind == "all-gather")
        assert gathers == layers  # each weight is updated in chunks (and gathered after)
    assert counts[3] == counts[6] <= 3, counts


@needs_libtpu
def test_a_weight_s_norm_is_taken_on_its_chunk_under_the_sharded_update():
    """The sharded update keeps each weight whole, and LARS takes its norm: each replica sums the
    squares of its chunk of it (a partial sum, fused with the updates' norms), not the whole weight
    (ResNet-50 at 1024 chips: 90 whole-weight reductions, 0.64 ms a step). In XLA:TPU's module no
    reduction outside the update reads a weight, and none in it reads more than a chunk's tiles."""
    _, module = _sharded_on_v3_2x2(*_lars_step(3))
    weight = 128 * 128 * 4
    sums = [op for op in module.ops if op.op_name.endswith("reduce_sum") and "podscale_update" not in op.op_name]
    assert sum(op.bytes * op.count for op in sums) < 0.01 * weight, [(op.name, op.bytes) for op in sums]
    update = [op for op in module.ops if op.phase == "update" and op.op_name.endswith("reduce_sum")]
    assert len(update) >= 6 and max(op.bytes for op in update) < weight / 2, sorted(op.bytes for op in update)


@needs_libtpu
def test_the_sharded_update_does_not_donate_the_weights_it_gathers_so_xla_tpu_copies_none():
    """The sharded update gathers each updated weight from its chunks. XLA:TPU cannot gather into
    a donated buffer: it copied the donated weight at the start and the gathered value into it at
    the end (transformer-big full on v3:2x2: 843 MB each). The gathered weights are not donated
    (the optimizer state, updated in place, still is), so no weight is copied at the start: the
    module aliases the optimizer state's buffers only."""
    devices = tpu.devices("tpu-v3", tpu.topology_name(systems.get("tpu-v3"), 4))
    mesh = project_mesh.compile_mesh({"data": len(devices)}, devices)
    dp = data_parallel(_step, mesh, Strategy(weight_update="sharded"))  # donate_state=True, as a run
    batch = _batch(2 * mesh.size)
    dp.prepare(_state(256), batch)
    text = dp.lower(dp.layout.stored_shapes(), batch).compile().as_text()
    copied = re.findall(r"= f32\[([\d,]+)\]\S* copy\(%param", text)
    assert not {"64,256", "256,8"} & set(copied), copied  # the weights' shapes
    header = text.splitlines()[0]  # HloModule ..., input_output_alias={ {0}: (0, {}, may-alias), ... }
    assert header.count("may-alias") == 5  # the step count and the four moments, not w1 and w2


def _scanned_step(offload: bool):
    """SGD on 8 stacked tanh layers under ``lax.scan``, each layer's input rematerialised, or
    offloaded to host memory between the passes (MaxText's ``offload`` policy)."""
    from jax.ad_checkpoint import checkpoint_name

    policy = (
        jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=["layer_input"],
            offload_src="device",
            offload_dst="pinned_host",
        )
        if offload
        else jax.checkpoint_policies.nothing_saveable
    )

    def layer(h, w):
        return jnp.tanh(checkpoint_name(h, "layer_input") @ w), None

    def step(state, batch):
        def loss(w):
            h, _ = jax.lax.scan(jax.checkpoint(layer, policy=policy), batch["x"], w)
            return jnp.mean(h**2)

        return {"w": state["w"] - 0.1 * jax.grad(loss)(state["w"])}, {}

    return step


@needs_libtpu
def test_memory_offloaded_to_host_is_not_counted_in_the_chip_s_memory():
    """XLA:TPU's peak counts the buffers a remat policy offloads to host memory, and not the
    device's temporaries: the row's memory per chip is the device's buffers (arguments, outputs
    and temporaries), below the same step's without the offload, and the host's is its own
    figure."""
    state = {"w": jax.ShapeDtypeStruct((8, 512, 512), jnp.float32)}
    batch = {"x": jax.ShapeDtypeStruct((4096, 512), jnp.float32)}  # per replica, as project takes it
    rows = {}
    for offload in (False, True):
        (rows[offload],) = project.project(
            _scanned_step(offload), state, batch, system="tpu-v6e", chips=[8], strategies=["replicated"]
        )
    kept, moved = rows[False], rows[True]
    assert kept.host_memory_per_chip == 0 and moved.host_memory_per_chip >= 7 * 4096 * 512 * 4  # 7 layers' inputs
    assert moved.memory_per_chip < kept.memory_per_chip
    s = systems.get("tpu-v6e")
    devices = tpu.devices("tpu-v6e", tpu.topology_name(s, 8))
    mesh = project_mesh.compile_mesh({"data": len(devices)}, devices)
    dp = data_parallel(_scanned_step(True), mesh)
    whole = {"x": jax.ShapeDtypeStruct((4096 * mesh.size, 512), jnp.float32)}
    dp.prepare(state, whole)
    memory = hlo.memory_of(dp.lower(dp.layout.stored_shapes(), whole).compile())
    held = memory["arguments"] + memory["outputs"] - memory["aliased"]
    # the host buffers in the compiler's peak, the device's temporaries (8.4 MiB) not
    assert held + memory["host_temporaries"] <= memory["allocated"] < held + memory["host_temporaries"] + 2**20
    assert (
        hlo.device_bytes(memory) * s.devices_per_chip == moved.memory_per_chip == memory["peak"] < memory["allocated"]
    )


@needs_libtpu
def test_two_slices_are_compiled_as_xla_tpu_s_multislice_module_and_their_dcn_parts_costed():
    """8 v5e chips as 2 slices of 2x2: each row is compiled for both slices at once (libtpu's
    multislice devices), whose module sums within a slice itself and sends each sum across the
    slices to the megascale runtime. Data x FSDP's copies are across the slices: each chunk's sum
    over the copies is a send, costed over DCN; FSDP over all 8 gathers across them too."""
    rows = project.project(
        _step, _state(), _batch(2), system="tpu-v5e", chips=[8], slices=2, strategies=["fsdp", "data-x-fsdp"]
    )
    by = {r.strategy: r for r in rows}
    assert all(r.compiler == "XLA:TPU v5e:2x2 x 2 slices" and "2 slices" in r.topology for r in rows)
    assert by["data-x-fsdp"].mesh == {"x": 2, "y": 4}
    s = systems.get("tpu-v5e")
    for r in rows:
        dcn = [c for c in r.collectives if c["axes"] == [hlo.DCN]]
        assert dcn and all(c["path"] == "DCN (2 slices)" and c["group_size"] == 2 for c in dcn), r.collectives
        for c in dcn:  # a ring of 2 over each chip's share of the data-centre network
            one = network.ring_time(c["kind"], 2, c["buffer_bytes"] / c["runs"], s.dcn_bandwidth, s.dcn_latency, False)
            assert c["seconds"] == pytest.approx(one * c["runs"])
    within = [c for c in by["data-x-fsdp"].collectives if c["axes"] == ["y"]]
    assert {c["kind"] for c in within} >= {"all-gather", "reduce-scatter"}  # the chunks' own, within a slice


@needs_libtpu
def test_a_shrunk_compile_mesh_spans_the_slices_it_covers_and_so_does_its_half(monkeypatch):
    """32 v5e chips as 8 slices of 2x2, compiled on at most 16 devices: the sharded update's row is
    compiled on the first 4 slices, and its second size (the first axis halved, for ``a + b / n``)
    on the first 2, each by XLA:TPU for those slices at once (not as one oversized slice)."""
    monkeypatch.setattr(project, "MAX_TPU_COMPILE_DEVICES", 16)
    lines = []
    (row,) = project.project(
        _step,
        _state(),
        _batch(2),
        system="tpu-v5e",
        chips=[32],
        slices=8,
        strategies=["sharded"],
        progress=lines.append,
    )
    compiles = sorted(line.split(": compiling")[0] for line in lines if "compiling with XLA:TPU" in line)
    assert compiles == [
        "tpu-v5e sharded, mesh 16 (v5e:2x2 x 4 slices)",
        "tpu-v5e sharded, mesh 8 (v5e:2x2 x 2 slices)",
    ], lines
    assert row.compiler == "XLA:TPU v5e:2x2 x 4 slices" and "8 slices" in row.topology
    assert any(c["axes"] == [hlo.DCN] for c in row.collectives)  # its sums across slices, over DCN


def _bn_layers_step(layers: int):
    """``layers`` blocks of a 128-wide dense layer in bfloat16 and batch norm over the whole batch,
    under LARS (as ResNet-50): the backward pass all-reduces each block's batch statistics between
    the layers' gradients."""
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(layers):
                x = nn.Dense(128, use_bias=False, dtype=jnp.bfloat16)(x)
                x = jnp.tanh(nn.BatchNorm(use_running_average=False)(x))
            return x

    return _batch_norm_step(Net(), optax.lars(0.1), 128)


@needs_libtpu
def test_the_chunks_gradient_sums_are_fused_whatever_the_layer_count_in_xla_tpus_module():
    """The sharded update reduce-scatters each kernel's gradient along one of its dims into its
    stored chunk. Sent where the update first reads each gradient, between the backward pass's
    batch-statistic all-reduces, XLA:TPU sent them one per layer (issue 45: ResNet-50's module had
    53, each a whole pod's latency at 1024 chips); deferred and sent together, XLA:TPU combines
    them: as many collectives carry the kernels' gradients for 6 layers as for 3."""
    kernel = 128 * 128 * 2  # a bfloat16 gradient
    counts = {}
    for layers in (3, 6):
        dp, module = _sharded_on_v3_2x2(*_bn_layers_step(layers))
        assert sum(leaf.chunked for leaf in dp.layout.leaves) == layers  # each kernel's momentum
        sums = [
            c for c in module.collectives if c.kind in ("all-reduce", "reduce-scatter") and c.buffer_bytes >= kernel
        ]
        counts[layers] = sum(c.count for c in sums)
        assert sum(c.buffer_bytes * c.count for c in sums) >= layers * kernel  # every kernel's gradient summed
    assert counts[3] == counts[6] <= 2, counts


@needs_libtpu
def test_the_2d_sum_is_one_collective_per_phase_in_xla_tpus_module():
    """On a TPU the 2-D sum sends each fused buffer whole (one chunk): XLA:TPU combined the
    chunks' reduce-scatters and all-reduces back into one per phase anyway and sent their
    all-gathers one by one (4 chunks: 1, 1 and 4 collectives). Each phase is one collective, and
    the first, an all-reduce of which each device keeps its row, is read as the reduce-scatter."""
    mesh, module = _lars_2d_on_v3_4x4(Strategy(grad_sum="2d", grad_sum_phases="explicit"))
    phases = sorted(
        (c.kind, c.axes) for c in module.collectives if hlo.GRAD_SUM_SCOPE in c.op_name or "(unnamed)" in c.op_name
    )
    assert phases == [("all-gather", ("x",)), ("all-reduce", ("y",)), ("reduce-scatter", ("x",))], module.collectives


def _lars_2d_on_v3_4x4(strategy):
    """XLA:TPU's module of a 4-layer LARS step on a ``4 x 8`` mesh of ``v3:4x4``'s 32 cores."""
    devices = tpu.devices("tpu-v3", "v3:4x4")
    mesh = project_mesh.compile_mesh({"x": 4, "y": 8}, devices)
    step, state = _lars_step(4)
    dp = data_parallel(step, mesh, strategy, donate_state=False)
    if strategy.grad_sum == "2d" and strategy.grad_sum_phases == "explicit":
        assert dp.grad_sum.chunks == 1 and "one chunk per phase" in dp.grad_sum.reason
    batch = {k: jax.ShapeDtypeStruct((64, 128), jnp.float32) for k in ("x", "y")}
    dp.prepare(state, batch)
    return mesh, hlo.read(dp.lower(dp.layout.stored_shapes(), batch).compile(), mesh)


@needs_libtpu
def test_on_a_tpu_the_2d_sum_is_xla_tpus_collective_over_the_torus_and_the_1d_sum_s_module():
    """Issue 45: XLA:TPU runs a collective over two torus dimensions over both dimensions' links
    at once, the 2-D scheme's own decomposition without its synchronous phases and flat buffers.
    On a TPU the 2-D sum is therefore sent as one collective over both axes by default, and its
    module's collectives are the 1-D sum's: the 2-D strategies cannot lose to the 1-D ones."""

    def sums(module):
        return sorted((c.kind, c.axes, c.buffer_bytes, c.count) for c in module.collectives)

    for update in ("replicated", "sharded"):
        _, two_d = _lars_2d_on_v3_4x4(Strategy(weight_update=update, grad_sum="2d", min_shard_size=1024))
        _, one_d = _lars_2d_on_v3_4x4(Strategy(weight_update=update, grad_sum="1d", min_shard_size=1024))
        assert sums(two_d) == sums(one_d), update
        assert all(c.axes == ("x", "y") for c in two_d.collectives), (update, two_d.collectives)
        kinds = {c.kind for c in two_d.collectives}
        assert {"all-reduce", "reduce-scatter", "all-gather"} & kinds >= (
            {"all-reduce"} if update == "replicated" else {"reduce-scatter", "all-gather"}
        ), (update, kinds)


def _attention_kernels():
    """Adam on three attention-shaped kernels (``[256, 4, 64]``: model dim x heads x head dim):
    ``(init, step, batch)``."""

    def init():
        params = {f"w{i}": jnp.zeros((256, 4, 64)) for i in range(3)}
        return {"params": params, "opt": TX.init(params)}

    def step(state, batch):
        def loss(params):
            h = batch["x"]
            for i in range(3):
                h = jnp.tanh(jnp.einsum("bd,dhk->bhk", h, params[f"w{i}"]).reshape(h.shape))
            return jnp.mean((h - batch["y"]) ** 2)

        grads = jax.grad(loss)(state["params"])
        updates, opt = TX.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {}

    return init, step, {k: jax.ShapeDtypeStruct((64, 256), jnp.float32) for k in ("x", "y")}


def _kernels_module(slice_name: str, weight_update: str):
    init, step, batch = _attention_kernels()
    devices = tpu.devices("tpu-v3", slice_name)
    mesh = project_mesh.compile_mesh({"data": len(devices)}, devices)
    dp = data_parallel(step, mesh, Strategy(weight_update=weight_update))
    dp.prepare(jax.eval_shape(init), batch)
    return hlo.read(dp.lower(dp.layout.stored_shapes(), batch).compile(), mesh)


@needs_libtpu
def test_the_replicated_update_copies_nothing_one_device_would_not_in_xla_tpus_module():
    """The replicated update sums each gradient in its own shape on a TPU: no relayout copies of
    gradients into fused flat buffers and back (issue 45: 27.5 ms of transformer-big's 42.1 ms
    update at 16 chips). Attention-shaped kernels (heads x head dim) under Adam on ``v3:4x4``: the
    update scope's copies are under 5% of the bytes it moves."""
    module = _kernels_module("v3:4x4", "replicated")
    assert module.copy_bytes(["update"]) < 0.05 * module.op_bytes(["update"]), module.to_dict()["copy_bytes"]


@needs_libtpu
def test_the_sharded_update_s_chunks_fill_their_tiles_so_it_moves_a_fraction_of_the_weights():
    """``[256, 256]`` kernels under Adam on ``v3:4x4`` (32 cores): chunked along their rows (8 rows,
    one tile high), the update's ops move less than the weights' own bytes, besides the copies of
    the gathered weights it returns, and it relays out nothing. Chunked along their columns (8 of
    each tile's 128 lanes) it moved 959 KB of the weights' 786 KB and relaid out 2 MB."""
    step, state, batch = _tanh_layers(3, 256, 64)
    devices = tpu.devices("tpu-v3", "v3:4x4")
    mesh = project_mesh.compile_mesh({"data": len(devices)}, devices)
    dp = data_parallel(step, mesh, Strategy(weight_update="sharded"))
    dp.prepare(state, batch)
    module = hlo.read(dp.lower(dp.layout.stored_shapes(), batch).compile(), mesh)
    weights = 3 * 256 * 256 * 4
    moved = module.op_bytes(["update"]) - module.copy_bytes(["update"])
    assert moved < weights / 2, moved
    assert module.copy_bytes(["update"], relayouts=True) == 0, module.to_dict()["relayout_bytes"]


@needs_libtpu
def test_the_sharded_update_relays_out_no_gradient_and_copies_only_the_weights_it_returns():
    """The sharded update reduce-scatters each gradient along one of its own dims: on ``v3:2x2``
    (8 cores) the attention-shaped kernels' gradients are relaid out neither in the backward pass
    nor in the update (issue 43). What the update scope copies is the three gathered weights, each
    in its own layout, read and written once: XLA:TPU copies every collective's result that the
    step returns (a ``shard_map`` returning an ``all_gather`` has that copy too), so a weight kept
    whole between steps costs a copy of itself a step, which FSDP's chunks do not."""
    module = _kernels_module("v3:2x2", "sharded")
    relaid = module.to_dict()["relayout_bytes"]
    assert relaid["backward"] == relaid["update"] == 0, relaid
    weights = 3 * 256 * 4 * 64 * 4
    assert module.copy_bytes(["update"], relayouts=False) == 2 * weights, module.to_dict()["copy_bytes"]


ASYNC_OPTIONS = (
    "--xla_tpu_enable_async_collective_fusion=true --xla_tpu_enable_async_collective_fusion_fuse_all_reduce=true "
    "--xla_enable_async_all_reduce=true --xla_tpu_async_collective_fusion_with_start_done_only=true "
    "--xla_jf_crs_combiner_threshold_in_bytes=1"
)
"""MaxText's asynchronous collective fusion, with XLA's combiner off (so each gradient's all-reduce is
its own and can start as soon as that gradient is made), and on v3 start-and-done-only fusions
(which otherwise run out of the core's vector memory)."""


@needs_libtpu
def test_asynchronous_collectives_that_libtpu_options_make_are_read_and_hidden_behind_the_backward_pass(monkeypatch):
    """With the options in ``LIBTPU_INIT_ARGS``, as a run passes them, XLA:TPU's ``v3:4x4`` module
    sends the first gradient's all-reduce as an ``AsyncCollectiveStart`` fusion and ends it after
    the other gradients' products. The reader counts it as the collective it is (four gradient
    all-reduces, none dropped) and the projection hides part of it; without the options nothing is
    hidden. A malformed option is refused naming it."""
    step, state, batch = _tanh_layers(4, 512, 16)

    def row():
        (r,) = project.project(step, state, batch, system="tpu-v3", chips=[16], strategies=["replicated"])
        return r

    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    plain = row()
    monkeypatch.setenv("LIBTPU_INIT_ARGS", ASYNC_OPTIONS)
    overlapped = row()
    assert plain.hidden_s == 0 and overlapped.hidden_s > 0, (plain.hidden_s, overlapped.hidden_s)
    runs = lambda r: sum(c["runs"] for c in r.collectives if c["kind"] == "all-reduce")  # noqa: E731
    assert runs(overlapped) == 4 and runs(plain) >= 1, (overlapped.collectives, plain.collectives)
    assert overlapped.exposed_s < overlapped.communication_s
    with pytest.raises(ValueError, match="'xla_foo=1' is not an option"):
        tpu.compile_options("--xla_bar=true xla_foo=1")
