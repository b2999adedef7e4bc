"""Mask R-CNN with a ResNet-50 FPN backbone (MLPerf's heavy-weight detector), and a tiny config for CPU.

The model follows the MLPerf references: maskrcnn-benchmark (mlcommons/training
``object_detection``, ``e2e_mask_rcnn_R_50_FPN_1x.yaml``) and Google's TPU submission
(mlcommons/training_results_v0.7 ``Google/benchmarks/maskrcnn/implementations/
maskrcnn-research-TF-tpu-v3-1024``, ``mask_rcnn_params.py``), whose static shapes it shares:

- ResNet-50 (bottleneck stages of 3, 4, 6, 3 blocks, frozen batch norm, the stem and first stage
  frozen) and an FPN of 256 channels: P2-P5 from the stages, P6 by a stride-2 subsampling of P5;
- a region proposal network over P2-P6 (a shared 3x3 convolution, then per anchor an objectness
  logit and 4 box offsets; anchors of 8 x stride at aspect ratios (1, 1), (1.4, 0.7), (0.7, 1.4)),
  trained on 256 sampled anchors per image (half objects at most, IoU 0.7 / 0.3);
- proposals: per level the 2000 best (1000 at evaluation), NMS at 0.7, the 1000 best over the
  levels: a fixed number per image, so the step compiles once (``rcnn.select_proposals``);
- 512 regions sampled per image from the proposals and the objects (a quarter objects, IoU 0.5),
  pooled by RoIAlign (written with gathers, ``rcnn.roi_align``) from the level their size picks:
  7x7 for the box head (two 1024-wide layers, class scores and per-class offsets), 14x14 for the
  mask head (four 3x3 convolutions, a 2x upsampling, a 28x28 mask per class) on the objects' regions;
- the losses of the references: binary cross-entropy and smooth L1 (beta 1/9) for the RPN,
  cross-entropy and smooth L1 for the box head, per-pixel binary cross-entropy of the region's
  class mask for the mask head; each image's loss is its own sampled anchors' and regions' mean.

Evaluation: the box head on the proposals, per-class NMS at 0.5 of the scores above 0.05, the 100
best detections per image, their masks pasted into the image; COCO box and mask AP by pycocotools
(``rcnn.coco_ap``), logged as MLPerf's ``eval_accuracy`` ``{"BBOX": box AP, "SEGM": mask AP}``
as the reference logs it and the v0.7 checker asks; the run reaches its target when both do.

The tiny config is the same network with narrower stages, one block each and P2-P4, on 64x64
canvases of the digits detection set with instance masks (each glyph's inked pixels). Expected::

    podscale train --model maskrcnn --config tiny --steps 600 --eval-every 50 --target 0.5 --no-progress

The full config has no ImageNet-pretrained backbone to start from (the references load one; its
frozen batch norm and frozen stem and res2 are as theirs, at their initial values here): it is for
compiling, planning and projecting; the tiny config trains its backbone, batch norm included.
Deviations kept: boxes are continuous (no ``+1`` pixel widths), the detections' per-class NMS runs
on the 10 x ``detections`` best class scores of an image, and each image's losses are its own
sampled anchors' and regions' means.

Why one file of about 740 lines: it is one workload, as every other MLPerf workload here is one
module (its config, the network, its recipe and its evaluation, each read against the other); the
pieces Mask R-CNN shares with detection in general (anchors, matching, sampling, NMS, RoIAlign,
COCO AP) are in :mod:`podscale.workloads.rcnn`.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from mlperf_logging.mllog import constants as C

from podscale.workloads import rcnn
from podscale.workloads.base import Reference, Workload, evaluate_whole_set
from podscale.workloads.datasets import DigitDetection

ASPECT_RATIOS = ((1.0, 1.0), (1.4, 0.7), (0.7, 1.4))
"""Anchor (width, height) factors: Google's ``aspect_ratios``."""
BOX_WEIGHTS = (10.0, 10.0, 5.0, 5.0)
"""The box head's offset scales (the references' ``BBOX_REG_WEIGHTS``)."""


