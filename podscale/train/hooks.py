"""The parts of ``podscale train``'s loop (:func:`podscale.train.trainer.train`), each an object
with a small interface that the loop calls at its points: a step has run (:meth:`TrainStep.__call__`,
:meth:`Records.ran`, :meth:`Display.stepped`), the step is done and may be saved
(:meth:`Checkpoints.after_step`) and evaluated (:meth:`Evaluation.run`), a stop was asked for
(:meth:`Preemption.check`), the loop ended.

* :class:`Clocks`: where the run's wall time goes (its goodput), and the timed steps (every step
  after the first, which compiles; evaluation and checkpointing between them are not timed).
* :class:`Display`: the progress bar on a terminal, plain lines elsewhere (process 0).
* :class:`Records`: ``metrics.jsonl`` and the TensorBoard points; a step's metrics are read one
  step late, while the next step runs, so that the host never stalls the devices.
* :class:`MLPerfBlocks`: the MLPerf log's blocks (``block_start``/``block_stop``) and ``run_stop``.
* :class:`Evaluation`: when to evaluate, the held-out metrics, MLPerf's eval events, the targets.
* :class:`Checkpoints`: when to save, the saves (a finite state only, with its data position).
* :class:`Preemption`: the coordinated stop (SIGTERM, Ctrl-C): all processes at the same step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable
from typing import Any

import jax
from mlperf_logging.mllog import constants as C
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from podscale.report import Ticker, heartbeat
from podscale.train import goodput
from podscale.train.board import Board
from podscale.train.config import TrainConfig, write_error
from podscale.train.data import padded_eval_batches
from podscale.train.evaluate import distributed_eval
from podscale.train.interrupt import Interrupted, StopRequest
from podscale.train.mlperf_log import RunLog
from podscale.train.records import log_step
from podscale.train.resume import saved_data_position
from podscale.train.supervise import ENV_STDERR_TTY
from podscale.train.tasks import make_eval_fn


class Clocks:
    """The run's goodput clock (:class:`~podscale.train.goodput.Clock`, from ``run_start``) and its
    timed span: from the end of the first step (step ``start + 1``, which compiles) to the end of
    the loop, less the evaluation and checkpointing inside it (:meth:`aside`). ``redone``: the steps
    an earlier segment ran past the checkpoint this run resumes from (lost to interruptions)."""

    def __init__(self, run_start: float, start: int, redone: int):
        self.clock = goodput.Clock(run_start)
        self.run_start, self.start, self.redone = run_start, start, redone
        self.loop_from = self.first_from = self.timed_from = self.timed_until = None
        self.first_batch = None  # the first batch's shapes: the step whose FLOPs MFU counts
        self.timed_steps = 0
        self.excluded = 0.0  # seconds of eval and checkpointing inside the timed span

    def part(self, name: str):
        return self.clock.part(name)

    def waiting(self, loader):
        """The loader's batches, the time waiting for each counted as input wait."""
        return self.clock.waiting(loader)

    def loop_started(self) -> None:
        self.loop_from = time.perf_counter()
        self.clock.add("startup", self.loop_from - self.run_start)

    def first_step(self, batch) -> None:
        self.first_from, self.first_batch = time.perf_counter(), goodput.shapes_of(batch)

    def stepped(self, step: int, state) -> None:
        if step == self.start:
            jax.block_until_ready(state)  # the first step compiles; time from its end
            self.timed_from = time.perf_counter()
            self.clock.add("compilation", self.timed_from - self.first_from)
        else:
            self.timed_steps += 1

    def examples_per_s(self, batch_size: int) -> float:
        """So far, over the timed steps (0 before the second step)."""
        if not self.timed_steps:
            return 0.0
        return self.timed_steps * batch_size / max(time.perf_counter() - self.timed_from, 1e-9)

    @contextlib.contextmanager
    def aside(self):
        """Time inside the timed span that is not the steps' (evaluation, checkpoints)."""
        began = time.perf_counter()
        yield
        self.excluded += time.perf_counter() - began

    def loop_ended(self, state) -> None:
        jax.block_until_ready(state)
        self.timed_until = time.perf_counter()
        self.clock.loop_ended(self.timed_until - self.loop_from)

    @property
    def elapsed(self) -> float:
        """Seconds of the timed steps."""
        return self.timed_until - self.timed_from - self.excluded if self.timed_from else 0.0

    def goodput(self, dp) -> dict[str, Any]:
        """The goodput record (:meth:`~podscale.train.goodput.Clock.summary`), after the loop; its
        MFU compiles the step once more where the device's peak is known."""
        elapsed, timed_steps = self.elapsed, self.timed_steps
        step_s = elapsed / timed_steps if timed_steps and elapsed > 0 else None
        device_kind = jax.devices()[0].device_kind
        flops = None
        if goodput.system_of(device_kind) is not None:  # a peak to compare with: the compiled step's FLOPs
            with self.clock.part("compilation"):
                flops = goodput.step_flops(dp, self.first_batch)
        return self.clock.summary(self.redone, timed_steps, step_s, goodput.mfu(flops, step_s, device_kind))


