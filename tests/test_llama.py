"""Llama 3.1 (podscale/workloads/llama3.py): the published architecture's pieces, the tiny model
under data parallelism, FSDP and FSDP x tensor against one device, and (slow) the tiny config
trained to its target through ``podscale train``."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import max_abs_diff, run_parallel, run_single

from podscale import Strategy, data_parallel, make_mesh, workloads
from podscale.parallel.tensor import RULES
from podscale.train.tasks import make_task, make_train_step
from podscale.workloads import llama3
from podscale.workloads.precision import FLOAT32


def test_rope_scaling_is_llama_3_1_s():
    """Wavelengths under 8192/4 positions kept, over 8192/1 divided by 8, the band between
    interpolated smoothly (HF ``_compute_llama3_parameters``)."""
    cfg = llama3.FULL_8B
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2) / cfg.head_dim)
    got = llama3.rope_frequencies(cfg)
    wavelength = 2 * math.pi / inv
    short, long = wavelength < 8192 / 4, wavelength > 8192
    assert short.any() and long.any() and (~short & ~long).any()
    np.testing.assert_allclose(got[short], inv[short])
    np.testing.assert_allclose(got[long], inv[long] / 8)
    band = got[~short & ~long]
    assert np.all((band <= inv[~short & ~long]) & (band >= inv[~short & ~long] / 8))
    assert np.all(np.diff(got) < 0)  # still ordered: the interpolation is continuous


def test_chunked_attention_equals_the_whole_and_is_causal():
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (2, 16, 2, 2, 8))
    k = jax.random.normal(kk, (2, 16, 2, 8))
    v = jax.random.normal(kv, (2, 16, 2, 8))
    whole = llama3.causal_attention(q, k, v, 0)
    np.testing.assert_allclose(llama3.causal_attention(q, k, v, 4), whole, rtol=1e-5, atol=1e-6)
    later = k.at[:, 9:].set(0.0), v.at[:, 9:].set(5.0)  # position 8 sees nothing after it
    np.testing.assert_allclose(llama3.causal_attention(q, *later, 4)[:, :9], whole[:, :9], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="attention_chunk=5 must divide the sequence length 16"):
        llama3.causal_attention(q, k, v, 5)


def test_the_loss_over_blocks_of_positions_equals_the_whole_sequence_s():
    """Output's blocks (loss_chunk) against the logits of the whole sequence at once."""
    cfg = llama3.TINY
    model = llama3.make_model(cfg, FLOAT32)
    tokens = jnp.asarray(llama3.CopyTokens(4, cfg.span, cfg.vocab_size).get(np.arange(4))["tokens"])
    variables = model.init(jax.random.key(0), tokens[:, :-1])
    loss, correct = model.apply(variables, tokens[:, :-1], tokens[:, 1:])
    logits = model.apply(variables, tokens[:, :-1])
    want = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    np.testing.assert_array_equal(correct, np.argmax(logits, -1) == tokens[:, 1:])
    assert cfg.loss_chunk < cfg.length  # the blocks are what ran


def test_the_two_sizes_share_the_tiny_model_and_the_rules_split_grouped_heads():
    small, large = workloads.get("llama3-8b"), workloads.get("llama3-70b")
    assert small.config("tiny") is large.config("tiny")
    assert RULES["llama3-8b"] is RULES["llama3-70b"]
    assert llama3.FULL_8B.kv_heads == llama3.FULL_70B.kv_heads == 8  # a tensor axis of up to 8
    with pytest.raises(ValueError, match="remat='some'"):
        llama3.LlamaConfig(**{**llama3.TINY.__dict__, "remat": "some"})