@dataclasses.dataclass(frozen=True)
class MaskRCNNConfig:
    global_batch: int
    per_core_batch: int
    train_steps: int
    source: str
    learning_rate: float
    warmup_steps: int
    decay_steps: tuple[int, ...]
    """Steps of the x0.1 drops."""
    weight_decay: float
    image_size: tuple[int, int]
    num_classes: int
    """Object classes, not counting the background."""
    stem_features: int
    stage_features: tuple[int, ...]
    """Each bottleneck stage's inner width (its output is 4x that)."""
    stage_blocks: tuple[int, ...]
    fpn_features: int
    max_level: int
    """The RPN's last level: the stages give P2 to P(1 + stages); levels past those subsample."""
    anchor_scale: float
    rpn_batch: int
    pre_nms_train: int
    post_nms_train: int
    pre_nms_eval: int
    post_nms_eval: int
    roi_batch: int
    head_features: int
    mask_convs: int
    mask_features: int
    gt_mask_size: int
    """Each object's mask, cropped at its box, arrives at this size (Google's ``gt_mask_size``)."""
    canonical: tuple[float, int]
    """(size, level): a region of that side pools from that level (the references' 224 and 4)."""
    max_objects: int
    detections: int
    channels: int = 3
    norm: str = "frozen"
    """``frozen``: the references' frozen batch norm (a fixed per-channel affine map, no
    parameters); ``batch``: batch norm trained from scratch (the tiny config)."""
    freeze_stages: int = 0
    """The stem and this many first stages are not trained (the references freeze the stem and
    res2: ``FREEZE_CONV_BODY_AT: 2``)."""
    momentum: float = 0.9
    decay_factor: float = 0.1
    warmup_factor: float = 0.0
    """The warmup's first learning rate as a fraction of the base (Google's ``lr_warmup_init``: 0)."""
    rpn_fg_fraction: float = 0.5
    rpn_positive: float = 0.7
    rpn_negative: float = 0.3
    rpn_nms: float = 0.7
    roi_fg_fraction: float = 0.25
    roi_fg_iou: float = 0.5
    box_pool: int = 7
    mask_pool: int = 14
    sampling_ratio: int = 2
    mask_size: int = 28
    score_threshold: float = 0.05
    nms_threshold: float = 0.5
    box_target: float = 0.0
    """The box AP a run must reach beside ``--target`` (the mask AP)."""
    spatial: int = 1
    """Partitions per image in the recipe (``--spatial``)."""
    train_size: int = 0
    eval_size: int = 0

    def __post_init__(self):
        stages = len(self.stage_blocks)
        checks = [
            (len(self.stage_features) == stages, "stage_features and stage_blocks need one entry per stage"),
            (self.max_level >= 1 + stages, f"max_level {self.max_level} is below the stages' last level {1 + stages}"),
            (
                self.mask_size == 2 * self.mask_pool,
                f"mask_size {self.mask_size} must be 2 x mask_pool ({self.mask_pool})",
            ),
            (
                self.roi_batch <= self.post_nms_train + self.max_objects,
                f"roi_batch {self.roi_batch} exceeds the candidates it samples from (post_nms_train "
                f"{self.post_nms_train} + max_objects {self.max_objects})",
            ),
            (0 < self.rpn_fg_fraction <= 1, f"rpn_fg_fraction {self.rpn_fg_fraction} is not in (0, 1]"),
            (0 < self.roi_fg_fraction <= 1, f"roi_fg_fraction {self.roi_fg_fraction} is not in (0, 1]"),
            (self.norm in ("frozen", "batch"), f"norm {self.norm!r}: use 'frozen' or 'batch'"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"MaskRCNNConfig: {message}")

    @property
    def levels(self) -> range:
        """The FPN levels the RPN runs on."""
        return range(2, self.max_level + 1)

    @property
    def roi_levels(self) -> range:
        """The levels regions pool from: those the backbone's stages give."""
        return range(2, 2 + len(self.stage_blocks))


_COCO_TRAIN = 118_287
FULL = MaskRCNNConfig(
    global_batch=128,
    per_core_batch=1,
    train_steps=16 * (_COCO_TRAIN // 128),
    source=(
        "MLPerf Training v0.7, Google TPU Mask R-CNN (mlcommons/training_results_v0.7 Google/benchmarks/maskrcnn: "
        "tpu-v4-16-TF/run_and_time.sh --train_batch_size=128 --hparams=first_lr_drop_step=9750,"
        "second_lr_drop_step=13000; implementations/maskrcnn-research-TF-tpu-v3-1024/mask_rcnn_params.py: "
        "momentum 0.9, learning_rate 0.16, lr_warmup_step 1000 from lr_warmup_init 0, use_bfloat16, "
        "image_size (832, 1344), gt_mask_size 112, num_classes 91, anchors 8 x stride on levels 2-6, RPN 256 "
        "anchors/image, 2000/1000 proposals, 512 regions/image; mask_rcnn_model.py: weight decay 1e-4 but "
        "not on batch norm or biases, biases' gradients x2, stem and res2 frozen, batch norm frozen); 16 "
        "epochs of 924 steps (its logs reach box AP 0.377 / mask AP 0.339 by epoch 15); the v3-1024 run "
        "splits each image 8 ways (--input_partition_dims=1,8,1); targets box AP 0.377, mask AP 0.339"
    ),
    learning_rate=0.16,
    warmup_steps=1000,
    decay_steps=(9750, 13000),
    weight_decay=1e-4,
    image_size=(832, 1344),
    num_classes=90,
    stem_features=64,
    stage_features=(64, 128, 256, 512),
    stage_blocks=(3, 4, 6, 3),
    fpn_features=256,
    max_level=6,
    anchor_scale=8.0,
    rpn_batch=256,
    pre_nms_train=2000,
    post_nms_train=1000,
    pre_nms_eval=1000,
    post_nms_eval=1000,
    roi_batch=512,
    head_features=1024,
    mask_convs=4,
    mask_features=256,
    gt_mask_size=112,
    canonical=(224.0, 4),
    max_objects=100,
    detections=100,
    freeze_stages=1,
    spatial=8,
    box_target=0.377,
)

TINY = MaskRCNNConfig(
    global_batch=32,
    per_core_batch=4,
    train_steps=600,
    source=(
        "tuned here for the digits detection set with masks: the full recipe's shape (SGD momentum 0.9, "
        "linear warmup from 0, weight decay off batch norm and biases, x0.1 at two steps), lr 0.02, "
        "batch norm trained from scratch (no pretrained backbone), P2-P4 with anchors of 4 x stride"
    ),
    learning_rate=0.02,
    warmup_steps=50,
    decay_steps=(420, 540),
    weight_decay=1e-4,
    image_size=(64, 64),
    num_classes=10,
    stem_features=16,
    stage_features=(8, 16, 32),
    stage_blocks=(1, 1, 1),
    fpn_features=32,
    max_level=4,
    anchor_scale=4.0,
    rpn_batch=64,
    pre_nms_train=128,
    post_nms_train=32,
    pre_nms_eval=128,
    post_nms_eval=32,
    roi_batch=16,
    head_features=128,
    sampling_ratio=1,
    mask_convs=2,
    mask_features=32,
    gt_mask_size=32,
    canonical=(32.0, 3),
    max_objects=3,
    detections=16,
    channels=1,
    norm="batch",
    train_size=4096,
    eval_size=256,
    box_target=0.6,
)


# -- the network ----------------------------------------------------------------------------------


class FrozenBatchNorm(nn.Module):
    """The references' ``FrozenBatchNorm2d``: a per-channel affine map from fixed statistics
    (buffers, not parameters: here the ``batch_stats`` collection, never updated)."""

    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        c = x.shape[-1]
        stat = lambda name, v: self.variable("batch_stats", name, lambda: jnp.full((c,), v, jnp.float32))  # noqa: E731
        scale, bias, mean, var = stat("scale", 1.0), stat("bias", 0.0), stat("mean", 0.0), stat("var", 1.0)
        mult = scale.value * jax.lax.rsqrt(var.value + 1e-5)
        return (x * mult.astype(x.dtype) + (bias.value - mean.value * mult).astype(x.dtype)).astype(self.dtype)


class _Norm(nn.Module):
    kind: str
    bn_axis: str | None
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x, train: bool):
        if self.kind == "frozen":
            return FrozenBatchNorm(self.dtype)(x)
        return nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name=self.bn_axis, dtype=self.dtype)(x)


