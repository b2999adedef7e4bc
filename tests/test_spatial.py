"""Spatial partitioning: each image's height split over a space axis equals one device on the
whole image (float32, summation order only), with halo exchanges and no gathered activations."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import leaf_relative_error, max_relative_diff, reordered_runs, run_parallel, run_single
from jax.sharding import Mesh

from podscale import data_parallel, make_mesh
from podscale.bench.spatial import classifier_step
from podscale.compiled import hlo
from podscale.parallel.mesh import BN_GROUP
from podscale.train.models import StemNet

STEPS = 10


def _setup(images=(32, 32), channels=3, rows=16, bn_axis=None):
    model = StemNet(bn_axis=bn_axis)
    rng = np.random.default_rng(0)
    shape = (rows, *images, channels) if channels else (rows, *images)
    batches = [
        {"image": rng.normal(size=shape).astype(np.float32), "label": rng.integers(0, 10, rows).astype(np.int32)}
        for _ in range(STEPS)
    ]
    variables = jax.jit(model.init)(jax.random.key(0), batches[0]["image"])  # one program, not one per op
    tx = optax.chain(optax.add_decayed_weights(5e-4), optax.sgd(0.05, momentum=0.9))

    state = (variables["params"], variables["batch_stats"], tx.init(variables["params"]))
    return classifier_step(model, tx), state, batches


_REFERENCE = {}


@pytest.mark.parametrize("weight_update", ["replicated", "sharded"])
@pytest.mark.parametrize("k", [2, 4])
def test_spatial_step_equals_one_device_on_the_whole_image(k, weight_update):
    step, state, batches = _setup()
    if "ref" not in _REFERENCE:
        _REFERENCE["ref"] = run_single(step, state, batches)
    ref, ref_metrics = _REFERENCE["ref"]
    dp = data_parallel(step, make_mesh((8 // k, k)), spatial=k, weight_update=weight_update, min_shard_size=64)
    out, metrics = run_parallel(dp, state, batches)
    assert max_relative_diff(ref[0], state[0]) > 1e-2, "the parameters did not move: the check would be empty"
    assert max_relative_diff(out, ref) <= 1e-6
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-6)
    assert dp.placement.batch.images == (True, False) and dp.placement.batch.uneven == ()

    if weight_update == "sharded":  # the update is sharded over data x space: 1/8 per device
        stored = dp.place_state(state)
        split = 0
        for x, leaf in zip(jax.tree.leaves(stored), dp.layout.leaves, strict=True):
            if leaf.sharded:  # flat chunks
                assert x.addressable_shards[0].data.size * 8 == x.size == leaf.stored.length * (8 // k)
            if leaf.chunked:  # chunks along a dim, split over the space axis where the dim divides
                split += leaf.stored.split == k
                assert x.addressable_shards[0].data.size * (8 // k) * leaf.stored.split == x.size
                assert list(x.addressable_shards[0].data.shape) == leaf.local_shape()
        assert split, [leaf.reason for leaf in dp.layout.leaves]
        new, _ = dp(stored, dp.place_batch(batches[0], len(batches[0]["label"])))
        assert [jax.typeof(x) for x in jax.tree.leaves(new)] == [jax.typeof(x) for x in jax.tree.leaves(stored)]
    module = hlo.read(dp.lower(dp.layout.stored_shapes(), batches[0]).compile(), dp.mesh)
    halos = [c for c in module.collectives if c.kind == "collective-permute"]
    assert halos and all(c.axes == ("y",) for c in halos), [(c.name, c.axes) for c in halos]
    # No activation is gathered: the only all-gathers are the sharded update's (updated weights,
    # gathered over the space axis, then the data axis), each smaller than the weights.
    gathers = [c for c in module.collectives if c.kind == "all-gather"]
    weights = sum(leaf.bytes for leaf in dp.layout.leaves if leaf.weight)
    assert weight_update == "sharded" or not gathers
    assert all(c.buffer_bytes * c.group_size <= weights for c in gathers), [(c.name, c.buffer_bytes) for c in gathers]


EIGHT_WAY_TOLERANCE = 1e-5
"""8 partitions of a 32-row image reorder more of each step's sums than 2 or 4 do: a weight's
gradient sums 16 x 32 x 32 products, which float32 rounds at about sqrt(16384) x 2**-24 = 8e-6 of
their magnitude in a random walk. Measured after 10 steps: 3.2e-6 (1 x 8, sharded update; it
is 1.4e-6 after the first step and grows smoothly: no discrete choice flips), where one device on
the same batches with their rows reordered ends 3.7e-7 away."""


@pytest.mark.parametrize("weight_update", ["replicated", "sharded"])
def test_one_replica_split_8_ways_equals_one_device(weight_update):
    """Spatial partitioning alone (a 1x8 mesh): no collective runs over the data axis of one
    device, which XLA's partitioner would refuse. The parameters within EIGHT_WAY_TOLERANCE."""
    step, state, batches = _setup()
    if "ref" not in _REFERENCE:
        _REFERENCE["ref"] = run_single(step, state, batches)
    ref, ref_metrics = _REFERENCE["ref"]
    dp = data_parallel(step, make_mesh((1, 8)), spatial=8, weight_update=weight_update, min_shard_size=64)
    out, metrics = run_parallel(dp, state, batches)
    assert max_relative_diff(out, ref) <= EIGHT_WAY_TOLERANCE
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-6)
    module = hlo.read(dp.lower(dp.layout.stored_shapes(), batches[0]).compile(), dp.mesh)
    assert any(c.kind == "collective-permute" for c in module.collectives)  # the halos
    assert all(c.group_size > 1 and c.axes != ("x",) for c in module.collectives)
    # The leaves the forward pass reads are found as with several replicas (not typed per
    # replica here): the sharded update still chunks the optimizer state, not the weights.
    two = data_parallel(step, make_mesh((2, 4)), spatial=4, weight_update=weight_update, min_shard_size=64)
    two.prepare(state, batches[0])
    assert [leaf.weight for leaf in dp.layout.leaves] == [leaf.weight for leaf in two.layout.leaves]
    assert [leaf.sharded for leaf in dp.layout.leaves] == [leaf.sharded for leaf in two.layout.leaves]


