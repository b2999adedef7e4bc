"""Mask R-CNN: its size and recipe against the published ones, its pieces against direct
references (RoIAlign, proposal selection, sampling, the loss of an image without objects), and its
step under spatial partitioning against one device on whole images (float64: see PARAMS_TOLERANCE)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import max_relative_diff

from podscale import data_parallel, make_mesh
from podscale.compiled import hlo
from podscale.parallel.plan import make_plan
from podscale.parallel.regions import shapes_only
from podscale.train.tasks import make_task, make_train_step
from podscale.workloads import maskrcnn, rcnn

STEPS = 2


def test_full_config_has_the_published_parameter_count_and_the_v07_recipe():
    count = maskrcnn.WORKLOAD.param_count("full")
    assert count == maskrcnn.REFERENCE_PARAMS  # the same layers as torchvision's, 91 classes
    cfg = maskrcnn.FULL
    assert cfg.global_batch == 128 and cfg.num_classes + 1 == 91 and cfg.spatial == 8
    schedule = maskrcnn.learning_rate_schedule(cfg, cfg.train_steps)
    assert float(schedule(0)) == 0.0 and float(schedule(500)) == pytest.approx(0.08)
    assert float(schedule(1000)) == pytest.approx(0.16) and float(schedule(9749)) == pytest.approx(0.16)
    assert float(schedule(9750)) == pytest.approx(0.016) and float(schedule(13000)) == pytest.approx(0.0016)
    from mlperf_logging.mllog import constants as C

    h = maskrcnn.hparams(cfg, cfg.train_steps)
    assert h[C.OPT_LR_DECAY_STEPS] == [9750, 13000] and h[C.OPT_LR_WARMUP_FACTOR] == pytest.approx(0.00016)
    assert h[C.NUM_IMAGE_CANDIDATES] == 1000 and h[C.OPT_BASE_LR] == 0.16


def test_the_recipe_freezes_the_stem_and_res2_and_spares_biases_weight_decay():
    cfg = maskrcnn.FULL
    model = maskrcnn.MaskRCNN(cfg)
    with shapes_only():
        variables = jax.eval_shape(
            lambda x: model.init(jax.random.key(0), x), jax.ShapeDtypeStruct((1, *cfg.image_size, 3), jnp.float32)
        )
    labels = maskrcnn.groups(cfg)(variables["params"])
    flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(labels)}
    assert flat["['stem']['kernel']"] == "frozen"
    assert all(v == "frozen" for k, v in flat.items() if k.startswith("['res2_"))
    assert flat["['res3_0']['Conv_0']['kernel']"] == "weight" and flat["['fc6']['bias']"] == "bias"
    # Frozen batch norm: its statistics and affine map are buffers (batch_stats), not parameters.
    assert variables["batch_stats"] and not any("BatchNorm" in k or "Frozen" in k for k in flat)


def _roi_align_reference(fmap, box, output, sr, scale, aligned):
    """torchvision's ``roi_align`` CPU kernel, point by point."""
    h, w, c = fmap.shape
    off = 0.5 if aligned else 0.0
    x0, y0, x1, y1 = (v * scale - off for v in box)
    bw, bh = x1 - x0, y1 - y0
    if not aligned:
        bw, bh = max(bw, 1.0), max(bh, 1.0)
    out = np.zeros((output, output, c))
    for i in range(output):
        for j in range(output):
            acc = np.zeros(c)
            for a in range(sr):
                for b in range(sr):
                    y = y0 + (i + (a + 0.5) / sr) * bh / output
                    x = x0 + (j + (b + 0.5) / sr) * bw / output
                    if y < -1.0 or y > h or x < -1.0 or x > w:
                        continue
                    y, x = max(y, 0.0), max(x, 0.0)
                    yl, xl = int(y), int(x)
                    if yl >= h - 1:
                        yh = yl = h - 1
                        y = float(yl)
                    else:
                        yh = yl + 1
                    if xl >= w - 1:
                        xh = xl = w - 1
                        x = float(xl)
                    else:
                        xh = xl + 1
                    ly, lx = y - yl, x - xl
                    acc += (
                        (1 - ly) * (1 - lx) * fmap[yl, xl]
                        + (1 - ly) * lx * fmap[yl, xh]
                        + ly * (1 - lx) * fmap[yh, xl]
                        + ly * lx * fmap[yh, xh]
                    )
            out[i, j] = acc / (sr * sr)
    return out