class _Bottleneck(nn.Module):
    features: int
    strides: int
    norm: str
    bn_axis: str | None
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x, train: bool):
        norm = lambda y: _Norm(self.norm, self.bn_axis, self.dtype)(y, train)  # noqa: E731
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
        y = nn.relu(norm(conv(self.features, (1, 1))(x)))
        y = nn.relu(norm(conv(self.features, (3, 3), self.strides, padding=1)(y)))
        y = norm(conv(4 * self.features, (1, 1))(y))
        if x.shape[-1] != 4 * self.features or self.strides != 1:
            x = norm(conv(4 * self.features, (1, 1), self.strides)(x))
        return nn.relu(x + y)


class MaskRCNN(nn.Module):
    """``model(images)``: the detections (evaluation); ``model.apply(..., method=MaskRCNN.losses)``:
    each image's training loss. Images ``[N, H, W]`` or ``[N, H, W, C]``."""

    cfg: MaskRCNNConfig
    bn_axis: str | None = None
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        cfg, dt = self.cfg, self.dtype
        self.stem = nn.Conv(cfg.stem_features, (7, 7), 2, padding=3, use_bias=False, dtype=dt, name="stem")
        self.blocks = [
            [
                _Bottleneck(f, 2 if s > 0 and b == 0 else 1, cfg.norm, self.bn_axis, dt, name=f"res{s + 2}_{b}")
                for b in range(n)
            ]
            for s, (f, n) in enumerate(zip(cfg.stage_features, cfg.stage_blocks, strict=True))
        ]
        self.stem_norm = _Norm(cfg.norm, self.bn_axis, dt, name="stem_norm")
        c = cfg.fpn_features
        self.lateral = [nn.Conv(c, (1, 1), dtype=dt, name=f"fpn_lateral{level}") for level in cfg.roi_levels]
        self.fpn_out = [nn.Conv(c, (3, 3), padding=1, dtype=dt, name=f"fpn_output{level}") for level in cfg.roi_levels]
        small = nn.initializers.normal(0.01)
        a = len(ASPECT_RATIOS)
        self.rpn_conv = nn.Conv(c, (3, 3), padding=1, kernel_init=small, dtype=dt, name="rpn_conv")
        self.rpn_logits = nn.Conv(a, (1, 1), kernel_init=small, dtype=dt, name="rpn_logits")
        self.rpn_boxes = nn.Conv(4 * a, (1, 1), kernel_init=small, dtype=dt, name="rpn_boxes")
        k = cfg.num_classes + 1
        self.fc6 = nn.Dense(cfg.head_features, dtype=dt, name="fc6")
        self.fc7 = nn.Dense(cfg.head_features, dtype=dt, name="fc7")
        self.cls_score = nn.Dense(k, kernel_init=small, dtype=dt, name="cls_score")
        self.bbox_pred = nn.Dense(4 * k, kernel_init=nn.initializers.normal(0.001), dtype=dt, name="bbox_pred")
        he = nn.initializers.variance_scaling(2.0, "fan_out", "normal")
        self.mask_fcn = [
            nn.Conv(cfg.mask_features, (3, 3), padding=1, kernel_init=he, dtype=dt, name=f"mask_fcn{i + 1}")
            for i in range(cfg.mask_convs)
        ]
        self.mask_up = nn.ConvTranspose(cfg.mask_features, (2, 2), (2, 2), kernel_init=he, dtype=dt, name="mask_up")
        self.mask_logits = nn.Conv(k, (1, 1), kernel_init=he, dtype=dt, name="mask_logits")

    # -- pieces ---------------------------------------------------------------------------------

    def features(self, images, train: bool) -> list[jax.Array]:
        """The FPN's maps, P2 to P(max_level), each ``[N, H / 2**l, W / 2**l, fpn_features]``."""
        x = images[..., None] if images.ndim == 3 else images
        x = self.stem(x.astype(self.dtype))
        x = nn.max_pool(nn.relu(self.stem_norm(x, train)), (3, 3), (2, 2), padding="SAME")
        if self.cfg.freeze_stages:
            x = jax.lax.stop_gradient(x)
        stages = []
        for s, blocks in enumerate(self.blocks):
            for block in blocks:
                x = block(x, train)
            if s < self.cfg.freeze_stages:
                x = jax.lax.stop_gradient(x)
            stages.append(x)
        inner = self.lateral[-1](stages[-1])
        outs = [self.fpn_out[-1](inner)]
        for i in range(len(stages) - 2, -1, -1):
            up = jnp.repeat(jnp.repeat(inner, 2, axis=1), 2, axis=2)  # nearest, x2
            inner = self.lateral[i](stages[i]) + up
            outs.insert(0, self.fpn_out[i](inner))
        while len(outs) < len(self.cfg.levels):  # P6: a 1x1 max-pool of stride 2 on the last
            outs.append(outs[-1][:, ::2, ::2])
        return outs

    def rpn(self, maps):
        """Per level: objectness logits ``[N, H*W*A]`` and box offsets ``[N, H*W*A, 4]``."""
        logits, offsets = [], []
        for m in maps:
            h = nn.relu(self.rpn_conv(m))
            n = m.shape[0]
            logits.append(self.rpn_logits(h).astype(jnp.float32).reshape(n, -1))
            offsets.append(self.rpn_boxes(h).astype(jnp.float32).reshape(n, -1, 4))
        return logits, offsets

    def box_head(self, pooled):
        n, r = pooled.shape[:2]
        x = pooled.reshape(n, r, -1).astype(self.dtype)
        x = nn.relu(self.fc7(nn.relu(self.fc6(x))))
        k = self.cfg.num_classes + 1
        return self.cls_score(x).astype(jnp.float32), self.bbox_pred(x).astype(jnp.float32).reshape(n, r, k, 4)

    def mask_head(self, pooled):
        n, r = pooled.shape[:2]
        x = pooled.reshape(n * r, *pooled.shape[2:]).astype(self.dtype)
        for conv in self.mask_fcn:
            x = nn.relu(conv(x))
        x = self.mask_logits(nn.relu(self.mask_up(x)))
        return x.astype(jnp.float32).reshape(n, r, *x.shape[1:])  # [N, R, 28, 28, classes + 1]

    def _anchors(self):
        cfg = self.cfg
        return [
            jnp.asarray(a.reshape(-1, 4))
            for a in rcnn.anchors(cfg.image_size, cfg.levels, cfg.anchor_scale, ASPECT_RATIOS)
        ]

    def _proposals(self, logits, offsets, pre: int, post: int):
        anchors = self._anchors()
        boxes = [rcnn.decode(jax.lax.stop_gradient(o), a) for o, a in zip(offsets, anchors, strict=True)]
        scores = [jax.lax.stop_gradient(s) for s in logits]
        select = functools.partial(
            rcnn.select_proposals,
            image_size=self.cfg.image_size,
            pre_nms=pre,
            post_nms=post,
            threshold=self.cfg.rpn_nms,
        )
        with jax.named_scope("proposals"):
            return jax.vmap(lambda s, b: select(s, b))(scores, boxes)

    def _pool(self, maps, boxes, output: int):
        cfg = self.cfg
        name = f"roi_align_{output}x{output}"
        with jax.named_scope(name):
            return rcnn.pool_regions(
                maps[: len(cfg.roi_levels)], boxes, cfg.roi_levels, output, cfg.sampling_ratio, cfg.canonical, name
            )

    # -- evaluation ------------------------------------------------------------------------------

    def __call__(self, images, train: bool = False):
        """The detections of each image: ``boxes [N, D, 4]`` (pixels), ``scores [N, D]``,
        ``labels [N, D]`` (from 1), ``valid [N, D]``, ``masks [N, D, 28, 28]`` (probabilities of
        the detection's class)."""
        cfg = self.cfg
        maps = self.features(images, train)
        logits, offsets = self.rpn(maps)
        proposals, _, valid = self._proposals(logits, offsets, cfg.pre_nms_eval, cfg.post_nms_eval)
        cls, deltas = self.box_head(self._pool(maps, proposals, cfg.box_pool))
        probs = jax.nn.softmax(cls, -1)[..., 1:]  # [N, P, classes]
        boxes = rcnn.clip_boxes(rcnn.decode(deltas[:, :, 1:], proposals[:, :, None], BOX_WEIGHTS), cfg.image_size)
        with jax.named_scope("detections"):
            det = jax.vmap(functools.partial(_detect, cfg=cfg))(probs, boxes, valid)
        masks = self.mask_head(self._pool(maps, det["boxes"], cfg.mask_pool))
        own = jnp.take_along_axis(masks, det["labels"][:, :, None, None, None], -1)[..., 0]
        det["masks"] = jax.nn.sigmoid(own)
        return det

    # -- training --------------------------------------------------------------------------------

    def losses(self, batch, train: bool = True, rng: jax.Array | None = None):
        """Each image's loss (``[N]``: RPN, box head and mask head) and its box head's accuracy
        over its sampled regions. The anchors and regions are sampled with ``fold_in(rng,
        index)`` per image (``rng``: the step's key; ``None``: a fixed key), so an image's sample
        depends on the step and the image, not on which replica or partition holds its row."""
        cfg = self.cfg
        h, w = cfg.image_size
        maps = self.features(batch["image"], train)
        logits, offsets = self.rpn(maps)
        gt_boxes = batch["boxes"] * jnp.array([w, h, w, h], jnp.float32)
        gt_labels = batch["labels"]
        base = jax.random.key(0) if rng is None else rng  # the step's key: new samples every step
        keys = jax.vmap(lambda i: jax.random.split(jax.random.fold_in(base, i)))(batch["index"])
        anchors = jnp.concatenate(self._anchors())
        with jax.named_scope("rpn_targets"):
            rpn = jax.vmap(functools.partial(_rpn_loss, anchors=anchors, cfg=cfg))(
                keys[:, 0], jnp.concatenate(logits, 1), jnp.concatenate(offsets, 1), gt_boxes, gt_labels
            )
        proposals, _, valid = self._proposals(logits, offsets, cfg.pre_nms_train, cfg.post_nms_train)
        with jax.named_scope("sample_regions"):
            regions = jax.vmap(functools.partial(_sample_regions, cfg=cfg))(
                keys[:, 1], proposals, valid, gt_boxes, gt_labels
            )
        cls, deltas = self.box_head(self._pool(maps, regions["rois"], cfg.box_pool))
        ce = -jnp.take_along_axis(jax.nn.log_softmax(cls), regions["classes"][..., None], -1)[..., 0]
        ok = regions["valid"].astype(jnp.float32)
        count = jnp.maximum(ok.sum(1), 1.0)
        box_cls = (ce * ok).sum(1) / count
        own = jnp.take_along_axis(deltas, regions["classes"][..., None, None], 2)[:, :, 0]
        targets = rcnn.encode(regions["gt_boxes"], regions["rois"], BOX_WEIGHTS)
        pos = regions["positive"].astype(jnp.float32)
        box_reg = (rcnn.smooth_l1(own - targets, 1.0).sum(-1) * pos).sum(1) / count
        quota = int(cfg.roi_fg_fraction * cfg.roi_batch)  # the sampler puts the objects first
        mask_rois, mask_pos = regions["rois"][:, :quota], pos[:, :quota]
        mask_logits = self.mask_head(self._pool(maps, mask_rois, cfg.mask_pool))
        mask_logits = jnp.take_along_axis(mask_logits, regions["classes"][:, :quota, None, None, None], -1)[..., 0]
        gt_index = regions["gt_index"][:, :quota]
        gt_masks = jnp.take_along_axis(batch["masks"], gt_index[:, :, None, None], 1)
        mask_gt_boxes = regions["gt_boxes"][:, :quota]
        with jax.named_scope("mask_targets"):
            mask_t = jax.vmap(functools.partial(rcnn.mask_targets, size=cfg.mask_size))(
                gt_masks, mask_gt_boxes, mask_rois
            )
        per_pixel = rcnn.sigmoid_cross_entropy(mask_logits, mask_t).mean((2, 3))
        mask = (per_pixel * mask_pos).sum(1) / jnp.maximum(mask_pos.sum(1), 1.0)
        correct = (jnp.argmax(cls, -1) == regions["classes"]).astype(jnp.float32)
        return {
            "loss": rpn["cls"] + rpn["box"] + box_cls + box_reg + mask,
            "accuracy": (correct * ok).sum(1) / count,
        }


