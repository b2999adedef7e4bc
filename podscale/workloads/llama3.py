"""Llama 3.1 decoders (8B and 70B) pre-trained as MaxText trains them on TPU pods.

The architecture is Llama 3.1's (Meta, "The Llama 3 Herd of Models", arXiv 2407.21783, Table 3;
the released ``config.json`` of ``meta-llama/Llama-3.1-8B`` and ``-70B``): a decoder of pre-norm
blocks, RMSNorm (epsilon 1e-5) before attention and before the MLP and once at the end; rotary
position embeddings (base 500,000) with Llama 3.1's frequency scaling (``rope_type: llama3``:
factor 8, low-frequency factor 1, high-frequency factor 4, original context 8192: wavelengths
longer than 8192 / 1 positions are divided by 8, shorter than 8192 / 4 kept, the band between
interpolated); grouped-query attention (8 key/value heads shared by the query heads), no biases;
a SwiGLU MLP (``down(silu(gate(x)) * up(x))``); untied input embeddings and output projection over
Llama 3's 128,256-token vocabulary. The layers are one ``nn.scan`` (parameters stacked on a
leading axis), as MaxText's ``scan_layers: True``.

Counted (``WORKLOAD.param_count("full")``): 8B has 2 x 525,336,576 embedding and output weights +
32 layers x 218,112,000 + 4,096 = 8,030,261,248 parameters (published: 8.03B); 70B has 2 x
1,050,673,152 + 80 x 855,654,400 + 8,192 = 70,553,706,496 (published: 70.6B).

Precision is the workloads' policy: float32 master weights and optimizer state; bfloat16 matrix
products and residual stream; RMSNorm, softmax and the loss computed in float32 (MaxText's
``weight_dtype: float32``, ``dtype: bfloat16``). Attention is a plain JAX function
(:func:`causal_attention`: two einsums and a float32 softmax under a causal mask, the queries in
checkpointed blocks of ``attention_chunk``). A fused kernel (splash or flash attention) would keep
each block's logits in VMEM instead of HBM and skip the blocks above the diagonal (half the
attention FLOPs here are masked away); the projection would then cost it as one custom call whose
FLOPs and bytes XLA:TPU does not report, so they would have to be supplied.

``remat`` is MaxText's ``remat_policy`` as a config choice: ``"none"`` (every activation kept for
the backward pass), ``"per-layer"`` (each scanned layer checkpointed, its matrix products' outputs
saved and the rest recomputed: MaxText's ``minimal``), ``"full"`` (each layer recomputed from its
input: MaxText's ``full``, its default) or ``"offload"`` (as ``full``, with each layer's input,
named ``decoder_layer_input`` as MaxText names it, moved to host memory between the passes: the
``decoder_layer_input: offload`` of MaxText's ``custom`` policy; config ``full-offload``).

The full configs' recipe is MaxText's (``MaxText/configs/base.yml``, which its Llama 3.1 configs and
the tpu-recipes runs inherit): AdamW (beta1 0.9, beta2 0.95, epsilon 1e-8, weight decay 0.1),
gradients clipped to global norm 1.0, learning rate 3e-5 reached by a linear warmup over the first
10% of the steps, then a cosine decay to 10% of it (Llama 2's schedule shape, arXiv 2307.09288
Sec. 2.2), sequences of 8192 tokens, 4 per chip (the per-device batch of the v6e runs this
workload projects; global batch 1024 at 256 chips).

The tiny config is the same architecture (hidden 64, 2 layers, 4 query and 2 key/value heads, MLP
128) on a planted copy task (:class:`CopyTokens`): a sequence is ``BOS``, ``span`` random content
tokens, then the same tokens again. The second half is a function of the first, so the rule that
made it (the teacher) predicts every copied token; nothing predicts the random first half better
than chance (1 / 30 here). The metric is the held-out next-token accuracy on the copied half; the
recipe (AdamW, warmup 10%, cosine to 10%, clipping 1.0) at a peak of 3e-3 reaches 0.99 on 8 CPU
replicas at step 70 of 64 sequences (6 s here; the same under ``--weight-update fsdp``)::

    podscale train --model llama3-8b --config tiny --steps 300 --eval-every 50 --target 0.99 --no-progress
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.ad_checkpoint import checkpoint_name
from mlperf_logging.mllog import constants as C

from podscale.workloads.base import Reference, Workload
from podscale.workloads.datasets import hash_uniform
from podscale.workloads.precision import Policy

PAD, BOS = 0, 1
"""Reserved token ids of the tiny task; content tokens are ``2 .. vocab_size - 1``."""
REMAT = ("none", "per-layer", "full", "offload")

_MAXTEXT = (
    "MaxText MaxText/configs/base.yml (AI-Hypercomputer/maxtext; its llama3.1 configs and tpu-recipes inherit it): "
    "AdamW(0.9, 0.95, 1e-8, weight decay 0.1), clip 1.0, lr 3e-5, linear warmup 10% of steps, cosine to 10%; "
    "sequence 8192, 4 per chip"
)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """One Llama config: model size, sequence, recipe and (tiny) data size."""

    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    """Key/value heads (grouped-query attention: ``heads / kv_heads`` query heads share one)."""
    mlp: int
    """Width of the SwiGLU MLP."""
    length: int
    """Tokens a training sequence is predicted from (the model's input length)."""
    global_batch: int
    per_core_batch: int
    train_steps: int
    learning_rate: float
    """Peak learning rate, reached at the end of the warmup."""
    source: str
    warmup_fraction: float = 0.1
    final_fraction: float = 0.1
    """The cosine decay ends at this fraction of the peak."""
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    norm_eps: float = 1e-5
    rope_theta: float = 500_000.0
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_length: int = 8192
    remat: str = "full"
    """MaxText's ``remat_policy``: ``none``, ``per-layer`` (its ``minimal``), ``full`` or ``offload``."""
    attention_chunk: int = 512
    """Queries per block of the attention (0: all at once); see :func:`causal_attention`."""
    loss_chunk: int = 1024
    """Positions per block of the output projection and the loss (0: all at once); see :class:`Output`."""
    span: int = 0
    """Tiny config: random tokens that are then copied (0: no bundled data)."""
    train_size: int = 0
    eval_size: int = 0

    def __post_init__(self):
        if self.remat not in REMAT:
            raise ValueError(f"LlamaConfig.remat={self.remat!r}: choose one of {', '.join(REMAT)}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(
                f"LlamaConfig: heads={self.heads} must divide hidden={self.hidden} and kv_heads={self.kv_heads} "
                "must divide heads"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


FULL_8B = LlamaConfig(
    vocab_size=128_256,
    hidden=4096,
    layers=32,
    heads=32,
    kv_heads=8,
    mlp=14_336,
    length=8192,
    global_batch=1024,
    per_core_batch=4,
    train_steps=150_000,
    learning_rate=3e-5,
    source=_MAXTEXT + "; model: Llama 3.1 8B config.json (hidden 4096, 32 layers, 32/8 heads, MLP 14336)",
)
FULL_70B = dataclasses.replace(
    FULL_8B,
    hidden=8192,
    layers=80,
    heads=64,
    mlp=28_672,
    source=_MAXTEXT + "; model: Llama 3.1 70B config.json (hidden 8192, 80 layers, 64/8 heads, MLP 28672)",
)
TINY = LlamaConfig(
    vocab_size=32,
    hidden=64,
    layers=2,
    heads=4,
    kv_heads=2,
    mlp=128,
    length=16,
    global_batch=64,
    per_core_batch=8,
    train_steps=300,
    learning_rate=3e-3,
    remat="per-layer",
    attention_chunk=8,
    loss_chunk=8,
    span=8,
    train_size=1 << 16,
    eval_size=512,
    source="tiny: the full architecture at hidden 64, 2 layers, 4/2 heads, MLP 128, on CopyTokens (8 random tokens "
    "then the same 8), MaxText's recipe shape (AdamW 0.9/0.95/1e-8, wd 0.1, clip 1.0, warmup 10%, cosine to 10%) "
    "at a peak of 3e-3",
)


# ----------------------------------------------------------------------------------------------
# Model


def rope_frequencies(cfg: LlamaConfig) -> np.ndarray:
    """Llama 3.1's rotary inverse frequencies (``rope_type: llama3``), float64 ``[head_dim / 2]``:
    base ``rope_theta``; wavelengths over ``original / low_freq_factor`` positions divided by
    ``factor``, under ``original / high_freq_factor`` kept, interpolated between."""
    d = cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    wavelength = 2 * math.pi / inv
    low, high = (
        cfg.rope_original_length / cfg.rope_low_freq_factor,
        cfg.rope_original_length / cfg.rope_high_freq_factor,
    )
    smooth = (cfg.rope_original_length / wavelength - cfg.rope_low_freq_factor) / (
        cfg.rope_high_freq_factor - cfg.rope_low_freq_factor
    )
    scaled = np.where(wavelength > low, inv / cfg.rope_factor, inv)
    between = (wavelength >= high) & (wavelength <= low)
    return np.where(between, (1 - smooth) * inv / cfg.rope_factor + smooth * inv, scaled)


def rotate(x, positions, cfg: LlamaConfig):
    """Rotary embedding of ``x`` [B, T, heads, head_dim] at ``positions`` [T], in float32: the two
    halves of each head's dimensions are a rotation's pairs (``rotate_half``)."""
    angles = positions[:, None].astype(jnp.float32) * jnp.asarray(rope_frequencies(cfg), jnp.float32)[None, :]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1).astype(x.dtype)


class RMSNorm(nn.Module):
    """``x / rms(x) * scale``, computed in float32, returned in ``x``'s dtype."""

    eps: float
    policy: Policy

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.policy.param_dtype)
        y = x.astype(jnp.float32)
        return (y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + self.eps) * scale).astype(x.dtype)


