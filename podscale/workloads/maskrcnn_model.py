"""Mask R-CNN's network: a ResNet-50 FPN backbone, the region proposal network, the box and mask
heads (flax modules), and each image's losses and detections from them.

:class:`MaskRCNN` builds itself from a :class:`podscale.workloads.maskrcnn.MaskRCNNConfig`; the
workload (its configs, recipe, data and evaluation, and the references the network follows) is
:mod:`podscale.workloads.maskrcnn`, the pieces shared with detection in general (anchors,
matching, sampling, NMS, RoIAlign, mask targets) :mod:`podscale.workloads.rcnn`.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import flax.linen as nn
import jax
import jax.numpy as jnp

from podscale.workloads import rcnn

if TYPE_CHECKING:
    from podscale.workloads.maskrcnn import MaskRCNNConfig

ASPECT_RATIOS = ((1.0, 1.0), (1.4, 0.7), (0.7, 1.4))
"""Anchor (width, height) factors: Google's ``aspect_ratios``."""
BOX_WEIGHTS = (10.0, 10.0, 5.0, 5.0)
"""The box head's offset scales (the references' ``BBOX_REG_WEIGHTS``)."""


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
