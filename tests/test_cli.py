"""End-to-end runs of the ``podscale`` command in subprocesses (marked slow; they run in CI)."""

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import long_run_env, podscale_main

PODSCALE = [sys.executable, "-m", "podscale.cli"]
pytestmark = pytest.mark.slow


def _run(*args, timeout=300, check=True, env=None):
    proc = subprocess.run([*PODSCALE, *args], capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"podscale {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def _summary(proc) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _train_to_target(*args, log, timeout=600) -> dict:
    """A time-to-target run's JSON summary, its MLPerf log written to ``log``. Its hundreds of
    steps run with XLA's default emitters at LLVM's level 1 (helpers.long_run_env), about 3x faster than the suite's."""
    proc = _run(*args, "--mllog", str(log), "--json", "--no-progress", timeout=timeout, env=long_run_env())
    return _summary(proc)


def _params(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def _assert_bit_identical(tmp_path, resumed: str, after: str) -> None:
    """``whole.npz`` (an uninterrupted run) and ``resumed`` hold the same parameters."""
    a, b = _params(tmp_path / "whole.npz"), _params(tmp_path / resumed)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=f"{k} after {after}")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "gpt9"], "unknown model 'gpt9'; choose one of: cnn, mlp, resnet, transformer"),
        (["--optimizer", "adamax"], "unknown optimizer 'adamax'; choose one of:"),
        (["--model", "transformer", "--data", "digits"], "data 'digits' does not fit model 'transformer'"),
        (["--mesh", "4x4"], "mesh shape (4, 4) needs 16 devices, but there are 8"),
        (["--batch-size", "20"], "--batch-size 20 is not divisible by the 8 replicas"),
        (
            ["--grad-sum", "2d"],
            "--grad-sum 2d needs a mesh with exactly two axes, got {'data': 8}; make one of its 8 devices, e.g. --mesh 4x2",
        ),
        (["--grad-sum-chunks", "0"], "--grad-sum-chunks must be at least 1, got 0"),
        (["--bucket-bytes", "0"], "--bucket-bytes must be at least 1, got 0"),
        (["--weight-update", "sharded", "--min-shard-size", "0"], "--min-shard-size must be at least 1"),
        (["--mesh", "4x2", "--grad-sum", "2d", "--axis-costs", "x=fast"], "--axis-costs x=fast: write calibrate"),
        (["--model", "resnet50"], "model 'resnet50' needs --config; choose one of: full, tiny"),
        (["--model", "resnet50", "--config", "full"], "does not ship with podscale"),
        (["--bn-group-size", "3"], "--bn-group-size 3 must be a positive divisor of the last mesh dimension"),
        (
            ["--replicas", "6", "--num-processes", "4", "--coordinator-address", "127.0.0.1:1", "--process-id", "0"],
            "--replicas 6 is not divisible by the 4 processes",
        ),
    ],
)
def test_bad_input_is_a_clear_error(args, message, capsys):
    """In this process (8 CPU devices, as a plain ``podscale train`` gets): main returns the exit code."""
    assert podscale_main(["train", "--steps", "1", "--no-progress", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def _one_and_two_processes(tmp_path, *args):
    common = ["train", *args, "--replicas", "8", "--json", "--no-progress"]
    one = _summary(_run(*common, "--export", str(tmp_path / "one.npz")))
    two = _summary(_run("launch", "--processes", "2", "--", *PODSCALE, *common, "--export", str(tmp_path / "two.npz")))
    assert (one["processes"], two["processes"]) == (1, 2)
    assert two["replicas"] == one["replicas"] == 8
    a, b = _params(tmp_path / "one.npz"), _params(tmp_path / "two.npz")
    assert a.keys() == b.keys()
    return one, two, max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


def test_two_processes_reach_the_same_parameters_and_loss_as_one(tmp_path):
    """The transformer for 20 steps: 2 processes x 4 devices (gloo) versus 1 process x 8 devices,
    parameters within 1e-6 (measured: 1.2e-7). The sharded update across two processes is held
    to one process's by the preemption test below (the MLP on digits, 300 steps).

    gloo sums in another order than the in-process all-reduce. Plain SGD keeps that roundoff at
    float32 level; Adam at lr=1e-3 divides the rare nearly-cancelling gradient elements by their
    own tiny RMS and grew it to ~1.6e-5 in 20 steps (measured), so this check uses SGD.
    """
    flags = ("--model", "transformer", "--optimizer", "sgd", "--learning-rate", "0.1", "--steps", "20")
    one, two, diff = _one_and_two_processes(tmp_path, *flags)
    assert diff <= 1e-6
    assert two["final_train_loss"] == pytest.approx(one["final_train_loss"], abs=1e-6)


def _stop_after(args: list[str], workdir, steps: int, sig: int, committed: bool = False) -> subprocess.Popen:
    """``podscale ARGS --workdir WORKDIR`` sent ``sig`` once it has logged ``steps`` steps (and,
    with ``committed``, once a checkpoint is complete: a save is asynchronous, so under load the
    first one may still be in flight steps later). ``proc.logged``: the steps logged by then."""
    proc = subprocess.Popen([*PODSCALE, *args, "--workdir", str(workdir)], stderr=subprocess.PIPE, text=True)
    metrics, checkpoints = workdir / "metrics.jsonl", workdir / "checkpoints"
    deadline = time.monotonic() + 240
    logged = 0
    while time.monotonic() < deadline and proc.poll() is None:
        logged = sum(1 for line in open(metrics) if '"loss"' in line) if metrics.exists() else 0
        done = not committed or (checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir()))
        if logged >= steps and done:
            break
        time.sleep(0.005)
    proc.send_signal(sig)
    proc.logged = logged
    return proc


def test_kill_sigterm_or_ctrl_c_then_resume_is_bit_identical(tmp_path):
    """Each way a run stops early, then ``--resume``: the final parameters equal one
    uninterrupted run's (which keeps no checkpoints: saving does not change the run).
    - SIGKILL at a random step: it resumes from the last periodic checkpoint (every 4 steps).
    - Preemption, by SIGTERM and by Ctrl-C: one line, exit code 128 + the signal, no traceback;
      the checkpoint written at the interrupted step (no periodic one before step 250) resumes."""
    common = ["train", "--model", "mlp", "--data", "digits", "--steps", "300", "--no-progress"]
    _run(*common, "--export", str(tmp_path / "whole.npz"))

    kill_after = random.Random().randint(6, 30)
    killed = [*common, "--checkpoint-every", "4"]
    proc = _stop_after(killed, tmp_path / "killed", kill_after, signal.SIGKILL, committed=True)
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, f"the run ended before it could be killed (step {kill_after})"
    kill_after = proc.logged  # at least the draw, and a checkpoint was complete
    # The rest of the run saves rarely (saving does not change the run; 70 saves took 9 s of 16).
    rest = [*common, "--checkpoint-every", "250", "--workdir", str(tmp_path / "killed")]
    resumed = _summary(_run(*rest, "--resume", "--json", "--export", str(tmp_path / "k.npz")))
    assert resumed["resumed_from"] is not None and resumed["resumed_from"] <= kill_after + 1
    _assert_bit_identical(tmp_path, "k.npz", f"a kill at step ~{kill_after}")

    stopped = [*common, "--checkpoint-every", "250"]
    for sig in (signal.SIGTERM, signal.SIGINT):
        workdir = tmp_path / f"stopped-{sig.name}"
        proc = _stop_after(stopped, workdir, 10, sig)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 128 + sig, err
        lines = [line for line in err.splitlines() if line.strip()]
        assert "Traceback" not in err and lines[-1].startswith(f"podscale: interrupted by {sig.name} at step")
        assert lines[-1].endswith("continue with --resume")
        step = int(lines[-1].split(" at step ")[1].split(";")[0])
        assert 10 <= step < 250  # the run stopped early, and saved there because of the signal
        export = f"{sig.name}.npz"
        resumed = _summary(
            _run(*stopped, "--workdir", str(workdir), "--resume", "--json", "--export", str(tmp_path / export))
        )
        assert resumed["resumed_from"] == step
        _assert_bit_identical(tmp_path, export, f"{sig.name} at step {step}")


def _two_processes(*args, **env_extra):
    """Processes 0 and 1 of one run, started by hand as on two hosts (each under its supervisor)."""
    env = dict(os.environ, PODSCALE_COORDINATOR=f"127.0.0.1:{_free_port()}", PODSCALE_NUM_PROCESSES="2", **env_extra)
    env.setdefault("PYTHONFAULTHANDLER", "1")  # a run that does not start shows where it waits
    return env["PODSCALE_COORDINATOR"], [
        subprocess.Popen(
            [*PODSCALE, *args], env=dict(env, PODSCALE_PROCESS_ID=str(i)), stderr=subprocess.PIPE, text=True
        )
        for i in range(2)
    ]


def _wait_for_steps(procs, metrics, steps: int, timeout: float = 240) -> None:
    """Until process 0 has logged ``steps`` steps (both train in lockstep: every step all-reduces)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        if metrics.exists() and sum(1 for line in open(metrics) if '"loss"' in line) >= steps:
            return
        time.sleep(0.02)
    said = {}
    # Still running: its Python stacks (PYTHONFAULTHANDLER), then it ends; process 0 last, since
    # the others end at once when the coordinator goes (and their supervisors then hide the rest).
    for i, p in reversed(list(enumerate(procs))):
        alive = p.poll() is None
        if alive:
            for child in subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(child), signal.SIGABRT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            said[i] = f"\nprocess {i} ({'stalled' if alive else f'exit {p.returncode}'}):\n"
            said[i] += p.communicate(timeout=20)[1][-12000:]
    said = "".join(said[i] for i in sorted(said))
    raise AssertionError(f"the run did not start: {[p.poll() for p in procs]}{said}")


HEARTBEAT_S = 10
PEER_LOST_BOUND_S = 20
"""A survivor exits within the heartbeat timeout plus this (documented in the README)."""


@pytest.mark.parametrize("victim", [0, 1])
def test_a_dead_peer_ends_the_others_with_a_message_naming_it(tmp_path, victim):
    """Whichever process dies (0 runs the coordinator), the other exits with code 3 and one
    podscale line naming it, within the heartbeat timeout plus a bound; no C++ stack trace."""
    metrics = tmp_path / "metrics.jsonl"
    args = ["train", "--model", "mlp", "--steps", "1000000", "--no-progress", "--metrics-file", str(metrics)]
    address, procs = _two_processes(*args, "--heartbeat-timeout", str(HEARTBEAT_S))
    try:
        _wait_for_steps(procs, metrics, 5)
        procs[victim].send_signal(signal.SIGKILL)
        start = time.monotonic()
        survivor = procs[1 - victim]
        _, err = survivor.communicate(timeout=HEARTBEAT_S + PEER_LOST_BOUND_S + 60)
        took = time.monotonic() - start
        assert survivor.returncode == 3, err[-3000:]
        assert took < HEARTBEAT_S + PEER_LOST_BOUND_S, f"{took:.1f} s"
        last = err.strip().splitlines()[-1]
        assert last.startswith(f"podscale: error: process {1 - victim} of 2: "), err[-3000:]
        named = (
            f"lost the coordinator at {address} (process 0)" if victim == 0 else "process 1 stopped sending heartbeats"
        )
        assert named in last
        assert "Traceback" not in err and "Check failure" not in err and "    @ " not in err
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def test_a_peer_that_never_starts_ends_in_a_bounded_wait_naming_the_coordinator():
    """Process 0 alone (the coordinator, waiting for its peer) and process 1 alone (waiting for
    the coordinator), side by side, each in its own two-process run that never assembles."""
    procs = {}
    ports = _free_ports(2)  # two different ports: two lone processes on one port would assemble
    start = time.monotonic()
    for alone in (0, 1):
        env = dict(os.environ, PODSCALE_COORDINATOR=f"127.0.0.1:{ports[alone]}", PODSCALE_NUM_PROCESSES="2")
        env["PODSCALE_PROCESS_ID"] = str(alone)
        cmd = [*PODSCALE, "train", "--model", "mlp", "--steps", "5", "--no-progress", "--join-timeout", "5", "--json"]
        procs[alone] = (env, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = {}
    try:
        for alone, (_, proc) in procs.items():
            outputs[alone] = proc.communicate(timeout=120)
    finally:
        for _, proc in procs.values():
            proc.kill()
    for alone, (env, proc) in procs.items():
        out, err = outputs[alone]
        assert proc.returncode == 3, err[-3000:]
        assert time.monotonic() - start < 5 + 60  # the join timeout, plus starting Python and JAX under load
        message = f"process {alone} of 2: the run did not assemble within --join-timeout 5 s"
        assert err.strip().splitlines()[-1].startswith(f"podscale: error: {message}")
        assert env["PODSCALE_COORDINATOR"] in err and "Check failure" not in err
        assert json.loads(out.strip().splitlines()[-1])["exit_code"] == 3


def test_sigterm_to_one_process_stops_all_at_one_step_and_resume_is_bit_identical(tmp_path):
    """A preemption notice to process 1 only: both stop at the same step boundary, save one
    checkpoint together and exit 143 with one line; two processes resumed from it end where an
    uninterrupted two-process run ends. With the sharded update (reduce-scatter and all-gather
    over gloo), and SGD: the uninterrupted run ends within 1e-6 of one process's (measured:
    2.4e-7 after the 300 steps; see the test above for why SGD).

    The same checkpoint resumed by one process instead feeds, step for step, the examples the
    uninterrupted one-process run fed: ``metrics.jsonl``'s ``examples``, and the losses they give.
    From there on the two runs differ only in the gradient sum's order, and that is all the
    losses may show: within 1e-5 of each other while no ReLU flips, and never as far apart as
    another batch would put them. A pre-activation within an ulp of zero does flip in one run and
    not the other now and then, and the ReLU's gradient jumps there (measured, with the suite's
    flags: stopped at steps 10, 11, 13 or 14, the continuation's loss at step 157 is 2.8e-5 off one
    process's, up to 1.1e-4 later, and its parameters 5e-4; stopped at 12 or 16, 2.4e-7 to the
    end). Which step the stop lands on depends on the machine's load, so the bound after a flip is
    the summation order's (2e-3 on a loss near 0.2, where the next batch is a median 5e-2 off)."""
    common = ["train", "--model", "mlp", "--data", "digits", "--optimizer", "sgd", "--learning-rate", "0.1"]
    common += ["--steps", "300", "--checkpoint-every", "250", "--weight-update", "sharded", "--no-progress"]
    launch = ("launch", "--processes", "2", "--", *PODSCALE, *common)
    _run(*launch, "--workdir", str(tmp_path / "whole"), "--export", str(tmp_path / "whole.npz"))
    _run(*common, "--workdir", str(tmp_path / "one"), "--export", str(tmp_path / "one.npz"))
    a, b = _params(tmp_path / "one.npz"), _params(tmp_path / "whole.npz")
    assert a.keys() == b.keys() and max(float(np.max(np.abs(a[k] - b[k]))) for k in a) <= 1e-6
    workdir = tmp_path / "stopped"
    _, procs = _two_processes(*common, "--workdir", str(workdir))
    try:
        _wait_for_steps(procs, workdir / "metrics.jsonl", 10)
        procs[1].send_signal(signal.SIGTERM)
        lasts = []
        for p in procs:
            _, err = p.communicate(timeout=120)
            assert p.returncode == 128 + signal.SIGTERM, err[-3000:]
            assert "Traceback" not in err
            lasts.append(err.strip().splitlines()[-1])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert lasts[0] == lasts[1] and lasts[0].startswith("podscale: interrupted by SIGTERM to the run"), lasts
    assert lasts[0].endswith("continue with --resume")
    step = int(lasts[0].split(" at step ")[1].split(";")[0])
    assert 10 <= step < 300
    shutil.copytree(workdir, tmp_path / "moved")  # the same checkpoint, for one process
    resumed = _summary(
        _run(*launch, "--workdir", str(workdir), "--resume", "--json", "--export", str(tmp_path / "resumed.npz"))
    )
    assert resumed["resumed_from"] == step
    _assert_bit_identical(tmp_path, "resumed.npz", f"SIGTERM to process 1 at step {step}")
    moved = _summary(
        _run(
            *common, "--workdir", str(tmp_path / "moved"), "--resume", "--json", "--export", str(tmp_path / "moved.npz")
        )
    )
    assert (moved["resumed_from"], moved["processes"]) == (step, 1)
    fed, alone = _step_records(tmp_path / "moved"), _step_records(tmp_path / "one")
    assert [r["step"] for r in fed] == list(range(1, 301))
    assert [r["examples"] for r in fed] == [r["examples"] for r in alone] == [[64 * s, 64 * s + 64] for s in range(300)]
    # Up to the stop, the records are the two-process run's: bit for bit the uninterrupted one's.
    assert [r["loss"] for r in fed[:step]] == [r["loss"] for r in _step_records(tmp_path / "whole")][:step]
    drift = [abs(r["loss"] - q["loss"]) for r, q in zip(fed, alone)][step:]
    assert max(drift[:10]) <= 1e-5, f"stopped at step {step}; the first steps after it: {drift[:10]}"
    assert max(drift) <= 2e-3, f"stopped at step {step}; from there on: {drift}"
    a, b = _params(tmp_path / "one.npz"), _params(tmp_path / "moved.npz")
    assert max(float(np.max(np.abs(a[k] - b[k]))) for k in a) <= 5e-3


