"""A small jaxpr interpreter that re-binds every equation, with rules for chosen primitives.

podscale rewrites a user's traced step rather than asking for changes to its code. This module is
the one place that walks a jaxpr: ``evaluate(closed_jaxpr, args, rules)`` runs the program
equation by equation under whatever trace is active (here: the body of a ``shard_map``), calling
``rules[name](eqn, invals)`` instead of binding a primitive whose name is in ``rules``.

Higher-order equations (nested ``jit``, ``remat``, ``custom_jvp_call``/``custom_vjp_call``,
``scan``, ``while``, ``cond``) are bound unchanged when no rule applies anywhere inside them;
otherwise they are inlined (call-like ones) or rebuilt with the same ``lax`` control flow around
an interpreted body, so a rule reaches a primitive at any depth. An equation that holds a rule's
primitive inside a form this module does not know is an error, never a silent skip.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax import lax
from jax._src.interpreters import partial_eval as pe  # convert_constvars_jaxpr; no public name
from jax.extend import core

Rule = Callable[[Any, list[Any]], Sequence[Any]]

GRAD_SUM = "psum_invariant"
"""The primitive that sums a replicated value's gradient over the mesh axes under ``check_vma``
(the transpose of the implicit cast of a replicated value to a per-replica one)."""


def is_grad_sum(eqn, axes) -> bool:
    """A ``GRAD_SUM`` over every replica axis. One over fewer axes is the model's own collective
    (batch norm over a group of replicas, or the backward pass of one) and is left as it is."""
    return eqn.primitive.name == GRAD_SUM and set(eqn.params["axes"]) == set(axes)


def terminal_partial_sum_uses(jaxpr, axes) -> dict[tuple[int, Any], tuple[str, ...]]:
    """Where the result of a ``GRAD_SUM`` over a strict subset A of ``axes`` is one step of a
    gradient's sum over the replicas, and so takes the 1/|A| of a mean: ``{(id(eqn), var): A}``
    for each such use of ``var`` by ``eqn``.

    With batch norm over a group of replicas, a weight's gradient may be summed in two steps (over
    the group axis, then over the others), while a statistic's cotangent is summed over the group
    on its way back through the model. A use of the former only meets further sums; the latter is
    cast to per-replica again (``pvary`` over A, the transpose of the forward ``psum``): it is
    part of each replica's backward pass and stays a plain sum. flax's batch norm feeds one sum to
    both (the cotangent of ``scale * rsqrt(var)``), hence the decision per use. An op shared by
    both paths between the sum and its uses would defeat this (the weight's part would stay a
    sum); flax's batch norm has none, which the bn-group tests check against one device.
    """
    _refuse_nested_partial_sums(jaxpr, axes)
    uses = {}
    for i, eqn in enumerate(jaxpr.eqns):
        if not _is_partial_sum(eqn, axes):
            continue
        group = set(eqn.params["axes"])
        for j in range(i + 1, len(jaxpr.eqns)):
            consumer = jaxpr.eqns[j]
            for var in eqn.outvars:
                if not any(v is var for v in consumer.invars):
                    continue
                if not _revaries(jaxpr.eqns[j:], group):
                    uses[(id(consumer), var)] = tuple(eqn.params["axes"])
    return uses


def _is_partial_sum(eqn, axes) -> bool:
    return eqn.primitive.name == GRAD_SUM and set(eqn.params["axes"]) != set(axes)


def _refuse_nested_partial_sums(jaxpr, axes) -> None:
    """Partial sums are rescaled in the top-level jaxpr only: refuse them inside remat, scan, ..."""
    for eqn in jaxpr.eqns:
        for sub in sub_jaxprs(eqn):
            if any(_is_partial_sum(e, axes) for e in sub.eqns) or _has_partial(sub, axes):
                raise NotImplementedError(
                    f"a sum over part of the mesh axes {tuple(axes)} (batch norm over a group of replicas?) sits "
                    f"inside {eqn.primitive.name}; podscale takes a gradient's mean there only for sums over "
                    "every axis. Drop bn_group_size, or move the batch norm out of jax.checkpoint / scan"
                )


def _has_partial(jaxpr, axes) -> bool:
    return any(_is_partial_sum(e, axes) or any(_has_partial(s, axes) for s in sub_jaxprs(e)) for e in jaxpr.eqns)


def _revaries(eqns, group: set) -> bool:
    """Whether the outputs of ``eqns[0]`` reach a cast to per-replica over an axis of ``group``
    (the transpose of a forward sum over it: the value belongs to each replica's backward pass)."""
    tainted = set(eqns[0].outvars)
    for eqn in eqns:
        if eqn is not eqns[0] and not any(v in tainted for v in eqn.invars if not isinstance(v, core.Literal)):
            continue
        if eqn.primitive.name in ("pvary", "pcast") and group & set(eqn.params.get("axes", ())):
            return True
        tainted.update(eqn.outvars)
    return False


def varying_axes(aval) -> frozenset:
    """The mesh axes over which a value of type ``aval`` differs per replica."""
    mat = getattr(aval, "manual_axis_type", None)  # JAX 0.10 names it so; older: ``aval.vma``
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


_CALL_PARAM = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
}


