"""SSD300 with a ResNet-34 backbone (MLPerf's single-shot detector), and a tiny config for CPU.

The model follows the MLPerf reference (mlcommons/training ``single_stage_detector/ssd``,
``ssd300.py``): torchvision's ResNet-34 through its third stage (``conv4_x``) with that stage's
stride set to 1, so a 300x300 image gives a 38x38 map of 256 channels; five extra blocks (a 1x1
convolution, then a 3x3 one, stride 2 for the first three, valid padding for the last two) give
maps of 19, 10, 5, 3 and 1; a 3x3 convolution per map predicts, for each of its 4, 6, 6, 6, 4, 4
default boxes per cell, 4 box offsets and 81 class scores (80 COCO classes and background):
8732 boxes (:data:`podscale.workloads.detection.SSD300`).

The tiny config is the same network with narrower stages and one block each, on 64x64 canvases
of the digits detection set (:class:`podscale.train.data.DigitDetection`), with four maps of 8,
4, 2 and 1 and 340 default boxes.

Not yet a registered workload (``podscale train --model ssd``): its evaluation is COCO mAP over
the whole held-out set (``detection.coco_map``), which the trainer's per-example evaluation does
not compute yet. The model, its step and its data are exact under spatial partitioning
(tests/test_ssd.py).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from podscale.train.data import DigitDetection
from podscale.workloads import detection
from podscale.workloads.detection import DefaultBoxes


@dataclasses.dataclass(frozen=True)
class SSDConfig:
    image_size: int
    num_classes: int
    """Object classes, not counting the background."""
    boxes: DefaultBoxes
    stem_features: int
    stage_features: tuple[int, ...]
    stage_blocks: tuple[int, ...]
    extra: tuple[tuple[int, int, int, str], ...]
    """Per extra block: (1x1 features, 3x3 features, stride, padding)."""
    channels: int = 3


FULL = SSDConfig(
    image_size=300,
    num_classes=80,
    boxes=detection.SSD300,
    stem_features=64,
    stage_features=(64, 128, 256),
    stage_blocks=(3, 4, 6),
    extra=(
        (256, 512, 2, "SAME"),
        (256, 512, 2, "SAME"),
        (128, 256, 2, "SAME"),
        (128, 256, 1, "VALID"),
        (128, 256, 1, "VALID"),
    ),
)

TINY_BOXES = DefaultBoxes(
    fig_size=64,
    feature_sizes=(8, 4, 2, 1),
    steps=(8, 16, 32, 64),
    scales=(10, 20, 32, 48, 64),
    aspect_ratios=((2,), (2,), (2,), (2,)),
)
TINY = SSDConfig(
    image_size=64,
    num_classes=10,
    boxes=TINY_BOXES,
    stem_features=16,
    stage_features=(16, 32, 32),
    stage_blocks=(1, 1, 1),
    extra=((32, 32, 2, "SAME"), (32, 32, 2, "SAME"), (32, 32, 2, "SAME")),
    channels=1,
)


class _Block(nn.Module):
    """ResNet-34's basic block: two 3x3 convolutions with batch norm, a projected shortcut when
    the shape changes."""

    features: int
    strides: int
    bn_axis: str | None
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x, train: bool):
        norm = lambda: nn.BatchNorm(  # noqa: E731
            use_running_average=not train, momentum=0.9, axis_name=self.bn_axis, dtype=self.dtype
        )
        y = nn.Conv(self.features, (3, 3), self.strides, padding=1, use_bias=False, dtype=self.dtype)(x)
        y = nn.relu(norm()(y))
        y = norm()(nn.Conv(self.features, (3, 3), padding=1, use_bias=False, dtype=self.dtype)(y))
        if x.shape[-1] != self.features or self.strides != 1:
            x = norm()(nn.Conv(self.features, (1, 1), self.strides, use_bias=False, dtype=self.dtype)(x))
        return nn.relu(x + y)


class SSD(nn.Module):
    """``(images [N, H, W] or [N, H, W, C]) -> (class logits [N, D, classes + 1], offsets [N, D, 4])``."""

    cfg: SSDConfig
    bn_axis: str | None = None
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = True):
        cfg = self.cfg
        if x.ndim == 3:
            x = x[..., None]
        x = x.astype(self.dtype)
        x = nn.Conv(cfg.stem_features, (7, 7), 2, padding=3, use_bias=False, dtype=self.dtype)(x)
        x = nn.relu(
            nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name=self.bn_axis, dtype=self.dtype)(x)
        )
        x = nn.max_pool(x, (3, 3), (2, 2), padding="SAME")
        for stage, (features, blocks) in enumerate(zip(cfg.stage_features, cfg.stage_blocks, strict=True)):
            for b in range(blocks):
                # The reference keeps the third stage at stride 1 (38x38 at 300): only stage 2 halves.
                strides = 2 if stage == 1 and b == 0 else 1
                x = _Block(features, strides, self.bn_axis, self.dtype)(x, train)
        maps = [x]
        for mid, out, strides, padding in cfg.extra:
            x = nn.relu(nn.Conv(mid, (1, 1), dtype=self.dtype)(x))
            x = nn.relu(nn.Conv(out, (3, 3), strides, padding=1 if padding == "SAME" else "VALID", dtype=self.dtype)(x))
            maps.append(x)
        sizes = tuple(m.shape[1] for m in maps)
        if sizes != cfg.boxes.feature_sizes:
            raise ValueError(f"SSD maps of sizes {sizes} do not match the default boxes' {cfg.boxes.feature_sizes}")
        logits, offsets = [], []
        for m, nd in zip(maps, cfg.boxes.per_cell(), strict=True):
            n, h, w, _ = m.shape
            conf = nn.Conv(nd * (cfg.num_classes + 1), (3, 3), padding=1, dtype=self.dtype)(m)
            loc = nn.Conv(nd * 4, (3, 3), padding=1, dtype=self.dtype)(m)
            # Box index = (type, row, column), as the default boxes are ordered.
            logits.append(conf.reshape(n, h, w, nd, -1).transpose(0, 3, 1, 2, 4).reshape(n, nd * h * w, -1))
            offsets.append(loc.reshape(n, h, w, nd, 4).transpose(0, 3, 1, 2, 4).reshape(n, nd * h * w, 4))
        return jnp.concatenate(logits, 1).astype(jnp.float32), jnp.concatenate(offsets, 1).astype(jnp.float32)


def encoder(cfg: SSDConfig):
    """The host-side targets of a canvas: each default box's label and encoded offsets."""
    ltrb, xywh = cfg.boxes.ltrb(), cfg.boxes.xywh()

    def encode(boxes, labels):
        matched_labels, matched = detection.match(boxes, labels, ltrb)
        return {"box_labels": matched_labels, "box_targets": detection.encode(matched, xywh)}

    return encode


def tiny_data(split: str = "train", size: int | None = None) -> DigitDetection:
    return DigitDetection(split, size=size, canvas=TINY.image_size, encoder=encoder(TINY))


def loss(model: SSD, variables, batch, train: bool = True):
    """``(mean loss over the batch, new batch stats)``: the reference's loss, per image then mean."""
    (logits, offsets), new = model.apply(variables, batch["image"], train=train, mutable=["batch_stats"])
    per_image = detection.ssd_loss(logits, offsets, batch["box_labels"], batch["box_targets"])
    return per_image.mean(), new["batch_stats"]


def param_count(cfg: SSDConfig) -> int:
    model = SSD(cfg)
    shape = jax.ShapeDtypeStruct((1, cfg.image_size, cfg.image_size, cfg.channels), jnp.float32)
    variables = jax.eval_shape(lambda x: model.init(jax.random.key(0), x), shape)
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(variables["params"]))


REFERENCE_PARAMS = 20_058_000
REFERENCE_SOURCE = (
    "OpenVINO Open Model Zoo, ssd-resnet34-1200-onnx (the MLPerf SSD-ResNet34, same layers at a "
    "1200x1200 input): 20.058 MParams"
)
