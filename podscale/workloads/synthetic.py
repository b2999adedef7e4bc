"""Synthetic data sets for the tiny configs, each example a pure function of (seed, index).

``ReversedTokens`` is the translation task of the tiny Transformer and GNMT: the target is the
source sequence reversed, so the model must attend across the whole source.
"""

from __future__ import annotations

import numpy as np

from podscale.workloads.datasets import hash_uniform

PAD, BOS = 0, 1
"""Reserved token ids; content tokens are ``2 .. vocab_size - 1``."""


class ReversedTokens:
    """``inputs``: ``length`` random content tokens; ``targets``: the same tokens reversed (int32)."""

    def __init__(self, size: int, length: int, vocab_size: int, seed: int = 0):
        if vocab_size < 3:
            raise ValueError(f"vocab_size {vocab_size}: needs room for PAD, BOS and at least one content token")
        self.size, self.length, self.vocab_size, self.seed = size, length, vocab_size, seed

    def __len__(self) -> int:
        return self.size

    def get(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        flat = indices[:, None].astype(np.uint64) * np.uint64(self.length) + np.arange(self.length, dtype=np.uint64)
        content = self.vocab_size - 2
        tokens = (2 + (hash_uniform(self.seed, flat, stream=11) * content).astype(np.int64)).astype(np.int32)
        return {"inputs": tokens, "targets": tokens[:, ::-1].copy()}


def shift_right(targets: np.ndarray):
    """Decoder inputs for teacher forcing: ``BOS`` then the targets without their last token."""
    import jax.numpy as jnp

    return jnp.concatenate([jnp.full_like(targets[:, :1], BOS), targets[:, :-1]], axis=1)
