"""Checkpoints hold the state in the layout it is stored in (nothing gathered to save) and restore
onto any other placement: another replica count, update, model axis or mesh. The values restored
are the values saved, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from podscale import data_parallel, make_mesh
from podscale.train.checkpoint import Checkpointer
from podscale.train.saving import CheckpointForm
from podscale.train.tasks import make_task, make_train_step


def _task(model="transformer"):
    task = make_task(model, "synthetic", seed=0)
    tx = optax.adamw(1e-3)
    batch = task.train_data.get(np.arange(16))
    return task, tx, batch


def _dp(task, tx, mesh, **strategy):
    return data_parallel(make_train_step(task, tx), mesh, donate_state=False, min_shard_size=64, **strategy)


PLACEMENTS = {
    # name: (mesh shape, devices used, strategy)
    "8 replicas, sharded": ((8,), 8, {"weight_update": "sharded"}),
    "4 replicas, sharded": ((4,), 4, {"weight_update": "sharded"}),
    "2 replicas, replicated": ((2,), 2, {"weight_update": "replicated"}),
    "4x2, model axis of 2, sharded": (
        (4, 2),
        8,
        {"model_parallel": 2, "rules": "transformer", "weight_update": "sharded"},
    ),
    "2x4, model axis of 4, replicated": ((2, 4), 8, {"model_parallel": 4, "rules": "transformer"}),
    "8 replicas, fsdp": ((8,), 8, {"weight_update": "fsdp"}),
    "2 replicas, fsdp": ((2,), 2, {"weight_update": "fsdp"}),
    "4x2, model axis of 2, fsdp": ((4, 2), 8, {"model_parallel": 2, "rules": "transformer", "weight_update": "fsdp"}),
    "2x4, fsdp over y (data x FSDP)": ((2, 4), 8, {"weight_update": "fsdp", "fsdp_axes": ("y",)}),
}
CHAINS = [  # the data axes alone on the MLP (quicker to trace), a model axis on the Transformer
    ("8 replicas, sharded", "4 replicas, sharded", "2 replicas, replicated"),
    ("4x2, model axis of 2, sharded", "2x4, model axis of 4, replicated", "8 replicas, sharded"),
    # flat chunks into chunks per model partition, then those read back as they are
    ("8 replicas, sharded", "4x2, model axis of 2, sharded", "4x2, model axis of 2, sharded"),
    # FSDP chunks (each leaf along its own dim) into flat chunks, a replicated state, and back;
    # then 4 chunks copied over a second data axis (data x FSDP)
    ("8 replicas, fsdp", "4 replicas, sharded", "2 replicas, fsdp", "2x4, fsdp over y (data x FSDP)"),
    ("4x2, model axis of 2, fsdp", "8 replicas, fsdp", "2x4, model axis of 4, replicated"),
]


def _placed(name, task, tx, batch):
    shape, count, strategy = PLACEMENTS[name]
    return _dp(task, tx, make_mesh(shape, devices=jax.devices()[:count]), **strategy)


def _assert_bits(a, b):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape and x.dtype == y.dtype, jax.tree_util.keystr(path)
        assert x.tobytes() == y.tobytes(), f"{jax.tree_util.keystr(path)} differs after the restore"


@pytest.mark.parametrize("chain", CHAINS, ids=[" -> ".join(c) for c in CHAINS])
def test_a_checkpoint_restores_bit_for_bit_onto_another_placement(tmp_path, chain):
    """The first placement of the chain trains a step and saves; each next one restores what the
    previous saved and saves it again: the restored state (gathered) is the saved one, bit for bit."""
    task, tx, batch = _task("transformer" if any("model" in name for name in chain) else "mlp")
    state = task.init_state(jax.random.key(0), tx)
    ckpt = Checkpointer(str(tmp_path), every=1)
    for step, name in enumerate(chain, start=1):
        dp = _placed(name, task, tx, batch)
        form = CheckpointForm(dp.prepare(state, batch).state)
        if step == 1:
            stored = dp.place_state(state, batch)
        else:
            restored_step, stored = ckpt.restore(form)  # read as saved, converted into this placement's
            assert restored_step == step - 1
            _assert_bits(dp.gather_state(stored), state)  # what the previous placement saved
        if step == 1:  # one step: the optimizer's moments hold values, not the init's zeros
            stored, _ = dp(stored, batch)
        state = dp.gather_state(stored)
        assert ckpt.maybe_save(step, stored, form.save_form)
        ckpt.close()  # waits for the async write, as the trainer's final save does
        ckpt = Checkpointer(str(tmp_path), every=1)
    assert ckpt.latest_step() == len(chain)


def test_a_save_writes_the_stored_state_as_it_is():
    """Nothing is gathered or reshaped to save: the saved form is the stored state itself (a
    sharded update's flat chunks, a rule's split leaves, each device's own piece), and the step's
    metadata says each leaf's saved and own shapes, which a restore reads back."""
    task, tx, batch = _task()
    state = task.init_state(jax.random.key(0), tx)
    dp = _placed("4x2, model axis of 2, sharded", task, tx, batch)
    stored = dp.place_state(state, batch)
    form = CheckpointForm(dp.placement.state)
    assert form.save_form(stored) is stored
    chunked = [leaf for leaf in dp.placement.state.leaves if leaf.sharded]
    split = [leaf for leaf in dp.placement.state.leaves if leaf.model_dim is not None]
    assert chunked and split
    layout = form.saved_layout()
    by_partition = [leaf for leaf in chunked if leaf.stored.by is not None]
    assert by_partition  # a split weight's optimizer state: chunked per model partition, which the metadata says
    for leaf, x in zip(dp.placement.state.leaves, jax.tree.leaves(stored), strict=True):
        chunks = {"chunks": {"replicas": 4, "partitions": 2, "dim": leaf.stored.by.dim}} if leaf in by_partition else {}
        assert layout[leaf.path] == {"saved": list(x.shape), "shape": list(leaf.shape), **chunks}
        if leaf.sharded or leaf.model_dim is not None:
            assert max(s.data.size for s in x.addressable_shards) < x.size, f"{leaf.path}: a device holds it whole"


def test_the_fingerprints_are_the_whole_values_whatever_the_sharding():
    """A leaf's fingerprint does not depend on how it is sharded, and a flipped bit changes it."""
    from podscale.train.checkpoint import checksums

    x = {"w": jnp.arange(64 * 8, dtype=jnp.float32).reshape(64, 8) / 7, "b": jnp.ones((3,), jnp.bfloat16)}
    mesh = make_mesh()
    spread = jax.device_put(x, {"w": jax.NamedSharding(mesh, jax.P("data")), "b": jax.NamedSharding(mesh, jax.P())})
    assert checksums(x) == checksums(spread)
    flipped = np.asarray(x["w"]).copy()
    flipped.view(np.uint32)[5, 3] ^= 1 << 17
    assert checksums({**x, "w": jnp.asarray(flipped)})["['w']"] != checksums(x)["['w']"]


def test_a_step_saved_before_per_shard_checkpoints_still_restores_and_is_verified(tmp_path):
    """Before this layout, podscale saved every leaf whole in its own shape, with a SHA-256 of
    each: such a step restores onto a sharded placement, checked against those checksums."""
    import orbax.checkpoint as ocp

    from podscale.train.checkpoint import CHECKSUMS, CheckpointError, _legacy_checksums

    task, tx, batch = _task()
    host = jax.device_get(task.init_state(jax.random.key(0), tx))
    manager = ocp.CheckpointManager(
        str(tmp_path), options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    )
    sums = _legacy_checksums(host)
    manager.save(3, args=ocp.args.StandardSave(host), custom_metadata={CHECKSUMS: sums})
    manager.close()
    dp = _placed("8 replicas, sharded", task, tx, batch)
    form = CheckpointForm(dp.prepare(host, batch).state)
    step, stored = Checkpointer(str(tmp_path), every=1).restore(form)
    assert step == 3
    _assert_bits(dp.gather_state(stored), host)
    # and verified: a changed SHA-256 is refused as damage
    meta = tmp_path / "3" / "_CHECKPOINT_METADATA"
    text = meta.read_text()
    first = next(iter(sums.values()))["sha256"]
    meta.write_text(text.replace(first, "0" * 64, 1))
    with pytest.raises(CheckpointError, match="does not match the checksum"):
        Checkpointer(str(tmp_path), every=1).restore(form)


def test_an_fsdp_save_writes_each_device_s_chunks():
    """FSDP stores every leaf in its own shape, chunked along one of its dims: the saved form is the
    stored state itself, and no device holds a chunked leaf whole."""
    task, tx, batch = _task()
    state = task.init_state(jax.random.key(0), tx)
    dp = _placed("8 replicas, fsdp", task, tx, batch)
    stored = dp.place_state(state, batch)
    form = CheckpointForm(dp.placement.state)
    assert form.save_form(stored) is stored
    chunked = [leaf for leaf in dp.placement.state.leaves if leaf.chunked]
    assert chunked
    for leaf, x in zip(dp.placement.state.leaves, jax.tree.leaves(stored), strict=True):
        assert form.saved_layout()[leaf.path] == {"saved": list(leaf.shape), "shape": list(leaf.shape)}
        if leaf.chunked:
            assert {s.data.size for s in x.addressable_shards} == {x.size // 8}, leaf.path
