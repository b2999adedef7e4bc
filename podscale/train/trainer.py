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
configuration) and :mod:`~podscale.train.saving` (checkpoints, finite only).
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
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from podscale._jax import jax_distributed
from podscale.report import Ticker, heartbeat
from podscale.train import goodput
from podscale.train.board import Board
from podscale.train.checkpoint import Checkpointer
from podscale.train.config import (
    DEFAULT_CHECKPOINT_EVERY,
    TrainConfig,
    make_output_folders,
    mllog_path,
    write_error,
)
from podscale.train.data import Loader, data_position, padded_eval_batches
from podscale.train.evaluate import distributed_eval
from podscale.train.interrupt import Interrupted, StopRequest
from podscale.train.mlperf_log import RunLog, parse, time_to_target
from podscale.train.prepare import check
from podscale.train.records import _flat_params, _log_run_config, _log_step, _metrics_path
from podscale.train.resume import check_data_position, resolved_run_config, saved_data_position
from podscale.train.saving import CheckpointForm, _save
from podscale.train.supervise import ENV_STDERR_TTY
from podscale.train.tasks import make_eval_fn


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
    # MLPerf asks whether the system's caches were cleared before the run: podscale does not
    # clear them (its data sets are synthetic or small, read into memory).
    mlog.event(C.CACHE_CLEAR, False)
    mlog.start(C.INIT_START)
    run = check(config, lead, write=True)
    mesh, task, strategy, dp = run.mesh, run.task, run.strategy, run.dp
    batch_size, eval_batch, init = run.batch_size, run.eval_batch, run.init

    # Init, then shard: the layout is decided on shapes, and the state is created directly in it.
    layout = run.layout
    if lead and dp.rule_notes:
        Console(stderr=True).print(
            f"podscale: the sharding rules {strategy.rules.name!r} leave {len(dp.rule_notes)} leaves as they are "
            "(--strict refuses them):\n  " + "\n  ".join(dp.rule_notes),
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
    evaluate = distributed_eval(make_eval_fn(task), dp)  # the state as the step stores and places it
    whole_set = task.workload.score if task.workload else None  # a whole-set metric (COCO mAP, AUC)
    predict = distributed_eval(task.predict_outputs, dp) if whole_set else None
    _log_run_config(
        mlog, config, task, dp, batch_size, eval_batch, bool(jax.eval_shape(init).batch_stats), run.schedule_steps
    )
    mlog.end(C.INIT_STOP)
    # A resumed segment's log is a whole log of its own (init, configuration, run_start), from step
    # ``start``: its first block starts there, at the epoch and example the checkpoint holds.
    resumed = {"resumed_from_step": start, "first_example": data_position(start, batch_size)}
    mlog.start(C.RUN_START, metadata=resumed if resumed_from is not None else None)
    epoch = lambda done: done * batch_size / len(task.train_data)  # noqa: E731
    position = lambda done: saved_data_position(done, batch_size)  # noqa: E731  (saved with each checkpoint)
    block_first = [start]

    def block_start(first: int) -> None:
        """A block runs from step ``first + 1`` to the next evaluation (MLPerf's ``epoch_count``:
        the epochs it spans, fractional for a tiny data set's short blocks)."""
        block_first[0] = first
        end = (
            min((first // config.eval_every + 1) * config.eval_every, config.steps)
            if config.eval_every
            else config.steps
        )
        meta = {"first_epoch_num": epoch(first), "epoch_count": epoch(end - first), "first_step_num": first + 1}
        mlog.start(C.BLOCK_START, metadata=meta)

    block_start(start)
    metrics_path = _metrics_path(config)
    clock = goodput.Clock(run_start)
    redone = goodput.redone_steps(metrics_path, start) if resumed_from is not None else 0
    log = open(metrics_path, "a") if (lead and metrics_path) else None  # noqa: SIM115
    resolved = resolved_run_config(config, task)
    board = Board(
        Board.at(config.workdir) if lead else None, resolved["learning_rate"], resolved["optimizer"] != "recipe"
    )
    closing.append(board.close)

    def record(entry):
        board.record(entry)
        if log:
            try:
                log.write(json.dumps(entry) + "\n")
                log.flush()
            except OSError as e:
                raise write_error(f"the metrics file {metrics_path}", e) from None

    loader = Loader(task.train_data, dp, batch_size, config.seed, start_step=start)
    summary: dict[str, Any] = {"time_to_target_s": None, "eval": {}}
    targets, accuracy = _targets(task, config)
    last_loss = None
    timed_from, timed_steps, step = None, 0, start
    excluded = 0.0  # seconds of eval and checkpointing inside the timed span
    console = Console(stderr=True, force_terminal=True if os.environ.get(ENV_STDERR_TTY) else None)
    # Where stderr is not a terminal (a pipe, a CI log) the bar does not show: plain lines instead.
    ticker = Ticker("podscale train", 10.0, enabled=lead and config.progress and not console.is_terminal)
    progress = Progress(
        TextColumn("step"),
        MofNCompleteColumn(),
        BarColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[eps]} ex/s"),
        TimeElapsedColumn(),
        # Under podscale's supervisor (multi-process) stderr is a pipe to a terminal.
        console=console,
        disable=not (lead and config.progress) or ticker.enabled,
    )
    try:
        with progress:
            bar = progress.add_task("train", total=config.steps, completed=start, loss="-", eps="-")
            pending = None
            loop_from = time.perf_counter()
            clock.add("startup", loop_from - run_start)
            for step, batch in clock.waiting(loader):
                if step >= config.steps:
                    break
                if step == start:
                    ticker(f"compiling and running step {start + 1} of {config.steps}", force=True)
                    first_from, first_batch = time.perf_counter(), goodput.shapes_of(batch)
                with heartbeat(ticker if step == start else None, "still compiling the first step", 10.0):
                    state, metrics = dp(state, batch)
                if pending is not None:  # read the previous step's metrics while this one runs
                    last_loss = _log_step(pending, record, batch_size, ckpt)
                pending = (step, metrics)
                if step == start:
                    jax.block_until_ready(state)  # the first step compiles; time from its end
                    timed_from = time.perf_counter()
                    clock.add("compilation", timed_from - first_from)
                else:
                    timed_steps += 1
                done = step + 1
                eps = timed_steps * batch_size / max(time.perf_counter() - timed_from, 1e-9) if timed_steps else 0.0
                progress.update(
                    bar, completed=done, loss=f"{last_loss:.4f}" if last_loss is not None else "-", eps=f"{eps:,.0f}"
                )
                shown = f", loss {last_loss:.4f}" if last_loss is not None else ""
                rate = f", {eps:,.0f} examples/s" if timed_steps else ""
                if timed_steps:
                    board.scalar("train/examples_per_s", eps, done)
                ticker(f"step {done} of {config.steps}{shown}{rate}", force=done == start + 1)
                aside = time.perf_counter()
                evaluating = (config.eval_every and done % config.eval_every == 0) or done == config.steps
                if evaluating or (ckpt and done % ckpt.every == 0):
                    # Let the step finish before another program runs collectives on the same
                    # devices: on CPU, the eval's all-reduce could otherwise interleave with the
                    # step's and never complete.
                    jax.block_until_ready(state)
                if ckpt and done % ckpt.every == 0:
                    last_loss = _log_step(pending, record, batch_size, ckpt)  # this step's loss, before saving it
                    pending = None
                    board.flush()  # the points up to a checkpoint outlive a kill -9, as metrics.jsonl's do
                    with clock.part("checkpointing"):
                        _save(ckpt, done, state, checkpointed.save_form, metadata=position(done))
                reached = False
                evaluated_from = time.perf_counter()
                if evaluating:
                    first = block_first[0]
                    mlog.end(
                        C.BLOCK_STOP,
                        metadata={"first_epoch_num": epoch(first), "epoch_num": epoch(done), "step_num": done},
                    )
                    mlog.start(C.EVAL_START, metadata={"epoch_num": epoch(done), "step_num": done})
                    results = evaluate(state, padded_eval_batches(task.eval_data, dp, eval_batch))
                    if predict is not None:  # each replica predicts its rows; the host scores the whole set
                        outputs = predict.predict(state, padded_eval_batches(task.eval_data, dp, eval_batch))
                        results.update(whole_set(task.model, outputs, task.eval_data))
                    at = {"epoch_num": epoch(done), "step_num": done}
                    mlog.end(C.EVAL_STOP, metadata=at)
                    mlog.event(C.EVAL_ACCURACY, accuracy(results), metadata={**at, "metric": task.eval_metric})
                    summary["eval"] = results
                    ticker(
                        f"step {done}: held-out "
                        + ", ".join(f"{k} {v:.4f}" for k, v in results.items() if isinstance(v, float)),
                        force=True,
                    )
                    record({"step": done, "eval": results, "time_s": time.perf_counter() - run_start})
                    board.flush()
                    reached = targets is not None and all(results[k] >= v for k, v in targets.items())
                    if reached:
                        summary["target_step"] = done
                    elif done < config.steps:
                        block_start(done)
                    clock.add("evaluation", time.perf_counter() - evaluated_from)
                excluded += time.perf_counter() - aside
                if reached:
                    break
                if stop.reached(done - start):
                    jax.block_until_ready(state)
                    if pending is not None:
                        last_loss = _log_step(pending, record, batch_size, ckpt)
                        pending = None
                    board.flush()
                    if ckpt:
                        _save(ckpt, done, state, checkpointed.save_form, force=True, metadata=position(done))
                        ckpt.close()
                    raise Interrupted(done, stop.stopped_by, saved=ckpt is not None, processes=jax.process_count())
            if pending is not None:
                last_loss = _log_step(pending, record, batch_size, ckpt)
            jax.block_until_ready(state)
            timed_until = time.perf_counter()
            clock.loop_ended(timed_until - loop_from)
    finally:
        loader.close()
        if log:
            log.close()
    final_step = step + 1 if step < config.steps else config.steps
    reached = config.target is not None and summary.get("target_step") is not None
    mlog.end(
        C.RUN_STOP,
        metadata={
            "status": C.SUCCESS if reached or config.target is None else C.ABORTED,
            "epoch_num": epoch(final_step),
            "step_num": final_step,
        },
    )
    if reached:
        summary["time_to_target_s"] = time_to_target(parse(mlog.lines), accuracy(targets))["seconds"]
    if ckpt:
        with clock.part("checkpointing"):
            _save(ckpt, final_step, state, checkpointed.save_form, force=True, metadata=position(final_step))
            ckpt.close()
    elapsed = timed_until - timed_from - excluded if timed_from else 0.0
    if config.export and lead:
        try:
            np.savez(config.export, **_flat_params(dp.gather_state(state).params))
        except OSError as e:
            raise write_error(f"--export {config.export}", e) from None
    step_s = elapsed / timed_steps if timed_steps and elapsed > 0 else None
    device_kind = jax.devices()[0].device_kind
    flops = None
    if goodput.system_of(device_kind) is not None:  # a peak to compare with: the compiled step's FLOPs
        with clock.part("compilation"):
            flops = goodput.step_flops(dp, first_batch)
    summary["goodput"] = clock.summary(redone, timed_steps, step_s, goodput.mfu(flops, step_s, device_kind))
    board.goodput(summary["goodput"], final_step)
    board.close()
    if lead and metrics_path:
        try:
            with open(metrics_path, "a") as f:
                f.write(json.dumps({"goodput": summary["goodput"]}) + "\n")
        except OSError as e:
            raise write_error(f"the metrics file {metrics_path}", e) from None
    summary.update(
        steps=final_step,
        schedule_steps=run.schedule_steps,
        final_train_loss=last_loss,
        eval_metric=task.eval_metric,
        eval_value=summary["eval"].get(task.eval_metric),
        target=config.target,
        targets=targets,
        examples_per_s=timed_steps * batch_size / elapsed if elapsed > 0 else None,
        replicas=dp.replicas,
        processes=jax.process_count(),
        mesh=dict(mesh.shape),
        grad_sum={
            "mode": dp.grad_sum.mode,
            "order": list(dp.grad_sum.order),
            "chunks": dp.grad_sum.chunks,
            "dtype": config.strategy.grad_sum_dtype,
        },
        model=config.model,
        config=config.config,
        data=config.data,
        optimizer=resolved_run_config(config, task)["optimizer"],
        batch_size=batch_size,
        resumed_from=resumed_from,
        mllog=mlog.path,
        seed=config.seed,
        learning_rate=_base_learning_rate(task, config),
        wall_time_s=time.perf_counter() - run_start,
        configuration=json.loads(
            json.dumps(dataclasses.asdict(dataclasses.replace(config, strategy=dp.strategy)), default=str)
        ),
    )
    return summary


def _base_learning_rate(task, config: TrainConfig) -> float:
    """The peak learning rate the run used: the flag, the recipe's, or adam's default."""
    return resolved_run_config(config, task)["learning_rate"]
