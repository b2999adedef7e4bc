"""Transformer-big specifics: causal decoder, greedy decoding, label smoothing, schedule, shared
embedding, exact-match metric, data."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from podscale.workloads import transformer_big as tb
from podscale.workloads.precision import BF16, FLOAT32
from podscale.workloads.synthetic import BOS, PAD, shift_right

CFG = tb.TINY


@pytest.fixture(scope="module")
def setup():
    model = tb.make_model(CFG, FLOAT32)
    batch = tb.make_data(CFG, 0)[0].get(np.arange(4))
    variables = jax.jit(lambda b: tb.init(model, jax.random.key(1), b))(batch)
    # At initialisation every position predicts BOS (its own input, through the tied table); noise
    # on every weight makes the greedy decodings below diverse.
    leaves, treedef = jax.tree.flatten(variables)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    noisy = jax.jit(lambda xs, ks: [x + 0.3 * jax.random.normal(ks[i], x.shape) for i, x in enumerate(xs)])
    variables = treedef.unflatten(noisy(leaves, keys))
    return model, variables, batch


@pytest.fixture(scope="module")
def apply(setup):
    """The tiny model's forward pass, jitted once: ``apply(variables, inputs, decoder_inputs)``."""
    return jax.jit(setup[0].apply)


def test_decoder_is_causal(setup, apply):
    model, variables, batch = setup
    dec = np.asarray(shift_right(batch["targets"]))
    logits = apply(variables, batch["inputs"], dec)
    j = 6
    changed = dec.copy()
    changed[:, j] = np.where(changed[:, j] == 5, 6, 5)
    logits2 = apply(variables, batch["inputs"], changed)
    np.testing.assert_array_equal(np.asarray(logits[:, :j]), np.asarray(logits2[:, :j]))
    assert np.abs(np.asarray(logits[:, j:]) - np.asarray(logits2[:, j:])).max() > 1e-3


def test_greedy_decoding_matches_a_python_loop_and_teacher_forcing(setup, apply):
    model, variables, batch = setup
    decoded = np.asarray(jax.jit(lambda v, x: tb.greedy_decode(model, v, x, CFG.length))(variables, batch["inputs"]))
    # A plain loop: run the decoder, append the argmax at the newest position, repeat.
    dec = np.full((4, CFG.length), PAD, np.int32)
    dec[:, 0] = BOS
    out = []
    for i in range(CFG.length):
        token = np.argmax(np.asarray(apply(variables, batch["inputs"], dec))[:, i], -1).astype(np.int32)
        out.append(token)
        if i + 1 < CFG.length:
            dec[:, i + 1] = token
    np.testing.assert_array_equal(decoded, np.stack(out, 1))
    # Fed its own outputs, the teacher-forced argmax reproduces them.
    forced = apply(variables, batch["inputs"], shift_right(decoded))
    np.testing.assert_array_equal(np.argmax(np.asarray(forced), -1), decoded)
    assert len(np.unique(decoded)) > 1  # not a degenerate constant decoding


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_label_smoothed_loss_and_accuracy_match_a_hand_computation():
    rng = np.random.default_rng(0)
    vocab = 7
    logits = rng.normal(size=(3, 5, vocab)).astype(np.float32)
    targets = rng.integers(2, vocab, size=(3, 5)).astype(np.int32)
    targets[1, 3:] = PAD
    targets[2, 0] = int(np.argmax(logits[2, 0]))
    per = tb._per_example(jnp.asarray(logits), jnp.asarray(targets), 0.1)
    q = np.full((3, 5, vocab), 0.1 / vocab) + 0.9 * np.eye(vocab)[targets]
    token_loss = -(q * _log_softmax(logits.astype(np.float64))).sum(-1)
    weights = (targets != PAD).astype(np.float64)
    np.testing.assert_allclose(per["loss"], (token_loss * weights).sum(-1) / weights.sum(-1), rtol=1e-5)
    correct = (np.argmax(logits, -1) == targets) * weights
    np.testing.assert_allclose(per["accuracy"], correct.sum(-1) / weights.sum(-1), rtol=1e-6)


def test_schedule_is_t2t_linear_warmup_then_rsqrt_decay():
    """The full config's schedule equals t2t's constant*linear_warmup*rsqrt_decay*rsqrt_hidden_size."""
    schedule = tb.learning_rate_schedule(tb.FULL)

    def t2t(step, constant=2.0, hidden=1024, warmup=1000):
        return constant * hidden**-0.5 * min(step / warmup, 1.0) * max(step, warmup) ** -0.5

    for step in (0, 1, 250, 999, 1000, 1001, 2000, 4000, 16000, 100000):
        # optax's linear_schedule computes peak - peak * (1 - step / warmup) in float32: early steps
        # lose a few digits to the cancellation.
        np.testing.assert_allclose(float(schedule(step)), t2t(step), rtol=1e-4)
    assert math.isclose(tb.FULL.learning_rate, max(t2t(s) for s in range(0, 3000)), rel_tol=1e-9)
    # The peak is the trainer's handle: replacing it scales the whole schedule.
    half = tb.learning_rate_schedule(dataclasses.replace(tb.FULL, learning_rate=tb.FULL.learning_rate / 2))
    np.testing.assert_allclose(float(half(4000)), t2t(4000) / 2, rtol=1e-5)


