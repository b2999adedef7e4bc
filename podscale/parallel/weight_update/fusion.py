"""The collectives of the replayed step, and their fusion.

Cross-replica sums are deferred (:class:`_Pending`) and sent together by :class:`_Fuser`: the
gradient sums as fused reduce-scatters (gradients of at least ``min_shard_size`` elements, in
:mod:`~podscale.parallel.weight_update.chunks`' layout) and fused all-reduces (the rest), the
partials of reductions over whole sharded tensors (per-layer norms) as one small all-reduce per
kind; :func:`gather` all-gathers shards, fused per dtype and bucket. Every fused buffer is packed
and unpacked by :func:`_pack` and :func:`_unpack`. What was sent is recorded in a :class:`Trace`
(one :class:`Collective` per phase), which the plan reports.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from podscale.parallel.collectives import Collective
from podscale.parallel.weight_update.chunks import Layout, Sharded, unpadded
from podscale.perf.hlo import GRAD_SUM_SCOPE, UPDATE_SCOPE


@dataclasses.dataclass
class Trace:
    """What one rewrite did: collectives, ops computed on gathered values. Filled while tracing."""

    collectives: list[Collective] = dataclasses.field(default_factory=list)
    gathered_ops: list[str] = dataclasses.field(default_factory=list)
    whole_ops: list[str] = dataclasses.field(default_factory=list)
    """Ops of the global program computed on whole values (see ``partition.Partitioner``)."""


def _record(trace: Trace, phases: list[Collective], tensors: int, why: str, update: bool) -> None:
    for ph in phases:
        trace.collectives.append(dataclasses.replace(ph, tensors=tensors, why=why, update=update))


def _buckets(items: list, nbytes, limit: int) -> list[list]:
    out, current, size = [], [], 0
    for item in items:
        if current and size + nbytes(item) > limit:
            out.append(current)
            current, size = [], 0
        current.append(item)
        size += nbytes(item)
    return out + ([current] if current else [])


def _pack(parts: list, k: int = 1) -> jax.Array:
    """One buffer of ``parts`` side by side along their last axis (a lone part as it is: no copy).
    ``k > 1``: chunks laid out per model partition (:class:`~.chunks.ByPartition`), ``k`` pieces
    each: the buffer holds every part's piece ``m`` in its own piece ``m``, so that each model
    partition packs only what it holds."""
    if len(parts) == 1:
        return parts[0]
    if k == 1:
        return jnp.concatenate(parts, axis=-1)
    lead = parts[0].shape[:-1]
    return jnp.concatenate([p.reshape(*lead, k, -1) for p in parts], axis=-1).reshape(*lead, -1)


def _unpack(buffer, widths: list[int], k: int = 1) -> Iterator[jax.Array]:
    """The inverse of :func:`_pack`: consecutive pieces of ``buffer``'s last axis, ``widths`` wide.
    Lazily, so that each piece is sliced just before its caller reshapes it (the program's ops
    in the order of one loop over the tensors)."""
    if len(widths) == 1:
        yield buffer
        return
    lead = buffer.shape[:-1]
    pieces = buffer if k == 1 else buffer.reshape(*lead, k, -1)
    offset = 0
    for width in widths:
        w = width // k
        piece = pieces[..., offset : offset + w]
        yield piece if k == 1 else piece.reshape(*lead, width)
        offset += w


def _fused_flat(values: list, collective) -> list:
    """``collective`` (an all-reduce) of ``values`` flattened into one buffer, back in their shapes."""
    total = collective(_pack([jnp.ravel(v) for v in values]))
    pieces = _unpack(total, [v.size for v in values])
    return [piece.reshape(v.shape) for piece, v in zip(pieces, values, strict=True)]


def _fuse_reduce_scatter(layout: Layout, values: list, trace: Trace, by: list | None = None) -> list:
    """Large tensors go alone (their padded rows are a free reshape, no copy into a buffer);
    the others are concatenated into one buffer."""
    by = by or [None] * len(values)
    alone = [i for i, v in enumerate(values) if layout.alone(v.size * v.dtype.itemsize)]
    fused = [i for i in range(len(values)) if i not in alone]
    out: list = [None] * len(values)
    for group in [[i] for i in alone] + ([fused] if fused else []):
        results = _reduce_scatter(layout, [values[i] for i in group], trace, [by[i] for i in group])
        for i, r in zip(group, results, strict=True):
            out[i] = r
    return out


def _reduce_scatter(layout: Layout, values: list, trace: Trace, by: list) -> list:
    """``by``: each value's chunking, all per model partition (one ``k``) or all flat."""
    k = by[0].k if by[0] is not None else 1
    rows = [layout._padded_rows(v, b) for v, b in zip(values, by, strict=True)]
    widths = [r.shape[1] for r in rows]
    buffer = _pack(rows, k)
    phases: list[Collective] = []
    if not layout.scatter:
        # The replicated update all-reduces the very same buffer, so that every element is summed
        # as in the sharded update (XLA:CPU's summation order depends on the buffer's layout).
        total = layout.grad_sum.all_reduce(buffer, phases)
        _record(trace, phases, len(values), "gradient sum", update=True)
        pieces = _unpack(total, widths, k)
        return [unpadded(piece, v.shape, b) for piece, v, b in zip(pieces, values, by, strict=True)]
    if k > 1:  # each model partition's pieces: [n, k * c] -> [k * c], the last dimension over the model axis
        local = layout.per_partition(lambda b: layout.grad_sum.reduce_scatter(b, phases), buffer, 1, 0)
    else:
        local = layout.grad_sum.reduce_scatter(buffer, phases)
    _record(trace, phases, len(values), "gradient sum", update=True)
    pieces = _unpack(local, widths, k)
    return [Sharded(piece, tuple(v.shape), b) for piece, v, b in zip(pieces, values, by, strict=True)]


