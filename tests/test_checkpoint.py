"""Checkpoints through the trainer, in-process (the kill-and-resume test is in test_cli.py)."""

import os

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
    with pytest.raises(CheckpointError, match=r"step 3 .* is corrupt.*Delete"):
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
    from podscale.train.trainer import NonFiniteError

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

    from podscale.train.trainer import _all_finite

    restored = ckpt._manager.restore(max(saved))  # what --resume would load: every value finite
    assert bool(_all_finite(jax.tree.map(np.asarray, restored)))


@pytest.mark.parametrize(
    ("change", "flag"),
    [
        (dict(seed=1), "--seed 0"),
        (dict(batch_size=32), "--batch-size 64"),
        (dict(model="cnn"), "--model mlp"),
        (dict(optimizer="sgd"), "--optimizer None"),
        (dict(learning_rate=0.1), "--learning-rate None"),
        (dict(data="digits"), "--data None"),
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
