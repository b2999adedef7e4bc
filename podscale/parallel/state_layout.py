"""Where each state leaf lives between steps, and the conversions between its two layouts.

Two layouts, stated once (as levanter keeps a parameter and a compute mapping): the *user* layout
is the state pytree the step was written for; the *stored* layout is what lives on the mesh. Each
leaf's stored form is one value of :mod:`podscale.parallel.stored` (whole, the sharded update's
flat chunks, a table's rows, or chunked along a dimension of its own), chosen here
(:func:`decide`). ``store``/``unstore`` convert between the two layouts. Checkpoints save the
stored layout as it is, and a restore converts it into another placement's
(``train.saving.CheckpointForm``, :meth:`StateLayout.saved_sharding`).

A flat-chunked leaf that a sharding rule splits over the model axis, where the leaves it is updated
with are split alike (:func:`partition_dims`), is chunked per model partition, then over the
replicas (``weight_update.ByPartition``). Its flat vector is ``[N, k, c]``: device ``(replica r,
partition m)`` holds a 1/N piece of partition m's slice of the leaf, the slice it holds of the
split weight itself.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from podscale.parallel import interpret
from podscale.parallel.partition.layouts import chunk_dim
from podscale.parallel.stored import WHOLE, Along, Flat, Rows, Stored
from podscale.parallel.weight_update import ByPartition, chunk_layout
from podscale.parallel.weight_update.chunks import agreed_dim, by_partition_layout


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """One state leaf's placement: what it is (``path``, ``shape``, ``dtype``, whether the forward
    pass reads it), how it is stored over the data axes (``stored``, one value of
    :mod:`podscale.parallel.stored`), the dimension a model axis splits, and why."""

    path: str
    shape: tuple[int, ...]
    dtype: Any
    stored: Stored
    reason: str
    weight: bool = False
    """Read by the forward pass (kept whole for it); otherwise optimizer or other state."""
    weak_type: bool = False
    model_dim: int | None = None
    """With tensor partitioning: the dimension split over the model axis (its sharding rule)."""
    model_split: int = 1
    """Devices of the model axis (of ``model_dim``'s split, or of a flat chunk's per-partition layout)."""

    @property
    def sharded(self) -> bool:
        """Stored in the sharded update's flat chunks."""
        return isinstance(self.stored, Flat)

    @property
    def table(self) -> bool:
        return isinstance(self.stored, Rows)

    @property
    def chunked(self) -> bool:
        """Stored chunked along a dimension of its own."""
        return isinstance(self.stored, Along)

    @property
    def partition_layout(self):
        """The layout the step's partitioner reads the stored leaf in: a table's rows, a chunk, or whole."""
        return self.stored.partition_layout

    @property
    def itemsize(self) -> int:
        return _itemsize(self.dtype)

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def padding_bytes(self) -> int:
        return self.stored.padding * self.itemsize

    def local_shape(self) -> list[int]:
        """The shape of each device's piece as stored."""
        return self.stored.local_shape(self.shape, self.model_dim, self.model_split)

    def bytes_per_device(self) -> int:
        return self.stored.per_device(self.shape, self.model_split) * self.itemsize