_KERNEL_INIT = nn.initializers.normal(stddev=0.02)


def over_blocks(fn, arrays, chunk: int, field: str):
    """``fn(*blocks, start)`` over consecutive blocks of ``chunk`` positions (dimension 1 of each
    of ``arrays``) in a ``lax.map`` whose body is checkpointed, so one block's intermediates are
    live at a time, forward and backward; its outputs (a tuple, or one array) joined back along
    dimension 1. ``chunk`` 0 (or the whole length): ``fn`` once on the whole arrays. ``field``
    names the config field a ``chunk`` that does not divide the length came from."""
    length = arrays[0].shape[1]
    if not chunk or chunk >= length:
        return fn(*arrays, 0)
    if length % chunk:
        raise ValueError(f"LlamaConfig.{field}={chunk} must divide the sequence length {length}")

    def split(a):
        return a.reshape(a.shape[0], length // chunk, chunk, *a.shape[2:]).swapaxes(0, 1)

    def join(a):
        return a.swapaxes(0, 1).reshape(a.shape[1], length, *a.shape[3:])

    out = jax.lax.map(jax.checkpoint(lambda args: fn(*args)), (*map(split, arrays), jnp.arange(0, length, chunk)))
    return jax.tree.map(join, out)


def causal_attention(q, k, v, chunk: int):
    """Causal grouped-query attention, a plain JAX function: ``q`` [B, T, kv, group, D] (scaled),
    ``k`` and ``v`` [B, T, kv, D]; softmax in float32. With ``chunk`` (a divisor of T), the queries
    go in blocks of ``chunk`` through a ``lax.map`` whose body is checkpointed: one block's
    ``[B, kv, group, chunk, T]`` logits are live at a time, forward and backward, instead of the
    whole ``[.., T, T]`` (37 GB per layer for 8B at 4 x 8192 tokens)."""
    length = q.shape[1]

    def block(qb, start):
        logits = jnp.einsum("btkgd,bskd->bkgts", qb, k).astype(jnp.float32)
        rows = start + jnp.arange(qb.shape[1])
        logits = jnp.where(rows[:, None] >= jnp.arange(length)[None, :], logits, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        return jnp.einsum("bkgts,bskd->btkgd", probs, v)

    return over_blocks(block, (q,), chunk, "attention_chunk")


class Attention(nn.Module):
    """Grouped-query causal self-attention with rotary positions, no biases."""

    cfg: LlamaConfig
    policy: Policy

    @nn.compact
    def __call__(self, x):
        cfg, p = self.cfg, self.policy
        dense = dict(use_bias=False, kernel_init=_KERNEL_INIT, dtype=p.compute_dtype, param_dtype=p.param_dtype)
        d, group = cfg.head_dim, cfg.heads // cfg.kv_heads
        positions = jnp.arange(x.shape[1])
        q = rotate(nn.DenseGeneral((cfg.heads, d), **dense, name="query")(x), positions, cfg)
        k = rotate(nn.DenseGeneral((cfg.kv_heads, d), **dense, name="key")(x), positions, cfg)
        v = nn.DenseGeneral((cfg.kv_heads, d), **dense, name="value")(x)
        q = q.reshape(*q.shape[:2], cfg.kv_heads, group, d) * jnp.asarray(d**-0.5, q.dtype)
        out = causal_attention(q, k, v, cfg.attention_chunk).reshape(*x.shape[:2], cfg.heads, d)
        return nn.DenseGeneral(cfg.hidden, axis=(-2, -1), **dense, name="out")(out)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    cfg: LlamaConfig
    policy: Policy

    @nn.compact
    def __call__(self, x):
        dense = dict(
            use_bias=False,
            kernel_init=_KERNEL_INIT,
            dtype=self.policy.compute_dtype,
            param_dtype=self.policy.param_dtype,
        )
        h = nn.silu(nn.Dense(self.cfg.mlp, name="gate", **dense)(x)) * nn.Dense(self.cfg.mlp, name="up", **dense)(x)
        return nn.Dense(self.cfg.hidden, name="down", **dense)(h)


class DecoderLayer(nn.Module):
    """``x + Attention(RMSNorm(x))``, then ``x + MLP(RMSNorm(x))``."""

    cfg: LlamaConfig
    policy: Policy

    @nn.compact
    def __call__(self, x, _):
        cfg, p = self.cfg, self.policy
        x = checkpoint_name(x, "decoder_layer_input")  # MaxText's name: what ``remat="offload"`` moves to host
        x = x + Attention(cfg, p, name="attention")(RMSNorm(cfg.norm_eps, p, name="attention_norm")(x))
        x = x + MLP(cfg, p, name="mlp")(RMSNorm(cfg.norm_eps, p, name="mlp_norm")(x))
        return x, None


_POLICIES = {
    "none": None,
    "per-layer": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    "full": jax.checkpoint_policies.nothing_saveable,
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=["decoder_layer_input"],
        offload_src="device",
        offload_dst="pinned_host",
    ),
}


class Llama(nn.Module):
    """Token embedding, the scanned decoder layers, a final RMSNorm and an untied output projection."""

    cfg: LlamaConfig
    policy: Policy

    @nn.compact
    def __call__(self, tokens, targets=None):
        """Logits ``[B, T, vocab]`` in ``compute_dtype``; position ``t`` sees ``tokens[:, :t+1]``.
        With ``targets`` [B, T]: each position's float32 cross-entropy and whether its argmax is the
        target, ``([B, T], [B, T])``, the logits made ``loss_chunk`` positions at a time
        (:class:`Output`)."""
        cfg, p = self.cfg, self.policy
        table = self.param(
            "embedding", nn.initializers.normal(stddev=0.02), (cfg.vocab_size, cfg.hidden), p.param_dtype
        )
        # The residual stream in compute_dtype, as MaxText's activations (``dtype: bfloat16``);
        # RMSNorm and the sums inside softmax in float32.
        x = jnp.take(table, tokens, axis=0).astype(p.compute_dtype)
        layer = DecoderLayer
        if cfg.remat != "none":
            layer = nn.remat(DecoderLayer, policy=_POLICIES[cfg.remat], prevent_cse=False)
        stack = nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=cfg.layers)
        x, _ = stack(cfg, p, name="layers")(x, None)
        x = RMSNorm(cfg.norm_eps, p, name="final_norm")(x)
        return Output(cfg, p, name="output")(x, targets)