@pytest.mark.parametrize("weight_update", ["replicated", "sharded"])
def test_spatial_with_batch_norm_groups_equals_one_device(weight_update):
    """make_mesh((4, 2), bn_group_size=4, spatial=2): one group of the 4 replicas, each image over
    2 devices; batch norm over the group's partitions is batch norm over the whole batch."""
    step, state, batches = _setup()
    grouped, _, _ = _setup(bn_axis=BN_GROUP)
    if "ref" not in _REFERENCE:
        _REFERENCE["ref"] = run_single(step, state, batches)
    ref, _ = _REFERENCE["ref"]
    mesh = make_mesh((4, 2), bn_group_size=4, spatial=2)
    assert mesh.axis_names == ("x", BN_GROUP, "y")
    dp = data_parallel(grouped, mesh, spatial=2, weight_update=weight_update, min_shard_size=64)
    out, _ = run_parallel(dp, state, batches)
    assert dp.roles.data == ("x", BN_GROUP) and dp.replicas == 4
    assert max_relative_diff(out, ref) <= 1e-6


def test_activation_memory_per_device_falls_with_the_partitions():
    """Two replicas of one image each, the image split over k = 1, 2, 4 devices (2k devices)."""
    step, state, batches = _setup(images=(64, 64), rows=2)
    temps = {}
    for k in (1, 2, 4):
        mesh = Mesh(np.array(jax.devices()[: 2 * k]).reshape(2, k), ("x", "y"))
        dp = data_parallel(step, mesh, spatial=k)  # k = 1: plain data parallelism (y has one device)
        dp.prepare(state, batches[0])
        temps[k] = hlo.memory_of(dp.lower(dp.layout.stored_shapes(), batches[0]).compile())["temporaries"]
    assert temps[2] < 0.7 * temps[1] and temps[4] < 0.7 * temps[2], temps