STRATEGIES = {
    "8-replicas": ((8,), None, {}),
    "8-replicas-fsdp": ((8,), None, {"weight_update": "fsdp"}),
    "data-x-model-fsdp": ((4, 2), ("data", "model"), {"weight_update": "fsdp", "model_axis": "model"}),
}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_tiny_llama_equals_one_device(strategy):
    """Three steps of the recipe (AdamW, clipping, warmup) in float32 compute: data parallelism,
    FSDP, and FSDP x tensor with the built-in rules (query heads, the 2 key/value heads, the
    MLP, the vocabulary) equal one device on the whole batch; the stored state keeps its type."""
    shape, names, fields = STRATEGIES[strategy]
    task = make_task("llama3-8b", config="tiny", policy=FLOAT32)
    tx = task.workload.make_optimizer(task.config, 10)
    batches = [task.train_data.get(np.arange(i * 32, (i + 1) * 32)) for i in range(3)]
    state = task.init_state(jax.random.key(0), tx)
    ref, ref_metrics = run_single(jax.jit(make_train_step(task, tx)), state, batches)
    mesh = make_mesh(shape) if names is None else jax.make_mesh(shape, names)
    rules = {"rules": RULES["llama3-8b"]} if "model_axis" in fields else {}
    dp = data_parallel(make_train_step(task, tx), mesh, Strategy(**fields, **rules))
    placed = dp.place_state(state, batches[0])
    types = jax.tree.map(jax.typeof, placed)
    out, metrics = run_parallel(dp, state, batches)
    assert jax.tree.map(jax.typeof, dp.place_state(out, batches[0])) == types
    assert max_abs_diff(ref.params, out.params) <= 1e-5
    assert max_abs_diff(ref.params, state.params) > 1e-3  # it trained: the check is not empty
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-5)
    if "model_axis" in fields:
        split = {leaf.path for leaf in dp.layout.leaves if leaf.model_dim is not None}
        assert any("['key']['kernel']" in p for p in split) and any("['output']['kernel']" in p for p in split)


@pytest.mark.slow
def test_tiny_llama_trains_to_its_target_through_podscale_train(tmp_path, capsys):
    """The copy task's teacher predicts every copied token; the tiny model reaches 0.99 of them
    held out (about step 70 of 64 sequences on 8 replicas)."""
    from podscale.cli import main

    code = main(
        ["train", "--model", "llama3-8b", "--config", "tiny", "--steps", "300", "--eval-every", "10"]
        + ["--target", "0.99", "--no-progress", "--weight-update", "fsdp"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "held-out accuracy" in out and "Time to target" in out.replace("time to target", "Time to target"), out


def test_full_configs_are_the_published_shapes():
    for cfg, params in ((llama3.FULL_8B, 8_030_261_248), (llama3.FULL_70B, 70_553_706_496)):
        assert cfg.vocab_size == 128_256 and cfg.length == 8192
        shapes = jax.eval_shape(
            lambda: llama3.make_model(cfg, llama3.Policy(), None).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
        )
        assert sum(x.size for x in jax.tree.leaves(shapes)) == params


def test_project_compares_the_recipe_s_strategies_unless_told_otherwise(capsys):
    """Llama's recipe is FSDP: ``podscale project`` without ``--strategies`` compares it with the
    sharded update (which never fits at 8B), not the MLPerf models' replicated/sharded/2-D set."""
    import json

    from podscale.cli import main

    argv = ["project", "--model", "llama3-8b", "--config", "tiny", "--system", "tpu-v6e", "--chips", "16"]
    argv += ["--compiler", "cpu", "--dry-run", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == [
        "16 chips: sharded would compile",
        "16 chips: fsdp would compile",
    ]
    assert main([*argv, "--strategies", "replicated"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == ["16 chips: replicated would compile"]


def test_offloaded_layer_inputs_under_fsdp_equal_one_device():
    """``remat="offload"`` (config ``full-offload``): each layer's input, named as MaxText names it,
    moved to host memory between the passes. Under FSDP the name and the moves run on each
    replica's rows (no op on the whole batch) and the steps equal one device's."""
    task = make_task("llama3-8b", config="tiny", policy=FLOAT32)
    task = dataclasses.replace(task, config=dataclasses.replace(task.config, remat="offload"))
    assert llama3.LLAMA3_8B.configs["full-offload"].remat == "offload"
    tx = task.workload.make_optimizer(task.config, 10)
    batches = [task.train_data.get(np.arange(i * 32, (i + 1) * 32)) for i in range(2)]
    state = task.init_state(jax.random.key(0), tx)
    ref, _ = run_single(jax.jit(make_train_step(task, tx)), state, batches)
    dp = data_parallel(make_train_step(task, tx), make_mesh((8,)), Strategy(weight_update="fsdp"))
    assert dp.plan(state, batches[0]).whole_ops == []
    out, _ = run_parallel(dp, state, batches)
    assert max_abs_diff(ref.params, out.params) <= 1e-5
