"""GNMT v2: the MLPerf Training v0.5-v0.7 recurrent translation benchmark (``rnn_translator``).

The model is the one of the MLPerf reference (``seq2seq/models/{gnmt,encoder,decoder,attention}.py``
of ``mlperf/training/rnn_translator``, kept as is in NVIDIA's submissions):

- one embedding of the shared 32,320-token vocabulary, used by encoder and decoder;
- encoder: 4 LSTM layers of 1024 units, the first bidirectional (its backward direction starts at
  each sentence's last real token, as PyTorch's packed sequences do), the second reading both
  directions, residual connections from the third layer on;
- decoder: a first LSTM layer whose outputs are the queries of a normalized Bahdanau attention over
  the encoder outputs; the attention context is concatenated to the input of every later layer
  (3 more LSTM layers, residual from the third decoder layer on); a dense classifier over the
  vocabulary. The decoder starts from zero states (GNMT v2 does not pass the encoder's states).

An LSTM layer computes its input projection for all time steps in one matrix product (as cuDNN
does) and runs the recurrent product in a ``lax.scan`` over time; both products take bfloat16
operands, the gates, the cell and the hidden state stay float32. The reference's PyTorch LSTMs
carry two bias vectors per layer (``b_ih`` and ``b_hh``), these one: 9 x 4096 = 36,864 parameters
fewer than the published 160,671,297 (0.02 %).

Full-config recipe (MLPerf Training v0.6, NVIDIA's DGX-1 submission: 8 GPUs x 256 sentences,
global batch 2048; ``config_DGX1.sh`` with the defaults of ``train.py``): Adam, learning rate
2.0e-3, exponential warm-up from 1 % over 200 steps, then constant until step 6453 (= 0.666 of the
9689-step schedule) where the rate is halved, and halved again every 809 steps, 4 times in all;
gradients clipped to global norm 5; label smoothing 0.1; training sentences up to 75 tokens.
The loss, as the reference's, is the label-smoothed cross entropy summed over a sentence's
non-padding target tokens and averaged over sentences. Dropout 0.2 is the reference's: on the input
of every LSTM layer (``seq2seq/models/{encoder,decoder}.py``) but the decoder's first, whose
``RecurrentAttention`` has dropout 0 there; drawn from the ``dropout`` key ``train_loss`` is given.

The tiny config is the same architecture (2 + 2 layers, the bidirectional encoder layer and the
attention kept) on ``ReversedTokens``; held-out ``exact_match`` is greedy decoding inside ``jit``:
``.venv/bin/podscale train --model gnmt --config tiny --steps 300 --eval-every 25 --target 0.95
--no-progress`` reached exact match 0.998 at step 225 (84 s to target on two shared CPU cores).
Running it needs the trainer to wait for the training step before a mid-run evaluation: an
evaluation launched while the step is still in flight left XLA:CPU's all-reduce rendezvous
waiting for good (aborted after 40 s) in every such run here.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from mlperf_logging.mllog import constants as C

from podscale.workloads.base import Reference, Workload
from podscale.workloads.precision import Policy
from podscale.workloads.synthetic import BOS, PAD, ReversedTokens, shift_right

_NVIDIA_V06 = (
    "MLPerf Training v0.6, NVIDIA GNMT submission on one DGX-1 (8 GPUs x 256 = global batch 2048): "
    "github.com/mlcommons/training_results_v0.6 NVIDIA/benchmarks/gnmt/implementations/pytorch/"
    "config_DGX1.sh (LR 2.0e-3, WARMUP_STEPS 200, REMAIN_STEPS 6453, DECAY_INTERVAL 809, MAX_SEQ_LEN 75, "
    "TRAIN_BATCH_SIZE 256 per GPU) and train.py defaults (Adam, 4 decay steps x 0.5, grad clip 5.0, "
    "label smoothing 0.1, hidden 1024, 4 layers, dropout 0.2, shared embedding)"
)


@dataclasses.dataclass(frozen=True)
class GNMTConfig:
    """Model, data and recipe of one GNMT config."""

    vocab_size: int
    hidden: int
    num_layers: int
    """LSTM layers in the encoder and in the decoder each (at least 2)."""
    max_len: int
    """Source and target length of a training batch."""
    global_batch: int
    per_core_batch: int
    train_steps: int
    learning_rate: float
    """Peak learning rate of Adam."""
    warmup_steps: int
    """Exponential warm-up from 1 % of the peak over this many steps (the reference's)."""
    decay_start: float
    """Fraction of the schedule after which the rate is halved (the reference's ``remain_steps``)."""
    source: str
    decay_steps: int = 4
    """How many times the rate is multiplied by ``decay_factor``, at equal intervals to the end."""
    decay_factor: float = 0.5
    grad_clip: float = 5.0
    label_smoothing: float = 0.1
    init_scale: float = 0.1
    """Weights are drawn uniformly from [-init_scale, init_scale], as the reference's."""
    dropout: float = 0.2
    """The reference's dropout on LSTM inputs (training only)."""
    unroll: bool = False
    """Unroll the loops over time (LSTM layers, greedy decoding) into straight-line code. Both
    configs keep ``while`` loops: the tiny config's 8 steps ran no faster unrolled on CPU (its
    300-step run, side by side: 22.6 s unrolled, 19.2 s as loops), and each compile took 1.4 to
    1.7x as long."""
    train_size: int = 0
    eval_size: int = 0

    def __post_init__(self):
        if self.num_layers < 2:
            raise ValueError(f"GNMT needs at least 2 layers (bidirectional + one more), got {self.num_layers}")


FULL = GNMTConfig(
    vocab_size=32320,
    hidden=1024,
    num_layers=4,
    max_len=75,
    global_batch=2048,
    per_core_batch=256,
    train_steps=9689,  # 6453 + 4 x 809: the schedule implied by REMAIN_STEPS / DECAY_INTERVAL
    learning_rate=2.0e-3,
    warmup_steps=200,
    decay_start=0.666,
    source=_NVIDIA_V06,
)

TINY = GNMTConfig(
    vocab_size=16,
    hidden=128,
    num_layers=2,
    max_len=8,
    global_batch=64,
    per_core_batch=8,
    train_steps=300,
    learning_rate=1e-2,
    warmup_steps=20,
    decay_start=0.666,
    source="the full recipe's shape (Adam, exponential warm-up, 4 halvings from 2/3 of the run, clip 5, "
    "label smoothing 0.1), peak rate and warm-up tuned for ReversedTokens on CPU",
    train_size=1 << 20,
    eval_size=512,
)


def _uniform(scale: float):
    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -scale, scale)

    return init


