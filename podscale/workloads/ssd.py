"""SSD300 with a ResNet-34 backbone (MLPerf's single-shot detector), and a tiny config for CPU.

The model follows the MLPerf reference (mlcommons/training ``single_stage_detector/ssd``,
``ssd300.py``): torchvision's ResNet-34 through its third stage (``conv4_x``) with that stage's
stride set to 1, so a 300x300 image gives a 38x38 map of 256 channels; five extra blocks (a 1x1
convolution, then a 3x3 one, stride 2 for the first three, valid padding for the last two) give
maps of 19, 10, 5, 3 and 1; a 3x3 convolution per map predicts, for each of its 4, 6, 6, 6, 4, 4
default boxes per cell, 4 box offsets and 81 class scores (80 COCO classes and background):
8732 boxes (:data:`podscale.workloads.detection.SSD300`).

The tiny config is the same network with narrower stages and one block each, on 64x64 canvases
of the digits detection set (:class:`podscale.workloads.datasets.DigitDetection`), with four maps of 8,
4, 2 and 1 and 340 default boxes.

The evaluation is COCO mAP@[.5:.95] by pycocotools over the whole held-out set: each image's
class logits and box offsets (:func:`predict`, on the devices), then on the host the reference's
post-processing and ``detection.coco_map`` (:func:`score`), logged as MLPerf's ``eval_accuracy``. Expected result::

    podscale train --model ssd --config tiny --steps 704 --eval-every 64 --target 0.5 --no-progress

reaches 0.5 mAP at step 384 (29 s on 8 CPU replicas).

"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from mlperf_logging.mllog import constants as C

from podscale.workloads import detection
from podscale.workloads.base import Reference, Workload, evaluate_whole_set
from podscale.workloads.datasets import DigitDetection
from podscale.workloads.detection import DefaultBoxes


@dataclasses.dataclass(frozen=True)
class SSDConfig:
    global_batch: int
    per_core_batch: int
    train_steps: int
    source: str
    learning_rate: float
    warmup_steps: int
    weight_decay: float
    steps_per_epoch: float
    """For the step drops at epochs 40 and 50 (the MLPerf ruleset's boundaries)."""
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
    momentum: float = 0.9
    decay_epochs: tuple[int, ...] = (40, 50)
    """Epochs of the x``decay_factor`` drops (the v0.7 ruleset's 40 and 50, or those scaled by a
    multiple of 10%)."""
    spatial: int = 1
    """Partitions per image in the recipe (``--spatial``); ``per_core_batch`` is then per device."""
    bn_group_size: int = 1
    """Replicas per batch-norm group in the recipe (``podscale project``'s default ``--bn-group-size``),
    from ``bn_group_min_replicas`` replicas up."""
    bn_group_min_replicas: int = 1
    decay_factor: float = 0.1
    max_objects: int = 100
    """Ground-truth boxes per image in a batch (padded): COCO's images hold at most about 100."""
    train_size: int = 0
    eval_size: int = 0


_COCO_TRAIN = 118_287  # train2017, as the v0.7 JAX SSD counts an epoch (--num_examples_per_epoch)
FULL = SSDConfig(
    global_batch=4096,
    per_core_batch=1,
    train_steps=round(120 * _COCO_TRAIN / 4096),
    source=(
        "MLPerf Training v0.7, Google TPU v3-4096 JAX SSD (mlcommons/training_results_v0.7 "
        "Google/benchmarks/ssd/tpu-v3-4096-JAX/run_and_time.sh, implementations/ssd-research-JAX-tpu-v3-4096: "
        "ssd_train.py, ssd_constants.py): batch 4096 over 1024 replicas of 4 spatial partitions "
        "(--num_partitions=4: one image per core), weight-update sharding, batch-norm groups of 16 cores "
        "(4 replicas), bf16; SGD momentum 0.9, lr 0.0012 x 4096 / 32 = 0.1536, linear warmup 26 epochs "
        "(warmup factor 0), weight decay 5e-4, x0.1 at epochs 64 and x0.01 at 80, at most 120 epochs; "
        "target mAP 0.23"
    ),
    learning_rate=0.0012 * 4096 / 32,
    warmup_steps=int(26 * _COCO_TRAIN / 4096),
    weight_decay=5e-4,
    steps_per_epoch=_COCO_TRAIN / 4096,
    decay_epochs=(64, 80),
    spatial=4,
    bn_group_size=4,
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
    global_batch=64,
    per_core_batch=8,
    train_steps=704,
    source=(
        "tuned here for the digits detection set: the full recipe's shape (SGD momentum 0.9, linear "
        "warmup, weight decay, x0.1 at two epochs), lr 0.05, 704 steps (11 epochs of 4096 canvases), drops "
        "at epochs 8 and 10 (the v0.7 ruleset accepts 40 and 50 scaled by a multiple of 10%: here 0.2)"
    ),
    learning_rate=0.05,
    warmup_steps=50,
    weight_decay=5e-4,
    steps_per_epoch=4096 / 64,
    train_size=4096,
    decay_epochs=(8, 10),
    eval_size=256,
    max_objects=3,
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
    return DigitDetection(split, size=size, canvas=TINY.image_size, max_objects=TINY.max_objects, encoder=encoder(TINY))


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


# -- the workload ---------------------------------------------------------------------------------


def make_model(cfg: SSDConfig, policy, bn_axis: str | None) -> SSD:
    return SSD(cfg, bn_axis=bn_axis, dtype=policy.compute_dtype)


def batch_shapes(cfg: SSDConfig, global_batch: int) -> dict[str, jax.ShapeDtypeStruct]:
    d = len(cfg.boxes.xywh())
    image = (cfg.image_size, cfg.image_size) + ((cfg.channels,) if cfg.channels > 1 else ())
    return {
        "image": jax.ShapeDtypeStruct((global_batch, *image), jnp.float32),
        "boxes": jax.ShapeDtypeStruct((global_batch, cfg.max_objects, 4), jnp.float32),
        "labels": jax.ShapeDtypeStruct((global_batch, cfg.max_objects), jnp.int32),
        "box_labels": jax.ShapeDtypeStruct((global_batch, d), jnp.int32),
        "box_targets": jax.ShapeDtypeStruct((global_batch, d, 4), jnp.float32),
    }


def make_data(cfg: SSDConfig, seed: int):
    del seed  # the canvases are a pure function of (split, index)
    if cfg.image_size != TINY.image_size:
        raise ValueError(
            "ssd --config full trains on COCO 2017 (the MLPerf data set), which does not ship with podscale; use "
            "--config tiny (the digits detection set)"
        )
    return tiny_data("train", cfg.train_size), tiny_data("test", cfg.eval_size)


def _decay_epochs(cfg: SSDConfig, total_steps: int) -> list[float]:
    """The drops' epochs in a run of ``total_steps`` (the config's own at its ``train_steps``)."""
    return [e * total_steps / cfg.train_steps for e in cfg.decay_epochs]


def _boundaries(cfg: SSDConfig, total_steps: int) -> list[int]:
    return [max(1, round(e * cfg.steps_per_epoch)) for e in _decay_epochs(cfg, total_steps)]


def _warmup(cfg: SSDConfig, total_steps: int) -> int:
    return max(1, min(total_steps - 1, round(cfg.warmup_steps * total_steps / cfg.train_steps)))


def learning_rate_schedule(cfg: SSDConfig, total_steps: int):
    """Linear warmup from 0 (warmup factor 0), then x``decay_factor`` at each boundary epoch; both
    keep their share of the schedule when ``total_steps`` differs from ``cfg.train_steps``."""
    warmup = _warmup(cfg, total_steps)
    drops = {b - warmup: cfg.decay_factor for b in _boundaries(cfg, total_steps) if b > warmup}
    return optax.join_schedules(
        [
            optax.linear_schedule(0.0, cfg.learning_rate, warmup),
            optax.piecewise_constant_schedule(cfg.learning_rate, drops),
        ],
        [warmup],
    )


def make_optimizer(cfg: SSDConfig, total_steps: int):
    """SGD with momentum and (coupled, as torch's SGD) weight decay on every parameter."""
    return optax.chain(
        optax.add_decayed_weights(cfg.weight_decay),
        optax.sgd(learning_rate_schedule(cfg, max(2, total_steps)), momentum=cfg.momentum),
    )


def hparams(cfg: SSDConfig, total_steps: int) -> dict:
    total_steps = max(2, total_steps)
    return {
        C.OPT_NAME: C.SGD,
        C.OPT_BASE_LR: cfg.learning_rate,
        C.OPT_WEIGHT_DECAY: cfg.weight_decay,
        C.OPT_LR_WARMUP_STEPS: _warmup(cfg, total_steps),
        C.OPT_LR_WARMUP_FACTOR: 0,
        # The epochs the drops fall at in this run (the config's, when --steps is its train_steps).
        C.OPT_LR_DECAY_BOUNDARY_EPOCHS: _decay_epochs(cfg, total_steps),
        C.OPT_LR_DECAY_FACTOR: cfg.decay_factor,
        C.MAX_SAMPLES: 1,  # no random-crop resampling: each canvas is used as it is
    }


def init(model: SSD, rng: jax.Array, batch) -> dict:
    return model.init(rng, batch["image"], train=False)


def _per_example(logits, offsets, batch) -> dict[str, jax.Array]:
    labels = batch["box_labels"]
    positive = labels > 0
    correct = ((jnp.argmax(logits, -1) == labels) & positive).sum(1) / jnp.maximum(positive.sum(1), 1)
    return {
        "loss": detection.ssd_loss(logits, offsets, labels, batch["box_targets"]),
        "accuracy": correct.astype(jnp.float32),
    }


def train_loss(model: SSD, variables: dict, batch, rng: jax.Array | None = None):
    """Per image: the reference's loss, and ``accuracy`` (of the default boxes matched to objects)."""
    del rng  # SSD has no dropout
    (logits, offsets), updates = model.apply(variables, batch["image"], train=True, mutable=["batch_stats"])
    return _per_example(logits, offsets, batch), updates["batch_stats"]


def eval_metrics(model: SSD, variables: dict, batch) -> dict[str, jax.Array]:
    logits, offsets = model.apply(variables, batch["image"], train=False)
    return _per_example(logits, offsets, batch)


def predict(model: SSD, variables: dict, batch) -> tuple[jax.Array, jax.Array]:
    """Each image's class logits and box offsets of its default boxes (inference)."""
    return model.apply(variables, batch["image"], train=False)


def score(model: SSD, predictions, data, chunk: int = 64) -> dict[str, float]:
    """COCO mAP of the whole held-out set's ``(logits, offsets)``: the reference's post-processing
    (score threshold 0.05, per-class NMS at IoU 0.5, the 200 best), pycocotools."""
    cfg = model.cfg
    logits, offsets = predictions
    xywh = cfg.boxes.xywh()
    truth, found = [], []
    for start in range(0, len(data), chunk):
        rows = slice(start, min(start + chunk, len(data)))
        batch = data.get(np.arange(rows.start, rows.stop))
        found += detection.detect(logits[rows], offsets[rows], xywh)
        truth += [(b[lab > 0], lab[lab > 0]) for b, lab in zip(batch["boxes"], batch["labels"], strict=True)]
    return detection.coco_map(truth, found, (cfg.image_size, cfg.image_size), cfg.num_classes)


def evaluate(model: SSD, variables: dict, data, chunk: int = 64) -> dict[str, float]:
    """:func:`score` of :func:`predict` over the whole held-out set, on one device."""
    return evaluate_whole_set(predict, score, model, variables, data, chunk)


WORKLOAD = Workload(
    name="ssd",
    description="SSD300 with a ResNet-34 backbone, COCO detection (MLPerf), SGD with momentum",
    configs={"full": FULL, "tiny": TINY},
    reference=Reference(params=REFERENCE_PARAMS, source=REFERENCE_SOURCE),
    make_model=make_model,
    batch_shapes=batch_shapes,
    make_data=make_data,
    make_optimizer=make_optimizer,
    init=init,
    train_loss=train_loss,
    eval_metrics=eval_metrics,
    eval_metric="map",
    hparams=hparams,
    predict=predict,
    score=score,
)
