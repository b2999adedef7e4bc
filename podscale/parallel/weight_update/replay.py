"""The replay of a traced per-replica step with values in the sharded update's layouts.

:class:`Rewriter` interprets the step's jaxpr equation by equation: a gradient sum (``psum``, or
the partitioner's ``psum_scatter`` of a gradient into a chunk along one of its dims) is
deferred to the fuser (:mod:`~podscale.parallel.weight_update.fusion`), a shape-only op on one is
moved before it so that all sums stay fusable, an op that meets a shard runs on the shards where
that is exact (elementwise ops, reshapes, reductions over a whole tensor) and on all-gathered
values otherwise, and replicated work of the update on a large tensor runs on this replica's
chunk (:mod:`~podscale.parallel.weight_update.chunks`). :func:`forward_used` finds the variables
the forward pass (what differs per replica) is computed from: a sum it reads is all-reduced, never
scattered, and no work it needs is cut into chunks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core

from podscale.compiled.hlo import GRAD_SUM_SCOPE, UPDATE_SCOPE
from podscale.parallel import interpret
from podscale.parallel.interpret import CALLS, GRAD_SUM, SHAPE_KEEPING, is_grad_sum
from podscale.parallel.weight_update.chunks import ByPartition, Chunking, Layout, Sharded, agreed_dim
from podscale.parallel.weight_update.fusion import Collective, Fuser, Pending, Trace, gather

REDUCTIONS = {"reduce_sum": ("sum", 0), "reduce_max": ("max", -np.inf), "reduce_min": ("min", np.inf)}


class Rewriter:
    """Replays a traced step with sharded layouts; see :mod:`podscale.parallel.weight_update`."""

    def __init__(self, layout: Layout, trace: Trace, leaves: Sequence[tuple[int | None, bool]] = ()):
        self.layout, self.trace = layout, trace
        self.leaves = tuple(leaves)
        """Per state leaf (the step's first inputs): the dimension a model axis splits it along
        (``None``: none) and whether it is a weight. A gradient is chunked as the leaves it is
        computed with are split (:meth:`chunking`)."""
        self.fuser = Fuser(layout, trace)
        self.forward: set | None = None  # variables the per-replica computation depends on
        self._update: dict[int, Any] = {}  # values downstream of a gradient sum (id -> value, kept alive)
        self._kin = lambda var, ctx=(): frozenset()  # until :meth:`run` reads the step

    def run(self, closed, args) -> list:
        """Evaluates a traced step (the top-level jaxpr)."""
        self.forward = forward_used(closed.jaxpr)
        self._kin = interpret.kin(closed.jaxpr, dict(zip(closed.jaxpr.invars, self.leaves)))
        return self.evaluate(closed.jaxpr, closed.consts, args)

    def chunking(self, var, ctx: tuple, shape) -> Chunking:
        """How a value of ``shape`` computed as ``var`` (under the calls ``ctx``) is chunked: per
        model partition along the dimension that every state leaf it is kin to
        (:func:`~podscale.parallel.interpret.kin`: the weight and optimizer state it is updated with)
        is split along, where they all agree and the update chunks per partition; else flat.
        ``split``: kin to a weight split over the model axis."""
        found = self._kin(var, ctx) or frozenset()
        agreed = agreed_dim(dim for dim, _ in found)
        split = any(dim is not None and weight for dim, weight in found)
        by = None
        if self.layout.chunks_per_partition and agreed is not None:
            by = ByPartition(tuple(shape), agreed, self.layout.model_split)
        return Chunking(by, split)

    # -- reading values -------------------------------------------------------------------
    def resolve(self, v):
        return v.get() if isinstance(v, Pending) else v

    def full(self, v, why: str):
        v = self.resolve(v)
        if isinstance(v, Sharded):
            return gather(self.layout, [v], self.trace, why)[0]
        return v

    # -- the interpreter ------------------------------------------------------------------
    def evaluate(self, jaxpr, consts, args, ctx: tuple = ()) -> list:
        """``ctx``: the ids of the call equations ``jaxpr`` is under (see :meth:`chunking`)."""
        env, read = interpret.environment(jaxpr, consts, args)
        # Equations run in order, except that one waiting on a deferred collective (and all that
        # depend on it) waits until nothing else can run; then the collectives it waits on are
        # sent, fused (:meth:`_unblocking`: a batch statistic the backward pass reads goes alone,
        # the gradient sums keep filling their buckets). The jaxpr is a dataflow graph, so this
        # order computes the same values; effectful equations keep their relative order.
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
                if self._in_update(eqn, invals):
                    with jax.named_scope(UPDATE_SCOPE), interpret.source(eqn):
                        outs = self.equation(eqn, invals, ctx)
                    self._update.update((id(o), o) for o in outs)
                else:
                    with interpret.source(eqn):
                        outs = self.equation(eqn, invals, ctx)
                for var, val in zip(eqn.outvars, outs, strict=True):
                    env[var] = val
            if blocked:
                self.fuser.flush(self._unblocking(blocked, env))
            todo = blocked
        return [read(v) for v in jaxpr.outvars]

    def _unblocking(self, blocked, env) -> list[Pending] | None:
        """The deferred collectives to send so that ``blocked`` can go on: the sums that a blocked
        equation reads and that are not gradient sums for the update (a batch statistic the
        backward pass reads, a norm's partials), with every other pending one of their kinds,
        fused. Gradient sums stay deferred, to fill their buckets, until nothing else blocks;
        then (``None``) everything pending is sent."""
        read = [env.get(x) for e in blocked for x in e.invars if not isinstance(x, core.Literal)]
        urgent = [
            v for v in read if isinstance(v, Pending) and v.result is None and (v.kind != "grad" or not v.scatter)
        ]
        if not urgent:
            return None
        kinds = {_group(v) for v in urgent}
        send = [q for q in self.fuser.pending if _group(q) in kinds]
        return send + [v for v in dict.fromkeys(urgent) if v not in send]  # one superseded yet read: too

    def _forward_reads(self, eqn) -> bool:
        """Whether the per-replica computation reads a result of ``eqn`` (:func:`forward_used`)."""
        return self.forward is not None and not self.forward.isdisjoint(eqn.outvars)

    def _in_update(self, eqn, invals) -> bool:
        """Whether ``eqn`` reads a gradient sum, a shard, or a value computed from them, and the
        per-replica computation reads none of its results (a batch statistic, summed whole or, as
        FSDP's, into chunks and gathered again, is not the update's)."""
        if self._forward_reads(eqn):
            return False
        for v in invals:
            if isinstance(v, Pending):
                if v.kind != "grad" or v.scatter:
                    return True
            elif isinstance(v, Sharded) or id(v) in self._update:
                return True
        return False

    def _waits(self, eqn, invals) -> bool:
        unresolved = any(isinstance(v, Pending) and v.result is None for v in invals)
        a_sum = is_grad_sum(eqn, self.layout.axes) or _chunk_sum(eqn, self.layout.axes)
        return unresolved and not self._movable(eqn, invals) and not a_sum

    def equation(self, eqn, invals, ctx: tuple = ()) -> list:
        name = eqn.primitive.name
        if _chunk_sum(eqn, self.layout.axes):
            return [
                self.fuser.add_dim(
                    self.full(invals[0], "a gradient summed into chunks"), eqn.params["scatter_dimension"]
                )
            ]
        if is_grad_sum(eqn, self.layout.axes):
            # A sum the forward pass reads (a statistic over the whole batch) is no gradient.
            scatter = not self._forward_reads(eqn)
            return [
                self.fuser.add(v, scatter=scatter, chunking=self.chunking(out, ctx, np.shape(v)))
                for v, out in zip(invals, eqn.outvars, strict=True)
            ]
        if self._movable(eqn, invals):
            moved = self.bind(eqn, [invals[0].value, *[self.varying(a) for a in invals[1:]]])
            return [self.fuser.move(invals[0], moved[0], self.chunking(eqn.outvars[0], ctx, np.shape(moved[0])))]
        vals = [self.resolve(v) for v in invals]
        has_shard = any(isinstance(v, Sharded) for v in vals)
        if name in CALLS and (has_shard or interpret.contains_any(eqn, {GRAD_SUM})):
            inner_jaxpr, consts = interpret.call_jaxpr(eqn)
            extra = len(vals) - len(inner_jaxpr.invars)
            return self.evaluate(inner_jaxpr, consts, vals[extra:], (*ctx, id(eqn)))
        if not has_shard and self._redundant(eqn, vals):
            # Replicated work of the update on a large whole tensor (LAMB's weight norm, a weight
            # decay term): every replica would repeat it, so each does its chunk instead.
            big = [i for i, v in enumerate(vals) if self._sliceable(v)]
            sliced = list(vals)
            for i in big:
                sliced[i] = self.layout.slice(vals[i], self.chunking(eqn.invars[i], ctx, np.shape(vals[i])).by)
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
        if not self.layout.scatter or self.forward is None or self._forward_reads(eqn):
            return False
        if self.layout.n == 1:  # no replica repeats it (and no value is typed per replica to tell the forward pass)
            return False
        if any(_varying(v.aval) for v in eqn.outvars) or not any(self._sliceable(v) for v in vals):
            return False
        name = eqn.primitive.name
        if name in SHAPE_KEEPING:
            shapes = {tuple(np.shape(v)) for v in vals if np.shape(v) != ()}
            return len(shapes) == 1
        return name in REDUCTIONS and len(vals) == 1 and len(eqn.params["axes"]) == np.ndim(vals[0])

    @staticmethod
    def _movable(eqn, invals) -> bool:
        """A shape-only op on a deferred gradient sum (the bias gradient's reshape and unit-axis
        reduce_sum in the backward pass): moving it before the sum keeps all sums fusable."""
        if not invals or not isinstance(invals[0], Pending) or invals[0].result is not None:
            return False
        if invals[0].dim is not None:  # a sum into chunks along a dim: the op would move that dim
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
        if interpret.contains_any(eqn, {GRAD_SUM}):
            # Control flow that resolves a partial sum inside (a value that each iteration needs
            # whole): those sums stay all-reduces in the loop, the results are full values.
            why = f"sum inside {eqn.primitive.name}"
            found = _sums_inside(eqn, self.layout.axes) or {1: (0, 0)}  # a group's sum: the model's own
            for runs, (nbytes, tensors) in sorted(found.items()):
                self.trace.collectives.append(
                    Collective("all-reduce", self.layout.axes, nbytes, tensors, why, runs=runs, update=True)
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
        by = shards[0].by  # how the chunks are laid out (per model partition, or flat)
        if name in SHAPE_KEEPING:
            if any(s.shape != shape or s.by != by for s in shards):
                return None
            args = []
            for v in vals:
                if isinstance(v, Sharded):
                    args.append(v.shard)
                elif np.shape(v) == ():  # a scalar operand (a select's predicate, a literal); beside
                    # chunks of a scalar, its value in every place of the chunk
                    args.append(v if shape != () else jnp.broadcast_to(v, np.shape(shards[0].shard)))
                elif tuple(np.shape(v)) == shape:
                    args.append(self.layout.slice(v, by).shard)
                else:
                    return None
            out = eqn.primitive.bind(*[self.varying(a) for a in args], **p)
            outs = out if eqn.primitive.multiple_results else [out]
            return [Sharded(o, shape, by) for o in outs]
        if name == "pvary" and len(vals) == 1 and set(p["axes"]) <= set(self.layout.axes):
            return [Sharded(self.varying(vals[0].shard), vals[0].shape, by)]  # a shard varies already
        if name == "reshard" and len(vals) == 1:  # a sharding annotation; shards are manual already
            return [vals[0]]
        # Shape-only ops keep the chunking of the shape the value was chunked in (``by``).
        if name == "reshape" and len(vals) == 1:
            return [Sharded(vals[0].shard, tuple(p["new_sizes"]), by)]
        if name == "broadcast_in_dim" and len(vals) == 1 and math.prod(p["shape"]) == vals[0].size:
            return [Sharded(vals[0].shard, tuple(p["shape"]), by)]  # only inserts unit dimensions
        if name == "squeeze" and len(vals) == 1:
            return [Sharded(vals[0].shard, tuple(d for i, d in enumerate(shape) if i not in p["dimensions"]), by)]
        if name in REDUCTIONS and len(vals) == 1 and tuple(sorted(p["axes"])) == tuple(range(len(shape))):
            kind, identity = REDUCTIONS[name]
            s = vals[0]
            local = s.shard
            if self.layout.padding(s.size, s.by):
                local = jnp.where(self.layout.valid(s), local, jnp.asarray(identity, local.dtype))
            partial = eqn.primitive.bind(local, **dict(p, axes=(0,)))
            return [self.fuser.add(partial, kind)]  # fused with the other partials when read
        return None


def _sums_inside(eqn, axes, runs: int = 1) -> dict[int, tuple[int, int]]:
    """The gradient sums (``GRAD_SUM`` over ``axes``) inside ``eqn``'s sub-jaxprs, as ``{runs per
    step: (bytes per device, tensors)}``: a scan's body runs once per iteration (a while loop's
    count is not known here: once), and of a ``cond``'s branches the one that sums most."""
    inner_runs = runs * eqn.params["length"] if eqn.primitive.name == "scan" else runs
    each = []
    for sub in interpret.sub_jaxprs(eqn):
        found: dict[int, tuple[int, int]] = {}
        for inner in sub.eqns:
            if is_grad_sum(inner, axes):
                size = sum(math.prod(v.aval.shape) * v.aval.dtype.itemsize for v in inner.invars)
                _add(found, {inner_runs: (size, len(inner.invars))})
            else:
                _add(found, _sums_inside(inner, axes, inner_runs))
        each.append(found)
    if eqn.primitive.name == "cond":  # one branch runs
        return max(each, key=lambda f: sum(b * r for r, (b, _) in f.items()), default={})
    out: dict[int, tuple[int, int]] = {}
    for found in each:
        _add(out, found)
    return out