Carry = tuple[jax.Array, jax.Array]  # (cell, hidden), float32 [batch, features]


def _zero_state(like: jax.Array, features: int) -> Carry:
    """Zero ``(c, h)`` of shape ``[like.shape[0], features]``, made *from* ``like``: under
    ``shard_map`` a scan carry must vary over the mesh as the data does, and ``zeros_like`` keeps
    that type where ``jnp.zeros`` would not."""
    zeros = jnp.zeros_like(like, shape=(like.shape[0], features), dtype=jnp.float32)
    return zeros, zeros


def zero_carries(config: GNMTConfig, like: jax.Array) -> tuple[Carry, ...]:
    """The decoder's initial states, zeros for each of its layers; ``like`` is any ``[batch, ...]``
    array of the batch (see ``_zero_state``)."""
    return tuple(_zero_state(like, config.hidden) for _ in range(config.num_layers))


class LSTM(nn.Module):
    """One LSTM layer over a sequence: ``x [B, T, F] -> (h [B, T, H], final (c, h))``.

    ``mask [B, T]`` (True for real tokens) freezes the state and zeroes the output at padding, so a
    ``reverse`` layer starts at each sequence's last real token (PyTorch's packed sequences).
    """

    features: int
    dtype: Any
    param_dtype: Any
    init_scale: float
    reverse: bool = False
    unroll: bool = False

    @nn.compact
    def __call__(self, x, carry: Carry | None = None, mask=None):
        batch, length = x.shape[:2]
        init = _uniform(self.init_scale)
        gates_x = nn.Dense(
            4 * self.features,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=init,
            bias_init=init,
            name="input",
        )(x)
        recurrent = self.param("recurrent_kernel", init, (self.features, 4 * self.features), self.param_dtype)
        recurrent = recurrent.astype(self.dtype)
        if carry is None:
            carry = _zero_state(x, self.features)
        if mask is None:
            mask = jnp.ones((batch, length), bool)

        def step(carry, inputs):
            gx, keep = inputs
            c, h = carry
            z = gx.astype(jnp.float32) + jnp.dot(h.astype(self.dtype), recurrent).astype(jnp.float32)
            i, f, g, o = jnp.split(z, 4, axis=-1)
            new_c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
            new_h = jax.nn.sigmoid(o) * jnp.tanh(new_c)
            keep = keep[:, None]
            new_c, new_h = jnp.where(keep, new_c, c), jnp.where(keep, new_h, h)
            return (new_c, new_h), jnp.where(keep, new_h, 0.0)

        carry, hs = jax.lax.scan(
            step, carry, (jnp.swapaxes(gates_x, 0, 1), mask.T), reverse=self.reverse, unroll=self.unroll
        )
        return jnp.swapaxes(hs, 0, 1), carry


