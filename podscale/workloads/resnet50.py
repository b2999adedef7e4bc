"""ResNet-50 v1.5 on ImageNet, trained with LARS: the MLPerf image-classification workload.

Model: He et al. 2016 ("Deep Residual Learning for Image Recognition", arXiv 1512.03385) with the
v1.5 change of the MLPerf reference (the stride-2 of a downsampling bottleneck sits in its 3x3
convolution, not in the first 1x1). Batch norm after every convolution, float32 statistics, the
last batch-norm scale of every residual block initialised to zero (as MLPerf submissions do).
25,557,032 parameters, the count of torchvision's ``resnet50`` (He et al.: "25.6M").

Recipe (``configs["full"]``): the MLPerf Training v2.0 NVIDIA DGX-A100 submission
(``mlcommons/training_results_v2.0``, ``NVIDIA/benchmarks/resnet/implementations/mxnet/
config_DGXA100.sh``): 8 GPUs x 408 = global batch 3264, LARS (You et al. 2017, arXiv 1708.03888)
with eta 0.001, momentum 0.9, weight decay 5e-5, base learning rate 10.5 reached by a linear
warmup over 2 epochs, then polynomial decay of power 2 to 1e-4 (the ``lars_opt_end_learning_rate``
of the MLPerf reference ``image_classification/tensorflow2/lars_util.py``), 37 epochs, label
smoothing 0.1. Batch-norm parameters and biases are excluded from both weight decay and the LARS
trust ratio, as in the MLPerf reference (``image_classification/tensorflow2/common.py``:
``skip_list=['batch_normalization', 'bias', 'bn']``) and the TPU submissions (Kumar et al. 2019,
arXiv 1909.09756). The reference model has no dropout, so nothing is left out here.

``configs["tiny"]``: the same bottleneck v1.5 network with stages of width 8/16/32 and one block
each, a 3x3 stem and no max-pool, on scikit-learn's 8x8 digits. Expected result::

    podscale train --model resnet50 --config tiny --steps 200 --eval-every 25 --target 0.97 --no-progress

reaches 97% held-out accuracy on 8 CPU replicas after 75-100 steps (under a minute of training).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from mlperf_logging.mllog import constants as C

from podscale.workloads import datasets
from podscale.workloads.base import Reference, Workload
from podscale.workloads.precision import Policy

IMAGENET_TRAIN_IMAGES = 1_281_167


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    """A ResNet v1.5 with bottleneck blocks and its LARS recipe (the MLPerf model has no dropout)."""

    global_batch: int
    """The global batch the recipe's hyperparameters are for."""
    per_core_batch: int
    """The submission's batch per accelerator."""
    train_steps: int
    """Length of the schedule."""
    source: str
    """Where the hyperparameters come from."""
    learning_rate: float
    """Peak (base) learning rate, reached at the end of the warmup."""
    warmup_steps: int
    """Linear warmup from 0 to ``learning_rate`` (scaled with ``total_steps / train_steps`` when a run
    is shorter or longer than ``train_steps``)."""
    end_learning_rate: float
    """Where the power-2 polynomial decay ends."""
    weight_decay: float
    """Applied to convolution and dense kernels only."""
    momentum: float = 0.9
    trust_coefficient: float = 0.001
    """LARS eta."""
    label_smoothing: float = 0.1
    stage_sizes: Sequence[int] = (3, 4, 6, 3)
    """Bottleneck blocks per stage."""
    stage_widths: Sequence[int] = (64, 128, 256, 512)
    """Width of each stage's 3x3 convolutions; blocks output 4x as many channels."""
    stem: str = "imagenet"
    """``imagenet``: 7x7/2 convolution and 3x3/2 max-pool; ``small``: one 3x3/1 convolution."""
    image_shape: tuple[int, ...] = (224, 224, 3)
    """One example's ``image``; a 2-D shape means one channel, added by the model."""
    num_classes: int = 1000
    bn_group_size: int = 1
    """Replicas per batch-norm group in the TPU pod recipe, from ``bn_group_min_replicas``
    replicas up (1: the whole batch): ``podscale project``'s default (``--bn-group-size``)."""
    bn_group_min_replicas: int = 1

    def __post_init__(self):
        if len(self.stage_sizes) != len(self.stage_widths):
            raise ValueError(f"stage_sizes {self.stage_sizes} and stage_widths {self.stage_widths} differ in length")
        if self.stem not in ("imagenet", "small"):
            raise ValueError(f"stem {self.stem!r}: use 'imagenet' or 'small'")
        if not 0 < self.warmup_steps < self.train_steps:
            raise ValueError(f"warmup_steps {self.warmup_steps} must lie in (0, train_steps={self.train_steps})")


