"""Bad input is refused before any work, naming the flag or parameter and saying what to do."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import podscale_main

import podscale
from podscale.train.trainer import TrainConfig

PODSCALE = [sys.executable, "-m", "podscale.cli"]


def _cli(*args, env=None):
    return subprocess.run([*PODSCALE, *args], capture_output=True, text=True, timeout=120, env=env)


CLI_CASES = [
    (["--learning-rate", "inf"], "--learning-rate must be a finite number > 0, got inf"),
    (["--learning-rate", "nan"], "--learning-rate must be a finite number > 0, got nan"),
    (["--learning-rate", "0"], "--learning-rate must be a finite number > 0"),
    (["--learning-rate=-1e-3"], "--learning-rate must be a finite number > 0"),
    (["--target", "-1"], "--target -1.0: the held-out metric"),
    (["--target", "2.0"], "give a value in [0, 1]"),
    (["--seed", "-1"], "--seed must be 0 or more"),
    (["--steps", "99999999999999999999"], "--steps 99999999999999999999: the step counter is a 32-bit integer"),
    (["--schedule-steps", "0"], "--schedule-steps must be at least 1"),
    (["--mesh", "4*2"], "write the mesh shape as 8 or 4x2"),
    (["--heartbeat-timeout", "0"], "--heartbeat-timeout must be a positive number of seconds"),
    (["--checkpoint-every", "5"], "--checkpoint-every needs --workdir"),
    (["--resume"], "--resume needs --workdir"),
    (["--export", "/nonexistent-podscale-dir/params.npz"], "the folder /nonexistent-podscale-dir does not exist"),
    (["--metrics-file", "/proc/m.jsonl"], "--metrics-file /proc/m.jsonl: cannot write in /proc"),
    (["--resume-fallback"], "--resume-fallback goes with --resume"),
    (["--replicas", "100000"], "--replicas 100000: too many CPU devices to simulate"),
    (
        ["--coordinator-address", "garbage", "--num-processes", "2", "--process-id", "0"],
        "--coordinator-address 'garbage': write it as HOST:PORT",
    ),
]


@pytest.mark.parametrize(("args", "message"), CLI_CASES, ids=[" ".join(a) for a, _ in CLI_CASES])
def test_train_refuses_bad_flags_with_a_message_and_exit_code_2(args, message, capsys):
    """``podscale train`` in this process (its exit code is main's return value; the subprocess
    test below holds the process's own exit code and its one JSON object)."""
    assert podscale_main(["train", "--steps", "2", "--no-progress", *args]) == 2
    out = capsys.readouterr()
    assert message in out.err
    assert "Traceback" not in out.err and "steps 2" not in out.out  # refused before training


def test_a_workdir_that_is_a_file_is_refused(tmp_path, capsys):
    path = tmp_path / "afile"
    path.write_text("")
    assert podscale_main(["train", "--steps", "2", "--no-progress", "--workdir", str(path)]) == 2
    assert f"--workdir {path}: is a file, not a directory" in capsys.readouterr().err


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root may write anywhere")
def test_a_workdir_that_is_not_writable_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ValueError, match="is not writable"):
        TrainConfig(workdir=str(locked / "run"))


def test_an_error_under_json_is_one_json_object():
    proc = _cli("train", "--steps", "2", "--seed", "-1", "--json")
    assert proc.returncode == 2
    out = json.loads(proc.stdout)
    assert out["exit_code"] == 2 and out["error"].startswith("--seed must be 0 or more")


def test_the_same_checks_hold_in_python(tmp_path):
    for kwargs, match in [
        (dict(learning_rate=float("inf")), "--learning-rate"),
        (dict(target=2.0), "--target"),
        (dict(seed=-1), "--seed"),
        (dict(checkpoint_every=3), "needs --workdir"),
        (dict(export=str(tmp_path / "missing" / "p.npz")), "does not exist"),
        (dict(export=str(tmp_path)), "is a directory"),
    ]:
        with pytest.raises(ValueError, match=match):
            TrainConfig(**kwargs)


