"""Small helpers for walking jaxprs: sub-jaxprs, containment, the per-replica axes of a value, the
one set of elementwise ops, and :func:`kin` (which variables are computed elementwise together).

The per-replica program that :mod:`podscale.parallel.partition` traces is replayed by
:mod:`podscale.parallel.weight_update.replay`, which uses these; an equation holding a form neither
knows is an error there, never a silent skip.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

from jax.extend import core

from podscale._jax import source_info_util

Rule = Callable[[Any, list[Any]], Sequence[Any]]

ELEMENTWISE = frozenset(
    """abs acos acosh add add_any and asin asinh atan atan2 atanh cbrt ceil clamp convert_element_type
    copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt igamma igammac imag
    integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not or population_count
    pow real reduce_precision rem round rsqrt select_n shift_left shift_right_arithmetic shift_right_logical
    sign sin sinh sqrt square sub tan tanh xor conj complex random_bits random_fold_in random_split
    random_wrap random_unwrap random_seed threefry2x32 polygamma zeta bessel_i0e bessel_i1e regularized_incomplete_beta
    stop_gradient bitcast_convert_type""".split()
)
"""Ops whose outputs are computed position by position from their operands' positions (with the
operands' leading dimensions for the random-key ops, whose outputs extend the key's shape)."""

KEY_OPS = frozenset("random_bits random_fold_in random_split random_wrap random_unwrap random_seed".split())

SHAPE_KEEPING = ELEMENTWISE - KEY_OPS - {"bitcast_convert_type"}
"""The elementwise ops whose output has their operands' shape (a chunk of each operand gives the
output's chunk at the same positions)."""

CALLS = frozenset("jit pjit custom_jvp_call custom_vjp_call closed_call".split())
"""Equations that call a sub-jaxpr once on their operands (its last inputs)."""

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


def call_jaxpr(eqn) -> tuple[Any, Sequence[Any]]:
    """A call's (:data:`CALLS`) jaxpr and its constants."""
    inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
    return (inner.jaxpr, inner.consts) if isinstance(inner, core.ClosedJaxpr) else (inner, ())


class _Families:
    """Disjoint sets of hashable keys (union-find, with path compression)."""

    def __init__(self):
        self.parent: dict = {}

    def find(self, key):
        root = key
        while self.parent.get(root, root) != root:
            root = self.parent[root]
        while key != root:
            self.parent[key], key = root, self.parent.get(key, key)
        return root

    def join(self, a, b) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[ra] = rb


def kin(jaxpr, seeds: dict[Any, Hashable]) -> Callable[[Any, tuple], frozenset]:
    """Which ``seeds`` (``{input variable: label}``) each variable of ``jaxpr`` is kin to: the
    labels of the seeds joined to it by chains of shape-keeping elementwise equations
    (:data:`SHAPE_KEEPING`) between same-shaped non-scalar variables, into and out of calls
    (:data:`CALLS`). Adam's ``mu * b1 + g * (1 - b1)`` makes the gradient sum ``g`` kin to the
    moment ``mu`` it is added to, and ``w - lr * u`` the update kin to its weight: a value is known
    by the state leaves it is computed with, not by its shape. A variable is named with the path of
    call equations it sits under (``ctx``, a tuple of their ids): one traced sub-jaxpr called for
    two leaves keeps their kin apart. Returns ``kin_of(var, ctx=())``."""
    families = _Families()
    find, join = families.find, families.join

    def joinable(v) -> bool:
        return isinstance(v, core.Var) and len(getattr(v.aval, "shape", ())) > 0

    def walk(jaxpr, ctx: tuple) -> None:
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name in SHAPE_KEEPING:
                out = eqn.outvars[0]
                if not joinable(out):
                    continue
                for v in [*eqn.invars, *eqn.outvars[1:]]:
                    if joinable(v) and v.aval.shape == out.aval.shape:
                        join((ctx, out), (ctx, v))
            elif name in CALLS:
                inner, _ = call_jaxpr(eqn)
                inside = (*ctx, id(eqn))
                extra = len(eqn.invars) - len(inner.invars)
                for a, b in [*zip(eqn.invars[extra:], inner.invars), *zip(eqn.outvars, inner.outvars)]:
                    if joinable(a) and joinable(b):
                        join((ctx, a), (inside, b))
                walk(inner, inside)

    walk(jaxpr, ())
    labels: dict = {}
    for var, label in seeds.items():
        labels.setdefault(find(((), var)), set()).add(label)
    frozen = {root: frozenset(found) for root, found in labels.items()}

    def kin_of(var, ctx: tuple = ()) -> frozenset:
        if not isinstance(var, core.Var):
            return frozenset()
        return frozen.get(find((ctx, var)), frozenset())

    return kin_of


_WHOLE_REDUCTIONS = frozenset("reduce_sum reduce_max reduce_min".split())


def update_only(jaxpr) -> frozenset:
    """The variables computed in ``jaxpr`` whose whole elementwise family (the variables joined
    to them by shape-keeping elementwise equations, as in :func:`kin`, within ``jaxpr`` and the
    calls it makes) is read by nothing but shape-keeping elementwise ops, reductions and
    ``jaxpr``'s outputs: an optimizer's update of a gradient (``g * g``, ``mu * b1 + g * (1 - b1)``,
    ``w - lr * u``), which can run on chunks from end to end. A batch statistic's family is not:
    the forward or backward pass broadcasts it over the rows, so it is needed whole. The reads of
    ``jaxpr``'s inputs (a weight's use in the forward pass) do not count: only computed variables'."""
    find, opened = _families(jaxpr, inputs=False)
    computed = {v for eqn in jaxpr.eqns for v in eqn.outvars if isinstance(v, core.Var)}
    return frozenset(v for v in computed if find(v) not in opened)


def _families(jaxpr, inputs: bool) -> tuple[Callable, set]:
    """:func:`update_only`'s families of ``jaxpr`` (``find``: a variable's root) and the roots of
    those read otherwise. ``inputs``: ``jaxpr``'s inputs join families too (a called jaxpr's,
    whose inputs are its caller's variables)."""
    families = _Families()
    find, join = families.find, families.join

    member = {v for eqn in jaxpr.eqns for v in eqn.outvars if isinstance(v, core.Var)}
    if inputs:
        member |= set(jaxpr.invars)
    opened: set = set()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        ins = [v for v in eqn.invars if isinstance(v, core.Var) and v in member]
        out = eqn.outvars[0] if eqn.outvars else None
        shape = getattr(getattr(out, "aval", None), "shape", None)
        if name in SHAPE_KEEPING and shape:
            for v in [*ins, *eqn.outvars[1:]]:
                if v.aval.shape == shape:
                    join(v, out)
            opened.update(v for v in ins if v.aval.shape != shape)  # read otherwise
        elif name in CALLS:
            inner, _ = call_jaxpr(eqn)
            ifind, iopen = _families(inner, inputs=True)
            extra = len(eqn.invars) - len(inner.invars)
            callers: dict = {}
            for a, b in zip(eqn.invars[extra:], inner.invars):
                if isinstance(a, core.Var) and a in member:
                    if ifind(b) in iopen:
                        opened.add(a)
                    callers.setdefault(ifind(b), []).append(a)
            for b, o in zip(eqn.outvars, inner.outvars):
                for a in callers.get(ifind(o), []) if isinstance(o, core.Var) else ():
                    join(a, b)
        elif name not in _WHOLE_REDUCTIONS:
            opened.update(ins)
    return find, {find(v) for v in opened}
