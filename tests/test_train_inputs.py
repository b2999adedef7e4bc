"""Input checks of ``podscale train`` and ``podscale launch``, mostly in-process and without
training: output paths, what ``--resume`` compares, device and process counts, launch's exit code."""

import json
import os
import signal
import subprocess
import sys
import types

import pytest
from helpers import podscale_main

from podscale import cli
from podscale.train import distributed
from podscale.train.config import OUTPUT_PATHS, RUN_CONFIG, TrainConfig, make_output_folders
from podscale.train.resume import FIXED_ON_RESUME, check_run_config
from podscale.train.supervise import EXIT_PEER_LOST
from podscale.train.tasks import make_task

PODSCALE = [sys.executable, "-m", "podscale.cli"]
FLAGS = [name for name, _ in OUTPUT_PATHS]  # workdir, metrics_file, mllog, export
FILES = [name for name, example in OUTPUT_PATHS if example is not None]


def _flag(name):
    return "--" + name.replace("_", "-")


def _file(name, path):
    """``path`` as a file name the flag takes (``--export`` writes a .npz archive)."""
    return f"{path}.npz" if name == "export" else str(path)


# --- every output path, checked once before any work ---------------------------------------------


def _bad_paths(tmp_path):
    """Kinds of path no run can write to, as (kind, path, what the message says), per flag."""
    afile = tmp_path / "afile"
    afile.write_text("")
    return [
        ("a system folder root cannot write in", "/proc/podscale-out", "cannot write in /proc"),
        ("deeper below a system folder", "/sys/podscale/a/b", "cannot write in /sys"),
        ("a path component that is a file", str(afile / "sub" / "out"), f"{afile} is a file, not a folder"),
    ]


@pytest.mark.parametrize("name", FLAGS)
def test_every_output_flag_refuses_a_path_it_cannot_write(tmp_path, name):
    for kind, path, message in _bad_paths(tmp_path):
        with pytest.raises(ValueError, match="^" + _flag(name) + " .*" + message) as err:
            TrainConfig(**{name: path if name == "workdir" else _file(name, path)})
        assert "choose" in str(err.value), kind


@pytest.mark.parametrize("name", FILES)
def test_an_output_file_that_is_a_directory_or_whose_folder_is_missing_is_refused(tmp_path, name):
    with pytest.raises(ValueError, match=f"^{_flag(name)} {tmp_path}: is a directory; give a file name"):
        TrainConfig(**{name: str(tmp_path)})
    missing = _file(name, tmp_path / "missing" / "out")
    with pytest.raises(ValueError, match=f"the folder {tmp_path / 'missing'} does not exist; create it first"):
        TrainConfig(**{name: str(missing)})
    fifo = _file(name, tmp_path / "fifo")  # no reader: opening it to write would wait for one forever
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=f"^{_flag(name)} {fifo}: the file cannot be written"):
        TrainConfig(**{name: str(fifo)})


@pytest.mark.parametrize("name", FILES)
def test_an_output_file_named_as_a_folder_or_on_a_device_that_takes_no_writes_is_refused(tmp_path, name):
    """A name ending in / is a folder's, though it does not exist yet; a device that refuses every
    write (/dev/full: no space left) would fail only after the run. Both refused before any work."""
    with pytest.raises(ValueError, match=f"^{_flag(name)} {tmp_path}/new/: names a folder .*give a file name"):
        TrainConfig(**{name: f"{tmp_path}/new/"})
    if name != "export" and os.path.exists("/dev/full"):
        with pytest.raises(ValueError, match=f"^{_flag(name)} /dev/full: the file cannot be written \\(No space"):
            TrainConfig(**{name: "/dev/full"})
        TrainConfig(**{name: "/dev/null"})  # takes every write


def test_closing_the_outputs_keeps_the_error_that_stopped_the_run():
    """A full disk stops a save; the outputs closed after it (the TensorBoard writer, the
    checkpointer) fail with the same cause, which must not hide the run's own error."""
    from podscale.train.trainer import _close_all

    closed = []

    def fails():
        closed.append("fails")
        raise OSError(28, "No space left on device")

    _close_all([fails, lambda: closed.append("next")], failing=True)  # the run's error is raised by the caller
    assert closed == ["fails", "next"]
    with pytest.raises(OSError, match="No space left"):
        _close_all([fails, lambda: closed.append("next")], failing=False)
    assert closed == ["fails", "next", "fails", "next"]


def test_a_workdir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(ValueError, match="--workdir .*afile: is a file, not a directory"):
        TrainConfig(workdir=str(tmp_path / "afile"))


