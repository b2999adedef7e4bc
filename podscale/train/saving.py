"""The state a run saves: checkpoints in the user layout, spread over the mesh (each process writes
the shards it holds, nothing is gathered, and any placement restores them), and only a finite
state (a non-finite loss or state stops the run, :class:`NonFiniteError`, and is never saved)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


class _CheckpointForm:
    """Checkpoints hold every leaf in its own (user) shape, sharded over the mesh as
    ``StateLayout.saved_sharding`` says: a sharded update's flat chunks are reshaped on the
    devices (XLA moves the pieces between them, no device gathers a leaf), a leaf a rule splits
    stays split over the model axis. A restore reads each device's pieces of the target
    placement's saved layout, and stores them (on the devices) in its stored layout: another mesh,
    replica or process count, or strategy restores the same values."""

    def __init__(self, layout):
        self.layout = layout
        self._saved = layout.saved_shardings()
        self._save = jax.jit(layout.unstore, out_shardings=self._saved)
        self._load = jax.jit(layout.store, out_shardings=layout.shardings())

    def save_form(self, state):
        return self._save(state)

    def like(self):
        return jax.tree.unflatten(
            self.layout.treedef,
            [
                jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
                for leaf, sharding in zip(self.layout.leaves, jax.tree.leaves(self._saved), strict=True)
            ],
        )

    def load(self, restored):
        return self._load(restored)


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


def _save(ckpt, step: int, state, form, force: bool = False) -> None:
    """Saves only a finite state (the loss was checked already; the weights are checked here)."""
    if not (force or step % ckpt.every == 0) or step in ckpt.saved_steps():
        return
    if not bool(_all_finite(state)):
        _non_finite("the state holds non-finite values", step, ckpt)
    ckpt.maybe_save(step, state, form, force=force)
