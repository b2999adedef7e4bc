"""ResNet-50 v1.5 workload: the LARS recipe (masks, schedule), label smoothing, the v1.5 layout,
and batch norm over groups of replicas (``bn_group_size=k``) against plain batch norm."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import max_abs_diff
from jax.sharding import PartitionSpec as P

from podscale import data_parallel, make_mesh
from podscale.parallel.mesh import BN_GROUP
from podscale.train.tasks import TrainState
from podscale.workloads import datasets
from podscale.workloads import resnet50 as r
from podscale.workloads.precision import BF16, FLOAT32

TINY = r.TINY
SMALL = dataclasses.replace(TINY, stage_sizes=(1, 1), stage_widths=(4, 8))  # the tiny layers, fewer: compiles fast


def _key(seed):
    """An rbg key: XLA:CPU compiles threefry's random bits slowly (seconds per call site)."""
    return jax.random.key(seed, impl="rbg")


def _variables(cfg=TINY, policy=BF16, abstract=False):
    model = r.make_model(cfg, policy, None)
    shapes = {k: jax.ShapeDtypeStruct((2, *v.shape[1:]), v.dtype) for k, v in r.batch_shapes(cfg, 2).items()}
    if abstract:
        return model, jax.eval_shape(lambda b: r.init(model, _key(0), b), shapes)
    return model, jax.jit(lambda b: r.init(model, _key(0), b))(
        {k: jnp.zeros(v.shape, v.dtype) for k, v in shapes.items()}
    )


def _digits(n, start=0):
    return {k: jnp.asarray(v) for k, v in datasets.Digits("train").get(np.arange(start, start + n)).items()}


# -- the recipe -----------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [TINY, r.FULL], ids=["tiny", "full"])
def test_lars_masks_exclude_exactly_batch_norm_params_and_biases(cfg):
    _, variables = _variables(cfg, abstract=True)
    params = variables["params"]
    bn_modules = {
        jax.tree_util.keystr(path[:-1]) for path, _ in jax.tree_util.tree_leaves_with_path(variables["batch_stats"])
    }
    mask = r.adapted(params)
    assert jax.tree.structure(mask) == jax.tree.structure(params)
    excluded = []
    for (path, leaf), flag in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(mask), strict=True):
        is_bn = jax.tree_util.keystr(path[:-1]) in bn_modules
        is_bias = path[-1].key == "bias"
        assert flag == (not (is_bn or is_bias)), (jax.tree_util.keystr(path), flag)
        if not flag:
            excluded.append(path)
        else:
            assert leaf.ndim >= 2  # only kernels are adapted
    # every batch norm contributes its scale and offset, plus the classifier's bias
    assert len(excluded) == 2 * len(bn_modules) + 1
    if cfg is r.FULL:
        assert len(bn_modules) == 1 + 3 * 16 + 4  # stem, 3 per bottleneck, 4 projections


def test_lars_applies_the_masks_to_both_weight_decay_and_the_trust_ratio():
    cfg = dataclasses.replace(TINY, weight_decay=0.1)  # large enough to see
    rng = np.random.default_rng(0)
    shapes = {
        "conv": {"kernel": (3, 3, 4, 8)},
        "bn": {"scale": (8,), "bias": (8,)},
        "head": {"kernel": (8, 10), "bias": (10,)},
    }
    params = jax.tree.map(
        lambda s: jnp.asarray(rng.normal(size=s), jnp.float32), shapes, is_leaf=lambda x: isinstance(x, tuple)
    )
    grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape) * 0.01, jnp.float32), params)
    tx = r.make_optimizer(cfg, cfg.train_steps)

    @jax.jit
    def second_update(params, grads):
        state = tx.init(params)
        _, state = tx.update(grads, state, params)  # step 0: learning rate 0, momentum trace stays 0
        return tx.update(grads, state, params)[0]

    updates = second_update(params, grads)
    lr = float(r.learning_rate_schedule(cfg, cfg.train_steps)(1))
    assert lr > 0
    mask = r.adapted(params)
    assert mask == {
        "conv": {"kernel": True},
        "bn": {"scale": False, "bias": False},
        "head": {"kernel": True, "bias": False},
    }
    for w, g, u, adapt in zip(
        jax.tree.leaves(params), jax.tree.leaves(grads), jax.tree.leaves(updates), jax.tree.leaves(mask), strict=True
    ):
        w, g, u = (np.asarray(x, np.float64) for x in (w, g, u))
        if adapt:
            d = g + cfg.weight_decay * w
            expected = -lr * cfg.trust_coefficient * np.linalg.norm(w) / np.linalg.norm(d) * d
        else:
            expected = -lr * g
        np.testing.assert_allclose(u, expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())


