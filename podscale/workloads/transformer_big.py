"""Transformer "big" for WMT English-German (Vaswani et al. 2017), as MLPerf v0.6 trains it.

The architecture is tensor2tensor's ``transformer_mlperf_tpu`` (the hparams set Google's MLPerf
v0.6 TPU submission trains; mlcommons/training_results_v0.6,
``Google/benchmarks/transformer/implementations/tpu-v3-1024-transformer/transformer/models/transformer.py``):
hidden 1024, filter 4096, 16 heads, 6 encoder and 6 decoder layers, pre-layer-norm residual blocks
(``layer_preprocess_sequence="n"``, ``layer_postprocess_sequence="da"``) with a final layer norm on
each stack, attention projections without bias, a ReLU feed-forward block with bias, sinusoidal
positions, and one embedding table shared by the source, the target and the output projection
(``shared_embedding_and_softmax_weights``), scaled by ``sqrt(hidden)`` on the way in and
initialised with standard deviation ``hidden ** -0.5``. The vocabulary is MLPerf's shared
33,708-subtoken vocabulary (mlcommons/training ``translation/tensorflow/process_data.py``,
``_TARGET_VOCAB_SIZE``). tensor2tensor's 32 x 1024 target-space embedding is left out (0.02% of
the parameters).

Parameters: 210.8 M with this vocabulary, against 213 M for "big" in Vaswani et al. 2017, Table 3
(vocabulary about 37,000): within 1.1%.

The full config's recipe is the one Google's MLPerf v0.6 submission on a TPU-v3-128 (128 cores)
logged (mlcommons/training_results_v0.6, ``Google/results/tpu-v3-128/transformer/result_0.txt``):
global batch 512 sequences (4 per core), Adam with beta1 0.9, beta2 0.98, epsilon 1e-9, learning
rate ``2.0 * hidden ** -0.5 * min(step / 1000, 1) * rsqrt(max(step, 1000))`` (t2t's
``constant*linear_warmup*rsqrt_decay*rsqrt_hidden_size``, constant 2.0, 1000 warmup steps: a peak
of 1.976e-3 at step 1000), label smoothing 0.1. Sequences are the 256-token packed sequences of
``translate_ende_wmt32k_packed`` (t2t ``max_length = 256``; individual sentences at most 80 tokens
as the log says; podscale's model has no segment ids, so one packed row is one sequence here).
``train_steps`` is 4 epochs of 1107 steps at this batch: the runs logged stop within 4 one-epoch
blocks, and 1107 is the steps per epoch at a 512 x 256-token batch given in Google's MLPerf v0.7
Lingvo ``WmtEnDeMlPerf`` params (mlcommons/training_results_v0.7). Dropout is the recipe's 0.1
(t2t ``layer_prepostprocess_dropout`` on the embedded inputs and on each sublayer's output before
its residual add, ``attention_dropout`` on the attention probabilities, ``relu_dropout`` after the
ReLU), drawn from the ``dropout`` key that ``train_loss`` is given.

The tiny config is the same architecture, small (hidden 64, filter 256, 4 heads, 2 + 2 layers),
trained with the full config's recipe unchanged, on ``ReversedTokens`` (10 tokens, 16 content
tokens), dropout 0.1 included: it reaches 0.99 exact-sequence match under greedy decoding after
about 700 steps of 64 examples on 8 CPU replicas (400 without dropout)::

    podscale train --model transformer-big --config tiny --steps 1000 --eval-every 100 \\
        --target 0.99 --no-progress

Its warmup is the full recipe's too, and with reason: Adam's epsilon of 1e-9 turns any gradient
element whose sign the bf16 rounding of a replica's partial sum flips into a full step of
``learning_rate``, so early steps at a steep warmup differ between 8 replicas and one device by
about the learning rate (the recipe's slope, 2e-6 per step, keeps that under 1e-5 at step 3).
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from mlperf_logging.mllog import constants as C

from podscale.workloads.base import Reference, Workload
from podscale.workloads.precision import Policy
from podscale.workloads.synthetic import BOS, PAD, ReversedTokens, shift_right

_FULL_SOURCE = (
    "Google MLPerf v0.6 Transformer, TPU-v3-128 (mlcommons/training_results_v0.6 "
    "Google/results/tpu-v3-128/transformer/result_0.txt): global batch 512 (4/core), Adam(0.9, 0.98, 1e-9), "
    "lr 2.0*d^-0.5*min(s/1000,1)*rsqrt(max(s,1000)), label smoothing 0.1; model: t2t transformer_mlperf_tpu "
    "(hidden 1024, filter 4096, 16 heads, 6+6 layers, pre-LN, shared embeddings, max_length 256)"
)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """One Transformer config: model size, sequence shape, recipe and (tiny) data size."""

    vocab_size: int
    """Shared source/target vocabulary, ``PAD`` and ``BOS`` included."""
    hidden: int
    filter: int
    """Width of the ReLU feed-forward block."""
    heads: int
    layers: int
    """Layers in the encoder, and again in the decoder."""
    length: int
    """Source and target length of a training row."""
    global_batch: int
    per_core_batch: int
    train_steps: int
    learning_rate: float
    """The recipe's peak learning rate, reached at the end of warmup."""
    warmup_steps: int
    source: str
    b1: float = 0.9
    b2: float = 0.98
    eps: float = 1e-9
    label_smoothing: float = 0.1
    dropout: float = 0.1
    """MLPerf's residual, attention and ReLU dropout (training only)."""
    train_size: int = 0
    """Tiny config: examples of the synthetic training set (0: no bundled data)."""
    eval_size: int = 0


