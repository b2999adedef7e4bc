"""Partitions the single-device step, traced at the *global* batch shape, over the data axes.

The specification is the user's step run on one device on the whole batch. podscale traces that
program (``jax.make_jaxpr`` at the global shapes, loops kept as loops) and evaluates it inside a
``shard_map`` that is manual over the data axes, carrying a *layout* with every value:

* ``REPLICATED``: the whole value, the same on every replica (weights, scalars, optimizer state);
* :class:`Split` ``(dim)``: this replica's contiguous block of ``dim`` (the batch and everything
  computed row by row from it), in the order of ``lax.axis_index(axes)``;
* ``PARTIAL``: a value of the whole shape whose *sum over the replicas* is the true value: what a
  reduction over a split dimension leaves (a weight's gradient, a token count, a loss's sum).

An equation with a rule runs on the local pieces and says its output layout (an elementwise op on
split rows stays split, a ``dot_general`` contracting the split batch gives a partial sum, ...).
A partial sum stays partial through sums and shape-only ops (so a weight used at every time step
of a loop, or in two places, is summed once) and is resolved by one ``psum`` (bound as
``psum_invariant``, which :mod:`podscale.weight_update` defers, fuses and, with the sharded update,
turns into a reduce-scatter) when something nonlinear reads it. An equation without a rule gets its
operands made whole (all-gathered or summed), which is always correct, and is listed in
``Partitioner.whole_ops`` for the plan. Nothing is rescaled: a mean over the batch divides by the
global count because the program says so, and a sum, a weighted mean or a per-example gradient
comes out as on one device.

A partial sum in a 16-bit float type is held in float32 (its *wide* form): the local reduction
that makes it (a ``dot_general``, a convolution, a ``reduce_sum``, a ``scatter-add``) accumulates
in float32, the sum over the replicas is taken in float32, and the result is rounded to the
program's type once, after that sum. One device rounds the whole batch's sum once too, so the
result is its rounding up to summation order: a float16 gradient overflows (and a loss-scaled
step is skipped) exactly where one device's does, not where one replica's share happens to.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core

from podscale._jax import all_gather_invariant, pe, prng, source_info_util, threefry2x32
from podscale.parallel import _interpret
from podscale.parallel._interpret import varying_axes

# -- layouts ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Split:
    """This replica's contiguous block of dimension ``dim``."""

    dim: int

    def __repr__(self) -> str:
        return f"split({self.dim})"


class _Named:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


REPLICATED = _Named("replicated")
PARTIAL = _Named("partial")
GROUP = _Named("group")
"""Batch norm over groups of replicas (opt-in): a whole value that is the same within a group
and differs between groups (the group's statistics). It computes like a replicated value."""

Layout = Any  # REPLICATED | PARTIAL | Split


def join(a: Layout, b: Layout) -> Layout:
    """The layout two values of one place (a loop carry, the branches of a cond) can share."""
    if a == b:
        return a
    if a is REPLICATED:
        return b
    if b is REPLICATED:
        return a
    return REPLICATED


class _Retry(Exception):
    """A loop carry or a branch output came out in another layout than assumed: trace again."""

    def __init__(self, layouts):
        super().__init__("retry")
        self.layouts = layouts


ELEMENTWISE = frozenset(
    """abs acos acosh add add_any and asin asinh atan atan2 atanh cbrt ceil clamp convert_element_type
    copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt igamma igammac imag
    integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not or population_count
    pow real reduce_precision rem round rsqrt select_n shift_left shift_right_arithmetic shift_right_logical
    sign sin sinh sqrt square sub tan tanh xor conj complex random_bits random_fold_in random_split
    random_wrap random_unwrap random_seed threefry2x32 polygamma zeta bessel_i0e bessel_i1e regularized_incomplete_beta
    stop_gradient bitcast_convert_type erf_inv""".split()
)
"""Ops whose outputs are computed position by position from their operands' positions (with the
operands' leading dimensions for the random-key ops, whose outputs extend the key's shape)."""

_KEY_OPS = frozenset("random_bits random_fold_in random_split random_wrap random_unwrap random_seed".split())

# Ops through which a partial sum stays partial: the sum of their results over the replicas is
# their result on the sum. Shape-only ops and sums; nothing that multiplies, so that the arithmetic
# after the sum is the single device's.
_LINEAR_UNARY = frozenset(
    "neg reshape transpose squeeze expand_dims slice broadcast_in_dim reduce_sum rev copy copy_p".split()
)
_LINEAR_SUMS = frozenset("add add_any sub".split())
_IDENTITY = frozenset("reshard sharding_constraint mesh_cast".split())


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)


def _narrow_float(dtype) -> bool:
    """A float type narrower than float32 (float16, bfloat16, the float8s): a partial sum in it is
    held in float32."""
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating) and np.dtype(dtype).itemsize < 4


@jax.jit
def one_replica_sum(x):
    """The sum over one replica: ``x`` itself. A named call in the program, so that
    ``weight_update.forward_used`` sees where a sum over the replicas would be (what is computed
    after it is the same on every replica, as after a real sum)."""
    return x


WIDE = np.dtype(np.float32)
"""The type a partial sum in a narrow float type is held in until it is summed and rounded."""


# -- the partitioner ---------------------------------------------------------------------------


