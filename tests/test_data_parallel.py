"""The data-parallel step against the plain single-device step."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import leaf_relative_error, max_abs_diff, run_parallel, run_single

from podscale import data_parallel, make_mesh
from podscale.compiled.gradsum_cost import AxisCost
from podscale.parallel.mesh import BN_GROUP
from podscale.train.tasks import make_task, make_train_step

STEPS = 10
GLOBAL_BATCH = 32


def _batches(task, n=STEPS, batch=GLOBAL_BATCH):
    return [task.train_data.get(np.arange(i * batch, (i + 1) * batch)) for i in range(n)]


CASES = [(m, o, (8,)) for m in ("mlp", "cnn", "transformer") for o in ("sgd", "adam")]
CASES += [("mlp", o, (4, 2)) for o in ("sgd", "adam")]  # a 2-D mesh: the batch is split over both axes


@pytest.mark.parametrize(("model", "optimizer", "mesh_shape"), CASES)
def test_equals_single_device_step(model, optimizer, mesh_shape):
    task = make_task(model, "synthetic", seed=0)
    # Adam normalises every element by its own RMS, so an element whose gradient is a near-total
    # cancellation (|g| ~ 1e-7 of a leaf whose largest element is ~1e-2) carries relative roundoff
    # that any change of summation order changes, and Adam turns it into an O(lr) step. At lr=1e-3
    # the CNN's worst element differed by 3e-4 after 10 steps (measured); at lr=3e-4 every
    # case here stays below 3e-7.
    tx = optax.sgd(0.1) if optimizer == "sgd" else optax.adam(3e-4)
    step = make_train_step(task, tx)
    state = task.init_state(jax.random.key(0), tx)
    batches = _batches(task)
    ref_state, ref_metrics = run_single(step, state, batches)
    dp = data_parallel(step, make_mesh(mesh_shape))
    par_state, par_metrics = run_parallel(dp, state, batches)
    assert max_abs_diff(ref_state.params, par_state.params) <= 1e-6
    assert max_abs_diff(ref_state.opt_state, par_state.opt_state) <= 1e-6
    assert int(par_state.step) == STEPS
    np.testing.assert_allclose(par_metrics["loss"], ref_metrics["loss"], rtol=1e-6)
    # The step really learned something, so equality is not the equality of two no-ops.
    assert max_abs_diff(state.params, par_state.params) > 1e-4


def test_gradient_is_mean_not_sum_over_replicas():
    """With check_vma, shard_map sums replicated parameters' gradients; podscale must average."""
    tx = optax.sgd(1.0)

    def step(params, batch):
        grads = jax.grad(lambda p: jnp.mean(batch["x"] * p))(params)
        return optax.apply_updates(params, tx.update(grads, tx.init(params))[0]), {}

    x = jnp.arange(16.0)
    dp = data_parallel(step, make_mesh())
    new, _ = dp(dp.place_state(jnp.float32(0.0)), {"x": x})
    assert float(new) == pytest.approx(-float(jnp.mean(x)), rel=1e-7)


def test_batch_norm_equals_batch_norm_over_the_whole_batch_on_one_device():
    """The default is what one device computes: statistics over the whole global batch."""
    task = make_task("resnet", "synthetic", seed=0)
    tx = optax.sgd(0.1)
    step = make_train_step(task, tx)
    state = task.init_state(jax.random.key(0), tx)
    batches = _batches(task, n=3, batch=16)
    dp = data_parallel(step, make_mesh())
    par_state, _ = run_parallel(dp, state, batches)
    whole, _ = run_single(step, state, batches)
    assert max_abs_diff(whole.params, par_state.params) <= 1e-6
    assert max_abs_diff(whole.batch_stats, par_state.batch_stats) <= 1e-6
    assert max_abs_diff(state.params, par_state.params) > 1e-4


def test_indivisible_batch_is_a_clear_error():
    task = make_task("mlp", "synthetic")
    tx = optax.sgd(0.1)
    dp = data_parallel(make_train_step(task, tx), make_mesh())
    state = dp.place_state(task.init_state(jax.random.key(0), tx))
    batch = task.train_data.get(np.arange(12))
    with pytest.raises(ValueError, match=r"batch\['image'\] has global batch size 12.*8 replicas.*multiple of 8"):
        dp(state, batch)