class BahdanauAttention(nn.Module):
    """Normalized Bahdanau attention of the reference: ``score = (g v/|v|) . tanh(W_q q + W_k k + b)``.

    Returns the context (probabilities @ keys) ``[B, T, K]`` and the probabilities ``[B, T, S]``.
    """

    units: int
    dtype: Any
    param_dtype: Any
    init_scale: float

    @nn.compact
    def __call__(self, query, keys, key_mask):
        dense = lambda name: nn.Dense(  # noqa: E731
            self.units,
            use_bias=False,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=_uniform(self.init_scale),
            name=name,
        )
        q, k = dense("query")(query), dense("key")(keys)
        v = self.param("att", _uniform(self.init_scale), (self.units,), self.param_dtype)
        scalar = self.param(
            "normalize_scalar", nn.initializers.constant(1 / math.sqrt(self.units)), (1,), self.param_dtype
        )
        bias = self.param("normalize_bias", nn.initializers.zeros_init(), (self.units,), self.param_dtype)
        v = v * (scalar / jnp.sqrt(jnp.sum(jnp.square(v))))
        hidden = jnp.tanh(q[:, :, None, :] + k[:, None, :, :] + bias.astype(self.dtype))  # [B, T, S, U]
        scores = jnp.einsum("btsu,u->bts", hidden, v.astype(self.dtype)).astype(jnp.float32)
        scores = jnp.where(key_mask[:, None, :], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1)
        context = jnp.einsum("bts,bsk->btk", probs.astype(self.dtype), keys.astype(self.dtype))
        return context, probs


class Encoder(nn.Module):
    config: GNMTConfig
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x, mask, train: bool = False):
        cfg = self.config
        drop = nn.Dropout(cfg.dropout, deterministic=not train)

        def lstm(name, reverse=False):
            return LSTM(cfg.hidden, self.dtype, self.param_dtype, cfg.init_scale, reverse, cfg.unroll, name=name)

        x = drop(x)
        forward, _ = lstm("layer0_fwd")(x, mask=mask)
        backward, _ = lstm("layer0_bwd", reverse=True)(x, mask=mask)
        x, _ = lstm("layer1")(drop(jnp.concatenate([forward, backward], axis=-1)))
        for i in range(2, cfg.num_layers):
            x = x + lstm(f"layer{i}")(drop(x))[0]
        return x


class Decoder(nn.Module):
    config: GNMTConfig
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, y, encoded, enc_mask, carries, train: bool = False):
        cfg = self.config
        drop = nn.Dropout(cfg.dropout, deterministic=not train)
        lstm = lambda name: LSTM(cfg.hidden, self.dtype, self.param_dtype, cfg.init_scale, unroll=cfg.unroll, name=name)  # noqa: E731
        x, carry = lstm("layer0")(y, carries[0])
        new = [carry]
        context, probs = BahdanauAttention(cfg.hidden, self.dtype, self.param_dtype, cfg.init_scale, name="attention")(
            x, encoded, enc_mask
        )
        x, carry = lstm("layer1")(drop(jnp.concatenate([x, context.astype(x.dtype)], axis=-1)), carries[1])
        new.append(carry)
        for i in range(2, cfg.num_layers):
            out, carry = lstm(f"layer{i}")(drop(jnp.concatenate([x, context.astype(x.dtype)], axis=-1)), carries[i])
            x = x + out
            new.append(carry)
        init = _uniform(cfg.init_scale)
        logits = nn.Dense(
            cfg.vocab_size,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=init,
            bias_init=init,
            name="classifier",
        )(x)
        return logits, tuple(new), probs