_NVIDIA_GLOBAL_BATCH, _NVIDIA_EPOCHS, _NVIDIA_WARMUP_EPOCHS = 8 * 408, 37, 2
_STEPS_PER_EPOCH = IMAGENET_TRAIN_IMAGES / _NVIDIA_GLOBAL_BATCH

FULL = ResNetConfig(
    global_batch=_NVIDIA_GLOBAL_BATCH,
    per_core_batch=408,
    train_steps=math.ceil(_NVIDIA_EPOCHS * _STEPS_PER_EPOCH),  # 14,524
    source=(
        "MLPerf Training v2.0, NVIDIA DGX-A100 ResNet-50 (mlcommons/training_results_v2.0 "
        "NVIDIA/benchmarks/resnet/implementations/mxnet/config_DGXA100.sh): 8x408 = batch 3264, LARS "
        "eta 0.001, lr 10.5, warmup 2 epochs, poly power 2, wd 5e-5, momentum 0.9, label smoothing 0.1, "
        "37 epochs; end lr 1e-4 from the MLPerf reference image_classification/tensorflow2/lars_util.py"
    ),
    learning_rate=10.5,
    warmup_steps=math.ceil(_NVIDIA_WARMUP_EPOCHS * _STEPS_PER_EPOCH),  # 786
    end_learning_rate=1e-4,
    weight_decay=5e-5,
    # MLPerf Training v0.6, Google TPU v3 ResNet-50 (mlcommons/training_results_v0.6
    # Google/benchmarks/resnet/tpu-v3-2048/run_and_time.sh): --distributed_group_size=8 for batch
    # 32768 on 2048 cores (1024 chips); tpu-v3-1024 (1024 cores): 1, each core's own batch.
    bn_group_size=8,
    bn_group_min_replicas=2048,
)

TINY = ResNetConfig(
    global_batch=128,
    per_core_batch=16,
    train_steps=200,
    source="tuned here for the 8x8 digits: the full recipe (LARS, warmup 10%, power-2 decay), 200 steps",
    learning_rate=8.0,
    warmup_steps=20,
    end_learning_rate=1e-4,
    weight_decay=5e-5,
    stage_sizes=(1, 1, 1),
    stage_widths=(8, 16, 32),
    stem="small",
    image_shape=(8, 8),
    num_classes=10,
)


# -- the model ------------------------------------------------------------------------------------

_conv_init = nn.initializers.variance_scaling(2.0, "fan_out", "normal")  # He et al. 2015, as torchvision


class Bottleneck(nn.Module):
    """1x1 -> 3x3 (stride here: v1.5) -> 1x1 (4x wider), each followed by batch norm; projection
    shortcut when the shape changes; the last batch norm's scale starts at zero."""

    width: int
    strides: int
    policy: Policy
    bn_axis: str | None

    @nn.compact
    def __call__(self, x, train: bool):
        conv = lambda f, k, s, name: nn.Conv(  # noqa: E731
            f,
            (k, k),
            (s, s),
            padding="SAME",
            use_bias=False,
            kernel_init=_conv_init,
            dtype=self.policy.compute_dtype,
            param_dtype=self.policy.param_dtype,
            name=name,
        )
        norm = lambda name, zero=False: _batch_norm(self.policy, self.bn_axis, train, name, zero)  # noqa: E731
        y = nn.relu(norm("bn1")(conv(self.width, 1, 1, "conv1")(x)))
        y = nn.relu(norm("bn2")(conv(self.width, 3, self.strides, "conv2")(y)))
        y = norm("bn3", zero=True)(conv(4 * self.width, 1, 1, "conv3")(y))
        if x.shape[-1] != 4 * self.width or self.strides != 1:
            x = norm("proj_bn")(conv(4 * self.width, 1, self.strides, "proj_conv")(x))
        return nn.relu(x + y)