def _step_records(workdir) -> list[dict]:
    """A run's per-step lines of ``metrics.jsonl`` (not its evaluations)."""
    with open(workdir / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if "examples" in r]


def test_launch_needs_a_command():
    proc = _run("launch", "--processes", "2", check=False)
    assert proc.returncode == 2 and "give the command after --" in proc.stderr


def _free_ports(n: int) -> list[int]:
    """``n`` different free ports (each socket held open until all are chosen)."""
    import contextlib
    import socket

    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_plan_reports_layouts_collectives_and_memory():
    plan = json.loads(_run("plan", "--model", "transformer", "--optimizer", "lamb", "--replicas", "8", "--json").stdout)
    kinds = {c["kind"] for c in plan["collectives"]}
    assert {"reduce-scatter", "all-gather", "all-reduce"} <= kinds
    assert plan["memory"]["optimizer_state"] < plan["memory"]["optimizer_state_replicated"] / 5
    assert not plan["gathered_ops"]
    sharded = [leaf for leaf in plan["leaves"] if leaf["sharded"]]
    assert sharded and all(leaf["role"] == "state" for leaf in sharded)
    assert all(leaf["reason"] for leaf in plan["leaves"])


def test_plan_eval_states_the_evaluation_steps_memory_beside_the_train_steps():
    """``plan --eval`` compiles the evaluation on the step's placement too: with 4-way model
    parallelism it needs no more memory per device than the train step."""
    args = ("plan", "--model", "bert-large", "--config", "tiny", "--mesh", "2x4", "--model-parallel", "4", "--eval")
    plan = json.loads(_run(*args, "--json").stdout)
    assert 0 < plan["eval"]["arguments"] and 0 < plan["eval"]["peak"] <= plan["memory"]["peak"]