def test_a_height_the_space_axis_does_not_divide_is_listed_and_strict_refuses_it():
    step, state, batches = _setup(images=(24, 24))  # 24 -> 12 -> 6: 4 does not divide 6
    dp = data_parallel(step, make_mesh((2, 4)), spatial=4)
    out, _ = run_parallel(dp, state, batches[:3])
    ref, _ = run_single(step, state, batches[:3])
    assert max_relative_diff(out, ref) <= 1e-6  # XLA pads, exactly
    uneven = dp.placement.batch.uneven
    assert uneven and all("is not a multiple of 4" in note for note in uneven)
    assert any(note.startswith("layer Conv_1: height 6") for note in uneven), uneven
    strict = data_parallel(step, make_mesh((2, 4)), spatial=4, strict=True)
    with pytest.raises(ValueError, match=r"strict=True: refused before running; spatial=4 does not divide"):
        strict.place_state(state, batches[0])


def test_spatial_input_errors_name_the_mesh_axis_the_height_or_the_model():
    step, state, batches = _setup()
    with pytest.raises(
        ValueError, match=r"spatial=4 needs a mesh whose last axis has 4 devices.*make_mesh\(\(2, 4\)\)"
    ):
        data_parallel(step, make_mesh((4, 2)), spatial=4)
    with pytest.raises(ValueError, match=r"spatial=2 needs a mesh whose last axis"):
        data_parallel(step, make_mesh(), spatial=2)
    with pytest.raises(ValueError, match=r"spatial must be at least 1"):
        data_parallel(step, make_mesh((4, 2)), spatial=0)
    odd_step, odd_state, odd = _setup(images=(30, 32))
    with pytest.raises(ValueError, match=r"the images have height 30 .*do not divide"):
        data_parallel(odd_step, make_mesh((2, 4)), spatial=4).place_state(odd_state, odd[0])

    def mlp_step(params, batch):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((batch["x"] @ p - batch["y"]) ** 2))(params)
        return params - 0.1 * grads, {"loss": loss}

    flat = {"x": np.ones((16, 4, 4), np.float32), "y": np.ones((16, 4, 3), np.float32)}
    with pytest.raises(ValueError, match=r"no convolution or pooling over an image-shaped batch leaf"):
        data_parallel(mlp_step, make_mesh((4, 2)), spatial=2).place_state(np.ones((4, 3), np.float32), flat)


def test_the_trainer_with_spatial_trains_like_data_parallelism(tmp_path):
    """``podscale train --mesh 4x2 --spatial 2`` (in-process): the same parameters as the plain
    4x2 data-parallel run, up to summation order, with the evaluation on the spatial mesh too.
    With SGD: Adam turns a gradient that is zero up to rounding (a convolution's bias before batch
    norm) into a step of about its learning rate whose sign the summation order decides, on one
    device as under podscale (tests/test_exactness.py), which would hide the trainer's plumbing."""
    from podscale.parallel.strategy import Strategy
    from podscale.train.trainer import TrainConfig, train

    common = dict(model="resnet", data="digits", optimizer="sgd", mesh=(4, 2), steps=8, eval_every=4, progress=False)
    plain = train(TrainConfig(**common, export=str(tmp_path / "plain.npz")))
    split = train(TrainConfig(**common, strategy=Strategy(spatial=2), export=str(tmp_path / "split.npz")))
    assert split["replicas"] == 4 and plain["replicas"] == 8
    with np.load(tmp_path / "plain.npz") as a, np.load(tmp_path / "split.npz") as b:
        assert max(float(np.max(np.abs(a[k] - b[k]))) for k in a.files) <= 1e-5
    assert abs(split["eval_value"] - plain["eval_value"]) <= 1e-6


