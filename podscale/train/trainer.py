"""The training loop behind ``podscale train``.

One step of data flow: the :class:`~podscale.data.Loader` thread prepares this process's rows of
the next global batch and places them on the mesh; ``DataParallelStep`` runs the user's step on
every replica; metrics come back one step late so the host never stalls the devices; every
``eval_every`` steps the held-out set is evaluated sharded over all replicas; every
``checkpoint_every`` steps orbax saves the replicated state.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from mlperf_logging.mllog import constants as C
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from podscale._jax import jax_distributed
from podscale.parallel.engine import data_parallel
from podscale.parallel.mesh import BN_GROUP, make_mesh
from podscale.parallel.strategy import Strategy
from podscale.parallel.tensor import RuleWarning, with_model_rules
from podscale.report import Ticker, heartbeat
from podscale.train.checkpoint import Checkpointer, CheckpointError
from podscale.train.data import Loader, padded_eval_batches
from podscale.train.distributed import ENV_PROCESS_ID
from podscale.train.evaluate import distributed_eval
from podscale.train.interrupt import Interrupted, StopRequest
from podscale.train.mlperf_log import RunLog, parse, time_to_target
from podscale.train.supervise import ENV_STDERR_TTY
from podscale.train.tasks import make_eval_fn, make_task, make_task_optimizer, make_train_step, recipe_config
from podscale.workloads.precision import check_state, policy_by_name

DEFAULT_CHECKPOINT_EVERY = 100


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """What ``podscale train`` runs. Every field is a command-line flag of the same name.

    Example: ``podscale train --model resnet --data digits --steps 600 --target 0.97``
    reaches 97% held-out accuracy on 8 CPU replicas in well under a minute of training.
    """

    model: str = "mlp"
    """``mlp``, ``cnn`` (residual CNN without batch norm), ``resnet`` or ``transformer``; or an
    MLPerf workload: ``resnet50``, ``transformer-big``, ``bert-large``, ``gnmt`` (with ``config``)."""
    config: str | None = None
    """For an MLPerf workload: ``tiny`` (trains here) or ``full`` (the MLPerf-size model)."""
    data: str | None = None
    """``digits`` (scikit-learn's handwritten digits, image models) or ``synthetic`` (any small
    model; the default). MLPerf workloads bring their own data."""
    optimizer: str | None = None
    """An optax optimizer by name (sgd, momentum, adam, adamw, lamb, lars, ...; default adam). MLPerf
    workloads use their recipe (optimizer, schedule, weight-decay masks) unless this is given."""
    learning_rate: float | None = None
    """Default 1e-3; for MLPerf workloads the recipe's peak learning rate."""
    batch_size: int | None = None
    """Global batch size, over all replicas; the replica count must divide it. Default 64, or the
    workload config's ``global_batch``."""
    steps: int = 100
    """Number of training steps (the run stops earlier when ``target`` is reached)."""
    eval_every: int = 0
    """Evaluate on the held-out set every this many steps; 0 evaluates only at the end."""
    eval_batch_size: int | None = None
    """Global eval batch size (default: ``batch_size``); the last batch is padded and masked."""
    checkpoint_every: int | None = None
    """Save a checkpoint every this many steps (needs ``workdir``; default 100 with it)."""
    workdir: str | None = None
    """Where checkpoints and ``metrics.jsonl`` go; without it nothing is saved."""
    resume: bool = False
    resume_fallback: bool = False
    """With ``resume``: a damaged or unreadable latest checkpoint is set aside (``STEP.damaged``,
    with a warning naming it) and the newest intact one restored, instead of refused."""
    seed: int = 0
    target: float | None = None
    """Held-out accuracy at which to stop and report the time to target."""
    mesh: tuple[int, ...] | None = None
    """Mesh shape; default a 1-D mesh over all devices."""
    strategy: Strategy = dataclasses.field(default_factory=Strategy)
    """How the step is spread over the mesh (weight update, gradient summation); see
    :class:`podscale.Strategy`. ``podscale train`` makes its flags from the strategy's fields."""
    precision: str = "bf16"
    """MLPerf workloads: ``bf16`` (bfloat16 convolutions and matrix products, float32 state) or
    ``float32``."""
    bn_group_size: int = 1
    """Batch-norm statistics over groups of this many neighbouring replicas (1: per replica)."""
    mllog: str | None = None
    """Write an MLPerf-format log (mlperf-logging's ``mllog``) here (default: WORKDIR/mllog.txt)."""
    metrics_file: str | None = None
    """JSON-lines metrics (default: WORKDIR/metrics.jsonl), appended to."""
    export: str | None = None
    """Write the final parameters to this ``.npz`` file (process 0)."""
    progress: bool = True

    def __post_init__(self):
        for name in ("batch_size", "steps", "bn_group_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.eval_batch_size is not None and self.eval_batch_size < 1:
            raise ValueError(f"--eval-batch-size must be at least 1, got {self.eval_batch_size}")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ValueError(f"--checkpoint-every must be at least 1, got {self.checkpoint_every}")
        if self.checkpoint_every is not None and not self.workdir:
            raise ValueError("--checkpoint-every needs --workdir, the directory the checkpoints go to")
        if self.learning_rate is not None and not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise ValueError(f"--learning-rate must be a finite number > 0, got {self.learning_rate}")
        if self.seed >= 2**63:
            raise ValueError(
                f"--seed must be below 2**63 (JAX's and NumPy's generators take a 64-bit seed), got {self.seed}"
            )
        for name in ("batch_size", "eval_batch_size"):
            if (getattr(self, name) or 0) >= 2**31:
                raise ValueError(
                    f"--{name.replace('_', '-')} {getattr(self, name)}: a batch dimension must be below 2**31 (XLA's "
                    "32-bit dimensions); give a smaller batch"
                )
        if self.seed < 0:
            raise ValueError(f"--seed must be 0 or more (it seeds JAX's and NumPy's generators), got {self.seed}")
        if self.target is not None and not 0 <= self.target <= 1:
            raise ValueError(
                f"--target {self.target}: the held-out metric it is compared with (accuracy, exact match, "
                "masked-LM accuracy) is a fraction; give a value in [0, 1]"
            )
        if self.eval_every < 0:
            raise ValueError(f"--eval-every must be 0 or more, got {self.eval_every}")
        if self.resume and not self.workdir:
            raise ValueError("--resume needs --workdir, the directory of the run to continue")
        if self.resume_fallback and not self.resume:
            raise ValueError("--resume-fallback goes with --resume: add --resume to continue the run in --workdir")
        # Process 0 alone writes the files; every process writes its part of --workdir's checkpoints.
        check_output_paths(self, files=os.environ.get(ENV_PROCESS_ID, "0") == "0")


OUTPUT_PATHS = (
    ("workdir", None),
    ("metrics_file", "metrics.jsonl"),
    ("mllog", "mllog.txt"),
    ("export", "params.npz"),
)
"""Every path a run writes: the ``--workdir`` directory, and files with an example name."""


def check_output_paths(config: TrainConfig, files: bool = True) -> None:
    """Checks every path the run writes (:data:`OUTPUT_PATHS`), once, before any work.

    ``--workdir`` is a directory, made with its missing parents. A file (``--metrics-file``,
    ``--mllog``, ``--export``) must not be a directory, and its folder must exist or lie inside
    ``--workdir`` (made with it; :func:`make_output_folders`). Nothing on the way may be a file;
    the nearest existing folder must take a new file, and an existing output file must open for
    writing: both probed for real (as root, ``os.access`` says yes even to ``/proc``). Without
    ``files`` (a process other than 0, which writes none of them), only ``--workdir``."""
    workdir = os.path.abspath(config.workdir) if config.workdir else None
    if config.export is not None and not str(config.export).endswith(".npz") and not os.path.isdir(config.export):
        raise ValueError(
            f"--export {config.export}: the parameters are written as a NumPy .npz archive; give a name ending in "
            f".npz, e.g. {os.path.splitext(config.export)[0] or 'params'}.npz"
        )
    written: dict[str, str] = {}  # each file once: two outputs on one path would interleave
    if workdir:
        written[os.path.join(workdir, RUN_CONFIG)] = f"podscale's own {RUN_CONFIG} in --workdir"
    for name, example in OUTPUT_PATHS:
        path = getattr(config, name)
        flag = "--" + name.replace("_", "-")
        if path is None and workdir and name in ("metrics_file", "mllog"):  # their defaults live in --workdir
            path, flag = os.path.join(workdir, example), f"--workdir's {example}"
        if path is None or (example is not None and not files):
            continue
        if example is not None:
            full = os.path.abspath(path)
            if full in written or (workdir and _inside(full, os.path.join(workdir, "checkpoints"))):
                other = written.get(full, "--workdir's checkpoints")
                raise ValueError(f"{flag} {path}: {other} is written there too; give each output a path of its own")
            written[full] = flag
        if not str(path).strip():
            raise ValueError(f"{flag}: the path is empty; give a {'directory' if example is None else 'file name'}")
        full = os.path.abspath(path)
        if example is None:
            if os.path.lexists(full) and not os.path.isdir(full):
                raise ValueError(f"{flag} {path}: is a file, not a directory; choose a directory")
            folder = full
        else:
            if os.path.isdir(full):
                raise ValueError(
                    f"{flag} {path}: is a directory; give a file name such as {os.path.join(path, example)}"
                )
            folder = os.path.dirname(full)
        existing = folder
        while not os.path.lexists(existing):
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            raise ValueError(
                f"{flag} {path}: {existing} is a file, not a folder, so nothing can be written under it; choose "
                "another path"
            )
        if not _can_create_file_in(existing):
            made = "" if existing == folder else f" (the nearest existing folder on the way to {folder})"
            raise ValueError(
                f"{flag} {path}: cannot write in {existing}{made}: a file cannot be created there (a read-only "
                "or system folder); choose a writable place"
            )
        if existing != folder and example is not None and not (workdir and _inside(folder, workdir)):
            raise ValueError(
                f"{flag} {path}: the folder {folder} does not exist; create it first (podscale makes missing "
                "folders only inside --workdir)"
            )
        if example is not None and os.path.lexists(full) and (problem := _cannot_open_to_write(full)):
            raise ValueError(f"{flag} {path}: the file cannot be written ({problem}); choose another path")


def make_output_folders(config: TrainConfig) -> None:
    """Makes ``--workdir`` and the missing folders of the files it holds (checked already)."""
    for name, example in OUTPUT_PATHS:
        path = getattr(config, name)
        if path is not None:
            os.makedirs(path if example is None else os.path.dirname(os.path.abspath(path)), exist_ok=True)


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder


def _can_create_file_in(folder: str) -> bool:
    """Creates and removes a file in ``folder``: whether this process can write there."""
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".podscale-probe-")
    except OSError:
        return False
    os.close(fd)
    os.remove(probe)
    return True