def _t2t_peak(constant: float, hidden: int, warmup: int) -> float:
    """t2t's ``constant * rsqrt_hidden_size * rsqrt(warmup)``: the rate at the end of warmup."""
    return constant / math.sqrt(hidden * warmup)


FULL = TransformerConfig(
    vocab_size=33708,
    hidden=1024,
    filter=4096,
    heads=16,
    layers=6,
    length=256,
    global_batch=512,
    per_core_batch=4,
    train_steps=4 * 1107,
    learning_rate=_t2t_peak(2.0, 1024, 1000),
    warmup_steps=1000,
    source=_FULL_SOURCE,
)

TINY = TransformerConfig(
    vocab_size=18,
    hidden=64,
    filter=256,
    heads=4,
    layers=2,
    length=10,
    global_batch=64,
    per_core_batch=8,
    train_steps=1000,
    learning_rate=FULL.learning_rate,
    warmup_steps=FULL.warmup_steps,
    source="tiny: the full architecture at hidden 64, 2+2 layers, on ReversedTokens (length 10, 16 content "
    "tokens), trained with the full recipe unchanged (Adam 0.9/0.98/1e-9, peak 1.976e-3 after 1000 warmup "
    "steps, rsqrt decay, label smoothing 0.1)",
    train_size=1 << 16,
    eval_size=512,
)


# ----------------------------------------------------------------------------------------------
# Model


def sinusoids(length: int, hidden: int) -> np.ndarray:
    """t2t's ``get_timing_signal_1d``: ``[sin(p / ts), cos(p / ts)]`` with log-spaced timescales
    from 1 to 1e4, float32 ``[length, hidden]``."""
    half = hidden // 2
    log_increment = math.log(1.0e4) / max(half - 1, 1)
    inv_timescales = np.exp(-log_increment * np.arange(half, dtype=np.float64))
    scaled = np.arange(length, dtype=np.float64)[:, None] * inv_timescales[None, :]
    signal = np.concatenate([np.sin(scaled), np.cos(scaled)], axis=1)
    return np.pad(signal, [(0, 0), (0, hidden % 2)]).astype(np.float32)


_KERNEL_INIT = nn.initializers.xavier_uniform()  # t2t's "uniform_unit_scaling": fan_avg, uniform


class Attention(nn.Module):
    """Multi-head attention without biases; softmax in float32, both matmuls in ``compute_dtype``."""

    cfg: TransformerConfig
    policy: Policy

    @nn.compact
    def __call__(self, x, memory, mask, train: bool = False):
        """``x`` [B, Q, H] attends to ``memory`` [B, K, H]; ``mask`` [B or 1, Q or 1, K] is True
        where attending is allowed; ``train`` applies dropout to the probabilities."""
        cfg, p = self.cfg, self.policy
        head_dim = cfg.hidden // cfg.heads
        dense = dict(use_bias=False, kernel_init=_KERNEL_INIT, dtype=p.compute_dtype, param_dtype=p.param_dtype)
        scale = jnp.asarray(head_dim**-0.5, p.compute_dtype)
        q = nn.DenseGeneral((cfg.heads, head_dim), **dense, name="query")(x) * scale
        k = nn.DenseGeneral((cfg.heads, head_dim), **dense, name="key")(memory)
        v = nn.DenseGeneral((cfg.heads, head_dim), **dense, name="value")(memory)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(p.accum_dtype)
        logits = jnp.where(mask[:, None], logits, jnp.finfo(p.accum_dtype).min)
        probs = jax.nn.softmax(logits, axis=-1).astype(p.compute_dtype)
        probs = nn.Dropout(cfg.dropout, deterministic=not train)(probs)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        return nn.DenseGeneral(cfg.hidden, axis=(-2, -1), **dense, name="out")(out)


