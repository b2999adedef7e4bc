"""The state a run saves: checkpoints in the stored layout (each process writes the shards it holds:
a sharded update's flat chunks, a rule's split leaves; nothing is gathered or reshaped to save),
restored onto any placement (:class:`CheckpointForm`), and only a finite state (a non-finite loss
or state stops the run, :class:`NonFiniteError`, and is never saved)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from podscale.parallel.weight_update import ByPartition
from podscale.parallel.weight_update.chunks import from_rows

LAYOUT = "podscale_layout"
"""The key of the saved layout in a step's orbax ``custom_metadata``: per leaf path, the shape
it was saved in (a sharded leaf's flat, padded one) and its own (the user layout's), and for a
leaf chunked per model partition (``weight_update.ByPartition``) its ``chunks``: the replicas,
the model partitions and the dimension they split (without it, a flat leaf is row-major with
its padding at the end)."""


class CheckpointForm:
    """How one placement's state goes to and comes from a checkpoint.

    A save writes the stored state as it is, with each leaf's saved and user shapes in the step's
    metadata (:meth:`saved_layout`). A restore (:meth:`abstract`, then :meth:`load`) reads each
    saved leaf onto this placement's mesh, spread over its devices (a flat chunk over the axes, a
    leaf in its own shape as this placement holds it), and converts it on the devices into this
    placement's stored layout: the padding of a flat chunk dropped or changed, a flat leaf
    reshaped to its own shape, or a leaf flattened and padded into chunks. So another mesh,
    replica or process count, or strategy restores the same values, bit for bit."""

    def __init__(self, layout):
        self.layout = layout

    def save_form(self, state):
        return state

    def saved_layout(self) -> dict[str, dict]:
        """Per leaf path, ``{"saved": shape in the checkpoint, "shape": its own}``, and ``"chunks"``
        for a leaf chunked per model partition (:meth:`_chunks`)."""
        out = {}
        for leaf in self.layout.leaves:
            entry = {"saved": list(self.layout.stored_shape(leaf)), "shape": list(leaf.shape)}
            if self._chunks(leaf) is not None:
                entry["chunks"] = self._chunks(leaf)
            out[leaf.path] = entry
        return out

    def _chunks(self, leaf) -> dict[str, int] | None:
        """How this placement chunks a sharded ``leaf`` per model partition, as the metadata says it."""
        by = leaf.stored.by if leaf.sharded else None
        if by is None:
            return None
        return {"replicas": self.layout.n, "partitions": by.k, "dim": by.dim}

    def _as_stored(self, leaf, entry) -> bool:
        """Whether a leaf saved as ``entry`` says is in this placement's stored layout of ``leaf``."""
        return tuple(entry["saved"]) == tuple(self.layout.stored_shape(leaf)) and entry.get("chunks") == self._chunks(
            leaf
        )

    def own_layout(self) -> dict[str, dict]:
        """Every leaf saved in its own shape: how podscale saved a step before it saved the stored
        layout (a step without the layout in its metadata)."""
        return {leaf.path: {"saved": list(leaf.shape), "shape": list(leaf.shape)} for leaf in self.layout.leaves}

    def like(self):
        """This placement's own stored layout (a checkpoint it saved restores as it is)."""
        return self.abstract(self.saved_layout())

    def _read_sharding(self, leaf, entry: dict) -> NamedSharding:
        mesh, saved = self.layout.mesh, tuple(entry["saved"])
        if self._as_stored(leaf, entry):
            return self.layout.sharding(leaf)  # as this placement stores it: nothing to convert
        if saved != tuple(leaf.shape):  # a flat chunked leaf of another placement: spread it over the axes
            axes = list(self.layout.axes) + [a for a in mesh.axis_names if a not in self.layout.axes]
            for k in range(len(axes), 0, -1):
                if saved[0] % math.prod(mesh.shape[a] for a in axes[:k]) == 0:
                    return NamedSharding(mesh, P(tuple(axes[:k])))
            return NamedSharding(mesh, P())
        return self.layout.saved_sharding(leaf)  # its own shape, to be chunked here

    def abstract(self, saved_layout: dict[str, dict]):
        """What to read: each leaf in the shape it was saved in, spread over this mesh. Refuses a
        checkpoint of another model or optimizer (another leaf or shape), naming the leaf."""
        out = []
        for leaf in self.layout.leaves:
            entry = saved_layout.get(leaf.path)
            if entry is None or tuple(entry["shape"]) != tuple(leaf.shape):
                found = "no such leaf" if entry is None else f"shape {entry['shape']}"
                raise ValueError(
                    f"the checkpoint holds {found} for {leaf.path}, which this run's state has as "
                    f"{list(leaf.shape)}: it was saved by another model or optimizer"
                )
            saved = tuple(entry["saved"])
            out.append(jax.ShapeDtypeStruct(saved, leaf.dtype, sharding=self._read_sharding(leaf, entry)))
        return jax.tree.unflatten(self.layout.treedef, out)

    def load(self, restored, saved_layout: dict[str, dict] | None = None):
        """The restored leaves (saved shapes, in ``saved_layout``: this placement's own by default)
        in this placement's stored layout, on the devices. A leaf read as this placement stores it
        is kept as it is (no copy); the others are converted by one program (a leaf's shape or
        order changes, so its buffer cannot be reused)."""
        leaves = jax.tree.leaves(restored)
        shardings = jax.tree.leaves(self.layout.shardings())
        entries = [
            (saved_layout or {}).get(leaf.path) or {"saved": list(np.shape(x)), "shape": list(leaf.shape)}
            for x, leaf in zip(leaves, self.layout.leaves, strict=True)
        ]
        if saved_layout is None:  # as this placement saved it: its own chunks where the shapes match
            entries = [
                {**e, "chunks": self._chunks(leaf)} if tuple(e["saved"]) == tuple(self.layout.stored_shape(leaf)) else e
                for e, leaf in zip(entries, self.layout.leaves, strict=True)
            ]
        todo = [
            i
            for i, (x, leaf) in enumerate(zip(leaves, self.layout.leaves, strict=True))
            if not self._as_stored(leaf, entries[i]) or x.sharding != shardings[i]
        ]
        if todo:
            convert = jax.jit(
                lambda xs: [self._convert(x, self.layout.leaves[i], entries[i]) for x, i in zip(xs, todo, strict=True)],
                out_shardings=[shardings[i] for i in todo],
            )
            for i, x in zip(todo, convert([leaves[i] for i in todo]), strict=True):
                leaves[i] = x
        return jax.tree.unflatten(self.layout.treedef, leaves)

    def _convert(self, x, leaf, entry: dict):
        if self._as_stored(leaf, entry):
            return x
        chunks = entry.get("chunks")
        if chunks is not None:  # chunked per model partition: back to its own shape first
            by = ByPartition(tuple(leaf.shape), int(chunks["dim"]), int(chunks["partitions"]))
            x = from_rows(x.reshape(int(chunks["replicas"]), -1), by)
        whole = jnp.ravel(x)[: math.prod(leaf.shape)].reshape(leaf.shape)  # a table's padding rows come last
        return self.layout.store_leaf(whole, leaf)

    def sizes(self, saved_layout: dict[str, dict] | None = None) -> list[int]:
        """Per leaf, the elements its fingerprint covers: its own element count (a flat saved
        leaf's padding at the end is left out), or, chunked per model partition (its padding
        between the partitions' pieces), every saved element."""
        saved_layout = saved_layout or self.saved_layout()
        out = []
        for leaf in self.layout.leaves:
            entry = saved_layout[leaf.path]
            out.append(math.prod(entry["saved" if entry.get("chunks") else "shape"]))
        return out


class NonFiniteError(ValueError):
    """The loss (or, at a checkpoint, the state) stopped being finite."""


def raise_non_finite(what: str, step: int, ckpt) -> None:
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


def save_finite(ckpt, step: int, state, form, force: bool = False, metadata: dict | None = None) -> None:
    """Saves only a finite state (the loss was checked already; the weights are checked here), with
    ``metadata`` (the run's data position) beside it."""
    if not (force or step % ckpt.every == 0) or step in ckpt.saved_steps():
        return
    if not bool(_all_finite(state)):
        raise_non_finite("the state holds non-finite values", step, ckpt)
    ckpt.maybe_save(step, state, form, force=force, metadata=metadata)