def _cannot_open_to_write(path: str) -> str | None:
    """Why an existing file cannot be opened to append to (without changing it), or ``None``."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK)
    except OSError as e:
        return e.strerror or type(e).__name__
    os.close(fd)
    return None


RUN_CONFIG = "run_config.json"
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
state. The rest may change on resume: ``--steps``, ``--mesh`` / ``--replicas`` / the process
count (checkpoints hold whole tensors), ``--eval-every``, ``--eval-batch-size``,
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


def _check_run_config(config: TrainConfig, task, write: bool) -> None:
    """A fresh run records the resolved ``FIXED_ON_RESUME`` values (:func:`resolved_run_config`:
    what it used, not the flags as typed) in ``WORKDIR/run_config.json``; ``--resume`` refuses,
    before any work, a run that resolves to another value of one of them, naming the flag."""
    path = os.path.join(config.workdir, RUN_CONFIG)
    mine = resolved_run_config(config, task)
    if not config.resume:
        if write and not os.path.isdir(os.path.join(config.workdir, "checkpoints")):
            os.makedirs(config.workdir, exist_ok=True)
            with open(path + ".tmp", "w") as f:
                json.dump(mine, f, indent=1)
            os.replace(path + ".tmp", path)
        return
    if not os.path.exists(path):
        if not os.path.isdir(os.path.join(config.workdir, "checkpoints")):
            return  # nothing to resume: the checkpoint restore says so
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
    theirs = resolved_run_config(config, task, {k: saved[k] for k in FIXED_ON_RESUME if k in saved})
    for key in FIXED_ON_RESUME:
        if theirs[key] != mine[key]:
            flag = "--" + key.replace("_", "-")
            hint = " (an MLPerf workload's own recipe: leave --optimizer out)" if theirs[key] == "recipe" else ""
            raise ValueError(
                f"--resume: the run in {config.workdir} was started with {flag} {theirs[key]}{hint}, this one asks "
                f"for {mine[key]}; resume with the same {flag} (or start a new --workdir). What may change on "
                "resume: --steps, --mesh/--replicas, --eval-every, --checkpoint-every, --target, the strategy"
            )


def _metrics_path(config: TrainConfig) -> str | None:
    if config.metrics_file:
        return config.metrics_file
    return os.path.join(config.workdir, "metrics.jsonl") if config.workdir else None


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


def _flat_params(params) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(params)}


def _preemption_sync() -> bool:
    """Whether JAX's preemption sync manager runs (multi-process runs with its service on)."""
    return jax_distributed.global_state.preemption_sync_manager is not None


