"""The SSD model: its size against the published one, and its step under spatial partitioning
against one device on whole images (float32)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import max_relative_diff, reordered_runs, run_parallel, run_single

from podscale import data_parallel, make_mesh
from podscale.compiled import hlo
from podscale.parallel.mesh import BN_GROUP
from podscale.workloads import ssd

STEPS = 10


def test_full_ssd300_has_the_published_parameter_count_and_8732_boxes():
    count = ssd.param_count(ssd.FULL)
    assert abs(count / ssd.REFERENCE_PARAMS - 1) <= 0.02, count
    assert len(ssd.FULL.boxes.xywh()) == 8732
    logits, offsets = jax.eval_shape(
        lambda x: ssd.SSD(ssd.FULL).init_with_output(jax.random.key(0), x, train=False)[0],
        jax.ShapeDtypeStruct((1, 300, 300, 3), jnp.float32),
    )
    assert logits.shape == (1, 8732, 81) and offsets.shape == (1, 8732, 4)


def test_full_recipe_is_the_v07_jax_ssds_and_its_logged_boundaries_pass_the_ruleset():
    """lr 0.0012 x 4096 / 32 after 26 warmup epochs, x0.1 at epoch 64 and x0.01 at 80 (118,287
    images an epoch); the logged epochs are 64 and 80 (the ruleset's 40 and 50, scaled by 1.6)."""
    from mlperf_logging.mllog import constants as C

    cfg = ssd.FULL
    schedule = ssd.learning_rate_schedule(cfg, cfg.train_steps)
    per_epoch = 118_287 / 4096
    assert cfg.global_batch == 4096 and cfg.spatial == 4 and cfg.weight_decay == 5e-4
    assert float(schedule(int(26 * per_epoch))) == pytest.approx(0.1536)
    assert float(schedule(int(13 * per_epoch))) == pytest.approx(0.1536 / 2, rel=1e-2)
    assert float(schedule(int(70 * per_epoch))) == pytest.approx(0.01536)
    assert float(schedule(int(100 * per_epoch))) == pytest.approx(0.001536)
    epochs = ssd.hparams(cfg, cfg.train_steps)[C.OPT_LR_DECAY_BOUNDARY_EPOCHS]
    assert epochs == [64, 80]
    from mlperf_logging.compliance_checker.mlp_compliance import is_integer  # the ruleset's own test

    assert all(is_integer(10 * (e / base - 1)) for e, base in zip(epochs, (40, 50), strict=True))


def _step(model, tx):
    def step(state, batch):
        params, stats, opt = state
        grad_fn = jax.value_and_grad(
            lambda p: ssd.loss(model, {"params": p, "batch_stats": stats}, batch), has_aux=True
        )
        (value, new_stats), grads = grad_fn(params)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), new_stats, opt), {"loss": value}

    return step


def _setup(bn_axis=None):
    data = ssd.tiny_data("train", size=16 * STEPS)
    batches = [data.get(np.arange(i * 16, (i + 1) * 16)) for i in range(STEPS)]
    model = ssd.SSD(ssd.TINY)
    variables = jax.jit(model.init)(jax.random.key(0), batches[0]["image"])  # one program, not one per op
    tx = optax.chain(optax.add_decayed_weights(5e-4), optax.sgd(0.02, momentum=0.9))
    state = (variables["params"], variables["batch_stats"], tx.init(variables["params"]))
    return _step(ssd.SSD(ssd.TINY, bn_axis=bn_axis), tx), state, batches


def _reference_states(step, state, batches):
    """One device's state before each step and after the last, and per step its own spread: how
    far the step on the batch with its rows permuted (another summation order) lands from it."""
    jstep, states, spreads = jax.jit(step), [jax.device_get(state)], []
    for batch in batches:
        before = state
        state, _ = jstep(state, batch)
        states.append(jax.device_get(state))
        spreads.append(max(max_relative_diff(o, states[-1]) for o in reordered_runs(step, before, [batch])))
    return states, spreads


_REFERENCE = {}


def test_ten_steps_of_ssd_drift_on_one_device_past_a_step_s_bound():
    """Hard negative mining ranks near-equal background losses: a change of summation order as
    small as reordering the batch's rows on ONE device can flip some picks, and the difference
    grows over the steps (measured after 10 steps: past 1e-3 on one CPU, 1.6e-6 on one with
    AVX-512, whose kernels sum in another order). Either way it passes what one step is held to
    (1e-6), so the spatial test below checks each of the 10 steps from the same state: podscale's
    difference, not the spec's own sensitivity."""
    step, state, batches = _setup()
    a, _ = run_single(step, state, batches)
    assert max(max_relative_diff(b, a) for b in reordered_runs(step, state, batches)) > 1e-6


