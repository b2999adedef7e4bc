"""DLRM on Criteo Terabyte: the MLPerf v0.7 recommendation workload.

Model: Naumov et al. 2019 ("Deep Learning Recommendation Model for Personalization and
Recommendation Systems", arXiv 1906.00091), as the MLPerf v0.7 reference and Google's v0.7 TPU
submission build it (mlcommons/training_results_v0.7, ``Google/benchmarks/dlrm/implementations/
dlrm-research-TF-tpu-v4-128/dlrm.py``): the 13 dense features through a bottom MLP 512-256-128
(ReLU on every layer), each of the 26 categorical features looked up in its own embedding table
of width 128, dot interactions of the 27 vectors (the strictly lower triangle of their Gram
matrix, 351 values) concatenated with the bottom MLP's output (479 values), a top MLP
1024-1024-512-256-1 (ReLU, the last layer a logit), binary cross-entropy. The tables' sizes are
the submission's ``--vocab_sizes_embed`` (``Google/benchmarks/dlrm/tpu-v4-128-TF/run_and_time.sh``:
Criteo Terabyte's 26 features, each capped at 40M ids as the reference does). Initialisation as the
submission's: tables uniform in ``+-1/sqrt(rows)`` (``feature_config.py``), bottom kernels Glorot
normal, top kernels normal with std ``sqrt(2 / (fan_in + fan_out))``, biases normal with std
``sqrt(1 / fan_out)``. The model applies the logit's sigmoid inside the loss
(``optax.sigmoid_binary_cross_entropy``: the submission's sigmoid then cross-entropy, without
its rounding at saturated probabilities).

Each table is an ordinary flax parameter looked up as ``table[ids]``; where a table lives is the
placement's business (``podscale.parallel.tables``: a table with at least the global batch's rows
is split by rows over the data axes, looked up and updated where its rows live).

Recipe (``configs["full"]``), the submission's ``run_and_time.sh``: SGD, global batch 55,296 on
128 TPU-v4 cores (``--num_tpu_shards=128``: 432 a core), base learning rate 0.887 scaled by
``batch / 2048`` (``utils.lr_fn``: a peak of 23.949), linear warmup over 2,750 steps, constant to
step 49,315, then a power-2 polynomial decay over 27,772 steps, 75,860 steps, an evaluation every
3,793 steps. Target: AUC 0.8025 on the held-out day (the MLPerf v0.7 rules). The reference's
Adagrad alternative (``--optimizer=adagrad``, constant rate) is ``optimizer="adagrad"``.

``configs["tiny"]``: the same network at width 16 (bottom 32-16, top 64-32-1) on synthetic click
logs from a planted model (:mod:`podscale.workloads.clicks`): the v0.7 cardinalities divided by
10,000 (at least 4 ids, at most the table's own), Zipf id frequencies (exponent 1.4), labels drawn
from a fixed teacher whose own AUC on the held-out split (16,384 examples), 0.8850, is the best any
model can reach. Its target, 0.8025, is MLPerf's (the compliance checker asks for it): 79% of the
teacher's gain over chance (0.5). SGD at a peak of 2.0 (the submission's schedule, shortened).
Expected result::

    podscale train --model dlrm --config tiny --steps 400 --eval-every 100 --target 0.8025 --no-progress

reaches AUC 0.8076 at step 300 on 8 CPU replicas (about 20 s to target on this 2-core machine).
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from mlperf_logging.mllog import constants as C

from podscale.workloads.base import Reference, Workload, evaluate_whole_set
from podscale.workloads.clicks import NUM_DENSE, ClickLogs
from podscale.workloads.precision import Policy

V07_CARDINALITIES = (
    39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546, 403346, 10,
    2208, 11938, 155, 4, 976, 14, 39979771, 25641295, 39664984, 585935, 12972, 108, 36,
)  # fmt: skip
"""Rows of the 26 tables: ``--vocab_sizes_embed`` of the v0.7 submission's run_and_time.sh."""