def train(config: TrainConfig) -> dict[str, Any]:
    """Trains as ``config`` says; returns the summary that ``--json`` prints."""
    run_start = time.perf_counter()
    lead = jax.process_index() == 0
    if lead:
        make_output_folders(config)
    mlpath = config.mllog or (os.path.join(config.workdir, "mllog.txt") if config.workdir else None)
    mlog = RunLog(mlpath, write=lead)
    stop = StopRequest(jax.process_count(), sync=_preemption_sync())
    try:
        with stop:
            return _train(config, mlog, run_start, lead, stop)
    except BaseException:
        if mlog.running:
            mlog.end(C.RUN_STOP, metadata={"status": C.ABORTED})
        raise
    finally:
        mlog.close()


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
    """The state's stored layout (``dp.prepare``: the step traced at the global batch's shapes)."""

    def dry_run_summary(self) -> dict[str, Any]:
        """What ``--dry-run`` prints: the run as it would start."""
        return {
            "dry_run": True,
            "mesh": {str(k): int(v) for k, v in self.mesh.shape.items()},
            "replicas": self.dp.replicas,
            "batch_size": self.batch_size,
            "eval_batch_size": self.eval_batch,
            "resume_from": self.latest_checkpoint,
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
    optimizer = make_task_optimizer(task, config.optimizer, config.learning_rate, config.steps)
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
    if config.eval_batch_size and held_out is not None and eval_batch > -(-held_out // mesh.size) * mesh.size:
        fits = -(-held_out // mesh.size) * mesh.size
        raise ValueError(
            f"--eval-batch-size {eval_batch} is larger than the held-out set ({held_out} examples): one batch of "
            f"{fits} (a multiple of the {mesh.size} devices) holds it all; give at most {fits}"
        )
    if eval_batch % mesh.size:  # the evaluation splits its rows over every device (spatial's too)
        raise ValueError(
            f"--eval-batch-size {eval_batch} is not divisible by the {mesh.size} devices the evaluation splits it "
            f"over; use a multiple of {mesh.size}"
        )
    latest = _check_checkpoints(config)
    if config.workdir:
        _check_run_config(config, task, write=write and lead)

    def init():
        return task.init_state(jax.random.key(config.seed), optimizer)

    shapes = jax.eval_shape(init)
    check_state(shapes)
    if config.bn_group_size > 1 and not shapes.batch_stats:
        raise ValueError(
            f"--bn-group-size {config.bn_group_size}: model {config.model!r} has no batch norm; drop the flag"
        )
    with warnings.catch_warnings():  # the rules' notes (a RuleWarning) are printed once, by the run
        warnings.simplefilter("ignore", RuleWarning)
        layout = dp.prepare(shapes, task.batch_shapes(batch_size))  # traces the step: its own checks
    return Prepared(mesh, task, optimizer, strategy, dp, batch_size, eval_batch, init, latest, layout)


def _check_checkpoints(config: TrainConfig) -> int | None:
    """The latest checkpoint step in ``--workdir`` (``None``: none), checked against ``--resume``
    and ``--steps`` before any work; nothing is created."""
    folder = os.path.join(config.workdir, "checkpoints") if config.workdir else None
    latest = None
    if folder and os.path.isdir(folder):
        found = Checkpointer(folder, config.checkpoint_every or DEFAULT_CHECKPOINT_EVERY)
        try:
            latest = found.latest_step()
        finally:
            found.close()
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


def _train(config: TrainConfig, mlog: RunLog, run_start: float, lead: bool, stop: StopRequest) -> dict[str, Any]:
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
    checkpointed = _CheckpointForm(layout)

    ckpt = (
        Checkpointer(os.path.join(config.workdir, "checkpoints"), config.checkpoint_every or DEFAULT_CHECKPOINT_EVERY)
        if config.workdir
        else None
    )
    resumed_from = None
    if ckpt and config.resume:
        resumed_from, restored = ckpt.restore(checkpointed.like(), fallback=config.resume_fallback)
        state = checkpointed.load(restored)
    start = int(np.asarray(state.step.addressable_data(0)))
    if start >= config.steps:
        raise ValueError(
            f"the run in {config.workdir} is already at step {start}, and --steps is {config.steps}; "
            f"pass a larger --steps to train further"
        )
    evaluate = distributed_eval(make_eval_fn(task), mesh)
    _log_run_config(mlog, config, task, dp, batch_size, eval_batch, bool(jax.eval_shape(init).batch_stats))
    mlog.end(C.INIT_STOP)
    mlog.start(C.RUN_START)
    epoch = lambda done: done * batch_size / len(task.train_data)  # noqa: E731
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
    log = open(metrics_path, "a") if (lead and metrics_path) else None  # noqa: SIM115

    def record(entry):
        if log:
            log.write(json.dumps(entry) + "\n")
            log.flush()

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
            for step, batch in loader:
                if step >= config.steps:
                    break
                if step == start:
                    ticker(f"compiling and running step {start + 1} of {config.steps}", force=True)
                with heartbeat(ticker if step == start else None, "still compiling the first step", 10.0):
                    state, metrics = dp(state, batch)
                if pending is not None:  # read the previous step's metrics while this one runs
                    last_loss = _log_step(pending, record, ckpt)
                pending = (step, metrics)
                if step == start:
                    jax.block_until_ready(state)  # the first step compiles; time from its end
                    timed_from = time.perf_counter()
                else:
                    timed_steps += 1
                done = step + 1
                eps = timed_steps * batch_size / max(time.perf_counter() - timed_from, 1e-9) if timed_steps else 0.0
                progress.update(
                    bar, completed=done, loss=f"{last_loss:.4f}" if last_loss is not None else "-", eps=f"{eps:,.0f}"
                )
                shown = f", loss {last_loss:.4f}" if last_loss is not None else ""
                rate = f", {eps:,.0f} examples/s" if timed_steps else ""
                ticker(f"step {done} of {config.steps}{shown}{rate}", force=done == start + 1)
                aside = time.perf_counter()
                evaluating = (config.eval_every and done % config.eval_every == 0) or done == config.steps
                if evaluating or (ckpt and done % ckpt.every == 0):
                    # Let the step finish before another program runs collectives on the same
                    # devices: on CPU, the eval's all-reduce could otherwise interleave with the
                    # step's and never complete.
                    jax.block_until_ready(state)
                if ckpt and done % ckpt.every == 0:
                    last_loss = _log_step(pending, record, ckpt)  # this step's loss, before saving it
                    pending = None
                    _save(ckpt, done, state, checkpointed.save_form)
                reached = False
                if evaluating:
                    first = block_first[0]
                    mlog.end(
                        C.BLOCK_STOP,
                        metadata={"first_epoch_num": epoch(first), "epoch_num": epoch(done), "step_num": done},
                    )
                    mlog.start(C.EVAL_START, metadata={"epoch_num": epoch(done), "step_num": done})
                    results = evaluate(state, padded_eval_batches(task.eval_data, dp, eval_batch))
                    if task.workload and task.workload.evaluate:  # a whole-set metric (COCO mAP)
                        whole = dp.gather_state(state)
                        variables = {"params": whole.params, "batch_stats": whole.batch_stats}
                        results.update(task.workload.evaluate(task.model, variables, task.eval_data))
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
                    reached = targets is not None and all(results[k] >= v for k, v in targets.items())
                    if reached:
                        summary["target_step"] = done
                    elif done < config.steps:
                        block_start(done)
                excluded += time.perf_counter() - aside
                if reached:
                    break
                if stop.reached(done - start):
                    jax.block_until_ready(state)
                    if pending is not None:
                        last_loss = _log_step(pending, record, ckpt)
                        pending = None
                    if ckpt:
                        _save(ckpt, done, state, checkpointed.save_form, force=True)
                        ckpt.close()
                    raise Interrupted(done, stop.stopped_by, saved=ckpt is not None, processes=jax.process_count())
            if pending is not None:
                last_loss = _log_step(pending, record, ckpt)
            jax.block_until_ready(state)
            timed_until = time.perf_counter()
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
        _save(ckpt, final_step, state, checkpointed.save_form, force=True)
        ckpt.close()
    elapsed = timed_until - timed_from - excluded if timed_from else 0.0
    if config.export and lead:
        np.savez(config.export, **_flat_params(dp.gather_state(state).params))
    summary.update(
        steps=final_step,
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


def _log_run_config(
    mlog: RunLog, config: TrainConfig, task, dp, batch_size: int, eval_batch: int, batch_norm: bool
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
            task.workload.hparams(cfg, config.steps) if task.workload.hparams else {C.OPT_BASE_LR: cfg.learning_rate}
        )
    else:
        hparams = {C.OPT_NAME: config.optimizer or "adam", C.OPT_BASE_LR: config.learning_rate or 1e-3}
    for key, value in hparams.items():
        mlog.event(key, value)


class _CheckpointForm:
    """Checkpoints hold the user layout (whole tensors), so they restore onto any replica count:
    the stored state is unstored (all-gathered) on save and stored (sliced) on restore."""

    def __init__(self, layout):
        replicated = NamedSharding(layout.mesh, P())
        self.layout = layout
        self._save = jax.jit(layout.unstore, out_shardings=replicated)
        self._load = jax.jit(layout.store, out_shardings=layout.shardings())
        self._replicated = replicated

    def _converts(self) -> bool:
        return self.layout.any_sharded or self.layout.any_split

    def save_form(self, state):
        return self._save(state) if self._converts() else state

    def like(self):
        return jax.tree.unflatten(
            self.layout.treedef,
            [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=self._replicated) for leaf in self.layout.leaves],
        )

    def load(self, restored):
        return self._load(restored) if self._converts() else restored


class NonFiniteError(ValueError):
    """The loss (or, at a checkpoint, the state) stopped being finite."""


def _log_step(pending, record, ckpt=None) -> float:
    step, metrics = pending
    values = {k: float(v) for k, v in metrics.items()}
    record({"step": step + 1, **values})
    if not math.isfinite(values["loss"]):
        _non_finite(f"the training loss is {values['loss']}", step + 1, ckpt)
    return values["loss"]


def _non_finite(what: str, step: int, ckpt) -> None:
    last = ckpt.latest_step() if ckpt else None
    kept = f"the last checkpoint, step {last}, is kept" if last is not None else "no checkpoint was saved"
    raise NonFiniteError(
        f"step {step}: {what}; stopped ({kept}; a non-finite state is never saved). Lower "
        "--learning-rate, or check the data"
    )


@jax.jit
def _all_finite(state) -> jax.Array:
    leaves = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])) if leaves else jnp.bool_(True)


def _save(ckpt, step: int, state, form, force: bool = False) -> None:
    """Saves only a finite state (the loss was checked already; the weights are checked here)."""
    if not (force or step % ckpt.every == 0) or step in ckpt.saved_steps():
        return
    if not bool(_all_finite(state)):
        _non_finite("the state holds non-finite values", step, ckpt)
    ckpt.maybe_save(step, state, form, force=force)