class Output(nn.Module):
    """The untied output projection (``kernel`` [hidden, vocab], as ``nn.Dense``'s) and, given
    targets, the loss: over blocks of ``loss_chunk`` positions in a ``lax.map`` whose body is
    checkpointed, so one block's ``[B, chunk, vocab]`` logits are live at a time (the whole
    sequence's are 7.8 GB in bfloat16 and 15.7 GB in float32 at 4 x 8192 tokens of Llama 3's
    128,256-token vocabulary), as MaxText's vocabulary tiling."""

    cfg: LlamaConfig
    policy: Policy

    @nn.compact
    def __call__(self, x, targets=None):
        cfg, p = self.cfg, self.policy
        kernel = self.param("kernel", _KERNEL_INIT, (cfg.hidden, cfg.vocab_size), p.param_dtype)
        w = kernel.astype(p.compute_dtype)

        def logits_of(xb):
            return jnp.einsum("bth,hv->btv", xb.astype(p.compute_dtype), w)

        if targets is None:
            return logits_of(x)

        def block(xb, tb, start):
            del start
            logits = logits_of(xb)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tb)
            return loss, (jnp.argmax(logits, -1) == tb).astype(jnp.float32)

        return over_blocks(block, (x, targets), cfg.loss_chunk, "loss_chunk")