class GNMT(nn.Module):
    """``apply(variables, inputs, decoder_inputs) -> logits [B, T, vocab]`` (teacher forcing)."""

    config: GNMTConfig
    policy: Policy

    def setup(self):
        cfg, dt, pdt = self.config, self.policy.compute_dtype, self.policy.param_dtype
        self.embed = nn.Embed(
            cfg.vocab_size, cfg.hidden, dtype=dt, param_dtype=pdt, embedding_init=_uniform(cfg.init_scale)
        )
        self.encoder = Encoder(cfg, dt, pdt)
        self.decoder = Decoder(cfg, dt, pdt)

    def encode(self, inputs, train: bool = False):
        """``inputs [B, S]`` -> (encoder outputs ``[B, S, H]``, mask of real tokens ``[B, S]``)."""
        mask = inputs != PAD
        return self.encoder(self.embed(inputs), mask, train), mask

    def decode(self, tokens, encoded, enc_mask, carries=None, train: bool = False):
        """``tokens [B, T]`` from ``carries`` (default zeros) -> (logits, new carries, attention probs)."""
        if carries is None:
            carries = zero_carries(self.config, tokens)
        return self.decoder(self.embed(tokens), encoded, enc_mask, carries, train)

    def __call__(self, inputs, decoder_inputs, train: bool = False):
        """``train``: apply dropout (needs a ``dropout`` rng)."""
        encoded, mask = self.encode(inputs, train)
        return self.decode(decoder_inputs, encoded, mask, train=train)[0]


def greedy_decode(model: GNMT, variables, inputs, length: int):
    """Greedy decoding for ``length`` steps from ``BOS``: ``[B, length]`` int32 tokens (jit-able)."""
    encoded, mask = model.apply(variables, inputs, method=GNMT.encode)

    def step(carry, _):
        carries, token = carry
        logits, carries, _ = model.apply(variables, token[:, None], encoded, mask, carries, method=GNMT.decode)
        token = jnp.argmax(logits[:, 0].astype(jnp.float32), axis=-1).astype(jnp.int32)
        return (carries, token), token

    start = (zero_carries(model.config, inputs), jnp.full_like(inputs[:, 0], BOS, dtype=jnp.int32))
    _, tokens = jax.lax.scan(step, start, None, length=length, unroll=model.config.unroll)
    return tokens.T


def _schedule_steps(config: GNMTConfig, total_steps: int) -> tuple[int, int, int]:
    """(first decay step, steps between decays, warm-up steps) of a run of ``total_steps``."""
    start = int(round(config.decay_start * total_steps))
    return start, max((total_steps - start) // config.decay_steps, 1), min(config.warmup_steps, start)


def learning_rate_schedule(config: GNMTConfig, total_steps: int) -> optax.Schedule:
    """The reference's ``WarmupMultiStepLR``: exponential warm-up from 1 % to the peak, constant,
    then ``decay_steps`` multiplications by ``decay_factor``, the first at ``decay_start`` of the
    run and then every ``(total - start) // decay_steps`` steps."""
    peak = config.learning_rate
    start, interval, warmup = _schedule_steps(config, total_steps)
    decays = {start - warmup + k * interval: config.decay_factor for k in range(config.decay_steps)}
    after = optax.piecewise_constant_schedule(peak, decays)
    if warmup == 0:
        return after
    rise = optax.exponential_decay(0.01 * peak, transition_steps=warmup, decay_rate=100.0, end_value=peak)
    return optax.join_schedules([rise, after], [warmup])


def make_optimizer(config: GNMTConfig, total_steps: int) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(config.grad_clip),
        optax.adam(learning_rate_schedule(config, total_steps)),
    )


def hparams(config: GNMTConfig, total_steps: int) -> dict:
    """The recipe under mllog's standard keys (Adam, warm-up, step decay, gradient clipping)."""
    start, interval, warmup = _schedule_steps(config, total_steps)
    return {
        C.OPT_NAME: C.ADAM,
        C.OPT_BASE_LR: config.learning_rate,
        C.OPT_LR_WARMUP_STEPS: warmup,
        C.OPT_LR_DECAY_START_STEP: start,
        C.OPT_LR_DECAY_INTERVAL: interval,
        C.OPT_LR_DECAY_FACTOR: config.decay_factor,
        C.OPT_LR_DECAY_STEPS: config.decay_steps,
        C.OPT_GRADIENT_CLIP_NORM: config.grad_clip,
        "label_smoothing": config.label_smoothing,
    }