def test_optimizer_is_adam_with_the_recipe_betas_on_the_schedule():
    cfg = dataclasses.replace(CFG, warmup_steps=4, learning_rate=0.1)
    tx = tb.make_optimizer(cfg, 100)
    params = {"w": jnp.zeros(3)}
    state = tx.init(params)
    grads = {"w": jnp.array([1.0, -2.0, 0.5])}
    m = v = np.zeros(3)
    g = np.asarray(grads["w"], np.float64)
    for step in range(6):
        updates, state = tx.update(grads, state, params)
        m, v = 0.9 * m + 0.1 * g, 0.98 * v + 0.02 * g * g
        m_hat, v_hat = m / (1 - 0.9 ** (step + 1)), v / (1 - 0.98 ** (step + 1))
        lr = 0.1 * min(step / 4, math.sqrt(4 / max(step, 1)))
        np.testing.assert_allclose(updates["w"], -lr * m_hat / (np.sqrt(v_hat) + 1e-9), rtol=1e-5, atol=1e-9)


def test_one_embedding_table_serves_source_target_and_output(setup, apply):
    model, variables, batch = setup
    params = variables["params"]
    leaves = jax.tree_util.tree_leaves_with_path(params)
    with_vocab = [jax.tree_util.keystr(path) for path, x in leaves if CFG.vocab_size in x.shape]
    assert with_vocab == ["['embedding']"]
    inputs = np.full((1, CFG.length), 3, np.int32)
    inputs[0, 4] = 4  # token 4: source only
    dec = np.full((1, CFG.length), BOS, np.int32)
    dec[0, 5] = 5  # token 5: decoder input only; token 6: neither
    base = np.asarray(apply(variables, inputs, dec))
    # Not a constant: layer norm would remove a shift of every coordinate.
    bump = jax.random.normal(jax.random.key(2), (CFG.hidden,))

    def bumped(token):
        table = params["embedding"].at[token].add(bump)
        return np.asarray(apply({"params": {**params, "embedding": table}}, inputs, dec))

    src = bumped(4)
    assert np.abs(src - base)[0, 0].max() > 1e-3  # the encoder reads the table
    tgt = bumped(5)
    # Earlier positions change only in the logit of token 5 (the output projection's row).
    np.testing.assert_array_equal(np.delete(tgt[0, :5], 5, -1), np.delete(base[0, :5], 5, -1))
    assert np.abs(np.delete(tgt - base, 5, -1))[0, 5].max() > 1e-3  # the decoder input embedding reads it
    out = bumped(6)
    np.testing.assert_array_equal(np.delete(out, 6, -1), np.delete(base, 6, -1))
    assert np.abs(out - base)[..., 6].min() > 1e-4  # the output projection is the table


def test_exact_match_counts_whole_sequences(setup):
    model, variables, batch = setup
    metrics_fn = jax.jit(lambda v, b: tb.eval_metrics(model, v, b))
    decoded = np.asarray(jax.jit(lambda v, x: tb.greedy_decode(model, v, x, CFG.length))(variables, batch["inputs"]))
    targets = decoded.copy()
    targets[1, 7] = (targets[1, 7] + 1 - 2) % (CFG.vocab_size - 2) + 2  # one token wrong
    targets[2] = np.roll(targets[2], 1)
    targets[3, 8:] = PAD  # padding is not scored
    metrics = metrics_fn(variables, {"inputs": batch["inputs"], "targets": targets})
    expected = [1.0, 0.0, float(np.array_equal(targets[2], decoded[2])), 1.0]
    np.testing.assert_array_equal(metrics["exact_match"], expected)
    assert set(metrics) == {"loss", "accuracy", "exact_match"}


def test_bf16_logits_and_float32_state_and_loss():
    model = tb.make_model(CFG, BF16)
    batch = tb.batch_shapes(CFG, 2)
    variables = jax.eval_shape(lambda b: tb.init(model, jax.random.key(0), b), batch)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(variables))
    logits = jax.eval_shape(lambda v, b: model.apply(v, b["inputs"], shift_right(b["targets"])), variables, batch)
    assert logits.dtype == jnp.bfloat16 and logits.shape == (2, CFG.length, CFG.vocab_size)
    per, stats = jax.eval_shape(lambda v, b: tb.train_loss(model, v, b), variables, batch)
    assert {k: (x.dtype, x.shape) for k, x in per.items()} == {k: (jnp.float32, (2,)) for k in ("loss", "accuracy")}
    assert stats == {}


def test_data_reverses_tokens_and_full_data_is_not_shipped():
    train, evaluation = tb.make_data(CFG, 0)
    b = train.get(np.arange(5))
    np.testing.assert_array_equal(b["targets"], b["inputs"][:, ::-1])
    assert b["inputs"].shape == (5, CFG.length) and b["inputs"].dtype == np.int32
    assert b["inputs"].min() >= 2 and b["inputs"].max() < CFG.vocab_size
    assert not np.array_equal(evaluation.get(np.arange(5))["inputs"], b["inputs"])
    with pytest.raises(ValueError, match="--config tiny"):
        tb.make_data(tb.FULL, 0)
