"""The single-device step on the global batch is the specification: steps that are not a plain
batch-mean loss, and forms JAX programs take, each checked against one device."""

import flax.linen as nn
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from helpers import max_abs_diff, max_relative_diff, relative_error, run_parallel, run_single

from podscale import data_parallel, make_mesh

TOL = 1e-6


def _rel(a, b) -> float:
    """Relative to each leaf's largest magnitude, absolute below 0.1: the biases start at zero and
    stay small, so their roundoff is the weights' (this was relative to the whole tree's largest
    value, about 0.6, before the suite had one relative error)."""
    return relative_error(a, b, floor=0.1)


def _data(i, n=32, d=6, classes=4, pad_every=3):
    k = jax.random.fold_in(jax.random.key(7), i)
    kx, ky = jax.random.split(k)
    return {
        "x": jax.random.normal(kx, (n, d)),
        "y": jax.random.randint(ky, (n,), 0, classes),
        "mask": (jnp.arange(n) % pad_every != 0).astype(jnp.float32),  # padding rows weigh 0
    }


def _params(d=6, h=16, classes=4):
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w1": jax.random.normal(k1, (d, h)) * 0.5, "w2": jax.random.normal(k2, (h, classes)) * 0.5}


def _logits(p, x):
    return jnp.tanh(x @ p["w1"]) @ p["w2"]


def _count_normalised_loss(p, b):
    """Cross-entropy over the non-padding rows divided by their number (flax's examples)."""
    ce = optax.softmax_cross_entropy_with_integer_labels(_logits(p, b["x"]), b["y"])
    return jnp.sum(ce * b["mask"]) / jnp.sum(b["mask"])


def _sgd_step(loss_fn, lr=0.1):
    def step(params, batch):
        loss, g = jax.value_and_grad(loss_fn)(params, batch)
        return jax.tree.map(lambda p, g: p - lr * g, params, g), {"loss": loss}

    return step


def _check(step, state, n_steps=4, mesh=None, **kw):
    batches = [_data(i) for i in range(n_steps)]
    ref, ref_m = run_single(step, state, batches)
    par, par_m = run_parallel(data_parallel(step, mesh or make_mesh(), **kw), state, batches)
    assert _rel(par, ref) <= TOL, _rel(par, ref)
    assert max_abs_diff(ref, state) > 1e-4  # the step learned something
    return par_m, ref_m


@pytest.mark.parametrize("weight_update", ["replicated", "sharded"])
def test_a_loss_normalised_by_a_count_from_the_batch(weight_update):
    _check(_sgd_step(_count_normalised_loss), _params(), weight_update=weight_update, min_shard_size=1)


def test_a_sum_loss():
    def loss(p, b):
        return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(_logits(p, b["x"]), b["y"]))

    _check(_sgd_step(loss, lr=0.005), _params())


def test_per_example_clipped_gradients():
    """vmap of grad, each example's gradient clipped to norm 1, then summed (DP-SGD's core)."""

    def step(params, batch):
        def one(p, x, y):
            return optax.softmax_cross_entropy_with_integer_labels(_logits(p, x[None]), y[None])[0]

        per = jax.vmap(jax.grad(one), in_axes=(None, 0, 0))(params, batch["x"], batch["y"])
        norms = jnp.sqrt(sum(jnp.sum(g.reshape(g.shape[0], -1) ** 2, axis=1) for g in jax.tree.leaves(per)))
        scale = jnp.minimum(1.0, 1.0 / (norms + 1e-6))
        g = jax.tree.map(lambda g: jnp.tensordot(scale, g, axes=1) / batch["x"].shape[0], per)
        return jax.tree.map(lambda p, g: p - 0.5 * g, params, g), {"clipped": jnp.mean(scale < 1)}

    _check(step, _params())


def test_dpsgd_from_optax_contrib():
    tx = optax.contrib.dpsgd(learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=0.0, seed=0)

    def step(state, batch):
        params, opt = state

        def one(p, x, y):
            return optax.softmax_cross_entropy_with_integer_labels(_logits(p, x[None]), y[None])[0]

        per = jax.vmap(jax.grad(one), in_axes=(None, 0, 0))(params, batch["x"], batch["y"])
        updates, opt = tx.update(per, opt, params)
        return (optax.apply_updates(params, updates), opt), {}

    params = _params()
    _check(step, (params, tx.init(params)))


