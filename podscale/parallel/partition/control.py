"""Calls and control flow (``jit`` inlined, ``remat``, ``scan``, ``while``, ``cond``) run on
local pieces, with the layouts of loop carries and branch outputs found by a fixed point
(:func:`_fixed_point`), and host callbacks (fired once per step, as on one device)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core

from podscale._jax import pe
from podscale.parallel import interpret, regions
from podscale.parallel.partition import chunked
from podscale.parallel.partition.jaxprs import source_at
from podscale.parallel.partition.layouts import PARTIAL, REPLICATED, Chunked, Split
from podscale.parallel.regions import partitioned

if TYPE_CHECKING:
    from podscale.parallel.partition.core import Partitioner


class _Retry(Exception):
    """A loop carry or a branch output came out in another layout than assumed: trace again."""

    def __init__(self, layouts):
        super().__init__("retry")
        self.layouts = layouts


def _inline(param: str):
    def rule(p: Partitioner, eqn, ins):
        closed = eqn.params[param]
        jaxpr, consts = (closed.jaxpr, closed.consts) if isinstance(closed, core.ClosedJaxpr) else (closed, ())
        extra = len(ins) - len(jaxpr.invars)
        # Inlined even when every input is whole: the replay then sees one flat program and can
        # run a nested helper's update work (optax's jitted norms) on shards too.
        outer, p.ctx = p.ctx, (*p.ctx, id(eqn))
        try:
            return p.run(jaxpr, consts, ins[extra:])
        finally:
            p.ctx = outer

    return rule


def _jit(p: Partitioner, eqn, ins):
    found = regions.parse(str(eqn.params.get("name", "")))
    if found is None:
        return _inline("jaxpr")(p, eqn, ins)
    return _region(p, eqn, ins, *found)


def _region(p: Partitioner, eqn, ins, region, kind: str):
    """A :func:`podscale.sum_over_blocks` region: by hand over its axis, on each replica's rows.

    The partitioner's own rules first run it as a call (into a scope of its own), which says how
    its outputs are laid out over the data axes. Where that needed no collective and every input
    is a replica's rows (``Split(0)``, the leaves of the batch's row count) or replicated (the
    others), the region is row by row: it runs by hand on the local values, its outputs laid out
    as the rules found (a replica's rows, or a partial sum over them: a weight's gradient), and
    XLA drops the call's unused values. Otherwise the call stands."""
    role = p.region_axes.get(region.over)
    if role is None or role[1] == 1:
        return _inline("jaxpr")(p, eqn, ins)
    axis, k = role
    marks = len(p.whole_ops), len(p.collectives), p.communications
    with p.scope():
        outs = _inline("jaxpr")(p, eqn, ins)
    rows = p.batch_rows
    avals = [tuple(v.aval.shape) for v in eqn.invars]
    why = None
    if len(p.whole_ops) > marks[0] or len(p.collectives) > marks[1] or p.communications > marks[2]:
        needs = p.whole_ops[marks[0] :][:3] or [f"{c.kind} ({c.why})" for c in p.collectives[marks[1] :][:3]]
        why = "over the data axes the partitioner's rules need a collective inside it: " + (
            "; ".join(needs) if needs else "a partial sum over the replicas made whole"
        )
    elif any(lay != (Split(0) if shape[:1] == (rows,) else REPLICATED) for (_, lay), shape in zip(ins, avals)):
        why = "its inputs are not each replica's rows or replicated"
    elif any(lay not in (REPLICATED, Split(0), PARTIAL) for _, lay in outs):
        why = "its outputs are not each replica's rows, partial sums or replicated"
    elif any(lay is PARTIAL and p.narrow_type(v) is not None for v, lay in outs):
        why = "a 16-bit partial sum it makes is held in float32 by the partitioner's rules"
    elif any(
        lay == Split(0) and lead + region.dim == 0
        for (_, lay), lead in zip(ins, regions.batch_dims(region, avals[: region.n_x]))
    ):
        why = "the dimension it splits is the batch's rows, which the data axes split"
    note = {"region": region.name, "rule": region.rule, "axis": axis, "partitions": k, "pass": kind}
    if why is not None:
        p.regions.append({**note, "by_hand": False, "why": why, "summed_bytes_per_device": 0})
        return outs
    with jax.named_scope(region.name):
        vals, summed = partitioned(region, kind, axis, k, [v for v, _ in ins], avals)
    if [np.shape(v) for v in vals] != [np.shape(v) for v, _ in outs]:
        # A whole value (a gradient broadcast over every row, say) where the region's rows give
        # this replica's: the rules' call stands, and XLA drops what was computed by hand.
        why = "an output is whole over the data axes, not this replica's share"
        p.regions.append({**note, "by_hand": False, "why": why, "summed_bytes_per_device": 0})
        return outs
    why = "the blocks' results summed" if kind == "fwd" else "gradients of its whole inputs summed"
    marks = len(p.collectives)
    for v, s in zip(vals, summed, strict=True):
        if s:
            p.record("all-reduce", (axis,), v, f"region {region.name}: {why}")
    summed_bytes = sum(c.bytes_per_device for c in p.collectives[marks:])
    p.regions.append({**note, "by_hand": True, "summed_bytes_per_device": summed_bytes})
    return [(v, lay) for v, (_, lay) in zip(vals, outs, strict=True)]


