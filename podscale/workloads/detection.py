"""Single-shot detection pieces, after the MLPerf SSD reference (mlcommons/training,
``single_stage_detector/ssd``): default boxes, matching, box encoding, the loss with hard
negative mining, non-maximum suppression, and COCO mAP by pycocotools.

Boxes are ``(x0, y0, x1, y1)`` in [0, 1] image coordinates unless said otherwise. Matching and
encoding run on the host (numpy) when a batch is made, so the training step sees static shapes:
per image, a label for every default box (0 = background) and its encoded offsets.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

SCALE_XY, SCALE_WH = 0.1, 0.2
"""The reference's encoding variances (``Encoder``: ``scale_xy=0.1``, ``scale_wh=0.2``)."""
MATCH_IOU = 0.5
NEGATIVES_PER_POSITIVE = 3


@dataclasses.dataclass(frozen=True)
class DefaultBoxes:
    """SSD's default (anchor) boxes, as the reference's ``DefaultBoxes`` builds them.

    For feature map ``i`` of size ``f`` with stride ``steps[i]`` on a ``fig_size`` image: boxes of
    scale ``scales[i]`` and ``sqrt(scales[i] * scales[i + 1])`` (square), and ``scales[i]`` at
    each aspect ratio ``a`` and ``1 / a``, centred on every cell; ordered by box type, then row,
    then column, as the heads' outputs are reshaped.
    """

    fig_size: int
    feature_sizes: tuple[int, ...]
    steps: tuple[int, ...]
    scales: tuple[int, ...]
    aspect_ratios: tuple[tuple[int, ...], ...]

    def per_cell(self) -> tuple[int, ...]:
        return tuple(2 + 2 * len(a) for a in self.aspect_ratios)

    def xywh(self) -> np.ndarray:
        """``[num_boxes, 4]`` centre x, centre y, width, height, clipped to [0, 1]."""
        out = []
        for i, size in enumerate(self.feature_sizes):
            fk = self.fig_size / self.steps[i]
            sk1, sk2 = self.scales[i] / self.fig_size, self.scales[i + 1] / self.fig_size
            sizes = [(sk1, sk1), (math.sqrt(sk1 * sk2),) * 2]
            for alpha in self.aspect_ratios[i]:
                w, h = sk1 * math.sqrt(alpha), sk1 / math.sqrt(alpha)
                sizes += [(w, h), (h, w)]
            for w, h in sizes:
                for r, c in itertools.product(range(size), repeat=2):
                    out.append(((c + 0.5) / fk, (r + 0.5) / fk, w, h))
        return np.clip(np.asarray(out, np.float32), 0.0, 1.0)

    def ltrb(self) -> np.ndarray:
        return xywh_to_ltrb(self.xywh())


SSD300 = DefaultBoxes(
    fig_size=300,
    feature_sizes=(38, 19, 10, 5, 3, 1),
    steps=(8, 16, 32, 64, 100, 300),
    scales=(21, 45, 99, 153, 207, 261, 315),
    aspect_ratios=((2,), (2, 3), (2, 3), (2, 3), (2,), (2,)),
)
"""The MLPerf SSD300's 8732 default boxes (``dboxes300_coco`` in the reference's ``utils.py``)."""


def xywh_to_ltrb(b: np.ndarray) -> np.ndarray:
    return np.concatenate([b[..., :2] - b[..., 2:] / 2, b[..., :2] + b[..., 2:] / 2], axis=-1)


def ltrb_to_xywh(b: np.ndarray) -> np.ndarray:
    return np.concatenate([(b[..., :2] + b[..., 2:]) / 2, b[..., 2:] - b[..., :2]], axis=-1)


def iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``[len(a), len(b)]`` intersection over union of ltrb boxes (numpy or jax arrays)."""
    xp = jnp if isinstance(a, jax.Array) or isinstance(b, jax.Array) else np
    lt = xp.maximum(a[:, None, :2], b[None, :, :2])
    rb = xp.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = xp.prod(xp.clip(rb - lt, 0, None), axis=-1)
    area = lambda x: xp.prod(x[:, 2:] - x[:, :2], axis=-1)  # noqa: E731
    return inter / (area(a)[:, None] + area(b)[None, :] - inter)


def match(boxes: np.ndarray, labels: np.ndarray, defaults_ltrb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The reference's ``Encoder.encode``: each default box takes the object it overlaps most if
    that IoU exceeds 0.5, and each object takes its best default box regardless. Returns
    ``(labels [num_defaults] int32 with 0 = background, matched ltrb boxes [num_defaults, 4])``."""
    n = len(defaults_ltrb)
    if len(boxes) == 0:
        return np.zeros(n, np.int32), defaults_ltrb.copy()
    overlaps = iou(boxes, defaults_ltrb)  # [objects, defaults]
    best_obj_iou, best_obj = overlaps.max(0), overlaps.argmax(0)
    best_default = overlaps.argmax(1)
    best_obj_iou[best_default] = 2.0  # every object keeps its best default box
    best_obj[best_default] = np.arange(len(boxes))
    positive = best_obj_iou > MATCH_IOU  # the reference's ``best_dbox_ious > criteria``
    out_labels = np.where(positive, labels[best_obj], 0).astype(np.int32)
    out_boxes = np.where(positive[:, None], boxes[best_obj], defaults_ltrb).astype(np.float32)
    return out_labels, out_boxes


def encode(boxes_ltrb: np.ndarray, defaults_xywh: np.ndarray) -> np.ndarray:
    """Offsets of matched boxes from their default boxes, scaled by the reference's variances."""
    b = ltrb_to_xywh(boxes_ltrb)
    xy = (b[..., :2] - defaults_xywh[..., :2]) / (SCALE_XY * defaults_xywh[..., 2:])
    wh = np.log(np.maximum(b[..., 2:], 1e-9) / defaults_xywh[..., 2:]) / SCALE_WH
    return np.concatenate([xy, wh], axis=-1).astype(np.float32)


def decode(offsets, defaults_xywh):
    """``encode``'s inverse (jax): ltrb boxes from predicted offsets."""
    xy = offsets[..., :2] * SCALE_XY * defaults_xywh[..., 2:] + defaults_xywh[..., :2]
    wh = jnp.exp(offsets[..., 2:] * SCALE_WH) * defaults_xywh[..., 2:]
    return jnp.concatenate([xy - wh / 2, xy + wh / 2], axis=-1)


def _smooth_l1(x):
    a = jnp.abs(x)
    return jnp.where(a < 1.0, 0.5 * x * x, a - 0.5)


def ssd_loss(logits, offsets, labels, targets):
    """Per-image loss of the reference's ``Loss``: smooth-L1 over the positives' offsets plus
    cross-entropy over the positives and the ``3 x positives`` hardest by rank of the negatives'
    cross-entropy (positives ranked at 0), divided by the number of positives; an image without
    objects adds 0.

    ``logits [N, D, classes + 1]``, ``offsets [N, D, 4]``, ``labels [N, D]`` (0 = background),
    ``targets [N, D, 4]`` (encoded). Returns ``[N]`` float32.
    """
    logits, offsets = logits.astype(jnp.float32), offsets.astype(jnp.float32)
    positive = labels > 0
    num_pos = positive.sum(axis=1)
    box = (_smooth_l1(offsets - targets).sum(-1) * positive).sum(1)
    ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], axis=-1)[..., 0]
    negatives = jnp.where(positive, 0.0, ce)
    # Rank of each default box by its negative loss, hardest first (the reference's two sorts).
    order = jnp.argsort(-negatives, axis=1, stable=True)
    rank = jnp.argsort(order, axis=1, stable=True)
    hard = rank < jnp.minimum(NEGATIVES_PER_POSITIVE * num_pos, labels.shape[1])[:, None]
    # As the reference (``con * (mask + neg_mask)``): a positive whose rank falls among the
    # hardest (possible when there are fewer negatives than 3x the positives) counts twice.
    cls = (ce * (positive.astype(jnp.float32) + hard.astype(jnp.float32))).sum(1)
    return jnp.where(num_pos > 0, (box + cls) / jnp.maximum(num_pos, 1), 0.0)


