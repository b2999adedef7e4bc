"""Two-stage detection pieces for Mask R-CNN, in jax with static shapes, after the MLPerf
references (mlcommons/training ``maskrcnn-benchmark``; Google's TPU submission,
mlcommons/training_results_v0.7 ``Google/benchmarks/maskrcnn``): multi-level anchors, the box
coder, anchor and proposal matching, sampling, non-maximum suppression, RoIAlign, mask targets,
the losses, and COCO box and mask AP by pycocotools.

Boxes are ``(x0, y0, x1, y1)`` in pixels. Everything that runs in the training step has a shape
fixed by the config (a fixed number of proposals per image, of sampled anchors and regions, with a
validity mask where an image has fewer), so the step compiles once. Random sampling (the
references' random subsets of anchors and regions) draws from a key made of the example's own
index, so it is a function of the example, not of where its row lands in a data-parallel batch.

Under spatial partitioning the feature maps are split along their height; the per-anchor scores
and boxes (a few numbers per anchor), which proposal selection ranks over the whole image, are
what XLA gathers; RoIAlign reads the split maps by gathers that XLA partitions: each partition
answers the sample points in its own rows (zero elsewhere) and every gathered sample is
all-reduced over the partitions. No map is gathered whole, but the samples (4 corners x the
bins' points x every level) can outnumber a small map's pixels: the plan shows their bytes.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from podscale.parallel.regions import sum_over_blocks

BOX_CLIP = math.log(1000.0 / 16)
"""The largest log-scale a predicted width or height offset may take (the references' clip)."""


def anchors(image_size: tuple[int, int], levels: range, scale: float, aspect_ratios) -> list[np.ndarray]:
    """Per level ``l`` (stride ``2**l``): ``[H_l, W_l, A, 4]`` boxes of side ``scale * 2**l``
    and aspect ratios ``(w, h)`` factors (Google's ``(1.0, 1.0), (1.4, 0.7), (0.7, 1.4)``),
    centred on every cell, as the level's head outputs are laid out."""
    h, w = image_size
    out = []
    for level in levels:
        stride = 2**level
        if h % stride or w % stride:
            raise ValueError(f"image size {image_size} is not a multiple of level {level}'s stride {stride}")
        ys = (np.arange(h // stride) + 0.5) * stride
        xs = (np.arange(w // stride) + 0.5) * stride
        half = np.array([[scale * stride * aw / 2, scale * stride * ah / 2] for aw, ah in aspect_ratios])
        cy, cx = np.meshgrid(ys, xs, indexing="ij")
        centre = np.stack([cx, cy], -1)[:, :, None, :]
        out.append(np.concatenate([centre - half, centre + half], -1).astype(np.float32))
    return out


def encode(boxes, reference, weights=(1.0, 1.0, 1.0, 1.0)):
    """Offsets of ``boxes`` from ``reference`` (both ltrb), scaled by ``weights`` (the box head's
    are ``(10, 10, 5, 5)``)."""
    rw, rh = reference[..., 2] - reference[..., 0], reference[..., 3] - reference[..., 1]
    rx, ry = reference[..., 0] + 0.5 * rw, reference[..., 1] + 0.5 * rh
    bw, bh = boxes[..., 2] - boxes[..., 0], boxes[..., 3] - boxes[..., 1]
    bx, by = boxes[..., 0] + 0.5 * bw, boxes[..., 1] + 0.5 * bh
    wx, wy, ww, wh = weights
    safe = lambda v: jnp.maximum(v, 1e-6)  # noqa: E731
    return jnp.stack(
        [
            wx * (bx - rx) / safe(rw),
            wy * (by - ry) / safe(rh),
            ww * jnp.log(safe(bw) / safe(rw)),
            wh * jnp.log(safe(bh) / safe(rh)),
        ],
        -1,
    )


def decode(offsets, reference, weights=(1.0, 1.0, 1.0, 1.0)):
    """:func:`encode`'s inverse, with the width and height offsets clipped at ``BOX_CLIP``."""
    rw, rh = reference[..., 2] - reference[..., 0], reference[..., 3] - reference[..., 1]
    rx, ry = reference[..., 0] + 0.5 * rw, reference[..., 1] + 0.5 * rh
    wx, wy, ww, wh = weights
    x = offsets[..., 0] / wx * rw + rx
    y = offsets[..., 1] / wy * rh + ry
    w = jnp.exp(jnp.minimum(offsets[..., 2] / ww, BOX_CLIP)) * rw
    h = jnp.exp(jnp.minimum(offsets[..., 3] / wh, BOX_CLIP)) * rh
    return jnp.stack([x - 0.5 * w, y - 0.5 * h, x + 0.5 * w, y + 0.5 * h], -1)


def iou(a, b):
    """``[..., len(a), len(b)]`` intersection over union of ltrb boxes ``a [..., P, 4]`` and
    ``b [..., Q, 4]``; 0 where either box is empty."""
    lt = jnp.maximum(a[..., :, None, :2], b[..., None, :, :2])
    rb = jnp.minimum(a[..., :, None, 2:], b[..., None, :, 2:])
    inter = jnp.prod(jnp.clip(rb - lt, 0, None), -1)
    area = lambda x: jnp.prod(jnp.clip(x[..., 2:] - x[..., :2], 0, None), -1)  # noqa: E731
    union = area(a)[..., :, None] + area(b)[..., None, :] - inter
    return jnp.where(union > 0, inter / jnp.where(union > 0, union, 1.0), 0.0)


def clip_boxes(boxes, image_size: tuple[int, int]):
    h, w = image_size
    return jnp.stack(
        [
            jnp.clip(boxes[..., 0], 0, w),
            jnp.clip(boxes[..., 1], 0, h),
            jnp.clip(boxes[..., 2], 0, w),
            jnp.clip(boxes[..., 3], 0, h),
        ],
        -1,
    )


# -- matching and sampling -------------------------------------------------------------------------


def match(candidates, gt_boxes, gt_valid):
    """For each candidate ``[P, 4]``: its best ground-truth box among the valid ones of
    ``gt_boxes [M, 4]`` and that IoU (``-1`` when the image has none)."""
    overlaps = jnp.where(gt_valid[None, :], iou(candidates, gt_boxes), -1.0)
    return jnp.argmax(overlaps, 1), jnp.max(overlaps, 1), overlaps


def anchor_labels(anchors_ltrb, gt_boxes, gt_valid, positive: float, negative: float):
    """The RPN's anchor labels (``1`` object, ``0`` background, ``-1`` ignored) and each anchor's
    object: IoU at least ``positive`` is an object, below ``negative`` background, and every valid
    object also takes the anchors of its highest IoU (ties included), as the references'
    ``allow_low_quality_matches``. An image without objects has only background."""
    best, best_iou, overlaps = match(anchors_ltrb, gt_boxes, gt_valid)
    labels = jnp.where(best_iou >= positive, 1, jnp.where(best_iou < negative, 0, -1))
    per_gt = jnp.max(overlaps, 0)  # [M]
    low_quality = jnp.any((overlaps == per_gt[None, :]) & gt_valid[None, :] & (per_gt[None, :] > 0), 1)
    return jnp.where(low_quality, 1, labels), best


def sample(key, labels, size: int, positive_fraction: float):
    """The references' balanced sampler with static shapes: a random subset of at most
    ``positive_fraction * size`` positives (``labels == 1``), the rest filled with random
    negatives (``labels == 0``); ignored (``-1``) never taken. Returns ``(indices [size],
    valid [size], is_positive [size])``, positives first; slots past the candidates an image has
    are invalid."""
    n = labels.shape[0]
    if size > n:
        raise ValueError(f"sampling {size} of {n} candidates: the sample is larger than the candidates")
    priority = jax.random.uniform(key, (n,))
    if not 0 <= positive_fraction <= 1:
        raise ValueError(f"sampling: positive_fraction {positive_fraction} is not in [0, 1]")
    quota = int(positive_fraction * size)
    pos = labels == 1
    if quota:
        kth = jax.lax.top_k(jnp.where(pos, priority, -1.0), quota)[0][-1]
        pos = pos & (priority >= kth)
    else:
        pos = jnp.zeros_like(pos)
    # Positives rank above every negative, negatives above the rest; top_k keeps that order.
    rank = jnp.where(pos, 2.0 + priority, jnp.where(labels == 0, 1.0 + priority, -1.0))
    values, indices = jax.lax.top_k(rank, size)
    return indices, values >= 0, values >= 2


# -- proposals ---------------------------------------------------------------------------------


def nms(boxes, scores, valid, threshold: float, limit: int):
    """Greedy non-maximum suppression with static shapes: the candidates in decreasing score
    (ties: the lower index first), each dropped when its IoU with a kept one exceeds
    ``threshold``. Returns ``(indices [limit], valid [limit])`` of the kept, best first; slots
    past the kept ones are invalid (their index is 0)."""
    k = boxes.shape[0]
    order = jnp.argsort(jnp.where(valid, -scores, jnp.inf), stable=True)
    boxes, valid = boxes[order], valid[order]
    overlaps = iou(boxes, boxes)
    later = jnp.arange(k)[None, :] > jnp.arange(k)[:, None]

    def body(i, keep):
        suppress = keep[i] & later[i] & (overlaps[i] > threshold)
        return keep & ~suppress

    keep = jax.lax.fori_loop(0, k, body, valid)
    # The kept, in order, then the rest: a stable sort on (not kept).
    slots = jnp.argsort(~keep, stable=True)[:limit]
    found = keep[slots]
    if limit > k:
        pad = limit - k
        slots, found = jnp.pad(slots, (0, pad)), jnp.pad(found, (0, pad))
    return jnp.where(found, order[slots], 0), found


def select_proposals(scores, boxes, image_size, pre_nms: int, post_nms: int, threshold: float):
    """One image's proposals: per level the ``pre_nms`` best by objectness (ties: the lower
    index), NMS per level, then the ``post_nms`` best over the levels. ``scores``: per level
    ``[K_l]`` logits; ``boxes``: per level ``[K_l, 4]`` decoded boxes. Returns ``(boxes
    [post_nms, 4], scores [post_nms], valid [post_nms])``; invalid rows are zero boxes."""
    kept_boxes, kept_scores, kept_valid = [], [], []
    for s, b in zip(scores, boxes, strict=True):
        top_s, top = jax.lax.top_k(s, min(pre_nms, s.shape[0]))
        b = clip_boxes(b[top], image_size)
        nonempty = (b[:, 2] > b[:, 0]) & (b[:, 3] > b[:, 1])
        keep, found = nms(b, top_s, nonempty, threshold, min(post_nms, top.shape[0]))
        kept_boxes.append(b[keep])
        kept_scores.append(jnp.where(found, top_s[keep], -jnp.inf))
        kept_valid.append(found)
    b, s, v = jnp.concatenate(kept_boxes), jnp.concatenate(kept_scores), jnp.concatenate(kept_valid)
    order = jnp.argsort(-s, stable=True)[:post_nms]  # invalid rows (-inf) last
    b, s, v = b[order], s[order], v[order]
    if order.shape[0] < post_nms:
        pad = post_nms - order.shape[0]
        b, s, v = jnp.pad(b, ((0, pad), (0, 0))), jnp.pad(s, (0, pad), constant_values=-jnp.inf), jnp.pad(v, (0, pad))
    return jnp.where(v[:, None], b, 0.0), s, v


# -- RoIAlign -----------------------------------------------------------------------------------


def bilinear(fmap, y, x, start=0, height: int | None = None):
    """``fmap [H, W, C]`` at real pixel coordinates ``y, x`` (any equal shapes), by four gathers,
    with torchvision's ``roi_align`` rule: a point more than one pixel outside reads 0, one
    within a pixel of the border reads the border.

    ``fmap`` may hold only the rows ``[start, start + fmap.shape[0])`` of a map of ``height`` rows
    (a block of a map split by height): the result is then these rows' share of each point, the
    upper and the lower row's terms each counted by the block that holds the row, so the shares
    of a map's blocks sum to the whole map's value."""
    h, w = (fmap.shape[0] if height is None else height), fmap.shape[1]
    outside = (y < -1.0) | (y > h) | (x < -1.0) | (x > w)
    y, x = jnp.clip(y, 0.0, None), jnp.clip(x, 0.0, None)
    y0, x0 = jnp.floor(y), jnp.floor(x)
    y0 = jnp.minimum(y0, h - 1)
    x0 = jnp.minimum(x0, w - 1)
    y = jnp.where(y0 >= h - 1, y0, y)
    x = jnp.where(x0 >= w - 1, x0, x)
    y1, x1 = jnp.minimum(y0 + 1, h - 1), jnp.minimum(x0 + 1, w - 1)
    ly, lx = y - y0, x - x0
    hy, hx = 1.0 - ly, 1.0 - lx
    yi0, yi1, xi0, xi1 = (v.astype(jnp.int32) for v in (y0, y1, x0, x1))

    def row(yi, wy):  # the row's two terms, where this block holds the row
        local = yi - start
        held = (local >= 0) & (local < fmap.shape[0])
        r = jnp.clip(local, 0, fmap.shape[0] - 1)
        terms = fmap[r, xi0] * (wy * hx)[..., None] + fmap[r, xi1] * (wy * lx)[..., None]
        return jnp.where(held[..., None], terms, 0.0)

    return jnp.where(outside[..., None], 0.0, row(yi0, hy) + row(yi1, ly))


def roi_align(
    fmap,
    boxes,
    output: int,
    sampling_ratio: int,
    spatial_scale: float,
    aligned: bool = False,
    start=0,
    height: int | None = None,
):
    """RoIAlign of ``boxes [R, 4]`` (image pixels) on one image's ``fmap [H, W, C]`` (a level of
    stride ``1 / spatial_scale``): ``[R, output, output, C]``, each bin the mean of
    ``sampling_ratio**2`` bilinear samples at regular points: torchvision's ``roi_align``, by
    default as maskrcnn-benchmark's ``ROIAlign`` (``aligned=False``: boxes at least a cell wide);
    ``aligned=True`` shifts the box by half a pixel (Detectron2's). ``start``, ``height``: ``fmap``
    is the block of rows ``[start, ...)`` of a map of ``height`` rows (see :func:`bilinear`)."""
    offset = 0.5 if aligned else 0.0
    b = boxes * spatial_scale - offset
    x0, y0 = b[:, 0], b[:, 1]
    bw, bh = b[:, 2] - b[:, 0], b[:, 3] - b[:, 1]
    if not aligned:
        bw, bh = jnp.maximum(bw, 1.0), jnp.maximum(bh, 1.0)
    # Sample points along one side: bin i, sample s at (i + (s + 0.5) / sr) / output of the side.
    frac = (jnp.arange(output)[:, None] + (jnp.arange(sampling_ratio)[None, :] + 0.5) / sampling_ratio) / output
    frac = frac.reshape(-1)  # [output * sr]
    ys = y0[:, None] + frac[None, :] * bh[:, None]  # [R, S]
    xs = x0[:, None] + frac[None, :] * bw[:, None]
    n = ys.shape[1]
    yy = jnp.broadcast_to(ys[:, :, None], (ys.shape[0], n, n))
    xx = jnp.broadcast_to(xs[:, None, :], (xs.shape[0], n, n))
    samples = bilinear(fmap, yy, xx, start, height)  # [R, S, S, C]
    r, c = samples.shape[0], samples.shape[-1]
    samples = samples.reshape(r, output, sampling_ratio, output, sampling_ratio, c)
    return samples.mean((2, 4))


def roi_levels(boxes, levels: range, canonical_size: float, canonical_level: int):
    """The FPN level each box is pooled from (the references' ``LevelMapper``):
    ``floor(canonical_level + log2(sqrt(area) / canonical_size))``, clamped to ``levels``."""
    area = jnp.clip(boxes[:, 2] - boxes[:, 0], 0, None) * jnp.clip(boxes[:, 3] - boxes[:, 1], 0, None)
    level = jnp.floor(canonical_level + jnp.log2(jnp.sqrt(area) / canonical_size + 1e-6))
    return jnp.clip(level, levels.start, levels.stop - 1).astype(jnp.int32)


def multilevel_roi_align(
    fmaps, boxes, levels: range, output: int, sampling_ratio: int, canonical, starts=None, heights=None
):
    """RoIAlign of each box on its level of the pyramid ``fmaps`` (one image's ``[H_l, W_l, C]``
    per level of ``levels``): ``[R, output, output, C]``. Every level is pooled and the box's own
    kept, so the shapes stay static. ``starts``, ``heights``: per level, ``fmaps`` hold the rows
    from ``start`` of maps of ``height`` rows (see :func:`bilinear`)."""
    level = roi_levels(boxes, levels, *canonical)
    starts = [0] * len(fmaps) if starts is None else starts
    heights = [None] * len(fmaps) if heights is None else heights
    out = 0.0
    for lvl, fmap, start, height in zip(levels, fmaps, starts, heights, strict=True):
        pooled = roi_align(fmap, boxes, output, sampling_ratio, 1.0 / 2**lvl, start=start, height=height)
        out = out + jnp.where((level == lvl)[:, None, None, None], pooled, 0.0)
    return out


def pool_regions(fmaps, boxes, levels: range, output: int, sampling_ratio: int, canonical, name: str):
    """:func:`multilevel_roi_align` of a batch (``fmaps``: per level ``[N, H_l, W_l, C]``, ``boxes
    [N, R, 4]``), marked as a sum over blocks of the maps' rows
    (:func:`podscale.parallel.regions.sum_over_blocks`): under a space axis each partition pools
    the samples that fall in its rows, and one sum of the pooled regions crosses the axis."""
    heights = [m.shape[1] for m in fmaps]

    def rows(blocks, starts, boxes):
        pool = functools.partial(
            multilevel_roi_align,
            levels=levels,
            output=output,
            sampling_ratio=sampling_ratio,
            canonical=canonical,
            starts=starts,
            heights=heights,
        )
        return jax.vmap(lambda fm, b: pool(fm, b))(blocks, boxes)

    return sum_over_blocks(rows, list(fmaps), boxes, dim=1, name=name)


def mask_targets(gt_masks, gt_boxes, rois, size: int):
    """The mask head's targets: each region's object mask, cut from the object's own mask
    ``gt_masks [R, S, S]`` (cropped at its box ``gt_boxes [R, 4]``, as Google's ``gt_mask_size``
    crops) at the region ``rois [R, 4]``, ``size x size``, binarized at 0.5."""
    s = gt_masks.shape[-1]
    frac = (jnp.arange(size) + 0.5) / size
    gw = jnp.maximum(gt_boxes[:, 2] - gt_boxes[:, 0], 1e-6)
    gh = jnp.maximum(gt_boxes[:, 3] - gt_boxes[:, 1], 1e-6)
    xs = rois[:, 0, None] + frac[None, :] * (rois[:, 2] - rois[:, 0])[:, None]
    ys = rois[:, 1, None] + frac[None, :] * (rois[:, 3] - rois[:, 1])[:, None]
    u = (xs - gt_boxes[:, 0, None]) / gw[:, None] * s - 0.5  # [R, size] in crop pixels
    v = (ys - gt_boxes[:, 1, None]) / gh[:, None] * s - 0.5
    vv = jnp.broadcast_to(v[:, :, None], (v.shape[0], size, size))
    uu = jnp.broadcast_to(u[:, None, :], (u.shape[0], size, size))
    inside = (vv >= -0.5) & (vv <= s - 0.5) & (uu >= -0.5) & (uu <= s - 0.5)
    values = jax.vmap(lambda m, y, x: bilinear(m[..., None], y, x)[..., 0])(gt_masks, vv, uu)
    return ((values >= 0.5) & inside).astype(jnp.float32)


# -- losses ---------------------------------------------------------------------------------------


def smooth_l1(x, beta: float):
    a = jnp.abs(x)
    return jnp.where(a < beta, 0.5 * x * x / beta, a - 0.5 * beta)


def sigmoid_cross_entropy(logits, labels):
    return jnp.maximum(logits, 0) - logits * labels + jnp.log1p(jnp.exp(-jnp.abs(logits)))


# -- evaluation -----------------------------------------------------------------------------------


def paste_masks(masks: np.ndarray, boxes: np.ndarray, size: tuple[int, int], threshold: float = 0.5) -> np.ndarray:
    """Each ``[M, M]`` mask probability map resized (bilinear) into its box of an image of
    ``size`` (height, width) and binarized, as the references' ``Masker``: ``[K, H, W]`` bool."""
    h, w = size
    out = np.zeros((len(masks), h, w), bool)
    m = masks.shape[-1]
    py, px = np.arange(h) + 0.5, np.arange(w) + 0.5
    for i, (mask, (x0, y0, x1, y1)) in enumerate(zip(masks, boxes, strict=True)):
        if x1 <= x0 or y1 <= y0:
            continue
        u = (px - x0) / (x1 - x0) * m - 0.5
        v = (py - y0) / (y1 - y0) * m - 0.5
        inside = ((v >= -0.5) & (v <= m - 0.5))[:, None] & ((u >= -0.5) & (u <= m - 0.5))[None, :]
        u, v = np.clip(u, 0, m - 1), np.clip(v, 0, m - 1)
        u0, v0 = np.floor(u).astype(int), np.floor(v).astype(int)
        u1, v1 = np.minimum(u0 + 1, m - 1), np.minimum(v0 + 1, m - 1)
        lu, lv = u - u0, v - v0
        top = mask[v0][:, u0] * (1 - lu) + mask[v0][:, u1] * lu
        bottom = mask[v1][:, u0] * (1 - lu) + mask[v1][:, u1] * lu
        value = top * (1 - lv)[:, None] + bottom * lv[:, None]
        out[i] = inside & (value >= threshold)
    return out


def coco_ap(truth, found, size: tuple[int, int], num_classes: int) -> dict[str, float]:
    """COCO box and mask AP by pycocotools (the references' evaluation). ``truth``: per image
    ``(boxes [K, 4] pixels, labels [K] from 1, masks [K, H, W] bool)``; ``found``: per image
    ``(boxes, scores, labels, masks)`` alike. Returns ``box_ap``, ``box_ap50``, ``mask_ap``,
    ``mask_ap50`` (AP@[.5:.95] and AP@.5)."""
    import contextlib
    import io

    from pycocotools import mask as mask_util
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    h, w = size

    def rle(m):
        r = mask_util.encode(np.asfortranarray(m.astype(np.uint8)))
        r["counts"] = r["counts"].decode("ascii")
        return r

    def xywh(b):
        x0, y0, x1, y1 = (float(v) for v in b)
        return [x0, y0, x1 - x0, y1 - y0]

    images, annotations, results = [], [], []
    for i, ((tb, tl, tm), (fb, fs, fl, fm)) in enumerate(zip(truth, found, strict=True)):
        images.append({"id": i, "height": h, "width": w})
        for b, lab, m in zip(tb, tl, tm, strict=True):
            box = xywh(b)
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": i,
                    "category_id": int(lab),
                    "bbox": box,
                    "area": float(m.sum()),
                    "iscrowd": 0,
                    "segmentation": rle(m),
                }
            )
        for b, s, lab, m in zip(fb, fs, fl, fm, strict=True):
            results.append(
                {"image_id": i, "category_id": int(lab), "bbox": xywh(b), "score": float(s), "segmentation": rle(m)}
            )
    if not annotations:
        raise ValueError("coco_ap: the held-out images hold no objects; nothing to score")
    gt = COCO()
    gt.dataset = {
        "images": images,
        "annotations": annotations,
        "categories": [{"id": c} for c in range(1, num_classes + 1)],
    }
    out = {}
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints its progress
        gt.createIndex()
        for kind, key in (("bbox", "box"), ("segm", "mask")):
            if not results:
                out[f"{key}_ap"] = out[f"{key}_ap50"] = 0.0
                continue
            ev = COCOeval(gt, gt.loadRes([dict(r) for r in results]), kind)
            ev.evaluate()
            ev.accumulate()
            ev.summarize()
            out[f"{key}_ap"], out[f"{key}_ap50"] = float(max(ev.stats[0], 0.0)), float(max(ev.stats[1], 0.0))
    return out
