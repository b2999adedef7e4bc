"""A run continued with ``--resume``: what a fresh run records in ``WORKDIR/run_config.json``
(:func:`resolved_run_config`) and what a resumed one must repeat (:data:`FIXED_ON_RESUME`), and
the checkpoints in ``--workdir`` checked against ``--resume`` and ``--steps``; all before any work."""

from __future__ import annotations

import json
import os
from typing import Any

from podscale.train.checkpoint import CheckpointError
from podscale.train.config import RUN_CONFIG, TrainConfig
from podscale.train.data import data_position
from podscale.train.tasks import recipe_config

FIXED_ON_RESUME = (
    "model",
    "config",
    "data",
    "optimizer",
    "learning_rate",
    "batch_size",
    "seed",
    "precision",
    "bn_group_size",
)
"""What a resumed run must repeat: the model, its data and their order, the optimizer and its
state. The rest may change on resume: ``--steps`` (up to the learning-rate schedule's horizon,
:func:`schedule_steps`, which is kept), ``--mesh`` / ``--replicas`` / the process
count (a restore converts the saved layout into the run's own), ``--eval-every``, ``--eval-batch-size``,
``--checkpoint-every``, ``--target``, the strategy (every strategy computes the same step) and
where logs and exports go."""


def resolved_run_config(config: TrainConfig, task, values: dict | None = None) -> dict[str, Any]:
    """The ``FIXED_ON_RESUME`` values a run uses (``values``, default ``config``'s), with every
    default filled in as ``task`` resolves it: the data set (``synthetic``; an MLPerf workload's
    own is ``None``), the optimizer (``adam``; ``recipe`` for an MLPerf workload's own), its peak
    learning rate (1e-3, or the recipe's) and the global batch (64, or the workload config's).
    ``None`` always means the default, so a ``run_config.json`` of an older podscale, which held
    the flags as given, resolves the same way."""
    v = {k: getattr(config, k) for k in FIXED_ON_RESUME} | dict(values or {})
    workload = task.workload
    if v["data"] is None and not workload:
        v["data"] = "synthetic"
    if v["optimizer"] is None:
        v["optimizer"] = "recipe" if workload else "adam"
    if v["learning_rate"] is None:
        v["learning_rate"] = (
            recipe_config(task, None).learning_rate if workload and v["optimizer"] == "recipe" else 1e-3
        )
    if v["batch_size"] is None:
        v["batch_size"] = task.config.global_batch if workload else 64
    for key, default in (("seed", 0), ("precision", "bf16"), ("bn_group_size", 1)):
        if v[key] is None:
            v[key] = default
    return v


SCHEDULE_STEPS = "schedule_steps"
"""The key of the learning-rate schedule's horizon in ``run_config.json`` (``None``: no schedule)."""


def has_schedule(task, config: TrainConfig) -> bool:
    """Whether the run's learning rate follows a schedule over the run's length: an MLPerf
    workload's own recipe whose hyperparameters change with the steps it is built for (the
    Transformer's warmup-rsqrt schedule has no end, so it has no horizon)."""
    workload = task.workload
    if not workload or config.optimizer is not None:
        return False
    if workload.hparams is None:
        return True
    cfg = recipe_config(task, config.learning_rate)
    return workload.hparams(cfg, 1000) != workload.hparams(cfg, 2000)


