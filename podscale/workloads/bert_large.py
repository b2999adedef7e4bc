"""BERT-large masked-LM pre-training (MLPerf Training "bert"), trained with LAMB.

The model is BERT-large (Devlin et al. 2019, "BERT: Pre-training of Deep Bidirectional Transformers
for Language Understanding", arXiv 1810.04805): 24 post-layer-norm encoder layers, hidden 1024,
16 heads, intermediate 4096, GELU (tanh form, as ``modeling.py`` of google-research/bert), learned
position embeddings for 512 positions, 2 token types, layer-norm epsilon 1e-12, and the masked-LM
head (dense + GELU + layer norm, then the output projection tied to the word embeddings plus an
output bias). The pooler and the next-sentence head are left out: MLPerf's quality target is the
masked-LM accuracy and the count matches the paper without them (see ``REFERENCE``).

Counted parameters (``WORKLOAD.param_count("full")``): embeddings 31,782,912 (word 30,522 x 1,024,
position 512 x 1,024, token type 2 x 1,024, layer norm) + 24 layers x 12,596,224 + masked-LM head
1,082,170 = 335,174,458; the paper says 340M (-1.4%); HuggingFace's ``bert-large-uncased``
``BertModel`` (with pooler, without the masked-LM head) has 335,141,888.

The recipe is ``optax.lamb`` (beta1 0.9, beta2 0.999, epsilon 1e-6, weight decay 0.01 on kernels
and embedding tables only: layer-norm parameters and biases are excluded, as ``exclude_from_weight_
decay=["LayerNorm", "layer_norm", "bias"]`` in the MLPerf reference) with a linear warmup to the
peak learning rate and then a polynomial decay of power 1.0 to zero. The full config's numbers are
Google's MLPerf Training v0.7 BERT submission on TPU v4-512 (``mlcommons/training_results_v0.7``,
``Google/benchmarks/bert/tpu-v4-512-TF/run_and_time.sh``): ``--train_batch_size=3072
--num_tpu_cores=512`` (6 sequences per core) ``--learning_rate=0.0015 --num_warmup_steps=100
--num_train_steps=1141 --lamb_weight_decay_rate=0.01 --lamb_beta_1=0.9 --lamb_beta_2=0.999
--log_epsilon=-6 --max_seq_length=512 --max_predictions_per_seq=76``. Differences: MLPerf starts
from the reference checkpoint (``model.ckpt-28252``) with the warmup offset by
``--start_warmup_step=-76`` and decays from step 0; here the warmup starts at step 0 and the decay
starts where it ends (the usual optax ``join_schedules`` form). Dropout is MLPerf's (``modeling.py``:
``hidden_dropout_prob`` 0.1 after the embeddings' layer norm and on the attention and feed-forward
outputs before their residual adds, ``attention_probs_dropout_prob`` 0.1 on the attention
probabilities), drawn from the ``dropout`` key that ``train_loss`` is given. MLPerf's
next-sentence loss is not trained.

Batches: ``tokens`` [B, L] int32 (the [MASK] replacements already applied; ``PAD`` = 0 marks
padding, which attention ignores), ``positions`` [B, P] int32 (exactly P masked positions per
sequence, never padding, ascending) and ``targets`` [B, P] int32 (the original tokens there). Token
types are all zero and not part of the batch.

The tiny config (2 layers, hidden 64, 4 heads, L = 32, P = 5, vocabulary 64, batch 128, LAMB peak
0.03 after 50 warmup steps, MLPerf's dropout 0.1) trains on a synthetic corpus (:class:`MarkovText`): sequences from a
fixed random sparse Markov chain, so a masked token is predictable from its neighbours (the Bayes
accuracy is about 0.91) while always guessing the most frequent token scores about 0.045
(``unigram_baseline``). On 8 simulated CPU replicas it reaches 0.79 held-out masked-token accuracy
at step 400 (under a minute on two CPU cores; with dropout, the peak of 0.05 that trained it
without dropout in 300 steps collapses to the unigram guess over 600 or 800 steps; 0.04 reached
the target at step 350 with 0.752, too close to that edge; 0.02 at step 550)::

    podscale train --model bert-large --config tiny --steps 600 --eval-every 50 --target 0.75 --no-progress

The data-parallel step differs from the single-device one by more than float32 rounding early in
training: bias gradients are reduced in bfloat16 (one sum vs 8 partial sums), and LAMB turns the
difference into a step of up to the learning rate for zero-initialised biases (trust ratio 1) and
for the attention key bias, whose exact gradient is zero.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from mlperf_logging.mllog import constants as C

from podscale.workloads.base import Reference, Workload
from podscale.workloads.datasets import hash_uniform
from podscale.workloads.precision import Policy
from podscale.workloads.synthetic import BOS, PAD

MASK = 2
"""The [MASK] token id; content tokens of the synthetic corpus are ``3 .. vocab_size - 1``."""
_FIRST_CONTENT = 3

_MLPERF = (
    "MLPerf Training v0.7, Google BERT on TPU v4-512 (mlcommons/training_results_v0.7, "
    "Google/benchmarks/bert/tpu-v4-512-TF/run_and_time.sh): global batch 3072 on 512 cores, LAMB lr 0.0015, "
    "100 warmup steps, 1141 steps, weight decay 0.01, betas 0.9/0.999, eps 1e-6, seq 512, 76 predictions"
)


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """BERT encoder + masked-LM head, its LAMB recipe, and (tiny) the synthetic corpus."""

    global_batch: int
    per_core_batch: int
    train_steps: int
    source: str
    learning_rate: float
    """Peak learning rate, reached at the end of the warmup."""
    warmup_steps: int
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-6
    decay_power: float = 1.0
    """Power of the polynomial decay to zero after the warmup (1.0: linear, as MLPerf BERT)."""
    layers: int = 24
    hidden: int = 1024
    heads: int = 16
    intermediate: int = 4096
    vocab_size: int = 30522
    type_vocab_size: int = 2
    seq_len: int = 512
    """Sequence length L; also the number of learned positions."""
    num_predictions: int = 76
    """P: masked positions per sequence (MLPerf's ``max_predictions_per_seq``)."""
    layer_norm_eps: float = 1e-12
    init_std: float = 0.02
    dropout: float = 0.1
    """MLPerf's dropout rate on hidden states and attention probabilities (training only)."""
    train_size: int = 0
    """Synthetic corpus (tiny only): training sequences (0: no bundled data)."""
    eval_size: int = 0
    successors: int = 3
    """Synthetic corpus: successors per token in the Markov chain."""
    chain_seed: int = 1234
    """Synthetic corpus: the seed of the Markov chain (shared by train and eval)."""

    def __post_init__(self):
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        if not 0 < self.num_predictions < self.seq_len:
            raise ValueError(f"num_predictions {self.num_predictions} must be in 1 .. seq_len - 1 ({self.seq_len - 1})")


FULL = BertConfig(
    global_batch=3072,
    per_core_batch=6,
    train_steps=1141,
    source=_MLPERF,
    learning_rate=0.0015,
    warmup_steps=100,
)

TINY = BertConfig(
    global_batch=128,
    per_core_batch=16,
    train_steps=600,
    source="podscale tiny BERT on a synthetic Markov-chain corpus; recipe as " + _MLPERF,
    learning_rate=0.03,
    warmup_steps=50,
    layers=2,
    hidden=64,
    heads=4,
    intermediate=256,
    vocab_size=64,
    seq_len=32,
    num_predictions=5,
    train_size=65536,
    eval_size=1024,
)


# ---------------------------------------------------------------------------------------------
# Model


class _Attention(nn.Module):
    cfg: BertConfig
    policy: Policy

    @nn.compact
    def __call__(self, x, mask, train: bool):
        cfg, cd = self.cfg, self.policy.compute_dtype
        head_dim = cfg.hidden // cfg.heads
        dense = functools.partial(
            nn.DenseGeneral,
            dtype=cd,
            param_dtype=self.policy.param_dtype,
            kernel_init=nn.initializers.truncated_normal(cfg.init_std),
        )
        q = dense((cfg.heads, head_dim), name="query")(x) * jnp.asarray(head_dim**-0.5, cd)
        k = dense((cfg.heads, head_dim), name="key")(x)
        v = dense((cfg.heads, head_dim), name="value")(x)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(self.policy.accum_dtype)
        logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
        probs = jax.nn.softmax(logits, axis=-1).astype(cd)
        probs = nn.Dropout(cfg.dropout, deterministic=not train)(probs)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        return dense(cfg.hidden, axis=(-2, -1), name="output")(out)


class _Layer(nn.Module):
    """One post-layer-norm encoder layer: ``x = LN(x + attn(x)); x = LN(x + ffn(x))``."""

    cfg: BertConfig
    policy: Policy

    @nn.compact
    def __call__(self, x, mask, train: bool):
        cfg, cd, pd = self.cfg, self.policy.compute_dtype, self.policy.param_dtype
        dense = functools.partial(
            nn.Dense, dtype=cd, param_dtype=pd, kernel_init=nn.initializers.truncated_normal(cfg.init_std)
        )
        norm = functools.partial(nn.LayerNorm, epsilon=cfg.layer_norm_eps, dtype=cd, param_dtype=pd)
        drop = nn.Dropout(cfg.dropout, deterministic=not train)
        x = norm(name="attention_norm")(x + drop(_Attention(cfg, self.policy, name="attention")(x, mask, train)))
        y = dense(cfg.intermediate, name="intermediate")(x)
        y = dense(cfg.hidden, name="ffn_output")(nn.gelu(y))
        return norm(name="ffn_norm")(x + drop(y)), None


class Bert(nn.Module):
    """``(tokens [B, L], positions [B, P]) -> float32 logits [B, P, vocab]`` at the masked positions.

    Layer-norm parameters live in modules whose names end in ``_norm`` (``weight_decay_mask``).
    """

    cfg: BertConfig
    policy: Policy

    @nn.compact
    def __call__(self, tokens, positions, train: bool = False):
        """``train``: apply dropout (needs a ``dropout`` rng)."""
        cfg, cd, pd = self.cfg, self.policy.compute_dtype, self.policy.param_dtype
        init = nn.initializers.truncated_normal(cfg.init_std)
        norm = functools.partial(nn.LayerNorm, epsilon=cfg.layer_norm_eps, dtype=cd, param_dtype=pd)
        embed = functools.partial(nn.Embed, features=cfg.hidden, embedding_init=init, dtype=cd, param_dtype=pd)
        word = embed(cfg.vocab_size, name="word_embeddings")
        length = tokens.shape[1]
        x = (
            word(tokens)
            + embed(cfg.seq_len, name="position_embeddings")(jnp.arange(length)[None, :])
            + embed(cfg.type_vocab_size, name="type_embeddings")(jnp.zeros_like(tokens))
        )
        x = nn.Dropout(cfg.dropout, deterministic=not train)(norm(name="embeddings_norm")(x))
        mask = (tokens != PAD)[:, None, None, :]  # [B, heads, queries, keys]
        layers = nn.scan(
            _Layer,
            variable_axes={"params": 0},
            split_rngs={"params": True, "dropout": True},
            in_axes=(nn.broadcast, nn.broadcast),
            length=cfg.layers,
        )
        x, _ = layers(cfg, self.policy, name="layers")(x, mask, train)
        h = jnp.take_along_axis(x, positions[:, :, None], axis=1)  # [B, P, hidden]
        h = nn.Dense(cfg.hidden, dtype=cd, param_dtype=pd, kernel_init=init, name="mlm_dense")(h)
        h = norm(name="mlm_norm")(nn.gelu(h))
        logits = word.attend(h).astype(self.policy.accum_dtype)  # tied to the word embeddings
        return logits + self.param("mlm_bias", nn.initializers.zeros, (cfg.vocab_size,), pd)


def make_model(cfg: BertConfig, policy: Policy, bn_axis: str | None = None) -> Bert:
    del bn_axis  # no batch norm
    return Bert(cfg, policy)


def batch_shapes(cfg: BertConfig, global_batch: int) -> dict[str, jax.ShapeDtypeStruct]:
    return {
        "tokens": jax.ShapeDtypeStruct((global_batch, cfg.seq_len), jnp.int32),
        "positions": jax.ShapeDtypeStruct((global_batch, cfg.num_predictions), jnp.int32),
        "targets": jax.ShapeDtypeStruct((global_batch, cfg.num_predictions), jnp.int32),
    }


def init(model: Bert, rng: jax.Array, batch) -> dict:
    return model.init(rng, batch["tokens"], batch["positions"], train=False)


def _rngs(rng):
    return {} if rng is None else {"dropout": rng}


def _per_example(logits, targets) -> dict[str, jax.Array]:
    """Mean masked-LM loss and accuracy over each sequence's P positions (all sequences have P)."""
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean(-1)
    correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32).mean(-1)
    return {"loss": loss, "accuracy": correct}