class FeedForward(nn.Module):
    cfg: TransformerConfig
    policy: Policy

    @nn.compact
    def __call__(self, x, train: bool = False):
        dense = dict(kernel_init=_KERNEL_INIT, dtype=self.policy.compute_dtype, param_dtype=self.policy.param_dtype)
        h = nn.relu(nn.Dense(self.cfg.filter, name="wi", **dense)(x))
        h = nn.Dropout(self.cfg.dropout, deterministic=not train)(h)
        return nn.Dense(self.cfg.hidden, name="wo", **dense)(h)


def _norm(policy: Policy, name: str) -> nn.LayerNorm:
    # Statistics and output in float32: the residual stream stays float32, Dense casts to bf16.
    return nn.LayerNorm(epsilon=1e-6, dtype=policy.accum_dtype, param_dtype=policy.param_dtype, name=name)


class EncoderLayer(nn.Module):
    """Pre-layer-norm: ``x + SelfAttention(LN(x))``, then ``x + FFN(LN(x))``."""

    cfg: TransformerConfig
    policy: Policy

    @nn.compact
    def __call__(self, x, mask, train: bool):
        drop = nn.Dropout(self.cfg.dropout, deterministic=not train)
        h = _norm(self.policy, "ln_self")(x)
        x = x + drop(Attention(self.cfg, self.policy, name="self_attention")(h, h, mask, train))
        x = x + drop(FeedForward(self.cfg, self.policy, name="ffn")(_norm(self.policy, "ln_ffn")(x), train))
        return x, None


class DecoderLayer(nn.Module):
    """Pre-layer-norm: causal self-attention, attention to the encoder output, feed-forward."""

    cfg: TransformerConfig
    policy: Policy

    @nn.compact
    def __call__(self, x, encoded, self_mask, cross_mask, train: bool):
        drop = nn.Dropout(self.cfg.dropout, deterministic=not train)
        h = _norm(self.policy, "ln_self")(x)
        x = x + drop(Attention(self.cfg, self.policy, name="self_attention")(h, h, self_mask, train))
        h = _norm(self.policy, "ln_cross")(x)
        x = x + drop(Attention(self.cfg, self.policy, name="cross_attention")(h, encoded, cross_mask, train))
        x = x + drop(FeedForward(self.cfg, self.policy, name="ffn")(_norm(self.policy, "ln_ffn")(x), train))
        return x, None


def _stack(layer, n: int, broadcast_args: int):
    """``n`` identical layers as one ``nn.scan`` (parameters stacked on a leading axis)."""
    return nn.scan(
        layer,
        variable_axes={"params": 0},
        split_rngs={"params": True, "dropout": True},
        in_axes=(nn.broadcast,) * (broadcast_args + 1),  # + the ``train`` flag
        length=n,
    )


