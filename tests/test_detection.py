"""SSD's pieces against direct references: default boxes, matching, encoding, the loss with hard
negative mining, NMS, pycocotools mAP, and the digits detection set."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from podscale.workloads import detection as D
from podscale.workloads.datasets import DigitDetection


def test_ssd300_has_the_mlperf_8732_default_boxes():
    boxes = D.SSD300.xywh()
    assert D.SSD300.per_cell() == (4, 6, 6, 6, 4, 4)
    assert boxes.shape == (8732, 4) and boxes.min() >= 0 and boxes.max() <= 1
    # The first feature map's first box: centre of cell (0, 0) of 38 at stride 8, scale 21/300.
    np.testing.assert_allclose(boxes[0], [0.5 / (300 / 8), 0.5 / (300 / 8), 21 / 300, 21 / 300], rtol=1e-6)


def test_match_takes_overlaps_of_half_and_every_objects_best_box():
    defaults = np.array(
        [[0, 0, 0.5, 0.5], [0.5, 0.5, 1, 1], [0, 0.5, 0.5, 1], [0.1, 0.1, 0.6, 0.6], [0, 0, 0.5, 0.25]], np.float32
    )
    boxes = np.array([[0, 0, 0.5, 0.5], [0.55, 0.55, 0.7, 0.7]], np.float32)  # the second overlaps < 0.5
    labels, matched = D.match(boxes, np.array([3, 7]), defaults)
    # Box 3 overlaps object 0 by 0.47 and box 4 by exactly 0.5 (not more): background; object 1's
    # best box (1) is forced.
    assert labels.tolist() == [3, 7, 0, 0, 0]
    np.testing.assert_array_equal(matched[:2], boxes)
    empty_labels, _ = D.match(np.zeros((0, 4), np.float32), np.zeros(0, np.int32), defaults)
    assert empty_labels.tolist() == [0, 0, 0, 0, 0]


def test_encode_and_decode_are_inverse():
    defaults = D.SSD300.xywh()[:50]
    rng = np.random.default_rng(0)
    centre = defaults[:, :2] + rng.normal(0, 0.01, (50, 2))
    size = defaults[:, 2:] * np.exp(rng.normal(0, 0.1, (50, 2)))
    boxes = D.xywh_to_ltrb(np.concatenate([centre, size], -1)).astype(np.float32)
    back = np.asarray(D.decode(jnp.asarray(D.encode(boxes, defaults)), jnp.asarray(defaults)))
    np.testing.assert_allclose(back, boxes, atol=1e-6)


def _loss_reference(logits, offsets, labels, targets):
    """The reference's Loss.forward transcribed, one image at a time in numpy: ``con_neg`` zeroes
    the positives, ``con_rank`` ranks by it (descending), ``closs = con * (mask + neg_mask)``."""
    out = []
    for lg, of, lab, tg in zip(logits, offsets, labels, targets, strict=True):
        pos = lab > 0
        n = int(pos.sum())
        if n == 0:
            out.append(0.0)
            continue
        d = np.abs(of - tg)
        sl1 = np.where(d < 1, 0.5 * d * d, d - 0.5).sum(-1)[pos].sum()
        logp = lg - np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1, keepdims=True)) - lg.max(-1, keepdims=True)
        ce = -logp[np.arange(len(lab)), lab]
        con_neg = np.where(pos, 0.0, ce)
        con_idx = np.argsort(-con_neg, kind="stable")
        con_rank = np.argsort(con_idx, kind="stable")
        neg_mask = con_rank < min(3 * n, len(lab))
        out.append((sl1 + (ce * (pos.astype(float) + neg_mask.astype(float))).sum()) / n)
    return np.array(out)


def test_ssd_loss_mines_three_negatives_per_positive_like_the_reference():
    rng = np.random.default_rng(1)
    n, d, c = 3, 40, 5
    logits = rng.normal(size=(n, d, c)).astype(np.float32)
    offsets = rng.normal(size=(n, d, 4)).astype(np.float32)
    targets = rng.normal(size=(n, d, 4)).astype(np.float32)
    labels = np.zeros((n, d), np.int32)
    labels[0, [2, 9]] = [1, 4]
    labels[1, :20] = 2  # 20 positives: 3 x 20 > the 20 negatives, so all negatives count
    # image 2 has no objects: its loss is 0, not a division by zero
    loss = jax.jit(D.ssd_loss)  # one program, not op by op
    got = np.asarray(loss(jnp.asarray(logits), jnp.asarray(offsets), jnp.asarray(labels), jnp.asarray(targets)))
    np.testing.assert_allclose(got, _loss_reference(logits, offsets, labels, targets), rtol=1e-5)
    assert got[2] == 0.0


def test_nms_keeps_the_best_of_overlapping_boxes_ties_by_index_and_handles_empty():
    boxes = np.array([[0, 0, 1, 1], [0, 0, 1, 0.95], [0, 0, 0.2, 0.2], [0, 0, 1, 1]], np.float32)
    scores = np.array([0.9, 0.8, 0.7, 0.9], np.float32)
    assert D.nms(boxes, scores, 0.5, 10).tolist() == [0, 2]  # 3 ties with 0 and overlaps it: dropped
    assert D.nms(boxes, scores, 0.5, 1).tolist() == [0]
    assert D.nms(np.zeros((0, 4), np.float32), np.zeros(0, np.float32), 0.5, 10).tolist() == []


def test_coco_map_is_one_for_exact_detections_and_lower_for_wrong_classes():
    truth = [(np.array([[0.1, 0.1, 0.4, 0.5]]), np.array([2])), (np.array([[0.5, 0.5, 0.9, 0.8]]), np.array([1]))]
    exact = [(b, np.array([0.9]), lab) for b, lab in truth]
    assert D.coco_map(truth, exact, (64, 64), 3)["map"] == pytest.approx(1.0)
    swapped = [(b, np.array([0.9]), 3 - lab) for b, lab in truth]
    assert D.coco_map(truth, swapped, (64, 64), 3)["map"] == 0.0
    nothing = [(np.zeros((0, 4)), np.zeros(0), np.zeros(0, np.int32)) for _ in truth]
    assert D.coco_map(truth, nothing, (64, 64), 3)["map"] == 0.0


def test_digit_detection_boxes_are_exact_and_objects_do_not_overlap():
    train, test = DigitDetection("train", size=64), DigitDetection("test", size=64)
    batch = train.get(np.arange(64))
    again = train.get(np.arange(64))
    np.testing.assert_array_equal(batch["image"], again["image"])  # a pure function of the index
    assert not np.array_equal(batch["image"], test.get(np.arange(64))["image"])
    for image, boxes, labels in zip(batch["image"], batch["boxes"], batch["labels"], strict=True):
        present = labels > 0
        assert 1 <= present.sum() <= 3 and set(labels[present]) <= set(range(1, 11))
        ink = np.zeros_like(image, bool)
        for b in boxes[present]:
            x0, y0, x1, y1 = np.round(b * 64).astype(int)
            region = image[y0:y1, x0:x1]
            assert region[0].any() and region[-1].any() and region[:, 0].any() and region[:, -1].any()  # tight
            assert not ink[y0:y1, x0:x1].any()  # no two objects overlap
            ink[y0:y1, x0:x1] = True
        assert not image[~ink].any()  # every inked pixel is inside a box


def test_digit_detection_refuses_sizes_that_do_not_fit():
    with pytest.raises(ValueError, match="min_size <= max_size <= canvas"):
        DigitDetection(min_size=40, max_size=30)
