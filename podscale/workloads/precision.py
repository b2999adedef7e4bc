"""The precision policy: bfloat16 for the heavy compute, float32 for everything that accumulates.

Models take ``policy.compute_dtype`` as the ``dtype`` of their convolutions, dense layers and
embeddings and ``policy.param_dtype`` (always float32) as their ``param_dtype``: flax then keeps the
master weights in float32 and casts them to bfloat16 at each use. Batch-norm statistics,
layer-norm reductions, softmax and losses are computed in float32 (the workloads cast to
``policy.accum_dtype`` before them), and optax keeps its state in the dtype of the parameters.

``check_state`` fails before training starts when master weights or optimizer state would be
stored in a 16-bit type: their updates are smaller than a bfloat16 ulp late in training.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

_SIXTEEN_BIT = (jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class Policy:
    """``compute_dtype`` for convolutions and matrix products; float32 for state and reductions."""

    compute_dtype: jnp.dtype = jnp.bfloat16
    param_dtype: jnp.dtype = jnp.float32
    accum_dtype: jnp.dtype = jnp.float32

    def __post_init__(self):
        for name in ("param_dtype", "accum_dtype"):
            if jnp.dtype(getattr(self, name)) != jnp.float32:
                raise ValueError(f"Policy.{name} must be float32, got {jnp.dtype(getattr(self, name)).name}")


BF16 = Policy()
FLOAT32 = Policy(compute_dtype=jnp.float32)
POLICIES = {"bf16": BF16, "float32": FLOAT32}


def policy_by_name(name: str) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown precision {name!r}; choose one of: {', '.join(POLICIES)}")
    return POLICIES[name]


def check_state(state, parts: tuple[str, ...] = ("params", "opt_state", "batch_stats")) -> None:
    """Raises if a floating leaf under ``state.<part>`` is stored in a 16-bit type.

    ``state`` may hold arrays or ``jax.ShapeDtypeStruct``s (as from ``jax.eval_shape``).
    """
    for part in parts:
        tree = getattr(state, part, None)
        if tree is None:
            continue
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            dtype = jnp.dtype(leaf.dtype)
            if any(dtype == jnp.dtype(t) for t in _SIXTEEN_BIT):
                raise TypeError(
                    f"state.{part}{jax.tree_util.keystr(path)} would be stored as {dtype.name}; master weights, "
                    f"optimizer state and batch-norm statistics must be float32. Create the model with "
                    f"param_dtype=jnp.float32 (compute in bfloat16 through dtype=) and do not cast the state"
                )
