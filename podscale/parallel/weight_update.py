"""Cross-replica weight-update sharding of an unmodified traced step (Xu et al., arXiv 2004.13336).

The replicated data-parallel step sums each gradient over the replicas (``psum_invariant``), then
every replica runs the same optimizer update on the full weights. Here the traced step is replayed
with values in one of two layouts:

* *full*: an ordinary value, the same on every replica (weights, scalars, small tensors);
* :class:`Sharded`: this replica's 1/N chunk of a tensor flattened in row-major order and padded
  with zeros to N chunks of :func:`chunk_layout`'s length. Every tensor of a given size uses the
  same chunking (a stored optimizer-state chunk, a reduce-scattered gradient, a sliced weight,
  alone or in a fused buffer), so two sharded operands of one shape line up element for element.

The gradient sums become one fused reduce-scatter (gradients of at least ``min_shard_size``
elements) and one fused all-reduce (the rest). Ops downstream then run on shards where that is
exact: elementwise ops (a full operand of the same shape is sliced, a scalar broadcasts), reshapes,
and reductions over a whole tensor (a local partial reduction, padding masked, plus a small
all-reduce: the per-layer norms of LARS and LAMB, global-norm clipping). Any other op that meets a
shard gets its operands all-gathered first and is recorded in the plan as computed on gathered
values, so nothing is silently wrong. Optimizer-state leaves (large float leaves the forward pass
never reads) stay sharded between steps; updated weights are all-gathered in one fused collective.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core

from podscale.parallel import _interpret
from podscale.parallel._interpret import GRAD_SUM, is_grad_sum
from podscale.parallel.gradsum import GradSum, PhaseRecord
from podscale.perf.hlo import GRAD_SUM_SCOPE, UPDATE_SCOPE

DEFAULT_MIN_SHARD_SIZE = 2048
"""Tensors with fewer elements stay replicated: at 8 KiB in float32, the latency of a collective
on its own costs more than updating it redundantly saves (it is fused with the others anyway)."""

DEFAULT_BUCKET_BYTES = 16 * 2**20
"""Gradients are summed in fused buffers of about this size (Horovod's tensor fusion): a buffer
is sent as soon as the backward pass has filled it, so its local gradients can be freed and its
collective can overlap the rest of the backward pass. Results do not depend on it."""


def chunk_layout(size: int, chunks: int, split: int = 1) -> tuple[int, int]:
    """(chunk length, padding) of a tensor of ``size`` elements cut into ``chunks`` chunks, one
    per data replica, each chunk split further over ``split`` devices (a spatial strategy's space
    axis or tensor partitioning's model axis; XLA partitions a replica's chunk over them): the
    length is ``ceil(size / chunks)`` rounded up to a multiple of ``split``, the padding what
    ``chunks`` such chunks hold beyond ``size``. The one rule for every chunk of a tensor: the
    stored state (:func:`podscale.parallel.state_layout.decide`), the gradient sums and slices
    (:class:`Layout`), whatever ``size``, ``chunks`` and ``split``."""
    if size < 0 or chunks < 1 or split < 1:
        raise ValueError(f"chunk_layout({size}, {chunks}, {split}): a size of at least 0, chunks and split at least 1")
    length = -(-size // chunks)
    length = -(-length // split) * split
    return length, length * chunks - size


def _buckets(items: list, nbytes, limit: int) -> list[list]:
    out, current, size = [], [], 0
    for item in items:
        if current and size + nbytes(item) > limit:
            out.append(current)
            current, size = [], 0
        current.append(item)
        size += nbytes(item)
    return out + ([current] if current else [])


ELEMENTWISE = frozenset(
    """abs acos acosh add add_any and asin asinh atan atan2 atanh cbrt ceil clamp convert_element_type
    copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt igamma imag
    integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not or pow real
    reduce_precision rem round rsqrt select_n sign sin sinh sqrt square sub tan tanh xor""".split()
)
REDUCTIONS = {"reduce_sum": ("sum", 0), "reduce_max": ("max", -np.inf), "reduce_min": ("min", np.inf)}


@dataclasses.dataclass(frozen=True)
class Sharded:
    """This replica's chunk of a tensor of shape ``shape``: flat, padded, 1/N of the elements."""

    shard: Any
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass
class Collective:
    kind: str  # reduce-scatter | all-reduce | all-gather
    axes: tuple[str, ...]
    bytes_per_device: int
    tensors: int
    why: str
    chunks: int = 1
    """Pipelined chunks the buffer is sent in (2-D gradient summation)."""
    update: bool = False
    """Part of the data-parallel update (gradient sums, the sharded update's norms, the gather
    of updated weights), as opposed to what the model itself needs (batch statistics, values
    made whole for an op)."""


def _record(trace: Trace, phases: list[PhaseRecord], tensors: int, why: str, update: bool) -> None:
    for ph in phases:
        trace.collectives.append(Collective(ph.kind, ph.axes, ph.bytes_per_device, tensors, why, ph.chunks, update))


@dataclasses.dataclass
class Trace:
    """What one rewrite did: collectives, ops computed on gathered values. Filled while tracing."""

    collectives: list[Collective] = dataclasses.field(default_factory=list)
    gathered_ops: list[str] = dataclasses.field(default_factory=list)
    whole_ops: list[str] = dataclasses.field(default_factory=list)
    """Ops of the global program computed on whole values (see ``partition.Partitioner``)."""


class Layout:
    """The chunking of tensors over the replicas, and how gradients are summed (``grad_sum``).

    Chunks are ordered by ``lax.axis_index(grad_sum.order)``, the order of the 2-D sum's phases.
    """

    def __init__(
        self,
        grad_sum: GradSum,
        min_shard_size: int,
        scatter: bool = True,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        split_shapes: frozenset = frozenset(),
        split: int = 1,
    ):
        self.grad_sum, self.axes, self.n = grad_sum, grad_sum.order, grad_sum.n
        self.min_shard_size, self.scatter, self.bucket_bytes = min_shard_size, scatter, bucket_bytes
        self.split = split
        """Devices each replica's chunk is split over (the space or model axis): chunk lengths are
        multiples of it, as the stored state's are (:func:`chunk_layout`)."""
        self.split_shapes = split_shapes
        """Shapes of the weights split over a model axis (tensor partitioning): an all-reduced
        gradient of such a shape is summed alone and unflattened, so that XLA keeps its split
        (flattened into a fused buffer, it would first be gathered over the model axis)."""

    def alone(self, nbytes: int) -> bool:
        """Whether a tensor is large enough to get a collective of its own (a quarter bucket)."""
        return nbytes >= self.bucket_bytes // 4

    def shard_len(self, size: int) -> int:
        return chunk_layout(size, self.n, self.split)[0]

    def padding(self, size: int) -> int:
        return chunk_layout(size, self.n, self.split)[1]

    def index(self):
        """This replica's chunk (0 with one replica, where no collective over the data axes runs)."""
        return jnp.zeros((), jnp.int32) if self.n == 1 else lax.axis_index(self.axes)

    def shards(self, shape, dtype) -> bool:
        return math.prod(shape) >= self.min_shard_size and jnp.issubdtype(dtype, jnp.inexact)

    def _padded_rows(self, x) -> jax.Array:
        flat = jnp.ravel(x)
        pad = self.padding(flat.size)
        return (jnp.pad(flat, (0, pad)) if pad else flat).reshape(self.n, -1)

    def slice(self, x) -> Sharded:
        """A full value's chunk on this replica (no communication)."""
        rows = self._padded_rows(x)
        index = self.index()
        return Sharded(lax.dynamic_index_in_dim(rows, index, 0, keepdims=False), tuple(np.shape(x)))

    def valid(self, s: Sharded) -> jax.Array:
        """Mask of the shard's real (not padding) elements."""
        length = s.shard.shape[0]
        start = self.index() * length
        return start + lax.iota(jnp.int32, length) < s.size


def _fuse_reduce_scatter(layout: Layout, values: list, trace: Trace) -> list:
    """Large tensors go alone (their padded rows are a free reshape, no copy into a buffer);
    the others are concatenated into one buffer."""
    alone = [i for i, v in enumerate(values) if layout.alone(v.size * v.dtype.itemsize)]
    fused = [i for i in range(len(values)) if i not in alone]
    out: list = [None] * len(values)
    for group in [[i] for i in alone] + ([fused] if fused else []):
        for i, r in zip(group, _reduce_scatter(layout, [values[i] for i in group], trace), strict=True):
            out[i] = r
    return out


def _reduce_scatter(layout: Layout, values: list, trace: Trace) -> list:
    rows = [layout._padded_rows(v) for v in values]
    buffer = jnp.concatenate(rows, axis=1) if len(rows) > 1 else rows[0]
    phases: list[PhaseRecord] = []
    if not layout.scatter:
        # The replicated update all-reduces the very same buffer, so that every element is summed
        # as in the sharded update (XLA:CPU's summation order depends on the buffer's layout).
        total = layout.grad_sum.all_reduce(buffer, phases)
        _record(trace, phases, len(values), "gradient sum", update=True)
        out, offset = [], 0
        for v, r in zip(values, rows, strict=True):
            out.append(total[:, offset : offset + r.shape[1]].reshape(-1)[: v.size].reshape(v.shape))
            offset += r.shape[1]
        return out
    local = layout.grad_sum.reduce_scatter(buffer, phases)
    _record(trace, phases, len(values), "gradient sum", update=True)
    out, offset = [], 0
    for v, r in zip(values, rows, strict=True):
        out.append(Sharded(local[offset : offset + r.shape[1]], tuple(v.shape)))
        offset += r.shape[1]
    return out


def _fuse_all_reduce(layout: Layout, values: list, trace: Trace, why: str, update: bool) -> list:
    if len(values) == 1 and layout.grad_sum.mode == "1d":  # as it is: no flattening
        phases: list[PhaseRecord] = []
        total = layout.grad_sum.all_reduce(values[0], phases)
        _record(trace, phases, 1, why, update)
        return [total]
    flat = [jnp.ravel(v) for v in values]
    buffer = jnp.concatenate(flat) if len(flat) > 1 else flat[0]
    phases: list[PhaseRecord] = []
    total = layout.grad_sum.all_reduce(buffer, phases)
    _record(trace, phases, len(values), why, update)
    out, offset = [], 0
    for v in values:
        out.append(total[offset : offset + v.size].reshape(v.shape))
        offset += v.size
    return out


def gather(layout: Layout, shards: list[Sharded], trace: Trace, why: str, update: bool = False) -> list:
    """All-gathers sharded values to full ones, fused per dtype (``update``: the updated weights)."""
    with jax.named_scope(UPDATE_SCOPE):
        return _gather(layout, shards, trace, why, update)


def _gather(layout: Layout, shards: list[Sharded], trace: Trace, why: str, update: bool) -> list:
    out: list = [None] * len(shards)
    by_dtype: dict[Any, list[int]] = {}
    for i, s in enumerate(shards):
        by_dtype.setdefault(s.shard.dtype, []).append(i)

    def full_bytes(i):
        return shards[i].size * shards[i].shard.dtype.itemsize

    buckets = [[i] for i in range(len(shards)) if layout.alone(full_bytes(i))]  # no copy out of a buffer
    for members in by_dtype.values():
        rest = [i for i in members if not layout.alone(full_bytes(i))]
        buckets += _buckets(rest, full_bytes, layout.bucket_bytes)
    for members in buckets:
        parts = [shards[i].shard for i in members]
        buffer = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
        phases: list[PhaseRecord] = []
        full = layout.grad_sum.all_gather(buffer, phases)  # [n, local]
        _record(trace, phases, len(members), why, update)
        offset = 0
        for i in members:
            s = shards[i]
            length = s.shard.shape[0]
            out[i] = full[:, offset : offset + length].reshape(-1)[: s.size].reshape(s.shape)
            offset += length
    return out


class _Pending:
    """A cross-replica reduction whose collective is deferred, so that many can be fused.

    ``kind`` is ``"grad"`` (a gradient sum, divided by the replica count: reduce-scattered when
    ``shard``, else all-reduced) or ``"sum"``/``"max"``/``"min"`` (the partials of a reduction
    over a whole sharded tensor, such as a per-layer norm)."""

    def __init__(self, fuser: _Fuser, value, shard: bool, kind: str = "grad"):
        self.fuser, self.value, self.shard, self.kind, self.result = fuser, value, shard, kind, None
        self.scatter = True

    def get(self):
        if self.result is None:
            if self not in self.fuser.pending:  # superseded by a moved op, yet read after all
                self.fuser.pending.append(self)
            self.fuser.flush()
        return self.result


class _Fuser:
    def __init__(self, layout: Layout, trace: Trace):
        self.layout, self.trace, self.pending = layout, trace, []

    def add(self, value, kind: str = "grad", scatter: bool = True) -> _Pending:
        """``scatter=False``: the sum is read by per-replica computation (a batch-norm statistic
        over the whole batch), so it is all-reduced whatever its size."""
        shard = scatter and kind == "grad" and self.layout.shards(value.shape, value.dtype)
        if shard and not self.layout.scatter and tuple(value.shape) in self.layout.split_shapes:
            shard = False  # the replicated update sums a split weight's gradient as it is (see split_shapes)
        p = _Pending(self, value, shard, kind)
        p.scatter = scatter
        if kind == "grad":
            # A bucket that was already full goes now, while the backward pass continues. It waits
            # until the next gradient sum arrives, so that the shape-only ops following the last
            # one (a transpose, a reshape) have been moved before its collective.
            same = [q for q in self.pending if (q.kind, q.shard, q.value.dtype) == (kind, p.shard, p.value.dtype)]
            if sum(q.value.size * q.value.dtype.itemsize for q in same) >= self.layout.bucket_bytes:
                self.flush(same)
        self.pending.append(p)
        return p

    def move(self, old: _Pending, value) -> _Pending:
        """``old``'s sum is deferred past a shape-only op: sum ``value`` (the op applied to the
        local gradient) instead. Exact, since the op moves no value across elements."""
        if old in self.pending:
            self.pending.remove(old)
        return self.add(value, old.kind, scatter=old.scatter)

    def flush(self, only: list[_Pending] | None = None) -> None:
        if only is None:
            pending, self.pending = self.pending, []
        else:
            pending = only
            self.pending = [q for q in self.pending if q not in only]
        groups: dict[tuple, list[_Pending]] = {}
        for p in pending:
            alone = p.kind == "grad" and not p.shard and tuple(p.value.shape) in self.layout.split_shapes
            groups.setdefault((p.kind, p.shard, p.value.dtype, p.scatter, id(p) if alone else None), []).append(p)
        for (kind, shard, _, scatter, _), members in groups.items():
            values = [p.value for p in members]
            if kind == "grad" and shard:
                with jax.named_scope(UPDATE_SCOPE), jax.named_scope(GRAD_SUM_SCOPE):
                    results = _fuse_reduce_scatter(self.layout, values, self.trace)
            elif kind == "grad" and scatter:
                with jax.named_scope(UPDATE_SCOPE), jax.named_scope(GRAD_SUM_SCOPE):
                    results = _fuse_all_reduce(self.layout, values, self.trace, "gradient sum (small tensors)", True)
            elif kind == "grad":  # the forward pass reads it: the model's own collective, not the update's
                why = "a sum the forward pass reads (batch statistics)"
                results = _fuse_all_reduce(self.layout, values, self.trace, why, update=False)
            else:
                with jax.named_scope(UPDATE_SCOPE):
                    results = _fuse_partials(self.layout, values, kind, self.trace)
            for p, r in zip(members, results, strict=True):
                p.result = r


def _fuse_partials(layout: Layout, values: list, kind: str, trace: Trace) -> list:
    collective = {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin}[kind]
    if layout.n == 1:  # one replica: the partials are the whole reduction
        return list(values)
    flat = [jnp.ravel(v) for v in values]
    buffer = jnp.concatenate(flat) if len(flat) > 1 else flat[0]
    total = collective(buffer, layout.axes)
    trace.collectives.append(
        Collective(
            "all-reduce",
            layout.axes,
            buffer.size * buffer.dtype.itemsize,
            len(values),
            f"reduce_{kind} of whole sharded tensors (norms)",
            update=True,
        )
    )
    out, offset = [], 0
    for v in values:
        out.append(total[offset : offset + v.size].reshape(v.shape))
        offset += v.size
    return out


class Rewriter:
    """Replays a traced step with sharded layouts; see the module docstring."""

    def __init__(self, layout: Layout, trace: Trace):
        self.layout, self.trace = layout, trace
        self.fuser = _Fuser(layout, trace)
        self.forward: set | None = None  # variables the per-replica computation depends on
        self._update: dict[int, Any] = {}  # values downstream of a gradient sum (id -> value, kept alive)

    def run(self, closed, args) -> list:
        """Evaluates a traced step (the top-level jaxpr)."""
        self.forward = forward_used(closed.jaxpr)
        return self.evaluate(closed.jaxpr, closed.consts, args)

    # -- reading values -------------------------------------------------------------------
    def resolve(self, v):
        return v.get() if isinstance(v, _Pending) else v

    def full(self, v, why: str):
        v = self.resolve(v)
        if isinstance(v, Sharded):
            return gather(self.layout, [v], self.trace, why)[0]
        return v

    # -- the interpreter ------------------------------------------------------------------
    def evaluate(self, jaxpr, consts, args) -> list:
        env, read = _interpret.environment(jaxpr, consts, args)
        # Equations run in order, except that one waiting on a deferred collective (and all that
        # depend on it) waits until nothing else can run; then every deferred collective is sent,
        # fused. The jaxpr is a dataflow graph, so this order computes the same values; effectful
        # equations keep their relative order.
        todo = list(jaxpr.eqns)
        while todo:
            blocked, blocked_vars = [], set()
            for eqn in todo:
                deps = [v for v in eqn.invars if not isinstance(v, core.Literal)]
                if any(v in blocked_vars for v in deps) or (_ordered(eqn) and blocked):
                    wait = True
                else:
                    invals = [read(v) for v in eqn.invars]
                    wait = self._waits(eqn, invals)
                if wait:
                    blocked.append(eqn)
                    blocked_vars.update(eqn.outvars)
                    continue
                if self._in_update(invals):
                    with jax.named_scope(UPDATE_SCOPE), _interpret.source(eqn):
                        outs = self.equation(eqn, invals)
                    self._update.update((id(o), o) for o in outs)
                else:
                    with _interpret.source(eqn):
                        outs = self.equation(eqn, invals)
                for var, val in zip(eqn.outvars, outs, strict=True):
                    env[var] = val
            if blocked:
                self.fuser.flush()
            todo = blocked
        return [read(v) for v in jaxpr.outvars]

    def _in_update(self, invals) -> bool:
        """Whether an equation reads a gradient sum, a shard, or a value computed from them (a sum
        the forward pass reads, such as a batch statistic, is not the update's)."""
        for v in invals:
            if isinstance(v, _Pending):
                if v.kind != "grad" or v.scatter:
                    return True
            elif isinstance(v, Sharded) or id(v) in self._update:
                return True
        return False

    def _waits(self, eqn, invals) -> bool:
        unresolved = any(isinstance(v, _Pending) and v.result is None for v in invals)
        return unresolved and not self._movable(eqn, invals) and not is_grad_sum(eqn, self.layout.axes)

    def equation(self, eqn, invals) -> list:
        name = eqn.primitive.name
        if is_grad_sum(eqn, self.layout.axes):
            # A sum the forward pass reads (a statistic over the whole batch) is no gradient.
            scatter = not any(v in self.forward for v in eqn.outvars)
            return [self.fuser.add(v, scatter=scatter) for v in invals]
        if self._movable(eqn, invals):
            moved = self.bind(eqn, [invals[0].value, *[self.varying(a) for a in invals[1:]]])
            return [self.fuser.move(invals[0], moved[0])]
        vals = [self.resolve(v) for v in invals]
        has_shard = any(isinstance(v, Sharded) for v in vals)
        if name in ("jit", "pjit", "custom_jvp_call", "custom_vjp_call", "closed_call") and (
            has_shard or _interpret.contains_any(eqn, {GRAD_SUM})
        ):
            inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
            inner_jaxpr, consts = (inner.jaxpr, inner.consts) if isinstance(inner, core.ClosedJaxpr) else (inner, ())
            extra = len(vals) - len(inner_jaxpr.invars)
            return self.evaluate(inner_jaxpr, consts, vals[extra:])
        if not has_shard and self._redundant(eqn, vals):
            # Replicated work of the update on a large whole tensor (LAMB's weight norm, a weight
            # decay term): every replica would repeat it, so each does its chunk instead.
            big = [i for i, v in enumerate(vals) if self._sliceable(v)]
            sliced = list(vals)
            for i in big:
                sliced[i] = self.layout.slice(vals[i])
            result = self.on_shards(eqn, sliced)
            if result is not None:
                return result
        if has_shard:
            sharded = self.on_shards(eqn, vals)
            if sharded is not None:
                return sharded
            self.trace.gathered_ops.append(f"{name}{[list(getattr(v, 'shape', ())) for v in vals]}")
            vals = [self.full(v, f"operand of {name}") for v in vals]
            # A gathered value is the same on every replica; type it as the program had it.
            vals = [
                self.varying(v) if isinstance(var, core.Var) and _varying(var.aval) else v
                for var, v in zip(eqn.invars, vals, strict=True)
            ]
        return self.bind(eqn, vals)

    def _sliceable(self, v) -> bool:
        return isinstance(v, jax.Array) and self.layout.shards(np.shape(v), v.dtype) and not _varying(jax.typeof(v))

    def _redundant(self, eqn, vals) -> bool:
        """An update-region equation (nothing per-replica depends on it) on a large whole tensor,
        of a kind that runs on chunks; only with the sharded update."""
        if not self.layout.scatter or self.forward is None or any(v in self.forward for v in eqn.outvars):
            return False
        if self.layout.n == 1:  # no replica repeats it (and no value is typed per replica to tell the forward pass)
            return False
        if any(_varying(v.aval) for v in eqn.outvars) or not any(self._sliceable(v) for v in vals):
            return False
        name = eqn.primitive.name
        if name in ELEMENTWISE:
            shapes = {tuple(np.shape(v)) for v in vals if np.shape(v) != ()}
            return len(shapes) == 1
        return name in REDUCTIONS and len(vals) == 1 and len(eqn.params["axes"]) == np.ndim(vals[0])

    @staticmethod
    def _movable(eqn, invals) -> bool:
        """A shape-only op on a deferred gradient sum (the bias gradient's reshape and unit-axis
        reduce_sum in the backward pass): moving it before the sum keeps all sums fusable."""
        if not invals or not isinstance(invals[0], _Pending) or invals[0].result is not None:
            return False
        name, p = eqn.primitive.name, eqn.params
        if name == "pad":  # the transpose of a slice: zeros sum to zeros
            return isinstance(eqn.invars[1], core.Literal) and eqn.invars[1].val == 0
        if len(invals) != 1:
            return False
        if name in ("reshape", "squeeze", "expand_dims", "transpose", "reshard"):
            return True
        if name == "broadcast_in_dim":
            return math.prod(p["shape"]) == invals[0].value.size
        if name == "reduce_sum":
            return all(invals[0].value.shape[a] == 1 for a in p["axes"])
        return False

    def bind(self, eqn, vals) -> list:
        if _interpret.contains_any(eqn, {GRAD_SUM}):
            # Control flow that resolves a partial sum inside (a value that each iteration needs
            # whole): those sums stay all-reduces in the loop, the results are full values.
            self.trace.collectives.append(
                Collective("all-reduce", self.layout.axes, 0, 0, f"sum inside {eqn.primitive.name}", update=True)
            )
        with eqn.ctx.manager:
            outs = eqn.primitive.bind(*vals, **eqn.primitive.get_bind_params(eqn.params))
        return list(outs) if eqn.primitive.multiple_results else [outs]

    def varying(self, x):
        """``x`` typed as differing per replica (primitives bound directly get no implicit cast)."""
        missing = tuple(a for a in self.layout.axes if not _varying(jax.typeof(x), a))
        return lax.pcast(x, missing, to="varying") if missing and self.layout.n > 1 else x

    def on_shards(self, eqn, vals) -> list | None:
        """The equation computed on shards, or ``None`` when it cannot be."""
        name, p = eqn.primitive.name, eqn.params
        shards = [v for v in vals if isinstance(v, Sharded)]
        shape = shards[0].shape
        if name in ELEMENTWISE:
            if any(s.shape != shape for s in shards):
                return None
            args = []
            for v in vals:
                if isinstance(v, Sharded):
                    args.append(v.shard)
                elif np.shape(v) == ():
                    args.append(v)
                elif tuple(np.shape(v)) == shape:
                    args.append(self.layout.slice(v).shard)
                else:
                    return None
            out = eqn.primitive.bind(*[self.varying(a) for a in args], **p)
            outs = out if eqn.primitive.multiple_results else [out]
            return [Sharded(o, shape) for o in outs]
        if name == "pvary" and len(vals) == 1 and set(p["axes"]) <= set(self.layout.axes):
            return [Sharded(self.varying(vals[0].shard), vals[0].shape)]  # a shard varies already
        if name == "reshard" and len(vals) == 1:  # a sharding annotation; shards are manual already
            return [vals[0]]
        if name == "reshape" and len(vals) == 1:
            return [Sharded(vals[0].shard, tuple(p["new_sizes"]))]
        if name == "broadcast_in_dim" and len(vals) == 1 and math.prod(p["shape"]) == vals[0].size:
            return [Sharded(vals[0].shard, tuple(p["shape"]))]  # only inserts unit dimensions
        if name == "squeeze" and len(vals) == 1:
            return [Sharded(vals[0].shard, tuple(d for i, d in enumerate(shape) if i not in p["dimensions"]))]
        if name in REDUCTIONS and len(vals) == 1 and tuple(sorted(p["axes"])) == tuple(range(len(shape))):
            kind, identity = REDUCTIONS[name]
            s = vals[0]
            local = s.shard
            if self.layout.padding(s.size):
                local = jnp.where(self.layout.valid(s), local, jnp.asarray(identity, local.dtype))
            partial = eqn.primitive.bind(local, **dict(p, axes=(0,)))
            return [self.fuser.add(partial, kind)]  # fused with the other partials when read
        return None


def _ordered(eqn) -> bool:
    """Whether ``eqn`` has an effect that fixes its order (a callback, a print); a collective's
    named-axis effect does not."""
    return any(type(e).__name__ != "NamedAxisEffect" for e in eqn.effects)


def forward_used(jaxpr, seeds=None) -> set:
    """Variables that a value differing per replica (the forward pass) is computed from. Each
    value's type says whether it differs per replica; with one replica, whose values are not typed
    so, ``seeds`` (the batch's variables) say, and what is computed from them differs."""
    if seeds is None:
        differs = lambda v: _varying(v.aval)  # noqa: E731
    else:
        varying = set(seeds)
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("jit", "pjit") and eqn.params.get("name") == "one_replica_sum":
                continue  # where the sum over the replicas would be: the same on every replica after it
            if any(v in varying for v in eqn.invars if not isinstance(v, core.Literal)):
                varying.update(eqn.outvars)
        differs = varying.__contains__
    needed = set()
    for eqn in reversed(jaxpr.eqns):
        if any(differs(v) or v in needed for v in eqn.outvars):
            needed.update(v for v in eqn.invars if not isinstance(v, core.Literal))
    return needed


def _varying(aval, axis=None) -> bool:
    names = _interpret.varying_axes(aval)
    return bool(names) if axis is None else axis in names