def _batch_norm(policy: Policy, bn_axis: str | None, train: bool, name: str, zero_scale: bool = False):
    return nn.BatchNorm(
        use_running_average=not train,
        axis_name=bn_axis,
        momentum=0.9,
        epsilon=1e-5,
        dtype=policy.compute_dtype,
        param_dtype=policy.param_dtype,
        name=name,
        scale_init=nn.initializers.zeros if zero_scale else nn.initializers.ones,
    )


class ResNet(nn.Module):
    """ResNet v1.5: stem, bottleneck stages, global average pool, dense classifier (bf16 logits)."""

    config: ResNetConfig
    policy: Policy
    bn_axis: str | None = None

    @nn.compact
    def __call__(self, x, train: bool = False):
        cfg, policy = self.config, self.policy
        if x.ndim == 3:
            x = x[..., None]
        kernel, strides = ((7, 7), (2, 2)) if cfg.stem == "imagenet" else ((3, 3), (1, 1))
        x = nn.Conv(
            cfg.stage_widths[0],
            kernel,
            strides,
            padding="SAME",
            use_bias=False,
            kernel_init=_conv_init,
            dtype=policy.compute_dtype,
            param_dtype=policy.param_dtype,
            name="stem_conv",
        )(x)
        x = nn.relu(_batch_norm(policy, self.bn_axis, train, "stem_bn")(x))
        if cfg.stem == "imagenet":
            x = nn.max_pool(x, (3, 3), (2, 2), padding="SAME")
        for stage, (blocks, width) in enumerate(zip(cfg.stage_sizes, cfg.stage_widths, strict=True)):
            for block in range(blocks):
                strides = 2 if stage > 0 and block == 0 else 1
                x = Bottleneck(width, strides, policy, self.bn_axis, name=f"stage{stage + 1}_block{block + 1}")(
                    x, train
                )
        x = jnp.mean(x.astype(policy.accum_dtype), axis=(1, 2)).astype(policy.compute_dtype)
        return nn.Dense(
            cfg.num_classes,
            kernel_init=nn.initializers.normal(0.01),
            dtype=policy.compute_dtype,
            param_dtype=policy.param_dtype,
            name="head",
        )(x)


def make_model(cfg: ResNetConfig, policy: Policy, bn_axis: str | None) -> ResNet:
    return ResNet(cfg, policy, bn_axis)


# -- data -----------------------------------------------------------------------------------------


def batch_shapes(cfg: ResNetConfig, global_batch: int) -> dict[str, jax.ShapeDtypeStruct]:
    return {
        "image": jax.ShapeDtypeStruct((global_batch, *cfg.image_shape), jnp.float32),
        "label": jax.ShapeDtypeStruct((global_batch,), jnp.int32),
    }


def make_data(cfg: ResNetConfig, seed: int):
    del seed  # the digits split is fixed
    if cfg.stem == "imagenet":
        raise ValueError(
            "resnet50 --config full trains on ImageNet (the MLPerf data set), which does not ship with "
            "podscale; use --config tiny (8x8 digits)"
        )
    return datasets.Digits("train"), datasets.Digits("test")


# -- the recipe -----------------------------------------------------------------------------------


def adapted(params) -> dict:
    """``True`` for the leaves LARS adapts and decays: convolution and dense kernels. Batch-norm
    scales and offsets and biases get ``False`` (plain momentum SGD, no weight decay)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key == "kernel", params)


def warmup_steps(cfg: ResNetConfig, total_steps: int) -> int:
    """The warmup's share of ``cfg.train_steps``, applied to ``total_steps``."""
    return max(1, min(total_steps - 1, round(cfg.warmup_steps * total_steps / cfg.train_steps)))


