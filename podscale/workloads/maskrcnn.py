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

Two modules: this one is the workload (its config, the full and tiny configs, the recipe, the
data and the evaluation); the network (backbone, FPN, RPN, box and mask heads, and each image's
losses and detections from them) is :mod:`podscale.workloads.maskrcnn_model`. The pieces Mask
R-CNN shares with detection in general (anchors, matching, sampling, NMS, RoIAlign, COCO AP) are
in :mod:`podscale.workloads.rcnn`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from mlperf_logging.mllog import constants as C

from podscale.workloads import rcnn
from podscale.workloads.base import Reference, Workload, evaluate_whole_set
from podscale.workloads.datasets import DigitDetection
from podscale.workloads.maskrcnn_model import MaskRCNN


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


def groups(cfg: MaskRCNNConfig):
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
        groups(cfg),
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