class Display:
    """What the run shows as it goes (process 0, with ``--progress``): a live bar where stderr is a
    terminal, else a plain line at most every 10 s (a pipe, a CI log); and the examples per second
    on the TensorBoard."""

    def __init__(self, config: TrainConfig, lead: bool, start: int, batch_size: int, board: Board):
        self.steps, self.start, self.batch_size, self.board = config.steps, start, batch_size, board
        console = Console(stderr=True, force_terminal=True if os.environ.get(ENV_STDERR_TTY) else None)
        # Where stderr is not a terminal (a pipe, a CI log) the bar does not show: plain lines instead.
        self.ticker = Ticker("podscale train", 10.0, enabled=lead and config.progress and not console.is_terminal)
        self.progress = Progress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[eps]} ex/s"),
            TimeElapsedColumn(),
            # Under podscale's supervisor (multi-process) stderr is a pipe to a terminal.
            console=console,
            disable=not (lead and config.progress) or self.ticker.enabled,
        )
        self.bar = None

    @contextlib.contextmanager
    def shown(self):
        """The bar, from step ``start``, while the loop runs."""
        with self.progress:
            self.bar = self.progress.add_task("train", total=self.steps, completed=self.start, loss="-", eps="-")
            yield

    def say(self, message: str) -> None:
        self.ticker(message, force=True)

    def heartbeat(self, first: bool):
        """While the first step compiles and runs, a line every 10 s."""
        return heartbeat(self.ticker if first else None, "still compiling the first step", 10.0)

    def stepped(self, done: int, loss: float | None, clocks: Clocks) -> None:
        eps = clocks.examples_per_s(self.batch_size)
        self.progress.update(
            self.bar, completed=done, loss=f"{loss:.4f}" if loss is not None else "-", eps=f"{eps:,.0f}"
        )
        shown = f", loss {loss:.4f}" if loss is not None else ""
        rate = f", {eps:,.0f} examples/s" if clocks.timed_steps else ""
        if clocks.timed_steps:
            self.board.scalar("train/examples_per_s", eps, done)
        self.ticker(f"step {done} of {self.steps}{shown}{rate}", force=done == self.start + 1)


class TrainStep:
    """One step of the data-parallel train step ``dp``; the first (step ``start``) compiles: it is
    announced, and timed as compilation."""

    def __init__(self, dp, start: int, clocks: Clocks, display: Display):
        self.dp, self.start, self.clocks, self.display = dp, start, clocks, display

    def __call__(self, state, step: int, batch):
        """The state after step ``step`` and its metrics (on the devices: read them later)."""
        first = step == self.start
        if first:
            self.display.say(f"compiling and running step {step + 1} of {self.display.steps}")
            self.clocks.first_step(batch)
        with self.display.heartbeat(first):
            state, metrics = self.dp(state, batch)
        self.clocks.stepped(step, state)
        return state, metrics