def per_example_losses(logits, targets, label_smoothing: float):
    """Label-smoothed cross entropy summed over each sentence's non-padding tokens, and the
    teacher-forced token accuracy over them."""
    logits = logits.astype(jnp.float32)
    labels = optax.smooth_labels(jax.nn.one_hot(targets, logits.shape[-1], dtype=jnp.float32), label_smoothing)
    token_loss = optax.softmax_cross_entropy(logits, labels)
    real = (targets != PAD).astype(jnp.float32)
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return {
        "loss": jnp.sum(token_loss * real, axis=-1),
        "accuracy": jnp.sum(correct * real, axis=-1) / jnp.maximum(jnp.sum(real, axis=-1), 1.0),
    }


def _make_model(config: GNMTConfig, policy: Policy, bn_axis: str | None) -> GNMT:
    del bn_axis
    return GNMT(config, policy)


def _batch_shapes(config: GNMTConfig, global_batch: int):
    shape = (global_batch, config.max_len)
    return {"inputs": jax.ShapeDtypeStruct(shape, jnp.int32), "targets": jax.ShapeDtypeStruct(shape, jnp.int32)}


def _make_data(config: GNMTConfig, seed: int):
    if config.train_size == 0:
        raise ValueError(
            "the MLPerf GNMT data set (WMT16 English-German) does not ship with podscale; use --config tiny "
            "(the full config is only traced and compiled)"
        )
    train = ReversedTokens(config.train_size, config.max_len, config.vocab_size, seed=seed)
    held_out = ReversedTokens(config.eval_size, config.max_len, config.vocab_size, seed=seed + 1)
    return train, held_out


def _init(model: GNMT, rng, batch):
    inputs = jnp.zeros(batch["inputs"].shape, jnp.int32)
    targets = jnp.zeros(batch["targets"].shape, jnp.int32)
    return model.init(rng, inputs, shift_right(targets), train=False)


def _train_loss(model: GNMT, variables, batch, rng=None):
    """Training mode; ``rng`` is the dropout key (``None``: no dropout)."""
    rngs = {} if rng is None else {"dropout": rng}
    logits = model.apply(variables, batch["inputs"], shift_right(batch["targets"]), train=rng is not None, rngs=rngs)
    return per_example_losses(logits, batch["targets"], model.config.label_smoothing), {}


def _eval_metrics(model: GNMT, variables, batch):
    targets = batch["targets"]
    logits = model.apply(variables, batch["inputs"], shift_right(targets), train=False)
    per = per_example_losses(logits, targets, model.config.label_smoothing)
    decoded = greedy_decode(model, variables, batch["inputs"], targets.shape[1])
    right = (decoded == targets) | (targets == PAD)
    per["exact_match"] = jnp.all(right, axis=-1).astype(jnp.float32)
    return per


WORKLOAD = Workload(
    name="gnmt",
    description="GNMT v2 (MLPerf rnn_translator): 4+4 LSTM layers of 1024, bidirectional first encoder layer, "
    "normalized Bahdanau attention",
    configs={"full": FULL, "tiny": TINY},
    reference=Reference(
        params=160_671_297,
        source="GNMT v2 as in the MLPerf rnn_translator reference (hidden 1024, 4+4 layers, shared 32,320-token "
        "embedding): 160,671,297 trainable parameters, MLBench 'NLP Translation tasks, results discussion' "
        "(mlbench.github.io, 2020-10-02); the same sum follows from the reference's seq2seq/models "
        "(encoder.py, decoder.py, attention.py)",
    ),
    make_model=_make_model,
    batch_shapes=_batch_shapes,
    make_data=_make_data,
    make_optimizer=make_optimizer,
    hparams=hparams,
    init=_init,
    train_loss=_train_loss,
    eval_metrics=_eval_metrics,
    eval_metric="exact_match",
)

__all__ = ["FULL", "GNMT", "TINY", "WORKLOAD", "GNMTConfig", "greedy_decode", "learning_rate_schedule", "zero_carries"]