def nms(boxes: np.ndarray, scores: np.ndarray, threshold: float, limit: int) -> np.ndarray:
    """Greedy non-maximum suppression (numpy): indices of kept boxes, best first, at most
    ``limit``; a box is dropped when its IoU with a kept one exceeds ``threshold``. Ties in score
    keep the lower index first."""
    order = np.argsort(-scores, kind="stable")
    keep: list[int] = []
    while order.size and len(keep) < limit:
        i = order[0]
        keep.append(int(i))
        if order.size == 1:
            break
        overlap = iou(boxes[i : i + 1], boxes[order[1:]])[0]
        order = order[1:][overlap <= threshold]
    return np.asarray(keep, np.int64)


def detect(
    logits: np.ndarray,
    offsets: np.ndarray,
    defaults_xywh: np.ndarray,
    score_threshold: float = 0.05,
    nms_threshold: float = 0.5,
    per_class: int = 200,
    limit: int = 200,
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The reference's post-processing per image: softmax scores; per class, the ``per_class``
    best boxes above ``score_threshold``, then NMS; the ``limit`` best over all classes. Returns per image
    ``(boxes ltrb [K, 4], scores [K], labels [K])`` (labels from 1)."""
    probs = np.asarray(jax.nn.softmax(jnp.asarray(logits, jnp.float32), axis=-1))
    boxes_all = np.asarray(decode(jnp.asarray(offsets, jnp.float32), jnp.asarray(defaults_xywh)))
    out = []
    for p, boxes in zip(probs, boxes_all, strict=True):
        found_b, found_s, found_l = [], [], []
        for c in range(1, p.shape[-1]):
            mask = p[:, c] > score_threshold
            if not mask.any():
                continue
            b, s = np.clip(boxes[mask], 0.0, 1.0), p[mask, c]
            top = np.argsort(-s, kind="stable")[:per_class]  # the reference's best 200 before NMS
            b, s = b[top], s[top]
            kept = nms(b, s, nms_threshold, per_class)
            found_b.append(b[kept])
            found_s.append(s[kept])
            found_l.append(np.full(len(kept), c, np.int32))
        if not found_b:
            out.append((np.zeros((0, 4), np.float32), np.zeros(0, np.float32), np.zeros(0, np.int32)))
            continue
        b, s, lab = np.concatenate(found_b), np.concatenate(found_s), np.concatenate(found_l)
        best = np.argsort(-s, kind="stable")[:limit]
        out.append((b[best], s[best], lab[best]))
    return out


def coco_map(
    truth: Sequence[tuple[np.ndarray, np.ndarray]],
    found: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]],
    size: tuple[int, int],
    num_classes: int,
) -> dict[str, float]:
    """COCO box AP by pycocotools (the MLPerf reference's evaluation). ``truth``: per image
    ``(ltrb boxes in [0, 1], labels from 1)``; ``found``: :func:`detect`'s output; ``size``:
    (height, width) in pixels. Returns ``{"map": AP@[.5:.95], "map50": AP@.5}``."""
    import contextlib
    import io

    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    h, w = size
    scale = np.array([w, h, w, h], np.float64)

    def coco_box(b):
        x0, y0, x1, y1 = (np.asarray(b, np.float64) * scale).tolist()
        return [x0, y0, x1 - x0, y1 - y0]

    images, annotations, results = [], [], []
    for i, ((tb, tl), (fb, fs, fl)) in enumerate(zip(truth, found, strict=True)):
        images.append({"id": i, "height": h, "width": w})
        for b, lab in zip(tb, tl, strict=True):
            box = coco_box(b)
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": i,
                    "category_id": int(lab),
                    "bbox": box,
                    "area": box[2] * box[3],
                    "iscrowd": 0,
                }
            )
        for b, s, lab in zip(fb, fs, fl, strict=True):
            results.append({"image_id": i, "category_id": int(lab), "bbox": coco_box(b), "score": float(s)})
    if not annotations:
        raise ValueError("coco_map: the held-out images hold no objects; nothing to score")
    gt = COCO()
    gt.dataset = {
        "images": images,
        "annotations": annotations,
        "categories": [{"id": c} for c in range(1, num_classes + 1)],
    }
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints its progress
        gt.createIndex()
        if not results:
            return {"map": 0.0, "map50": 0.0}
        dt = gt.loadRes(results)
        ev = COCOeval(gt, dt, "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return {"map": float(max(ev.stats[0], 0.0)), "map50": float(max(ev.stats[1], 0.0))}