_RESNET50 = {}


@pytest.mark.parametrize(
    ("k", "weight_update", "bn_groups"),
    # Every pair of k, update and batch-norm grouping, in four cases.
    [(2, "replicated", False), (2, "sharded", True), (4, "sharded", False), (4, "replicated", True)],
    ids=["2-replicated-whole-batch-bn", "2-sharded-bn-groups", "4-sharded-whole-batch-bn", "4-replicated-bn-groups"],
)
def test_the_tiny_resnet50_workload_splits_its_digits_and_equals_one_device(k, weight_update, bn_groups):
    """The tiny ResNet-50 (LARS, float32) on 8x8 digits, the first 10 steps of its recipe's
    schedule: heights 8, 4, 2, so at k = 4 XLA pads the last stage (listed as uneven). With bn
    groups, one group of every replica (the whole batch, as on one device). Every leaf of the
    parameters and batch statistics equals one device's within 1e-6 relative error (the leaf's
    2-norm; measured 4e-7 to 8e-7: elementwise, a few small batch-norm biases differ by 15 ulps),
    or within twice one device's own spread where that is wider: its 10 steps on the same batches
    with their rows permuted (on a CPU with AVX-512, 7e-7 by the 2-norm, 2.0e-6 elementwise)."""
    from podscale.train.tasks import make_task, make_train_step
    from podscale.workloads.precision import FLOAT32

    if not _RESNET50:
        task = make_task("resnet50", config="tiny", policy=FLOAT32)
        tx = task.workload.make_optimizer(task.config, task.config.train_steps)
        batches = [task.train_data.get(np.arange(i * 16, (i + 1) * 16)) for i in range(STEPS)]
        state = task.init_state(jax.random.key(0), tx)
        ref, _ = run_single(make_train_step(task, tx), state, batches)
        assert max_relative_diff(ref.params, state.params) > 1e-2, "the parameters did not move"
        spread = reordered_runs(make_train_step(task, tx), state, batches)
        floors = {
            "params": max(leaf_relative_error(o.params, ref.params) for o in spread),
            "batch_stats": max(leaf_relative_error(o.batch_stats, ref.batch_stats) for o in spread),
            "elementwise": max(max_relative_diff(o.params, ref.params) for o in spread),
        }
        _RESNET50.update(tx=tx, batches=batches, state=state, ref=ref, floors=floors)
    tx, batches, state, ref, floors = (_RESNET50[key] for key in ("tx", "batches", "state", "ref", "floors"))
    task = make_task("resnet50", config="tiny", policy=FLOAT32, bn_axis=BN_GROUP if bn_groups else None)
    replicas = 8 // k
    mesh = make_mesh((replicas, k), bn_group_size=replicas, spatial=k) if bn_groups else make_mesh((replicas, k))
    dp = data_parallel(make_train_step(task, tx), mesh, spatial=k, weight_update=weight_update)
    out, _ = run_parallel(dp, state, batches)
    assert leaf_relative_error(out.params, ref.params) <= max(1e-6, 2 * floors["params"]), floors
    assert leaf_relative_error(out.batch_stats, ref.batch_stats) <= max(1e-6, 2 * floors["batch_stats"]), floors
    assert max_relative_diff(out.params, ref.params) <= max(2e-6, 2 * floors["elementwise"]), (
        floors
    )  # no element far off
    assert bool(dp.placement.batch.uneven) == (k == 4)  # heights 8, 4, 2: 4 does not divide 2
    assert dict(zip(sorted(batches[0]), dp.placement.batch.images, strict=True)) == {"image": True, "label": False}


