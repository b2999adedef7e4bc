"""Small flax models to start with: an MLP, a ResNet for 8x8 images, a decoder-only Transformer.

Each is a plain ``flax.linen`` module called as ``model.apply(variables, x, train=...)``. Models
with batch norm keep their running statistics in the ``batch_stats`` collection. The MLPerf
reference models have their own issue.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax.numpy as jnp


class MLP(nn.Module):
    """Flattens its input and applies ReLU hidden layers, then a linear classifier."""

    hidden: Sequence[int] = (128, 128)
    num_classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool = False):
        del train
        x = x.reshape(x.shape[0], -1)
        for width in self.hidden:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.num_classes)(x)


class ResidualBlock(nn.Module):
    features: int
    strides: int = 1
    batch_norm: bool = True

    @nn.compact
    def __call__(self, x, train: bool):
        norm = (lambda: nn.BatchNorm(use_running_average=not train, momentum=0.9)) if self.batch_norm else None
        y = nn.Conv(self.features, (3, 3), self.strides, use_bias=not self.batch_norm)(x)
        y = nn.relu(norm()(y) if norm else y)
        y = nn.Conv(self.features, (3, 3), use_bias=not self.batch_norm)(y)
        y = norm()(y) if norm else y
        if x.shape != y.shape:
            x = nn.Conv(self.features, (1, 1), self.strides, use_bias=not self.batch_norm)(x)
            x = norm()(x) if norm else x
        return nn.relu(x + y)


class SmallResNet(nn.Module):
    """A ResNet for small images (8x8 digits): a 3x3 stem, residual stages, global average pool.

    ``batch_norm=False`` gives the same network without batch norm (a plain residual CNN), whose
    data-parallel step equals the single-device step exactly.
    """

    stage_features: Sequence[int] = (32, 64)
    blocks_per_stage: int = 1
    num_classes: int = 10
    batch_norm: bool = True

    @nn.compact
    def __call__(self, x, train: bool = False):
        if x.ndim == 3:
            x = x[..., None]
        x = nn.Conv(self.stage_features[0], (3, 3), use_bias=not self.batch_norm)(x)
        if self.batch_norm:
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.relu(x)
        for stage, features in enumerate(self.stage_features):
            for block in range(self.blocks_per_stage):
                strides = 2 if stage > 0 and block == 0 else 1
                x = ResidualBlock(features, strides, self.batch_norm)(x, train)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes)(x)


class StemNet(nn.Module):
    """A ResNet's stem and one residual block on larger images: a 7x7 stride-2 convolution, batch
    norm, a 3x3 stride-2 max-pool, a residual pair of 3x3 convolutions, global average pool. Every
    height is the image's over 2 and 4, so a 64x64 image splits 8 ways (spatial partitioning)."""

    features: int = 8
    num_classes: int = 10
    bn_axis: str | None = None
    """Average batch-norm statistics over this mesh axis (``BN_GROUP``: batch-norm groups)."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        if x.ndim == 3:
            x = x[..., None]
        x = nn.Conv(self.features, (7, 7), strides=2, padding=3, use_bias=False)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name=self.bn_axis)(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        y = nn.relu(nn.Conv(self.features, (3, 3), padding=1)(x))
        x = nn.relu(x + nn.Conv(self.features, (3, 3), padding=1)(y))
        return nn.Dense(self.num_classes)(x.mean((1, 2)))


class DecoderBlock(nn.Module):
    num_heads: int
    mlp_dim: int

    @nn.compact
    def __call__(self, x, mask):
        y = nn.LayerNorm()(x)
        # No biases in the attention projections: a key bias cannot change the softmax (its gradient
        # is exactly zero), so it would only carry roundoff.
        y = nn.MultiHeadDotProductAttention(num_heads=self.num_heads, use_bias=False)(y, y, mask=mask)
        x = x + y
        y = nn.LayerNorm()(x)
        y = nn.Dense(self.mlp_dim)(y)
        y = nn.Dense(x.shape[-1])(nn.gelu(y))
        return x + y


class Transformer(nn.Module):
    """A pre-LayerNorm decoder-only Transformer language model with learned positions."""

    vocab_size: int = 32
    width: int = 64
    depth: int = 2
    num_heads: int = 4
    mlp_dim: int = 256
    max_len: int = 64

    @nn.compact
    def __call__(self, tokens, train: bool = False):
        del train
        length = tokens.shape[-1]
        if length > self.max_len:
            raise ValueError(f"tokens have length {length} but the Transformer's max_len is {self.max_len}")
        embed = nn.Embed(self.vocab_size, self.width)
        positions = self.param("positions", nn.initializers.normal(0.02), (self.max_len, self.width))
        x = embed(tokens) + positions[:length]
        mask = nn.make_causal_mask(tokens)
        for _ in range(self.depth):
            x = DecoderBlock(self.num_heads, self.mlp_dim)(x, mask)
        x = nn.LayerNorm()(x)
        return embed.attend(x)