def _add(into: dict[int, tuple[int, int]], parts: dict[int, tuple[int, int]]) -> None:
    """``parts`` (``{runs: (bytes, tensors)}``) added into ``into``, key by key."""
    for r, (nbytes, tensors) in parts.items():
        have = into.get(r, (0, 0))
        into[r] = (have[0] + nbytes, have[1] + tensors)


def _chunk_sum(eqn, axes) -> bool:
    """A gradient sum into chunks along one of its dims (``psum_scatter``, tiled, over every data
    axis), as :func:`podscale.parallel.partition.chunked.scatter` writes one outside loops: in the
    gradient sum's scope. Another reduce-scatter (a table's looked-up rows returned to the
    examples that looked them up, which the forward pass reads) is sent where it is."""
    p = eqn.params
    return (
        eqn.primitive.name == "reduce_scatter"
        and p.get("tiled")
        and p.get("axis_index_groups") is None
        and tuple(p["axis_name"]) == tuple(axes)
        and GRAD_SUM_SCOPE in str(eqn.source_info.name_stack).split("/")
    )


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
    names = interpret.varying_axes(aval)
    return bool(names) if axis is None else axis in names


def _group(p: Pending) -> tuple:
    """The deferred collectives that go out fused together when one of them must."""
    return p.kind, p.scatter