def test_launch_runs_this_interpreters_podscale_without_the_venv_on_path():
    env = dict(os.environ, PATH="/usr/bin:/bin")
    proc = _cli("launch", "--processes", "1", "--", "podscale", "models", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    assert {m["name"] for m in json.loads(proc.stdout)} >= {"resnet50", "gnmt"}


def test_a_refusal_under_launch_is_said_once_not_once_per_process():
    """Every process reads the same bad flag: process 0 says it; launch says another process's
    refusal only where it differs (issue 42, 22)."""
    proc = _cli("launch", "--processes", "2", "--", "podscale", "train", "--model", "mlp", "--batch-size", "12")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("--batch-size 12 is not divisible") == 1, proc.stderr
    assert "podscale: error (process" not in proc.stderr


def test_launch_says_each_process_s_refusal_that_differs(tmp_path, capsys):
    from podscale.train import distributed

    for pid, message in ((0, "a"), (1, "a"), (2, "b"), (3, "b")):
        (tmp_path / f"{pid}.txt").write_text(message)
    distributed._print_other_refusals(str(tmp_path), 4)
    assert capsys.readouterr().err == "podscale: error (process 2): b\n"


def test_reusing_a_donated_state_raises_instead_of_crashing():
    def step(state, batch):
        return {"w": state["w"] - 0.1 * jnp.mean(batch) * state["w"]}, {}

    dp = podscale.data_parallel(step, podscale.make_mesh())
    batch = jnp.ones((8, 2))
    state = dp.place_state({"w": jnp.ones(4)}, batch)
    new, _ = dp(state, batch)
    with pytest.raises(ValueError, match=r"state\['w'\] was donated to an earlier step"):
        dp(state, batch)
    with pytest.raises(ValueError, match="donated"):
        dp.gather_state(state)
    assert dp.gather_state(new)["w"].tolist() == pytest.approx([0.9] * 4)


ARGPARSE_CASES = [
    ["train", "--steps", "x"],
    ["train", "--precision", "fp8"],
    ["train", "--bogus"],
    ["project", "--multi-axis", "foo"],
    ["bench", "nothing"],
    ["plan", "--replicas", "2.5"],
    ["bogus"],
]


@pytest.mark.parametrize("argv", ARGPARSE_CASES, ids=" ".join)
def test_a_flag_argparse_refuses_is_one_podscale_error_and_json_under_json(argv, capsys):
    from podscale import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main([*argv, "--json"])
    assert exit_.value.code == 2
    out = capsys.readouterr()
    assert out.err.startswith("podscale: error: ") and out.err.count("\n") == 1, out.err
    assert "--help" in out.err and "usage:" not in out.err
    assert json.loads(out.out)["exit_code"] == 2


def _dir_named(tmp_path, name):
    (tmp_path / "w" / name).mkdir(parents=True)
    return str(tmp_path / "w")


# Found by a second new-user sweep: each refused before any work, in the run's own words.
SWEEP_CASES = [
    (lambda t: ["--seed", str(10**20)], "--seed must be below 2**63"),
    (lambda t: ["--batch-size", str(2**40)], "below 2**31"),
    (lambda t: ["--eval-batch-size", str(2**40)], "below 2**31"),
    (lambda t: ["--eval-batch-size", "100000"], "larger than the held-out set (512 examples)"),
    (lambda t: ["--batch-size", "100000"], "larger than the data set"),
    (lambda t: ["--export", str(t / "p.txt")], "ending in .npz"),
    (lambda t: ["--mllog", str(t / "x"), "--metrics-file", str(t / "x")], "give each output a path of its own"),
    (lambda t: ["--workdir", str(t / "w"), "--metrics-file", str(t / "w" / "run_config.json")], "run_config.json"),
    (lambda t: ["--workdir", _dir_named(t, "metrics.jsonl")], "--workdir's metrics.jsonl"),
    (lambda t: ["--workdir", _dir_named(t, "mllog.txt")], "--workdir's mllog.txt"),
    (lambda t: ["--optimizer", ""], "--optimizer is empty"),
    (lambda t: ["--data", ""], "--data is empty"),
    (lambda t: ["--mesh", "8x1", "--grad-sum", "2d"], "has one device"),
    (lambda t: ["--mesh", "4x2", "--grad-sum", "2d", "--grad-sum-chunks", "100000"], "at most 64"),
    (lambda t: ["--axis-costs", "x=1:1,y=1:1"], "add --grad-sum 2d"),
    (lambda t: ["--grad-sum-phases", "xla"], "--grad-sum-phases xla says how the 2-D gradient sum is sent"),
    (
        lambda t: ["--mesh", "4x2", "--grad-sum", "2d", "--grad-sum-phases", "xla", "--grad-sum-chunks", "2"],
        "add --grad-sum-phases explicit",
    ),
    (lambda t: ["--mesh", "4x2", "--grad-sum", "2d", "--axis-costs", "x=nan:1,y=1:1"], "finite"),
    (lambda t: ["--mesh", "3x3"], "for example --mesh 8 or --mesh 4x2"),
    (lambda t: ["--model", "resnet", "--data", "digits", "--bn-group-size", "3"], "--bn-group-size 3 must be"),
]


@pytest.mark.parametrize(("args", "message"), SWEEP_CASES, ids=[m for _, m in SWEEP_CASES])
def test_a_dry_run_refuses_what_a_new_user_got_wrong(args, message, tmp_path, capsys):
    from podscale import cli

    assert cli.main(["train", "--no-progress", *args(tmp_path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_launch_refuses_a_command_that_cannot_run(tmp_path, monkeypatch, capsys):
    from podscale import cli

    plain = tmp_path / "not-executable"
    plain.write_text("")
    for command in ("/nonexistent/cmd", "", str(plain)):
        assert cli.main(["launch", "--processes", "2", "--", command]) == 2
        assert "is not found or not executable" in capsys.readouterr().err
    monkeypatch.setenv("PODSCALE_PROCESS_ID", "abc")
    assert cli.main(["train", "--dry-run"]) == 2
    assert "PODSCALE_PROCESS_ID='abc'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("leaf", "message"),
    [
        ("hello", r"batch\['name'\] is a Python str \('hello'\)"),
        (object(), r"batch\['name'\] is a Python object"),
        (np.array(["a"] * 8), r"batch\['name'\] is an array of <U1 \(strings or objects\)"),
        (np.array([None] * 8, dtype=object), r"batch\['name'\] is an array of object"),
    ],
    ids=["str", "object", "array of str", "array of objects"],
)
def test_a_batch_leaf_that_is_no_array_of_numbers_is_refused_by_its_path_before_tracing(leaf, message):

    def step(state, batch):
        return {"w": state["w"] - 0.1 * jnp.mean(batch["x"]) * state["w"]}, {}

    dp = podscale.data_parallel(step, podscale.make_mesh())
    with pytest.raises(ValueError, match=message + ".*encode strings as integer ids"):
        dp.place_state({"w": jnp.ones(4)}, {"x": jnp.ones((8, 2)), "name": leaf})


def test_library_arguments_that_mean_nothing_are_refused_or_warned_by_name():
    import warnings

    with pytest.raises(ValueError, match=r"make_mesh\(devices=\[\]\): no devices"):
        podscale.make_mesh(devices=[])

    def step(state, batch):
        return {"w": state["w"] - 0.1 * jnp.mean(batch) * state["w"]}, {}

    with pytest.raises(TypeError, match="donate_state='yes' is a str; give True or False"):
        podscale.data_parallel(step, podscale.make_mesh(), donate_state="yes")
    dp = podscale.data_parallel(step, podscale.make_mesh(), min_table_rows=16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dp.place_state({"w": jnp.ones(4)}, jnp.ones((8, 2)))
    assert any("min_table_rows=16: the step looks up no weight by rows" in str(w.message) for w in caught)


FLAG_CASES = [
    (["bench", "embedding", "--replicas", "3", "--dry-run"], "--replicas 3: bench embedding splits its global batch"),
    (["train", "--model", "dlrm", "--config", "tiny", "--target", "2"], "(model dlrm's auc) is a fraction"),
    (["train", "--model", "ssd", "--config", "tiny", "--target", "2"], "(model ssd's map) is a fraction"),
    (["train", "--precision", "float32", "--dry-run"], "--precision float32: model 'mlp' always computes in float32"),
    (["project", "--system", "a100", "--multi-axis", "ring", "--dry-run"], "--multi-axis ring: system a100 is gpu"),
    (["train", "--mllog", "/tmp/podscale-no-such-dir/", "--dry-run"], "names a folder (it ends in /)"),
    (["train", "--metrics-file", "/dev/full", "--dry-run"], "--metrics-file /dev/full: the file cannot be written"),
]


@pytest.mark.parametrize(("args", "message"), FLAG_CASES, ids=[" ".join(a[:4]) for a, _ in FLAG_CASES])
def test_flags_that_mean_nothing_or_would_fail_later_are_refused_naming_the_flag(args, message, capsys):
    assert podscale_main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["train", "plan", "project", "verify"])
def test_every_commands_help_lists_every_workload_and_system(command, capsys):
    from podscale import workloads
    from podscale.compiled import systems

    assert podscale_main([command, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert all(name in text for name in workloads.NAMES), text
    if command == "project":
        assert all(name in text for name in systems.SYSTEMS)