def _saved_run_config(config: TrainConfig) -> dict | None:
    """``run_config.json`` of the run ``--resume`` continues (``None``: none there yet)."""
    path = os.path.join(config.workdir, RUN_CONFIG)
    if not os.path.exists(path):
        if not os.path.isdir(os.path.join(config.workdir, "checkpoints")):
            return None  # nothing to resume: the checkpoint restore says so
        raise ValueError(
            f"--resume: {path} is missing, so podscale cannot check that this run continues the one in "
            f"--workdir {config.workdir}; start a new --workdir"
        )
    try:
        with open(path) as f:
            saved = json.load(f)
        if not isinstance(saved, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        raise ValueError(
            f"--resume: {path} cannot be read ({e}), so podscale cannot check that this run continues the one "
            f"in --workdir {config.workdir}; start a new --workdir"
        ) from None
    return saved


def schedule_steps(config: TrainConfig, task) -> int | None:
    """The steps the run's learning-rate schedule is built over (``None``: the learning rate follows
    no schedule of the run's length, :func:`has_schedule`): ``--schedule-steps``, else on
    ``--resume`` the horizon the run recorded in ``run_config.json`` when it started, else
    ``--steps``. A resumed run keeps its schedule: ``--steps`` past the recorded horizon, or
    another ``--schedule-steps``, is refused naming it (the same steps could not follow the
    schedule a straight run of that length follows)."""
    if not has_schedule(task, config):
        if config.schedule_steps is not None:
            why = (
                f"optimizer {config.optimizer!r} runs at a constant learning rate"
                if config.optimizer is not None or not task.workload
                else f"model {config.model!r}'s recipe has a schedule of no set length"
            )
            raise ValueError(
                f"--schedule-steps {config.schedule_steps}: {why}, so no schedule has steps; drop the flag"
            )
        return None
    saved = _saved_run_config(config) if config.resume and config.workdir else None
    if saved is None:
        return config.schedule_steps or config.steps
    where = f"the run in {config.workdir}"
    recorded = saved.get(SCHEDULE_STEPS)
    if not isinstance(recorded, int) or isinstance(recorded, bool):
        if config.schedule_steps is None:  # an older podscale's run: its horizon was its --steps, unrecorded
            raise ValueError(
                f"--resume: {where} follows its recipe's learning-rate schedule, whose length its {RUN_CONFIG} does "
                "not record (an older podscale built it over each run's --steps); pass --schedule-steps with the "
                "--steps that run started with, to continue on its schedule"
            )
        return config.schedule_steps
    if config.schedule_steps is not None and config.schedule_steps != recorded:
        raise ValueError(
            f"--resume: {where} was started with --schedule-steps {recorded} (its learning-rate schedule's length), "
            f"this one asks for {config.schedule_steps}; resume with the same --schedule-steps, or leave it out"
        )
    if config.steps > recorded:
        raise ValueError(
            f"--steps {config.steps}: {where} follows its recipe's learning-rate schedule over {recorded} steps "
            f"(--schedule-steps {recorded}, recorded when it started), which a resumed run keeps, so it ends at step "
            f"{recorded}; give --steps of at most {recorded}. To extend a run later, start it with --schedule-steps "
            "set to the most steps it may train; or start a new --workdir"
        )
    return recorded


def check_run_config(config: TrainConfig, task, write: bool, horizon: int | None = None) -> None:
    """A fresh run records the resolved ``FIXED_ON_RESUME`` values (:func:`resolved_run_config`:
    what it used, not the flags as typed) in ``WORKDIR/run_config.json``; ``--resume`` refuses,
    before any work, a run that resolves to another value of one of them, naming the flag."""
    path = os.path.join(config.workdir, RUN_CONFIG)
    mine = resolved_run_config(config, task)
    if not config.resume:
        if write and not os.path.isdir(os.path.join(config.workdir, "checkpoints")):
            os.makedirs(config.workdir, exist_ok=True)
            with open(path + ".tmp", "w") as f:
                json.dump(mine | ({SCHEDULE_STEPS: horizon} if horizon is not None else {}), f, indent=1)
            os.replace(path + ".tmp", path)
        return
    saved = _saved_run_config(config)
    if saved is None:
        return
    theirs = resolved_run_config(config, task, {k: saved[k] for k in FIXED_ON_RESUME if k in saved})
    for key in FIXED_ON_RESUME:
        if theirs[key] != mine[key]:
            flag = "--" + key.replace("_", "-")
            hint = " (an MLPerf workload's own recipe: leave --optimizer out)" if theirs[key] == "recipe" else ""
            raise ValueError(
                f"--resume: the run in {config.workdir} was started with {flag} {theirs[key]}{hint}, this one asks "
                f"for {mine[key]}; resume with the same {flag} (or start a new --workdir). What may change on "
                "resume: --steps (up to --schedule-steps, the schedule's length, where a recipe has one), "
                "--mesh/--replicas, --eval-every, --checkpoint-every, --target, the strategy"
            )


def check_checkpoints(config: TrainConfig) -> int | None:
    """The latest checkpoint step in ``--workdir`` (``None``: none), checked against ``--resume``
    and ``--steps`` before any work; nothing is created.

    The steps are read from the file system alone (the finalized step directories of orbax's
    standard step names, the manager's own), not through an orbax ``CheckpointManager``: its
    constructor enters a barrier of all processes, and whether the folder exists yet differs
    between processes (process 0's manager creates it). A process that found it made a moment
    ago entered one barrier more than the others, and the run hung at its first step (seen in
    the two-process SIGTERM test under load)."""
    folder = os.path.join(config.workdir, "checkpoints") if config.workdir else None
    latest = None
    if folder and os.path.isdir(folder):
        import orbax.checkpoint as ocp

        latest = max((found.step for found in ocp.step.standard_name_format().find_all(folder)), default=None)
    if config.resume and latest is None:
        raise CheckpointError(
            f"--resume: no complete checkpoint in {folder}. Start without --resume, or point --workdir at the "
            "directory of the run to continue."
        )
    if not config.resume and latest is not None:
        raise ValueError(
            f"--workdir {config.workdir} already holds checkpoints (latest step {latest}); pass --resume "
            "to continue that run, or choose a new --workdir"
        )
    if config.resume and latest >= config.steps and not config.resume_fallback:
        raise ValueError(
            f"the run in {config.workdir} is already at step {latest}, and --steps is {config.steps}; "
            f"pass a larger --steps to train further"
        )
    return latest


DATA_POSITION = "data"
"""The key of a checkpoint's data position in the metadata the trainer saves with it
(:meth:`Checkpointer.maybe_save`): ``{"next_example": N, "global_batch": B}``."""


def saved_data_position(step: int, global_batch: int) -> dict:
    """What a checkpoint of ``step`` saves beside the state: the run's data position, the global
    index of the next example it feeds (:func:`~podscale.train.data.data_position`), and the global
    batch that makes it."""
    return {DATA_POSITION: {"next_example": data_position(step, global_batch), "global_batch": global_batch}}


def check_data_position(saved: dict, step: int, global_batch: int, where: str) -> None:
    """A run resumed from checkpoint ``step`` (``where``: which, in which folder) feeds next the
    example the checkpoint's run would have fed next: refused, naming both, when the global batch
    differs from the one it was saved with, or its saved position is not this run's first example
    (``step x global batch``). A checkpoint of an older podscale, saved without it, is not checked."""
    position = saved.get(DATA_POSITION)
    if not isinstance(position, dict):
        return
    theirs, their_batch = position.get("next_example"), position.get("global_batch")
    first = data_position(step, global_batch)
    if their_batch != global_batch:
        raise ValueError(
            f"--resume: {where} was saved by a run with a global batch of {their_batch} examples per step (its next "
            f"example: {theirs}); this run's global batch is {global_batch}, which would start at example {first} "
            f"and feed another order of examples. Resume with --batch-size {their_batch}, or start a new --workdir"
        )
    if theirs != first:
        raise ValueError(
            f"--resume: {where} saved its data position as example {theirs}, but step {step} at a global batch of "
            f"{global_batch} starts at example {first}: the checkpoint does not continue this run's data order. "
            "Start a new --workdir"
        )