@pytest.mark.parametrize(
    ("k", "weight_update", "bn_groups"),
    # Every pair of k, update and batch-norm grouping, in four cases.
    [(2, "replicated", False), (2, "sharded", True), (4, "sharded", False), (4, "replicated", True)],
    ids=["2-replicated-whole-batch-bn", "2-sharded-bn-groups", "4-sharded-whole-batch-bn", "4-replicated-bn-groups"],
)
def test_tiny_ssd_spatial_step_equals_one_device(k, weight_update, bn_groups):
    """k partitions per canvas on a (8/k) x k mesh; with bn groups, one group of every replica
    (batch norm over the whole batch, as on one device). Each of 10 steps, from one device's
    state at that step, equals one device's step within 1e-6 relative (or twice one device's own
    spread on that step, its batch's rows permuted, where that is wider)."""
    step, state, batches = _setup()
    if "states" not in _REFERENCE:
        _REFERENCE["states"] = _reference_states(step, state, batches)
    states, spreads = _REFERENCE["states"]
    replicas = 8 // k
    if bn_groups:
        step = _setup(bn_axis=BN_GROUP)[0]
        mesh = make_mesh((replicas, k), bn_group_size=replicas, spatial=k)
    else:
        mesh = make_mesh((replicas, k))
    dp = data_parallel(step, mesh, spatial=k, weight_update=weight_update, min_shard_size=64)
    assert max_relative_diff(states[-1][0], states[0][0]) > 1e-2, (
        "the parameters did not move: the check would be empty"
    )
    for i, batch in enumerate(batches):
        out, _ = run_parallel(dp, states[i], [batch])
        # within 1e-6, or twice one device's own spread on that step where it is wider
        assert max_relative_diff(out, states[i + 1]) <= max(1e-6, 2 * spreads[i]), (f"step {i + 1}", spreads[i])
    assert dict(zip(sorted(batches[0]), dp.placement.batch.images, strict=True)) == {
        "box_labels": False,
        "box_targets": False,
        "boxes": False,
        "image": True,
        "labels": False,
    }
    module = hlo.read(dp.lower(dp.layout.stored_shapes(), batches[0]).compile(), dp.mesh)
    assert any(c.kind == "collective-permute" and c.axes == (mesh.axis_names[-1],) for c in module.collectives)


@pytest.mark.full_config
def test_full_ssd300_compiles_for_one_replica_and_for_4_spatial_partitions():
    """bf16 compute at one image per replica: whole, and split over 4 devices. SSD300's heights
    (150, 75, 38, 19, 10, 5, 3, 1) are not all multiples of 4: XLA pads those layers, the plan
    lists them, and the per-device temporaries still fall."""
    from jax.sharding import Mesh

    model = ssd.SSD(ssd.FULL, dtype=jnp.bfloat16)
    tx = ssd.make_optimizer(ssd.FULL, ssd.FULL.train_steps)
    boxes = len(ssd.FULL.boxes.xywh())
    batch = {
        "image": jax.ShapeDtypeStruct((1, 300, 300, 3), jnp.float32),
        "box_labels": jax.ShapeDtypeStruct((1, boxes), jnp.int32),
        "box_targets": jax.ShapeDtypeStruct((1, boxes, 4), jnp.float32),
    }
    variables = jax.eval_shape(lambda x: model.init(jax.random.key(0), x), batch["image"])
    state = jax.eval_shape(lambda v: (v["params"], v["batch_stats"], tx.init(v["params"])), variables)
    temps = {}
    assert ssd.FULL.spatial == 4  # the v0.7 JAX recipe's partitions per image
    for k in (1, ssd.FULL.spatial):
        mesh = Mesh(np.array(jax.devices()[:k]).reshape(1, k), ("data", "space"))
        dp = data_parallel(_step(model, tx), mesh, spatial=k)
        dp.prepare(state, batch)
        module = hlo.read(dp.lower(dp.layout.stored_shapes(), batch).compile(), mesh)
        temps[k] = module.memory["temporaries"]
        if k == 4:
            assert any(c.kind == "collective-permute" for c in module.collectives)
            assert any(note.startswith("layer _Block_0/Conv_0: height 75 ") for note in dp.placement.batch.uneven), (
                dp.placement.batch.uneven[:3]
            )
    assert temps[4] < 0.8 * temps[1], temps