@pytest.mark.parametrize("cfg", [TINY, r.FULL], ids=["tiny", "full"])
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_schedule_warms_up_linearly_then_decays_as_a_power_2_polynomial(cfg, scale):
    total = int(cfg.train_steps * scale)
    schedule = r.learning_rate_schedule(cfg, total)
    warmup = round(cfg.warmup_steps * scale)
    peak, end = cfg.learning_rate, cfg.end_learning_rate
    steps = np.unique(
        np.concatenate([np.arange(0, total + 1, max(1, total // 97)), [warmup - 1, warmup, warmup + 1, total]])
    )
    got = np.array([float(schedule(t)) for t in steps])
    plain = np.where(
        steps < warmup,
        peak * steps / warmup,
        end + (peak - end) * (1 - np.clip(steps - warmup, 0, total - warmup) / (total - warmup)) ** 2,
    )
    np.testing.assert_allclose(got, plain, rtol=1e-5, atol=1e-6)
    assert got[0] == 0.0 and np.isclose(float(schedule(warmup)), peak) and np.isclose(float(schedule(total)), end)


# -- loss, metrics, model -------------------------------------------------------------------------


def test_label_smoothing_loss_equals_a_hand_computed_smoothed_cross_entropy():
    model, variables = _variables(SMALL, BF16)
    variables = jax.tree_util.tree_map_with_path(lambda p, x: x + 0.5 if p[-1].key == "scale" else x, variables)
    batch = _digits(16)
    per, logits = jax.jit(
        lambda v, b: (r.train_loss(model, v, b)[0], model.apply(v, b["image"], train=True, mutable=["batch_stats"])[0])
    )(variables, batch)
    z = np.asarray(logits, np.float64)
    logp = z - z.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    k, a = TINY.num_classes, TINY.label_smoothing
    q = np.full((16, k), a / k)
    q[np.arange(16), np.asarray(batch["label"])] += 1 - a
    np.testing.assert_allclose(per["loss"], -(q * logp).sum(-1), rtol=1e-5)
    assert per["loss"].dtype == jnp.float32
    np.testing.assert_array_equal(per["accuracy"], (z.argmax(-1) == np.asarray(batch["label"])).astype(np.float32))
    # unsmoothed cross-entropy differs: the smoothing is really applied
    assert not np.allclose(per["loss"], -logp[np.arange(16), np.asarray(batch["label"])], rtol=1e-3)
    metrics = jax.jit(lambda v, b: r.eval_metrics(model, v, b))(variables, batch)
    assert set(metrics) == {"loss", "accuracy"} and all(v.shape == (16,) for v in metrics.values())


def test_v1_5_strides_in_the_3x3_convolution_and_zero_init_last_batch_norm():
    model = r.make_model(r.FULL, BF16, None)
    image = jax.ShapeDtypeStruct((1, 224, 224, 3), jnp.float32)

    def run(x):
        variables = model.init(_key(0), x, train=False)
        out, state = model.apply(variables, x, train=False, capture_intermediates=True, mutable=["intermediates"])
        return out, state["intermediates"], variables["params"]

    out, inter, params = jax.eval_shape(run, image)
    assert out.shape == (1, 1000)
    block = inter["stage2_block1"]
    assert block["conv1"]["__call__"][0].shape == (1, 56, 56, 128)  # 1x1 keeps the resolution
    assert block["conv2"]["__call__"][0].shape == (1, 28, 28, 128)  # the 3x3 strides
    assert block["proj_conv"]["__call__"][0].shape == (1, 28, 28, 512)
    assert inter["stem_conv"]["__call__"][0].shape == (1, 112, 112, 64)
    assert inter["stage4_block3"]["__call__"][0].shape == (1, 7, 7, 2048)
    _, tiny = _variables(TINY, BF16)
    for path, leaf in jax.tree_util.tree_leaves_with_path(tiny["params"]):
        name = jax.tree_util.keystr(path)
        if path[-1].key == "scale":
            assert np.all(np.asarray(leaf) == (0.0 if "'bn3'" in name else 1.0)), name


def test_full_data_does_not_ship():
    with pytest.raises(ValueError, match="--config tiny"):
        r.make_data(r.FULL, 0)


# -- batch norm over groups of replicas -----------------------------------------------------------


def _bn_setup():
    """float32 compute so the comparisons are tight; BN scales moved off 0/1 so every path
    carries gradient."""
    mesh = make_mesh(bn_group_size=4)  # 8 devices: (data 2, bn_group 4)
    grouped = r.make_model(SMALL, FLOAT32, BN_GROUP)
    plain = r.make_model(SMALL, FLOAT32, None)
    batch = _digits(32, start=100)
    variables = jax.jit(lambda b: r.init(plain, _key(1), b))(batch)
    variables = jax.tree_util.tree_map_with_path(lambda p, x: x + 0.3 if p[-1].key == "scale" else x, variables)
    return mesh, grouped, plain, batch, variables


def _group_slices(batch, groups=2):
    n = len(batch["label"]) // groups
    return [jax.tree.map(lambda x: x[g * n : (g + 1) * n], batch) for g in range(groups)]


def test_bn_group_forward_statistics_equal_batch_norm_over_each_groups_combined_batch():
    mesh, grouped, plain, batch, variables = _bn_setup()
    axes = tuple(mesh.axis_names)

    def stats(v, b):
        return r.train_loss(grouped, v, b)[1]

    per_device = jax.jit(
        jax.shard_map(
            lambda v, b: jax.tree.map(lambda s: s[None], stats(v, b)),
            mesh=mesh,
            in_specs=(P(), P(axes)),
            out_specs=P(axes),
        )
    )(variables, batch)
    single = jax.jit(lambda v, b: r.train_loss(plain, v, b)[1])
    refs = [single(variables, b) for b in _group_slices(batch)]
    for device in range(8):
        group = device // 4  # devices (data, bn_group) in row-major order; each group holds contiguous rows
        got = jax.tree.map(lambda s, d=device: s[d], per_device)
        assert max_abs_diff(got, refs[group]) <= 1e-6, device
    # the test can fail: per-replica and whole-batch statistics are different
    whole = single(variables, batch)
    replica = single(variables, _group_slices(batch, 8)[0])
    assert max_abs_diff(whole, refs[0]) > 1e-3 and max_abs_diff(replica, refs[0]) > 1e-3


def test_bn_group_training_step_under_data_parallel_equals_grouped_batch_norm_on_one_device():
    mesh, grouped, plain, batch, variables = _bn_setup()
    tx = optax.sgd(1.0)
    state = TrainState(
        jnp.zeros((), jnp.int32), variables["params"], variables["batch_stats"], tx.init(variables["params"])
    )

    def step(state, b):
        def loss(p):
            per, bs = r.train_loss(grouped, {"params": p, "batch_stats": state.batch_stats}, b)
            return per["loss"].mean(), bs

        (value, bs), grads = jax.value_and_grad(loss, has_aux=True)(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        return state.replace(params=optax.apply_updates(state.params, updates), batch_stats=bs, opt_state=opt_state), {
            "loss": value
        }

    dp = data_parallel(step, mesh)
    out, metrics = dp(dp.place_state(state, batch), batch)
    out = dp.gather_state(out)

    def reference(p):  # plain batch norm on each group's combined batch; the loss is the global mean
        results = [
            r.train_loss(plain, {"params": p, "batch_stats": state.batch_stats}, b) for b in _group_slices(batch)
        ]
        value = jnp.mean(jnp.stack([per["loss"].mean() for per, _ in results]))
        return value, jax.tree.map(lambda *s: sum(s) / len(s), *[bs for _, bs in results])

    (value, stats), grads = jax.jit(jax.value_and_grad(reference, has_aux=True))(state.params)
    assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads)) > 1e-2
    np.testing.assert_allclose(metrics["loss"], value, rtol=1e-6)
    assert max_abs_diff(out.batch_stats, stats) <= 1e-6
    assert max_abs_diff(out.params, jax.tree.map(lambda p, g: p - g, state.params, grads)) <= 1e-6