class Records:
    """What process 0 writes as the run goes: ``metrics.jsonl`` (``path``; a line per step and per
    evaluation, and the goodput at the end) and the TensorBoard points (:class:`Board`, under
    ``workdir``). Each step's metrics are read one step late (:meth:`ran`): the host reads them
    while the next step runs, so it never stalls the devices; :meth:`read` reads them at once."""

    def __init__(
        self, config: TrainConfig, path: str | None, lead: bool, resolved: dict, batch_size: int, run_start: float, ckpt
    ):
        self.path = path if lead else None
        self.batch_size, self.run_start, self.ckpt = batch_size, run_start, ckpt
        self.file = open(path, "a") if (lead and path) else None  # noqa: SIM115
        self.board = Board(
            Board.at(config.workdir) if lead else None, resolved["learning_rate"], resolved["optimizer"] != "recipe"
        )
        self.pending = None  # the step whose metrics are still to be read, and its metrics
        self.last_loss: float | None = None

    def record(self, entry: dict[str, Any]) -> None:
        self.board.record(entry)
        if self.file:
            try:
                self.file.write(json.dumps(entry) + "\n")
                self.file.flush()
            except OSError as e:
                raise write_error(f"the metrics file {self.path}", e) from None

    def ran(self, step: int, metrics) -> None:
        """Step ``step`` is running: the previous step's metrics are read now, its own next time."""
        self.read()
        self.pending = (step, metrics)

    def read(self) -> None:
        """Records the step still to be read (its loss checked finite)."""
        if self.pending is not None:
            self.last_loss = log_step(self.pending, self.record, self.batch_size, self.ckpt)
            self.pending = None

    def evaluated(self, done: int, results: dict[str, Any]) -> None:
        self.record({"step": done, "eval": results, "time_s": time.perf_counter() - self.run_start})
        self.board.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()

    def goodput(self, record: dict[str, Any], step: int) -> None:
        """The run's goodput: on the board (then closed) and as the last line of ``metrics.jsonl``."""
        self.board.goodput(record, step)
        self.board.close()
        if self.path:
            try:
                with open(self.path, "a") as f:
                    f.write(json.dumps({"goodput": record}) + "\n")
            except OSError as e:
                raise write_error(f"the metrics file {self.path}", e) from None


