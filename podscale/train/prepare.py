"""Every check a run makes before any work (:func:`check`), and what it resolves (:class:`Prepared`):
``--dry-run`` stops here, and the training loop (:mod:`podscale.train.trainer`) starts from it."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax

from podscale.parallel.engine import data_parallel
from podscale.parallel.mesh import BN_GROUP, make_mesh
from podscale.parallel.strategy import Strategy
from podscale.parallel.tensor import RuleWarning, with_model_rules
from podscale.train.config import TrainConfig, check_output_paths
from podscale.train.resume import (
    check_checkpoints,
    check_data_position,
    check_run_config,
    resolved_run_config,
    schedule_steps,
)
from podscale.train.tasks import make_task, make_task_optimizer, make_train_step
from podscale.workloads.precision import check_state, policy_by_name


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A run checked before any work: everything :func:`check` resolved from the config."""

    mesh: Any
    task: Any
    optimizer: Any
    strategy: Strategy
    dp: Any
    batch_size: int
    eval_batch: int
    init: Any
    latest_checkpoint: int | None
    layout: Any
    """The state's stored layout (``dp.prepare(...).state``: the step traced at the global batch's shapes)."""
    schedule_steps: int | None = None
    """The steps the learning-rate schedule is built over (``None``: no schedule of the run's length)."""

    def dry_run_summary(self) -> dict[str, Any]:
        """What ``--dry-run`` prints: the run as it would start."""
        return {
            "dry_run": True,
            "mesh": {str(k): int(v) for k, v in self.mesh.shape.items()},
            "replicas": self.dp.replicas,
            "batch_size": self.batch_size,
            "eval_batch_size": self.eval_batch,
            "resume_from": self.latest_checkpoint,
            "schedule_steps": self.schedule_steps,
        }


def check(config: TrainConfig, lead: bool = True, write: bool = False) -> Prepared:
    """Every check a run makes before any work (the devices, the model, its data, the optimizer,
    the batch over the replicas, the state's dtypes, the run recorded in ``--workdir``, the
    checkpoints there, the step traced at the global shapes and its layout decided), with nothing
    initialised, compiled or written unless ``write`` (then a new run records its
    ``run_config.json``). ``--dry-run`` stops here."""
    if lead:  # the files process 0 writes, checked there (a run whose process index is known only now)
        check_output_paths(config)
    mesh = make_mesh(config.mesh, bn_group_size=config.bn_group_size, spatial=config.strategy.spatial)
    task = make_task(
        config.model,
        config.data,
        config.seed,
        config=config.config,
        policy=policy_by_name(config.precision),
        bn_axis=BN_GROUP if config.bn_group_size > 1 else None,
    )
    horizon = schedule_steps(config, task)  # a resumed run keeps the schedule it started on
    optimizer = make_task_optimizer(task, config.optimizer, config.learning_rate, horizon or config.steps)
    batch_size = resolved_run_config(config, task)["batch_size"]
    strategy = with_model_rules(config.strategy, config.model)
    dp = data_parallel(make_train_step(task, optimizer, config.seed), mesh, strategy)
    if batch_size % dp.replicas:
        raise ValueError(
            f"--batch-size {batch_size} is not divisible by the {dp.replicas} replicas; use a multiple of {dp.replicas}"
        )
    if task.train_data is not None and batch_size > len(task.train_data):
        raise ValueError(f"--batch-size {batch_size} is larger than the data set ({len(task.train_data)} examples)")
    eval_batch = config.eval_batch_size or batch_size
    held_out = len(task.eval_data) if task.eval_data is not None else None
    if config.eval_batch_size and held_out is not None and eval_batch > -(-held_out // dp.replicas) * dp.replicas:
        fits = -(-held_out // dp.replicas) * dp.replicas
        raise ValueError(
            f"--eval-batch-size {eval_batch} is larger than the held-out set ({held_out} examples): one batch of "
            f"{fits} (a multiple of the {dp.replicas} replicas) holds it all; give at most {fits}"
        )
    if eval_batch % dp.replicas:  # the evaluation splits its rows over the replicas, as the step does
        raise ValueError(
            f"--eval-batch-size {eval_batch} is not divisible by the {dp.replicas} replicas the evaluation splits it "
            f"over; use a multiple of {dp.replicas}"
        )
    latest = check_checkpoints(config)
    if config.workdir:
        check_run_config(config, task, write=write and lead, horizon=horizon)

    def init():
        return task.init_state(jax.random.key(config.seed), optimizer)

    shapes = task.state_shapes(optimizer, rng=jax.random.key(config.seed))
    check_state(shapes)
    if config.bn_group_size > 1 and not shapes.batch_stats:
        raise ValueError(
            f"--bn-group-size {config.bn_group_size}: model {config.model!r} has no batch norm; drop the flag"
        )
    with warnings.catch_warnings():  # the rules' notes (a RuleWarning) are printed once, by the run
        warnings.simplefilter("ignore", RuleWarning)
        layout = dp.prepare(shapes, task.batch_shapes(batch_size)).state  # traces the step: its own checks
    return Prepared(mesh, task, optimizer, strategy, dp, batch_size, eval_batch, init, latest, layout, horizon)


def resume_step(config: TrainConfig, run: Prepared) -> int | None:
    """``--resume --dry-run``: the step the run would resume from, read and verified against its
    checksums as the run's restore does (with ``--resume-fallback``, the newest intact step; a
    damaged one is refused as the run refuses it), with nothing changed on disk."""
    if not config.resume:
        return run.latest_checkpoint
    import os

    from podscale.train.checkpoint import Checkpointer
    from podscale.train.config import DEFAULT_CHECKPOINT_EVERY
    from podscale.train.saving import CheckpointForm

    ckpt = Checkpointer(
        os.path.join(config.workdir, "checkpoints"), config.checkpoint_every or DEFAULT_CHECKPOINT_EVERY
    )
    try:
        step, state = ckpt.restore(CheckpointForm(run.layout), fallback=config.resume_fallback, dry_run=True)
        metadata = ckpt.metadata(step)
    finally:
        ckpt.close()
    del state
    start = step
    where = f"checkpoint step {step} in {ckpt.directory}"
    check_data_position(metadata, start, run.batch_size, where)
    if start >= config.steps:
        raise ValueError(
            f"the run in {config.workdir} is already at step {start}, and --steps is {config.steps}; "
            f"pass a larger --steps to train further"
        )
    return step