def test_an_integer_counted_over_the_batch_equals_one_device():
    def step(state, batch):
        return {"seen": state["seen"] + jnp.sum(batch["x"] > 0).astype(jnp.int32)}, {}

    dp = data_parallel(step, make_mesh())
    state = dp.place_state({"seen": jnp.int32(0)})
    x = jnp.arange(16.0) - 5.0
    new, _ = dp(state, {"x": x})
    assert int(new["seen"]) == 10


def test_metrics_are_global_means():
    def step(state, batch):
        return state, {"mean_x": jnp.mean(batch["x"])}

    dp = data_parallel(step, make_mesh())
    x = jnp.arange(32.0) ** 2
    _, metrics = dp(dp.place_state({"w": jnp.zeros(())}), {"x": x})
    assert float(metrics["mean_x"]) == pytest.approx(float(jnp.mean(x)), rel=1e-6)


def test_non_callable_step_and_bad_mesh():
    with pytest.raises(TypeError, match="step must be callable"):
        data_parallel(3, make_mesh())
    with pytest.raises(TypeError, match="jax.sharding.Mesh"):
        data_parallel(lambda s, b: (s, {}), "data")


def _mlp_loss(params, x, y):
    h = jnp.tanh(x @ params["w1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def _accumulating_step(params, batch):
    """Gradient accumulation over 2 microbatches with lax.scan: the gradient sums sit in a scan."""
    micro = jax.tree.map(lambda v: v.reshape(2, v.shape[0] // 2, *v.shape[1:]), batch)

    def body(acc, mb):
        return jax.tree.map(jnp.add, acc, jax.grad(_mlp_loss)(params, mb["x"], mb["y"])), None

    grads, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), micro)
    return jax.tree.map(lambda p, g: p - 0.1 * g / 2, params, grads), {}


def _remat_step(params, batch):
    grads = jax.grad(jax.checkpoint(_mlp_loss))(params, batch["x"], batch["y"])
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), {}


def _cond_step(params, batch):
    """The update inside lax.cond, the gradient inside a nested jit."""
    grads = jax.jit(jax.grad(_mlp_loss))(params, batch["x"], batch["y"])
    return jax.lax.cond(
        jnp.all(jnp.isfinite(grads["w1"])),
        lambda: jax.tree.map(lambda p, g: p - 0.1 * g, params, grads),
        lambda: params,
    ), {}


@pytest.mark.parametrize("step", [_accumulating_step, _remat_step, _cond_step], ids=lambda f: f.__name__)
def test_gradient_sums_inside_scan_remat_jit_and_cond(step):
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(k1, (6, 16)), "w2": jax.random.normal(k2, (16, 3))}
    batches = [
        {
            "x": jax.random.normal(jax.random.fold_in(k3, i), (32, 6)),
            "y": jax.random.normal(jax.random.fold_in(k4, i), (32, 3)),
        }
        for i in range(5)
    ]
    ref, _ = run_single(step, params, batches)
    dp = data_parallel(step, make_mesh())
    par, _ = run_parallel(dp, params, batches)
    assert max_abs_diff(ref, par) <= 1e-6
    assert max_abs_diff(params, par) > 1e-3
    # Microbatches of the split rows stay split (each replica's rows of each microbatch): no op
    # runs on the whole batch.
    assert dp.plan(params, batches[0]).whole_ops == []