def _rpn_loss(key, logits, offsets, gt_boxes, gt_labels, anchors, cfg: MaskRCNNConfig):
    labels, best = rcnn.anchor_labels(anchors, gt_boxes, gt_labels > 0, cfg.rpn_positive, cfg.rpn_negative)
    idx, ok, pos = rcnn.sample(key, labels, cfg.rpn_batch, cfg.rpn_fg_fraction)
    okf, posf = ok.astype(jnp.float32), pos.astype(jnp.float32)
    count = jnp.maximum(okf.sum(), 1.0)
    cls = (rcnn.sigmoid_cross_entropy(logits[idx], posf) * okf).sum() / count
    targets = rcnn.encode(gt_boxes[best[idx]], anchors[idx])
    box = (rcnn.smooth_l1(offsets[idx] - targets, 1.0 / 9).sum(-1) * posf).sum() / count
    return {"cls": cls, "box": box}


def _sample_regions(key, proposals, valid, gt_boxes, gt_labels, cfg: MaskRCNNConfig):
    gt_valid = gt_labels > 0
    candidates = jnp.concatenate([proposals, gt_boxes])
    usable = jnp.concatenate([valid, gt_valid])
    best, best_iou, _ = rcnn.match(candidates, gt_boxes, gt_valid)
    labels = jnp.where(usable, jnp.where(best_iou >= cfg.roi_fg_iou, 1, 0), -1)
    idx, ok, pos = rcnn.sample(key, labels, cfg.roi_batch, cfg.roi_fg_fraction)
    gt_index = best[idx]
    return {
        "rois": candidates[idx],
        "valid": ok,
        "positive": pos,
        "classes": jnp.where(pos, gt_labels[gt_index], 0),
        "gt_boxes": gt_boxes[gt_index],
        "gt_index": gt_index,
    }