@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("sr", [1, 2])
def test_roi_align_equals_direct_bilinear_interpolation(sr, aligned):
    rng = np.random.default_rng(sr)
    fmap = rng.normal(size=(12, 10, 3)).astype(np.float32)
    boxes = np.array(
        [[3.0, 5.0, 30.0, 41.0], [-6.0, -4.0, 10.0, 8.0], [30.0, 40.0, 47.0, 55.0], [8.0, 8.0, 8.5, 9.0]], np.float32
    )  # inside, over the top-left border, over the bottom-right one, smaller than a pixel
    got = jax.jit(rcnn.roi_align, static_argnums=(2, 3, 4, 5))(
        jnp.asarray(fmap), jnp.asarray(boxes), 5, sr, 0.25, aligned
    )
    for box, g in zip(boxes, np.asarray(got), strict=True):
        want = _roi_align_reference(fmap.astype(np.float64), box, 5, sr, 0.25, aligned)
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5)


def test_nms_and_proposal_selection_break_ties_by_index_and_pad_empty_images():
    nms = jax.jit(rcnn.nms, static_argnums=(3, 4))  # one program each, not op by op
    select_proposals = jax.jit(rcnn.select_proposals, static_argnums=(2, 3, 4, 5))
    boxes = jnp.array([[0, 0, 10, 10], [0, 0, 10, 10], [20, 20, 30, 30], [1, 1, 10, 10]], jnp.float32)
    scores = jnp.array([0.5, 0.5, 0.5, 0.9])
    keep, found = nms(boxes, scores, jnp.ones(4, bool), 0.7, 4)
    # 3 is best; 0 and 1 (IoU 0.81 with it) go; 2 stays. Equal scores keep the lower index first.
    assert keep.tolist()[:2] == [3, 2] and found.tolist() == [True, True, False, False]
    keep, found = nms(boxes[:3], scores[:3], jnp.ones(3, bool), 0.99, 3)
    assert keep.tolist() == [0, 2, 0] and found.tolist() == [True, True, False]  # 1 duplicates 0
    # Proposal selection: a level of tied scores takes the lowest indices; an image whose boxes
    # are all empty has no valid proposal, and its rows are zero boxes.
    level = jnp.zeros(6)
    spread = jnp.array([[0, 0, 4, 4], [10, 0, 14, 4], [20, 0, 24, 4], [30, 0, 34, 4], [40, 0, 44, 4], [50, 0, 54, 4]])
    b, s, v = select_proposals([level], [spread.astype(jnp.float32)], (64, 64), 3, 4, 0.7)
    assert v.tolist() == [True, True, True, False] and b[:3, 0].tolist() == [0, 10, 20]
    empty = jnp.zeros((6, 4), jnp.float32)
    b, s, v = select_proposals([level], [empty], (64, 64), 3, 4, 0.7)
    assert not v.any() and not b.any() and bool(jnp.all(s == -jnp.inf))


def test_sampler_takes_positives_up_to_the_quota_first_and_never_an_ignored_candidate():
    sample = jax.jit(rcnn.sample, static_argnums=(2, 3))  # one program, not op by op
    labels = jnp.array([1] * 10 + [-1] * 5 + [0] * 20)
    idx, ok, pos = sample(jax.random.key(0), labels, 16, 0.25)
    assert ok.all() and pos.tolist() == [True] * 4 + [False] * 12
    assert all(labels[i] == 1 for i in idx[:4]) and all(labels[i] == 0 for i in idx[4:])
    few = jnp.array([1, -1, 0, -1, -1, -1])  # fewer candidates than the sample: padded slots invalid
    idx, ok, pos = sample(jax.random.key(1), few, 4, 0.5)
    assert ok.tolist() == [True, True, False, False] and pos.tolist() == [True, False, False, False]


def test_anchor_labels_keep_each_objects_best_anchor_and_an_empty_image_is_background():
    anchors = jnp.array([[0, 0, 10, 10], [0, 0, 20, 20], [30, 30, 40, 40]], jnp.float32)
    gt = jnp.array([[0, 0, 14, 14], [0, 0, 0, 0]], jnp.float32)
    anchor_labels = jax.jit(rcnn.anchor_labels, static_argnums=(3, 4))  # one program, not op by op
    labels, best = anchor_labels(anchors, gt, jnp.array([True, False]), 0.7, 0.3)
    # IoU 0.51 and 0.49: neither passes 0.7, the best one is the object's by the low-quality rule.
    assert labels.tolist() == [1, -1, 0] and best.tolist()[0] == 0
    labels, _ = anchor_labels(anchors, gt, jnp.array([False, False]), 0.7, 0.3)
    assert labels.tolist() == [0, 0, 0]


