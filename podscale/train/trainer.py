"""The training loop behind ``podscale train``.

One step of data flow: the :class:`~podscale.data.Loader` thread prepares this process's rows of
the next global batch and places them on the mesh; ``DataParallelStep`` runs the user's step on
every replica; metrics come back one step late so the host never stalls the devices; every
``eval_every`` steps the held-out set is evaluated on the state as the step stores it, each
replica on its own rows (a whole-set metric, COCO mAP or AUC: each replica predicts its rows and
the host scores them all); every ``checkpoint_every`` steps orbax saves the stored state, each
process its own shards, in the background (:mod:`~podscale.train.checkpoint`).

Around the loop: :mod:`~podscale.train.config` (what a run is, its output paths),
:mod:`~podscale.train.prepare` (every check before work), :mod:`~podscale.train.resume` (what a
resumed run must repeat), :mod:`~podscale.train.records` (metrics and the MLPerf log's
configuration) and :mod:`~podscale.train.saving` (checkpoints, finite only). The loop itself
(:func:`_loop`) is a few lines; its parts are the objects of :mod:`~podscale.train.hooks` (the
goodput clocks, the display, the records, MLPerf's blocks, evaluation, checkpoints, preemption).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from typing import Any

import jax
import numpy as np
from mlperf_logging.mllog import constants as C
from rich.console import Console

from podscale._jax import jax_distributed
from podscale.train import goodput
from podscale.train.checkpoint import Checkpointer
from podscale.train.config import (
    DEFAULT_CHECKPOINT_EVERY,
    TrainConfig,
    make_output_folders,
    mllog_path,
    write_error,
)
from podscale.train.data import Loader, data_position
from podscale.train.hooks import (
    Checkpoints,
    Clocks,
    Display,
    Evaluation,
    Hooks,
    MLPerfBlocks,
    Preemption,
    Records,
    TrainStep,
)
from podscale.train.interrupt import StopRequest
from podscale.train.mlperf_log import RunLog, parse, time_to_target
from podscale.train.prepare import check
from podscale.train.records import flat_params, log_run_config, metrics_path
from podscale.train.resume import check_data_position, resolved_run_config
from podscale.train.saving import CheckpointForm
from podscale.train.saving import save_finite as _save  # the trainer's handle on saving (tests replace it)


def _targets(task, config: TrainConfig):
    """The metrics a run must reach (``--target``'s ``eval_metric`` and the workload's other
    quality targets; ``None`` without ``--target``), and how a result is logged as MLPerf's
    ``eval_accuracy``."""
    workload = task.workload
    accuracy = (workload.mlperf_accuracy if workload and workload.mlperf_accuracy else None) or (
        lambda results: results[task.eval_metric]
    )
    if config.target is None:
        return None, accuracy
    targets = {task.eval_metric: config.target}
    if workload and workload.quality:
        targets.update(workload.quality(task.config))
    return targets, accuracy


def _preemption_sync() -> bool:
    """Whether JAX's preemption sync manager runs (multi-process runs with its service on)."""
    return jax_distributed.global_state.preemption_sync_manager is not None


def train(config: TrainConfig) -> dict[str, Any]:
    """Trains as ``config`` says; returns the summary that ``--json`` prints."""
    run_start = time.perf_counter()
    lead = jax.process_index() == 0
    if lead:
        make_output_folders(config)
    # Each run segment logs to a file of its own (MLPerf allows one run_start per log): a resumed
    # run's is the next mllog.N.txt, written only if it is new.
    mlog = RunLog(mllog_path(config) if lead else None, write=lead, mode="x" if config.resume else "w")
    stop = StopRequest(jax.process_count(), sync=_preemption_sync())
    closing: list = []  # the checkpointer, closed (its save in flight finished) however the run ends
    try:
        with stop:
            summary = _train(config, mlog, run_start, lead, stop, closing)
    except BaseException:
        if mlog.running:
            with contextlib.suppress(OSError):  # a full disk: the error that stopped the run says so
                mlog.end(C.RUN_STOP, metadata={"status": C.ABORTED})
        _close_all([mlog.close, *closing], failing=True)
        raise
    _close_all([mlog.close, *closing], failing=False)
    return summary


def _close_all(closing: list, failing: bool) -> None:
    """Closes every output (the MLPerf log, the checkpointer, the TensorBoard writer), each even if
    another fails. Where the run is failing already (a full disk stopped a save), what its outputs
    fail with on closing is the same cause and would hide it: the run's own error is kept. Otherwise
    the first failure is raised, once all are closed."""
    first = None
    for close in closing:
        try:
            close()
        except Exception as e:
            first = first or e
    if first is not None and not failing:
        raise first