def _detect(probs, boxes, valid, cfg: MaskRCNNConfig):
    """One image's detections from the box head: the scores above the threshold, per-class NMS
    (one NMS over boxes shifted apart by class), the ``detections`` best."""
    p, k = probs.shape
    scores = jnp.where(valid[:, None] & (probs > cfg.score_threshold), probs, -1.0).reshape(-1)
    labels = jnp.broadcast_to(jnp.arange(1, k + 1), (p, k)).reshape(-1)
    flat = boxes.reshape(-1, 4)
    top_s, top = jax.lax.top_k(scores, min(scores.shape[0], 10 * cfg.detections))
    shift = (labels[top] * (max(cfg.image_size) + 1)).astype(jnp.float32)[:, None]
    b = flat[top]
    nonempty = (b[:, 2] > b[:, 0]) & (b[:, 3] > b[:, 1]) & (top_s > 0)
    keep, found = rcnn.nms(b + shift, top_s, nonempty, cfg.nms_threshold, cfg.detections)
    return {
        "boxes": jnp.where(found[:, None], b[keep], 0.0),
        "scores": jnp.where(found, top_s[keep], 0.0),
        "labels": jnp.where(found, labels[top][keep], 1),
        "valid": found,
    }


def param_count(cfg: MaskRCNNConfig) -> int:
    return WORKLOAD.param_count("full" if cfg is FULL else "tiny")