class Partitioner:
    """Evaluates a global-shape jaxpr on local pieces; see the module docstring."""

    def __init__(
        self,
        axes: Sequence[str],
        n: int,
        group_axis: str | None = None,
        group_size: int = 1,
        batch_rows: int | None = None,
        independent_rng: bool = False,
        platform: str = "cpu",
    ):
        self.axes, self.n = tuple(axes), n
        self.upcast_dots = platform == "cpu"
        """How a 16-bit ``dot_general`` or convolution accumulates in float32: on GPUs and TPUs, as
        the op itself (``preferred_element_type=float32``); XLA:CPU has no such kernel for every
        shape, so there its operands are widened first (exact: every 16-bit float is a float32)."""
        self.independent_rng = independent_rng
        """Opt-in: batch-shaped draws come from per-replica streams instead of one device's."""
        self.batch_rows = batch_rows
        """The global batch size: a random draw with this many leading rows is drawn row-split."""
        self.group_axis, self.group_size = group_axis, group_size
        """``group_axis``: the mesh axis of batch-norm groups (``make_mesh(bn_group_size=k)``); the
        step was traced with it bound to size 1, so a ``psum`` over it is the model's group sum."""
        self._feeds_group_sum: set = set()
        self._zeros: set = set()
        """Variables that are a broadcast zero (``jnp.zeros``): already a partial sum of zeros."""
        self._group_values: set[int] = set()
        """ids of the group values an equation is being computed on (as replicated ones)."""
        self.whole_ops: list[str] = []
        """Equations computed on whole values because no rule ran them on pieces, for the plan."""
        self.collectives: list[tuple[str, tuple[str, ...], int, str]] = []
        """The collectives the partitioning adds itself, for the plan: (kind, mesh axes, bytes of the
        buffer each device contributes, what for). Its sums of partial values are the replay's to fuse and
        record."""
        self._memo: dict[tuple, tuple[Any, Any]] = {}
        """Conversions already made, by (id of the local value, source, destination): a partial
        sum read by two ops (Adam's ``g`` and ``g * g``) is summed once."""
        self._wide: dict[int, tuple[Any, np.dtype]] = {}
        """Partial sums held in float32 for a narrow float type, by id: (the value, the program's
        type), which the value is rounded to once it is summed."""

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

    def vary(self, x):
        """``x`` typed as differing per replica (binding a primitive directly needs equal types)."""
        x = x if isinstance(x, jax.Array) else jnp.asarray(x)
        if self.one:
            return x
        have = _vma(x)
        missing = tuple(a for a in self.axes if a not in have)
        return lax.pcast(x, missing, to="varying") if missing else x

    def slice_rows(self, x, dim: int):
        """A whole value's block of ``dim`` on this replica (no communication)."""
        return self.convert(x, REPLICATED, Split(dim))

    def _slice_rows(self, x, dim: int):
        size = x.shape[dim] // self.n
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
            if any(_vma(v) for v in vals if isinstance(v, jax.Array)):
                operand, idx, upd = (self.vary(v) for v in (operand, idx, upd))
            prm = eqn.params
            out = lax.scatter_add(
                operand.astype(WIDE),
                idx,
                upd.astype(WIDE),
                prm["dimension_numbers"],
                indices_are_sorted=prm["indices_are_sorted"],
                unique_indices=prm["unique_indices"],
                mode=prm["mode"],
            )
            return [out]
        dtypes = {np.dtype(v.dtype) for v in vals if hasattr(v, "dtype")}
        if self.upcast_dots or WIDE in dtypes:  # a wide operand beside a 16-bit one: one type for both
            vals = [v.astype(WIDE) if _narrow_float(getattr(v, "dtype", None)) else v for v in vals]
        return self.bind(eqn, vals, **changes, preferred_element_type=WIDE)

    def narrow_type(self, x):
        """The program's type of ``x`` where ``x`` is a partial sum held in float32 for a narrow
        float type, else ``None``."""
        hit = self._wide.get(id(x))
        return hit[1] if hit is not None and hit[0] is x else None

    def hold(self, x, layout: Layout, dtype=None):
        """``x`` as the partitioner holds a value of the program's type ``dtype`` (``x``'s own
        where not given) in ``layout``: a partial sum of a narrow float type in float32."""
        dtype = getattr(x, "dtype", None) if dtype is None else dtype
        if layout is not PARTIAL or not _narrow_float(dtype) or not hasattr(x, "dtype"):
            return x
        if self.narrow_type(x) is not None:
            return x
        if np.dtype(x.dtype) != WIDE:
            x = x.astype(WIDE)  # a partial that no reduction made (a value on replica 0): exact
        self._wide[id(x)] = (x, np.dtype(dtype))
        return x

    def _whole(self, x, layout: Layout):
        if layout is REPLICATED:
            return x
        if self.one:  # one replica: its value is the whole value
            narrow = self.narrow_type(x) if layout is PARTIAL else None
            x = one_replica_sum(x)  # marks where the sum would be, for forward_used
            return x if narrow is None else x.astype(narrow)
        if layout is GROUP:  # the groups' values averaged (their running statistics, say)
            self.record("all-reduce", self.axes, x, "mean over batch-norm groups")
            return lax.pmean(x, self.axes)
        if layout is PARTIAL:
            narrow = self.narrow_type(x)
            total = lax.psum(x, self.axes)
            return total if narrow is None else total.astype(narrow)  # rounded once, after the sum
        out = all_gather_invariant(x, self.axes, axis=layout.dim, tiled=True)
        self.record("all-gather", self.axes, x, "rows made whole")
        return out

    def record(self, kind: str, axes, buffer, why: str) -> None:
        nbytes = math.prod(np.shape(buffer)) * np.dtype(buffer.dtype).itemsize
        self.collectives.append((kind, tuple(axes), int(nbytes), why))

    def convert(self, x, src: Layout, dst: Layout):
        if src == dst:
            return x
        key = (id(x), src, dst)
        hit = self._memo.get(key)
        if hit is not None and hit[0] is x:
            return hit[1]
        out = self._convert(x, src, dst)
        self._memo[key] = (x, out)  # holds x, so its id is not reused
        return out

    def _convert(self, x, src: Layout, dst: Layout):
        if dst is GROUP:
            return x if src is REPLICATED else self.whole(x, src)
        if src is GROUP and dst is REPLICATED:
            return self._whole(x, src)
        if src is GROUP:
            src = REPLICATED  # a group's whole value: sliced or masked like a replicated one
        if dst is REPLICATED:
            return self._whole(x, src)
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

    def run(self, jaxpr, consts, args: Sequence[tuple[Any, Layout]]) -> list[tuple[Any, Layout]]:
        env: dict[Any, tuple[Any, Layout]] = {}
        for v, c in zip(jaxpr.constvars, consts, strict=True):
            env[v] = (c, REPLICATED)
        for v, (a, lay) in zip(jaxpr.invars, args, strict=True):
            env[v] = (self.hold(a, lay, _dtype(v)), lay)

        def read(var):
            if isinstance(var, core.Literal):
                return (var.val, REPLICATED)
            return env[var]

        if self.group_axis is not None:
            self._feeds_group_sum |= _feeding_group_sums(jaxpr, self.group_axis)
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "broadcast_in_dim" and _is_zero(eqn.invars[0]):
                self._zeros.add(eqn.outvars[0])
            ins = [read(v) for v in eqn.invars]
            with _interpret.source(eqn):
                outs = self.equation(eqn, ins)
            for var, (out, lay) in zip(eqn.outvars, outs, strict=True):
                env[var] = (self.hold(out, lay, _dtype(var)), lay)
        return [read(v) for v in jaxpr.outvars]

    def equation(self, eqn, ins) -> list[tuple[Any, Layout]]:
        name = eqn.primitive.name
        if name not in _CONTROL and any(self.narrow_type(v) is not None for v, _ in ins):
            out = self.wide_rule(eqn, ins)
            if out is not None:
                return out
            # Anything else reads the sum, rounded to the program's type.
            ins = [(self.whole(v, lay), REPLICATED) if self.narrow_type(v) is not None else (v, lay) for v, lay in ins]
        layouts = [lay for _, lay in ins]
        if name == "psum" and self.group_axis is not None and set(eqn.params["axes"]) == {self.group_axis}:
            return [self.group_sum(v, lay) for v, lay in ins]
        if GROUP in layouts and PARTIAL in layouts and _linear_in_partial(eqn, layouts):
            # A partial sum times a group's value: the group's share of the sum over the groups
            # of (group sum x group value), as batch norm over each group's rows gives.
            return [(o, PARTIAL) for o in self.bind(eqn, [v for v, _ in ins])]
        if GROUP in layouts and name not in _CONTROL:
            # Computes like a replicated value; what comes out whole is the group's.
            group_ids = {id(v) for v, lay in ins if lay is GROUP}
            self._group_values |= group_ids
            try:
                outs = self.equation(eqn, [(v, REPLICATED if lay is GROUP else lay) for v, lay in ins])
            finally:
                self._group_values -= group_ids
            return [(v, GROUP if lay is REPLICATED else lay) for v, lay in outs]
        if PARTIAL in layouts and id(eqn) in self._feeds_group_sum:
            # On its way to the model's group sum: linear ops keep the partial sum.
            scaled = name in ("div", "mul") and layouts[1] is REPLICATED
            scaled |= name == "mul" and layouts[0] is REPLICATED
            joined = name in ("stack", "concatenate") and all(lay is PARTIAL for lay in layouts)
            if scaled or joined:
                return [(o, PARTIAL) for o in self.bind(eqn, [v for v, _ in ins])]
        if name in _CONTROL:
            return _CONTROL[name](self, eqn, ins)
        if name == "random_bits" and layouts == [REPLICATED]:
            out = _random_bits_rows(self, eqn, ins[0][0])
            if out is not None:
                return out
        if all(lay is REPLICATED for lay in layouts):
            return [(o, REPLICATED) for o in self.bind(eqn, [v for v, _ in ins])]
        if name in _IDENTITY and len(ins) == 1:
            return [ins[0]]
        if PARTIAL in layouts:
            out = self.partial_rule(eqn, ins)
            if out is not None:
                return out
            ins = [
                (
                    self.whole(v, lay) if lay is PARTIAL else v,
                    REPLICATED if lay is PARTIAL else lay,
                )
                for v, lay in ins
            ]
            if all(lay is REPLICATED for _, lay in ins):
                return [(o, REPLICATED) for o in self.bind(eqn, [v for v, _ in ins])]
        rule = _RULES.get(name)
        if name in ELEMENTWISE:
            rule = _elementwise
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
            groups, narrow = self.n // self.group_size, self.narrow_type(v)
            total = one_replica_sum(v) if self.one else lax.psum(v, self.group_axis)
            if not self.one:
                self.record("all-reduce", (self.group_axis,), total, "batch-norm group statistic")
            total = total * jnp.asarray(groups, total.dtype)
            return (total if narrow is None else total.astype(narrow), GROUP)
        return (v, lay)  # already whole: a sum over one member

    def fallback(self, eqn, ins):
        shapes = [list(v.aval.shape) for v in eqn.invars if hasattr(v.aval, "shape")]
        where = _source(eqn)
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
        if any(_vma(v) for v in vals if isinstance(v, jax.Array)):
            vals = [self.vary(v) for v in vals]
        # Not under ``eqn.ctx``: that context is the global trace's, outside the shard_map.
        outs = eqn.primitive.bind(*vals, **params)
        return list(outs) if eqn.primitive.multiple_results else [outs]

    # -- partial sums ----------------------------------------------------------------------------
    def wide_rule(self, eqn, ins):
        """Equations through which a partial sum held in float32 stays partial (and in float32:
        the ops a partial sum stays partial through are sums and shape ops, so no rounding is
        skipped that one device would make before the sum), or ``None``."""
        name = eqn.primitive.name
        layouts = [lay for _, lay in ins]
        if name == "psum" and self.group_axis is not None and set(eqn.params["axes"]) == {self.group_axis}:
            return [self.group_sum(v, lay) for v, lay in ins]
        if name in _IDENTITY and len(ins) == 1:
            return [ins[0]]
        keeps = (name in _LINEAR_UNARY and len(ins) == 1) or (
            name in (*_LINEAR_SUMS, "concatenate", "stack") and all(lay is PARTIAL for lay in layouts)
        )
        keeps |= name == "pad" and layouts[1] is REPLICATED and _is_zero(eqn.invars[1])
        keeps |= name == "dynamic_slice" and all(lay is REPLICATED for lay in layouts[1:])
        keeps |= GROUP in layouts and PARTIAL in layouts and _linear_in_partial(eqn, layouts)
        if PARTIAL in layouts and id(eqn) in self._feeds_group_sum:
            keeps |= name in ("div", "mul") and layouts[1] is REPLICATED
            keeps |= name == "mul" and layouts[0] is REPLICATED
        vals = [v for v, _ in ins]
        if name == "convert_element_type" and len(ins) == 1:
            new = np.dtype(eqn.params["new_dtype"])
            if jnp.issubdtype(new, jnp.floating) and new.itemsize >= WIDE.itemsize:
                # Widened by the program (a 16-bit gradient cast to a float32 master weight's type):
                # it stays a partial sum, now of the wide type, with no rounding to 16 bits before
                # the sum. One device's XLA drops that round trip too where it may keep excess
                # precision (xla_allow_excess_precision, on by default). A copy, so that the
                # 16-bit value (if read elsewhere) keeps its own rounding.
                out = lax.copy_p.bind(vals[0]) if new == WIDE else vals[0].astype(new)
                return [(out, PARTIAL)]
        if name in ("scatter-add", "scatter_add") and layouts[1] is REPLICATED:
            vals = [self.convert(vals[0], layouts[0], PARTIAL), vals[1], self.convert(vals[2], layouts[2], PARTIAL)]
            keeps = True
        if not keeps:
            return None
        if name in ("scatter-add", "scatter_add", "dot_general", "conv_general_dilated"):
            return [(o, PARTIAL) for o in self.wide_bind(eqn, vals)]
        vals = [v.astype(WIDE) if _narrow_float(getattr(v, "dtype", None)) else v for v in vals]
        return [(o, PARTIAL) for o in self.bind(eqn, vals)]

    def partial_rule(self, eqn, ins):
        """Equations through which a partial sum stays partial, or ``None``."""
        name = eqn.primitive.name
        layouts = [lay for _, lay in ins]
        vals = [v for v, _ in ins]
        if name in _LINEAR_UNARY and len(ins) == 1:
            return [(o, PARTIAL) for o in self.bind(eqn, vals)]
        if name in _LINEAR_SUMS and all(lay is PARTIAL for lay in layouts):
            return [(o, PARTIAL) for o in self.bind(eqn, vals)]
        if name == "convert_element_type" and _is_float(eqn.params["new_dtype"]) and _is_float(vals[0].dtype):
            if np.dtype(eqn.params["new_dtype"]).itemsize >= np.dtype(vals[0].dtype).itemsize:
                return [(o, PARTIAL) for o in self.bind(eqn, vals)]
            return None
        if name == "pad" and layouts[1] is REPLICATED and _is_zero(eqn.invars[1]):
            return [(o, PARTIAL) for o in self.bind(eqn, vals)]
        if name == "dynamic_slice" and all(lay is REPLICATED for lay in layouts[1:]):
            return [(o, PARTIAL) for o in self.bind(eqn, vals)]
        if name in ("concatenate", "stack") and all(lay is PARTIAL for lay in layouts):
            return [(o, PARTIAL) for o in self.bind(eqn, vals)]
        if name == "scatter-add" and layouts[1] is REPLICATED:
            operand = self.convert(vals[0], layouts[0], PARTIAL)
            updates = self.convert(vals[2], layouts[2], PARTIAL)
            return [(o, PARTIAL) for o in self.bind(eqn, [operand, vals[1], updates])]
        return None