_SUBMISSION = (
    "MLPerf Training v0.7, Google DLRM on TPU-v4-128 (mlcommons/training_results_v0.7 "
    "Google/benchmarks/dlrm/tpu-v4-128-TF/run_and_time.sh): batch 55296, SGD, lr 0.887 x batch/2048, "
    "warmup 2750 steps, power-2 decay from step 49315 over 27772 steps, 75860 steps; "
    "implementations/dlrm-research-TF-tpu-v4-128/{dlrm.py,utils.py,feature_config.py}"
)


@dataclasses.dataclass(frozen=True)
class DLRMConfig:
    """A DLRM and its recipe (and, for the tiny config, its synthetic data)."""

    global_batch: int
    per_core_batch: int
    train_steps: int
    source: str
    learning_rate: float
    """The peak learning rate (the submission's base rate times ``global_batch / 2048``)."""
    warmup_steps: int
    decay_start_step: int
    decay_steps: int
    cardinalities: tuple[int, ...] = V07_CARDINALITIES
    embed_dim: int = 128
    bottom: tuple[int, ...] = (512, 256, 128)
    top: tuple[int, ...] = (1024, 1024, 512, 256, 1)
    optimizer: str = "sgd"
    """``sgd`` (the submission's) or ``adagrad`` (the reference's alternative, constant rate)."""
    adagrad_init_accum: float = 0.0
    train_size: int = 0
    """Tiny config: examples of the synthetic training split (0: no bundled data)."""
    eval_size: int = 0

    def __post_init__(self):
        if self.bottom[-1] != self.embed_dim:
            raise ValueError(f"bottom MLP {self.bottom} must end at embed_dim {self.embed_dim} (dot interactions)")
        if self.top[-1] != 1:
            raise ValueError(f"top MLP {self.top} must end in one logit")
        if self.optimizer not in ("sgd", "adagrad"):
            raise ValueError(f"optimizer {self.optimizer!r}: use 'sgd' or 'adagrad'")
        if not 0 <= self.warmup_steps <= self.decay_start_step:
            raise ValueError(
                f"warmup_steps {self.warmup_steps} must lie in [0, decay_start_step={self.decay_start_step}]"
            )


_BATCH = 55_296
FULL = DLRMConfig(
    global_batch=_BATCH,
    per_core_batch=_BATCH // 128,
    train_steps=75_860,
    source=_SUBMISSION,
    learning_rate=0.887 * _BATCH / 2048,
    warmup_steps=2750,
    decay_start_step=49_315,
    decay_steps=27_772,
)

TINY = DLRMConfig(
    global_batch=256,
    per_core_batch=32,
    train_steps=400,
    source="tiny: the v0.7 network at width 16 on planted click logs (v0.7 cardinalities / 10,000); its SGD schedule",
    learning_rate=2.0,
    warmup_steps=20,
    decay_start_step=300,
    decay_steps=100,
    cardinalities=tuple(min(v, max(4, math.ceil(v / 10_000))) for v in V07_CARDINALITIES),
    embed_dim=16,
    bottom=(32, 16),
    top=(64, 32, 1),
    train_size=1 << 20,
    eval_size=16_384,
)

REFERENCE_PARAMS = 90 * 2**30 // 4
REFERENCE_SOURCE = (
    "MLPerf's DLRM Terabyte model (the v0.7 network, ids capped at 40M) as published float32 weights: "
    "90 GB (mlcommons CM get-ml-model-dlrm-terabyte, tb00_40M; mlcommons/ck issue 1214), 90 GiB / 4 bytes"
)


# -- the model ------------------------------------------------------------------------------------


def _mlp(x, widths, policy: Policy, name: str, kernel_init, last_relu: bool):
    for i, width in enumerate(widths):
        fan_in = x.shape[-1]
        x = nn.Dense(
            width,
            kernel_init=kernel_init(fan_in, width),
            bias_init=nn.initializers.normal(math.sqrt(1.0 / width)),
            dtype=policy.compute_dtype,
            param_dtype=policy.param_dtype,
            name=f"{name}_{i}",
        )(x)
        if last_relu or i < len(widths) - 1:
            x = nn.relu(x)
    return x