def make_model(cfg: LlamaConfig, policy: Policy, bn_axis: str | None = None) -> Llama:
    del bn_axis  # no batch norm
    return Llama(cfg, policy)


# ----------------------------------------------------------------------------------------------
# Data, loss, metrics, recipe


class CopyTokens:
    """``tokens`` [N, 2 span + 1] int32: ``BOS``, ``span`` random content tokens, the same again.

    Each example is a pure function of ``(seed, index)``; the copied half is what can be learnt.
    """

    def __init__(self, size: int, span: int, vocab_size: int, seed: int = 0):
        if vocab_size < 3 or span < 1:
            raise ValueError(f"CopyTokens: vocab_size {vocab_size}, span {span}: needs content tokens and a span >= 1")
        self.size, self.span, self.vocab_size, self.seed = size, span, vocab_size, seed

    def __len__(self) -> int:
        return self.size

    def get(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        indices = np.asarray(indices)
        flat = indices[:, None].astype(np.uint64) * np.uint64(self.span) + np.arange(self.span, dtype=np.uint64)
        prefix = 2 + (hash_uniform(self.seed, flat, stream=21) * (self.vocab_size - 2)).astype(np.int64)
        bos = np.full((len(indices), 1), BOS, np.int64)
        return {"tokens": np.concatenate([bos, prefix, prefix], axis=1).astype(np.int32)}


def batch_shapes(cfg: LlamaConfig, global_batch: int) -> dict[str, jax.ShapeDtypeStruct]:
    return {"tokens": jax.ShapeDtypeStruct((global_batch, cfg.length + 1), jnp.int32)}


def make_data(cfg: LlamaConfig, seed: int):
    if not cfg.train_size:
        raise ValueError(
            "Llama 3.1's pre-training corpus does not ship with podscale; the full configs are for compiling, "
            "planning and projecting. Train with --config tiny (a planted copy task)"
        )
    if 2 * cfg.span != cfg.length:
        raise ValueError(f"LlamaConfig: length={cfg.length} must be twice span={cfg.span} (BOS, the span, its copy)")
    return (
        CopyTokens(cfg.train_size, cfg.span, cfg.vocab_size, seed=seed),
        CopyTokens(cfg.eval_size, cfg.span, cfg.vocab_size, seed=seed + 1),
    )


def init(model: Llama, rng: jax.Array, batch) -> dict:
    return model.init(rng, jnp.asarray(batch["tokens"])[:, :-1])


def _per_example(cfg: LlamaConfig, loss, correct) -> dict[str, jax.Array]:
    """Mean next-token cross-entropy (float32) over every position; ``accuracy``: the next token
    predicted on the copied half (the tiny task's planted part; the whole sequence without one)."""
    start = correct.shape[1] - cfg.span if cfg.span else 0
    return {"loss": loss.mean(-1), "accuracy": correct[:, start:].mean(-1)}


def train_loss(model: Llama, variables: dict, batch, rng: jax.Array | None = None):
    del rng  # no dropout (Llama 3 pre-training uses none)
    tokens = batch["tokens"]
    loss, correct = model.apply(variables, tokens[:, :-1], tokens[:, 1:])
    return _per_example(model.cfg, loss, correct), {}


def eval_metrics(model: Llama, variables: dict, batch):
    return train_loss(model, variables, batch)[0]


def learning_rate_schedule(cfg: LlamaConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 over ``warmup_fraction`` of the steps, then a cosine decay to
    ``final_fraction`` of the peak at ``total_steps`` (MaxText's schedule)."""
    warmup = max(1, int(cfg.warmup_fraction * total_steps))
    return optax.warmup_cosine_decay_schedule(
        0.0, cfg.learning_rate, warmup, max(total_steps, warmup + 1), cfg.learning_rate * cfg.final_fraction
    )


def make_optimizer(cfg: LlamaConfig, total_steps: int) -> optax.GradientTransformation:
    """AdamW on the warmup + cosine schedule after clipping to global norm ``clip_norm``."""
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(
            learning_rate_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay
        ),
    )


def hparams(cfg: LlamaConfig, total_steps: int) -> dict:
    return {
        C.OPT_NAME: C.ADAM,
        C.OPT_BASE_LR: cfg.learning_rate,
        C.OPT_LR_WARMUP_STEPS: max(1, int(cfg.warmup_fraction * total_steps)),
        C.OPT_ADAM_BETA_1: cfg.b1,
        C.OPT_ADAM_BETA_2: cfg.b2,
        C.OPT_ADAM_EPSILON: cfg.eps,
        "opt_weight_decay": cfg.weight_decay,
        "opt_gradient_clip_norm": cfg.clip_norm,
        "opt_end_learning_rate": cfg.learning_rate * cfg.final_fraction,
    }


def tokens_per_example(cfg: LlamaConfig) -> int:
    """Tokens one training example predicts (throughput in tokens per second)."""
    return cfg.length


def _workload(name: str, full: LlamaConfig, params: int, size: str) -> Workload:
    return Workload(
        name=name,
        mlperf_name=name,
        description=f"Llama 3.1 {size} decoder, MaxText's pre-training recipe (sequence 8192)",
        # "full-offload": the full size with each layer's input offloaded to host memory between
        # the passes (remat="offload"), as the tpu-recipes' v6e runs of these models do.
        configs={"full": full, "full-offload": dataclasses.replace(full, remat="offload"), "tiny": TINY},
        reference=Reference(
            params=params,
            source=f"Meta, Llama 3.1 model card and arXiv 2407.21783 Table 3: {size} ({params / 1e9:.2f}B parameters)",
        ),
        make_model=make_model,
        batch_shapes=batch_shapes,
        make_data=make_data,
        make_optimizer=make_optimizer,
        init=init,
        train_loss=train_loss,
        eval_metrics=eval_metrics,
        eval_metric="accuracy",
        hparams=hparams,
        tokens_per_example=tokens_per_example,
        # MaxText's recipe is FSDP over the slice; sharded (weights whole on every chip) beside it
        # shows why: its float32 weights alone are 32 GB at 8B
        project_strategies=("sharded", "fsdp"),
    )


LLAMA3_8B = _workload("llama3-8b", FULL_8B, 8_030_000_000, "8B")
LLAMA3_70B = _workload("llama3-70b", FULL_70B, 70_600_000_000, "70B")
