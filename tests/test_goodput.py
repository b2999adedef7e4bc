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


def _events(tmp_path, steps):
    from podscale.train.board import Board

    b = Board(str(tmp_path))
    for step in steps:
        b.scalar("train/loss", float(step), step)
    b.close()
    (path,) = tmp_path.glob("events.out.tfevents.*")
    return path


def test_reading_event_files_skips_a_torn_last_record_and_names_what_it_cannot_read(tmp_path):
    """As TensorBoard does: a torn last record (a kill or a full disk mid-write) is skipped; other
    files in the folder are left alone; a damaged record before the end, an event-file name on a
    file that is none, or a missing folder is a ValueError naming the path."""
    from podscale.train.board import read

    path = _events(tmp_path, [1, 2, 3])
    whole = path.read_bytes()
    (tmp_path / "notes.txt").write_text("not an event file")
    assert [s for s, _ in read(str(tmp_path))["train/loss"]] == [1, 2, 3]
    for cut in (1, 5, 13):  # inside the last record's CRC, its payload, its length
        path.write_bytes(whole[:-cut])
        assert [s for s, _ in read(str(tmp_path))["train/loss"]] == [1, 2], cut
    stray = tmp_path / "events.out.tfevents.stray"
    stray.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00abcd\xff\xff\xff\xff\xffabcd" * 2)
    with pytest.raises(ValueError, match=f"{stray}: the record at byte 0 is damaged"):
        read(str(tmp_path))
    with pytest.raises(ValueError, match=f"{tmp_path / 'missing'}: no such folder of TensorBoard event files"):
        read(str(tmp_path / "missing"))


def test_the_board_is_flushed_at_each_checkpoint_and_a_write_the_disk_refuses_names_the_folder(tmp_path, monkeypatch):
    """After ``kill -9`` the TensorBoard points up to the last checkpoint are on disk, as
    metrics.jsonl's are; a writer whose disk is full is one WriteError naming its folder, and
    closing it afterwards does not fail again."""
    import errno

    from podscale.train import board, trainer
    from podscale.train.config import WriteError
    from podscale.train.trainer import TrainConfig, train

    seen = {}
    save = trainer._save

    def spy(ckpt, step, *args, **kwargs):
        seen[step] = [s for s, _ in board.read(str(tmp_path / "tensorboard")).get("train/loss", [])]
        return save(ckpt, step, *args, **kwargs)

    monkeypatch.setattr(trainer, "_save", spy)
    train(TrainConfig(model="mlp", steps=4, checkpoint_every=2, workdir=str(tmp_path), progress=False))
    assert seen[2] == [1, 2] and seen[4][:4] == [1, 2, 3, 4]

    b = board.Board(str(tmp_path / "full"))

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(b.writer, "write_event", full)
    with pytest.raises(WriteError, match=r"TensorBoard events in .*full: cannot be written \(No space left"):
        b.scalar("train/loss", 1.0, 1)
    b.close()  # the writer is gone: nothing more to fail
