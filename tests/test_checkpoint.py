"""Checkpoints through the trainer, in-process (the kill-and-resume test is in test_cli.py)."""

import json
import os
import random
import re
import sys

import numpy as np
import pytest

from podscale.train.checkpoint import CheckpointError
from podscale.train.trainer import TrainConfig, train


def _config(workdir, **kw):
    base = dict(model="mlp", steps=6, checkpoint_every=3, workdir=str(workdir), progress=False)
    return TrainConfig(**{**base, **kw})


def _params(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def test_resume_continues_to_the_same_parameters(tmp_path):
    whole = train(_config(tmp_path / "a", export=str(tmp_path / "a.npz")))
    train(_config(tmp_path / "b", steps=3))
    resumed = train(_config(tmp_path / "b", resume=True, export=str(tmp_path / "b.npz")))
    assert resumed["resumed_from"] == 3 and resumed["steps"] == whole["steps"] == 6
    a, b = _params(tmp_path / "a.npz"), _params(tmp_path / "b.npz")
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert resumed["final_train_loss"] == whole["final_train_loss"]


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        train(_config(tmp_path, resume=True))


def test_existing_checkpoints_are_not_overwritten_without_resume(tmp_path):
    train(_config(tmp_path, steps=3))
    with pytest.raises(ValueError, match="already holds checkpoints.*--resume"):
        train(_config(tmp_path))


def test_corrupt_checkpoint_is_a_clear_error(tmp_path):
    train(_config(tmp_path, steps=3))
    step_dir = tmp_path / "checkpoints" / "3"
    for root, _, files in os.walk(step_dir / "default"):
        for name in files:
            with open(os.path.join(root, name), "wb") as f:
                f.write(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=r"step 3 .* is (corrupt|damaged).*another --workdir"):
        train(_config(tmp_path, resume=True))


def test_partial_checkpoint_is_a_clear_error(tmp_path):
    train(_config(tmp_path, steps=3))
    data = tmp_path / "checkpoints" / "3" / "default" / "ocdbt.process_0"
    for root, _, files in os.walk(data):
        for name in files:
            os.remove(os.path.join(root, name))
    with pytest.raises(CheckpointError, match="step 3"):
        train(_config(tmp_path, resume=True))


def test_an_unfinished_save_is_ignored_and_the_last_good_step_resumes(tmp_path):
    train(_config(tmp_path, steps=3))
    (tmp_path / "checkpoints" / "6.orbax-checkpoint-tmp-1234").mkdir()  # a save killed midway
    summary = train(_config(tmp_path, resume=True))
    assert summary["resumed_from"] == 3 and summary["steps"] == 6


def test_the_check_before_a_run_reads_the_steps_without_a_checkpoint_manager(tmp_path, monkeypatch):
    """The check of ``--workdir`` before a run enters no orbax barrier: a ``CheckpointManager``
    enters one as it is made, and made only where the folder already existed, it put a process
    that found the folder a moment after process 0 made it one barrier ahead of the others (a
    two-process run hung at its first step). It finds the latest finalized step all the same."""
    import orbax.checkpoint as ocp

    from podscale.train.resume import check_checkpoints

    train(_config(tmp_path, steps=3))
    (tmp_path / "checkpoints" / "6.orbax-checkpoint-tmp-1234").mkdir()  # a save killed midway
    (tmp_path / "checkpoints" / "backup_500").mkdir()  # not a step of podscale's (orbax's legacy names)

    def refuse(*a, **k):
        raise AssertionError("a CheckpointManager was made")

    monkeypatch.setattr(ocp.CheckpointManager, "__init__", refuse)
    assert check_checkpoints(_config(tmp_path, resume=True)) == 3
    with pytest.raises(ValueError, match="already holds checkpoints"):
        check_checkpoints(_config(tmp_path))
    assert check_checkpoints(_config(tmp_path / "new")) is None


def test_resuming_a_finished_run_says_to_raise_steps(tmp_path):
    train(_config(tmp_path, steps=3))
    with pytest.raises(ValueError, match="already at step 3.*larger --steps"):
        train(_config(tmp_path, steps=3, resume=True))


def test_bad_checkpoint_and_eval_settings_name_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--checkpoint-every must be at least 1"):
        _config(tmp_path, checkpoint_every=0)
    with pytest.raises(ValueError, match="--eval-batch-size must be at least 1"):
        _config(tmp_path, eval_batch_size=0)


def test_a_non_finite_loss_stops_the_run_naming_the_step_and_never_saves_it(tmp_path):
    from podscale.train.checkpoint import Checkpointer
    from podscale.train.saving import NonFiniteError

    # SGD at 1e4 on the small MLP overflows within a few steps.
    config = _config(tmp_path / "run", optimizer="sgd", learning_rate=1e4, steps=40, checkpoint_every=1)
    with pytest.raises(NonFiniteError, match=r"step \d+: the training loss is (nan|inf)") as err:
        train(config)
    bad = int(str(err.value).split(":")[0].removeprefix("step "))
    ckpt = Checkpointer(str(tmp_path / "run" / "checkpoints"), 1)
    saved = ckpt.saved_steps()
    assert saved and max(saved) < bad  # the step whose loss was not finite was not saved
    assert f"the last checkpoint, step {max(saved)}, is kept" in str(err.value)
    import jax

    from podscale.train.saving import _all_finite

    restored = ckpt._manager.restore(max(saved))  # what --resume would load: every value finite
    assert bool(_all_finite(jax.tree.map(np.asarray, restored)))


@pytest.mark.parametrize(
    ("change", "flag"),
    [
        (dict(seed=1), "--seed 0"),
        (dict(batch_size=32), "--batch-size 64"),
        (dict(model="cnn"), "--model mlp"),
        (dict(optimizer="sgd"), "--optimizer adam"),
        (dict(learning_rate=0.1), "--learning-rate 0.001"),
        (dict(data="digits"), "--data synthetic"),
    ],
)
def test_resume_refuses_another_run_naming_the_field(tmp_path, change, flag):
    train(_config(tmp_path, steps=3))
    with pytest.raises(ValueError, match=f"was started with {flag}, this one asks for"):
        train(_config(tmp_path, resume=True, **change))


def test_resume_may_change_steps_mesh_and_eval(tmp_path):
    train(_config(tmp_path, steps=3))
    out = train(_config(tmp_path, resume=True, steps=6, mesh=(4, 2), eval_every=2, checkpoint_every=2))
    assert out["resumed_from"] == 3 and out["steps"] == 6


def _largest_file(folder):
    sizes = [
        (os.path.getsize(os.path.join(r, f)), os.path.join(r, f)) for r, _, files in os.walk(folder) for f in files
    ]
    return max(sizes)[1]


_ZSTD_FRAME = bytes.fromhex("28b52ffd")


def _zstd_blocks(data, at):
    """The (start, end) of each raw or compressed block's content in the zstd frame at ``at``
    (RFC 8878: frame header, then 3-byte block headers), or None where these bytes are no frame."""
    descriptor = data[at + 4]
    single, dictionary, size = (descriptor >> 5) & 1, descriptor & 3, descriptor >> 6
    pos = at + 5 + (1 - single) + (0, 1, 2, 4)[dictionary] + (single, 2, 4, 8)[size]
    blocks = []
    while pos + 3 <= len(data):
        header = int.from_bytes(data[pos : pos + 3], "little")
        kind, length = (header >> 1) & 3, header >> 3
        end = pos + 3 + (1 if kind == 1 else length)
        if kind == 3 or end > len(data):
            return None
        if kind != 1 and length:
            blocks.append((pos + 3, end))
        pos = end
        if header & 1:  # the frame's last block
            return blocks
    return None


def _array_chunks(path):
    """(start, end) of the largest block of every zstd frame in ``path``: the stored arrays'
    chunks. Damage goes into each of them, since the file may also hold frames no restore reads
    (a b-tree node or chunk that a later commit of the same save superseded): a run under load
    once restored a step whose file had two flipped bits in such a frame, unchanged."""
    data = open(path, "rb").read()
    frames = [_zstd_blocks(data, m.start()) for m in re.finditer(re.escape(_ZSTD_FRAME), data)]
    chunks = [max(blocks, key=lambda b: b[1] - b[0]) for blocks in frames if blocks]
    assert chunks, f"{path}: expected zstd-compressed array chunks, found none"
    return chunks


def _flip_bits(path, bits, seed=0):
    """``bits`` flipped bits inside each array chunk's stored bytes."""
    data, rng = bytearray(open(path, "rb").read()), random.Random(seed)
    for start, end in _array_chunks(path):
        for _ in range(bits):
            data[rng.randrange(start, end)] ^= 1 << rng.randrange(8)
    open(path, "wb").write(data)


def _scribble(path, count, at):
    """Overwrites ``count`` bytes of each array chunk from ``at`` (a fraction of its length) with
    noise; ``at=0`` from the frame's first byte (its header)."""
    data, rng = bytearray(open(path, "rb").read()), random.Random(1)
    for start, end in _array_chunks(path):
        first = data.rfind(_ZSTD_FRAME, 0, start) if at == 0 else start + int((end - start) * at)
        last = min(first + count, end)
        data[first:last] = bytes(rng.randrange(256) for _ in range(last - first))
    open(path, "wb").write(data)


# The ways a stored array chunk changes after the save: a couple of flipped bits (orbax then
# restores other values without a word), many bytes of noise in its middle, and its start (the
# compressed frame's header, which orbax cannot decode at all).
DAMAGE = {
    "2 flipped bits": lambda path: _flip_bits(path, 2),
    "2 flipped bits, another place": lambda path: _flip_bits(path, 2, seed=7),
    "4 KiB of noise": lambda path: _scribble(path, 4096, at=0.4),
    "its first bytes": lambda path: _scribble(path, 64, at=0.0),
}
LEAF = r"(leaf|leaves) \.(params|opt_state|batch_stats|step)"


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_checkpoint_is_refused_naming_the_step_and_the_leaf(tmp_path, damage):
    train(_config(tmp_path, steps=6))
    DAMAGE[damage](_largest_file(tmp_path / "checkpoints" / "6"))
    with pytest.raises(
        CheckpointError, match=rf"checkpoint step 6 in .* is damaged: {LEAF}.*--resume-fallback.*step 3"
    ):
        train(_config(tmp_path, resume=True, steps=9))


@pytest.mark.parametrize("damage", ["2 flipped bits", "4 KiB of noise"])
def test_resume_fallback_skips_a_damaged_step_and_the_run_continues_exactly(tmp_path, damage, capfd):
    whole = train(_config(tmp_path / "whole", steps=9, export=str(tmp_path / "whole.npz")))
    run = tmp_path / "run"
    train(_config(run, steps=6))
    DAMAGE[damage](_largest_file(run / "checkpoints" / "6"))
    capfd.readouterr()
    out = train(_config(run, resume=True, resume_fallback=True, steps=9, export=str(tmp_path / "run.npz")))
    err = capfd.readouterr().err
    assert out["resumed_from"] == 3 and out["steps"] == 9
    assert "skipped checkpoint step 6: damaged" in err and "resuming from step 3" in err
    assert (run / "checkpoints" / "6.damaged").is_dir()  # kept aside, not deleted; step 6 saved anew
    a, b = _params(tmp_path / "whole.npz"), _params(tmp_path / "run.npz")
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert out["final_train_loss"] == whole["final_train_loss"]
    again = train(_config(run, resume=True, steps=12))  # the new step 9 verifies
    assert again["resumed_from"] == 9


def test_resume_fallback_with_no_intact_step_left_is_a_clear_error(tmp_path):
    train(_config(tmp_path, steps=3))
    _flip_bits(_largest_file(tmp_path / "checkpoints" / "3"), 2)
    with pytest.raises(CheckpointError, match=r"step 3 .* is damaged.*No earlier step"):
        train(_config(tmp_path, resume=True, steps=6))
    with pytest.raises(CheckpointError, match=rf"no intact checkpoint .*step 3: damaged: {LEAF}"):
        train(_config(tmp_path, resume=True, resume_fallback=True, steps=6))


def test_resume_fallback_needs_resume(tmp_path):
    with pytest.raises(ValueError, match="--resume-fallback goes with --resume"):
        _config(tmp_path, resume_fallback=True)


def _step_metadata(step_dir):
    path = os.path.join(step_dir, "_CHECKPOINT_METADATA")
    with open(path) as f:
        return path, json.load(f)


def test_every_leaf_has_a_checksum_saved_inside_its_step(tmp_path):
    train(_config(tmp_path, steps=3))
    _, meta = _step_metadata(tmp_path / "checkpoints" / "3")
    sums = meta["custom_metadata"]["podscale_checksums"]
    assert ".step" in sums and any(k.startswith(".params[") for k in sums) and any(".opt_state" in k for k in sums)
    assert all(len(v["fingerprint"]) == 16 and "dtype" in v for v in sums.values())
    layout = meta["custom_metadata"]["podscale_layout"]
    assert set(layout) == set(sums) and all(set(v) == {"saved", "shape"} for v in layout.values())


def test_damaged_checksums_are_refused(tmp_path):
    train(_config(tmp_path, steps=3))
    path, meta = _step_metadata(tmp_path / "checkpoints" / "3")
    leaf = next(k for k in meta["custom_metadata"]["podscale_checksums"] if k.startswith(".params"))
    meta["custom_metadata"]["podscale_checksums"][leaf]["fingerprint"] = "0" * 16
    with open(path, "w") as f:
        json.dump(meta, f)
    with pytest.raises(CheckpointError, match=r"step 3 .* is damaged: leaf " + re.escape(leaf)):
        train(_config(tmp_path, resume=True))


def test_every_checkpoint_saves_its_data_position_and_each_step_records_its_examples(tmp_path):
    """The data position, the global index of the next example to feed, is saved with each step
    (beside the checksums); ``metrics.jsonl`` records the examples each step fed, ``[first, last)``."""
    train(_config(tmp_path))
    for step in (3, 6):
        _, meta = _step_metadata(tmp_path / "checkpoints" / str(step))
        assert meta["custom_metadata"]["podscale_run"] == {"data": {"next_example": 64 * step, "global_batch": 64}}
    with open(tmp_path / "metrics.jsonl") as f:
        records = [r for r in map(json.loads, f) if "examples" in r]
    assert [(r["step"], r["examples"]) for r in records] == [(s + 1, [64 * s, 64 * (s + 1)]) for s in range(6)]


def _set_data_position(step_dir, position):
    path, meta = _step_metadata(step_dir)
    if position is None:  # as an older podscale saved it
        del meta["custom_metadata"]["podscale_run"]
    else:
        meta["custom_metadata"]["podscale_run"]["data"].update(position)
    with open(path, "w") as f:
        json.dump(meta, f)


def test_a_checkpoint_whose_data_position_is_not_its_steps_is_refused(tmp_path):
    train(_config(tmp_path, steps=3))
    _set_data_position(tmp_path / "checkpoints" / "3", {"next_example": 100})
    with pytest.raises(ValueError, match=r"step 3 .* saved its data position as example 100, but step 3 at a global "):
        train(_config(tmp_path, resume=True))


def test_resume_at_another_global_batch_is_refused_naming_both(tmp_path):
    """run_config.json refuses another --batch-size first; the checkpoint's own position too."""
    train(_config(tmp_path, steps=3))
    with open(tmp_path / "run_config.json") as f:
        recorded = json.load(f)
    with open(tmp_path / "run_config.json", "w") as f:
        json.dump({**recorded, "batch_size": 32}, f)
    with pytest.raises(
        ValueError,
        match=r"step 3 in .* global batch of 64 examples per step \(its next example: 192\); this run's global "
        r"batch is 32, which would start at example 96 .* Resume with --batch-size 64",
    ):
        train(_config(tmp_path, resume=True, batch_size=32))


def test_a_checkpoint_saved_without_its_data_position_still_resumes(tmp_path):
    train(_config(tmp_path, steps=3))
    _set_data_position(tmp_path / "checkpoints" / "3", None)
    assert train(_config(tmp_path, resume=True))["resumed_from"] == 3


@pytest.mark.parametrize("how", ["removed", "unreadable", "whole file removed"])
def test_a_checkpoint_whose_checksums_are_gone_is_refused_as_damaged(tmp_path, how):
    """Every save writes them atomically with the step: without them a step cannot be verified."""
    train(_config(tmp_path, steps=3))
    path, meta = _step_metadata(tmp_path / "checkpoints" / "3")
    if how == "removed":
        del meta["custom_metadata"]["podscale_checksums"]
        with open(path, "w") as f:
            json.dump(meta, f)
    elif how == "unreadable":
        with open(path, "w") as f:
            f.write("{garbage")
    else:
        os.remove(path)
    with pytest.raises(CheckpointError, match=r"step 3 .* is damaged: the checksums saved with it are missing"):
        train(_config(tmp_path, resume=True))


@pytest.mark.parametrize("damage", ["2 flipped bits", "its first bytes"])
def test_a_damaged_checkpoint_on_the_command_line_is_exit_2_and_one_json_error(tmp_path, damage):
    """No traceback either: orbax's other failed reads of the step would print theirs at exit."""
    import subprocess
    import sys

    train(_config(tmp_path, steps=3))
    DAMAGE[damage](_largest_file(tmp_path / "checkpoints" / "3"))
    args = ["train", "--model", "mlp", "--steps", "4", "--workdir", str(tmp_path), "--resume", "--json"]
    proc = subprocess.run([sys.executable, "-m", "podscale.cli", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    out = json.loads(proc.stdout)
    assert out["exit_code"] == 2 and re.search(rf"checkpoint step 3 in .* is damaged: {LEAF}", out["error"])
    assert "Traceback" not in proc.stderr and "podscale: error: checkpoint step 3" in proc.stderr


def test_orbax_reads_that_fail_after_the_damage_is_reported_print_nothing(caplog, monkeypatch):
    """Reads still running when a restore fails finish later, in orbax's threads, and each would
    print a traceback (the rare one under load): a failed read's task is logged by asyncio when
    collected, its coroutine is unraisable at exit, and a read that succeeds hands its result to
    orbax's closed event loop ("Event loop is closed", printed bare by the reader thread). While a
    restore runs, and after one failed, those are dropped; any other failure is still reported, and
    so is an uncaught exception through orbax's code in the main thread."""
    import asyncio
    import gc
    import logging
    import types

    from podscale.train import checkpoint

    def raising_in(filename, function="read"):
        scope = {}
        source = f"def {function}():\n    raise RuntimeError('Event loop is closed')\n"
        exec(compile(source, filename, "exec"), scope)  # noqa: S102
        try:
            scope[function]()
        except RuntimeError as e:
            return e

    def leave_a_failed_task(filename):
        scope = {}
        exec(compile("async def read():\n    raise OSError('damaged chunk')\n", filename, "exec"), scope)  # noqa: S102

        async def main():
            task = asyncio.get_running_loop().create_task(scope["read"]())
            await asyncio.sleep(0)
            del task

        asyncio.run(main())
        gc.collect()

    def printed(error, capsys_hook):
        seen = []
        capsys_hook(seen, error)
        return seen

    def leave_a_failed_future(message):
        """tensorstore's read sets its error on the future: no orbax frame, the step's folder named."""

        async def main():
            asyncio.get_running_loop().create_future().set_exception(ValueError(message))

        asyncio.run(main())
        gc.collect()

    gc.collect()  # what earlier tests left is collected before this one listens
    failed = f"{os.sep}run{os.sep}checkpoints{os.sep}6{os.sep}"
    monkeypatch.setattr(checkpoint, "_failed_steps", {failed})
    orbax_file = f"{os.sep}site-packages{os.sep}orbax{os.sep}checkpoint{os.sep}serialization.py"
    late_loop = raising_in(f"{os.sep}asyncio{os.sep}base_events.py", "call_soon_threadsafe")
    user_error = raising_in(f"{os.sep}elsewhere{os.sep}user_code.py")
    shown = []
    original = sys.excepthook, sys.unraisablehook
    sys.excepthook = lambda kind, value, tb: shown.append(("except", value))
    sys.unraisablehook = lambda u: shown.append(("unraisable", u.exc_value))
    try:
        checkpoint._quiet_late_reads(True)  # what a restore does; kept after it fails
        with caplog.at_level(logging.ERROR):
            leave_a_failed_task(orbax_file)
            leave_a_failed_future(f'Error reading "w" in OCDBT database at local file "{failed}default/"')
            sys.excepthook(RuntimeError, late_loop, late_loop.__traceback__)
            orbax_error = raising_in(orbax_file)
            unraisable = types.SimpleNamespace(
                exc_type=RuntimeError, exc_value=orbax_error, exc_traceback=orbax_error.__traceback__
            )
            sys.unraisablehook(unraisable)
            assert not shown and not [r for r in caplog.records if "never retrieved" in r.getMessage()]
            sys.excepthook(RuntimeError, orbax_error, orbax_error.__traceback__)  # uncaught in the main thread
            sys.excepthook(RuntimeError, user_error, user_error.__traceback__)
            leave_a_failed_task(f"{os.sep}elsewhere{os.sep}user_code.py")
            leave_a_failed_future(f'Error reading "w" at local file "{os.sep}run{os.sep}checkpoints{os.sep}60{os.sep}"')
            assert shown == [("except", orbax_error), ("except", user_error)]
            assert len([r for r in caplog.records if "never retrieved" in r.getMessage()]) == 2
        checkpoint._quiet_late_reads(False)  # after a restore that succeeded: the hooks are put back
        assert (sys.excepthook, sys.unraisablehook) != original and sys.excepthook is not checkpoint._excepthook
    finally:
        checkpoint._quiet_late_reads(False)
        sys.excepthook, sys.unraisablehook = original


def test_a_recipe_resumed_to_more_steps_keeps_its_schedule_and_equals_a_straight_run(tmp_path):
    """A recipe's learning-rate schedule spans ``--schedule-steps`` (default: the first run's
    ``--steps``), recorded with the run and kept on resume: a run started to stop early and
    resumed to its horizon is bit for bit the straight run; past the horizon is refused by name."""
    base = dict(model="dlrm", config="tiny", checkpoint_every=2)
    whole = train(_config(tmp_path / "whole", steps=4, export=str(tmp_path / "whole.npz"), **base))
    assert whole["schedule_steps"] == 4
    train(_config(tmp_path / "run", steps=2, schedule_steps=4, **base))
    with pytest.raises(ValueError, match=r"--steps 6: .* schedule over 4 steps \(--schedule-steps 4"):
        train(_config(tmp_path / "run", steps=6, resume=True, **base))
    with pytest.raises(ValueError, match="started with --schedule-steps 4 .*, this one asks for 6"):
        train(_config(tmp_path / "run", steps=4, schedule_steps=6, resume=True, **base))
    out = train(_config(tmp_path / "run", steps=4, resume=True, export=str(tmp_path / "run.npz"), **base))
    assert out["resumed_from"] == 2 and out["schedule_steps"] == 4
    a, b = _params(tmp_path / "whole.npz"), _params(tmp_path / "run.npz")
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_a_dry_run_resume_reads_the_checksums_and_says_the_step_the_run_would_resume_from(tmp_path, capfd, caplog):
    """``--resume --dry-run`` verifies the step it names as the run's restore does: a damaged newest
    step is refused as the run refuses it, and with ``--resume-fallback`` the step named is the one
    the run resumes from; nothing is set aside."""
    from helpers import podscale_main

    train(_config(tmp_path, steps=6))
    args = ["train", "--model", "mlp", "--steps", "9", "--workdir", str(tmp_path), "--resume", "--dry-run"]
    capfd.readouterr()
    assert podscale_main(args) == 0
    assert "resume_from 6)" in capfd.readouterr().out
    _flip_bits(_largest_file(tmp_path / "checkpoints" / "6"), 2)
    assert podscale_main(args) == 2
    out = capfd.readouterr()
    assert re.search(rf"podscale: error: checkpoint step 6 in .* is damaged: {LEAF}", out.err)
    assert podscale_main([*args, "--resume-fallback"]) == 0
    out = capfd.readouterr()
    assert "resume_from 3)" in out.out
    assert "the run would skip checkpoint step 6: damaged" in out.err
    assert (tmp_path / "checkpoints" / "6").is_dir() and not (tmp_path / "checkpoints" / "6.damaged").exists()
    # orbax's "Item "default" was found in the checkpoint, but could not be restored", on every read
    # of a step's metadata by a manager that was not told its item's handler: not once
    assert not [r for r in caplog.records if "could not be restored" in r.getMessage()]


def test_a_disk_that_fills_during_a_save_is_exit_2_one_line_and_the_earlier_steps_resume(tmp_path):
    """A full disk, as the kernel says it (a file-size limit, RLIMIT_FSIZE: every write past it
    fails, as on a full disk): one podscale line naming the step, the cause and the intact steps,
    exit code 2, no traceback (not the TensorBoard writer's nor orbax's writes still in flight);
    the steps saved before resume."""
    import subprocess

    train(_config(tmp_path, steps=3, export=str(tmp_path / "3.npz")))
    # Half the largest leaf: orbax writes a leaf whole into one data file, however its writes are
    # split between files (that split varies from run to run), so saving that leaf must fail; every
    # other file the run writes (metadata, logs, events) stays under it.
    limit = max(a.nbytes for a in _params(tmp_path / "3.npz").values()) // 2
    data = [p for p in tmp_path.rglob("*") if p.suffix == ".npz" or "d" in p.relative_to(tmp_path).parts[:-1]]
    small = [p for p in tmp_path.rglob("*") if p.is_file() and p not in data]
    assert max(p.stat().st_size for p in small) < limit, "the limit must fail the data, not a log or metadata"
    # A write past the limit fails (EFBIG) instead of raising SIGXFSZ; set in the child itself.
    limited = (
        "import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); "
        "os.execv(sys.executable, [sys.executable, '-m', 'podscale.cli', *sys.argv[1:]])"
    )
    args = ["train", "--model", "mlp", "--steps", "6", "--checkpoint-every", "3", "--workdir", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, "-c", limited, *args, "--resume", "--no-progress"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("podscale: error:")]
    assert errors == [
        f"podscale: error: checkpoint step 6 could not be written in {tmp_path / 'checkpoints'}: File too large; the "
        "steps saved before it are intact (latest 3). Free space on its disk, then continue with --resume"
    ], proc.stderr
    assert train(_config(tmp_path, resume=True))["resumed_from"] == 3