def test_plan_strict_fails_on_ops_that_cannot_run_on_shards():
    # flat chunks (the 2-D sum's fused buffers) cannot take adafactor's factored row and column means
    args = ("plan", "--model", "mlp", "--optimizer", "adafactor", "--mesh", "4x2", "--grad-sum", "2d", "--strict")
    proc = _run(*args, check=False)
    assert proc.returncode == 2 and "refused before running" in proc.stderr and "reduce_sum" in proc.stderr


def test_sharded_checkpoints_move_between_replica_counts(tmp_path):
    """8 -> 4 -> 2 -> 8 replicas through checkpoints ends where an unmoved 8-replica run ends."""
    common = [
        "train",
        "--model",
        "mlp",
        "--optimizer",
        "momentum",
        "--learning-rate",
        "0.05",
        "--batch-size",
        "32",
        "--weight-update",
        "sharded",
        "--checkpoint-every",
        "2",
        "--no-progress",
        "--json",
    ]
    whole = _summary(
        _run(
            *common,
            "--replicas",
            "8",
            "--steps",
            "8",
            "--workdir",
            str(tmp_path / "w"),
            "--export",
            str(tmp_path / "whole.npz"),
        )
    )
    moved = tmp_path / "m"
    _run(*common, "--replicas", "8", "--steps", "2", "--workdir", str(moved))
    _run(*common, "--replicas", "4", "--steps", "4", "--workdir", str(moved), "--resume")
    _run(*common, "--replicas", "2", "--steps", "6", "--workdir", str(moved), "--resume")
    last = _summary(
        _run(
            *common,
            "--replicas",
            "8",
            "--steps",
            "8",
            "--workdir",
            str(moved),
            "--resume",
            "--export",
            str(tmp_path / "moved.npz"),
        )
    )
    assert last["resumed_from"] == 6 and last["steps"] == whole["steps"] == 8
    a, b = _params(tmp_path / "whole.npz"), _params(tmp_path / "moved.npz")
    assert max(float(np.max(np.abs(a[k] - b[k]))) for k in a) <= 1e-6