def _itemsize(dtype) -> int:
    """Bytes per element; a typed PRNG key counts its key data (two uint32 for threefry)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return math.prod(jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=dtype._impl))).shape) * 4
    return np.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class StateLayout:
    treedef: Any
    leaves: tuple[LeafLayout, ...]
    mesh: Mesh
    order: tuple[str, ...] | None = None
    """The mesh axes in the order chunks are laid out (the gradient sum's); default mesh order."""
    parts: tuple[str, ...] = ()
    """The axes left to XLA's partitioner (a spatial strategy's space axis, tensor partitioning's
    model axis, or both): each data replica's flat chunk is split over them as well (XLA partitions
    the update of a chunk over them), so a sharded leaf is 1/(data x k) per device, k their devices;
    a chunk along a dim is, where data x k divide the dim (``Along.split``), else whole over them."""
    model: str | None = None
    """Tensor partitioning's model axis: a leaf with a ``model_dim`` is split over it along that
    dimension."""

    @property
    def axes(self) -> tuple[str, ...]:
        return self.order or tuple(self.mesh.axis_names)

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The data axes in mesh order: as the partitioner numbers the replicas (an FSDP chunk's
        index), whatever order the gradient sum goes in."""
        return tuple(a for a in self.mesh.axis_names if a in self.axes)

    @property
    def n(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.axes)

    @property
    def any_sharded(self) -> bool:
        return any(leaf.sharded for leaf in self.leaves)

    @property
    def any_split(self) -> bool:
        """Whether a leaf is split over a model axis (tensor partitioning)."""
        return any(leaf.model_dim is not None for leaf in self.leaves)

    def specs(self):
        return jax.tree.unflatten(self.treedef, [self._spec(leaf) for leaf in self.leaves])

    def _spec(self, leaf: LeafLayout) -> P:
        """How the step's ``shard_map`` (manual over the data axes) sees the stored leaf."""
        match leaf.stored:
            case Along(dim=dim, axes=axes):
                return P(*[(axes or self.data_axes) if d == dim else None for d in range(len(leaf.shape))])
            case Flat() | Rows():
                return P(self.axes)
        return P()

    def sharding(self, leaf: LeafLayout) -> NamedSharding:
        spec: list = [None] * len(leaf.shape)
        if leaf.model_dim is not None:
            spec[leaf.model_dim] = self.model
        match leaf.stored:
            case Along(
                dim=dim, axes=axes, split=split
            ):  # along its dim over the data axes (and a rule's over the model axis)
                spec[dim] = (axes or self.data_axes) + ((spec[dim],) if spec[dim] else ())
                if split > 1:  # each replica's chunk split over the space axis too (left to XLA)
                    spec[dim] += tuple(self.parts)
            case Rows():  # rows over the data axes, whole over a space or model axis
                spec = [self.axes]
            case Flat():  # each replica's chunk split over the space and model axes too
                spec = [(*self.axes, *self.parts)]
        return NamedSharding(self.mesh, P(*spec) if any(spec) else P())

    def saved_sharding(self, leaf: LeafLayout) -> NamedSharding:
        """How a restore reads ``leaf`` where a checkpoint holds it in its own shape (another
        placement's form: ``train.saving.CheckpointForm``), spread over the mesh so that no device
        holds it whole where its shape allows: a rule's dimension over the model axis, then the first other dimension that the
        remaining axes divide over them (over fewer of them, in mesh order, where they do not);
        else whole (a scalar, a small or oddly shaped leaf, a PRNG key). The first: a sharded
        update's chunk is a contiguous run of the flattened leaf, so where the replicas divide its
        size and its first dimension, the chunk is the device's block of rows and making the saved
        form moves nothing between devices. A leaf chunked along a dimension is read as stored."""
        if leaf.chunked:
            return self.sharding(leaf)
        spec: list = [None] * len(leaf.shape)
        if leaf.model_dim is not None:
            spec[leaf.model_dim] = self.model
        if not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            rest = [a for a in self.mesh.axis_names if a not in spec]
            for k in range(len(rest), 0, -1):
                n = math.prod(self.mesh.shape[a] for a in rest[:k])
                free = [d for d, s in enumerate(spec) if s is None and leaf.shape[d] % n == 0 and leaf.shape[d] >= n]
                if free:
                    spec[free[0]] = tuple(rest[:k])
                    break
        return NamedSharding(self.mesh, P(*spec))

    def shardings(self):
        """The stored leaves' shardings on the mesh (``specs`` name the data axes only, as the
        ``shard_map`` manual over them sees its inputs)."""
        return jax.tree.unflatten(self.treedef, [self.sharding(leaf) for leaf in self.leaves])

    def stored_shapes(self):
        """The stored leaves as ``ShapeDtypeStruct``, with their shardings: lowering the step for
        them is lowering it for the placed state (jit's trace of a call is reused)."""

        def one(leaf):
            return jax.ShapeDtypeStruct(
                self.stored_shape(leaf), leaf.dtype, weak_type=leaf.weak_type, sharding=self.sharding(leaf)
            )

        return jax.tree.unflatten(self.treedef, [one(leaf) for leaf in self.leaves])

    def check(self, state, what: str = "state") -> None:
        treedef = jax.tree.structure(state)
        if treedef != self.treedef:
            raise ValueError(f"{what} has structure {treedef}, but this step was prepared for {self.treedef}")

    @functools.cached_property
    def _stored_signature(self) -> tuple[tuple[tuple[int, ...], Any], ...]:
        return tuple((self.stored_shape(leaf), leaf.dtype) for leaf in self.leaves)

    def stored_shape(self, leaf: LeafLayout) -> tuple[int, ...]:
        """The shape ``leaf`` has on the mesh: flat ``N * chunk`` when sharded, a table's rows
        padded to ``N`` blocks, else its own."""
        return leaf.stored.stored_shape(leaf.shape, self.n)

    def check_stored(self, state, what: str = "state") -> None:
        """Refuses a stored ``state`` this layout did not place: its structure, and each leaf's
        shape and dtype against the stored ones (on the host, no device sync). A stored leaf is a
        global value (a flat, padded vector for a sharded one), so a leaf of the right shape is
        read alike on any mesh; one of another shape was stored by another step object (another
        strategy, mesh or ``min_shard_size``) or was never placed."""
        leaves, treedef = jax.tree.flatten(state)
        if treedef == self.treedef and all(
            getattr(x, "shape", None) == shape and getattr(x, "dtype", None) == dtype
            for x, (shape, dtype) in zip(leaves, self._stored_signature, strict=True)
        ):
            return  # the usual case, what the step returned: checked in a few microseconds a leaf
        self.check(state, what)
        other = (
            "it was placed by another step object (another weight_update, mesh, min_shard_size or model_parallel): "
            "pass the state this step's place_state (or a call of this step) returned, or gather it with the step "
            "that placed it (gather_state) and place the result with this one's place_state"
        )
        for (path, x), leaf in zip(jax.tree_util.tree_leaves_with_path(state), self.leaves, strict=True):
            shape, expected = tuple(np.shape(x)), self.stored_shape(leaf)
            where = f"{what}{jax.tree_util.keystr(path)}"
            if shape != expected:
                stored = (
                    f"a flat {list(expected)} (its {list(leaf.shape)} padded and split over the replicas)"
                    if leaf.sharded
                    else f"{list(expected)}"
                )
                why = (
                    "that is the user layout (gather_state's): place it with this step's place_state first"
                    if shape == leaf.shape
                    else other
                )
                raise ValueError(f"{where} has shape {list(shape)}, but this step stores that leaf as {stored}; {why}")
            dtype = getattr(x, "dtype", None)
            if not _same_dtype(dtype, leaf.dtype):
                raise ValueError(f"{where} has dtype {dtype}, but this step stores that leaf as {leaf.dtype}; {other}")

    def check_user(self, state, what: str = "state") -> None:
        """Refuses a user-layout ``state`` (what :meth:`place` takes) whose leaves' shapes or dtypes
        are not those this layout was decided for, such as a stored (flat) state."""
        self.check(state, what)
        for (path, x), leaf in zip(jax.tree_util.tree_leaves_with_path(state), self.leaves, strict=True):
            shape, dtype = tuple(np.shape(x)), getattr(x, "dtype", None)
            if shape != leaf.shape or not _same_dtype(dtype, leaf.dtype):
                stored = (
                    " (the stored, flat layout of a sharded leaf)"
                    if leaf.sharded and shape == self.stored_shape(leaf)
                    else ""
                )
                raise ValueError(
                    f"{what}{jax.tree_util.keystr(path)} is {dtype}{list(shape)}{stored}, but this step was prepared "
                    f"for {leaf.dtype}{list(leaf.shape)}: place_state and prepare take the state as the step itself "
                    "takes it (what gather_state returns); a state a step object stored is gathered by that one first"
                )

    # -- conversions; pure functions usable under jit --------------------------------------
    def store(self, state):
        """User layout -> stored layout (each leaf to its stored form)."""
        self.check(state)
        leaves = []
        for x, leaf in zip(jax.tree.leaves(state), self.leaves, strict=True):
            leaves.append(self.store_leaf(x, leaf))
        return jax.tree.unflatten(self.treedef, leaves)

    def unstore(self, stored):
        """Stored layout -> user layout (drop the padding, restore the shape)."""
        leaves = []
        for x, leaf in zip(jax.tree.leaves(stored), self.leaves, strict=True):
            leaves.append(self.unstore_leaf(x, leaf))
        return jax.tree.unflatten(self.treedef, leaves)

    def store_leaf(self, x, leaf: LeafLayout, xp=jnp):
        """A leaf's value in its own shape -> its stored form (``xp``: ``jax.numpy`` or ``numpy``)."""
        return leaf.stored.store(x, leaf.shape, self.n, xp)

    def unstore_leaf(self, x, leaf: LeafLayout, xp=jnp):
        """The inverse of :meth:`store_leaf`: a leaf's stored value -> its own shape."""
        return leaf.stored.unstore(x, leaf.shape, self.n, xp)

    # -- host-side placement ----------------------------------------------------------------
    def place(self, state):
        """Host or single-device state (user layout) -> stored state on the mesh."""
        self.check(state)
        out = []
        for x, leaf in zip(jax.tree.leaves(state), self.leaves, strict=True):
            out.append(_put(x, self.sharding(leaf), leaf, self))  # chunk i on device i of the order
        return jax.tree.unflatten(self.treedef, out)

    def fetch(self, stored):
        """Stored state on the mesh -> user-layout host numpy arrays, on every process."""
        out = []
        for x, leaf in zip(jax.tree.leaves(stored), self.leaves, strict=True):
            x = _get(x)
            out.append(x if _is_key(x) else self.unstore_leaf(np.asarray(x), leaf, np))
        return jax.tree.unflatten(self.treedef, out)


def _same_dtype(dtype, expected) -> bool:
    """Whether a leaf of ``dtype`` (``None``: a Python scalar, not checked) is stored as ``expected``,
    as JAX canonicalises them (a NumPy float64 is a float32 without x64)."""
    if dtype is None or dtype == expected:
        return True
    try:
        return jax.dtypes.canonicalize_dtype(dtype) == jax.dtypes.canonicalize_dtype(expected)
    except TypeError:
        return False


def stored_chunk(x) -> tuple[str, ...] | None:
    """The mesh axes ``x`` is split over when it looks like a sharded leaf a step stored, else
    ``None``: a 1-D array split over the data axes, as :meth:`StateLayout.shardings` stores one (a
    1-D leaf split over the last axis alone of a mesh of several is a weight split over a model
    axis, in its own shape). Without that step's layout such a leaf cannot be read back: its
    length is padded, its shape lost."""
    if not isinstance(x, jax.Array) or _is_key(x) or x.ndim != 1 or not isinstance(x.sharding, NamedSharding):
        return None
    spec = tuple(x.sharding.spec)
    if not spec or spec[0] is None:
        return None
    axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    names = tuple(x.sharding.mesh.axis_names)
    if len(names) > 1 and axes == names[-1:]:
        return None  # split over a model axis
    return axes


def refuse_stored(state, what: str, doing: str) -> None:
    """Refuses ``state`` when a leaf looks like a stored sharded chunk (:func:`stored_chunk`)."""
    for path, x in jax.tree_util.tree_leaves_with_path(state):
        axes = stored_chunk(x)
        if axes is not None:
            raise ValueError(
                f"{what}{jax.tree_util.keystr(path)} is a flat {list(x.shape)} split over mesh axes {axes}: the stored "
                f"layout of a sharded weight update, placed by another step object; this one cannot {doing} it "
                "without that step's layout (the leaf's shape and padding): gather the state with the step that "
                "placed it (its gather_state), then place the result with this one's place_state (an array of "
                "your own split so: pass it as host data, np.asarray(x))"
            )


def _float(dtype) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.inexact)) and not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _is_key(x) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _put(x, sharding, leaf: LeafLayout | None = None, layout: StateLayout | None = None):
    if _is_key(x):  # typed PRNG keys travel as their raw key data
        return jax.random.wrap_key_data(_put(jax.random.key_data(x), sharding), impl=jax.random.key_impl(x))
    if isinstance(x, jax.Array) and x.sharding == sharding and not (leaf and (leaf.sharded or leaf.table)):
        return x
    x = np.asarray(x)
    if leaf is not None:
        x = layout.store_leaf(x, leaf, np)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def _get(x):
    if not isinstance(x, jax.Array):
        return np.asarray(x)
    if _is_key(x):
        return jax.random.wrap_key_data(_get(jax.random.key_data(x)), impl=jax.random.key_impl(x))
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def decide(
    state,
    mesh: Mesh,
    forward_inputs: set[int] | None,
    min_shard_size: int,
    shard: bool = True,
    order: tuple[str, ...] | None = None,
    parts: tuple[str, ...] = (),
    model: str | None = None,
    model_dims: tuple[int | None, ...] | None = None,
    tables: dict[int, int] | None = None,
    fsdp: bool = False,
    dims: bool = False,
    partition_dims: Sequence[int | None] | None = None,
    chunk_axes: tuple[str, ...] | None = None,
) -> StateLayout:
    """The layout of every leaf of ``state`` (arrays or ``ShapeDtypeStruct``).

    ``forward_inputs`` holds the flat indices of leaves the forward pass reads (the weights).
    ``shard=False`` (the replicated update) keeps every leaf replicated over the data axes.
    ``parts``: the axes XLA partitions (space, model), over which every chunk is split too.
    ``model_dims``: per leaf, the dimension its sharding rule splits over the axis ``model``.
    ``partition_dims``: per leaf, the dimension a sharded leaf's chunks are laid out per model
    partition along (:func:`partition_dims`; ``None``: flat chunks), with the sharded update and
    the model axis the one left to XLA.
    ``tables``: ``{leaf index: rows per replica}`` of the tables split by rows over the data axes
    (:func:`podscale.parallel.tables.choose`), whatever the weight update.
    ``fsdp=True``: every float leaf of at least ``min_shard_size`` elements (weights and optimizer
    state alike) is stored chunked along its :func:`chunk_dim` over the data axes, where they divide
    one of its dimensions. ``dims=True`` (the sharded update with the sum sent as one collective),
    without a model axis: an optimizer-state leaf the replicas chunk along one of its dimensions is
    stored so (the update's gradient reduce-scattered into that chunk, in its own shape: no
    relayout), split over a space axis too where the replicas times its devices divide that
    dimension; the others keep flat chunks. ``chunk_axes`` (data x FSDP): the data axes FSDP chunks over, where
    not every one (the others hold whole copies of the chunks).
    """
    n = math.prod(mesh.shape[a] for a in (order or mesh.axis_names))
    chunks = (chunk_axes, math.prod(mesh.shape[a] for a in chunk_axes)) if chunk_axes else (None, n)
    per_partition = shard and model and tuple(parts) == (model,)
    leaves = []
    for i, (path, x) in enumerate(jax.tree_util.tree_leaves_with_path(state)):
        shape, dtype = tuple(np.shape(x)), x.dtype
        size = math.prod(shape)
        kw = dict(
            path=jax.tree_util.keystr(path),
            shape=shape,
            dtype=dtype,
            weight=i in (forward_inputs or ()),
            weak_type=bool(getattr(x, "weak_type", False)),
        )
        dim = model_dims[i] if model_dims else None
        chunked = shard and not kw["weight"] and size >= min_shard_size and _float(dtype)
        if fsdp and not (tables and i in tables):
            k = mesh.shape[model] if dim is not None else 1
            leaves.append(_fsdp_leaf(kw, chunks, min_shard_size, dim, k, tiles=model is None))
        elif tables and i in tables:
            what = "table" if kw["weight"] else "a table's optimizer state"
            leaves.append(
                LeafLayout(
                    **kw,
                    stored=Rows(tables[i]),
                    reason=f"{what}: rows split over the data axes ({n} x {tables[i]} rows), looked up and updated there",
                )
            )
        elif dim is not None and not chunked:
            k = mesh.shape[model]
            leaves.append(
                LeafLayout(
                    **kw,
                    stored=WHOLE,
                    reason=f"dimension {dim} split over model axis {model!r} ({k} devices), whole over the replicas",
                    model_dim=dim,
                    model_split=k,
                )
            )
        elif not shard:
            leaves.append(LeafLayout(**kw, stored=WHOLE, reason="weight_update='replicated'"))
        elif not jnp.issubdtype(dtype, jnp.inexact) or jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            leaves.append(LeafLayout(**kw, stored=WHOLE, reason=f"not a float ({dtype})"))
        elif size < min_shard_size:
            leaves.append(LeafLayout(**kw, stored=WHOLE, reason=f"small: {size} < min_shard_size {min_shard_size}"))
        elif kw["weight"]:
            leaves.append(
                LeafLayout(
                    **kw,
                    stored=WHOLE,
                    reason="weight: the forward pass reads it whole; updated on shards, then all-gathered",
                )
            )
        elif dims and model is None and chunk_dim(shape, n) is not None:
            d = chunk_dim(shape, n)
            reason = f"sharded along dimension {d} over the {n} replicas, in its own shape"
            k = math.prod(mesh.shape[a] for a in parts)  # a space axis (no model axis here)
            split = k if k > 1 and shape[d] % (n * k) == 0 else 1
            if split > 1:
                reason += f", each chunk split over the space axis {parts[0]!r} too"
            elif k > 1:
                reason += f", each chunk whole over the space axis {parts[0]!r} ({n} x {k} do not divide {shape[d]})"
            leaves.append(LeafLayout(**kw, stored=Along(d, n, split=split), reason=reason))
        else:
            k = math.prod(mesh.shape[a] for a in parts)
            reason = f"sharded over {n} replicas x {k} partitions" if k > 1 else "sharded"
            if dims and model is None:
                reason += f" (flat: no dimension of {list(shape)} that the {n} replicas divide)"
            elif dims:
                reason += " (flat: a model axis splits the chunks too)"
            dim = partition_dims[i] if per_partition and partition_dims else None
            by = ByPartition(shape, dim, k) if dim is not None else None
            if by is not None:  # per model partition, then over the replicas
                length, padding = by_partition_layout(by, n)
                reason += f", per model partition of dimension {dim}"
            else:
                length, padding = chunk_layout(size, n, k)  # the chunk splits over the space and model axes too
            flat = Flat(length, padding, k, by)
            leaves.append(LeafLayout(**kw, stored=flat, reason=reason, model_split=k if by is not None else 1))
    return StateLayout(jax.tree.structure(state), tuple(leaves), mesh, order, tuple(parts), model)


