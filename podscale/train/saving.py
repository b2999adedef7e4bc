"""The state a run saves: checkpoints in the user layout (whole tensors, so any replica count
restores them), and only a finite state (a non-finite loss or state stops the run,
:class:`NonFiniteError`, and is never saved)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


class _CheckpointForm:
    """Checkpoints hold the user layout (whole tensors), so they restore onto any replica count:
    the stored state is unstored (all-gathered) on save and stored (sliced) on restore."""

    def __init__(self, layout):
        replicated = NamedSharding(layout.mesh, P())
        self.layout = layout
        self._save = jax.jit(layout.unstore, out_shardings=replicated)
        self._load = jax.jit(layout.store, out_shardings=layout.shardings())
        self._replicated = replicated

    def _converts(self) -> bool:
        return self.layout.any_sharded or self.layout.any_split

    def save_form(self, state):
        return self._save(state) if self._converts() else state

    def like(self):
        return jax.tree.unflatten(
            self.layout.treedef,
            [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=self._replicated) for leaf in self.layout.leaves],
        )

    def load(self, restored):
        return self._load(restored) if self._converts() else restored


class NonFiniteError(ValueError):
    """The loss (or, at a checkpoint, the state) stopped being finite."""


def _non_finite(what: str, step: int, ckpt) -> None:
    last = ckpt.latest_step() if ckpt else None
    kept = f"the last checkpoint, step {last}, is kept" if last is not None else "no checkpoint was saved"
    raise NonFiniteError(
        f"step {step}: {what}; stopped ({kept}; a non-finite state is never saved). Lower "
        "--learning-rate, or check the data"
    )


@jax.jit
def _all_finite(state) -> jax.Array:
    leaves = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])) if leaves else jnp.bool_(True)


def _save(ckpt, step: int, state, form, force: bool = False, metadata: dict | None = None) -> None:
    """Saves only a finite state (the loss was checked already; the weights are checked here), with
    ``metadata`` (the run's data position) beside it."""
    if not (force or step % ckpt.every == 0) or step in ckpt.saved_steps():
        return
    if not bool(_all_finite(state)):
        _non_finite("the state holds non-finite values", step, ckpt)
    ckpt.maybe_save(step, state, form, force=force, metadata=metadata)