@pytest.mark.parametrize("microbatches, rows", [(8, 64), (2, 32)], ids=["exchanged", "gathered"])
def test_microbatches_scanned_over_stay_split(microbatches, rows):
    """``k`` microbatches of a global batch reshaped ``[k, rows / k]`` and scanned over. Where the
    replicas divide both (8 of 8 rows on 8 replicas), each replica's rows, a whole microbatch,
    are exchanged (an all-to-all) for its rows of every microbatch; where they divide only the
    microbatch (2 of 16 rows: a replica's 4 rows are a quarter of one), the rows are gathered
    and each replica keeps its block of each microbatch. Either way the work stays split and equals
    one device."""

    def step(params, batch):
        micro = jax.tree.map(lambda v: v.reshape(microbatches, -1, *v.shape[1:]), batch)

        def body(acc, mb):
            return jax.tree.map(jnp.add, acc, jax.grad(_mlp_loss)(params, mb["x"], mb["y"])), None

        grads, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), micro)
        return jax.tree.map(lambda p, g: p - 0.1 * g / microbatches, params, grads), {}

    k1, k2, k3 = jax.random.split(jax.random.key(2), 3)
    params = {"w1": jax.random.normal(k1, (6, 16)), "w2": jax.random.normal(k2, (16, 3))}
    batches = [
        {"x": jax.random.normal(jax.random.fold_in(k3, i), (rows, 6)), "y": jnp.full((rows, 3), 0.5)} for i in range(2)
    ]
    dp = data_parallel(step, make_mesh())
    ref, _ = run_single(step, params, batches)
    par, _ = run_parallel(dp, params, batches)
    assert max_abs_diff(ref, par) <= 1e-6
    plan = dp.plan(params, batches[0])
    assert plan.whole_ops == []
    exchanged = [c for c in plan.collectives if c["kind"] == "all-to-all"]
    assert len(exchanged) == (2 if microbatches == 8 else 0), plan.collectives  # x and y


def test_a_map_over_examples_is_not_exchanged_as_microbatches():
    """``lax.map`` over the batch's rows scans its dimension 0, which is no microbatch: it is run
    on the gathered rows as before (no all-to-all splitting the features, which would sum every
    example's products over the replicas, one all-reduce per example), equal to one device."""

    def step(params, batch):
        def loss(w):
            per = jax.lax.map(lambda x: jnp.sum(jnp.tanh(x @ w) ** 2), batch["x"])
            return jnp.mean(per)

        return {"w": params["w"] - 0.1 * jax.grad(loss)(params["w"])}, {}

    params = {"w": jax.random.normal(jax.random.key(3), (16, 8))}
    batches = [{"x": jax.random.normal(jax.random.key(4 + i), (32, 16))} for i in range(2)]
    dp = data_parallel(step, make_mesh())
    ref, _ = run_single(step, params, batches)
    par, _ = run_parallel(dp, params, batches)
    assert max_abs_diff(ref, par) == 0.0
    plan = dp.plan(params, batches[0])
    assert not [c for c in plan.collectives if c["kind"] == "all-to-all" or c["runs"] > 1], plan.collectives


def test_optax_multisteps_accumulates_like_one_device():
    tx = optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2)

    def step(state, batch):
        params, opt_state = state
        grads = jax.grad(_mlp_loss)(params, batch["x"], batch["y"])
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {}

    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    params = {"w1": jax.random.normal(k1, (6, 16)), "w2": jax.random.normal(k2, (16, 3))}
    batches = [{"x": jax.random.normal(jax.random.fold_in(k3, i), (32, 6)), "y": jnp.ones((32, 3))} for i in range(6)]
    ref, _ = run_single(step, (params, tx.init(params)), batches)
    par, _ = run_parallel(data_parallel(step, make_mesh()), (params, tx.init(params)), batches)
    assert max_abs_diff(ref, par) <= 1e-6


def test_remat_keeps_its_optimization_barrier():
    """Rebuilding jax.checkpoint (rather than inlining it) keeps the recomputation a recomputation."""
    params = {"w1": jnp.ones((6, 16)), "w2": jnp.ones((16, 3))}
    batch = {"x": jnp.ones((32, 6)), "y": jnp.ones((32, 3))}
    dp = data_parallel(_remat_step, make_mesh(), donate_state=False)
    assert "optimization_barrier" in dp.lower(dp.place_state(params), batch).as_text()


def test_typed_prng_keys_in_the_state_round_trip():
    dp = data_parallel(lambda s, b: (s, {}), make_mesh())
    state = {"rng": jax.random.key(3), "w": jnp.ones(2)}
    placed = dp.place_state(state)
    back = dp.gather_state(placed)
    np.testing.assert_array_equal(jax.random.key_data(back["rng"]), jax.random.key_data(state["rng"]))


class _BNNet(nn.Module):
    bn_axis: str | None

    @nn.compact
    def __call__(self, x, train):
        x = nn.BatchNorm(use_running_average=not train, axis_name=self.bn_axis, momentum=0.9)(nn.Dense(16)(x))
        return nn.Dense(3)(nn.relu(x))