def test_an_optimizer_reading_the_loss():
    tx = optax.polyak_sgd(max_learning_rate=0.5)

    def step(state, batch):
        params, opt = state
        loss, g = jax.value_and_grad(_count_normalised_loss)(params, batch)
        updates, opt = tx.update(g, opt, params, value=loss)
        return (optax.apply_updates(params, updates), opt), {"loss": loss}

    params = _params()
    _check(step, (params, tx.init(params)))


def test_a_flax_train_state_with_its_python_int_step():
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(nn.tanh(nn.Dense(16)(x)))

    model = MLP()
    ts = train_state.TrainState.create(
        apply_fn=model.apply, params=model.init(jax.random.key(0), jnp.ones((1, 6)))["params"], tx=optax.adam(1e-2)
    )
    assert isinstance(ts.step, int)

    def step(state, batch):
        def loss(p):
            ce = optax.softmax_cross_entropy_with_integer_labels(state.apply_fn({"params": p}, batch["x"]), batch["y"])
            return jnp.sum(ce * batch["mask"]) / jnp.sum(batch["mask"])

        value, grads = jax.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads=grads), {"loss": value}

    batches = [_data(i) for i in range(4)]
    ref, _ = run_single(step, ts, batches)
    for weight_update in ("replicated", "sharded"):
        dp = data_parallel(step, make_mesh(), weight_update=weight_update, min_shard_size=1)
        placed = dp.place_state(ts, batches[0])
        for b in batches:
            placed, _ = dp(placed, b)
        assert int(placed.step) == 4
        assert _rel(dp.gather_state(placed).params, ref.params) <= TOL


def test_a_flax_nnx_optimizer_step():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(6, 16, rngs=rngs)
            self.b = nnx.Linear(16, 4, rngs=rngs)

        def __call__(self, x):
            return self.b(jnp.tanh(self.a(x)))

    model = Net(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)

        def loss(m):
            ce = optax.softmax_cross_entropy_with_integer_labels(m(batch["x"]), batch["y"])
            return jnp.sum(ce * batch["mask"]) / jnp.sum(batch["mask"])

        value, grads = nnx.value_and_grad(loss)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), {"loss": value}

    _check(step, state)


def test_typed_prng_keys_in_the_state_and_plan():
    def step(state, batch):
        key, sub = jax.random.split(state["key"])
        noise = jax.random.normal(sub, state["w"].shape) * 1e-3
        g = jax.grad(lambda w: _count_normalised_loss({"w1": w, "w2": state["w2"]}, batch))(state["w"])
        return {"key": key, "w": state["w"] - 0.1 * g + noise, "w2": state["w2"]}, {}

    p = _params()
    state = {"key": jax.random.key(3), "w": p["w1"], "w2": p["w2"]}
    _check(step, state)
    dp = data_parallel(step, make_mesh(), weight_update="sharded", min_shard_size=1)
    plan = dp.plan(state, _data(0))
    assert any(leaf["path"] == "['key']" and not leaf["sharded"] for leaf in plan.leaves)


class _DropoutNet(nn.Module):
    @nn.compact
    def __call__(self, x, key):
        h = nn.Dropout(0.5, deterministic=False)(nn.Dense(16)(x), rng=key)
        return nn.Dense(4)(jnp.tanh(h)), h


def test_dropout_masks_equal_one_devices():
    model = _DropoutNet()
    params = model.init(jax.random.key(0), jnp.ones((1, 6)), jax.random.key(1))["params"]

    def step(state, batch):
        params, key = state
        key, sub = jax.random.split(key)

        def loss(p):
            out, h = model.apply({"params": p}, batch["x"], sub)
            ce = optax.softmax_cross_entropy_with_integer_labels(out, batch["y"])
            return jnp.mean(ce), h

        (value, h), g = jax.value_and_grad(loss, has_aux=True)(params)
        return (jax.tree.map(lambda p, g: p - 0.1 * g, params, g), key), {"dropped": h == 0}

    par_m, ref_m = _check(step, (params, jax.random.key(5)))
    np.testing.assert_array_equal(par_m["dropped"], ref_m["dropped"])  # the same mask, row for row
    assert 0.3 < float(np.mean(ref_m["dropped"])) < 0.7