class MLPerfBlocks:
    """The MLPerf log's blocks: a block runs from step ``first + 1`` to the next evaluation
    (MLPerf's ``epoch_count``: the epochs it spans, fractional for a tiny data set's short blocks)."""

    def __init__(self, mlog: RunLog, config: TrainConfig, batch_size: int, train_examples: int):
        self.mlog, self.config = mlog, config
        self.batch_size, self.train_examples = batch_size, train_examples
        self.first = 0

    def epoch(self, done: int) -> float:
        return done * self.batch_size / self.train_examples

    def start(self, first: int) -> None:
        self.first = first
        every, steps = self.config.eval_every, self.config.steps
        end = min((first // every + 1) * every, steps) if every else steps
        meta = {
            "first_epoch_num": self.epoch(first),
            "epoch_count": self.epoch(end - first),
            "first_step_num": first + 1,
        }
        self.mlog.start(C.BLOCK_START, metadata=meta)

    def stop(self, done: int) -> None:
        meta = {"first_epoch_num": self.epoch(self.first), "epoch_num": self.epoch(done), "step_num": done}
        self.mlog.end(C.BLOCK_STOP, metadata=meta)

    def run_stop(self, final_step: int, success: bool) -> None:
        self.mlog.end(
            C.RUN_STOP,
            metadata={
                "status": C.SUCCESS if success else C.ABORTED,
                "epoch_num": self.epoch(final_step),
                "step_num": final_step,
            },
        )


class Evaluation:
    """Every ``eval_every`` steps and after the last, the held-out set, evaluated on the state as
    the step stores and places it, each replica on its own rows (a whole-set metric, COCO mAP or
    AUC: each replica predicts its rows and the host scores them all); MLPerf's eval events;
    whether the targets (``targets``: ``{metric: value}``, or ``None``) are reached."""

    def __init__(
        self,
        run,
        config: TrainConfig,
        targets: dict | None,
        accuracy: Callable,
        mlog: RunLog,
        blocks: MLPerfBlocks,
        records: Records,
        display: Display,
        clocks: Clocks,
    ):
        self.task, self.dp, self.eval_batch = run.task, run.dp, run.eval_batch
        self.every, self.steps = config.eval_every, config.steps
        self.targets, self.accuracy = targets, accuracy
        self.mlog, self.blocks, self.records, self.display, self.clocks = mlog, blocks, records, display, clocks
        self.evaluate = distributed_eval(make_eval_fn(self.task), self.dp)  # the state as the step stores it
        self.whole_set = self.task.workload.score if self.task.workload else None  # COCO mAP, AUC
        self.predict = distributed_eval(self.task.predict_outputs, self.dp) if self.whole_set else None
        self.results: dict[str, Any] = {}  # the last evaluation's
        self.target_step: int | None = None

    def due(self, done: int) -> bool:
        return bool((self.every and done % self.every == 0) or done == self.steps)

    def run(self, done: int, state) -> bool:
        """Evaluates after step ``done`` (which ends an MLPerf block); whether the targets are reached."""
        began = time.perf_counter()
        task, mlog, blocks = self.task, self.mlog, self.blocks
        blocks.stop(done)
        mlog.start(C.EVAL_START, metadata={"epoch_num": blocks.epoch(done), "step_num": done})
        results = self.evaluate(state, padded_eval_batches(task.eval_data, self.dp, self.eval_batch))
        if self.predict is not None:  # each replica predicts its rows; the host scores the whole set
            outputs = self.predict.predict(state, padded_eval_batches(task.eval_data, self.dp, self.eval_batch))
            results.update(self.whole_set(task.model, outputs, task.eval_data))
        at = {"epoch_num": blocks.epoch(done), "step_num": done}
        mlog.end(C.EVAL_STOP, metadata=at)
        mlog.event(C.EVAL_ACCURACY, self.accuracy(results), metadata={**at, "metric": task.eval_metric})
        self.results = results
        shown = ", ".join(f"{k} {v:.4f}" for k, v in results.items() if isinstance(v, float))
        self.display.say(f"step {done}: held-out {shown}")
        self.records.evaluated(done, results)
        reached = self.targets is not None and all(results[k] >= v for k, v in self.targets.items())
        if reached:
            self.target_step = done
        elif done < self.steps:
            blocks.start(done)
        self.clocks.clock.add("evaluation", time.perf_counter() - began)
        return reached


class Checkpoints:
    """With a workdir, orbax checkpoints (``ckpt``, a :class:`~podscale.train.checkpoint.Checkpointer`)
    of the stored state (``form``, a :class:`~podscale.train.saving.CheckpointForm`) every
    ``ckpt.every`` steps, when the run is stopped and at its end, each with its data position.
    ``save`` is :func:`~podscale.train.saving.save_finite` (it saves only a finite state)."""

    def __init__(self, ckpt, form, batch_size: int, save: Callable, records: Records, clocks: Clocks):
        self.ckpt, self.form, self.batch_size, self.save_finite = ckpt, form, batch_size, save
        self.records, self.clocks = records, clocks

    def due(self, done: int) -> bool:
        return bool(self.ckpt and done % self.ckpt.every == 0)

    def save(self, step: int, state, force: bool = False) -> None:
        position = saved_data_position(step, self.batch_size)  # where a run resumed from it reads on
        self.save_finite(self.ckpt, step, state, self.form.save_form, force=force, metadata=position)

    def after_step(self, done: int, state) -> None:
        """Every ``ckpt.every`` steps (the step finished): its loss checked and recorded first."""
        if not self.due(done):
            return
        self.records.read()  # this step's loss, before saving it
        self.records.board.flush()  # the points up to a checkpoint outlive a kill -9, as metrics.jsonl's do
        with self.clocks.part("checkpointing"):
            self.save(done, state)

    def last(self, step: int, state) -> bool:
        """The run's last checkpoint, at ``step`` whatever ``every`` says, its write finished;
        whether one was saved (with a workdir)."""
        if not self.ckpt:
            return False
        self.save(step, state, force=True)
        self.ckpt.close()
        return True

    def at_end(self, step: int, state) -> None:
        """The last checkpoint of a run that ran its steps (or reached its targets), timed."""
        if self.ckpt:
            with self.clocks.part("checkpointing"):
                self.last(step, state)


class Preemption:
    """The coordinated stop: after a SIGTERM (preemption) or SIGINT (Ctrl-C) to any process, every
    process stops after the same step, records it, saves it (with a workdir) and raises
    :class:`~podscale.train.interrupt.Interrupted`."""

    def __init__(self, stop: StopRequest, start: int, records: Records, checkpoints: Checkpoints):
        self.stop, self.start, self.records, self.checkpoints = stop, start, records, checkpoints

    def check(self, done: int, state) -> None:
        if not self.stop.reached(done - self.start):
            return
        jax.block_until_ready(state)
        self.records.read()
        self.records.board.flush()
        saved = self.checkpoints.last(done, state)
        raise Interrupted(done, self.stop.stopped_by, saved=saved, processes=jax.process_count())


@dataclasses.dataclass
class Hooks:
    """The loop's parts, as :func:`podscale.train.trainer.train` builds them for a run."""

    clocks: Clocks
    records: Records
    display: Display
    blocks: MLPerfBlocks
    train_step: TrainStep
    evaluation: Evaluation
    checkpoints: Checkpoints
    preemption: Preemption