def _train(
    config: TrainConfig, mlog: RunLog, run_start: float, lead: bool, stop: StopRequest, closing: list
) -> dict[str, Any]:
    """MLPerf's init (:func:`_begin`), the loop's parts (:func:`_hooks`), the loop, the end (:func:`_finish`)."""
    begun = _begin(config, mlog, lead, closing)
    hooks = _hooks(config, begun, mlog, run_start, lead, stop, closing)
    run = begun.run
    loader = Loader(run.task.train_data, run.dp, run.batch_size, config.seed, start_step=begun.start)
    try:
        state, step = _loop(config, hooks, begun.state, loader, begun.start)
    finally:
        loader.close()
        hooks.records.close()
    return _finish(config, begun, hooks, mlog, lead, state, step)


def _loop(config: TrainConfig, hooks: Hooks, state, loader: Loader, start: int) -> tuple[Any, int]:
    """Trains from step ``start`` to ``config.steps`` (or until the targets are reached); the state
    and the last step it ran (0-based)."""
    step = start
    with hooks.display.shown():
        hooks.clocks.loop_started()
        for step, batch in hooks.clocks.waiting(loader):
            if step >= config.steps:
                break
            state, metrics = hooks.train_step(state, step, batch)
            hooks.records.ran(step, metrics)  # the previous step's metrics are read while this one runs
            done = step + 1
            hooks.display.stepped(done, hooks.records.last_loss, hooks.clocks)
            with hooks.clocks.aside():  # evaluation and checkpoints are not timed as steps
                evaluating = hooks.evaluation.due(done)
                if evaluating or hooks.checkpoints.due(done):
                    # Let the step finish before another program runs collectives on the same
                    # devices: on CPU, the eval's all-reduce could otherwise interleave with the
                    # step's and never complete.
                    jax.block_until_ready(state)
                hooks.checkpoints.after_step(done, state)
                reached = evaluating and hooks.evaluation.run(done, state)
            if reached:
                break
            hooks.preemption.check(done, state)  # a coordinated stop: raises Interrupted
        hooks.records.read()  # the last step's metrics
        hooks.clocks.loop_ended(state)
    return state, step


@dataclasses.dataclass
class _Begun:
    """A run at MLPerf's ``run_start``: checked (:func:`~podscale.train.prepare.check`), its state
    initialized or restored (``resumed_from``: the checkpoint step, or ``None``) at step ``start``."""

    run: Any
    state: Any
    form: CheckpointForm
    ckpt: Checkpointer | None
    resumed_from: int | None
    start: int