def test_mask_targets_of_the_objects_own_box_are_its_crop():
    crop = np.zeros((1, 8, 8), np.float32)
    crop[0, 2:6, 1:4] = 1.0
    box = jnp.array([[8.0, 16.0, 24.0, 32.0]])
    mask_targets = jax.jit(rcnn.mask_targets, static_argnums=3)  # one program, not op by op
    got = mask_targets(jnp.asarray(crop), box, box, 8)
    np.testing.assert_array_equal(np.asarray(got), crop)
    half = mask_targets(jnp.asarray(crop), box, jnp.array([[8.0, 16.0, 40.0, 48.0]]), 8)
    assert np.asarray(half)[0, 4:, :].sum() == 0 and np.asarray(half)[0, 1:3, 0:2].all()  # outside the box: 0


def test_pasted_masks_and_coco_ap_of_perfect_detections():
    masks = np.ones((1, 28, 28), np.float32)
    pasted = rcnn.paste_masks(masks, np.array([[4.0, 8.0, 20.0, 40.0]]), (64, 64))
    assert pasted[0].sum() == 16 * 32 and pasted[0, 8:40, 4:20].all()
    truth_mask = np.zeros((1, 64, 64), bool)
    truth_mask[0, 8:40, 4:20] = True
    truth = [(np.array([[4.0, 8.0, 20.0, 40.0]]), np.array([3]), truth_mask)]
    found = [(np.array([[4.0, 8.0, 20.0, 40.0]]), np.array([0.9]), np.array([3]), truth_mask)]
    ap = rcnn.coco_ap(truth, found, (64, 64), 10)
    assert ap["box_ap"] == pytest.approx(1.0) and ap["mask_ap"] == pytest.approx(1.0)


def _setup(size=8, dtype=jnp.float32):
    """The tiny model, its initial state and STEPS batches, in ``dtype`` (float64 needs x64 on:
    the parameters, batch statistics and images are widened, and the model computes in it)."""
    data = maskrcnn.tiny_data("train", size=size * STEPS)
    batches = [data.get(np.arange(i * size, (i + 1) * size)) for i in range(STEPS)]
    model = maskrcnn.MaskRCNN(maskrcnn.TINY, dtype=dtype)
    variables = jax.jit(lambda x: model.init(jax.random.key(0), x))(batches[0]["image"])
    widen = lambda x: np.asarray(x, dtype) if np.issubdtype(np.asarray(x).dtype, np.floating) else x  # noqa: E731
    variables = jax.tree.map(widen, jax.device_get(variables))
    batches = [jax.tree.map(widen, b) for b in batches]
    tx = maskrcnn.make_optimizer(maskrcnn.TINY, 100)
    state = (variables["params"], variables["batch_stats"], tx.init(variables["params"]))

    def step(state, batch):
        params, stats, opt = state

        def loss(p):
            per, new = maskrcnn.train_loss(model, {"params": p, "batch_stats": stats}, batch)
            return per["loss"].mean(), new

        (value, new_stats), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), new_stats, opt), {"loss": value}

    return model, step, state, batches


def test_loss_of_an_image_without_objects_is_its_backgrounds_alone_and_finite():
    """An image without objects: every anchor and region is background, so its loss is finite
    and positive (the RPN's and the box head's classification), and it gives the box
    regression and the mask head no gradient."""
    model, step, state, batches = _setup(size=2)
    batch = {k: np.array(v) for k, v in batches[0].items()}
    batch["labels"][0] = 0
    batch["boxes"][0] = 0.0
    batch["masks"][0] = 0.0

    def first(params, batch):
        per, _ = maskrcnn.train_loss(model, {"params": params, "batch_stats": state[1]}, batch)
        return per["loss"][0], per

    (_, per), grads = jax.jit(jax.value_and_grad(first, has_aux=True))(state[0], batch)
    assert np.isfinite(np.asarray(per["loss"])).all() and float(per["loss"][0]) > 0
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    assert float(jnp.abs(grads["mask_logits"]["kernel"]).max()) == 0.0
    assert float(jnp.abs(grads["bbox_pred"]["kernel"]).max()) == 0.0
    assert float(jnp.abs(grads["cls_score"]["kernel"]).max()) > 0.0  # the backgrounds' cross-entropy


_REFERENCE = {}