@pytest.mark.parametrize("name", FILES)
def test_an_output_file_may_go_into_the_workdir_before_it_exists(tmp_path, name):
    workdir = tmp_path / "run" / "new"
    config = TrainConfig(workdir=str(workdir), **{name: _file(name, workdir / "sub" / "out")})
    make_output_folders(config)
    assert (workdir / "sub").is_dir()


def test_an_unwritable_export_is_one_json_error_before_training():
    proc = subprocess.run(
        [*PODSCALE, "train", "--model", "mlp", "--steps", "2", "--no-progress", "--json", "--export", "/proc/p.npz"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    out = json.loads(proc.stdout)
    assert out["exit_code"] == 2 and out["error"].startswith("--export /proc/p.npz: cannot write in /proc")
    assert "Traceback" not in proc.stderr


# --- --resume compares what the runs used, not the flags as typed -------------------------------

# Each FIXED_ON_RESUME field at the value a run takes when it is not given (the small models').
DEFAULTS = {
    "model": "mlp",
    "config": None,
    "data": "synthetic",
    "optimizer": "adam",
    "learning_rate": 1e-3,
    "batch_size": 64,
    "seed": 0,
    "precision": "bf16",
    "bn_group_size": 1,
}


def test_every_field_fixed_on_resume_has_a_default_here():
    assert set(DEFAULTS) == set(FIXED_ON_RESUME)


def _started_and_resumed(tmp_path, task, first: dict, then: dict):
    workdir = str(tmp_path / "run")
    check_run_config(TrainConfig(workdir=workdir, **first), task, write=True)
    os.makedirs(os.path.join(workdir, "checkpoints"))
    check_run_config(TrainConfig(workdir=workdir, resume=True, **then), task, write=True)
    with open(os.path.join(workdir, RUN_CONFIG)) as f:
        return json.load(f)


@pytest.mark.parametrize("field", FIXED_ON_RESUME)
def test_a_default_written_out_resumes_the_same_run_both_ways_round(tmp_path, field):
    task = make_task("mlp")
    explicit = {field: DEFAULTS[field]}
    _started_and_resumed(tmp_path / "a", task, explicit, {})
    recorded = _started_and_resumed(tmp_path / "b", task, {}, explicit)
    assert recorded == DEFAULTS  # the values the run used, every default filled in


def test_all_defaults_written_out_at_once_resume_an_implicit_run(tmp_path):
    task = make_task("mlp")
    _started_and_resumed(tmp_path, task, {}, DEFAULTS)


def test_an_mlperf_workload_records_its_recipe_and_the_recipes_learning_rate(tmp_path):
    task = make_task("gnmt", config="tiny", with_data=False)
    peak, batch = task.config.learning_rate, task.config.global_batch
    base = dict(model="gnmt", config="tiny")
    recorded = _started_and_resumed(tmp_path / "a", task, base, {**base, "learning_rate": peak, "batch_size": batch})
    assert (recorded["optimizer"], recorded["learning_rate"], recorded["batch_size"]) == ("recipe", peak, batch)
    assert recorded["data"] is None  # the workload's own
    _started_and_resumed(tmp_path / "b", task, {**base, "learning_rate": peak}, base)
    # Naming an optimizer replaces the recipe (its schedule and masks): another run.
    with pytest.raises(ValueError, match=r"started with --optimizer recipe \(an MLPerf workload's own recipe"):
        _started_and_resumed(tmp_path / "c", task, base, {**base, "optimizer": "adam"})


def test_a_run_config_of_an_older_podscale_holding_none_resolves_to_the_defaults(tmp_path):
    """Older podscale wrote the flags as given: ``None`` there means the default."""
    task = make_task("mlp")
    workdir = tmp_path / "run"
    (workdir / "checkpoints").mkdir(parents=True)
    old = {k: None for k in FIXED_ON_RESUME} | {"model": "mlp", "batch_size": 64, "seed": 0, "precision": "bf16"}
    (workdir / RUN_CONFIG).write_text(json.dumps(old))
    check_run_config(TrainConfig(workdir=str(workdir), resume=True, **DEFAULTS), task, write=False)
    with pytest.raises(ValueError, match="was started with --optimizer adam, this one asks for sgd"):
        check_run_config(TrainConfig(workdir=str(workdir), resume=True, optimizer="sgd"), task, write=False)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(learning_rate=1e-2), "--learning-rate 0.001, this one asks for 0.01"),
        (dict(data="digits"), "--data synthetic, this one asks for digits"),
        (dict(batch_size=32), "--batch-size 64, this one asks for 32"),
    ],
)
def test_another_value_is_still_refused_naming_the_resolved_values(tmp_path, change, message):
    with pytest.raises(ValueError, match=f"was started with {message}"):
        _started_and_resumed(tmp_path, make_task("mlp"), {}, change)