def sub_jaxprs(eqn) -> list[Any]:
    subs = []
    for value in eqn.params.values():
        items = value if isinstance(value, (tuple, list)) else (value,)
        for item in items:
            if isinstance(item, core.ClosedJaxpr):
                subs.append(item.jaxpr)
            elif isinstance(item, core.Jaxpr):
                subs.append(item)
    return subs


def contains(jaxpr, names: frozenset[str] | set[str]) -> bool:
    """Whether any equation of ``jaxpr``, at any depth, is a primitive named in ``names``."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in names:
            return True
        if any(contains(sub, names) for sub in sub_jaxprs(eqn)):
            return True
    return False


def contains_any(eqn, names) -> bool:
    """Whether a sub-jaxpr of ``eqn``, at any depth, holds a primitive named in ``names``."""
    return any(contains(sub, names) for sub in sub_jaxprs(eqn))


def _as_closed(jaxpr_like) -> tuple[Any, Sequence[Any]]:
    if isinstance(jaxpr_like, core.ClosedJaxpr):
        return jaxpr_like.jaxpr, jaxpr_like.consts
    return jaxpr_like, ()


def environment(jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> tuple[dict, Callable]:
    """The variable environment of ``jaxpr`` bound to ``consts`` and ``args``, and its reader."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(var):
        return var.val if isinstance(var, core.Literal) else env[var]

    return env, read


def evaluate(jaxpr, consts: Sequence[Any], args: Sequence[Any], rules: Mapping[str, Rule]) -> list[Any]:
    """Evaluates ``jaxpr`` on ``args`` under the current trace, applying ``rules``."""
    env, read = environment(jaxpr, consts, args)
    names = frozenset(rules)
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name in rules:
            outs = list(rules[name](eqn, invals))
        elif sub_jaxprs(eqn) and any(contains(s, names) for s in sub_jaxprs(eqn)):
            outs = rebuild(eqn, invals, rules)
        else:
            with eqn.ctx.manager:
                outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
            if not eqn.primitive.multiple_results:
                outs = [outs]
        for var, val in zip(eqn.outvars, outs, strict=True):
            env[var] = val
    return [read(v) for v in jaxpr.outvars]


def rebuild(eqn, invals, rules) -> list[Any]:
    name, p = eqn.primitive.name, eqn.params
    if name in ("remat2", "checkpoint"):
        # Rebuilt, not inlined: inlining would drop the optimization barrier that keeps XLA from
        # merging the recomputation into the forward pass, and with it the memory saving.
        closed = jax.make_jaxpr(lambda *a: evaluate(p["jaxpr"], (), a, rules))(*invals)
        jaxpr = pe.convert_constvars_jaxpr(closed.jaxpr)
        with eqn.ctx.manager:
            return list(eqn.primitive.bind(*closed.consts, *invals, **dict(p, jaxpr=jaxpr)))
    if name in _CALL_PARAM:
        # Inlining a call is the same function; only its derivative rule is dropped, and the step
        # is not differentiated again after this rewrite.
        inner, consts = _as_closed(p[_CALL_PARAM[name]])
        n_extra = len(invals) - len(inner.invars)
        return evaluate(inner, consts, invals[n_extra:], rules) if n_extra >= 0 else _unknown(eqn)
    if name == "scan":
        body, nc, ncarry = p["jaxpr"], p["num_consts"], p["num_carry"]
        consts, init, xs = invals[:nc], invals[nc : nc + ncarry], invals[nc + ncarry :]

        def scan_body(carry, x):
            outs = evaluate(body.jaxpr, body.consts, [*consts, *carry, *x], rules)
            return outs[:ncarry], outs[ncarry:]

        carry, ys = lax.scan(
            scan_body, list(init), list(xs), length=p["length"], reverse=p["reverse"], unroll=p["unroll"]
        )
        return [*carry, *ys]
    if name == "while":
        cj, bj = p["cond_jaxpr"], p["body_jaxpr"]
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cconsts, bconsts, init = invals[:cn], invals[cn : cn + bn], invals[cn + bn :]
        out = lax.while_loop(
            lambda c: evaluate(cj.jaxpr, cj.consts, [*cconsts, *c], rules)[0],
            lambda c: evaluate(bj.jaxpr, bj.consts, [*bconsts, *c], rules),
            list(init),
        )
        return list(out)
    if name == "cond":
        index, ops = invals[0], invals[1:]
        branches = [(lambda br: lambda *a: evaluate(br.jaxpr, br.consts, a, rules))(br) for br in p["branches"]]
        return list(lax.switch(index, branches, *ops))
    return _unknown(eqn)


def _unknown(eqn):
    raise NotImplementedError(
        f"podscale cannot rewrite inside a '{eqn.primitive.name}' equation of the traced step "
        "(it holds a cross-replica reduction podscale must change). Please report this with "
        "the step that produced it; as a workaround move that part out of the "
        f"'{eqn.primitive.name}'."
    )


def trace(fn: Callable, *args) -> tuple[Any, Any]:
    """Traces ``fn(*args)`` to a closed jaxpr and the pytree structure of its output.

    Nested ``jax.jit`` calls are inlined (``disable_jit`` while tracing), so the jaxpr is one flat
    dataflow graph in which the rewrite can defer and fuse collectives across what were separate
    jitted helpers (optax's per-leaf norms, for instance)."""
    with jax.disable_jit():
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    return closed, jax.tree.structure(out_shape)
