"""2-D gradient summation against 1-D and against the single-device step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import max_abs_diff, relative_error, run_parallel, run_single

from podscale import data_parallel, make_mesh
from podscale.compiled import gradsum_cost
from podscale.compiled.gradsum_cost import AxisCost, choose_order, parse_axis_costs
from podscale.parallel import gradsum
from podscale.parallel.gradsum import calibrate, make_grad_sum
from podscale.train.tasks import make_task, make_train_step

STEPS = 5


@pytest.fixture(scope="module")
def setup():
    task = make_task("mlp", "synthetic")
    tx = optax.adam(1e-3)
    state = task.init_state(jax.random.key(0), tx)
    batches = [task.train_data.get(np.arange(i * 32, (i + 1) * 32)) for i in range(STEPS)]
    step = make_train_step(task, tx)
    return step, state, batches, run_single(step, state, batches)[0]


def _run(setup, weight_update, mesh_shape, **kw):
    step, state, batches, _ = setup
    dp = data_parallel(step, make_mesh(mesh_shape), weight_update=weight_update, min_shard_size=256, **kw)
    dp.prepare(state, batches[0])
    return run_parallel(dp, state, batches)[0], dp


def _rel(want, got):
    """Relative to one device's leaf, absolute below magnitude 1."""
    return relative_error(got, want, floor=1.0)


@pytest.mark.parametrize("weight_update", ["replicated", "sharded"])
def test_2d_sum_equals_1d_and_the_single_device_step(setup, weight_update):
    single = setup[3]
    one_d, _ = _run(setup, weight_update, (4, 2))
    outs = {}
    for chunks in (1, 4):
        outs[chunks], dp = _run(setup, weight_update, (4, 2), grad_sum="2d", grad_sum_chunks=chunks)
        phases = {(c.kind, c.axes) for c in dp.trace.collectives if c.why.startswith("gradient sum")}
        second = "all-reduce" if weight_update == "replicated" else "reduce-scatter"
        assert {("reduce-scatter", ("x",)), (second, ("y",))} <= phases
        assert all(c.chunks == chunks for c in dp.trace.collectives if c.axes in (("x",), ("y",)))
        assert not any(c.axes == ("x", "y") for c in dp.trace.collectives if c.why.startswith("gradient sum"))
    # The same summation order whatever the chunking: bit-identical.
    assert max_abs_diff(outs[1], outs[4]) == 0.0
    # Another order than one collective over all devices, and than one device: 1e-6 relative.
    assert _rel(one_d, outs[4]) <= 1e-6
    assert _rel(single.params, outs[4].params) <= 1e-6


@pytest.mark.parametrize("weight_update", ["replicated", "sharded"])
def test_the_2d_sum_sent_as_one_collective_is_the_1d_sum_over_both_axes(setup, weight_update):
    # grad_sum_phases="xla" (a TPU's default): XLA lays the phases over the torus; podscale sends one
    # collective over both axes, the 1-D sum's, in the 2-D order: the same arithmetic, bit for bit.
    one_d, _ = _run(setup, weight_update, (4, 2))
    two_d, dp = _run(setup, weight_update, (4, 2), grad_sum="2d", grad_sum_phases="xla")
    assert (dp.grad_sum.mode, dp.grad_sum.phases, dp.grad_sum.one_collective) == ("2d", "xla", True)
    sums = [c for c in dp.trace.collectives if c.why.startswith("gradient sum")]
    assert sums and all(c.axes == ("x", "y") for c in sums)
    assert max_abs_diff(one_d, two_d) == 0.0
    assert dp.grad_sum.order == ("x", "y")  # mesh order, as the 1-D sum's
    plan = dp.plan(setup[1], setup[2][0])
    assert plan.grad_sum["phases"] == "xla" and "one collective over x and y" in plan.grad_sum["reason"]
    # The knobs of podscale's own phases ask for them where the platform's default is one collective.
    costs = {"x": AxisCost(bandwidth=1e9, latency=1e-5), "y": AxisCost(bandwidth=1e11, latency=1e-6)}
    with pytest.raises(ValueError, match="axis_costs choose which axis podscale's own phases"):
        _run(setup, weight_update, (4, 2), grad_sum="2d", grad_sum_phases="xla", axis_costs=costs)