# --- devices and processes ------------------------------------------------------------------------


class _FakeJax:
    """What ``distributed.setup`` calls on ``jax``, recorded; ``backend`` is the one JAX would pick."""

    def __init__(self, backend="cpu", devices=None, initialize=None):
        self.updates = {}
        self.joined = []
        self.config = types.SimpleNamespace(update=self.updates.__setitem__, jax_platforms=None)
        self.distributed = types.SimpleNamespace(initialize=initialize or (lambda **kw: self.joined.append(kw)))
        self.default_backend = lambda: backend
        self.device_count = lambda: devices if devices is not None else self.updates["jax_num_cpu_devices"]
        self.process_count = lambda: 1


def _spec(processes):
    return distributed.ClusterSpec(coordinator_address="127.0.0.1:1", num_processes=processes, process_id=0)


@pytest.mark.parametrize("replicas", [distributed.MAX_CPU_DEVICES + 1, 100_000, 10**9])
def test_more_cpu_devices_than_jax_can_simulate_are_refused_before_any_work(monkeypatch, replicas):
    fake = _FakeJax()
    monkeypatch.setattr(distributed, "jax", fake)
    monkeypatch.setattr(distributed, "_cpu_only", lambda: True)
    with pytest.raises(ValueError, match=rf"--replicas {replicas}: .*at most {distributed.MAX_CPU_DEVICES} devices"):
        distributed.setup(replicas, distributed.ClusterSpec())
    assert fake.updates == {}  # refused before JAX was asked for a device
    # Several processes: the limit is per process.
    fake = _FakeJax(devices=2 * distributed.MAX_CPU_DEVICES)
    monkeypatch.setattr(distributed, "jax", fake)
    distributed.setup(2 * distributed.MAX_CPU_DEVICES, _spec(2))
    assert fake.updates["jax_num_cpu_devices"] == distributed.MAX_CPU_DEVICES


def test_the_cpu_device_limit_leaves_an_accelerator_alone(monkeypatch):
    """Where a GPU or TPU may run, the backend is asked once started; only CPU refuses."""
    monkeypatch.setattr(distributed, "_cpu_only", lambda: False)
    monkeypatch.setattr(distributed, "jax", _FakeJax(backend="gpu", devices=4096))
    distributed.setup(4096, distributed.ClusterSpec())
    fake = _FakeJax(backend="cpu")
    monkeypatch.setattr(distributed, "jax", fake)
    with pytest.raises(ValueError, match="at most 2048 devices per process"):
        distributed.setup(4096, distributed.ClusterSpec())
    assert fake.updates["jax_num_cpu_devices"] == 1  # never the 4096 it cannot make


@pytest.mark.parametrize("processes", [3, 5, 6, 7, 16])
def test_default_replicas_that_do_not_divide_over_the_processes_are_refused_naming_replicas(monkeypatch, processes):
    fake = _FakeJax()
    monkeypatch.setattr(distributed, "jax", fake)
    monkeypatch.setattr(distributed, "_cpu_only", lambda: True)
    with pytest.raises(ValueError, match=rf"do not divide over the {processes} processes; pass --replicas \d+"):
        distributed.setup(None, _spec(processes))
    assert fake.updates == {} and fake.joined == []


@pytest.mark.parametrize("processes", [1, 2, 4, 8])
def test_default_replicas_split_evenly_over_processes_that_divide_them(monkeypatch, processes):
    fake = _FakeJax(devices=8)
    monkeypatch.setattr(distributed, "jax", fake)
    distributed.setup(None, _spec(processes))
    assert fake.updates["jax_num_cpu_devices"] == 8 // processes


def test_replicas_not_divisible_by_the_processes_suggest_multiples(monkeypatch):
    monkeypatch.setattr(distributed, "jax", _FakeJax())
    with pytest.raises(
        ValueError, match="--replicas 7 is not divisible by the 3 processes; pass a multiple of 3, such as 6 or 9"
    ):
        distributed.setup(7, _spec(3))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (dict(num_processes=0, process_id=0, coordinator_address="h:1"), "--num-processes must be at least 1"),
        (dict(num_processes=2, process_id=-1, coordinator_address="h:1"), "--process-id must be 0 or more"),
    ],
)
def test_process_counts_and_ids_that_make_no_sense_are_refused(spec, message):
    with pytest.raises(ValueError, match=message):
        distributed.ClusterSpec(**spec)