def _bn_step(model, tx):
    def step(state, batch):
        params, stats, opt = state

        def loss(p):
            out, upd = model.apply({"params": p, "batch_stats": stats}, batch["x"], True, mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(out, batch["y"]).mean(), upd["batch_stats"]

        (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), stats, opt), {"loss": value}

    return step


@pytest.mark.parametrize(
    "weight_update, grad_sum",
    [
        ("replicated", "1d"),
        ("sharded", "1d"),
        ("fsdp", "1d"),
        ("replicated", "2d"),
        ("sharded", "2d"),
        ("fsdp", "2d"),
        ("sharded", "2d, y first"),
    ],
)
def test_batch_norm_over_groups_of_replicas_equals_batch_norm_over_each_groups_batch(weight_update, grad_sum):
    """bn_group_size=4 on 8 replicas: two groups, each normalizing over its 4 replicas' rows. With
    the 2-D sum on a 2x4 mesh, the group axis joins the axis it was split from: the phases run
    over ``x`` and over ``(y, bn_group)``, in either order (axis costs that make ``y`` first: the
    sharded update's chunks then ordered ``(y, bn_group, x)``)."""
    tx = optax.sgd(0.1)
    x = jax.random.normal(jax.random.key(1), (64, 5))
    batch = {"x": x, "y": jnp.arange(64) % 3}
    variables = _BNNet(None).init(jax.random.key(0), x[:2], False)
    state = (variables["params"], variables["batch_stats"], tx.init(variables["params"]))
    mesh = make_mesh(None if grad_sum == "1d" else (2, 4), bn_group_size=4)
    first = grad_sum == "2d, y first"  # y's links cheaper: its phase goes first
    costs = {"axis_costs": {"x": AxisCost(1e9, 1e-3), "y": AxisCost(1e12, 1e-6)}} if first else {}
    dp = data_parallel(
        _bn_step(_BNNet(BN_GROUP), tx),
        mesh,
        weight_update=weight_update,
        grad_sum=grad_sum[:2],
        min_shard_size=1,
        **costs,
    )
    dp.prepare(state, batch)
    if grad_sum != "1d":
        expected = (("y", BN_GROUP), ("x",)) if first else (("x",), ("y", BN_GROUP))
        assert dp.grad_sum.groups == expected, dp.grad_sum
        phases = {tuple(c["axes"]) for c in dp.plan(state, batch).collectives if c["update"]}
        assert phases >= {("x",), ("y", BN_GROUP)}, phases
    (params, stats, _), metrics = run_parallel(dp, state, [batch])

    # One device: the plain model (no collectives) on each group's 32 rows, losses averaged.
    plain = _BNNet(None)

    def group_loss(p, rows):
        out, upd = plain.apply(
            {"params": p, "batch_stats": variables["batch_stats"]}, x[rows], True, mutable=["batch_stats"]
        )
        return optax.softmax_cross_entropy_with_integer_labels(out, batch["y"][rows]).mean(), upd["batch_stats"]

    groups = [slice(0, 32), slice(32, 64)]

    @jax.jit  # one program (op by op, each of the model's ops would compile on its own)
    def reference(p):
        ref_loss = jnp.mean(jnp.stack([group_loss(p, g)[0] for g in groups]))
        grads = jax.grad(lambda p: jnp.mean(jnp.stack([group_loss(p, g)[0] for g in groups])))(p)
        ref_params = optax.apply_updates(p, tx.update(grads, tx.init(p))[0])
        ref_stats = jax.tree.map(lambda *s: jnp.mean(jnp.stack(s), 0), *[group_loss(p, g)[1] for g in groups])
        return ref_loss, ref_params, ref_stats

    ref_loss, ref_params, ref_stats = reference(variables["params"])
    np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=1e-6)
    assert max_abs_diff(ref_params, params) <= 1e-6
    assert max_abs_diff(ref_stats, stats) <= 1e-6  # stored statistics: the mean over groups


