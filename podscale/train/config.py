"""What ``podscale train`` runs (:class:`TrainConfig`, a flag per field, checked as it is made),
and the paths a run writes (:data:`OUTPUT_PATHS`), checked before any work and made at its start."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tempfile

from podscale.parallel.strategy import Strategy
from podscale.train.distributed import ENV_PROCESS_ID

DEFAULT_CHECKPOINT_EVERY = 100
MAX_STEPS = 2**31
"""``--steps`` is below this: the state's step counter is an ``int32``."""


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
    schedule_steps: int | None = None
    """The steps an MLPerf recipe's learning-rate schedule is built over, its horizon (default: the
    first run's ``steps``). Recorded in ``run_config.json`` and kept on ``resume``, so a resumed run
    follows the schedule it started on: a run that is to be extended later is started with the most
    steps it may train here (``--steps 10 --schedule-steps 20``, then ``--resume --steps 20``, is
    bit-identical to ``--steps 20``). Not for an optimizer of constant learning rate."""
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
    """Write an MLPerf-format log (mlperf-logging's ``mllog``) here (default: WORKDIR/mllog.txt). A
    run resumed with ``resume`` logs its segment to a file of its own beside it (``mllog.1.txt``,
    ``mllog.2.txt``, ...: :func:`mllog_path`)."""
    metrics_file: str | None = None
    """JSON-lines metrics (default: WORKDIR/metrics.jsonl), appended to."""
    export: str | None = None
    """Write the final parameters to this ``.npz`` file (process 0)."""
    progress: bool = True

    def __post_init__(self):
        for name in ("batch_size", "steps", "schedule_steps", "bn_group_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name in ("steps", "schedule_steps"):
            if (getattr(self, name) or 0) >= MAX_STEPS:
                raise ValueError(
                    f"--{name.replace('_', '-')} {getattr(self, name)}: the step counter is a 32-bit integer (the "
                    f"state's step); give fewer than {MAX_STEPS} steps"
                )
        if self.schedule_steps is not None and self.schedule_steps < self.steps:
            raise ValueError(
                f"--steps {self.steps} is more than --schedule-steps {self.schedule_steps}: the learning-rate "
                "schedule would end before the run does; give --schedule-steps of at least --steps (or leave it "
                "out: the schedule then spans --steps)"
            )
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
                f"--target {self.target}: the held-out metric it is compared with ({_eval_metric(self.model)}) is a "
                "fraction; give a value in [0, 1]"
            )
        if self.precision != "bf16" and not _is_workload(self.model):
            raise ValueError(
                f"--precision {self.precision}: model {self.model!r} always computes in float32; --precision sets the "
                "compute dtype of an MLPerf workload (its bf16 convolutions and matrix products); drop the flag"
            )
        if self.eval_every < 0:
            raise ValueError(f"--eval-every must be 0 or more, got {self.eval_every}")
        if self.resume and not self.workdir:
            raise ValueError("--resume needs --workdir, the directory of the run to continue")
        if self.resume_fallback and not self.resume:
            raise ValueError("--resume-fallback goes with --resume: add --resume to continue the run in --workdir")
        # Process 0 alone writes the files; every process writes its part of --workdir's checkpoints.
        check_output_paths(self, files=os.environ.get(ENV_PROCESS_ID, "0") == "0")


def _is_workload(model: str) -> bool:
    from podscale import workloads

    return model in workloads.NAMES


def _eval_metric(model: str) -> str:
    """The held-out metric ``--target`` compares with for ``model``: its name (``mlp``'s accuracy,
    dlrm's AUC, ssd's COCO mAP: the workload's own ``eval_metric``)."""
    from podscale import workloads

    if model in workloads.NAMES:
        return f"model {model}'s {workloads.get(model).eval_metric}"
    return f"model {model}'s accuracy"


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
    writing (not a resumed run's ``--mllog``: it writes a new segment beside it, :func:`mllog_path`):
    both probed for real (as root, ``os.access`` says yes even to ``/proc``). Without
    ``files`` (a process other than 0, which writes none of them), only ``--workdir``."""
    workdir = os.path.abspath(config.workdir) if config.workdir else None
    folder_name = str(config.export).endswith(("/", os.sep))  # refused below, as a folder's name
    if (
        config.export is not None
        and not str(config.export).endswith(".npz")
        and not folder_name
        and not os.path.isdir(config.export)
    ):
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
            if os.path.isdir(full) or str(path).endswith((os.sep, "/")):
                what = "is a directory" if os.path.isdir(full) else "names a folder (it ends in /)"
                raise ValueError(f"{flag} {path}: {what}; give a file name such as {os.path.join(path, example)}")
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
        resumed_log = name == "mllog" and config.resume  # writes a new file beside it (mllog_path), not it
        if example is not None and os.path.lexists(full) and not resumed_log:
            if problem := _cannot_open_to_write(full):
                raise ValueError(f"{flag} {path}: the file cannot be written ({problem}); choose another path")


def mllog_segment(path: str, segment: int) -> str:
    """Segment ``segment``'s MLPerf log: the first (0) at ``path``, a resumed run's segment N beside
    it with ``.N`` before its extension (``mllog.txt``, ``mllog.1.txt``, ``mllog.2.txt``, ...)."""
    if segment == 0:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.{segment}{ext}"


def mllog_path(config: TrainConfig) -> str | None:
    """The MLPerf log this run writes (``None``: none). MLPerf's rules allow one ``run_start`` per
    log, so each run segment has a file of its own and none is appended to or overwritten by a
    later one: a new run writes ``--mllog`` (default ``WORKDIR/mllog.txt``) afresh; a run resumed
    with ``--resume`` writes the next segment after the highest already there (``mllog.1.txt``,
    then ``mllog.2.txt``, ...; with ``--mllog PATH``, the same beside ``PATH``)."""
    path = config.mllog or (os.path.join(config.workdir, "mllog.txt") if config.workdir else None)
    if path is None or not config.resume:
        return path
    folder, name = os.path.split(os.path.abspath(path))
    root, ext = os.path.splitext(name)
    pattern = re.compile(re.escape(root) + r"\.([1-9][0-9]*)" + re.escape(ext))
    found = [
        int(m.group(1)) for f in (os.listdir(folder) if os.path.isdir(folder) else ()) if (m := pattern.fullmatch(f))
    ]
    return mllog_segment(path, max(found, default=0) + 1)


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
    """Why an existing file cannot be opened to append to (without changing it), or ``None``. A
    device that is not a terminal is written a newline, which one that takes no writes refuses
    (``/dev/full``: no space left on it; ``/dev/null`` takes it)."""
    import stat

    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK)
    except OSError as e:
        return e.strerror or type(e).__name__
    try:
        if stat.S_ISCHR(os.fstat(fd).st_mode) and not os.isatty(fd):
            os.write(fd, b"\n")
    except OSError as e:
        return e.strerror or type(e).__name__
    finally:
        os.close(fd)
    return None


RUN_CONFIG = "run_config.json"


class WriteError(ValueError):
    """An output could not be written while the run went on: a full disk (``ENOSPC``), a quota or
    file-size limit, a device that takes no writes. One ``podscale: error:`` line, exit code 2."""


def write_error(what: str, error: OSError) -> WriteError:
    """The :class:`WriteError` of ``error`` (an ``OSError``) while writing ``what`` (the flag or
    file and its path): the system's reason, and that the checkpoints saved before it are kept."""
    reason = error.strerror or str(error) or type(error).__name__
    return WriteError(
        f"{what}: cannot be written ({reason}); free space on its disk (or choose another path). The checkpoints "
        "saved before this, if any, are intact: continue with --resume"
    )