@pytest.mark.parametrize("command", ["train", "plan", "bench wus"])
def test_too_many_replicas_are_exit_2_on_every_command(command):
    proc = subprocess.run(
        [*PODSCALE, *command.split(), "--replicas", "100000", "--json"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stderr
    assert "--replicas 100000: too many CPU devices" in json.loads(proc.stdout)["error"]


def test_distributed_auto_without_a_cluster_says_what_to_do():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JAX_", "OMPI_", "PMI_", "TPU_"))}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [*PODSCALE, "train", "--model", "mlp", "--steps", "2", "--distributed-auto", "--json", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr
    error = json.loads(proc.stdout.strip().splitlines()[-1])["error"]
    assert error.startswith("--distributed-auto: JAX found no cluster to join here")
    assert "--coordinator-address" in error and "podscale launch" in error and "SLURM" in error
    assert "Traceback" not in proc.stderr


# --- podscale launch ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--processes", "0"], "--processes must be at least 1, got 0"),
        (["--processes", "-2"], "--processes must be at least 1"),
        (["--processes", "1000000"], "--processes 1000000: podscale launch starts every process on this machine"),
        (["--processes", "2", "--grace", "-1"], "--grace must be a finite number of seconds >= 0"),
        (["--processes", "2", "--grace", "nan"], "--grace must be a finite number"),
        (["--processes", "2", "--grace", "inf"], "--grace must be a finite number"),
    ],
)
def test_launch_refuses_counts_and_grace_periods_that_make_no_sense(capsys, args, message):
    assert cli.main(["launch", *args, "--", sys.executable, "-c", "pass"]) == 2
    assert message in capsys.readouterr().err


# Children of ``launch``: each reads its process id and dies, exits or waits as told.
_CHILD = """
import os, signal, sys, time
what = sys.argv[1:][int(os.environ["PODSCALE_PROCESS_ID"])]
if what.startswith("sig"):
    os.kill(os.getpid(), getattr(signal, what[3:]))
elif what.startswith("late"):
    time.sleep(0.5); sys.exit(int(what[4:]))
elif what == "hang":
    time.sleep(60)
sys.exit(int(what))
"""


@pytest.mark.parametrize(
    ("children", "code"),
    [
        (["late3", "sigSIGKILL"], EXIT_PEER_LOST),  # a peer killed: the survivor's 3, not 137
        (["sigSIGTERM", "late3"], EXIT_PEER_LOST),
        (["late3", "137"], EXIT_PEER_LOST),  # a supervisor whose training child was killed
        (["hang", "2"], 2),  # the one launch kills after the grace period does not count
        (["hang", "sigSIGKILL"], 128 + signal.SIGKILL),  # nobody said why: as a shell reports it
        (["late1", "0", "0"], 1),
        (["0", "0"], 0),
    ],
    ids=lambda v: ",".join(v) if isinstance(v, list) else str(v),
)
def test_launch_returns_the_exit_code_a_child_gave_not_a_signal(children, code):
    command = [sys.executable, "-c", _CHILD, *children]
    assert distributed.launch(len(children), command, grace_s=1.0) == code