def test_nn_scan_layers():
    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            return jnp.tanh(nn.Dense(16)(h)) + h, None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(16)(x)
            h, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)()(h, None)
            return nn.Dense(4)(h)

    model = Stack()
    params = model.init(jax.random.key(0), jnp.ones((1, 6)))["params"]

    def loss(p, b):
        ce = optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, b["x"]), b["y"])
        return jnp.sum(ce * b["mask"]) / jnp.sum(b["mask"])

    _check(_sgd_step(loss), params)


def test_an_rnn_over_time_sums_each_weights_gradient_once():
    """A recurrent kernel used at every time step: one sum for its gradient, after the loop."""
    k = jax.random.split(jax.random.key(2), 3)
    params = {
        "wx": jax.random.normal(k[0], (6, 8)) * 0.3,
        "wh": jax.random.normal(k[1], (8, 8)) * 0.3,
        "out": jax.random.normal(k[2], (8, 4)) * 0.3,
    }

    def loss(p, b):
        xs = jnp.stack([b["x"] * (t + 1) / 5 for t in range(5)])  # [time, batch, features]

        def cell(h, x):
            h = jnp.tanh(x @ p["wx"] + h @ p["wh"])
            return h, h

        h, _ = jax.lax.scan(cell, jnp.zeros((b["x"].shape[0], 8)), xs)
        ce = optax.softmax_cross_entropy_with_integer_labels(h @ p["out"], b["y"])
        return jnp.sum(ce * b["mask"]) / jnp.sum(b["mask"])

    step = _sgd_step(loss)
    _check(step, params)
    dp = data_parallel(step, make_mesh())
    text = dp.lower(dp.place_state(params), _data(0)).compile().as_text()
    assert "while" in text  # the scan stays a loop
    gradient_sums = [c for c in dp.trace.collectives if c.why.startswith("gradient sum")]
    assert sum(c.tensors for c in gradient_sums) <= 4  # wx, wh, out and the loss's sums, each once


def test_a_step_that_calls_pmean_is_refused_before_running():
    def step(params, batch):
        g = jax.grad(_count_normalised_loss)(params, batch)
        g = jax.lax.pmean(g, "data")
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, g), {}

    dp = data_parallel(step, make_mesh())
    with pytest.raises(ValueError, match="collective over a named axis.*remove lax.pmean"):
        dp.place_state(_params(), _data(0))


def test_ragged_batch_leaves_are_refused():
    dp = data_parallel(_sgd_step(_count_normalised_loss), make_mesh())
    batch = dict(_data(0), extra=jnp.ones((8, 2)))
    with pytest.raises(ValueError, match=r"batch\['extra'\] has 8.*same leading batch size"):
        dp.place_state(_params(), batch)


def test_a_per_example_metric_comes_back_whole():
    def step(params, batch):
        return params, {"probs": jax.nn.softmax(_logits(params, batch["x"]))}

    dp = data_parallel(step, make_mesh())
    _, metrics = dp(dp.place_state(_params()), _data(0))
    ref = jax.nn.softmax(_logits(_params(), _data(0)["x"]))
    assert metrics["probs"].shape == (32, 4)
    np.testing.assert_allclose(metrics["probs"], ref, rtol=1e-6)


def test_the_step_that_used_to_hang():
    """A nonlinear function of the whole gradient (its squared norm) in the update."""

    def step(w, batch):
        g = jax.grad(lambda w: jnp.mean((batch["x"] @ w) ** 2))(w)
        return w - 0.1 * g - 0.01 * jnp.sum(g.reshape(-1) ** 2), {}

    w = jax.random.normal(jax.random.key(0), (6, 3)) * 0.3
    _check(step, w)