def test_small_sums_go_along_each_axis_in_turn_with_the_explicit_phases_and_as_one_collective_otherwise():
    """Batch statistics and per-layer norms (GradSum.by_axis): with podscale's explicit 2-D phases,
    an all-reduce along each axis (two short rings, where one collective over both axes would be
    one ring through the pod on paper 1's machine); where the 2-D sum is one collective, one."""
    from jax.sharding import PartitionSpec as P

    mesh = make_mesh((4, 2))
    x = jnp.arange(8 * 3, dtype=jnp.float32).reshape(8, 3)
    for phases, want in (("explicit", [("x",), ("y",)]), ("xla", [("x", "y")])):
        small = make_grad_sum(mesh, "2d", phases=phases).by_axis()
        records = []
        total = jax.shard_map(
            lambda v, s=small, r=records: s.all_reduce(v, r), mesh=mesh, in_specs=P(("x", "y")), out_specs=P()
        )(x)
        np.testing.assert_array_equal(total, x.sum(0, keepdims=True))
        assert [(c.kind, c.axes, c.chunks) for c in records] == [("all-reduce", a, 1) for a in want], phases


def test_lars_norms_of_chunks_go_along_each_axis_with_the_explicit_phases():
    """The sharded update's per-layer norm partials (LARS) are small sums too: along each axis in
    turn with the explicit 2-D phases, one collective over both axes with XLA's; both as one device."""
    task = make_task("mlp", "synthetic")
    tx = optax.lars(0.1)
    state = task.init_state(jax.random.key(0), tx)
    batches = [task.train_data.get(np.arange(i * 32, (i + 1) * 32)) for i in range(2)]
    step = make_train_step(task, tx)
    single = run_single(step, state, batches)[0]
    for phases, want in (("explicit", {("x",), ("y",)}), ("xla", {("x", "y")})):
        dp = data_parallel(
            step, make_mesh((4, 2)), weight_update="sharded", min_shard_size=256, grad_sum="2d", grad_sum_phases=phases
        )
        out = run_parallel(dp, state, batches)[0]
        norms = {c.axes for c in dp.trace.collectives if "norms" in c.why}
        assert norms == want, (phases, dp.trace.collectives)
        assert _rel(single.params, out.params) <= 1e-6


def test_sharded_update_on_the_2d_mesh_gathers_along_y_then_x(setup):
    _, dp = _run(setup, "sharded", (4, 2), grad_sum="2d")
    gathers = [c.axes for c in dp.trace.collectives if c.kind == "all-gather" and c.why == "updated weights"]
    assert gathers[:2] == [("y",), ("x",)]
    assert any(leaf.sharded for leaf in dp.layout.leaves)


def test_the_cheaper_axis_goes_first_and_the_plan_says_why(setup):
    step, state, batches, _ = setup
    costs = {"x": AxisCost(bandwidth=1e9, latency=1e-5), "y": AxisCost(bandwidth=1e11, latency=1e-6)}
    dp = data_parallel(step, make_mesh((4, 2)), grad_sum="2d", axis_costs=costs)
    assert dp.grad_sum.order == ("y", "x")
    plan = dp.plan(state, batches[0])
    assert plan.grad_sum["order"] == ["y", "x"] and "y first" in plan.grad_sum["reason"]
    assert any(
        tuple(c["axes"]) == ("y",) and c["kind"] == "reduce-scatter" and c["chunks"] == 4 for c in plan.collectives
    )
    # With equal costs the order is a tie, and the mesh order stays.
    same = {a: AxisCost(1e10, 1e-6) for a in "xy"}
    order, reason = choose_order(make_mesh((4, 2)), same, 2**24)
    assert order == ("x", "y") and "tie" in reason


def test_modelled_order_prefers_the_faster_link_for_the_long_phase():
    mesh = make_mesh((4, 2))
    fast_x = {"x": AxisCost(1e11, 1e-6), "y": AxisCost(1e9, 1e-6)}
    assert choose_order(mesh, fast_x, 2**24)[0] == ("x", "y")
    fast_y = {"x": AxisCost(1e9, 1e-6), "y": AxisCost(1e11, 1e-6)}
    assert choose_order(mesh, fast_y, 2**24)[0] == ("y", "x")


def test_calibration_measures_every_axis():
    costs = calibrate(make_mesh((4, 2)), small=2**10, large=2**16, repeats=2)
    assert set(costs) == {"x", "y"}
    assert all(c.bandwidth > 0 and c.latency >= 0 for c in costs.values())
    assert all(isinstance(c, gradsum_cost.AxisCost) for c in costs.values())