REFERENCE_PARAMS = 44_401_393
REFERENCE_SOURCE = (
    "torchvision maskrcnn_resnet50_fpn, MaskRCNN_ResNet50_FPN_Weights.COCO_V1 (pytorch/vision "
    "torchvision/models/detection/mask_rcnn.py): num_params 44,401,393, 91 classes, frozen batch norm "
    "(buffers), box AP 37.9, mask AP 34.6"
)


# -- the workload ---------------------------------------------------------------------------------


def make_model(cfg: MaskRCNNConfig, policy, bn_axis: str | None) -> MaskRCNN:
    return MaskRCNN(cfg, bn_axis=bn_axis, dtype=policy.compute_dtype)


def batch_shapes(cfg: MaskRCNNConfig, global_batch: int) -> dict[str, jax.ShapeDtypeStruct]:
    h, w = cfg.image_size
    image = (h, w) + ((cfg.channels,) if cfg.channels > 1 else ())
    m, s = cfg.max_objects, cfg.gt_mask_size
    return {
        "image": jax.ShapeDtypeStruct((global_batch, *image), jnp.float32),
        "boxes": jax.ShapeDtypeStruct((global_batch, m, 4), jnp.float32),
        "labels": jax.ShapeDtypeStruct((global_batch, m), jnp.int32),
        "masks": jax.ShapeDtypeStruct((global_batch, m, s, s), jnp.float32),
        "index": jax.ShapeDtypeStruct((global_batch,), jnp.int32),
    }