def test_strict_refuses_before_running_and_keeps_the_state():
    def step(params, batch):
        order = jnp.argsort(batch["x"][:, 0])  # a sort over the batch: whole values
        g = jax.grad(_count_normalised_loss)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, g), {"first": order[0]}

    dp = data_parallel(step, make_mesh(), strict=True)
    state = dp.place_state(_params(), _data(0))
    with pytest.raises(ValueError, match="strict=True: refused before running.*sort"):
        dp(state, _data(0))
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))  # not donated away
    relaxed = data_parallel(step, make_mesh())
    relaxed(relaxed.place_state(_params()), _data(0))
    assert any("sort" in op for op in relaxed.trace.whole_ops)


@pytest.mark.parametrize("mesh_shape", [None, (4, 2)])
def test_random_draws_with_the_batch_rows_are_the_single_devices_bits(mesh_shape):
    """Drawn for the local rows only (no whole draw per replica), bit for bit one device's."""

    def step(key, batch):
        k1, k2, k3 = jax.random.split(key, 3)
        rows = batch["x"].shape[0]
        draws = {
            "mask": jax.random.bernoulli(k1, 0.5, (rows, 3, 5)) * batch["x"][:, :1, None],
            "uniform": jax.random.uniform(k2, (rows, 7)) + batch["x"][:, :1],
            "normal": jax.random.normal(k3, (rows,), jnp.bfloat16),
            "bits": jax.random.bits(k3, (rows, 2), jnp.uint8),
        }
        return jax.random.fold_in(key, 1), draws

    key, batch = jax.random.key(4), {"x": jnp.ones((64, 3))}
    ref = jax.jit(step)(key, batch)[1]
    dp = data_parallel(step, make_mesh(mesh_shape))
    got = dp(dp.place_state(key), batch)[1]
    for name in ref:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(ref[name]), err_msg=name)
    assert dp.trace.whole_ops == []


def test_independent_random_streams_are_opt_in_and_differ_from_one_device():
    def step(key, batch):
        return key, {"mask": jax.random.bernoulli(key, 0.5, (batch["x"].shape[0], 64))}

    key, batch = jax.random.key(4), {"x": jnp.ones((64, 3))}
    ref = np.asarray(jax.jit(step)(key, batch)[1]["mask"])
    dp = data_parallel(step, make_mesh(), rng="independent")
    got = np.asarray(dp(dp.place_state(key), batch)[1]["mask"])
    assert (got != ref).mean() > 0.3  # other bits ...
    rows = got.reshape(8, 8, 64)
    assert all((rows[i] != rows[0]).any() for i in range(1, 8))  # ... and a stream per replica
    assert 0.4 < got.mean() < 0.6
    with pytest.raises(ValueError, match="rng='shared'"):
        data_parallel(step, make_mesh(), rng="shared")


def test_a_depthwise_convolution_runs_on_the_local_rows():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Conv(8, (3, 3))(x)
            x = nn.Conv(8, (3, 3), feature_group_count=8)(nn.relu(x))  # depthwise
            return nn.Dense(4)(x.mean((1, 2)))

    model = Net()
    params = model.init(jax.random.key(0), jnp.zeros((1, 6, 6, 3)))["params"]

    def loss(p, b):
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, b["img"]), b["y"]))

    def batch(i):
        k = jax.random.fold_in(jax.random.key(3), i)
        return {"img": jax.random.normal(k, (32, 6, 6, 3)), "y": jnp.arange(32) % 4}

    step = _sgd_step(loss)
    batches = [batch(i) for i in range(3)]
    ref, _ = run_single(step, params, batches)
    dp = data_parallel(step, make_mesh())
    par, _ = run_parallel(dp, params, batches)
    assert _rel(par, ref) <= TOL
    # Only the depthwise kernel's gradient (a convolution grouped over the batch) is made whole.
    assert all(op.startswith("conv_general_dilated") for op in dp.trace.whole_ops) and len(dp.trace.whole_ops) == 1


# -- reductions over the split batch in a 16-bit type --------------------------------------------
# One device rounds such a sum once, after adding every row. Each replica's partial is summed in
# float32 and rounded once after the sum over the replicas: one device's rounding, up to order.