def _fuse_all_reduce(layout: Layout, values: list, trace: Trace, why: str, update: bool) -> list:
    phases: list[Collective] = []
    if len(values) == 1 and layout.grad_sum.mode == "1d":  # as it is: no flattening
        out = [layout.grad_sum.all_reduce(values[0], phases)]
    else:
        out = _fused_flat(values, lambda buffer: layout.grad_sum.all_reduce(buffer, phases))
    _record(trace, phases, len(values), why, update)
    return out


def gather(layout: Layout, shards: list[Sharded], trace: Trace, why: str, update: bool = False) -> list:
    """All-gathers sharded values to full ones, fused per dtype (``update``: the updated weights)."""
    with jax.named_scope(UPDATE_SCOPE):
        return _gather(layout, shards, trace, why, update)


def _gather(layout: Layout, shards: list[Sharded], trace: Trace, why: str, update: bool) -> list:
    out: list = [None] * len(shards)
    by_dtype: dict[Any, list[int]] = {}  # per dtype and chunking (per model partition or flat)
    for i, s in enumerate(shards):
        by_dtype.setdefault((s.shard.dtype, _k(s.by)), []).append(i)

    def full_bytes(i):
        return shards[i].size * shards[i].shard.dtype.itemsize

    buckets = [[i] for i in range(len(shards)) if layout.alone(full_bytes(i))]  # no copy out of a buffer
    for members in by_dtype.values():
        rest = [i for i in members if not layout.alone(full_bytes(i))]
        buckets += _buckets(rest, full_bytes, layout.bucket_bytes)
    for members in buckets:
        parts = [shards[i].shard for i in members]
        k = _k(shards[members[0]].by)
        phases: list[Collective] = []
        if k > 1:  # [k * c] -> [n, k * c], the model axis's pieces gathered where they lie
            full = layout.per_partition(lambda s: layout.grad_sum.all_gather(s, phases), _pack(parts, k), 0, 1)
        else:
            full = layout.grad_sum.all_gather(_pack(parts), phases)  # [n, local]
        _record(trace, phases, len(members), why, update)
        for i, piece in zip(members, _unpack(full, [p.shape[0] for p in parts], k), strict=True):
            out[i] = unpadded(piece, shards[i].shape, shards[i].by)
    return out


def _k(by) -> int:
    """The model partitions a chunking lays a chunk out over (1: flat)."""
    return 1 if by is None else by.k


class _Pending:
    """A cross-replica reduction whose collective is deferred, so that many can be fused.

    ``kind`` is ``"grad"`` (a gradient sum, divided by the replica count: reduce-scattered when
    ``shard``, else all-reduced) or ``"sum"``/``"max"``/``"min"`` (the partials of a reduction
    over a whole sharded tensor, such as a per-layer norm)."""

    def __init__(self, fuser: _Fuser, value, shard: bool, kind: str = "grad"):
        self.fuser, self.value, self.shard, self.kind, self.result = fuser, value, shard, kind, None
        self.scatter = True
        self.by = None  # a sharded gradient's chunking (per model partition, or flat)

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
        p.by = self.layout.by(value.shape) if shard else None
        if kind == "grad":
            # A bucket that was already full goes now, while the backward pass continues. It waits
            # until the next gradient sum arrives, so that the shape-only ops following the last
            # one (a transpose, a reshape) have been moved before its collective.
            key = (kind, p.shard, p.value.dtype, _k(p.by))
            same = [q for q in self.pending if (q.kind, q.shard, q.value.dtype, _k(q.by)) == key]
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
            key = (p.kind, p.shard, p.value.dtype, p.scatter, _k(p.by), id(p) if alone else None)
            groups.setdefault(key, []).append(p)
        for (kind, shard, _, scatter, _, _), members in groups.items():
            values = [p.value for p in members]
            if kind == "grad" and shard:
                with jax.named_scope(UPDATE_SCOPE), jax.named_scope(GRAD_SUM_SCOPE):
                    results = _fuse_reduce_scatter(self.layout, values, self.trace, [p.by for p in members])
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
    reduce = {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin}[kind]
    if layout.n == 1:  # one replica: the partials are the whole reduction
        return list(values)
    why = f"reduce_{kind} of whole sharded tensors (norms)"

    def collective(buffer):
        nbytes = buffer.size * buffer.dtype.itemsize
        trace.collectives.append(Collective("all-reduce", layout.axes, nbytes, len(values), why, update=True))
        return reduce(buffer, layout.axes)

    return _fused_flat(values, collective)