def _remat(p: Partitioner, eqn, ins):
    if all(lay is REPLICATED for _, lay in ins):
        return [(o, REPLICATED) for o in p.bind(eqn, [v for v, _ in ins])]
    # Rebuilt with the same params, not inlined: the recomputation keeps its optimization
    # barrier (and so its memory saving).
    layouts = [lay for _, lay in ins]
    found: list = []

    @_scoped(p, eqn)
    def body(*vals):
        outs = p.run(eqn.params["jaxpr"], (), list(zip(vals, layouts, strict=True)))
        found.append(([lay for _, lay in outs], _casts(p, outs)))
        return [v for v, _ in outs]

    vals = [v for v, _ in ins]
    closed = jax.make_jaxpr(body)(*vals)
    jaxpr = pe.convert_constvars_jaxpr(closed.jaxpr)
    outs = eqn.primitive.bind(*closed.consts, *vals, **dict(eqn.params, jaxpr=jaxpr))
    out_layouts, casts = found[-1]
    return list(zip(_recast(p, outs, casts), out_layouts, strict=True))


def _scoped(p: Partitioner, eqn=None):
    """A body run in a scope of its own (``Partitioner.scope``); with ``eqn``, a remat's, a loop's
    or a branch's, under the equation's id (``Partitioner.ctx``), as :func:`interpret.kin` names the
    body's variables."""

    def wrap(fn):
        def inner(*args):
            outer = p.ctx
            if eqn is not None:
                p.ctx = (*outer, id(eqn))
            try:
                with p.scope():
                    return fn(*args)
            finally:
                p.ctx = outer

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
    # A cast 16-bit partial sum's rounding is not in its type, which is all the next iteration (or
    # the branch's caller) reads: it is summed and rounded before it leaves.
    vals_layouts = [
        (p.whole(v, lay), REPLICATED) if p.cast_type(v) is not None else (v, lay) for v, lay in vals_layouts
    ]
    return [p.hold(p.convert(v, lay, t), t) for (v, lay), t in zip(vals_layouts, targets, strict=True)]


def _casts(p: Partitioner, outs) -> list:
    """Per value of a body's outputs: ``(narrow, wide)`` where it is a cast 16-bit partial sum
    (``Partitioner.cast_type``), which the caller registers again on what comes out; else ``None``."""
    return [(p.narrow_type(v), p.cast_type(v)) if p.cast_type(v) is not None else None for v, _ in outs]


def _recast(p: Partitioner, vals, casts) -> list:
    return [v if c is None else p.hold_cast(v, *c) for v, c in zip(vals, casts, strict=True)]


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
    body, (nc, ncarry) = prm["jaxpr"], interpret.scan_counts(prm)
    consts, init, xs = ins[:nc], ins[nc : nc + ncarry], ins[nc + ncarry :]
    # The scanned dimension is 0 and runs in order: a split along it cannot be scanned locally. A
    # chunk along another dimension (a stacked layer's weight, stored by FSDP) is scanned as
    # chunks: each iteration reads its own layer's chunk, gathered inside the loop where it is used.
    xs = [_unscanned(p, v, lay, var) for (v, lay), var in zip(xs, eqn.invars[nc + ncarry :], strict=True)]
    x_layouts = [_inner(lay, -1) for _, lay in xs]
    ys_layouts: list = []
    ys_casts: list = []

    def attempt(carry_layouts, pinned, guessed):
        carry0 = _vary_all(
            p, [p.hold(p.convert(v, lay, t), t) for (v, lay), t in zip(init, carry_layouts, strict=True)], carry_layouts
        )

        @_scoped(p, eqn)
        def step(carry, x):
            outs = p.run(body.jaxpr, body.consts, [*consts, *zip(carry, carry_layouts), *zip(x, x_layouts)])
            new = _vary_all(p, _fit(p, outs[:ncarry], carry_layouts, pinned, guessed), carry_layouts)
            ys = outs[ncarry:]
            if p.fsdp:
                # A layer's partial sum (its weight's gradient) is reduce-scattered into chunks inside
                # the loop, as FSDP stores the stack: the whole stack's sum is never held.
                ys = [
                    _chunked(p, v, var) if lay is PARTIAL else (v, lay)
                    for (v, lay), var in zip(ys, body.jaxpr.outvars[ncarry:], strict=True)
                ]
            # Rows stack as they are: stacked partial sums are the partial sum of the stack (a
            # layer's weight gradient out of the backward scan over layers is summed once, after
            # the loop, where the sharded update can reduce-scatter it); a partial ``xs`` is sliced
            # into partial rows the same way.
            # A cast 16-bit partial sum (a float32 master weight's gradient) stacks as it is too,
            # registered again on the stack: its rounding commutes with stacking.
            ys_layouts[:] = [lay for _, lay in ys]
            ys_casts[:] = _casts(p, ys)
            return new, [v for v, _ in ys]

        runs, p.runs = p.runs, p.runs * prm["length"]
        try:
            carry, ys = _run_scan(step, carry0, xs, prm)
        finally:
            p.runs = runs
        ys_out = [_inner(lay, 1) for lay in ys_layouts]
        return [*zip(carry, carry_layouts), *zip(_recast(p, ys, ys_casts), ys_out)]

    return _fixed_point(p, attempt, [lay for _, lay in init], guessed=_zero_carries(p, eqn, nc, ncarry))