def _loss_scaled_f16_step(lr=2.0**-10):
    """A float16 step with a dynamic loss scale: a step whose gradient is not finite is skipped
    and the scale halved (as optax's or flax's dynamic scale does). The weights may be float32
    master weights, cast to float16 for the product."""

    def step(state, batch):
        params, scale = state

        def loss_fn(p):
            out = (batch["x"] @ p["w"].astype(jnp.float16)).astype(jnp.float32)[:, 0]
            return jnp.sum(out * batch["g"]) * scale

        g = jax.grad(loss_fn)(params)
        g = jax.tree.map(lambda x: x / scale.astype(x.dtype), g)
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(g)]))
        new = jax.tree.map(lambda p, x: jnp.where(finite, p - jnp.asarray(lr, p.dtype) * x, p), params, g)
        return (new, jnp.where(finite, scale, scale / 2)), {"finite": finite, "w_grad": g["w"]}

    return step


def _f16_batch(row_values):
    n = len(row_values)
    return {"x": jnp.asarray(row_values, jnp.float16)[:, None] * jnp.ones((n, 2), jnp.float16), "g": jnp.ones((n,))}


@pytest.mark.parametrize(
    "rows",
    [
        # every replica's 4 rows sum to ±80,000 (over float16's 65,504); the whole batch sums to 0
        ([20000.0] * 4 + [-20000.0] * 4) * 4,
        # every replica's partial is finite (20,000); the whole batch's 160,000 is not
        [5000.0] * 32,
    ],
    ids=["partials overflow, the sum does not", "the sum overflows, the partials do not"],
)
@pytest.mark.parametrize("weight_update", ["replicated", "sharded"])
@pytest.mark.parametrize("master", [jnp.float16, jnp.float32], ids=["float16 weight", "float32 weight cast"])
def test_a_float16_gradient_sum_overflows_where_one_device_s_does(rows, weight_update, master):
    """Whatever the program casts the product's gradient to afterwards (a float32 master weight's
    type), one device's sum over the rows is of the product's type: float16, and it overflows."""
    step, batch = _loss_scaled_f16_step(), _f16_batch(rows)
    state = ({"w": jnp.ones((2, 1), master)}, jnp.asarray(1.0))
    ref, ref_m = run_single(step, state, [batch])
    par, par_m = run_parallel(
        data_parallel(step, make_mesh(), weight_update=weight_update, min_shard_size=1), state, [batch]
    )
    assert bool(par_m["finite"]) == bool(ref_m["finite"])
    np.testing.assert_array_equal(np.asarray(par_m["w_grad"]), np.asarray(ref_m["w_grad"]))
    assert max_abs_diff(par, ref) == 0.0


@pytest.mark.parametrize("weight_update", ["replicated", "sharded"])
def test_flax_dynamic_loss_scale_over_float32_master_weights_skips_the_steps_one_device_skips(weight_update):
    """flax's DynamicScale over float32 weights cast to float16 for the product, 8 steps of rows
    whose scaled gradient overflows float16 on some steps: the same steps are skipped, the scale
    follows the same path, and the weights end equal."""
    from flax.training.dynamic_scale import DynamicScale

    def step(state, batch):
        params, dyn = state

        def loss_fn(p):
            out = batch["x"].astype(jnp.float16) @ p["w"].astype(jnp.float16) + p["b"].astype(jnp.float16)
            return jnp.sum(out.astype(jnp.float32)) / batch["x"].shape[0]

        dyn, finite, loss, g = dyn.value_and_grad(loss_fn)(params)
        new = jax.tree.map(lambda p, g: jnp.where(finite, p - 2.0**-12 * g, p), params, g)
        return (new, dyn), {"finite": finite, "scale": dyn.scale, "loss": loss}

    state = ({"w": jnp.ones((2, 3)), "b": jnp.zeros((3,))}, DynamicScale(growth_interval=2, scale=2.0**14))
    batches = [{"x": jnp.full((32, 2), 3000.0 if i % 3 == 0 else 1.0)} for i in range(8)]
    jstep = jax.jit(step)
    dp = data_parallel(step, make_mesh(), weight_update=weight_update, min_shard_size=1)
    ref, par = state, dp.place_state(state, batches[0])
    for batch in batches:
        ref, ref_m = jstep(ref, batch)
        par, par_m = dp(par, batch)
        assert bool(par_m["finite"]) == bool(ref_m["finite"]) and float(par_m["scale"]) == float(ref_m["scale"])
    assert not all(bool(jstep(state, b)[1]["finite"]) for b in batches[:1])  # the first step overflows
    assert max_abs_diff(dp.gather_state(par), jax.device_get(ref)) == 0.0


