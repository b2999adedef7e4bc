"""BERT-large workload: masked-LM data, the tied output projection, the metric, and the LAMB recipe."""

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from podscale.workloads import bert_large as bert
from podscale.workloads.precision import BF16, FLOAT32
from podscale.workloads.synthetic import BOS, PAD

TINY = bert.TINY


def _variables(cfg=TINY, policy=BF16):
    model = bert.make_model(cfg, policy)
    train, _ = bert.make_data(cfg, seed=0)
    batch = train.get(np.arange(4))
    return model, jax.jit(lambda b: bert.init(model, jax.random.key(0), b))(batch), batch


def test_masked_positions_are_exactly_p_per_sequence_and_never_padding():
    train, held_out = bert.make_data(TINY, seed=3)
    batch = train.get(np.arange(512))
    tokens, positions, targets = batch["tokens"], batch["positions"], batch["targets"]
    assert positions.shape == targets.shape == (512, TINY.num_predictions)
    lengths = (tokens != PAD).sum(1)
    assert np.all(tokens[np.arange(TINY.seq_len)[None, :] >= lengths[:, None]] == PAD)  # padding only at the end
    assert np.all(positions >= 1) and np.all(positions < lengths[:, None])  # never [CLS]/BOS, never padding
    assert all(len(set(row)) == TINY.num_predictions for row in positions)
    assert np.all(np.diff(positions, axis=1) > 0)
    assert not np.isin(targets, [PAD, BOS, bert.MASK]).any()
    replaced = np.take_along_axis(tokens, positions, 1)
    share_mask, share_same = np.mean(replaced == bert.MASK), np.mean(replaced == targets)
    assert 0.75 < share_mask < 0.85 and 0.07 < share_same < 0.16  # 80% [MASK], 10% kept (+ random hits)
    unmasked = np.ones_like(tokens, bool)
    np.put_along_axis(unmasked, positions, False, 1)
    assert not np.any(tokens[unmasked] == bert.MASK)
    # a pure function of (seed, index); the held-out stream differs from the training stream
    again = train.get(np.array([7, 2]))
    np.testing.assert_array_equal(again["tokens"], batch["tokens"][[7, 2]])
    assert not np.array_equal(held_out.get(np.arange(4))["tokens"], batch["tokens"][:4])


def test_full_config_data_does_not_ship():
    with pytest.raises(ValueError, match="--config tiny"):
        bert.make_data(bert.FULL, 0)


def test_unigram_baseline_equals_a_direct_count():
    _, held_out = bert.make_data(TINY, seed=0)
    targets = [int(t) for i in range(len(held_out)) for t in held_out.get(np.array([i]))["targets"][0]]
    token, count = collections.Counter(targets).most_common(1)[0]
    assert bert.unigram_baseline(TINY) == pytest.approx(count / len(targets))
    assert bert.WORKLOAD.unigram_baseline is bert.unigram_baseline
    assert bert.unigram_baseline(TINY) < 0.2


def test_mlm_head_is_tied_to_the_word_embeddings():
    cfg = dataclasses.replace(TINY, vocab_size=97)  # a size no other weight dimension has
    model, variables, batch = _variables(cfg, FLOAT32)
    params = variables["params"]
    table = params["word_embeddings"]["embedding"]
    assert table.shape == (cfg.vocab_size, cfg.hidden)
    with_vocab = [
        jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_leaves_with_path(params) if cfg.vocab_size in x.shape
    ]
    assert with_vocab == ["['mlm_bias']", "['word_embeddings']['embedding']"]
    capture = jax.jit(lambda v, t, p: model.apply(v, t, p, capture_intermediates=lambda mdl, _: mdl.name == "mlm_norm"))
    logits, inter = capture(variables, batch["tokens"], batch["positions"])
    hidden = inter["intermediates"]["mlm_norm"]["__call__"][0]
    expected = np.asarray(hidden) @ np.asarray(table).T + np.asarray(params["mlm_bias"])
    np.testing.assert_allclose(np.asarray(logits), expected, rtol=1e-5, atol=1e-5)


def test_metrics_are_the_masked_token_accuracy_and_cross_entropy():
    model, variables, batch = _variables()
    logits = np.asarray(jax.jit(model.apply)(variables, batch["tokens"], batch["positions"]), np.float64)
    targets = batch["targets"]
    log_probs = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    loss = -np.take_along_axis(log_probs, targets[..., None], -1)[..., 0].mean(1)
    accuracy = (logits.argmax(-1) == targets).mean(1)
    metrics = jax.jit(lambda v, b: bert.eval_metrics(model, v, b))(variables, batch)
    np.testing.assert_allclose(metrics["mlm_accuracy"], accuracy)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
    per, batch_stats = jax.jit(lambda v, b: bert.train_loss(model, v, b))(variables, batch)
    np.testing.assert_allclose(per["accuracy"], accuracy)
    assert batch_stats == {}
    assert bert.WORKLOAD.eval_metric == "mlm_accuracy"


def test_weight_decay_mask_excludes_exactly_layer_norm_params_and_biases():
    _, variables, _ = _variables()
    params = variables["params"]
    mask = bert.weight_decay_mask(params)
    leaves = jax.tree_util.tree_leaves_with_path(params)
    # layer-norm modules are the parents of the "scale" leaves (nothing else has a scale)
    norms = {p[:-1] for p, _ in leaves if p[-1].key == "scale"}
    assert len(norms) == 4  # embeddings, attention and ffn (stacked over layers), masked-LM head
    for path, _ in leaves:
        excluded = path[:-1] in norms or path[-1].key in ("bias", "mlm_bias")
        decayed = _get(mask, path)
        assert decayed is (not excluded), jax.tree_util.keystr(path)
    # the optimizer applies it: with zero gradients only the decayed parameters move
    cfg = dataclasses.replace(TINY, warmup_steps=0)
    tx = bert.make_optimizer(cfg, 10)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = jax.jit(tx.update)(zeros, tx.init(params), params)
    for path, update in jax.tree_util.tree_leaves_with_path(updates):
        moved = bool(jnp.any(update != 0))
        assert moved is _get(mask, path), jax.tree_util.keystr(path)


def _get(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


def test_schedule_warms_up_linearly_then_decays_linearly_to_zero():
    cfg = dataclasses.replace(TINY, learning_rate=0.3, warmup_steps=20)
    total = 100
    schedule = bert.learning_rate_schedule(cfg, total)
    steps = np.arange(total + 5)
    got = np.array([float(schedule(s)) for s in steps])
    expected = np.where(
        steps < 20, 0.3 * steps / 20, 0.3 * np.clip(1 - (steps - 20) / (total - 20), 0, 1) ** cfg.decay_power
    )
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-9)
    assert got.argmax() == 20 and got[0] == 0 and got[total] == 0
    assert bert.FULL.decay_power == 1.0
    # a run shorter than the warmup still gets a valid schedule
    short = bert.learning_rate_schedule(cfg, 10)
    assert float(short(10)) == pytest.approx(0.3)


def test_full_config_has_the_cited_mlperf_constants():
    full = bert.FULL
    assert (full.global_batch, full.per_core_batch, full.learning_rate, full.warmup_steps) == (3072, 6, 0.0015, 100)
    assert (full.weight_decay, full.b1, full.b2, full.eps) == (0.01, 0.9, 0.999, 1e-6)
    assert (full.seq_len, full.num_predictions, full.layers, full.hidden, full.heads) == (512, 76, 24, 1024, 16)