@pytest.mark.parametrize("weight_update", ["replicated", "sharded"])
def test_spatial_with_the_2d_gradient_sum_over_two_data_axes_equals_one_device(weight_update):
    """A 2x2x2 mesh: the 2-D sum over the two data axes (reduce-scatter along x, all-reduce along
    y, all-gather back), each image's height over the third. The batch statistics, small sums the
    forward pass reads, are an all-reduce along each data axis in turn, not the 2-D sum's phases."""
    step, state, batches = _setup()
    ref, _ = run_single(step, state, batches)
    dp = data_parallel(step, make_mesh((2, 2, 2)), spatial=2, grad_sum="2d", weight_update=weight_update)
    out, _ = run_parallel(dp, state, batches)
    assert max_relative_diff(out, ref) <= 1e-6
    module = hlo.read(dp.lower(dp.layout.stored_shapes(), batches[0]).compile(), dp.mesh)
    kinds = {(c.kind, c.axes) for c in module.collectives}
    assert {("reduce-scatter", ("x",)), ("all-gather", ("x",)), ("collective-permute", ("z",))} <= kinds
    stats = {
        c.axes
        for c in module.collectives
        if c.kind == "all-reduce" and c.axes in (("x",), ("y",)) and hlo.UPDATE_SCOPE not in c.op_name
    }
    assert stats == {("x",), ("y",)}, module.collectives


def test_the_space_axis_is_named_by_its_role_in_any_position():
    """``space_axis`` names the axis: here the first of a ``jax.make_mesh`` mesh (Explicit axes),
    the data axis after it; the same step as one device's, with the sharded update."""
    step, state, batches = _setup()
    if "ref" not in _REFERENCE:
        _REFERENCE["ref"] = run_single(step, state, batches)
    ref, ref_metrics = _REFERENCE["ref"]
    mesh = jax.make_mesh((4, 2), ("space", "data"))
    dp = data_parallel(step, mesh, space_axis="space", weight_update="sharded", min_shard_size=64)
    assert (dp.roles.space, dp.roles.data, dp.replicas) == ("space", ("data",), 2)
    out, metrics = run_parallel(dp, state, batches)
    assert max_relative_diff(out, ref) <= 1e-6
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-6)
    module = hlo.read(dp.lower(dp.layout.stored_shapes(), batches[0]).compile(), dp.mesh)
    halos = [c for c in module.collectives if c.kind == "collective-permute"]
    assert halos and all(c.axes == ("space",) for c in halos)
    assert dp.plan().spatial["partitions"] == 4


def test_layers_whose_height_4_does_not_divide_still_run_on_every_partition(monkeypatch):
    """300x300 images (SSD300's): the residual pair runs at 75 rows, which 4 partitions do not
    divide. podscale splits each image convolution's input and result by height, so XLA pads 75 to
    76 (19 rows each) and every partition computes a quarter: the compiled step's convolution FLOPs
    per device are at most 0.3 of one device's. Without the split (``MAX_SPLIT_CONV = 0``) XLA's
    propagation alone runs such layers on fewer partitions (0.41 of one device's on XLA:TPU v3,
    compile-only; above 0.3 on XLA:CPU)."""
    from podscale.parallel.partition import core

    step, state, batches = _setup(images=(300, 300), rows=4)

    def conv_flops(mesh, k):
        dp = data_parallel(step, mesh, spatial=k)
        dp.prepare(state, batches[0])
        module = hlo.read(dp.lower(dp.layout.stored_shapes(), batches[0]).compile(), mesh)
        return sum(op.conv_flops * op.count for op in module.ops if op.phase != "update")

    one = conv_flops(Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("x", "y")), 1)
    split = Mesh(np.array(jax.devices()[:4]).reshape(1, 4), ("x", "y"))
    assert conv_flops(split, 4) <= 0.3 * one
    monkeypatch.setattr(core, "MAX_SPLIT_CONV", 0)
    assert conv_flops(split, 4) > 0.3 * one