class Transformer(nn.Module):
    """Encoder-decoder Transformer with one embedding table for source, target and output."""

    cfg: TransformerConfig
    policy: Policy

    def setup(self):
        cfg, p = self.cfg, self.policy
        self.embedding = self.param(
            "embedding", nn.initializers.normal(stddev=cfg.hidden**-0.5), (cfg.vocab_size, cfg.hidden), p.param_dtype
        )
        self.encoder = _stack(EncoderLayer, cfg.layers, 1)(cfg, p, name="encoder")
        self.decoder = _stack(DecoderLayer, cfg.layers, 3)(cfg, p, name="decoder")
        self.encoder_norm = _norm(p, "encoder_norm")
        self.decoder_norm = _norm(p, "decoder_norm")
        self.input_dropout = nn.Dropout(cfg.dropout)

    def embed(self, tokens, train: bool = False):
        """Float32 ``[B, L, H]``: the table row (gathered in float32) times ``sqrt(hidden)``, plus
        sinusoidal positions (then dropout when ``train``)."""
        x = jnp.take(self.embedding, tokens, axis=0) * jnp.sqrt(jnp.float32(self.cfg.hidden))
        x = x + jnp.asarray(sinusoids(tokens.shape[1], self.cfg.hidden))
        return self.input_dropout(x, deterministic=not train)

    def encode(self, inputs, train: bool = False):
        """``(encoded [B, L, H] float32, input mask [B, L])``; ``PAD`` source tokens are masked."""
        keep = inputs != PAD
        x, _ = self.encoder(self.embed(inputs, train), keep[:, None, :], train)
        return self.encoder_norm(x), keep

    def decode(self, decoder_inputs, encoded, input_mask, train: bool = False):
        """Logits ``[B, T, vocab]`` in ``compute_dtype``, the embedding table as the output
        projection; position ``t`` sees ``decoder_inputs[:, :t+1]`` only."""
        length = decoder_inputs.shape[1]
        causal = jnp.tril(jnp.ones((length, length), bool))[None]
        embedded = self.embed(decoder_inputs, train)
        x, _ = self.decoder(embedded, encoded, causal, input_mask[:, None, :], train)
        x = self.decoder_norm(x)
        dt = self.policy.compute_dtype
        return jnp.einsum("bth,vh->btv", x.astype(dt), self.embedding.astype(dt))

    def __call__(self, inputs, decoder_inputs, train: bool = False):
        """``train``: apply dropout (needs a ``dropout`` rng)."""
        return self.decode(decoder_inputs, *self.encode(inputs, train), train)


def make_model(cfg: TransformerConfig, policy: Policy, bn_axis: str | None = None) -> Transformer:
    del bn_axis  # no batch norm
    return Transformer(cfg, policy)


# ----------------------------------------------------------------------------------------------
# Data, loss, metrics, recipe


def batch_shapes(cfg: TransformerConfig, global_batch: int) -> dict[str, jax.ShapeDtypeStruct]:
    shape = jax.ShapeDtypeStruct((global_batch, cfg.length), jnp.int32)
    return {"inputs": shape, "targets": shape}


def make_data(cfg: TransformerConfig, seed: int):
    if not cfg.train_size:
        raise ValueError(
            "the MLPerf WMT14 English-German data set does not ship with podscale; the full config is for "
            "compiling and sizing only. Train with --config tiny (synthetic reversed-token translation)"
        )
    return (
        ReversedTokens(cfg.train_size, cfg.length, cfg.vocab_size, seed=seed),
        ReversedTokens(cfg.eval_size, cfg.length, cfg.vocab_size, seed=seed + 1),
    )


def init(model: Transformer, rng: jax.Array, batch) -> dict:
    targets = jnp.asarray(batch["targets"])
    return model.init(rng, jnp.asarray(batch["inputs"]), shift_right(targets), train=False)


def smoothed_loss(logits, targets, smoothing: float):
    """Per-token float32 cross-entropy against ``optax.smooth_labels`` of the one-hot targets."""
    labels = optax.smooth_labels(jax.nn.one_hot(targets, logits.shape[-1], dtype=jnp.float32), smoothing)
    return optax.softmax_cross_entropy(logits.astype(jnp.float32), labels)


def _per_example(logits, targets, smoothing: float) -> dict[str, jax.Array]:
    """Mean smoothed loss and teacher-forced token accuracy over each example's non-``PAD`` targets."""
    weights = (targets != PAD).astype(jnp.float32)
    count = jnp.maximum(weights.sum(-1), 1.0)
    loss = (smoothed_loss(logits, targets, smoothing) * weights).sum(-1) / count
    correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
    return {"loss": loss, "accuracy": (correct * weights).sum(-1) / count}


def train_loss(model: Transformer, variables: dict, batch, rng: jax.Array | None = None):
    """Training mode; ``rng`` is the dropout key (``None``: no dropout)."""
    targets = batch["targets"]
    rngs = {} if rng is None else {"dropout": rng}
    logits = model.apply(variables, batch["inputs"], shift_right(targets), train=rng is not None, rngs=rngs)
    return _per_example(logits, targets, model.cfg.label_smoothing), {}