def _unscanned(p: Partitioner, v, lay, var):
    """A scanned input ``v`` (``var`` in the program) in a layout the scan can run on locally. One
    split along the scanned dimension 0 is made whole, but microbatches (the batch's rows cut
    into ``[k, rows / k, ...]``, each replica holding whole microbatches:
    ``Partitioner.microbatches``), which are exchanged into their split along dimension 1 where
    the replicas divide both (an all-to-all: each replica keeps its rows of every microbatch).
    Any other dimension 1 is no rows: split, each iteration would sum its contractions over the
    replicas (a ``lax.map`` over examples: one all-reduce per example)."""
    if _along(lay) != 0:
        return v, lay
    shape = tuple(var.aval.shape)
    if p.microbatches.get(id(v)) is v and p.divides(shape, 1) and not p.one:
        p.communications += 1
        p.record("all-to-all", p.axes, v, "scanned rows exchanged for each iteration's rows")
        return lax.all_to_all(v, p.axes, 1, 0, tiled=True), Split(1)
    return p.whole(v, lay), REPLICATED


def _along(layout) -> int | None:
    """The dimension a split or chunked layout divides, else ``None``."""
    return layout.dim if isinstance(layout, (Split, Chunked)) else None


def _inner(layout, shift: int):
    """A split or chunked layout of a stack's slice (``shift=-1``) or of a stack of slices (``+1``)."""
    if _along(layout) is None:
        return layout
    return type(layout)(layout.dim + shift)


def _chunked(p: Partitioner, v, var):
    to = chunked.chunk_of(p, var.aval.shape)
    return (v, PARTIAL) if to is None else (p.convert(v, PARTIAL, to), to)


def _run_scan(step, carry0, xs, prm):
    return lax.scan(
        step,
        carry0,
        [v for v, _ in xs],
        length=prm["length"],
        reverse=prm["reverse"],
        unroll=prm["unroll"],
        _split_transpose=prm.get("_split_transpose", False),
    )


def _while(p: Partitioner, eqn, ins):
    prm = eqn.params
    cj, bj, cn, bn = prm["cond_jaxpr"], prm["body_jaxpr"], prm["cond_nconsts"], prm["body_nconsts"]
    cconsts, bconsts, init = ins[:cn], ins[cn : cn + bn], ins[cn + bn :]

    def attempt(carry_layouts, pinned, guessed):
        carry0 = [p.hold(p.convert(v, lay, t), t) for (v, lay), t in zip(init, carry_layouts, strict=True)]

        @_scoped(p, eqn)
        def cond(c):
            ((pred, lay),) = p.run(cj.jaxpr, cj.consts, [*cconsts, *zip(c, carry_layouts)])
            return p.to_whole(pred, lay)

        @_scoped(p, eqn)
        def body(c):
            outs = p.run(bj.jaxpr, bj.consts, [*bconsts, *zip(c, carry_layouts)])
            return _vary_all(p, _fit(p, outs, carry_layouts, pinned, guessed), carry_layouts)

        out = lax.while_loop(cond, body, _vary_all(p, carry0, carry_layouts))
        return list(zip(out, carry_layouts, strict=True))

    return _fixed_point(p, attempt, [lay for _, lay in init], guessed=_zero_carries(p, eqn, cn + bn, len(init)))


def _vary_all(p: Partitioner, vals, layouts):
    """Split and partial carries differ per replica: type them so from the start (a chunk over the
    axes it is chunked over: with data x FSDP, its copies over the other axes are alike)."""
    return [
        v if lay is REPLICATED else p.vary_chunk(v) if isinstance(lay, Chunked) else p.vary(v)
        for v, lay in zip(vals, layouts, strict=True)
    ]


def _cond(p: Partitioner, eqn, ins):
    (index, il), *ops = ins
    index = p.whole(index, il)
    branches = eqn.params["branches"]

    def attempt(out_layouts, pinned, guessed):
        def make(br):
            @_scoped(p, eqn)
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
            f"{eqn.primitive.name}{source_at(eqn)} with ordered=True: JAX runs ordered effects on one device only, "
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
        f"io_callback{source_at(eqn)} in the step: podscale runs the step on every replica, so it would fire once per "
        "replica, where one device fires it once per step. Call it outside the step (on the metrics the step "
        "returns), or use jax.debug.callback, which podscale fires once per step on the whole values."
    )


CONTROL = {
    "debug_callback": _debug_callback,
    "debug_print": _debug_callback,
    "io_callback": _io_callback,
    "jit": _jit,
    "pjit": _jit,
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