def test_2d_gradient_sum_trains_like_1d_and_the_plan_shows_both_axes(tmp_path):
    common = ["train", "--model", "mlp", "--mesh", "4x2", "--steps", "10", "--json", "--no-progress"]
    one = _summary(_run(*common, "--export", str(tmp_path / "1d.npz")))
    two = _summary(_run(*common, "--grad-sum", "2d", "--grad-sum-chunks", "2", "--export", str(tmp_path / "2d.npz")))
    assert two["grad_sum"] == {"mode": "2d", "order": ["x", "y"], "chunks": 2, "dtype": None, "phases": "explicit"}
    np.testing.assert_allclose(two["final_train_loss"], one["final_train_loss"], rtol=1e-6)
    a, b = _params(tmp_path / "1d.npz"), _params(tmp_path / "2d.npz")
    assert max(float(np.max(np.abs(a[k] - b[k]))) for k in a) <= 1e-6
    plan = json.loads(
        _run(
            "plan",
            "--model",
            "mlp",
            "--mesh",
            "4x2",
            "--grad-sum",
            "2d",
            "--axis-costs",
            "x=1e9:1e-5,y=1e11:1e-6",
            "--json",
        ).stdout
    )
    assert plan["grad_sum"]["order"] == ["y", "x"] and "y first" in plan["grad_sum"]["reason"]
    kinds = {(c["kind"], tuple(c["axes"])) for c in plan["collectives"]}
    assert {
        ("reduce-scatter", ("y",)),
        ("reduce-scatter", ("x",)),
        ("all-gather", ("x",)),
        ("all-gather", ("y",)),
    } <= kinds