def _table_init(rows: int):
    bound = 1.0 / math.sqrt(rows)
    return lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)


class DLRM(nn.Module):
    """Bottom MLP, 26 embedding tables, dot interactions, top MLP; returns one logit per example."""

    cfg: DLRMConfig
    policy: Policy

    @nn.compact
    def __call__(self, dense, sparse):
        cfg, policy = self.cfg, self.policy
        glorot = lambda fan_in, fan_out: nn.initializers.glorot_normal()  # noqa: E731
        x = _mlp(dense.astype(policy.compute_dtype), cfg.bottom, policy, "bottom", glorot, last_relu=True)
        vectors = [x]
        for t, rows in enumerate(cfg.cardinalities):
            table = self.param(f"table_{t}", _table_init(rows), (rows, cfg.embed_dim), policy.param_dtype)
            vectors.append(table[sparse[:, t]].astype(policy.compute_dtype))  # the lookup: a gather
        stacked = jnp.stack(vectors, axis=1)  # [batch, 27, dim]
        gram = jnp.einsum("bfd,bgd->bfg", stacked, stacked)
        low_f, low_g = np.tril_indices(len(vectors), -1)
        interactions = gram.reshape(gram.shape[0], -1)[:, low_f * len(vectors) + low_g]  # 351 for 27 vectors
        top_init = lambda fan_in, fan_out: nn.initializers.normal(math.sqrt(2.0 / (fan_in + fan_out)))  # noqa: E731
        logit = _mlp(jnp.concatenate([x, interactions], axis=1), cfg.top, policy, "top", top_init, last_relu=False)
        return logit[:, 0].astype(jnp.float32)


def make_model(cfg: DLRMConfig, policy: Policy, bn_axis: str | None = None) -> DLRM:
    del bn_axis  # no batch norm
    return DLRM(cfg, policy)


def batch_shapes(cfg: DLRMConfig, global_batch: int) -> dict[str, jax.ShapeDtypeStruct]:
    return {
        "dense": jax.ShapeDtypeStruct((global_batch, NUM_DENSE), jnp.float32),
        "sparse": jax.ShapeDtypeStruct((global_batch, len(cfg.cardinalities)), jnp.int32),
        "label": jax.ShapeDtypeStruct((global_batch,), jnp.float32),
    }


def make_data(cfg: DLRMConfig, seed: int):
    if not cfg.train_size:
        raise ValueError(
            "the full DLRM config's data is Criteo Terabyte (about 1.3 TB of click logs), which does not ship "
            "with podscale: use it for compiling and sizing only. Train with --config tiny (planted click logs)"
        )
    del seed  # the planted model and its splits are fixed: the teacher's AUC is the config's
    train = ClickLogs(cfg.train_size, cfg.cardinalities)
    held_out = ClickLogs(cfg.eval_size, cfg.cardinalities, offset=cfg.train_size, cache=True)
    return train, held_out


def init(model: DLRM, rng: jax.Array, batch) -> dict:
    return model.init(rng, batch["dense"], batch["sparse"])


def _per_example(logit, label) -> dict[str, jax.Array]:
    return {
        "loss": optax.sigmoid_binary_cross_entropy(logit, label),
        "accuracy": ((logit > 0) == (label > 0.5)).astype(jnp.float32),
    }


def train_loss(model: DLRM, variables: dict, batch, rng: jax.Array | None = None):
    del rng  # no dropout
    return _per_example(model.apply(variables, batch["dense"], batch["sparse"]), batch["label"]), {}


def eval_metrics(model: DLRM, variables: dict, batch) -> dict[str, jax.Array]:
    return _per_example(model.apply(variables, batch["dense"], batch["sparse"]), batch["label"])