PARAMS_TOLERANCE = 1e-11
"""How far the partitioned run's parameters may be from one device's after STEPS steps, relative
(largest difference over the leaf's largest value), in float64. Measured: 2.8e-14 (1 x 4) and 2.7e-14
(8 replicas) after 2 steps.
Float32 cannot be held to a bound: the step is discontinuous at float32's rounding level. Its
ReLUs (box head fc6/fc7, mask head convolutions and upsampling, RPN conv, the backbone's) are
the references' own, and each step has about one of its ~3.3M ReLU inputs within float32
roundoff of 0 (a relative 1e-7 perturbation of the parameters flips 0 to 2 per step): a
reordered sum flips it, and that unit's whole share of the gradient (one region of 256, one
pixel of a 4x4 map) moves leaves by 1e-4 to 1e-2 (1 x 4 in float32: 3e-4 after step 2, 4e-2
after step 5). In float64 roundoff is 1e-16 and no ReLU is that close. The losses are held to
1e-12 at every step."""

LOSS_RTOL = 1e-12


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def _reference(step, state, batches):
    """One device: its states and losses over the STEPS steps (of batches of this size)."""
    size = len(batches[0]["index"])
    if size not in _REFERENCE:
        jstep, s, losses = jax.jit(step), state, []
        for batch in batches:
            s, metrics = jstep(s, batch)
            losses.append(float(metrics["loss"]))
        _REFERENCE[size] = jax.device_get(s), losses
    return _REFERENCE[size]


def test_reordering_rows_on_one_device_moves_the_parameters_as_far(x64):
    """The spec's own sensitivity (see PARAMS_TOLERANCE): the same STEPS steps with each batch's
    rows permuted on one device (each image's loss and gradient are the same; only their sums'
    order differs) do not end bit-identical, but within the tolerance the partitioned runs are
    held to; their losses stay within LOSS_RTOL."""
    model, step, state, batches = _setup(dtype=jnp.float64)
    want, losses = _reference(step, state, batches)
    perm = np.random.default_rng(0).permutation(len(batches[0]["index"]))
    jstep, s, got = jax.jit(step), state, []
    for batch in batches:
        s, metrics = jstep(s, jax.tree.map(lambda x: x[perm], batch))
        got.append(float(metrics["loss"]))
    assert 0 < max_relative_diff(jax.device_get(s), want) <= PARAMS_TOLERANCE
    np.testing.assert_allclose(got, losses, rtol=LOSS_RTOL)


@pytest.mark.parametrize(
    ("replicas", "k", "weight_update"),
    [(8, 1, "replicated"), (2, 4, "sharded"), (1, 8, "sharded")],
    ids=["8-replicas-replicated", "2x4-sharded", "one-replica-1x8-sharded"],
)
def test_tiny_maskrcnn_spatial_steps_equal_one_device(replicas, k, weight_update, x64):
    """k partitions per canvas on a replicas x k mesh (one replica: spatial partitioning alone,
    on all 8 devices; k = 1: plain data parallelism over 8 replicas): the whole model
    (backbone, RPN, anchor matching, proposals, RoIAlign, heads) on the partitions, STEPS chained
    steps against one device's on whole canvases: every step's loss within LOSS_RTOL relative,
    the parameters and optimizer state within PARAMS_TOLERANCE."""
    # 8 images a step (half the run time of 16), 16 for 8 replicas: with one image per replica the
    # losses were 8e-8 off one device's, with two within LOSS_RTOL. The heads cast their outputs to
    # float32 and the losses reduce them in float32 (the model's own casts, kept under float64);
    # the likely cause, not yet confirmed, is XLA:CPU reducing a batch of one image's rows in
    # another order than a batch of several.
    model, step, state, batches = _setup(size=16 if k == 1 else 8, dtype=jnp.float64)
    want, want_losses = _reference(step, state, batches)
    assert max_relative_diff(want[0], state[0]) > 1e-3, "the parameters did not move: the check would be empty"
    mesh = make_mesh((replicas, k) if k > 1 else (replicas,), devices=jax.devices()[: replicas * k])
    dp = data_parallel(step, mesh, spatial=k, weight_update=weight_update, min_shard_size=64)
    placed, losses = dp.place_state(jax.device_get(state), batches[0]), []
    for batch in batches:
        placed, metrics = dp(placed, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, want_losses, rtol=LOSS_RTOL)
    assert max_relative_diff(dp.gather_state(placed), want) <= PARAMS_TOLERANCE
    if k == 1:
        return
    assert dict(zip(sorted(batches[0]), dp.placement.batch.images, strict=True)) == {
        "boxes": False,
        "image": True,
        "index": False,
        "labels": False,
        "masks": False,
    }
    if (replicas, k, weight_update) == (2, 4, "sharded"):
        # The plan of the program the workload runs: float32's (XLA's SPMD partitioner gathers the
        # float64 max-pool derivative's operand over the space axis; float32's it exchanges halos).
        with jax.enable_x64(False):
            _, step32, state32, batches32 = _setup()
            dp32 = data_parallel(step32, mesh, spatial=k, weight_update=weight_update, min_shard_size=64)
            dp32.place_state(jax.device_get(state32), batches32[0])
            _check_no_feature_map_is_gathered(dp32, batches32[0])