def test_a_run_whose_stderr_is_not_a_terminal_prints_progress_lines():
    """A pipe or a CI log gets no live bar: plain lines say what the run is doing (the first
    step's compile, steps, evaluations), so a long run never looks hung."""
    proc = subprocess.run(
        [sys.executable, "-m", "podscale.cli", "train", "--model", "mlp", "--steps", "4", "--eval-every", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("podscale train: ")]
    assert lines[0].startswith("podscale train: compiling and running step 1 of 4 (")
    assert any(line.startswith("podscale train: step 2: held-out accuracy ") for line in lines), lines
    assert any(line.startswith("podscale train: step 4: held-out accuracy ") for line in lines), lines
    quiet = subprocess.run(
        [sys.executable, "-m", "podscale.cli", "train", "--model", "mlp", "--steps", "2", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert quiet.returncode == 0 and "podscale train: " not in quiet.stderr


def test_only_process_0_checks_the_files_it_alone_writes(monkeypatch, tmp_path):
    """--metrics-file, --mllog and --export are written by process 0: another host need not have
    their folders; every process writes its part of --workdir, so each checks it."""
    missing = str(tmp_path / "only-on-host-0" / "m.jsonl")
    monkeypatch.setenv(distributed.ENV_PROCESS_ID, "1")
    TrainConfig(metrics_file=missing, mllog=missing, export=missing.replace(".jsonl", ".npz"))
    with pytest.raises(ValueError, match="--workdir"):
        TrainConfig(workdir="/proc/podscale-run")
    monkeypatch.setenv(distributed.ENV_PROCESS_ID, "0")
    with pytest.raises(ValueError, match="--metrics-file"):
        TrainConfig(metrics_file=missing)


_NO_JAX = """
import os, sys
from podscale import cli
from podscale.train import supervise
if sys.argv[1] == "launch":
    code = cli.main(["launch", "--processes", "2", "--", sys.executable, "-c", "pass"])
else:
    os.environ.update(PODSCALE_COORDINATOR="127.0.0.1:1", PODSCALE_NUM_PROCESSES="2", PODSCALE_PROCESS_ID="0")
    supervise.run = lambda argv, **kw: 0  # the child it would start loads JAX, as it must
    code = cli.main(["train", "--model", "mlp", "--steps", "3", "--json"])
print(code, "jax" in sys.modules)
"""


@pytest.mark.parametrize("role", ["launch", "supervisor"])
def test_the_launcher_and_a_processs_supervisor_never_load_jax(role):
    """They start processes and watch them; only the processes that train load JAX."""
    proc = subprocess.run([sys.executable, "-c", _NO_JAX, role], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["0", "False"], proc.stdout + proc.stderr


def test_a_launched_command_gets_the_users_jax_platforms():
    """Where libtpu is installed without a TPU, podscale keeps JAX on the CPU by setting
    ``JAX_PLATFORMS`` in its own process: the commands ``launch`` starts get the user's."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "PODSCALE_SET_JAX_PLATFORMS")}
    show = [sys.executable, "-c", "import os; print(os.environ.get('JAX_PLATFORMS'))"]
    proc = subprocess.run(
        [*PODSCALE, "launch", "--processes", "1", "--", *show], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode == 0 and proc.stdout.split() == ["None"], proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "flags", [["--num-processes", "2"], ["--process-id", "0"], ["--num-proc", "2", "--process-id", "0"]]
)
def test_an_incomplete_or_abbreviated_cluster_is_refused_as_the_whole_command_line_reads_it(flags, capsys):
    assert podscale_main(["train", "--model", "mlp", "--steps", "2", "--json", *flags]) == 2
    out = capsys.readouterr()
    assert "Traceback" not in out.err and json.loads(out.out.strip().splitlines()[-1])["exit_code"] == 2


def test_subpackages_are_attributes_after_a_plain_import():
    code = "import podscale; print(podscale.parallel.tensor.Rules.__name__, podscale.workloads.NAMES[0])"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.split()[0] == "Rules", proc.stderr[-2000:]


def test_the_schedules_horizon_is_recorded_and_refused_where_it_means_nothing(tmp_path):
    from podscale.train.resume import SCHEDULE_STEPS, schedule_steps

    dlrm = make_task("dlrm", config="tiny", with_data=False)
    assert schedule_steps(TrainConfig(model="dlrm", config="tiny", steps=7), dlrm) == 7
    assert schedule_steps(TrainConfig(model="dlrm", config="tiny", steps=7, schedule_steps=9), dlrm) == 9
    # No schedule of the run's length: a constant learning rate, or the Transformer's endless one.
    assert schedule_steps(TrainConfig(steps=7), make_task("mlp")) is None
    with pytest.raises(ValueError, match="--schedule-steps 9: optimizer 'adam' runs at a constant learning rate"):
        schedule_steps(TrainConfig(model="dlrm", config="tiny", optimizer="adam", steps=7, schedule_steps=9), dlrm)
    big = make_task("transformer-big", config="tiny", with_data=False)
    assert schedule_steps(TrainConfig(model="transformer-big", config="tiny"), big) is None
    with pytest.raises(ValueError, match="--steps 9 is more than --schedule-steps 5"):
        TrainConfig(steps=9, schedule_steps=5)
    # A run of an older podscale, whose run_config.json has no horizon, is refused naming the flag.
    workdir = tmp_path / "run"
    (workdir / "checkpoints").mkdir(parents=True)
    (workdir / RUN_CONFIG).write_text(json.dumps({"model": "dlrm"}))
    resumed = dict(model="dlrm", config="tiny", workdir=str(workdir), resume=True)
    with pytest.raises(ValueError, match="does not record .* pass --schedule-steps"):
        schedule_steps(TrainConfig(**resumed), dlrm)
    (workdir / RUN_CONFIG).write_text(json.dumps({"model": "dlrm", SCHEDULE_STEPS: 30}))
    assert schedule_steps(TrainConfig(steps=20, **resumed), dlrm) == 30
