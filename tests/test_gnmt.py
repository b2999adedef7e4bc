"""GNMT specifics: greedy decoding, the bidirectional encoder and causal decoder, attention,
the reference's learning-rate schedule and label-smoothed loss."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from podscale.workloads import gnmt
from podscale.workloads.precision import FLOAT32
from podscale.workloads.synthetic import BOS, PAD, shift_right

# Three layers each, so the residual layers of encoder and decoder are exercised too.
SMALL = dataclasses.replace(gnmt.TINY, vocab_size=12, hidden=16, num_layers=3, max_len=6)


def _model(policy=FLOAT32, **changes):
    cfg = dataclasses.replace(SMALL, **changes)
    model = gnmt.GNMT(cfg, policy)
    batch = {k: jnp.zeros(v.shape, v.dtype) for k, v in gnmt.WORKLOAD.batch_shapes(cfg, 4).items()}
    variables = gnmt.WORKLOAD.init(model, jax.random.key(1), batch)
    # Normal weights, larger than the recipe's, so that an untrained model's greedy tokens vary.
    leaves, tree = jax.tree.flatten(variables)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    return model, jax.tree.unflatten(tree, [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


@functools.partial(jax.jit, static_argnames=("model", "method"))
def _apply(model, variables, *args, method=None):
    return model.apply(variables, *args, method=method)


def _tokens(seed, shape, vocab=SMALL.vocab_size):
    return jnp.asarray(np.random.default_rng(seed).integers(2, vocab, size=shape), jnp.int32)


@pytest.mark.parametrize("unroll", [False, True])
def test_greedy_decoding_equals_a_python_loop_of_single_steps(unroll):
    model, variables = _model(unroll=unroll)
    inputs = _tokens(0, (4, SMALL.max_len))
    decoded = jax.jit(lambda v, x: gnmt.greedy_decode(model, v, x, SMALL.max_len))(variables, inputs)

    encoded, mask = _apply(model, variables, inputs, method=gnmt.GNMT.encode)
    token, carries, loop, step_logits = jnp.full((4,), BOS, jnp.int32), None, [], []
    for _ in range(SMALL.max_len):
        logits, carries, _ = _apply(model, variables, token[:, None], encoded, mask, carries, method=gnmt.GNMT.decode)
        token = jnp.argmax(logits[:, 0], -1).astype(jnp.int32)
        loop.append(token)
        step_logits.append(logits[:, 0])
    np.testing.assert_array_equal(decoded, np.stack(loop, 1))
    # The carried single steps give what the whole sequence gives under teacher forcing.
    forced = _apply(model, variables, inputs, shift_right(decoded))
    np.testing.assert_allclose(forced, np.stack(step_logits, 1), atol=1e-5, rtol=1e-5)
    assert len(np.unique(np.asarray(decoded))) > 1  # not a degenerate constant sequence


def test_bidirectional_encoder_sees_the_future_and_the_decoder_is_causal():
    model, variables = _model()
    inputs = _tokens(1, (2, SMALL.max_len))
    changed = inputs.at[:, -1].set(jnp.where(inputs[:, -1] == 2, 3, 2))
    enc = _apply(model, variables, inputs, method=gnmt.GNMT.encode)[0]
    enc_changed = _apply(model, variables, changed, method=gnmt.GNMT.encode)[0]
    assert np.max(np.abs(enc[:, 0] - enc_changed[:, 0])) > 1e-4  # the first output saw the last token

    targets = _tokens(2, (2, SMALL.max_len))
    t = 3
    other = targets.at[:, t].set(jnp.where(targets[:, t] == 2, 3, 2))
    logits = _apply(model, variables, inputs, shift_right(targets))
    logits_other = _apply(model, variables, inputs, shift_right(other))  # decoder input t + 1 differs
    np.testing.assert_allclose(logits[:, : t + 1], logits_other[:, : t + 1], atol=1e-6)
    assert np.max(np.abs(logits[:, t + 1] - logits_other[:, t + 1])) > 1e-4


def test_padding_is_packed_and_attention_weights_sum_to_one():
    model, variables = _model()
    real = 4
    inputs = _tokens(3, (2, SMALL.max_len)).at[:, real:].set(PAD)
    encoded, mask = _apply(model, variables, inputs, method=gnmt.GNMT.encode)
    # The backward direction starts at the last real token: the same as encoding the unpadded source.
    shorter, _ = _apply(model, variables, inputs[:, :real], method=gnmt.GNMT.encode)
    np.testing.assert_allclose(encoded[:, :real], shorter, atol=1e-6)

    _, _, probs = _apply(model, variables, _tokens(4, (2, 5)), encoded, mask, method=gnmt.GNMT.decode)
    np.testing.assert_allclose(np.sum(probs, -1), 1.0, atol=1e-6)
    assert np.all(probs[:, :, real:] == 0)
    assert np.all(probs[:, :, :real] > 0)


def _reference_lr(step, peak, total, warmup, remain_fraction, decay_steps=4, factor=0.5):
    """WarmupMultiStepLR.get_lr of the MLPerf reference, written out."""
    remain = round(remain_fraction * total)
    interval = max((total - remain) // decay_steps, 1)
    warmup = min(warmup, remain)
    if step <= warmup:
        return peak * math.exp(math.log(0.01) / warmup) ** (warmup - step) if warmup else peak
    if step >= remain:
        return peak * factor ** min((step - remain) // interval + 1, decay_steps)
    return peak


@pytest.mark.parametrize("total", [400, 9689, 123])
def test_schedule_is_the_references_warmup_multistep(total):
    cfg = gnmt.FULL if total == 9689 else gnmt.TINY
    schedule = gnmt.learning_rate_schedule(cfg, total)
    steps = np.arange(total + 5)
    ours = np.asarray(jax.vmap(schedule)(steps))
    ref = np.array([_reference_lr(int(s), cfg.learning_rate, total, cfg.warmup_steps, cfg.decay_start) for s in steps])
    np.testing.assert_allclose(ours, ref, rtol=1e-5)
    if total == 9689:  # NVIDIA's DGX-1 values: REMAIN_STEPS 6453, DECAY_INTERVAL 809
        assert schedule(6452) == pytest.approx(2e-3) and schedule(6453) == pytest.approx(1e-3)
        assert schedule(6453 + 809) == pytest.approx(5e-4) and schedule(6453 + 3 * 809) == pytest.approx(1.25e-4)
        assert schedule(0) == pytest.approx(2e-5) and schedule(200) == pytest.approx(2e-3)


def test_label_smoothed_loss_is_summed_over_real_tokens():
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(3, 5, 7)).astype(np.float32)
    targets = rng.integers(2, 7, size=(3, 5)).astype(np.int32)
    targets[1, 3:] = PAD
    per = gnmt.per_example_losses(jnp.asarray(logits), jnp.asarray(targets), 0.1)

    logp = logits - np.log(np.sum(np.exp(logits), -1, keepdims=True))
    nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    token = 0.9 * nll + 0.1 * (-logp.mean(-1))  # the reference's LabelSmoothing
    real = targets != PAD
    np.testing.assert_allclose(per["loss"], np.sum(token * real, -1), rtol=1e-5)
    correct = (logits.argmax(-1) == targets) & real
    np.testing.assert_allclose(per["accuracy"], correct.sum(-1) / real.sum(-1), rtol=1e-6)


def test_exact_match_is_every_token_of_the_greedy_decoding():
    model, variables = _model()
    inputs = _tokens(6, (4, SMALL.max_len))
    decoded = gnmt.greedy_decode(model, variables, inputs, SMALL.max_len)
    wrong = decoded.at[0, -1].set(jnp.where(decoded[0, -1] == 2, 3, 2))
    metrics = jax.jit(lambda v, b: gnmt.WORKLOAD.eval_metrics(model, v, b))(
        variables, {"inputs": inputs, "targets": wrong}
    )
    np.testing.assert_array_equal(metrics["exact_match"], [0, 1, 1, 1])
    np.testing.assert_allclose(metrics["accuracy"], [1 - 1 / SMALL.max_len, 1, 1, 1])


def test_full_config_data_does_not_ship():
    with pytest.raises(ValueError, match="--config tiny"):
        gnmt.WORKLOAD.make_data(gnmt.FULL, 0)