def _check_no_feature_map_is_gathered(dp, batch):
    """The plan lists what the space axis gathers or sums, per layer, with its bytes: the pooled
    regions (RoIAlign, a region partitioned by hand: each partition pools the samples in its rows,
    and one sum of the pooled regions crosses the axis) and the per-anchor values the proposals
    rank; no all-gather over the space axis is as large as one replica's P2 map (what gathering
    the maps RoIAlign reads would take). The space axis's bytes for RoIAlign are at most twice the
    pooled regions' (XLA's own partitioning of its gathers all-reduced every gathered sample:
    37 MiB per device per step here, against 3.1 MiB)."""
    module = hlo.read(dp.lower(dp.placement.stored_shapes(), batch).compile(), dp.mesh)
    whole_plan = make_plan(dp.placement, dp.trace, dp.grad_sum, dp.strategy, module)
    plan = whole_plan.spatial
    cfg = maskrcnn.TINY
    rows = len(batch["image"]) // dp.replicas
    quota = int(cfg.roi_fg_fraction * cfg.roi_batch)
    pooled = rows * (cfg.roi_batch * cfg.box_pool**2 + quota * cfg.mask_pool**2) * cfg.fpn_features * 4
    assert {r["name"]: r["by_hand"] for r in whole_plan.regions} == {"roi_align_7x7": True, "roi_align_14x14": True}
    roi = sum(g["bytes_per_device"] for g in plan["gathers"] if "roi_align" in g["layer"])
    assert pooled <= roi <= 2 * pooled, (roi, pooled)
    assert plan["halo_exchanges"] > 0 and plan["halo_bytes_per_device"] > 0
    layers = " ".join(g["layer"] for g in plan["gathers"])
    assert "roi_align_7x7" in layers and "roi_align_14x14" in layers and "proposals" in layers
    assert plan["gather_bytes_per_device"] == sum(g["bytes_per_device"] for g in plan["gathers"]) > 0
    p2 = rows * (cfg.image_size[0] // 4) * (cfg.image_size[1] // 4) * cfg.fpn_features * 4
    for c in module.collectives:
        if (
            c.kind == "all-gather" and dp.roles.space in c.axes and hlo.UPDATE_SCOPE not in c.op_name
        ):  # not the update's
            assert c.buffer_bytes * c.group_size < p2, (c.op_name[:200], c.buffer_bytes)


def test_the_performance_model_reads_its_flops_halos_and_gathers():
    """``podscale.projection.project.project`` (what ``podscale project`` runs) on the tiny Mask R-CNN,
    each image over the 2 cores of a TPU-v3 chip (2 chips, 2 replicas) against an image per core:
    the partitioned step's FLOPs per device fall, and its halo exchanges and what the space axis
    gathers or sums are costed, with their bytes. XLA:CPU's module, in this process (seconds to
    compile where XLA:TPU's takes a minute; the TPU path's costing and the command line are
    tests/test_tpu_project.py's and tests/test_project.py's)."""
    from podscale import Strategy
    from podscale.projection.project import project

    task = make_task("maskrcnn", config="tiny", with_data=False)
    tx = task.workload.make_optimizer(task.config, task.config.train_steps)
    step = make_train_step(task, tx)
    state = jax.eval_shape(lambda b: task.init_state(jax.random.key(0), tx, b), task.batch_shapes(2))
    common = dict(system="tpu-v3", chips=[2], strategies=["replicated"], replica_batch=1, compiler="cpu")
    (one,) = project(step, state, task.batch_shapes, **common)  # 4 replicas, an image each
    (two,) = project(step, state, task.batch_shapes, base=Strategy(spatial=2), **common)
    assert (one.global_batch, two.global_batch) == (4, 2) and list(two.mesh.values()) == [2, 2]
    assert 0 < two.flops_per_device < one.flops_per_device
    space = list(two.mesh)[-1]
    over_space = [c for c in two.collectives if list(c["axes"]) == [space] and c["buffer_bytes"] > 0]
    assert {"collective-permute", "all-reduce"} <= {c["kind"] for c in over_space}
    assert all(c["seconds"] > 0 for c in over_space)
