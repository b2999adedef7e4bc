"""Checkpoints of the training state with orbax.

Saves are synchronous and atomic: orbax writes a step into a temporary directory and renames it
when complete, so a crash mid-save leaves the previous good checkpoint untouched and never a
half-written step that looks finished. A restore that finds no checkpoint, or one that orbax
cannot read, raises :class:`CheckpointError` naming the directory and what to do.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


class CheckpointError(RuntimeError):
    """A checkpoint is missing, partial or unreadable."""


class Checkpointer:
    """Saves every ``every`` steps under ``directory`` and restores the latest step."""

    def __init__(self, directory: str, every: int, max_to_keep: int = 3):
        if every < 1:
            raise ValueError(f"--checkpoint-every must be at least 1, got {every}")
        self.directory = os.path.abspath(directory)
        self.every = every
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False
            ),
        )

    def latest_step(self) -> int | None:
        self._manager.reload()
        return self._manager.latest_step()

    def maybe_save(self, step: int, state, transform=None, force: bool = False) -> bool:
        """Saves ``transform(state)`` at multiples of ``every`` (or when ``force``)."""
        if not force and step % self.every:
            return False
        if step in self._manager.all_steps():
            return False  # the step we resumed from: already saved, never overwritten
        state = transform(state) if transform else state
        self._manager.save(step, args=ocp.args.StandardSave(state), force=True)
        return True

    def saved_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def restore(self, like):
        """Restores the latest step into the structure, shapes and shardings of ``like``."""
        step = self.latest_step()
        if step is None:
            raise CheckpointError(
                f"--resume: no complete checkpoint in {self.directory}. Start without --resume, or "
                "point --workdir at the directory of the run to continue."
            )
        abstract = jax.tree.map(
            lambda x: x if isinstance(x, jax.ShapeDtypeStruct) else ocp.utils.to_shape_dtype_struct(x), like
        )
        try:
            return step, self._manager.restore(step, args=ocp.args.StandardRestore(abstract))
        except Exception as e:  # orbax raises many kinds; all mean this step cannot be read
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} is corrupt or does not match this "
                f"model/optimizer ({type(e).__name__}: {str(e)[:300]}). Delete "
                f"{os.path.join(self.directory, str(step))} to resume from an earlier step, or start "
                "a new run with another --workdir."
            ) from e

    def close(self) -> None:
        self._manager.close()