def _begin(config: TrainConfig, mlog: RunLog, lead: bool, closing: list) -> _Begun:
    """MLPerf's init: the checks, the state (restored with ``--resume``), the run's configuration."""
    # MLPerf asks whether the system's caches were cleared before the run: podscale does not
    # clear them (its data sets are synthetic or small, read into memory).
    mlog.event(C.CACHE_CLEAR, False)
    mlog.start(C.INIT_START)
    run = check(config, lead, write=True)
    task, strategy, dp, batch_size, init = run.task, run.strategy, run.dp, run.batch_size, run.init

    # Init, then shard: the layout is decided on shapes, and the state is created directly in it.
    layout = run.layout
    if lead and dp.placement.rule_notes:
        Console(stderr=True).print(
            f"podscale: the sharding rules {strategy.rules.name!r} leave {len(dp.placement.rule_notes)} leaves as they are "
            "(--strict refuses them):\n  " + "\n  ".join(dp.placement.rule_notes),
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    state = jax.jit(lambda: layout.store(init()), out_shardings=layout.shardings())()
    checkpointed = CheckpointForm(layout)

    ckpt = (
        Checkpointer(os.path.join(config.workdir, "checkpoints"), config.checkpoint_every or DEFAULT_CHECKPOINT_EVERY)
        if config.workdir
        else None
    )
    if ckpt:
        closing.append(ckpt.close)
    resumed_from = None
    if ckpt and config.resume:
        # read as it was saved (any placement's stored layout), converted into this one's
        resumed_from, state = ckpt.restore(checkpointed, fallback=config.resume_fallback)
    start = int(np.asarray(state.step.addressable_data(0)))
    if resumed_from is not None:  # the data position saved with the step is where this run's data starts
        where = f"checkpoint step {resumed_from} in {ckpt.directory}"
        check_data_position(ckpt.metadata(resumed_from), start, batch_size, where)
    if start >= config.steps:
        raise ValueError(
            f"the run in {config.workdir} is already at step {start}, and --steps is {config.steps}; "
            f"pass a larger --steps to train further"
        )
    log_run_config(
        mlog, config, task, dp, batch_size, run.eval_batch, bool(jax.eval_shape(init).batch_stats), run.schedule_steps
    )
    mlog.end(C.INIT_STOP)
    # A resumed segment's log is a whole log of its own (init, configuration, run_start), from step
    # ``start``: its first block starts there, at the epoch and example the checkpoint holds.
    resumed = {"resumed_from_step": start, "first_example": data_position(start, batch_size)}
    mlog.start(C.RUN_START, metadata=resumed if resumed_from is not None else None)
    return _Begun(run, state, checkpointed, ckpt, resumed_from, start)


def _hooks(
    config: TrainConfig, begun: _Begun, mlog: RunLog, run_start: float, lead: bool, stop: StopRequest, closing: list
) -> Hooks:
    """The loop's parts, from the run's first MLPerf block (step ``begun.start + 1``) on."""
    run, start = begun.run, begun.start
    blocks = MLPerfBlocks(mlog, config, run.batch_size, len(run.task.train_data))
    blocks.start(start)
    path = metrics_path(config)
    redone = goodput.redone_steps(path, start) if begun.resumed_from is not None else 0
    clocks = Clocks(run_start, start, redone)
    resolved = resolved_run_config(config, run.task)
    records = Records(config, path, lead, resolved, run.batch_size, run_start, begun.ckpt)
    closing.append(records.board.close)
    display = Display(config, lead, start, run.batch_size, records.board)
    targets, accuracy = _targets(run.task, config)
    evaluation = Evaluation(run, config, targets, accuracy, mlog, blocks, records, display, clocks)
    # ``_save`` looked up here, when the run starts: the module's name for it is the handle tests replace.
    checkpoints = Checkpoints(begun.ckpt, begun.form, run.batch_size, _save, records, clocks)
    return Hooks(
        clocks=clocks,
        records=records,
        display=display,
        blocks=blocks,
        train_step=TrainStep(run.dp, start, clocks, display),
        evaluation=evaluation,
        checkpoints=checkpoints,
        preemption=Preemption(stop, start, records, checkpoints),
    )


def _finish(
    config: TrainConfig, begun: _Begun, hooks: Hooks, mlog: RunLog, lead: bool, state, step: int
) -> dict[str, Any]:
    """After the loop: MLPerf's ``run_stop``, the last checkpoint, the export, the goodput; the summary."""
    run, evaluation, clocks = begun.run, hooks.evaluation, hooks.clocks
    task, dp, batch_size = run.task, run.dp, run.batch_size
    summary: dict[str, Any] = {"time_to_target_s": None, "eval": evaluation.results}
    if evaluation.target_step is not None:
        summary["target_step"] = evaluation.target_step
    final_step = step + 1 if step < config.steps else config.steps
    reached = config.target is not None and summary.get("target_step") is not None
    hooks.blocks.run_stop(final_step, success=reached or config.target is None)
    if reached:
        target = evaluation.accuracy(evaluation.targets)
        summary["time_to_target_s"] = time_to_target(parse(mlog.lines), target)["seconds"]
    hooks.checkpoints.at_end(final_step, state)
    if config.export and lead:
        try:
            np.savez(config.export, **flat_params(dp.gather_state(state).params))
        except OSError as e:
            raise write_error(f"--export {config.export}", e) from None
    summary["goodput"] = clocks.goodput(dp)
    hooks.records.goodput(summary["goodput"], final_step)
    elapsed = clocks.elapsed
    summary.update(
        steps=final_step,
        schedule_steps=run.schedule_steps,
        final_train_loss=hooks.records.last_loss,
        eval_metric=task.eval_metric,
        eval_value=summary["eval"].get(task.eval_metric),
        target=config.target,
        targets=evaluation.targets,
        examples_per_s=clocks.timed_steps * batch_size / elapsed if elapsed > 0 else None,
        replicas=dp.replicas,
        processes=jax.process_count(),
        mesh=dict(run.mesh.shape),
        grad_sum={
            "mode": dp.grad_sum.mode,
            "order": list(dp.grad_sum.order),
            "chunks": dp.grad_sum.chunks,
            "phases": dp.grad_sum.phases if dp.grad_sum.mode == "2d" else None,
            "dtype": config.strategy.grad_sum_dtype,
        },
        model=config.model,
        config=config.config,
        data=config.data,
        optimizer=resolved_run_config(config, task)["optimizer"],
        batch_size=batch_size,
        resumed_from=begun.resumed_from,
        mllog=mlog.path,
        seed=config.seed,
        learning_rate=_base_learning_rate(task, config),
        wall_time_s=time.perf_counter() - clocks.run_start,
        configuration=json.loads(
            json.dumps(dataclasses.asdict(dataclasses.replace(config, strategy=dp.strategy)), default=str)
        ),
    )
    return summary


def _base_learning_rate(task, config: TrainConfig) -> float:
    """The peak learning rate the run used: the flag, the recipe's, or adam's default."""
    return resolved_run_config(config, task)["learning_rate"]