def tiny_data(split: str = "train", size: int | None = None, cfg: MaskRCNNConfig | None = None) -> DigitDetection:
    cfg = cfg or TINY
    return DigitDetection(
        split, size=size, canvas=cfg.image_size[0], max_objects=cfg.max_objects, mask_size=cfg.gt_mask_size
    )


def make_data(cfg: MaskRCNNConfig, seed: int):
    del seed  # the canvases are a pure function of (split, index)
    if cfg.image_size != TINY.image_size:
        raise ValueError(
            "maskrcnn --config full trains on COCO 2017 (the MLPerf data set), which does not ship with podscale; "
            "use --config tiny (the digits detection set with instance masks)"
        )
    return tiny_data("train", cfg.train_size, cfg), tiny_data("test", cfg.eval_size, cfg)


def learning_rate_schedule(cfg: MaskRCNNConfig, total_steps: int):
    """Linear warmup from ``warmup_factor`` x the base, then x0.1 at each drop step; warmup and
    drops keep their share of the schedule when ``total_steps`` differs from ``train_steps``."""
    scale = total_steps / cfg.train_steps
    warmup = max(1, min(total_steps - 1, round(cfg.warmup_steps * scale)))
    drops = {max(1, round(d * scale)) - warmup: cfg.decay_factor for d in cfg.decay_steps if round(d * scale) > warmup}
    return optax.join_schedules(
        [
            optax.linear_schedule(cfg.warmup_factor * cfg.learning_rate, cfg.learning_rate, warmup),
            optax.piecewise_constant_schedule(cfg.learning_rate, drops),
        ],
        [warmup],
    )


def _groups(cfg: MaskRCNNConfig):
    """Each parameter's group: ``frozen`` (the stem and the first ``freeze_stages`` stages),
    ``bias`` (biases and batch norm's offset: no weight decay, twice the learning rate, as Google's
    ``mask_rcnn_model.py``), ``norm`` (batch norm's scale: no weight decay), or ``weight``."""
    stages = tuple(f"res{s + 2}_" for s in range(cfg.freeze_stages))

    def label(path, leaf):
        names = [str(getattr(p, "key", p)) for p in path]
        if cfg.freeze_stages and (names[0] in ("stem", "stem_norm") or names[0].startswith(stages)):
            return "frozen"
        if names[-1] == "scale":
            return "norm"
        if names[-1] == "bias" or leaf.ndim == 1:
            return "bias"
        return "weight"

    return lambda params: jax.tree_util.tree_map_with_path(label, params)


def make_optimizer(cfg: MaskRCNNConfig, total_steps: int):
    """SGD with momentum; weight decay (coupled) on the weights only; biases at twice the rate;
    batch norm's scale at the rate, without decay."""
    schedule = learning_rate_schedule(cfg, max(2, total_steps))
    return optax.multi_transform(
        {
            "weight": optax.chain(optax.add_decayed_weights(cfg.weight_decay), optax.sgd(schedule, cfg.momentum)),
            "bias": optax.sgd(lambda s: 2.0 * schedule(s), cfg.momentum),
            "norm": optax.sgd(schedule, cfg.momentum),
            "frozen": optax.set_to_zero(),
        },
        _groups(cfg),
    )