def predict(model: DLRM, variables: dict, batch) -> jax.Array:
    """Each example's logit (inference)."""
    return model.apply({"params": variables["params"]}, batch["dense"], batch["sparse"])


def score(model: DLRM, logits: np.ndarray, data, chunk: int = 4096) -> dict[str, float]:
    """AUC of the whole held-out set's ``logits`` (scikit-learn's ``roc_auc_score``; the
    submission's ``tf.metrics.auc`` approximates it with 1000 thresholds)."""
    from sklearn.metrics import roc_auc_score

    del model
    labels = [
        data.get(np.arange(start, min(start + chunk, len(data))))["label"] for start in range(0, len(data), chunk)
    ]
    return {"auc": float(roc_auc_score(np.concatenate(labels), logits))}


def evaluate(model: DLRM, variables: dict, data, chunk: int = 4096) -> dict[str, float]:
    """:func:`score` of :func:`predict` over the whole held-out set, on one device."""
    return evaluate_whole_set(predict, score, model, variables, data, chunk)


def learning_rate_schedule(cfg: DLRMConfig, total_steps: int | None = None) -> optax.Schedule:
    """The submission's ``utils.lr_fn``: linear warmup from 0, constant, then ``(1 - t)**2`` over
    ``decay_steps`` from ``decay_start_step`` (at least 1e-7); a run of another length than
    ``train_steps`` scales the decay's start and length with it."""
    scale = (total_steps or cfg.train_steps) / cfg.train_steps
    warmup = max(1, round(cfg.warmup_steps * scale))
    start, length = round(cfg.decay_start_step * scale), max(1, round(cfg.decay_steps * scale))
    peak = cfg.learning_rate

    def schedule(count):
        step = jnp.asarray(count, jnp.float32)
        warm = peak * step / warmup
        done = jnp.minimum(step - start, length)
        decayed = jnp.maximum(peak * ((length - done) / length) ** 2, 1e-7)
        return jnp.where(step < warmup, warm, jnp.where(step > start, decayed, peak))

    return schedule


def make_optimizer(cfg: DLRMConfig, total_steps: int) -> optax.GradientTransformation:
    if cfg.optimizer == "adagrad":
        return optax.adagrad(cfg.learning_rate, initial_accumulator_value=cfg.adagrad_init_accum)
    return optax.sgd(learning_rate_schedule(cfg, total_steps))


def hparams(cfg: DLRMConfig, total_steps: int) -> dict:
    """The recipe under the v0.7 DLRM rules' keys (mlperf-logging ``training_0.7.0/closed_dlrm.yaml``)."""
    scale = (total_steps or cfg.train_steps) / cfg.train_steps
    return {
        C.OPT_NAME: C.SGD if cfg.optimizer == "sgd" else "adagrad",
        C.OPT_BASE_LR: cfg.learning_rate,
        "sgd_opt_base_learning_rate": cfg.learning_rate,
        C.OPT_LR_WARMUP_STEPS: max(1, round(cfg.warmup_steps * scale)),
        "lr_decay_start_steps": round(cfg.decay_start_step * scale),
        "sgd_opt_learning_rate_decay_steps": max(1, round(cfg.decay_steps * scale)),
        "sgd_opt_learning_rate_decay_poly_power": 2,
    }


WORKLOAD = Workload(
    name="dlrm",
    description="DLRM (Naumov et al. 2019), Criteo Terabyte click logs (MLPerf v0.7), SGD, 26 embedding tables",
    configs={"full": FULL, "tiny": TINY},
    reference=Reference(params=REFERENCE_PARAMS, source=REFERENCE_SOURCE),
    make_model=make_model,
    batch_shapes=batch_shapes,
    make_data=make_data,
    make_optimizer=make_optimizer,
    init=init,
    train_loss=train_loss,
    eval_metrics=eval_metrics,
    eval_metric="auc",
    hparams=hparams,
    predict=predict,
    score=score,
)