def _ulps_apart(a, b):
    """Per element, how many steps of a 16-bit type ``a`` and ``b`` are apart."""
    a, b = (np.asarray(x).view(np.int16).astype(np.int64) for x in (a, b))
    a, b = (np.where(x < 0, -(x & 0x7FFF), x) for x in (a, b))  # sign-magnitude to a number line
    return np.abs(a - b)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("weight_update", ["replicated", "sharded"])
@pytest.mark.parametrize("master", [False, True], ids=["16-bit weight", "float32 weight cast"])
def test_16_bit_weight_gradients_are_rounded_once(dtype, weight_update, master):
    """A 16-bit layer's weight gradient, a sum over 256 rows on 8 replicas: one device rounds
    the sum once, to the product's type, also where the weight is a float32 master weight cast to
    16 bits for the product (its gradient the 16-bit sum, widened). Rounding each replica's share
    first put most elements several steps of the type away from one device's; not rounding at all
    (a float32 sum for a float32 weight) put them 2.1e-3 off; rounded once, they differ only where
    float32 summation order moves a sum across a rounding boundary (one step, rarely)."""

    def step(params, batch):
        def loss_fn(p):
            return jnp.sum((batch["x"].astype(dtype) @ p["w"].astype(dtype)).astype(jnp.float32) * batch["t"]) / 256

        return params, {"g": jax.grad(loss_fn)(params)["w"]}

    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    params = {"w": jax.random.normal(k1, (16, 32)).astype(jnp.float32 if master else dtype)}
    batch = {"x": jax.random.normal(k2, (256, 16)), "t": jax.random.normal(k3, (256, 32))}
    _, ref = run_single(step, params, [batch])
    dp = data_parallel(step, make_mesh(), weight_update=weight_update, min_shard_size=1)
    _, par = run_parallel(dp, params, [batch])
    assert par["g"].dtype == ref["g"].dtype == params["w"].dtype
    if master:  # a 16-bit sum widened: every element is of the 16-bit type, exactly
        for g in (par["g"], ref["g"]):
            np.testing.assert_array_equal(np.asarray(g.astype(dtype).astype(jnp.float32)), np.asarray(g))
    apart = _ulps_apart(par["g"].astype(dtype), ref["g"].astype(dtype))
    assert apart.max() <= 1 and np.count_nonzero(apart) <= apart.size // 100, (apart.max(), np.count_nonzero(apart))