def test_the_cost_model_lives_in_perf_and_stays_importable_from_gradsum():
    for name in ("AxisCost", "modelled_seconds", "choose_order", "parse_axis_costs"):
        assert getattr(gradsum, name) is getattr(gradsum_cost, name)
        assert getattr(gradsum_cost, name).__module__ == "podscale.compiled.gradsum_cost"
    # x first: 2 reduce-scatter/all-gather rings of 4 on x, an all-reduce of 1/4 on y (one way).
    costs = {"x": AxisCost(1e9, 1e-6), "y": AxisCost(2e9, 1e-5)}
    rs_x = 3 / 4 * 2**20 / 1e9 + 3 * 1e-6
    ar_y = 2 * (1 / 2 * 2**18 / 2e9) + 2 * 1 * 1e-5
    assert gradsum_cost.modelled_seconds(("x", "y"), {"x": 4, "y": 2}, costs, 2**20) == pytest.approx(2 * rs_x + ar_y)


def test_bfloat16_summation_is_opt_in_and_close(setup):
    full, _ = _run(setup, "replicated", (4, 2), grad_sum="2d")
    low, dp = _run(setup, "replicated", (4, 2), grad_sum="2d", grad_sum_dtype=jnp.bfloat16)
    assert dp.grad_sum.dtype == jnp.bfloat16
    assert 0 < max_abs_diff(full.params, low.params) <= 1e-2  # rounding of the sums, in Adam's steps
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(low.params))
    sums = [c for c in dp.trace.collectives if c.kind == "reduce-scatter"]
    ref = [
        c for c in _run(setup, "replicated", (4, 2), grad_sum="2d")[1].trace.collectives if c.kind == "reduce-scatter"
    ]
    assert [c.bytes_per_device for c in sums] == [c.bytes_per_device // 2 for c in ref]


def test_bad_grad_sum_settings_say_what_to_do():
    mesh8 = make_mesh()
    with pytest.raises(
        ValueError, match=r"grad_sum='2d' needs a mesh with exactly two axes, got \{'data': 8\}.*make_mesh\(\(4, 2\)\)"
    ):
        make_grad_sum(mesh8, "2d")
    with pytest.raises(ValueError, match="grad_sum='ring': choose one of 1d, 2d"):
        make_grad_sum(mesh8, "ring")
    with pytest.raises(ValueError, match="grad_sum_chunks=4 pipelines the 2-D sum"):
        make_grad_sum(mesh8, "1d", chunks=4)
    with pytest.raises(ValueError, match="grad_sum_phases='xla' says how the 2-D gradient sum is sent"):
        make_grad_sum(mesh8, "1d", phases="xla")
    with pytest.raises(ValueError, match="grad_sum_chunks=4 pipelines podscale's own phases.*'explicit'"):
        make_grad_sum(make_mesh((4, 2)), "2d", chunks=4, phases="xla")
    with pytest.raises(ValueError, match="axis_costs choose which axis podscale's own phases"):
        make_grad_sum(make_mesh((4, 2)), "2d", axis_costs="calibrate", phases="xla")  # refused before measuring
    with pytest.raises(ValueError, match="grad_sum_phases='ring': choose one of xla, explicit"):
        make_grad_sum(make_mesh((4, 2)), "2d", phases="ring")
    with pytest.raises(ValueError, match="grad_sum_dtype must be a float type"):
        make_grad_sum(make_mesh((4, 2)), "2d", dtype=jnp.int32)
    with pytest.raises(ValueError, match="axis_costs has no entry for mesh axis 'y'"):
        make_grad_sum(make_mesh((4, 2)), "2d", axis_costs={"x": AxisCost(1e9, 1e-6)})
    with pytest.raises(ValueError, match="axis_costs='x=fast'"):
        parse_axis_costs("x=fast")
    for text in ("x=nan:1e-6,y=1:1", "x=inf:1e-6,y=1:1", "x=1:nan,y=1:1", "x=0:1,y=1:1", "x=1:-1,y=1:1"):
        with pytest.raises(ValueError, match="finite"):
            parse_axis_costs(text)
    with pytest.raises(ValueError, match="axis 'x' given twice"):
        parse_axis_costs("x=1:1,x=2:2,y=1:1")
    with pytest.raises(ValueError, match="at most 64 pipelined chunks"):
        make_grad_sum(make_mesh((4, 2)), "2d", chunks=65)
    with pytest.raises(ValueError, match=r"axis 'y' of mesh .* has one device.*make_mesh\(\(4, 2\)\)"):
        make_grad_sum(make_mesh((8, 1)), "2d")
    assert parse_axis_costs("x=1e11:1e-6,y=4.5e10:2e-6") == {"x": AxisCost(1e11, 1e-6), "y": AxisCost(4.5e10, 2e-6)}
