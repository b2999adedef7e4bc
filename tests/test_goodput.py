"""Goodput and MFU of a run: the parts of its wall time (in the summary, printed, in metrics.jsonl),
the steps a resumed run redoes, and MFU only where the device's peak is known."""

import json
import subprocess
import sys

import jax
import pytest

from podscale.train import goodput

PODSCALE = [sys.executable, "-m", "podscale.cli"]


def test_redone_steps_are_those_logged_past_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": s, "examples": [0, 1], "loss": 1.0} for s in range(1, 8)]
    lines += [{"step": 5, "eval": {"accuracy": 0.5}}, {"goodput": {"wall_s": 1.0}}]
    path.write_text("\n".join(map(json.dumps, lines)) + '\n{"step": 9, "exa')  # a line cut short by a kill
    assert goodput.redone_steps(str(path), 5) == 2
    assert goodput.redone_steps(str(path), 7) == 0
    assert goodput.redone_steps(str(tmp_path / "none.jsonl"), 5) == 0


def test_mfu_only_where_the_peak_is_known():
    cpu = goodput.mfu(1e9, 0.01, "cpu")
    assert cpu["mfu"] is None and "no peak FLOP/s is known for device kind 'cpu'" in cpu["mfu_note"]
    v4 = goodput.mfu(275e12 * 0.01 * 0.5, 0.01, "TPU v4")
    assert v4["mfu"] == pytest.approx(0.5) and "tpu-v4" in v4["mfu_note"]
    assert goodput.system_of("NVIDIA H100 80GB HBM3").name == "h100"
    assert goodput.system_of("TPU v5 lite").name == "tpu-v5e"
    assert goodput.system_of("TPU v3").device_peak("bf16") == pytest.approx(123e12 / 2)  # 2 devices per chip


def test_step_flops_are_read_from_the_compiled_module():
    import podscale
    from podscale.train.tasks import make_optimizer, make_task, make_train_step

    task = make_task("mlp")
    tx = make_optimizer("sgd", 0.1)
    batch = task.example_batch(16)
    state = task.init_state(jax.random.key(0), tx, batch)
    dp = podscale.data_parallel(make_train_step(task, tx), podscale.make_mesh(8))
    dp.prepare(state, batch)
    flops = goodput.step_flops(dp, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch))
    params = sum(x.size for x in jax.tree.leaves(state.params))
    assert 2 * params * 2 <= flops <= 20 * params * 2  # forward and backward of 2 rows per device, roughly


@pytest.mark.slow
def test_a_run_splits_its_wall_time_and_its_workdir_holds_tensorboard_events(tmp_path):
    """One run: its wall time's parts (summary, stderr, metrics.jsonl), no MFU on the CPU, and the
    TensorBoard event files (loss, learning rate, examples/s, evaluations, goodput) read back."""
    from podscale.train import board

    args = ["train", "--model", "mlp", "--steps", "6", "--eval-every", "3", "--checkpoint-every", "3"]
    proc = subprocess.run(
        [*PODSCALE, *args, "--learning-rate", "0.01", "--workdir", str(tmp_path), "--json", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout.strip().splitlines()[-1])["goodput"]
    parts = record["seconds"]
    assert set(parts) == set(goodput.PARTS)
    assert all(v >= 0 for v in parts.values())
    assert sum(parts.values()) == pytest.approx(record["wall_s"], rel=1e-6)
    assert parts["compilation"] > 0 and parts["checkpointing"] > 0 and parts["evaluation"] > 0
    assert record["goodput"] == pytest.approx(parts["training"] / record["wall_s"])
    assert record["mfu"] is None and "no peak" in record["mfu_note"]
    assert "goodput " in proc.stderr and "MFU: no peak FLOP/s is known" in proc.stderr  # --json: the lines on stderr
    with open(tmp_path / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert records[-1]["goodput"]["seconds"] == parts

    scalars = board.read(str(tmp_path / "tensorboard"))
    losses = [(r["step"], r["loss"]) for r in records if "examples" in r]
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([v for _, v in losses], rel=1e-6)
    assert scalars["train/learning_rate"] == [(s, pytest.approx(0.01)) for s in range(1, 7)]
    assert [s for s, _ in scalars["eval/accuracy"]] == [3, 6]
    assert len(scalars["train/examples_per_s"]) == 5 and all(v > 0 for _, v in scalars["train/examples_per_s"])
    assert scalars["goodput/fraction"] == [(6, pytest.approx(record["goodput"], rel=1e-6))]
    assert scalars["goodput/checkpointing_s"][0][1] == pytest.approx(parts["checkpointing"], rel=1e-6)