def _fsdp_leaf(kw: dict, chunks: tuple, min_shard_size: int, model_dim: int | None, k: int, tiles: bool) -> LeafLayout:
    """A leaf's FSDP layout: chunked along :func:`chunk_dim` (with ``tiles``: no model axis) over
    ``chunks`` (``(axes, n)``: the ``n`` replicas of the data axes ``axes``, ``None`` for all), or
    why not."""
    axes, n = chunks
    shape, dtype = kw["shape"], kw["dtype"]
    size = math.prod(shape)
    model = {"model_dim": model_dim, "model_split": k} if model_dim is not None else {}
    if not _float(dtype):
        return LeafLayout(**kw, stored=WHOLE, reason=f"not a float ({dtype}): replicated", **model)
    if size < min_shard_size:
        return LeafLayout(**kw, stored=WHOLE, reason=f"small: {size} < min_shard_size {min_shard_size}", **model)
    dim = chunk_dim(shape, n, tiles)
    if dim is None or n == 1:
        why = "one replica" if n == 1 else f"no dimension of {list(shape)} that the {n} replicas divide"
        return LeafLayout(**kw, stored=WHOLE, reason=f"{why}: replicated", **model)
    over = f"the {n} replicas" if axes is None else f"the {n} replicas of axes {', '.join(axes)}"
    return LeafLayout(**kw, stored=Along(dim, n, axes), reason=f"fsdp: dimension {dim} over {over}", **model)


def partition_dims(jaxpr, model_dims: Sequence[int | None]) -> tuple[int | None, ...]:
    """Per state leaf (``jaxpr``'s first inputs, ``model_dims`` theirs): the dimension its chunks
    are laid out per model partition along (:class:`ByPartition`), where every leaf it is kin to
    (:func:`~podscale.parallel.interpret.kin`: computed elementwise with it, as a weight with its
    gradient and optimizer state) is split along that one dimension; else ``None`` (flat chunks).
    The weight update's replay chunks a gradient by the same rule (``Rewriter.chunking``), so two
    leaves of one shape split along different dimensions each keep their own."""
    kin = interpret.kin(jaxpr, {var: (i, dim) for i, (var, dim) in enumerate(zip(jaxpr.invars, model_dims))})
    return tuple(agreed_dim(d for _, d in kin(var) or ()) for var in jaxpr.invars[: len(model_dims)])
