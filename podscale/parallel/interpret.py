"""Small helpers for walking jaxprs: sub-jaxprs, containment, the per-replica axes of a value.

The per-replica program that :mod:`podscale.parallel.partition` traces is replayed by
:mod:`podscale.parallel.weight_update.replay`, which uses these; an equation holding a form neither
knows is an error there, never a silent skip.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jax.extend import core

from podscale._jax import source_info_util

Rule = Callable[[Any, list[Any]], Sequence[Any]]

GRAD_SUM = "psum_invariant"
"""The primitive that sums a replicated value's gradient over the mesh axes under ``check_vma``
(the transpose of the implicit cast of a replicated value to a per-replica one)."""


def is_grad_sum(eqn, axes) -> bool:
    """A ``GRAD_SUM`` over every replica axis. One over fewer axes is the model's own collective
    (batch norm over a group of replicas, or the backward pass of one) and is left as it is."""
    return eqn.primitive.name == GRAD_SUM and set(eqn.params["axes"]) == set(axes)


def varying_axes(aval) -> frozenset:
    """The mesh axes over which a value of type ``aval`` differs per replica."""
    mat = getattr(aval, "manual_axis_type", None)  # JAX 0.10 names it so; older: ``aval.vma``
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


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


def environment(jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> tuple[dict, Callable]:
    """The variable environment of ``jaxpr`` bound to ``consts`` and ``args``, and its reader."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(var):
        return var.val if isinstance(var, core.Literal) else env[var]

    return env, read


def source(eqn):
    """The context to bind ``eqn``'s primitive in so that it keeps the user's name stack and
    source line (as ``jax.core.eval_jaxpr`` does): compiled ops and their collectives then name
    the layer they come from (``metadata={op_name=...}`` in the HLO)."""
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    return source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack)