@pytest.mark.parametrize("weight_update", ["replicated", "sharded"])
def test_cast_16_bit_gradients_leave_a_layer_scan_unsummed_and_a_weight_used_twice_is_summed_per_use(weight_update):
    """float32 master weights cast to bfloat16 for each product: scanned layers, and a weight
    used in two products (two casts). One device rounds each product's gradient to bfloat16 and
    adds the two uses in float32: podscale sums each use apart (the plan counts those bytes) and
    the layers' gradients once, after the loop (reduce-scattered by the sharded update), each
    rounded as one device rounds it."""
    dtype, n = jnp.bfloat16, 64

    def step(params, batch):
        def loss_fn(p):
            def layer(h, w):
                return jnp.tanh(h.astype(dtype) @ w.astype(dtype)).astype(jnp.float32), None

            h, _ = jax.lax.scan(layer, batch["x"], p["layers"])
            out = (h.astype(dtype) @ p["shared"].astype(dtype)) @ p["shared"].astype(dtype)
            return jnp.sum(out.astype(jnp.float32) * batch["t"]) / n

        g = jax.grad(loss_fn)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, g), {"g": g}

    k1, k2, k3, k4 = jax.random.split(jax.random.key(5), 4)
    params = {"layers": jax.random.normal(k1, (3, 16, 16)) / 4, "shared": jax.random.normal(k2, (16, 16)) / 4}
    batch = {"x": jax.random.normal(k3, (n, 16)), "t": jax.random.normal(k4, (n, 16))}
    _, ref = run_single(step, params, [batch])
    dp = data_parallel(step, make_mesh(), weight_update=weight_update, min_shard_size=1)
    _, par = run_parallel(dp, params, [batch])
    a, b = par["g"]["layers"], ref["g"]["layers"]  # rounded once, to bfloat16: of that type
    np.testing.assert_array_equal(np.asarray(a.astype(dtype).astype(jnp.float32)), np.asarray(a))
    apart = _ulps_apart(a.astype(dtype), b.astype(dtype))
    assert apart.max() <= 1 and np.count_nonzero(apart) <= apart.size // 50, apart.max()
    # Two bfloat16 terms added in float32: a term one step off (float32 summation order, rarely)
    a, b = np.asarray(par["g"]["shared"]), np.asarray(ref["g"]["shared"])
    off = np.abs(a - b) > 0
    assert np.count_nonzero(off) <= a.size // 50 and np.all(np.abs(a - b) <= 2.0**-7 * np.abs(b)), np.abs(a - b).max()
    plan = dp.plan()
    assert plan.traffic["summed_apart_bytes"] == 16 * 16 * 4  # the second use of "shared"
    assert not [c for c in plan.collectives if "inside" in c["why"]], plan.collectives  # none in the loop
    if weight_update == "sharded":
        assert "reduce-scatter" in {c["kind"] for c in plan.collectives}


# -- host callbacks ------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh_shape", [(8,), (4, 2)])
def test_debug_callbacks_fire_once_per_step_with_one_device_s_values(mesh_shape, capfd):
    seen = []

    def step(params, batch):
        loss, g = jax.value_and_grad(_count_normalised_loss)(params, batch)
        jax.debug.callback(lambda loss, x: seen.append((float(loss), np.asarray(x))), loss, batch["x"])
        jax.debug.print("podscale-test loss {loss}", loss=loss)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, g), {"loss": loss}

    batches = [_data(i) for i in range(2)]
    _, ref = run_single(step, _params(), batches)
    jax.effects_barrier()
    one_device, seen[:] = list(seen), []
    capfd.readouterr()
    grad_sum = "2d" if len(mesh_shape) == 2 else "1d"
    run_parallel(data_parallel(step, make_mesh(mesh_shape), grad_sum=grad_sum), _params(), batches)
    jax.effects_barrier()
    assert len(seen) == len(one_device) == 2
    for (loss, x), (want_loss, want_x) in zip(seen, one_device, strict=True):
        assert loss == pytest.approx(want_loss, rel=1e-6) and x.shape == want_x.shape == (32, 6)
        np.testing.assert_array_equal(x, want_x)  # the whole batch, not one replica's rows
    assert capfd.readouterr().out.count("podscale-test loss") == 2


def test_io_callback_and_ordered_callbacks_are_refused_before_running():
    from jax.experimental import io_callback

    def with_io(params, batch):
        io_callback(lambda x: None, None, batch["x"])
        return params, {}

    def ordered(params, batch):
        jax.debug.print("{x}", x=batch["x"], ordered=True)
        return params, {}

    for step, match in [(with_io, r"io_callback at .*fire once per replica"), (ordered, r"ordered=True")]:
        dp = data_parallel(step, make_mesh())
        with pytest.raises(NotImplementedError, match=match):  # placing the state traces the step
            dp(dp.place_state(_params(), _data(0)), _data(0))


# -- meshes from jax.make_mesh ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "names", "kw"),
    [
        ((8,), ("batch",), dict(weight_update="replicated")),
        ((8,), ("batch",), dict(weight_update="sharded", min_shard_size=1)),
        ((4, 2), ("a", "b"), dict(grad_sum="2d")),
    ],
)
def test_a_mesh_from_jax_make_mesh_with_explicit_axes_is_accepted(shape, names, kw):
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh(shape, names)
    assert set(mesh.axis_types) == {AxisType.Explicit}  # JAX's default
    step, batches = _sgd_step(_count_normalised_loss), [_data(i) for i in range(3)]
    ref, _ = run_single(step, _params(), batches)
    # A batch already placed on the user's mesh is taken too.
    placed = [jax.device_put(b, NamedSharding(mesh, P(names))) for b in batches]
    par, _ = run_parallel(data_parallel(step, mesh, **kw), _params(), placed)
    assert _rel(par, ref) <= TOL


