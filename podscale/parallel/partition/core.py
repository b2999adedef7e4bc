"""The :class:`Partitioner`: conversions between layouts, and the replay of a jaxpr on local
pieces, equation by equation, by the rules of :mod:`.rules` (split values), :mod:`.control`
(calls, loops, branches, callbacks) and :mod:`.draws` (random draws)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core

from podscale._jax import all_gather_invariant
from podscale.parallel import interpret
from podscale.parallel.collectives import Collective
from podscale.parallel.interpret import ELEMENTWISE
from podscale.parallel.partition import chunked, partials, shape_rules
from podscale.parallel.partition.contract_rules import split_spatially
from podscale.parallel.partition.control import CONTROL
from podscale.parallel.partition.draws import random_bits_rows
from podscale.parallel.partition.jaxprs import global_shape, is_zero, source_at, var_dtype, vma
from podscale.parallel.partition.layouts import GROUP, PARTIAL, REPLICATED, Chunked, Layout, Split
from podscale.parallel.partition.rules import RULES, elementwise
from podscale.parallel.partition.setup import Setup
from podscale.parallel.partition.sums import (
    IDENTITY,
    WIDE,
    feeding_group_sums,
    linear_in_partial,
    narrow_float,
    one_replica_sum,
    widen,
)

_REBOUND = frozenset(("scan", "while", "cond", "remat2", "checkpoint"))
"""Control flow whose bodies are traced anew (their inputs read by their types)."""

MAX_SPLIT_CONV = 4
"""With the space axis alone, the image convolutions are split by height explicitly (see
:meth:`Partitioner.bind`) up to this many partitions: the sizes the suite holds exact (tiny SSD and
ResNet-50 at 2 and 4, Mask R-CNN on 2x4)."""


class Partitioner:
    """Evaluates a global-shape jaxpr on local pieces; see the package docstring."""

    def __init__(self, setup: Setup):
        axes, n, fsdp = setup.axes, setup.n, setup.fsdp
        self.setup = setup
        self.axes, self.n = tuple(axes), n
        self.chunk_axes = tuple(axes) if setup.chunk_axes is None else tuple(setup.chunk_axes)
        self.chunk_n = n if setup.chunk_size is None else setup.chunk_size
        """The data axes a :class:`Chunked` value is chunked over and their replicas: every data axis,
        or (data x FSDP) some, the others holding whole copies of the chunks."""
        self.fsdp, self.min_chunk = fsdp, setup.min_chunk
        """FSDP (``weight_update="fsdp"``): a loop's stacked partial sums (a scanned layer's
        gradient) are reduce-scattered into chunks inside the loop, so that no gradient is held
        whole. Chunked values (:class:`Chunked`) are computed on by their rules whatever this says."""
        self.chunk_partials = fsdp if setup.chunk_partials is None else setup.chunk_partials
        """A partial sum of at least ``min_chunk`` elements that the update reads elementwise is
        reduce-scattered into chunks (:func:`.chunked.settle`): FSDP, and the sharded update's
        chunks along a dimension (``state_layout.decide``)."""
        self._update_only = None
        """:func:`~podscale.parallel.interpret.update_only` of the step's jaxpr: the sharded update
        sums a partial sum into chunks for such a family only (a batch statistic is read whole by
        the forward pass: summed into chunks, it would be gathered again)."""
        self.leaving = False
        """Set while the step's outputs are converted to their stored layouts: a chunk gathered
        then is an updated weight's (the update's traffic, for the plan), not a use's."""
        self.runs = 1
        """How many times the equations being replayed run per step: a loop body's, its trip count
        (a collective recorded there runs that many times)."""
        self.table_leaves = dict(setup.table_leaves)
        """``{input index: rows per replica}``: the step's inputs that are tables split by rows
        (and their optimizer state). A gradient scattered into a zero table stays split by rows
        where it is kin to them (:meth:`table_rows_of`), not where it has a table's shape."""
        self.ctx: tuple = ()
        """The ids of the call, remat, loop and branch equations whose jaxpr is running: how
        :func:`~podscale.parallel.interpret.kin` names a variable inside them."""
        self._table_kin = None
        self.region_axes = dict(setup.region_axes)
        """Per role a region can be partitioned over (``space``, ``model``): its mesh axis and size
        (:mod:`podscale.parallel.regions`)."""
        self.communications = 0
        """How many values the replay has summed or gathered over the data axes so far (a region
        run by hand must need none: :func:`~podscale.parallel.partition.control._region`)."""
        self.regions: list[dict] = []
        """Each region of the step met, how it was partitioned (by hand, or why not), for the plan."""
        self.conv_axes = tuple(setup.conv_axes)
        """The mesh axes left to XLA that every convolution's operands and result are split over, by
        their spatial dimensions (``contract_rules.split_spatially``): with two of them (data x
        space x model), where XLA's partitioner is otherwise off by an axis's size; with the space
        axis alone, the image layers' inputs and results by height (see :meth:`bind`)."""
        self.conv_size = setup.conv_size
        """With one of ``conv_axes``: its size (the partitions of each image)."""
        self.upcast_dots = setup.platform == "cpu"
        """How a 16-bit ``dot_general`` or convolution accumulates in float32: on GPUs and TPUs, as
        the op itself (``preferred_element_type=float32``); XLA:CPU has no such kernel for every
        shape, so there its operands are widened first (exact: every 16-bit float is a float32)."""
        self.independent_rng = setup.independent_rng
        """Opt-in: batch-shaped draws come from per-replica streams instead of one device's."""
        self.batch_rows = setup.batch_rows
        """The global batch size: a random draw with this many leading rows is drawn row-split."""
        self.group_axis, self.group_size = setup.group_axis, setup.group_size
        """``group_axis``: the mesh axis of batch-norm groups (``make_mesh(bn_group_size=k)``); the
        step was traced with it bound to size 1, so a ``psum`` over it is the model's group sum."""
        self.feeds_group_sum: set = set()
        self.microbatches: dict[int, Any] = {}
        """Rows a reshape cut into microbatches (``[k, rows / k, ...]``, each replica's whole ones),
        by id: a scan over them exchanges them (``control._unscanned``)."""
        self._zeros: set = set()
        """Variables that are a broadcast zero (``jnp.zeros``): already a partial sum of zeros."""
        self._group_values: set[int] = set()
        self.broadcasts: dict[int, tuple] = {}
        """Whole values a ``broadcast_in_dim`` made, by id: (the value, the equation, its operand),
        so that a block of one is broadcast at the block's size (:func:`shape_rules.broadcast_block`)."""
        """ids of the group values an equation is being computed on (as replicated ones)."""
        self.whole_ops: list[str] = []
        """Equations computed on whole values because no rule ran them on pieces, for the plan."""
        self.collectives: list[Collective] = []
        """The collectives the partitioning adds itself, for the plan: (kind, mesh axes, bytes of the
        buffer each device contributes, what for). Its sums of partial values are the replay's to fuse and
        record."""
        self._memo: dict[tuple, tuple[Any, Any]] = {}
        """Conversions already made, by (id of the local value, source, destination): a partial
        sum read by two ops (Adam's ``g`` and ``g * g``) is summed once."""
        self._padded: dict[int, tuple[Any, int]] = {}
        """Values split by rows in padded blocks (a table's rows, and every value computed from
        them row by row: its gradient, a row-wise statistic), by id: (the value, the rows of the
        whole value). Their padding rows are held at zero (:meth:`pad_rows`), so that a sum over the
        rows or a product contracting them is the whole value's; a value made whole drops them."""
        self.summed_apart_bytes = 0
        """Bytes per replica of partial sums summed apart because one device rounds each term of
        their sum apart (:func:`.partials.sums_apart`): beyond each weight's one gradient sum, for the plan."""
        self._apart: dict[int, Any] = {}
        """Sums of such terms, by id: a further term added to one is summed apart too."""
        self._wide: dict[int, tuple[Any, np.dtype, np.dtype]] = {}
        """Partial sums held in float32 whose sum one device rounds to a narrow float type, by id:
        (the value, that narrow type, the value's type in the program). The program's type is the
        narrow type itself, or a wider one the program cast the narrow sum to (a float32 master
        weight's gradient of a 16-bit product): the sum is rounded to the narrow type, then cast."""

    # -- conversions ---------------------------------------------------------------------------
    @property
    def one(self) -> bool:
        """One replica (a 1xk mesh whose last axis is a space or model axis): every collective over
        the data axes is the value itself, and none is emitted (XLA's SPMD partitioner refuses a
        collective over a manual axis of one device whose operand an automatic axis splits). The
        step's ``shard_map`` then does not type values per replica (``check_vma=False``)."""
        return self.n == 1

    def index(self):
        return jnp.zeros((), jnp.int32) if self.one else lax.axis_index(self.axes)

    def chunk_index(self):
        """This replica's chunk of a :class:`Chunked` value (its index over :attr:`chunk_axes`)."""
        return jnp.zeros((), jnp.int32) if self.one else lax.axis_index(self.chunk_axes)

    @property
    def outer_axes(self) -> tuple[str, ...]:
        """The data axes a chunk is not split over (data x FSDP): copies of it, whose partial sums
        are summed across them."""
        return tuple(a for a in self.axes if a not in self.chunk_axes)

    def vary(self, x):
        """``x`` typed as differing per replica (binding a primitive directly needs equal types)."""
        x = x if isinstance(x, jax.Array) else jnp.asarray(x)
        if self.one:
            return x
        have = vma(x)
        missing = tuple(a for a in self.axes if a not in have)
        return lax.pcast(x, missing, to="varying") if missing else x

    def vary_chunk(self, x):
        """``x``, a :class:`Chunked` value, typed as differing over the axes it is chunked over."""
        return x if self.one else self._vary_over(x, set(self.chunk_axes))

    def _vary_over(self, x, axes: set):
        x = x if isinstance(x, jax.Array) else jnp.asarray(x)
        missing = tuple(a for a in self.axes if a in axes and a not in vma(x))
        return lax.pcast(x, missing, to="varying") if missing else x

    def slice_rows(self, x, dim: int):
        """A whole value's block of ``dim`` on this replica (no communication)."""
        return self.convert(x, REPLICATED, Split(dim))

    def block(self, size: int) -> int:
        """The length of each replica's block of a dimension of ``size`` split over the replicas:
        ``ceil(size / N)``, the last block padded where they do not divide it (a table's rows)."""
        return -(-size // self.n)

    def _slice_rows(self, x, dim: int):
        size = self.block(x.shape[dim])
        if size * self.n != x.shape[dim]:  # blocks of ceil(rows / N), the last padded (a table's)
            x = jnp.pad(x, [(0, size * self.n - x.shape[dim]) if d == dim else (0, 0) for d in range(x.ndim)])
        elif id(x) in self.broadcasts and self.broadcasts[id(x)][0] is x:
            _, eqn, operand = self.broadcasts[id(x)]
            return shape_rules.broadcast_block(self, eqn, operand, dim)
        return lax.dynamic_slice_in_dim(x, self.index() * size, size, dim)

    def whole(self, x, layout: Layout):
        """The whole value, the same on every replica."""
        return self.convert(x, layout, REPLICATED)

    def wide_bind(self, eqn, vals, **changes) -> list[Any]:
        """``eqn`` (a reduction: ``dot_general``, a convolution, ``scatter-add``) on ``vals``,
        accumulated and returned in float32 where its result is a narrow float type."""
        name = eqn.primitive.name
        if name in ("scatter-add", "scatter_add"):
            operand, idx, upd = vals
            if any(vma(v) for v in vals if isinstance(v, jax.Array)):
                operand, idx, upd = (self.vary(v) for v in (operand, idx, upd))
            prm = eqn.params
            out = lax.scatter_add(
                widen(operand),
                idx,
                widen(upd),
                prm["dimension_numbers"],
                indices_are_sorted=prm["indices_are_sorted"],
                unique_indices=prm["unique_indices"],
                mode=prm["mode"],
            )
            return [out]
        dtypes = {np.dtype(v.dtype) for v in vals if hasattr(v, "dtype")}
        if self.upcast_dots or WIDE in dtypes:  # a wide operand beside a 16-bit one: one type for both
            vals = [widen(v) for v in vals]
        return self.bind(eqn, vals, **changes, preferred_element_type=WIDE)

    def _held_wide(self, x):
        """``x``'s entry in :attr:`_wide` (``(x, narrow, program type)``), else ``None``."""
        hit = self._wide.get(id(x))
        return hit if hit is not None and hit[0] is x else None

    def narrow_type(self, x):
        """The narrow float type the sum of ``x`` is rounded to, where ``x`` is a partial sum held
        in float32 for one, else ``None``."""
        hit = self._held_wide(x)
        return None if hit is None else hit[1]

    def cast_type(self, x):
        """Where ``x`` is a partial sum held in float32 whose narrow sum the program then casts to a
        wider type (:meth:`narrow_type`), that type; else ``None``."""
        hit = self._held_wide(x)
        return hit[2] if hit is not None and hit[2] != hit[1] else None

    def hold_cast(self, x, narrow, dtype):
        """``x``, a partial sum in float32 whose sum one device rounds to ``narrow`` and the
        program holds as ``dtype`` (wider): registered so, rounded then cast once summed."""
        self._wide[id(x)] = (x, np.dtype(narrow), np.dtype(dtype))
        return x

    def rounded(self, total, x):
        """``total``, the sum of the partial sums ``x`` over the replicas, rounded as one device
        rounds it: to the narrow type, then cast to the program's, where ``x`` is held wide."""
        hit = self._held_wide(x)
        if hit is None:
            return total
        total = total.astype(hit[1])  # rounded once, after the sum
        return total if hit[2] == hit[1] else total.astype(hit[2])

    def hold(self, x, layout: Layout, dtype=None):
        """``x`` as the partitioner holds a value of the program's type ``dtype`` (``x``'s own
        where not given) in ``layout``: a partial sum of a narrow float type in float32."""
        dtype = getattr(x, "dtype", None) if dtype is None else dtype
        if layout is not PARTIAL or not narrow_float(dtype) or not hasattr(x, "dtype"):
            return x
        if self.narrow_type(x) is not None:
            return x
        if np.dtype(x.dtype) != WIDE:
            x = widen(x)  # a partial that no reduction made (a value on replica 0): exact
        self._wide[id(x)] = (x, np.dtype(dtype), np.dtype(dtype))
        return x

    def padded_rows(self, x, layout: Layout) -> int | None:
        """The rows of the whole value where ``x`` is split by rows in padded blocks, else ``None``."""
        hit = self._padded.get(id(x)) if isinstance(layout, Split) else None
        return hit[1] if hit is not None and hit[0] is x else None

    def pad_rows(self, x, layout: Layout, var):
        """``x``, split by ``layout`` as the jaxpr variable ``var``: where its blocks over-cover
        ``var``'s rows (a table's, padded), registered as padded, with its padding rows zero (what
        an op made of them, ``exp(0)`` say, is not carried on)."""
        if not isinstance(layout, Split) or self.one or not hasattr(x, "shape"):
            return x
        rows = global_shape(var)[layout.dim] if hasattr(var, "aval") else None
        if rows is None or x.shape[layout.dim] * self.n == rows:
            return x
        if self.padded_rows(x, layout) is None:
            local = x.shape[layout.dim]
            row = self.index() * local + lax.broadcasted_iota(jnp.int32, x.shape, layout.dim)
            x = jnp.where(row < rows, x, jnp.zeros((), x.dtype))
            self._padded[id(x)] = (x, rows)
        return x

    def mask_padding(self, x, layout: Layout, fill):
        """``x`` with its padding rows (if any) set to ``fill``: the identity of a reduction over
        the rows (``-inf`` for a max, ``True`` for an all)."""
        rows = self.padded_rows(x, layout)
        if rows is None:
            return x
        local = x.shape[layout.dim]
        row = self.index() * local + lax.broadcasted_iota(jnp.int32, x.shape, layout.dim)
        return jnp.where(row < rows, x, jnp.asarray(fill, x.dtype))

    def to_whole(self, x, layout: Layout):
        """``x`` of ``layout`` made whole on every replica by the collective it needs (a partial
        sum all-reduced, a split gathered, groups averaged), not memoised as :meth:`convert` is."""
        if layout is REPLICATED:
            return x
        self.communications += not self.one
        if self.one:  # one replica: its value is the whole value
            total = one_replica_sum(x)  # marks where the sum would be, for forward_used
            return self.rounded(total, x) if layout is PARTIAL else total
        if layout is GROUP:  # the groups' values averaged (their running statistics, say)
            self.record("all-reduce", self.axes, x, "mean over batch-norm groups")
            return lax.pmean(x, self.axes)
        if layout is PARTIAL:
            return self.rounded(lax.psum(x, self.axes), x)
        out = all_gather_invariant(x, self.axes, axis=layout.dim, tiled=True)
        self.record("all-gather", self.axes, x, "rows made whole")
        rows = self.padded_rows(x, layout)
        if rows is not None:  # split in padded blocks (a table's): drop the padding of the last block
            return lax.slice_in_dim(out, 0, rows, axis=layout.dim)
        return out

    def record(self, kind: str, axes, buffer, why: str, update: bool = False) -> None:
        nbytes = math.prod(np.shape(buffer)) * np.dtype(buffer.dtype).itemsize
        self.collectives.append(Collective(kind, tuple(axes), int(nbytes), 1, why, runs=self.runs, update=update))

    def convert(self, x, src: Layout, dst: Layout):
        if src == dst:
            return x
        if isinstance(src, Chunked):  # gathered for each use, and dropped after it: not kept
            return chunked.convert(self, x, src, dst)
        key = (id(x), src, dst)
        hit = self._memo.get(key)
        if hit is not None and hit[0] is x:
            return hit[1]
        out = self._convert(x, src, dst)
        self._memo[key] = (x, out)  # holds x, so its id is not reused
        return out

    def _convert(self, x, src: Layout, dst: Layout):
        if isinstance(dst, Chunked):
            return chunked.convert(self, x, src, dst)
        if dst is GROUP:
            return x if src is REPLICATED else self.whole(x, src)
        if src is GROUP and dst is REPLICATED:
            return self.to_whole(x, src)
        if src is GROUP:
            src = REPLICATED  # a group's whole value: sliced or masked like a replicated one
        if dst is REPLICATED:
            return self.to_whole(x, src)
        if src is not REPLICATED:
            x = self.whole(x, src)
        if dst is PARTIAL and id(x) in self._group_values:
            raise NotImplementedError(
                "a batch-norm group statistic (bn_group_size) meets a sum over the whole batch in an op podscale "
                "cannot yet compute per group. Drop bn_group_size, or report the step."
            )
        if dst is PARTIAL:  # the whole value on replica 0, zeros elsewhere: it sums to itself
            return jnp.where(self.index() == 0, x, jnp.zeros_like(x))
        return self._slice_rows(x, dst.dim)

    def splittable(self, shape, dim: int) -> bool:
        """Whether a whole value of ``shape`` can be cut into this replica's block of ``dim`` to
        meet a value split along it. Where the replicas do not divide the dimension, the blocks
        are ``ceil(size / N)`` long and the last is padded (:meth:`_slice_rows`), as a table's rows
        are stored: only a value computed from such padded blocks is split along such a
        dimension, so the two meet in one geometry."""
        return 0 <= dim < len(shape) and shape[dim] > 0

    def divides(self, shape, dim: int) -> bool:
        """Whether the replicas divide dimension ``dim`` of ``shape`` into equal blocks: where a rule
        chooses to split a value (a reshape's result, a draw of the batch's rows), not to meet one."""
        return 0 <= dim < len(shape) and shape[dim] % self.n == 0 and shape[dim] > 0

    # -- evaluation ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self):
        """The body of a loop, a branch or a remat is a new trace: conversions made outside it
        are not reused inside, nor the other way round."""
        saved, self._memo = self._memo, {}
        try:
            yield
        finally:
            self._memo = saved

    def table_rows_of(self, var) -> int | None:
        """The rows per replica of the table split by rows that ``var`` (in the running jaxpr) is
        computed elementwise with (its gradient, updated with it and its optimizer state), or
        ``None`` (also in the body of a form :func:`~podscale.parallel.interpret.kin` does not
        walk)."""
        found = self._table_kin(var, self.ctx) if self._table_kin is not None else None
        return next(iter(found)) if found and len(found) == 1 else None

    def _moves_memory(self, eqn, ins) -> bool:
        """A ``device_put`` to memory spaces only, of values of one layout (bound together, they
        are typed alike), none split in padded blocks (their padding is held at zero by a masked
        select, which cannot read host memory): each piece moves as it is."""
        spaces = all(isinstance(d, jax.memory.Space) for d in eqn.params["devices"])
        return spaces and len({lay for _, lay in ins}) == 1 and all(self.padded_rows(v, lay) is None for v, lay in ins)

    def only_updated(self, var) -> bool:
        """Whether nothing but the update reads ``var``'s elementwise family (see ``_update_only``)."""
        computed = not isinstance(var, core.Literal)  # a literal is no family's (nor hashable)
        return self._update_only is not None and computed and self._update_only(var, self.ctx)

    def run(self, jaxpr, consts, args: Sequence[tuple[Any, Layout]]) -> list[tuple[Any, Layout]]:
        if self._table_kin is None and self.table_leaves and not self.ctx:  # the step's own jaxpr
            self._table_kin = interpret.kin(jaxpr, {jaxpr.invars[i]: rows for i, rows in self.table_leaves.items()})
        if self._update_only is None and self.chunk_partials and not self.fsdp and not self.ctx:
            self._update_only = interpret.update_only(jaxpr)  # the step's own jaxpr, run first
        env: dict[Any, tuple[Any, Layout]] = {}
        for v, c in zip(jaxpr.constvars, consts, strict=True):
            env[v] = (c, REPLICATED)
        for v, (a, lay) in zip(jaxpr.invars, args, strict=True):
            env[v] = (self.pad_rows(self.hold(a, lay, var_dtype(v)), lay, v), lay)

        def read(var):
            if isinstance(var, core.Literal):
                return (var.val, REPLICATED)
            return env[var]

        if self.group_axis is not None:
            self.feeds_group_sum |= feeding_group_sums(jaxpr, self.group_axis)
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "broadcast_in_dim" and is_zero(eqn.invars[0]):
                self._zeros.add(eqn.outvars[0])
            ins = [read(v) for v in eqn.invars]
            apart = partials.sums_apart(self, eqn, ins)
            with interpret.source(eqn):
                outs = self.equation(eqn, ins)
            if apart:
                self._apart.update((id(o), o) for o, _ in outs)
            for var, (out, lay) in zip(eqn.outvars, outs, strict=True):
                env[var] = (self.pad_rows(self.hold(out, lay, var_dtype(var)), lay, var), lay)
        return [read(v) for v in jaxpr.outvars]

    def equation(self, eqn, ins) -> list[tuple[Any, Layout]]:
        name = eqn.primitive.name
        if name in _REBOUND and any(self.cast_type(v) is not None for v, _ in ins):
            # A body traced anew (a loop, a branch, a remat) reads its inputs by their types, and
            # a cast sum's rounding is not in its type: it enters summed.
            ins = [(self.whole(v, lay), REPLICATED) if self.cast_type(v) is not None else (v, lay) for v, lay in ins]
        if name not in CONTROL and any(self.narrow_type(v) is not None for v, _ in ins):
            out = partials.wide_rule(self, eqn, ins)
            if out is not None:
                return out
            # Anything else reads the sum, rounded to the program's type (in chunks, for the update
            # of chunked weights: :func:`.chunked.settle`).
            ins = [
                chunked.settle(self, eqn, ins, i) if self.narrow_type(v) is not None else (v, lay)
                for i, (v, lay) in enumerate(ins)
            ]
        layouts = [lay for _, lay in ins]
        if name == "psum" and self.group_axis is not None and set(eqn.params["axes"]) == {self.group_axis}:
            return [self.group_sum(v, lay) for v, lay in ins]
        if GROUP in layouts and PARTIAL in layouts and linear_in_partial(eqn, layouts):
            # A partial sum times a group's value: the group's share of the sum over the groups
            # of (group sum x group value), as batch norm over each group's rows gives.
            return [(o, PARTIAL) for o in self.bind(eqn, [v for v, _ in ins])]
        if GROUP in layouts and name not in CONTROL:
            # A chunk beside a group's value is gathered first: each group's result is its own,
            # where a chunk of it would mix the groups' values once gathered.
            ins = [(self.whole(v, lay), REPLICATED) if isinstance(lay, Chunked) else (v, lay) for v, lay in ins]
            # Computes like a replicated value; what comes out whole is the group's.
            group_ids = {id(v) for v, lay in ins if lay is GROUP}
            self._group_values |= group_ids
            try:
                outs = self.equation(eqn, [(v, REPLICATED if lay is GROUP else lay) for v, lay in ins])
            finally:
                self._group_values -= group_ids
            return [(v, GROUP if lay is REPLICATED else lay) for v, lay in outs]
        if PARTIAL in layouts and id(eqn) in self.feeds_group_sum:
            # On its way to the model's group sum: linear ops keep the partial sum.
            scaled = name in ("div", "mul") and layouts[1] is REPLICATED
            scaled |= name == "mul" and layouts[0] is REPLICATED
            joined = name in ("stack", "concatenate") and all(lay is PARTIAL for lay in layouts)
            if scaled or joined:
                return [(o, PARTIAL) for o in self.bind(eqn, [v for v, _ in ins])]
        if name in CONTROL:
            return CONTROL[name](self, eqn, ins)
        if name == "random_bits" and layouts == [REPLICATED]:
            out = random_bits_rows(self, eqn, ins[0][0])
            if out is not None:
                return out
        if name == "broadcast_in_dim" and layouts == [REPLICATED] and self.n > 1:
            (out,) = self.bind(eqn, [ins[0][0]])
            self.broadcasts[id(out)] = (out, eqn, ins[0][0])  # a block of it is made at the block's size
            return [(out, REPLICATED)]
        if name == "reduce_sum" and layouts == [REPLICATED] and id(ins[0][0]) not in self._group_values:
            # (A batch-norm group's value is its group's own: chunks summed over every replica would
            # mix the groups'.)
            out = chunked.whole_sum(self, eqn, ins[0])
            if out is not None:
                return out
        if all(lay is REPLICATED for lay in layouts):
            return [(o, REPLICATED) for o in self.bind(eqn, [v for v, _ in ins])]
        if name in IDENTITY and len(ins) == 1:
            return [ins[0]]
        if name == "device_put" and self._moves_memory(eqn, ins):
            # A move to or from host memory (a remat policy's offload): each piece moves as it is.
            return list(zip(self.bind(eqn, [v for v, _ in ins]), layouts, strict=True))
        if PARTIAL in layouts:
            out = partials.partial_rule(self, eqn, ins)
            if out is not None:
                return out
            ins = [chunked.settle(self, eqn, ins, i) if lay is PARTIAL else (v, lay) for i, (v, lay) in enumerate(ins)]
            if all(lay is REPLICATED for _, lay in ins):
                return [(o, REPLICATED) for o in self.bind(eqn, [v for v, _ in ins])]
        if any(isinstance(lay, Chunked) for _, lay in ins):
            return chunked.equation(self, eqn, ins)
        rule = RULES.get(name)
        if name in ELEMENTWISE:
            rule = elementwise
        out = rule(self, eqn, ins) if rule is not None else None
        if out is not None:
            return out
        return self.fallback(eqn, ins)

    def group_sum(self, v, lay):
        """The model's sum over its batch-norm group, in a program traced with the group axis of
        size 1: a partial sum (the replica's share of a statistic over the whole batch, divided by
        the whole batch's count) summed over the group, times the number of groups, is the
        statistic over the group's rows."""
        if lay is PARTIAL:
            self.communications += not self.one
            groups = self.n // self.group_size
            total = one_replica_sum(v) if self.one else lax.psum(v, self.group_axis)
            if not self.one:
                self.record("all-reduce", (self.group_axis,), total, "batch-norm group statistic")
            return (self.rounded(total * jnp.asarray(groups, total.dtype), v), GROUP)
        return (v, lay)  # already whole: a sum over one member

    def fallback(self, eqn, ins):
        shapes = [list(v.aval.shape) for v in eqn.invars if hasattr(v.aval, "shape")]
        where = source_at(eqn)
        if any(isinstance(lay, Split) for _, lay in ins) and any(id(v) in self._group_values for v, _ in ins):
            # Whole rows of every group with this group's statistics would be wrong for the others.
            raise NotImplementedError(
                f"{eqn.primitive.name}{shapes}{where} combines batch-norm group statistics (bn_group_size) with "
                "the whole batch, which podscale cannot yet compute per group. Drop bn_group_size, or move that "
                "op out of the path of the group statistics."
            )
        self.whole_ops.append(f"{eqn.primitive.name}{shapes}{where}")
        vals = [self.whole(v, lay) for v, lay in ins]
        return [(o, REPLICATED) for o in self.bind(eqn, vals)]

    def bind(self, eqn, vals, **changes) -> list[Any]:
        """Binds ``eqn``'s primitive on ``vals``, with the params in ``changes`` that it has."""
        params = dict(eqn.params, **{k: v for k, v in changes.items() if k in eqn.params})
        params = eqn.primitive.get_bind_params(params)
        varying = set().union(*(vma(v) for v in vals if isinstance(v, jax.Array)))
        if varying:  # every operand typed as varying over every data axis, but chunks over their own
            target = varying if self.outer_axes and varying <= set(self.chunk_axes) else set(self.axes)
            vals = [self._vary_over(v, target) for v in vals]
        conv = eqn.primitive.name == "conv_general_dilated" and self.conv_axes
        if conv and len(self.conv_axes) == 1:
            # One axis (the space axis alone), of at most MAX_SPLIT_CONV partitions: a convolution
            # over the batch's images (a layer or its input gradient: its batch dimension first,
            # of the batch's rows) is split, its input and result by height. XLA then splits an
            # uneven height (SSD's 38 rows over 4) by padding, where its own propagation ran those
            # layers on 2 of the 4 partitions. The kernel stays whole, and a kernel gradient is
            # left to XLA, which sums the partitions' shares (split over its window, a kernel
            # would be gathered again for every convolution). Convolutions over other rows (Mask
            # R-CNN's regions) are left to XLA's propagation, as is every convolution past
            # MAX_SPLIT_CONV partitions: at 8, with maps of 1 and 2 rows per partition, XLA's kernel
            # gradient of a strided convolution came out wrong (tiny Mask R-CNN on 1x8, res4_0's
            # 3x3 stride-2 kernel 0.19 off, relative), where its propagation alone is exact.
            dn = params["dimension_numbers"]
            conv = (
                self.conv_size <= MAX_SPLIT_CONV
                and dn.lhs_spec[0] == 0
                and dn.out_spec[0] == 0
                and len(dn.lhs_spec) > 2
                and eqn.invars[0].aval.shape[0] == self.batch_rows
            )
            if conv:
                vals = [split_spatially(eqn, vals[0], dn.lhs_spec, self.conv_axes), *vals[1:]]
        elif conv:
            dn = params["dimension_numbers"]
            lhs, rhs = (split_spatially(eqn, v, spec, self.conv_axes) for v, spec in zip(vals, dn[:2], strict=False))
            vals = [lhs, rhs, *vals[2:]]
        # Not under ``eqn.ctx``: that context is the global trace's, outside the shard_map.
        outs = eqn.primitive.bind(*vals, **params)
        if conv:
            outs = split_spatially(eqn, outs, dn.out_spec, self.conv_axes)
        return list(outs) if eqn.primitive.multiple_results else [outs]