def _linear_in_partial(eqn, layouts) -> bool:
    """Whether ``eqn`` is linear in its one partial operand, the others whole."""
    if layouts.count(PARTIAL) != 1 or any(isinstance(lay, Split) for lay in layouts):
        return False
    name = eqn.primitive.name
    if name in ("mul", "dot_general", "conv_general_dilated", "neg", "convert_element_type", *_LINEAR_UNARY):
        return True
    return name == "div" and layouts[0] is PARTIAL


_GROUP_FEEDERS = frozenset(
    "div mul stack concatenate reshape broadcast_in_dim convert_element_type squeeze slice transpose neg add add_any sub "
    "reduce_sum pad".split()
)


def _feeding_group_sums(jaxpr, axis: str) -> set:
    """ids of the equations whose results reach a ``psum`` over ``axis`` only through scalings
    and shape ops (a mean's division by its count, flax's stacking of mean and mean square)."""
    found: set = set()
    wanted: set = set()
    for eqn in reversed(jaxpr.eqns):
        if eqn.primitive.name == "psum" and set(eqn.params["axes"]) == {axis}:
            wanted.update(v for v in eqn.invars if not isinstance(v, core.Literal))
            continue
        if eqn.primitive.name in _GROUP_FEEDERS and any(v in wanted for v in eqn.outvars):
            found.add(id(eqn))
            wanted.update(v for v in eqn.invars if not isinstance(v, core.Literal))
    return found