def test_bench_gradsum_reports_every_variant():
    result = json.loads(_run("bench", "gradsum", "--sizes", "0.25", "--steps", "1", "--json").stdout)
    per = result["0.25 MiB"]
    assert set(per) == {"1d", "2d 4x2", "2d 2x4", "2d 4x2 k=4", "2d 2x4 k=4"}
    assert per["1d"]["bytes_per_axis"] == {"data": 7 * 2**18 // 4}
    assert per["2d 4x2"]["bytes_per_axis"] == {"x": 3 * 2**18 // 2, "y": 2**18 // 4}
    assert all(r["max_abs_error"] == 0 and r["median_s"] > 0 for r in per.values())
    assert per["2d 4x2 k=4"]["collectives"][0]["chunks"] == 4


def test_tiny_resnet50_reaches_97_percent_with_lars_and_logs_it(tmp_path):
    """The issue's ResNet time-to-target run, end to end, with its MLPerf log."""
    from mlperf_logging.mllog import constants as C

    from podscale.train import mlperf_log

    log = tmp_path / "mllog.txt"
    # docs/benchmarks.md's command, evaluated every 100 steps instead of 25: its target falls at step
    # 100 there, a multiple of both.
    args = ["train", "--model", "resnet50", "--config", "tiny", "--steps", "200", "--eval-every", "100"]
    summary = _train_to_target(*args, "--target", "0.97", log=log)
    assert summary["eval_value"] >= 0.97 and summary["optimizer"] == "recipe"
    events = mlperf_log.read(str(log))
    logged = {e["key"]: e["value"] for e in events}
    assert logged[C.OPT_NAME] == C.LARS and logged[C.LARS_OPT_LR_DECAY_POLY_POWER] == 2
    assert logged[C.GLOBAL_BATCH_SIZE] == 128
    assert mlperf_log.time_to_target(events, 0.97)["seconds"] == summary["time_to_target_s"]
    _passes_the_checker(log, tmp_path)


def _passes_the_checker(log, cwd):
    from test_mlperf_log import _checker

    proc = _checker(str(log), cwd)
    assert proc.returncode == 0 and "SUCCESS" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_tiny_dlrm_reaches_its_auc_target_and_logs_it(tmp_path):
    """The DLRM time-to-target run of docs/benchmarks.md: held-out AUC (scikit-learn's
    roc_auc_score) at least MLPerf's 0.8025 on the planted click logs, whose teacher's own AUC is
    0.8850, logged as ``eval_accuracy`` for benchmark ``dlrm``; the compliance checker accepts it."""
    from podscale.train import mlperf_log

    log = tmp_path / "mllog.txt"
    args = ["train", "--model", "dlrm", "--config", "tiny", "--steps", "400", "--eval-every", "100"]
    summary = _train_to_target(*args, "--target", "0.8025", log=log)
    assert 0.8025 <= summary["eval_value"] < 0.8850 and summary["time_to_target_s"] is not None
    events = mlperf_log.read(str(log))
    assert next(e for e in events if e["key"] == "submission_benchmark")["value"] == "dlrm"
    _passes_the_checker(log, tmp_path)


def test_tiny_ssd_reaches_its_map_target_and_logs_it(tmp_path):
    """The SSD time-to-target run of docs/benchmarks.md: COCO mAP by pycocotools at least 0.5,
    with an MLPerf log the compliance checker accepts."""
    log = tmp_path / "mllog.txt"
    # docs/benchmarks.md's command, evaluated every 384 steps instead of 64: it reaches the target at
    # step 384 there, a multiple of both (and the run's last step is evaluated too).
    args = ["train", "--model", "ssd", "--config", "tiny", "--steps", "704", "--eval-every", "384", "--target", "0.5"]
    summary = _train_to_target(*args, log=log)
    assert summary["eval_value"] >= 0.5 and summary["time_to_target_s"] is not None
    _passes_the_checker(log, tmp_path)


@pytest.mark.slow
def test_tiny_maskrcnn_reaches_its_box_and_mask_ap_targets_and_logs_both(tmp_path):
    """The Mask R-CNN time-to-target run of docs/benchmarks.md: box and mask AP by pycocotools,
    logged as MLPerf's ``eval_accuracy`` {"BBOX", "SEGM"}, with a log the compliance checker
    accepts (its quality rule: BBOX at least 0.377 and SEGM at least 0.339)."""
    from podscale.train import mlperf_log
    from podscale.workloads import maskrcnn

    log = tmp_path / "mllog.txt"
    args = ["train", "--model", "maskrcnn", "--config", "tiny", "--steps", str(MASKRCNN_RUN["steps"])]
    args += ["--eval-every", str(MASKRCNN_RUN["every"]), "--target", str(MASKRCNN_RUN["target"])]
    summary = _train_to_target(*args, log=log, timeout=900)
    assert summary["time_to_target_s"] is not None
    assert summary["eval"]["mask_ap"] >= MASKRCNN_RUN["target"] and summary["eval"]["mask_ap50"] >= 0.5
    assert summary["eval"]["box_ap"] >= maskrcnn.TINY.box_target
    assert summary["targets"] == {"mask_ap": MASKRCNN_RUN["target"], "box_ap": maskrcnn.TINY.box_target}
    events = mlperf_log.read(str(log))
    last = [e for e in events if e["key"] == "eval_accuracy"][-1]["value"]
    assert last == {"BBOX": summary["eval"]["box_ap"], "SEGM": summary["eval"]["mask_ap"]}
    _passes_the_checker(log, tmp_path)


MASKRCNN_RUN = {"steps": 600, "every": 250, "target": 0.5}
"""docs/benchmarks.md's Mask R-CNN run (its steps and mask AP target), evaluated every 250 steps
instead of 50: it reaches its targets at step 250 there, a multiple of both, and each evaluation
(pycocotools' box and mask AP on the held-out canvases) costs about 25 training steps."""


@pytest.mark.parametrize(
    ("model", "steps", "every", "target", "replicas"),
    [("transformer-big", 1000, 700, 0.99, 2), ("bert-large", 600, 400, 0.75, 8)],
)
def test_tiny_transformers_reach_their_targets(tmp_path, model, steps, every, target, replicas):
    """The time-to-target runs of docs/benchmarks.md, with MLPerf logs the compliance checker
    accepts, evaluated at their target steps only (700 and 400 there) and at their last; each
    evaluation decodes or scores the whole held-out set. bert-large runs on
    8 replicas, as documented. transformer-big runs on 2: its step is the same up to summation
    order on any replica count (no batch norm; dropout masks drawn as on one device: tests/
    test_workloads.py holds 8 replicas to one device), and on 2 CPU cores 8 simulated devices
    launch 4x the kernels of 2 for a tiny model's step (measured: 80 CPU-seconds on 8 replicas,
    55 on 2, both at step 700 with exact match 0.9941). The same runs with ``--mesh 4x2
    --model-parallel 2`` (rows of docs/benchmarks.md) reach their targets at the same steps:
    their step equals this one up to summation order (tests/test_tensor.py, which also resumes a
    model-parallel run through the trainer), and on 8 CPU devices sharing 2 cores they take 1.5x
    as long."""
    log = tmp_path / "mllog.txt"
    args = ["train", "--model", model, "--config", "tiny", "--steps", str(steps), "--eval-every", str(every)]
    summary = _train_to_target(*args, "--target", str(target), "--replicas", str(replicas), log=log)
    assert summary["eval_value"] >= target and summary["replicas"] == replicas
    _passes_the_checker(log, tmp_path)


def test_plan_of_a_workload_reads_at_80_columns_when_piped_and_json_has_the_same_content():
    args = ("plan", "--model", "resnet50", "--config", "tiny", "--replicas", "8")
    text = _run(*args).stdout  # piped: rich lays it out for 80 columns
    assert max(len(line) for line in text.splitlines()) <= 80
    plan = json.loads(_run(*args, "--json").stdout)
    from podscale.report import size

    for c in plan["compiled"]["collectives"]:  # every figure printed whole
        assert size(c["buffer_bytes"]) in text and size(c["moved_bytes"]) in text
    assert f"{plan['traffic']['ratio']:.3f}x" in text and plan["traffic"]["ratio"] <= 1.05
    for key in ("weights", "optimizer_state", "gradients", "temporaries", "peak"):
        assert plan["memory"][key] > 0


@pytest.mark.slow
def test_plan_of_a_full_config_needs_no_data_set():
    plan = json.loads(
        _run("plan", "--model", "transformer-big", "--config", "full", "--replicas", "8", "--json").stdout
    )
    assert plan["replicas"] == 8 and plan["traffic"]["ratio"] <= 1.05
    kinds = {c["kind"] for c in plan["compiled"]["collectives"]}
    assert {"reduce-scatter", "all-gather"} <= kinds
    assert plan["memory"]["optimizer_state"] < plan["memory"]["optimizer_state_replicated"] / 4


def _marked(mark: str) -> list[int]:
    """The live processes whose environment holds ``PODSCALE_TEST_MARK=mark`` (orphans too)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{pid}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            continue
        if f"PODSCALE_TEST_MARK={mark}".encode() in env.split(b"\0") and not zombie:
            found.append(int(pid))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_stopped_or_killed_launcher_stops_every_process_it_started(tmp_path, sig):
    """``podscale launch`` itself stopped: SIGTERM is passed on (the run's coordinated save, then
    exit 143); SIGKILL leaves its processes to notice the lost parent, which stop the same way.
    Either way no descendant is left running, and the run's checkpoint is saved."""
    import uuid

    mark = uuid.uuid4().hex
    workdir = tmp_path / "run"
    args = ["train", "--model", "mlp", "--steps", "1000000", "--checkpoint-every", "100000", "--no-progress"]
    launcher = subprocess.Popen(
        [*PODSCALE, "launch", "--processes", "2", "--", *PODSCALE, *args, "--workdir", str(workdir)],
        env=dict(os.environ, PODSCALE_TEST_MARK=mark),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_steps([launcher], workdir / "metrics.jsonl", 3)
        assert len(_marked(mark)) == 5  # launch, and each process's supervisor and trainer
        launcher.send_signal(sig)
        _, err = launcher.communicate(timeout=120)
        deadline = time.monotonic() + 60
        while _marked(mark) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _marked(mark), f"left running after launch got {sig.name}"
    finally:
        for pid in _marked(mark):
            os.kill(pid, signal.SIGKILL)
    if sig == signal.SIGTERM:
        assert launcher.returncode == 128 + sig and "Traceback" not in err, err[-3000:]
        assert "podscale: interrupted by SIGTERM to the run" in err
    assert any(p.name.isdigit() for p in (workdir / "checkpoints").iterdir())  # the stop's coordinated save