def train_loss(model: Bert, variables: dict, batch, rng: jax.Array | None = None):
    """Training mode; ``rng`` is the dropout key (``None``: no dropout)."""
    logits = model.apply(variables, batch["tokens"], batch["positions"], train=rng is not None, rngs=_rngs(rng))
    return _per_example(logits, batch["targets"]), {}


def eval_metrics(model: Bert, variables: dict, batch):
    per = _per_example(model.apply(variables, batch["tokens"], batch["positions"], train=False), batch["targets"])
    return {"loss": per["loss"], "mlm_accuracy": per["accuracy"]}


# ---------------------------------------------------------------------------------------------
# Recipe


def weight_decay_mask(params):
    """True for kernels and embedding tables; False for biases and layer-norm scales and biases."""

    def decayed(path, _):
        names = [getattr(k, "key", str(k)) for k in path]
        return not (names[-1].endswith("bias") or any(n.endswith("_norm") for n in names))

    return jax.tree_util.tree_map_with_path(decayed, params)


def learning_rate_schedule(cfg: BertConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to ``learning_rate`` over ``warmup_steps`` (at most ``total_steps``),
    then a polynomial decay of power ``decay_power`` to 0 at ``total_steps``."""
    warmup = min(cfg.warmup_steps, total_steps)
    return optax.join_schedules(
        [
            optax.linear_schedule(0.0, cfg.learning_rate, warmup),
            optax.polynomial_schedule(cfg.learning_rate, 0.0, cfg.decay_power, max(total_steps - warmup, 1)),
        ],
        [warmup],
    )


def make_optimizer(cfg: BertConfig, total_steps: int) -> optax.GradientTransformation:
    return optax.lamb(
        learning_rate_schedule(cfg, total_steps),
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        mask=weight_decay_mask,
    )


# ---------------------------------------------------------------------------------------------
# Synthetic data


class MarkovText:
    """Masked-LM examples from a fixed random sparse Markov chain; each a pure function of (seed, index).

    The chain (from ``cfg.chain_seed``) gives every content token ``cfg.successors`` random
    successors with probabilities decreasing as 1/rank, so a masked token is predictable from its
    neighbours. A sequence is ``BOS`` then a chain walk from a random start, ``PAD`` after a random
    length in ``[3/4 L, L]``. ``num_predictions`` distinct positions among the walk's (never ``BOS``,
    never padding) are masked as BERT does: 80% ``MASK``, 10% a random content token, 10% unchanged.
    ``stream`` separates the training and held-out sets.
    """

    def __init__(self, cfg: BertConfig, size: int, seed: int, stream: int):
        self.size, self.seed, self.stream = size, seed, stream
        self.length, self.num_predictions, self.vocab_size = cfg.seq_len, cfg.num_predictions, cfg.vocab_size
        self.min_length = max((3 * cfg.seq_len) // 4, cfg.num_predictions + 1)
        content = cfg.vocab_size - _FIRST_CONTENT
        if content < cfg.successors:
            raise ValueError(f"vocab_size {cfg.vocab_size}: needs at least {cfg.successors} content tokens")
        rng = np.random.default_rng(cfg.chain_seed)
        self.successors = np.stack([rng.choice(content, cfg.successors, replace=False) for _ in range(content)])
        weights = 1.0 / np.arange(1, cfg.successors + 1)
        self.cumulative = np.cumsum(weights / weights.sum())

    def __len__(self) -> int:
        return self.size

    def _uniform(self, indices: np.ndarray, width: int, stream: int) -> np.ndarray:
        flat = indices[:, None].astype(np.uint64) * np.uint64(width) + np.arange(width, dtype=np.uint64)
        return hash_uniform(self.seed, flat, stream=self.stream * 16 + stream)

    def get(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        indices = np.asarray(indices)
        n, length, content = len(indices), self.length, self.vocab_size - _FIRST_CONTENT
        steps = self._uniform(indices, length, 0)
        walk = np.empty((n, length - 1), np.int64)
        walk[:, 0] = (steps[:, 0] * content).astype(np.int64)
        for t in range(1, length - 1):
            choice = np.searchsorted(self.cumulative, steps[:, t], side="right")
            walk[:, t] = self.successors[walk[:, t - 1], np.minimum(choice, self.successors.shape[1] - 1)]
        lengths = self.min_length + (self._uniform(indices, 1, 1)[:, 0] * (length - self.min_length + 1)).astype(
            np.int64
        )
        original = np.concatenate([np.full((n, 1), BOS), walk + _FIRST_CONTENT], axis=1)
        original[np.arange(length)[None, :] >= lengths[:, None]] = PAD
        # P distinct positions in 1 .. length-1: the P smallest random keys among them.
        keys = self._uniform(indices, length, 2)
        keys[:, 0] = np.inf
        keys[np.arange(length)[None, :] >= lengths[:, None]] = np.inf
        positions = np.sort(np.argsort(keys, axis=1, kind="stable")[:, : self.num_predictions], axis=1)
        rows = np.arange(n)[:, None]
        targets = original[rows, positions]
        how = self._uniform(indices, self.num_predictions, 3)
        random_tokens = _FIRST_CONTENT + (self._uniform(indices, self.num_predictions, 4) * content).astype(np.int64)
        replaced = np.where(how < 0.8, MASK, np.where(how < 0.9, random_tokens, targets))
        tokens = original.copy()
        tokens[rows, positions] = replaced
        return {
            "tokens": tokens.astype(np.int32),
            "positions": positions.astype(np.int32),
            "targets": targets.astype(np.int32),
        }


def make_data(cfg: BertConfig, seed: int):
    if not cfg.train_size:
        raise ValueError(
            "the MLPerf BERT data set (Wikipedia 2020/01/01, TFRecords) does not ship with podscale; use --config tiny"
        )
    return MarkovText(cfg, cfg.train_size, seed, stream=1), MarkovText(cfg, cfg.eval_size, seed, stream=2)


def unigram_baseline(cfg: BertConfig, seed: int = 0) -> float:
    """Held-out masked-LM accuracy of always guessing one token: the share of the most frequent
    masked target among all masked targets of the eval set (data seed ``seed``)."""
    _, held_out = make_data(cfg, seed)
    targets = held_out.get(np.arange(len(held_out)))["targets"]
    return float(np.bincount(targets.ravel()).max() / targets.size)


REFERENCE = Reference(
    params=340_000_000,
    source=(
        "Devlin et al. 2019, BERT (arXiv 1810.04805), Sec. 3: BERT-LARGE (L=24, H=1024, A=16) 'Total "
        "Parameters=340M'; counted here: embeddings + 24 layers + masked-LM head (tied output, output "
        "bias) = 335,174,458, no pooler / next-sentence head"
    ),
)


def hparams(cfg: BertConfig, total_steps: int) -> dict:
    """The recipe under mllog's standard LAMB keys."""
    return {
        C.OPT_NAME: C.LAMB,
        C.OPT_BASE_LR: cfg.learning_rate,
        C.OPT_LAMB_BETA_1: cfg.b1,
        C.OPT_LAMB_BETA_2: cfg.b2,
        C.OPT_LAMB_EPSILON: cfg.eps,
        C.OPT_LAMB_WEIGHT_DECAY: cfg.weight_decay,
        C.OPT_LAMB_LR_DECAY_POLY_POWER: cfg.decay_power,
        C.OPT_LR_WARMUP_STEPS: min(cfg.warmup_steps, total_steps),
        C.NUM_WARMUP_STEPS: min(cfg.warmup_steps, total_steps),
        C.OPT_LR_TRAINING_STEPS: total_steps,
    }


WORKLOAD = Workload(
    name="bert-large",
    mlperf_name="bert",
    description="BERT-large masked-LM pre-training with LAMB (MLPerf bert)",
    configs={"full": FULL, "tiny": TINY},
    reference=REFERENCE,
    make_model=make_model,
    batch_shapes=batch_shapes,
    make_data=make_data,
    make_optimizer=make_optimizer,
    init=init,
    train_loss=train_loss,
    eval_metrics=eval_metrics,
    eval_metric="mlm_accuracy",
    hparams=hparams,
    unigram_baseline=unigram_baseline,
)