def _vma(x) -> frozenset:
    try:
        return varying_axes(jax.typeof(x))
    except TypeError:
        return frozenset()


def _is_zero(var) -> bool:
    return isinstance(var, core.Literal) and np.all(np.asarray(var.val) == 0)


def _source(eqn) -> str:
    try:
        frame = source_info_util.user_frame(eqn.source_info.traceback)
        return f" at {frame.file_name.rsplit('/', 1)[-1]}:{frame.start_line}" if frame else ""
    except Exception:  # source info is a courtesy; never fail the plan over it
        return ""


def _dtype(var):
    """The program's type of ``var`` (``None`` for a token or a key)."""
    dtype = getattr(getattr(var, "aval", None), "dtype", None)
    return dtype if isinstance(dtype, np.dtype) else None


def _global_shape(var) -> tuple[int, ...]:
    return tuple(var.aval.shape)


# -- rules for split values ----------------------------------------------------------------------


def _random_bits_rows(p: Partitioner, eqn, key):
    """This replica's rows of a threefry draw with the batch's leading size (a dropout mask):
    the very bits of the single-device draw (``jax_threefry_partitionable``: bit i is a function
    of the key and the flat index i), computed for the local rows only."""
    shape, bit_width = tuple(eqn.params["shape"]), eqn.params["bit_width"]
    if not shape or shape[0] != p.batch_rows or not p.splittable(shape, 0) or np.shape(key) != ():
        return None
    local = (shape[0] // p.n, *shape[1:])
    if p.independent_rng:  # rng="independent": this replica's own stream
        mine = jax.random.fold_in(key, p.index())
        return [(jax.random.bits(mine, local, prng.UINT_DTYPES[bit_width]), Split(0))]
    if not jax.config.jax_threefry_partitionable or "threefry" not in str(jax.random.key_impl(key)):
        return None
    size = math.prod(local)
    offsets = np.arange(p.n, dtype=np.uint64) * np.uint64(size)  # each replica's first flat index
    hi_table = jnp.asarray((offsets >> np.uint64(32)).astype(np.uint32))
    lo_table = jnp.asarray((offsets & np.uint64(0xFFFFFFFF)).astype(np.uint32))
    hi, lo = prng.iota_2x32_shape(local)
    off_hi, off_lo = hi_table[p.index()], lo_table[p.index()]
    lo2 = lo + off_lo
    hi = hi + off_hi + (lo2 < lo).astype(jnp.uint32)  # carry
    k1, k2 = jax.random.key_data(key)
    bits1, bits2 = threefry2x32.threefry2x32_p.bind(k1, k2, hi, lo2)
    dtype = prng.UINT_DTYPES[bit_width]
    if bit_width == 64:
        bits = lax.shift_left(bits1.astype(dtype), jnp.asarray(32, dtype)) | bits2.astype(dtype)
    elif bit_width == 32:
        bits = bits1 ^ bits2
    else:
        bits = (bits1 ^ bits2).astype(dtype)
    return [(bits, Split(0))]


def _elementwise(p: Partitioner, eqn, ins):
    name = eqn.primitive.name
    shape = _global_shape(eqn.outvars[0])
    dims = {lay.dim for _, lay in ins if isinstance(lay, Split)}
    if len(dims) != 1:
        return None
    (dim,) = dims
    if name in _KEY_OPS and name != "random_fold_in" and dim >= len(eqn.invars[0].aval.shape):
        return None  # random-key ops extend their key's shape; only the key's dimensions split
    # (fold_in broadcasts a key against its data, position by position: it extends nothing.)
    if name == "bitcast_convert_type" and dim >= min(len(shape), len(eqn.invars[0].aval.shape)) - (
        len(shape) != len(eqn.invars[0].aval.shape)
    ):
        return None  # a change of width adds or drops the last dimension
    vals = []
    for (v, lay), var in zip(ins, eqn.invars, strict=True):
        vshape = tuple(getattr(var.aval, "shape", ()))
        if isinstance(lay, Split):
            vals.append(v)
        elif vshape == ():
            vals.append(v)
        elif len(vshape) > dim and vshape[dim] == 1:
            vals.append(v)  # a size-1 dimension broadcasts (jaxprs allow it in elementwise ops)
        elif len(vshape) > dim and vshape[dim] == shape[dim] and p.splittable(vshape, dim):
            vals.append(p.slice_rows(v, dim))
        else:
            return None
    return [(o, Split(dim)) for o in p.bind(eqn, vals)]


def _local_shape(p: Partitioner, shape, dim: int):
    shape = list(shape)
    shape[dim] //= p.n
    return tuple(shape)


def _broadcast_in_dim(p: Partitioner, eqn, ins):
    (v, lay), *dyn = ins
    if dyn or not isinstance(lay, Split):
        return None
    out_dim = eqn.params["broadcast_dimensions"][lay.dim]
    in_shape, shape = _global_shape(eqn.invars[0]), eqn.params["shape"]
    if in_shape[lay.dim] != shape[out_dim]:
        return None
    out = p.bind(eqn, [v], shape=_local_shape(p, shape, out_dim), sharding=None)
    return [(out[0], Split(out_dim))]


def _reshape_dim(in_shape, out_shape, dim: int, n: int):
    """The output dimension a split of input ``dim`` becomes under a row-major reshape, if the
    blocks stay contiguous: the dimensions before it keep their product, and ``dim`` is merged
    with later ones, split into a leading factor, or kept."""
    before = math.prod(in_shape[:dim])
    acc = 1
    for j, size in enumerate(out_shape):
        if acc == before:
            # out dim j starts where input dim `dim` starts
            if size == in_shape[dim]:
                return j
            if size > in_shape[dim] and size % in_shape[dim] == 0:  # merged with later dims
                rest = size // in_shape[dim]
                if math.prod(in_shape[dim + 1 :]) % rest == 0 and _prefix_product(in_shape[dim + 1 :], rest):
                    return j
                return None
            if size < in_shape[dim] and in_shape[dim] % size == 0 and size % n == 0:  # leading factor
                return j
            return None
        acc *= size
        if acc > before:
            return None
    return None


def _prefix_product(dims, target) -> bool:
    acc = 1
    for d in dims:
        if acc == target:
            return True
        acc *= d
    return acc == target


def _reshape(p: Partitioner, eqn, ins):
    (v, lay), *dyn = ins
    if dyn or not isinstance(lay, Split) or eqn.params.get("dimensions") is not None:
        return None
    in_shape, out_shape = _global_shape(eqn.invars[0]), tuple(eqn.params["new_sizes"])
    out_dim = _reshape_dim(in_shape, out_shape, lay.dim, p.n)
    if out_dim is None or not p.splittable(out_shape, out_dim):
        return None
    out = p.bind(eqn, [v], new_sizes=_local_shape(p, out_shape, out_dim), sharding=None)
    return [(out[0], Split(out_dim))]


def _transpose(p: Partitioner, eqn, ins):
    ((v, lay),) = ins
    perm = tuple(eqn.params["permutation"])
    return [(p.bind(eqn, [v])[0], Split(perm.index(lay.dim)))]


def _squeeze(p: Partitioner, eqn, ins):
    ((v, lay),) = ins
    dims = tuple(d % len(_global_shape(eqn.invars[0])) for d in eqn.params["dimensions"])
    if lay.dim in dims:
        return None
    return [(p.bind(eqn, [v])[0], Split(lay.dim - sum(d < lay.dim for d in dims)))]


def _reduce(p: Partitioner, eqn, ins):
    ((v, lay),) = ins
    axes = tuple(eqn.params["axes"])
    name = eqn.primitive.name
    local = p.bind(eqn, [v], **({"out_sharding": None} if "out_sharding" in eqn.params else {}))[0]
    if lay.dim not in axes:
        return [(local, Split(lay.dim - sum(a < lay.dim for a in axes)))]
    if name == "reduce_sum":
        if _narrow_float(v.dtype):  # accumulated in float32, rounded after the sum over the replicas
            local = p.bind(eqn, [v.astype(WIDE)], **({"out_sharding": None} if "out_sharding" in eqn.params else {}))[0]
        return [(local, PARTIAL)]
    collective = {"reduce_max": lax.pmax, "reduce_min": lax.pmin}.get(name)
    if collective is None:
        return None
    if p.one:
        return [(local, REPLICATED)]
    p.record("all-reduce", p.axes, local, f"{name} over the rows")
    return [(collective(local, p.axes), REPLICATED)]


def _reduce_or_and(p: Partitioner, eqn, ins):
    ((v, lay),) = ins
    axes = tuple(eqn.params["axes"])
    local = p.bind(eqn, [v])[0]
    if lay.dim not in axes:
        return [(local, Split(lay.dim - sum(a < lay.dim for a in axes)))]
    if p.one:
        return [(local, REPLICATED)]
    as_int = local.astype(jnp.int32)
    combined = lax.pmax(as_int, p.axes) if eqn.primitive.name == "reduce_or" else lax.pmin(as_int, p.axes)
    p.record("all-reduce", p.axes, combined, f"{eqn.primitive.name} over the rows")
    return [(combined.astype(local.dtype), REPLICATED)]


def _along_other_dim(param: str):
    """Ops along one dimension (``argmax``, ``cumsum``, ``sort``...): split elsewhere, they run
    on the local rows."""

    def rule(p: Partitioner, eqn, ins):
        dims = {lay.dim for _, lay in ins if isinstance(lay, Split)}
        if len(dims) != 1:
            return None
        (dim,) = dims
        value = eqn.params[param]
        along = tuple(value) if isinstance(value, (tuple, list)) else (value,)
        rank = len(_global_shape(eqn.invars[0]))
        if dim in tuple(a % rank for a in along):
            return None
        vals = [v if isinstance(lay, Split) else p.slice_rows(v, dim) for v, lay in ins]
        out_dim = dim
        if eqn.primitive.name in ("argmax", "argmin"):
            out_dim = dim - sum(a < dim for a in along)
        return [(o, Split(out_dim)) for o in p.bind(eqn, vals)]

    return rule


def _dot_general(p: Partitioner, eqn, ins):
    (lhs, ll), (rhs, rl) = ins
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lc, rc, lb, rb = map(tuple, (lc, rc, lb, rb))
    lshape, rshape = _global_shape(eqn.invars[0]), _global_shape(eqn.invars[1])
    lfree = [d for d in range(len(lshape)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(rshape)) if d not in rc and d not in rb]
    nb = len(lb)
    changes = {"out_sharding": None} if "out_sharding" in eqn.params else {}

    def done(l_val, r_val, layout):
        if layout is PARTIAL and _narrow_float(eqn.outvars[0].aval.dtype):  # accumulated in float32
            return [(o, layout) for o in p.wide_bind(eqn, [l_val, r_val], **changes)]
        return [(o, layout) for o in p.bind(eqn, [l_val, r_val], **changes)]

    if isinstance(ll, Split) and isinstance(rl, Split):
        d, e = ll.dim, rl.dim
        if d in lc and e == rc[lc.index(d)]:
            return done(lhs, rhs, PARTIAL)
        if d in lb and e == rb[lb.index(d)]:
            return done(lhs, rhs, Split(lb.index(d)))
        return None
    if isinstance(ll, Split):
        d = ll.dim
        if d in lc:
            e = rc[lc.index(d)]
            return done(lhs, p.slice_rows(rhs, e), PARTIAL) if p.splittable(rshape, e) else None
        if d in lb:
            e = rb[lb.index(d)]
            return done(lhs, p.slice_rows(rhs, e), Split(lb.index(d))) if p.splittable(rshape, e) else None
        return done(lhs, rhs, Split(nb + lfree.index(d)))
    e = rl.dim
    if e in rc:
        d = lc[rc.index(e)]
        return done(p.slice_rows(lhs, d), rhs, PARTIAL) if p.splittable(lshape, d) else None
    if e in rb:
        d = lb[rb.index(e)]
        return done(p.slice_rows(lhs, d), rhs, Split(rb.index(e))) if p.splittable(lshape, d) else None
    return done(lhs, rhs, Split(nb + len(lfree) + rfree.index(e)))


def _conv(p: Partitioner, eqn, ins):
    (lhs, ll), (rhs, rl) = ins
    prm = eqn.params
    dn = prm["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    if prm["batch_group_count"] != 1:
        return None  # a grouped convolution's kernel gradient: groups of the batch
    if isinstance(ll, Split) and rl is REPLICATED and ll.dim == lhs_spec[0]:
        return [(o, Split(out_spec[0])) for o in p.bind(eqn, [lhs, rhs])]  # the batch: row by row
    if prm["feature_group_count"] != 1:
        return None
    if isinstance(ll, Split) and isinstance(rl, Split) and ll.dim == lhs_spec[1] and rl.dim == rhs_spec[1]:
        # contracts the split batch (a kernel's gradient), accumulated in float32 for a narrow type
        if _narrow_float(eqn.outvars[0].aval.dtype):
            return [(o, PARTIAL) for o in p.wide_bind(eqn, [lhs, rhs])]
        return [(o, PARTIAL) for o in p.bind(eqn, [lhs, rhs])]
    return None


def _gather(p: Partitioner, eqn, ins):
    (op, ol), (idx, il) = ins
    dn = eqn.params["dimension_numbers"]
    oshape, ishape = _global_shape(eqn.invars[0]), _global_shape(eqn.invars[1])
    out_rank = len(_global_shape(eqn.outvars[0]))
    offset_dims = tuple(dn.offset_dims)
    batch_out = [d for d in range(out_rank) if d not in offset_dims]  # one per index dim but the last
    obatch, ibatch = tuple(dn.operand_batching_dims), tuple(dn.start_indices_batching_dims)
    window = [d for d in range(len(oshape)) if d not in dn.collapsed_slice_dims and d not in obatch]
    slice_sizes = list(eqn.params["slice_sizes"])
    # Batching dimensions (take_along_axis): operand rows pair with index rows.
    for d, i in zip(obatch, ibatch, strict=True):
        if ol in (Split(d), REPLICATED) and il in (Split(i), REPLICATED) and (ol == Split(d) or il == Split(i)):
            if not (p.splittable(oshape, d) and p.splittable(ishape, i)):
                return None
            vals = [p.convert(op, ol, Split(d)), p.convert(idx, il, Split(i))]
            return [(o, Split(batch_out[i])) for o in p.bind(eqn, vals)]
    if ol is REPLICATED and isinstance(il, Split) and il.dim < len(ishape) - 1 and il.dim not in ibatch:
        return [(o, Split(batch_out[il.dim])) for o in p.bind(eqn, [op, idx])]
    if isinstance(ol, Split) and il is REPLICATED:
        d = ol.dim
        if d in window and d not in dn.start_index_map and slice_sizes[d] == oshape[d]:
            slice_sizes[d] //= p.n
            out = p.bind(eqn, [op, idx], slice_sizes=tuple(slice_sizes))
            return [(out[0], Split(offset_dims[window.index(d)]))]
    return None


def _scatter(p: Partitioner, eqn, ins):
    (op, ol), (idx, il), (upd, ul) = ins
    dn = eqn.params["dimension_numbers"]
    oshape, ishape, ushape = (_global_shape(v) for v in eqn.invars)
    obatch, ibatch = tuple(dn.operand_batching_dims), tuple(dn.scatter_indices_batching_dims)
    window = [d for d in range(len(oshape)) if d not in dn.inserted_window_dims and d not in obatch]
    upd_scatter = [d for d in range(len(ushape)) if d not in dn.update_window_dims]  # one per index dim but the last
    if ol is PARTIAL:
        return None
    # A window dimension that no index addresses: rows go to the same rows.
    for d in window:
        ud = dn.update_window_dims[window.index(d)]
        if d in dn.scatter_dims_to_operand_dims or ushape[ud] != oshape[d] or il is not REPLICATED:
            continue
        if ol in (Split(d), REPLICATED) and ul in (Split(ud), REPLICATED) and (ol == Split(d) or ul == Split(ud)):
            if not p.splittable(oshape, d):
                return None
            vals = [p.convert(op, ol, Split(d)), idx, p.convert(upd, ul, Split(ud))]
            return [(o, Split(d)) for o in p.bind(eqn, vals)]
    # Batching dimensions: operand rows, index rows and update rows pair up.
    for d, i in zip(obatch, ibatch, strict=True):
        if i >= len(ishape) - 1:
            continue
        ud = upd_scatter[i]
        lays = (ol, il, ul)
        if all(lay in (want, REPLICATED) for lay, want in zip(lays, (Split(d), Split(i), Split(ud)))) and any(
            isinstance(lay, Split) for lay in lays
        ):
            if not (p.splittable(oshape, d) and p.splittable(ishape, i) and p.splittable(ushape, ud)):
                return None
            vals = [p.convert(op, ol, Split(d)), p.convert(idx, il, Split(i)), p.convert(upd, ul, Split(ud))]
            return [(o, Split(d)) for o in p.bind(eqn, vals)]
    if eqn.primitive.name not in ("scatter-add", "scatter_add"):
        return None
    # Rows of updates scattered into a whole operand (an embedding's gradient): each replica adds
    # its rows; the operand is counted once (on replica 0), so the result is a partial sum.
    if isinstance(il, Split) and il.dim < len(ishape) - 1 and il.dim not in ibatch:
        i = il.dim
    elif isinstance(ul, Split) and ul.dim in upd_scatter:
        i = upd_scatter.index(ul.dim)
    else:
        return None
    ud = upd_scatter[i]
    if ol is not REPLICATED or il not in (Split(i), REPLICATED) or ul not in (Split(ud), REPLICATED):
        return None
    if not (p.splittable(ishape, i) and p.splittable(ushape, ud)):
        return None
    zero = not isinstance(eqn.invars[0], core.Literal) and eqn.invars[0] in p._zeros
    operand = op if zero else p.convert(op, REPLICATED, PARTIAL)
    vals = [operand, p.convert(idx, il, Split(i)), p.convert(upd, ul, Split(ud))]
    if _narrow_float(vals[0].dtype):  # added up in float32, rounded after the sum over the replicas
        return [(o, PARTIAL) for o in p.wide_bind(eqn, vals)]
    return [(o, PARTIAL) for o in p.bind(eqn, vals)]


def _slice(p: Partitioner, eqn, ins):
    ((v, lay),) = ins
    shape = _global_shape(eqn.invars[0])
    d = lay.dim
    start, limit = list(eqn.params["start_indices"]), list(eqn.params["limit_indices"])
    strides = eqn.params["strides"]
    if start[d] != 0 or limit[d] != shape[d] or (strides and strides[d] != 1):
        return None
    limit[d] //= p.n
    return [(p.bind(eqn, [v], limit_indices=tuple(limit))[0], lay)]


def _dynamic_slice(p: Partitioner, eqn, ins):
    (v, lay), *idx = ins
    if any(il is not REPLICATED for _, il in idx) or not isinstance(lay, Split):
        return None
    sizes = list(eqn.params["slice_sizes"])
    if sizes[lay.dim] != _global_shape(eqn.invars[0])[lay.dim]:
        return None
    sizes[lay.dim] //= p.n
    return [(p.bind(eqn, [v, *[i for i, _ in idx]], slice_sizes=tuple(sizes))[0], lay)]


def _dynamic_update_slice(p: Partitioner, eqn, ins):
    (op, ol), (upd, ul), *idx = ins
    if any(il is not REPLICATED for _, il in idx):
        return None
    dim = ol.dim if isinstance(ol, Split) else ul.dim if isinstance(ul, Split) else None
    if dim is None:
        return None
    oshape, ushape = _global_shape(eqn.invars[0]), _global_shape(eqn.invars[1])
    if ushape[dim] != oshape[dim] or not p.splittable(oshape, dim):
        return None
    op, upd = p.convert(op, ol, Split(dim)), p.convert(upd, ul, Split(dim))
    return [(p.bind(eqn, [op, upd, *[i for i, _ in idx]])[0], Split(dim))]


def _pad(p: Partitioner, eqn, ins):
    (v, lay), (pv, pl) = ins
    if not isinstance(lay, Split) or pl is not REPLICATED:
        return None
    config = eqn.params["padding_config"]
    if tuple(config[lay.dim]) != (0, 0, 0):
        return None
    return [(p.bind(eqn, [v, pv])[0], lay)]


def _split_operands(p: Partitioner, eqn, ins, along: int):
    """The one split dimension of ``ins`` (not ``along``) and every operand split on it, or
    ``None``: for ops that join operands along another dimension."""
    dims = {lay.dim for _, lay in ins if isinstance(lay, Split)}
    if len(dims) != 1 or along in dims:
        return None
    (dim,) = dims
    vals = []
    for (v, lay), var in zip(ins, eqn.invars, strict=True):
        if not (isinstance(lay, Split) or p.splittable(_global_shape(var), dim)):
            return None
        vals.append(p.convert(v, lay, Split(dim)))
    return dim, vals


def _concatenate(p: Partitioner, eqn, ins):
    found = _split_operands(p, eqn, ins, eqn.params["dimension"])
    if found is None:
        return None
    dim, vals = found
    return [(p.bind(eqn, vals)[0], Split(dim))]


def _stack(p: Partitioner, eqn, ins):
    found = _split_operands(p, eqn, ins, -1)  # the new axis is not an operand's
    if found is None:
        return None
    dim, vals = found
    return [(p.bind(eqn, vals)[0], Split(dim + 1 if eqn.params["axis"] <= dim else dim))]


def _rev(p: Partitioner, eqn, ins):
    ((v, lay),) = ins
    if lay.dim in eqn.params["dimensions"]:
        return None
    return [(p.bind(eqn, [v])[0], lay)]


def _split_op(p: Partitioner, eqn, ins):
    ((v, lay),) = ins
    if lay.dim == eqn.params["axis"]:
        return None
    return [(o, lay) for o in p.bind(eqn, [v])]


def _windowed(p: Partitioner, eqn, ins):
    """Pooling (``reduce_window_*``, and ``select_and_scatter_add``/``select_and_gather_add`` of
    its derivative): a window of size 1, stride 1, no padding along the split dimension runs on
    the local rows."""
    dims = {lay.dim for _, lay in ins if isinstance(lay, Split)}
    if len(dims) != 1:
        return None
    (dim,) = dims
    prm = eqn.params
    if prm["window_dimensions"][dim] != 1 or prm["window_strides"][dim] != 1 or tuple(prm["padding"][dim]) != (0, 0):
        return None
    for key in ("base_dilation", "window_dilation"):
        if key in prm and prm[key][dim] != 1:
            return None
    vals = []
    for (v, lay), var in zip(ins, eqn.invars, strict=True):
        shape = _global_shape(var)
        if shape == ():
            vals.append(v)  # an init value
        elif isinstance(lay, Split) or p.splittable(shape, dim):
            vals.append(p.convert(v, lay, Split(dim)))
        else:
            return None
    return [(o, Split(dim)) for o in p.bind(eqn, vals)]


def _optimization_barrier(p: Partitioner, eqn, ins):
    outs = p.bind(eqn, [v for v, _ in ins])
    return list(zip(outs, [lay for _, lay in ins], strict=True))


_RULES = {
    "broadcast_in_dim": _broadcast_in_dim,
    "reshape": _reshape,
    "transpose": _transpose,
    "squeeze": _squeeze,
    "reduce_sum": _reduce,
    "reduce_max": _reduce,
    "reduce_min": _reduce,
    "reduce_prod": _reduce,
    "reduce_or": _reduce_or_and,
    "reduce_and": _reduce_or_and,
    "argmax": _along_other_dim("axes"),
    "argmin": _along_other_dim("axes"),
    "cumsum": _along_other_dim("axis"),
    "cumprod": _along_other_dim("axis"),
    "cummax": _along_other_dim("axis"),
    "cummin": _along_other_dim("axis"),
    "cumlogsumexp": _along_other_dim("axis"),
    "sort": _along_other_dim("dimension"),
    "top_k": _along_other_dim("axis"),
    "dot_general": _dot_general,
    "conv_general_dilated": _conv,
    "gather": _gather,
    "scatter-add": _scatter,
    "scatter_add": _scatter,
    "scatter": _scatter,
    "slice": _slice,
    "dynamic_slice": _dynamic_slice,
    "dynamic_update_slice": _dynamic_update_slice,
    "pad": _pad,
    "concatenate": _concatenate,
    "rev": _rev,
    "stack": _stack,
    "split": _split_op,
    "optimization_barrier": _optimization_barrier,
    "reduce_window_max": _windowed,
    "reduce_window_min": _windowed,
    "reduce_window_sum": _windowed,
    "reduce_window": _windowed,
    "select_and_scatter_add": _windowed,
    "select_and_gather_add": _windowed,
}


# -- calls and control flow ------------------------------------------------------------------------


def _inline(param: str):
    def rule(p: Partitioner, eqn, ins):
        closed = eqn.params[param]
        jaxpr, consts = (closed.jaxpr, closed.consts) if isinstance(closed, core.ClosedJaxpr) else (closed, ())
        extra = len(ins) - len(jaxpr.invars)
        # Inlined even when every input is whole: the replay then sees one flat program and can
        # run a nested helper's update work (optax's jitted norms) on shards too.
        return p.run(jaxpr, consts, ins[extra:])

    return rule


def _remat(p: Partitioner, eqn, ins):
    if all(lay is REPLICATED for _, lay in ins):
        return [(o, REPLICATED) for o in p.bind(eqn, [v for v, _ in ins])]
    # Rebuilt with the same params, not inlined: the recomputation keeps its optimization
    # barrier (and so its memory saving).
    layouts = [lay for _, lay in ins]
    found: list = []

    @_scoped(p)
    def body(*vals):
        outs = p.run(eqn.params["jaxpr"], (), list(zip(vals, layouts, strict=True)))
        found.append([lay for _, lay in outs])
        return [v for v, _ in outs]

    vals = [v for v, _ in ins]
    closed = jax.make_jaxpr(body)(*vals)
    jaxpr = pe.convert_constvars_jaxpr(closed.jaxpr)
    outs = eqn.primitive.bind(*closed.consts, *vals, **dict(eqn.params, jaxpr=jaxpr))
    return list(zip(outs, found[-1], strict=True))


def _scoped(p: Partitioner):
    def wrap(fn):
        def inner(*args):
            with p.scope():
                return fn(*args)

        return inner

    return wrap


def _fit(p: Partitioner, vals_layouts, targets, pinned: frozenset, guessed: frozenset = frozenset()):
    """Converts each value to its target layout, or raises ``_Retry`` with better targets: a split
    or partial value meeting a replicated target takes that slot over (unless the slot was already
    given up, ``pinned``), and two different non-replicated layouts give the slot up. A ``guessed``
    slot (a zero-initialised carry tried as a partial sum) takes whatever layout the body gives."""
    new_targets, retry = list(targets), False
    for i, ((_, lay), t) in enumerate(zip(vals_layouts, targets, strict=True)):
        if i in guessed and lay != t:
            new_targets[i], retry = lay, True
            continue
        if lay == t or lay is REPLICATED:
            continue
        if t is REPLICATED and i not in pinned:
            new_targets[i], retry = lay, True
        elif t is not REPLICATED:
            new_targets[i], retry = REPLICATED, True
    if retry:
        raise _Retry(new_targets)
    return [p.hold(p.convert(v, lay, t), t) for (v, lay), t in zip(vals_layouts, targets, strict=True)]


def _fixed_point(p: Partitioner, attempt, initial, limit: int = 16, guessed=()):
    """Runs ``attempt(targets, pinned, guessed)`` until the layouts it assumes are the layouts it
    gets. ``guessed`` slots start as partial sums and keep that only if the body keeps it."""
    targets, pinned, guessed = list(initial), set(), set(guessed)
    for i in guessed:
        targets[i] = PARTIAL
    mark, cmark = len(p.whole_ops), len(p.collectives)
    for _ in range(limit):
        try:
            return attempt(targets, frozenset(pinned), frozenset(guessed))
        except _Retry as r:
            del p.whole_ops[mark:], p.collectives[cmark:]  # that trace is dropped
            changed = {i for i, (a, b) in enumerate(zip(targets, r.layouts)) if a != b}
            pinned |= {i for i in changed - guessed if targets[i] is not REPLICATED and r.layouts[i] is REPLICATED}
            guessed -= changed
            targets = r.layouts
    return attempt([REPLICATED] * len(targets), frozenset(range(len(targets))), frozenset())


def _zero_carries(p: Partitioner, eqn, first: int, count: int) -> list[int]:
    """Carry slots initialised with a broadcast zero: a weight's gradient accumulated over the
    iterations of a backward loop. Tried as partial sums first, so that the sum is taken once,
    after the loop (and reduce-scattered there by the sharded update), not at every iteration."""
    carries = eqn.invars[first : first + count]
    return [
        i
        for i, v in enumerate(carries)
        if isinstance(v, core.Var) and v in p._zeros and jnp.issubdtype(v.aval.dtype, jnp.inexact)
    ]


def _scan(p: Partitioner, eqn, ins):
    prm = eqn.params
    body, nc, ncarry = prm["jaxpr"], prm["num_consts"], prm["num_carry"]
    consts, init, xs = ins[:nc], ins[nc : nc + ncarry], ins[nc + ncarry :]
    # The scanned dimension is 0 and runs in order: a split along it cannot be scanned locally.
    xs = [(p.whole(v, lay), REPLICATED) if isinstance(lay, Split) and lay.dim == 0 else (v, lay) for v, lay in xs]
    x_layouts = [Split(lay.dim - 1) if isinstance(lay, Split) else lay for _, lay in xs]
    ys_layouts: list = []

    def attempt(carry_layouts, pinned, guessed):
        carry0 = _vary_all(
            p, [p.hold(p.convert(v, lay, t), t) for (v, lay), t in zip(init, carry_layouts, strict=True)], carry_layouts
        )

        @_scoped(p)
        def step(carry, x):
            outs = p.run(body.jaxpr, body.consts, [*consts, *zip(carry, carry_layouts), *zip(x, x_layouts)])
            new = _vary_all(p, _fit(p, outs[:ncarry], carry_layouts, pinned, guessed), carry_layouts)
            ys = outs[ncarry:]
            # Rows stack as they are: stacked partial sums are the partial sum of the stack (a
            # layer's weight gradient out of the backward scan over layers is summed once, after
            # the loop, where the sharded update can reduce-scatter it); a partial ``xs`` is sliced
            # into partial rows the same way.
            ys_layouts[:] = [lay for _, lay in ys]
            return new, [v for v, _ in ys]

        carry, ys = lax.scan(
            step,
            carry0,
            [v for v, _ in xs],
            length=prm["length"],
            reverse=prm["reverse"],
            unroll=prm["unroll"],
            _split_transpose=prm.get("_split_transpose", False),
        )
        ys_out = [Split(lay.dim + 1) if isinstance(lay, Split) else lay for lay in ys_layouts]
        return [*zip(carry, carry_layouts), *zip(ys, ys_out)]

    return _fixed_point(p, attempt, [lay for _, lay in init], guessed=_zero_carries(p, eqn, nc, ncarry))


def _while(p: Partitioner, eqn, ins):
    prm = eqn.params
    cj, bj, cn, bn = prm["cond_jaxpr"], prm["body_jaxpr"], prm["cond_nconsts"], prm["body_nconsts"]
    cconsts, bconsts, init = ins[:cn], ins[cn : cn + bn], ins[cn + bn :]

    def attempt(carry_layouts, pinned, guessed):
        carry0 = [p.hold(p.convert(v, lay, t), t) for (v, lay), t in zip(init, carry_layouts, strict=True)]

        @_scoped(p)
        def cond(c):
            ((pred, lay),) = p.run(cj.jaxpr, cj.consts, [*cconsts, *zip(c, carry_layouts)])
            return p._whole(pred, lay)

        @_scoped(p)
        def body(c):
            outs = p.run(bj.jaxpr, bj.consts, [*bconsts, *zip(c, carry_layouts)])
            return _vary_all(p, _fit(p, outs, carry_layouts, pinned, guessed), carry_layouts)

        out = lax.while_loop(cond, body, _vary_all(p, carry0, carry_layouts))
        return list(zip(out, carry_layouts, strict=True))

    return _fixed_point(p, attempt, [lay for _, lay in init], guessed=_zero_carries(p, eqn, cn + bn, len(init)))


def _vary_all(p: Partitioner, vals, layouts):
    """Split and partial carries differ per replica: type them so from the start."""
    return [p.vary(v) if lay is not REPLICATED else v for v, lay in zip(vals, layouts, strict=True)]


def _cond(p: Partitioner, eqn, ins):
    (index, il), *ops = ins
    index = p.whole(index, il)
    branches = eqn.params["branches"]

    def attempt(out_layouts, pinned, guessed):
        def make(br):
            @_scoped(p)
            def fn(*vals):
                outs = p.run(br.jaxpr, br.consts, list(zip(vals, [lay for _, lay in ops], strict=True)))
                return _vary_all(p, _fit(p, outs, out_layouts, pinned), out_layouts)

            return fn

        outs = lax.switch(index, [make(br) for br in branches], *[v for v, _ in ops])
        return list(zip(outs, out_layouts, strict=True))

    return _fixed_point(p, attempt, [REPLICATED] * len(eqn.outvars))


def _debug_callback(p: Partitioner, eqn, ins):
    """``jax.debug.print`` and ``jax.debug.callback``: fired once per step, on the whole values,
    as one device fires them (replica 0 fires; the others skip it)."""
    if any(type(e).__name__.startswith("Ordered") for e in eqn.effects):
        raise NotImplementedError(
            f"{eqn.primitive.name}{_source(eqn)} with ordered=True: JAX runs ordered effects on one device only, "
            "and podscale runs the step on every replica. Drop ordered=True: podscale fires the callback once per "
            "step, on the whole values."
        )
    vals = [p.whole(v, lay) for v, lay in ins]

    def fire(*vals):
        p.bind(eqn, list(vals))
        return ()

    lax.cond(p.index() == 0, fire, lambda *_: (), *vals)
    return []


def _io_callback(p: Partitioner, eqn, ins):
    raise NotImplementedError(
        f"io_callback{_source(eqn)} in the step: podscale runs the step on every replica, so it would fire once per "
        "replica, where one device fires it once per step. Call it outside the step (on the metrics the step "
        "returns), or use jax.debug.callback, which podscale fires once per step on the whole values."
    )


_CONTROL = {
    "debug_callback": _debug_callback,
    "debug_print": _debug_callback,
    "io_callback": _io_callback,
    "jit": _inline("jaxpr"),
    "pjit": _inline("jaxpr"),
    "closed_call": _inline("call_jaxpr"),
    "core_call": _inline("call_jaxpr"),
    "custom_jvp_call": _inline("call_jaxpr"),
    "custom_vjp_call": _inline("call_jaxpr"),
    "remat2": _remat,
    "checkpoint": _remat,
    "scan": _scan,
    "while": _while,
    "cond": _cond,
}