def greedy_decode(model: Transformer, variables: dict, inputs, length: int):
    """``length`` tokens by greedy decoding, inside one ``lax.fori_loop``.

    The encoder runs once; step ``i`` re-runs the decoder on the whole buffer (``BOS`` then the
    tokens chosen so far, later positions still ``PAD``) and takes the argmax at position ``i``:
    by causality, the later positions do not change it.
    """
    encoded, mask = model.apply(variables, inputs, method=Transformer.encode)
    batch = inputs.shape[0]
    # Derived from ``inputs`` so that, under shard_map, the loop carry varies over the batch axis
    # as the decoder's output does.
    zeros = (inputs[:, :1] * 0).astype(jnp.int32) + jnp.zeros((batch, length), jnp.int32)
    buffer = zeros.at[:, 0].set(BOS)

    def step(i, carry):
        buffer, out = carry
        logits = model.apply(variables, buffer, encoded, mask, method=Transformer.decode)
        token = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, i, axis=1, keepdims=False), -1).astype(jnp.int32)
        out = jax.lax.dynamic_update_index_in_dim(out, token, i, axis=1)
        # Feed the token at position i + 1 (the last step's write goes nowhere: clamp and keep).
        nxt = jnp.minimum(i + 1, length - 1)
        cur = jax.lax.dynamic_index_in_dim(buffer, nxt, axis=1, keepdims=False)
        buffer = jax.lax.dynamic_update_index_in_dim(buffer, jnp.where(i + 1 < length, token, cur), nxt, axis=1)
        return buffer, out

    _, out = jax.lax.fori_loop(0, length, step, (buffer, zeros))
    return out


def eval_metrics(model: Transformer, variables: dict, batch):
    """``loss`` and ``accuracy`` teacher-forced; ``exact_match``: the greedy decoding gets every
    non-``PAD`` target token right."""
    targets = batch["targets"]
    logits = model.apply(variables, batch["inputs"], shift_right(targets), train=False)
    metrics = _per_example(logits, targets, model.cfg.label_smoothing)
    decoded = greedy_decode(model, variables, batch["inputs"], targets.shape[1])
    metrics["exact_match"] = jnp.all((decoded == targets) | (targets == PAD), axis=-1).astype(jnp.float32)
    return metrics


def learning_rate_schedule(cfg: TransformerConfig) -> optax.Schedule:
    """Linear warmup from 0 to ``learning_rate`` over ``warmup_steps``, then ``rsqrt`` decay:
    ``learning_rate * min(step / warmup, sqrt(warmup / step))`` (t2t's
    ``linear_warmup*rsqrt_decay``, with its constants folded into the peak)."""
    peak, warmup = cfg.learning_rate, cfg.warmup_steps
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak, warmup), lambda count: peak * jax.lax.rsqrt(1.0 + count / warmup)],
        boundaries=[warmup],
    )


def make_optimizer(cfg: TransformerConfig, total_steps: int) -> optax.GradientTransformation:
    """Adam with the MLPerf betas and epsilon on the warmup + rsqrt schedule. The schedule has no
    end, so ``total_steps`` does not change it (as in MLPerf)."""
    del total_steps
    return optax.adam(learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)


def hparams(cfg: TransformerConfig, total_steps: int) -> dict:
    """The recipe under mllog's standard Adam keys."""
    del total_steps
    return {
        C.OPT_NAME: C.ADAM,
        C.OPT_BASE_LR: cfg.learning_rate,
        C.OPT_LR_WARMUP_STEPS: cfg.warmup_steps,
        C.OPT_ADAM_BETA_1: cfg.b1,
        C.OPT_ADAM_BETA_2: cfg.b2,
        C.OPT_ADAM_EPSILON: cfg.eps,
        "label_smoothing": cfg.label_smoothing,
    }


WORKLOAD = Workload(
    name="transformer-big",
    mlperf_name="transformer",
    description="Transformer big (Vaswani et al. 2017), WMT14 En-De, MLPerf v0.6 recipe",
    configs={"full": FULL, "tiny": TINY},
    reference=Reference(params=213_000_000, source="Vaswani et al. 2017, Attention Is All You Need, Table 3, 'big'"),
    make_model=make_model,
    batch_shapes=batch_shapes,
    make_data=make_data,
    make_optimizer=make_optimizer,
    init=init,
    train_loss=train_loss,
    eval_metrics=eval_metrics,
    eval_metric="exact_match",
    hparams=hparams,
)