def test_batch_norm_over_groups_inside_remat_equals_it_outside():
    tx = optax.sgd(0.1)
    model = _BNNet(BN_GROUP)
    x = jax.random.normal(jax.random.key(1), (64, 5))
    batch = {"x": x, "y": jnp.arange(64) % 3}
    variables = _BNNet(None).init(jax.random.key(0), x[:2], False)

    def step(state, batch):
        params, stats, opt = state

        @jax.checkpoint
        def loss(p):
            out, upd = model.apply({"params": p, "batch_stats": stats}, batch["x"], True, mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(out, batch["y"]).mean(), upd["batch_stats"]

        (_, stats), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), stats, opt), {}

    state = (variables["params"], variables["batch_stats"], tx.init(variables["params"]))
    inside, _ = run_parallel(data_parallel(step, make_mesh(bn_group_size=4)), state, [batch])
    outside, _ = run_parallel(data_parallel(_bn_step(model, tx), make_mesh(bn_group_size=4)), state, [batch])
    assert max_abs_diff(inside, outside) <= 1e-6
    assert max_abs_diff(inside[0], state[0]) > 1e-4


def test_group_statistics_meeting_an_op_without_a_rule_are_refused_not_wrong():
    """A group's statistic joined to the whole batch (concatenated along it) has no per-group
    meaning podscale could compute: refused before running, naming the op."""

    def step(w, batch):
        def loss(w):
            h = batch["x"] @ w
            mean = jax.lax.pmean(jnp.mean(h, axis=0), BN_GROUP)  # the group's statistic
            return jnp.mean(jnp.concatenate([h, mean[None]], axis=0) ** 2)

        return w - 0.1 * jax.grad(loss)(w), {}

    dp = data_parallel(step, make_mesh(bn_group_size=4))
    batch = {"x": jax.random.normal(jax.random.key(1), (64, 5))}
    with pytest.raises(NotImplementedError, match="concatenate.*batch-norm group statistics"):
        dp.place_state(jnp.ones((5, 3)), batch)


def _least_squares_step(tx):
    def step(state, batch):
        params, opt = state

        def loss(p):
            pred = jax.lax.conv_general_dilated(
                batch["x"], p["k"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
            ).mean((1, 2))
            return jnp.mean((pred @ p["w"] - batch["y"]) ** 2)

        loss_value, grads = jax.value_and_grad(loss)(params)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), {"loss": loss_value}

    return step


def _rows_batch(rng, rows: int, height: int = 8):
    return {
        "x": rng.normal(size=(rows, height, height, 2)).astype(np.float32),
        "y": rng.normal(size=(rows, 3)).astype(np.float32),
    }


# Any sequence of global batch sizes (and image sizes) that one device takes: each new signature is
# traced and partitioned anew, as jax.jit retraces; a size seen before reuses its program.
SIZE_SEQUENCES = [((16, 8), (32, 8)), ((32, 8), (16, 8)), ((16, 8), (24, 8), (16, 8)), ((8, 8), (8, 12), (16, 4))]


@pytest.mark.parametrize("sizes", SIZE_SEQUENCES, ids=lambda s: "-".join(f"{n}x{h}" for n, h in s))
@pytest.mark.parametrize(("mesh_shape", "options"), [((8,), {}), ((4, 2), {"spatial": 2})], ids=["dp", "spatial"])
@pytest.mark.parametrize("weight_update", ["replicated", "sharded"])
def test_a_step_called_with_another_global_batch_size_retraces(sizes, mesh_shape, options, weight_update):
    tx = optax.sgd(0.1, momentum=0.9)
    step = _least_squares_step(tx)
    params = {"k": jnp.full((3, 3, 2, 4), 0.1), "w": jnp.ones((4, 3)) / 4}
    state = (params, tx.init(params))
    rng = np.random.default_rng(0)
    batches = [_rows_batch(rng, n, h) for n, h in sizes]
    dp = data_parallel(step, make_mesh(mesh_shape), weight_update=weight_update, min_shard_size=4, **options)
    got_state, got_metrics = run_parallel(dp, state, batches)
    want_state, want_metrics = run_single(step, state, batches)
    assert leaf_relative_error(got_state, want_state) < 1e-6
    assert leaf_relative_error(got_metrics, want_metrics) < 1e-6
    assert len(dp.programs()) == len(set(sizes))  # one program per signature, reused when it comes back