def hparams(cfg: MaskRCNNConfig, total_steps: int) -> dict:
    total_steps = max(2, total_steps)
    scale = total_steps / cfg.train_steps
    warmup = max(1, min(total_steps - 1, round(cfg.warmup_steps * scale)))
    return {
        C.OPT_NAME: C.SGD,
        C.OPT_BASE_LR: cfg.learning_rate,
        C.OPT_WEIGHT_DECAY: cfg.weight_decay,
        C.OPT_LR_WARMUP_STEPS: warmup,
        # As Google's log: the rate's rise per warmup step (base rate / warmup steps).
        C.OPT_LR_WARMUP_FACTOR: cfg.learning_rate / warmup,
        C.OPT_LR_DECAY_FACTOR: cfg.decay_factor,
        C.OPT_LR_DECAY_STEPS: [max(1, round(d * scale)) for d in cfg.decay_steps if round(d * scale) > warmup],
        C.NUM_IMAGE_CANDIDATES: cfg.post_nms_train,
        C.MIN_IMAGE_SIZE: min(cfg.image_size),
        C.MAX_IMAGE_SIZE: max(cfg.image_size),
    }


def init(model: MaskRCNN, rng: jax.Array, batch) -> dict:
    return model.init(rng, batch["image"], train=False)


def _losses(model, variables, batch, train: bool, rng=None):
    mutable = ["batch_stats"] if train and model.cfg.norm == "batch" else False
    out = model.apply(variables, batch, train=train, rng=rng, method=MaskRCNN.losses, mutable=mutable)
    return out if mutable else (out, {"batch_stats": variables.get("batch_stats", {})})


def train_loss(model: MaskRCNN, variables: dict, batch, rng: jax.Array | None = None):
    """Per image: the loss of the references (RPN + box head + mask head) and the box head's
    accuracy over the sampled regions."""
    per, updates = _losses(model, variables, batch, train=True, rng=rng)
    return per, updates["batch_stats"]


def eval_metrics(model: MaskRCNN, variables: dict, batch) -> dict[str, jax.Array]:
    return _losses(model, variables, batch, train=False)[0]


def predict(model: MaskRCNN, variables: dict, batch) -> dict[str, jax.Array]:
    """Each image's detections (:meth:`MaskRCNN.__call__`: boxes, scores, labels, valid and the
    28 x 28 mask probabilities of each)."""
    return model.apply(variables, batch["image"], train=False)


def score(model: MaskRCNN, det: dict, data, chunk: int = 64) -> dict[str, float]:
    """COCO box and mask AP of the whole held-out set's detections: their masks pasted into the
    canvas, pycocotools."""
    cfg = model.cfg
    h, w = cfg.image_size
    scale = np.array([w, h, w, h], np.float32)
    truth, found = [], []
    for start in range(0, len(data), chunk):
        rows = np.arange(start, min(start + chunk, len(data)))
        batch = data.get(rows)
        for j, i in enumerate(rows):
            lab = batch["labels"][j]
            truth.append((batch["boxes"][j][lab > 0] * scale, lab[lab > 0], data.instance_masks(int(i))))
            v = det["valid"][i]
            boxes = det["boxes"][i][v]
            found.append(
                (boxes, det["scores"][i][v], det["labels"][i][v], rcnn.paste_masks(det["masks"][i][v], boxes, (h, w)))
            )
    return rcnn.coco_ap(truth, found, (h, w), cfg.num_classes)


def evaluate(model: MaskRCNN, variables: dict, data, chunk: int = 64) -> dict[str, float]:
    """:func:`score` of :func:`predict` over the whole held-out set, on one device."""
    return evaluate_whole_set(predict, score, model, variables, data, chunk)


def mlperf_accuracy(results: dict[str, float]) -> dict[str, float]:
    """MLPerf's ``eval_accuracy`` for Mask R-CNN: ``{"BBOX": box AP, "SEGM": mask AP}``."""
    return {"BBOX": results["box_ap"], "SEGM": results["mask_ap"]}


WORKLOAD = Workload(
    name="maskrcnn",
    description="Mask R-CNN, ResNet-50 FPN, COCO detection and instance masks (MLPerf), SGD with momentum",
    configs={"full": FULL, "tiny": TINY},
    reference=Reference(params=REFERENCE_PARAMS, source=REFERENCE_SOURCE),
    make_model=make_model,
    batch_shapes=batch_shapes,
    make_data=make_data,
    make_optimizer=make_optimizer,
    init=init,
    train_loss=train_loss,
    eval_metrics=eval_metrics,
    eval_metric="mask_ap",
    hparams=hparams,
    predict=predict,
    score=score,
    mlperf_accuracy=mlperf_accuracy,
    quality=lambda cfg: {"box_ap": cfg.box_target},
    samples=True,
)
