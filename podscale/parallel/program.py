"""The user's step as podscale reads it: traced once at the global shapes (the specification),
the signature a batch is compiled for, and the checks on what the step returns."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from podscale.parallel import interpret
from podscale.parallel.weight_update import Sharded

Step = Callable[[Any, Any], tuple[Any, Any]]


def path_str(path) -> str:
    return jax.tree_util.keystr(path)


def _leaf_shape(x) -> jax.ShapeDtypeStruct:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if not hasattr(x, "dtype"):  # a Python scalar (flax TrainState.create's step), as jit sees it
        x = jnp.asarray(x)
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, weak_type=getattr(x, "weak_type", False))


def shape_structs(tree):
    """``jax.ShapeDtypeStruct`` leaves for a tree of arrays, Python scalars or shape structs."""
    return jax.tree.map(_leaf_shape, tree)


def as_arrays(tree):
    """Python scalars (a flax ``TrainState``'s ``step``) as arrays, as ``jax.jit`` would take them."""
    return jax.tree.map(lambda x: x if hasattr(x, "dtype") else jnp.asarray(x), tree)


@dataclasses.dataclass
class GlobalTrace:
    """The user's step traced at the global batch shape: the specification podscale partitions."""

    closed: Any
    out_tree: Any
    n_state: int


def trace_global(step: Step, state, batch, group_axis: str | None = None) -> GlobalTrace:
    """Traces ``step`` at the global shapes, with nested ``jit``s and loops kept. With batch norm
    over groups of replicas, the model's ``group_axis`` is bound with size 1 (one device)."""
    axis_env = [(group_axis, 1)] if group_axis else None
    try:
        closed, out_shape = jax.make_jaxpr(step, return_shape=True, axis_env=axis_env)(state, batch)
    except NameError as e:
        if "axis name" not in str(e):
            raise
        raise ValueError(
            f"the step calls a collective over a named axis ({e}). podscale runs the step as written for one "
            "device on the whole global batch and sums gradients itself: remove lax.pmean/psum/all_gather from "
            "the step (a mean over the batch is jnp.mean)."
        ) from None
    return GlobalTrace(closed, jax.tree.structure(out_shape), len(jax.tree.leaves(state)))


def check_kept_shapes(new_state, layout) -> None:
    """A step keeps every state leaf's shape, as a loop carry does: the next call reads the state
    it returned in the layout this one was placed in."""
    pairs = jax.tree_util.tree_leaves_with_path(new_state, is_leaf=lambda x: isinstance(x, Sharded))
    for (path, v), leaf in zip(pairs, layout.leaves, strict=True):
        shape = tuple(v.shape) if isinstance(v, Sharded) else tuple(np.shape(v))
        if leaf.table or leaf.chunked:  # this replica's rows or chunk
            local = leaf.stored.chunk_shape(leaf.shape) if leaf.chunked else leaf.stored.local_shape(leaf.shape)
            shape = tuple(leaf.shape) if list(shape) == local else shape
        if shape != tuple(leaf.shape):
            raise ValueError(
                f"the step returned new_state{path_str(path)} with shape {list(shape)}, but was given it with shape "
                f"{list(leaf.shape)}: a step must return every state leaf in the shape it took (as a loop carry), "
                "so that its result can be stepped again; keep values of other shapes in the metrics"
            )


def signature(batch) -> tuple:
    """What a traced program depends on in a batch: its tree, and each leaf's shape and dtype."""
    shapes = shape_structs(batch)
    return jax.tree.structure(shapes), tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(shapes))


def as_whole(kind: str, path, x):
    if interpret.varying_axes(jax.typeof(x)):
        raise AssertionError(f"podscale left {kind}{path_str(path)} per replica; please report this with the step")
    return x


def _not_an_array(leaf) -> str | None:
    """What ``leaf`` is where it is no array of numbers or bools (a str, an object, an array of
    strings or objects); ``None`` for an array, a shape and dtype, or a number."""
    dtype = getattr(leaf, "dtype", None)
    if dtype is None:
        if isinstance(leaf, bool | int | float | complex | np.number):
            return None
        return f"a Python {type(leaf).__name__} ({leaf!r:.40})"
    try:
        kind = np.dtype(dtype).kind
    except TypeError:
        return None  # a JAX dtype numpy does not know (a PRNG key's)
    return f"an array of {np.dtype(dtype)} (strings or objects)" if kind in "OUSV" else None


def check_batch(batch, n: int, mesh) -> None:
    """Raises a ``ValueError`` naming the leaf when the replicas cannot split ``batch``."""
    first = None
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        if problem := _not_an_array(leaf):
            raise ValueError(
                f"batch{path_str(path)} is {problem}; every batch leaf must be an array of numbers or bools, one row "
                "per example (encode strings as integer ids; pass other Python values to the step outside the batch)"
            )
        shape = np.shape(leaf)
        if not shape:
            raise ValueError(f"batch{path_str(path)} is a scalar; every batch leaf needs a leading batch dimension")
        if shape[0] == 0:
            raise ValueError(
                f"batch{path_str(path)} has no rows (shape {list(shape)}); give a global batch of at least {n} rows, "
                f"one per replica of mesh {dict(mesh.shape)}"
            )
        if first is None:
            first = (path, shape)
        elif shape[0] != first[1][0]:
            raise ValueError(
                f"batch{path_str(path)} has {shape[0]} rows (shape {list(shape)}) but batch{path_str(first[0])} has "
                f"{first[1][0]} (shape {list(first[1])}): every batch leaf needs the same leading batch size, "
                "since podscale splits the rows of all of them alike. Pass per-batch constants in the state "
                "or as a leaf with one row per example."
            )
        if shape[0] % n:
            raise ValueError(
                f"batch{path_str(path)} has global batch size {shape[0]} (shape {list(shape)}), which the "
                f"{n} replicas of mesh {dict(mesh.shape)} do not divide. Use a global batch "
                f"that is a multiple of {n}, e.g. {max(n, shape[0] // n * n)}."
            )


@dataclasses.dataclass(frozen=True)
class KeptApart:
    """A jitted step called as ``(state, batch)`` whose state leaves at ``kept`` are passed apart
    and not donated (the rest are): ``inner`` takes ``(donated leaves, kept leaves, batch)``."""

    inner: Any
    treedef: Any
    kept: frozenset[int]

    def args(self, state, batch) -> tuple:
        leaves = self.treedef.flatten_up_to(state)
        donated = [x for i, x in enumerate(leaves) if i not in self.kept]
        return donated, [x for i, x in enumerate(leaves) if i in self.kept], batch

    def __call__(self, state, batch):
        return self.inner(*self.args(state, batch))

    def lower(self, state, batch):
        return self.inner.lower(*self.args(state, batch))


def check_not_donated(tree, name: str) -> None:
    """A donated buffer passed again would abort the process inside XLA; refuse it here."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if isinstance(leaf, jax.Array) and leaf.is_deleted():
            raise ValueError(
                f"{name}{jax.tree_util.keystr(path)} was donated to an earlier step (donate_state=True) and "
                "its buffers are gone: pass the state that step returned, or build the step with "
                "data_parallel(..., donate_state=False) to keep the input"
            )