def learning_rate_schedule(cfg: ResNetConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to the peak, then power-2 polynomial decay to ``end_learning_rate`` at
    ``total_steps``. The warmup keeps its share of the schedule when ``total_steps`` differs from
    ``cfg.train_steps``."""
    warmup = warmup_steps(cfg, total_steps)
    return optax.join_schedules(
        [
            optax.linear_schedule(0.0, cfg.learning_rate, warmup),
            optax.polynomial_schedule(
                cfg.learning_rate, cfg.end_learning_rate, power=2, transition_steps=total_steps - warmup
            ),
        ],
        boundaries=[warmup],
    )


def make_optimizer(cfg: ResNetConfig, total_steps: int) -> optax.GradientTransformation:
    return optax.lars(
        learning_rate_schedule(cfg, max(2, total_steps)),
        weight_decay=cfg.weight_decay,
        weight_decay_mask=adapted,
        trust_coefficient=cfg.trust_coefficient,
        trust_ratio_mask=adapted,
        momentum=cfg.momentum,
    )


def hparams(cfg: ResNetConfig, total_steps: int) -> dict:
    """The recipe under mllog's standard LARS keys."""
    total_steps = max(2, total_steps)
    return {
        C.OPT_NAME: C.LARS,
        C.LARS_OPT_BASE_LEARNING_RATE: cfg.learning_rate,
        C.LARS_OPT_END_LR: cfg.end_learning_rate,
        C.LARS_OPT_LR_DECAY_POLY_POWER: 2,
        C.LARS_OPT_LR_DECAY_STEPS: total_steps - warmup_steps(cfg, total_steps),
        C.OPT_LR_WARMUP_STEPS: warmup_steps(cfg, total_steps),
        C.LARS_OPT_MOMENTUM: cfg.momentum,
        C.LARS_OPT_WEIGHT_DECAY: cfg.weight_decay,
        C.LARS_EPSILON: 0.0,
        "label_smoothing": cfg.label_smoothing,
    }


# -- loss and metrics -----------------------------------------------------------------------------


def init(model: ResNet, rng: jax.Array, batch) -> dict:
    return model.init(rng, batch["image"], train=False)


def smoothed_cross_entropy(logits: jax.Array, labels: jax.Array, smoothing: float) -> jax.Array:
    """Per-example cross-entropy against one-hot labels smoothed by ``smoothing``, in float32."""
    logits = logits.astype(jnp.float32)
    targets = optax.smooth_labels(jax.nn.one_hot(labels, logits.shape[-1], dtype=jnp.float32), smoothing)
    return optax.softmax_cross_entropy(logits, targets)


def _per_example(cfg: ResNetConfig, logits, labels) -> dict[str, jax.Array]:
    return {
        "loss": smoothed_cross_entropy(logits, labels, cfg.label_smoothing),
        "accuracy": (jnp.argmax(logits, -1) == labels).astype(jnp.float32),
    }


def train_loss(model: ResNet, variables: dict, batch, rng: jax.Array | None = None):
    del rng  # the MLPerf ResNet has no dropout
    logits, updates = model.apply(variables, batch["image"], train=True, mutable=["batch_stats"])
    return _per_example(model.config, logits, batch["label"]), updates["batch_stats"]


def eval_metrics(model: ResNet, variables: dict, batch) -> dict[str, jax.Array]:
    """Top-1 ``accuracy`` and the (label-smoothed, as in training) ``loss`` per example."""
    logits = model.apply(variables, batch["image"], train=False)
    return _per_example(model.config, logits, batch["label"])


WORKLOAD = Workload(
    name="resnet50",
    mlperf_name="resnet",
    description="ResNet-50 v1.5 image classification (MLPerf), LARS with batch-norm groups",
    configs={"full": FULL, "tiny": TINY},
    reference=Reference(
        params=25_557_032,
        source="torchvision.models.resnet50 (25,557,032 parameters); He et al. 2016, arXiv 1512.03385: '25.6M'",
    ),
    make_model=make_model,
    batch_shapes=batch_shapes,
    make_data=make_data,
    make_optimizer=make_optimizer,
    init=init,
    train_loss=train_loss,
    eval_metrics=eval_metrics,
    eval_metric="accuracy",
    hparams=hparams,
)
