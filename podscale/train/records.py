"""What a run writes as it goes, besides checkpoints: ``metrics.jsonl`` (a line per step with the
examples it fed, whose loss is checked finite), the MLPerf log's run configuration, and the exported parameters."""

from __future__ import annotations

import math
import os

import jax
import numpy as np
from mlperf_logging.mllog import constants as C

from podscale.train.config import TrainConfig
from podscale.train.data import step_examples
from podscale.train.mlperf_log import RunLog
from podscale.train.saving import raise_non_finite
from podscale.train.tasks import recipe_config


def metrics_path(config: TrainConfig) -> str | None:
    if config.metrics_file:
        return config.metrics_file
    return os.path.join(config.workdir, "metrics.jsonl") if config.workdir else None


def flat_params(params) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(params)}


def log_run_config(
    mlog: RunLog,
    config: TrainConfig,
    task,
    dp,
    batch_size: int,
    eval_batch: int,
    batch_norm: bool,
    schedule_steps: int | None = None,
) -> None:
    """The MLPerf log's run configuration: submission, batch, seed, data sizes, hyperparameters."""
    # MLPerf's benchmark names (resnet, transformer, bert, gnmt); the small models log their own.
    mlog.event(C.SUBMISSION_BENCHMARK, task.workload.mlperf_name if task.workload else config.model)
    mlog.event(C.SUBMISSION_ORG, "podscale")
    mlog.event(C.SUBMISSION_DIVISION, "open")
    mlog.event(C.SUBMISSION_STATUS, "research")
    mlog.event(C.SUBMISSION_PLATFORM, f"{dp.replicas}x{jax.devices()[0].device_kind}")
    mlog.event(C.SEED, config.seed)
    mlog.event(C.GLOBAL_BATCH_SIZE, batch_size)
    mlog.event(C.TRAIN_SAMPLES, len(task.train_data))
    mlog.event(C.EVAL_SAMPLES, len(task.eval_data))
    if batch_norm:  # the images each batch norm normalizes over: a replica's, times its group
        mlog.event(C.MODEL_BN_SPAN, batch_size // dp.replicas * config.bn_group_size)
    if task.workload and config.optimizer is None:
        cfg = recipe_config(task, config.learning_rate)
        hparams = (
            task.workload.hparams(cfg, schedule_steps or config.steps)
            if task.workload.hparams
            else {C.OPT_BASE_LR: cfg.learning_rate}
        )
    else:
        hparams = {C.OPT_NAME: config.optimizer or "adam", C.OPT_BASE_LR: config.learning_rate or 1e-3}
    for key, value in hparams.items():
        mlog.event(key, value)


def log_step(pending, record, global_batch: int, ckpt=None) -> float:
    """Records a step's line: its number (1-based), the examples it fed (``[first, last)``, their
    global positions in the data stream, over all processes) and its metrics."""
    step, metrics = pending
    values = {k: float(v) for k, v in metrics.items()}
    record({"step": step + 1, "examples": list(step_examples(step, global_batch)), **values})
    if not math.isfinite(values["loss"]):
        raise_non_finite(f"the training loss is {values['loss']}", step + 1, ckpt)
    return values["loss"]