def test_distributed_eval_on_a_mesh_from_jax_make_mesh():
    from podscale import distributed_eval

    mesh = jax.make_mesh((8,), ("batch",))
    batch = {**_data(0), "mask": jnp.ones(32)}
    run = distributed_eval(lambda p, b: {"sq": jnp.sum(_logits(p, b["x"]) ** 2, axis=-1)}, mesh)
    want = float(jnp.mean(jnp.sum(_logits(_params(), batch["x"]) ** 2, axis=-1)))
    assert run(_params(), [batch])["sq"] == pytest.approx(want, rel=1e-6)


# -- a gradient that is zero up to rounding, under Adam -------------------------------------------


def test_adam_turns_a_bias_before_batch_norm_into_a_step_the_summation_order_decides():
    """flax's nnx MNIST CNN pattern (issue 42, 2): a convolution with a bias, then BatchNorm, which
    subtracts the batch mean, so the bias's gradient is zero up to rounding. Adam divides it by its
    own root mean square: a step of about the learning rate whose sign rounding picks. One device's
    own run with the batch's rows permuted moves that bias by as much, so it and the optimizer
    state built from it (mu, nu) differ at any summation order, podscale's included: bounded by
    the learning rate per step. Every other leaf equals one device within twice one device's own
    spread under that permutation."""
    from flax import nnx

    class CNN(nnx.Module):
        def __init__(self, rngs):
            self.conv = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
            self.bn = nnx.BatchNorm(8, rngs=rngs)
            self.out = nnx.Linear(8 * 4 * 4, 10, rngs=rngs)

        def __call__(self, x):
            x = nnx.avg_pool(nnx.relu(self.bn(self.conv(x))), window_shape=(2, 2), strides=(2, 2))
            return self.out(x.reshape(x.shape[0], -1))

    lr, steps = 1e-3, 3
    model = CNN(nnx.Rngs(0))
    graphdef, state = nnx.split((model, nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)))

    def step(state, batch):
        model, opt = nnx.merge(graphdef, state)

        def loss_fn(model):
            logits = model(batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return nnx.state((model, opt)), {"loss": loss, "grads": nnx.state(grads)}

    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.random((32, 8, 8, 1), np.float32), "y": rng.integers(0, 10, 32).astype(np.int32)}
        for _ in range(steps)
    ]
    ref, ref_m = run_single(step, state, batches)
    g = ref_m["grads"]["conv"]
    assert np.max(np.abs(g["bias"].value)) <= 1e-5 * np.max(np.abs(g["kernel"].value))  # zero up to rounding
    spread = helpers.reordered_runs(step, state, batches)
    par, _ = run_parallel(data_parallel(step, make_mesh()), state, batches)

    def split(tree):
        """(the bias before batch norm and the Adam state of it, every other leaf)"""
        flat = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)}
        rounding = {k: v for k, v in flat.items() if "'conv']['bias'" in k}
        return rounding, {k: v for k, v in flat.items() if k not in rounding}

    (ref_bias, ref_rest), (par_bias, par_rest) = split(ref), split(par)
    assert len(ref_bias) == 3  # the bias, its mu and its nu
    moved = max(
        float(np.max(np.abs(split(o)[0]["[0]['conv']['bias'].value"] - ref_bias["[0]['conv']['bias'].value"])))
        for o in spread
    )
    assert moved > 0.1 * lr  # the spec's own spread: a reordering alone moves the bias by about a step
    # podscale moves it no more than the learning rate per step, as a reordering does
    assert (
        np.max(np.abs(par_bias["[0]['conv']['bias'].value"] - ref_bias["[0]['conv']['bias'].value"])) <= 2 * lr * steps
    )
    floor = max(max_relative_diff(split(o)[1], ref_rest) for o in spread)
    assert max_relative_diff(par_rest, ref_rest) <= max(1e-5, 2 * floor), floor
