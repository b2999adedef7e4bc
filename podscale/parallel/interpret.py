"""Small helpers for walking jaxprs: sub-jaxprs, containment, the per-replica axes of a value, the
one set of elementwise ops, and :func:`kin` (which variables are computed elementwise together).

The per-replica program that :mod:`podscale.parallel.partition` traces is replayed by
:mod:`podscale.parallel.weight_update.replay`, which uses these; an equation holding a form neither
knows is an error there, never a silent skip.
"""

from __future__ import annotations

import math
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
    stop_gradient bitcast_convert_type name""".split()
)
"""Ops whose outputs are computed position by position from their operands' positions (with the
operands' leading dimensions for the random-key ops, whose outputs extend the key's shape).
``name`` is ``jax.ad_checkpoint.checkpoint_name``'s identity (a remat policy has read it by the
time the step is traced: the offloads are ``device_put`` equations then); on a piece, the named
value is not gathered whole."""

KEY_OPS = frozenset("random_bits random_fold_in random_split random_wrap random_unwrap random_seed".split())

SHAPE_KEEPING = ELEMENTWISE - KEY_OPS - {"bitcast_convert_type"}
"""The elementwise ops whose output has their operands' shape (a chunk of each operand gives the
output's chunk at the same positions)."""

CALLS = frozenset("jit pjit custom_jvp_call custom_vjp_call closed_call".split())
"""Equations that call a sub-jaxpr once on their operands (its last inputs)."""

REMATS = frozenset("remat2 checkpoint".split())
"""``jax.checkpoint``'s equations: called once on their operands too. :func:`kin` walks into their
body, which the partitioner runs under the equation's id (``Partitioner.ctx``)."""

LOOPS = frozenset("scan while cond".split())
"""Loops and branches: :func:`kin` walks their bodies too (:func:`body_pairs`), which the
partitioner runs under the equation's id, as a remat's."""

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


def scan_counts(params) -> tuple[int, int]:
    """How many of a ``scan``'s inputs are consts and carry: JAX 0.10's ``num_consts`` and
    ``num_carry``, or the trees JAX 0.11 gives instead (``ft_in``: consts, carry, xs)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def body_pairs(eqn) -> list[tuple[Any, list[tuple[Any, Any]], list[tuple[Any, Any]]]]:
    """A loop's or a branch's (:data:`LOOPS`) bodies, each as ``(jaxpr, across, around)``:
    ``across`` pairs the equation's variables with the body's that hold the same values (its
    operands with the body's inputs, its results with the body's results: a carry, a const, a
    branch's operand), ``around`` pairs a body's carry results with its carry inputs (the next
    iteration's). A scanned input or a stacked result pairs with its slice; :func:`kin` joins
    only pairs of one shape."""
    prm, name = eqn.params, eqn.primitive.name
    if name == "scan":
        body = prm["jaxpr"].jaxpr
        nc, ncarry = scan_counts(prm)
        across = [*zip(eqn.invars, body.invars), *zip(eqn.outvars, body.outvars)]
        return [(body, across, list(zip(body.outvars[:ncarry], body.invars[nc : nc + ncarry])))]
    if name == "while":
        cj, bj, cn, bn = prm["cond_jaxpr"].jaxpr, prm["body_jaxpr"].jaxpr, prm["cond_nconsts"], prm["body_nconsts"]
        init = eqn.invars[cn + bn :]
        cond = [*zip(eqn.invars[:cn], cj.invars[:cn]), *zip(init, cj.invars[cn:])]
        body = [*zip(eqn.invars[cn : cn + bn], bj.invars[:bn]), *zip(init, bj.invars[bn:])]
        body += list(zip(eqn.outvars, bj.outvars))
        around = [*zip(bj.outvars, bj.invars[bn:]), *zip(bj.outvars, cj.invars[cn:])]
        return [(cj, cond, []), (bj, body, around)]
    if name == "cond":
        return [
            (br.jaxpr, [*zip(eqn.invars[1:], br.jaxpr.invars), *zip(eqn.outvars, br.jaxpr.outvars)], [])
            for br in prm["branches"]
        ]
    return []


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


def kin(jaxpr, seeds: dict[Any, Hashable]) -> Callable[[Any, tuple], frozenset | None]:
    """Which ``seeds`` (``{input variable: label}``) each variable of ``jaxpr`` is kin to: the
    labels of the seeds joined to it by chains of shape-keeping elementwise equations
    (:data:`SHAPE_KEEPING`) between same-shaped non-scalar variables, into and out of calls
    (:data:`CALLS`, and remat's :data:`REMATS`), loops and branches (:data:`LOOPS`: a carry with
    its value in the body and the next iteration's, a const with its use). Adam's ``mu * b1 + g * (1 - b1)`` makes the gradient sum ``g`` kin to the
    moment ``mu`` it is added to, and ``w - lr * u`` the update kin to its weight: a value is known
    by the state leaves it is computed with, not by its shape. A variable is named with the path of
    call, loop or branch equations it sits under (``ctx``, a tuple of their ids): one traced
    sub-jaxpr called for two leaves keeps their kin apart. Returns ``kin_of(var, ctx=())``:
    ``None`` for a variable the walk did not reach (in the body of a form it does not know)."""
    families = _Families()
    find, join = families.find, families.join

    walked: set = set()

    def joinable(v) -> bool:
        return isinstance(v, core.Var) and len(getattr(v.aval, "shape", ())) > 0

    def walk(jaxpr, ctx: tuple) -> None:
        walked.update((ctx, v) for v in jaxpr.invars)
        walked.update((ctx, v) for eqn in jaxpr.eqns for v in eqn.outvars)
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name in SHAPE_KEEPING:
                out = eqn.outvars[0]
                if not joinable(out):
                    continue
                for v in [*eqn.invars, *eqn.outvars[1:]]:
                    if joinable(v) and v.aval.shape == out.aval.shape:
                        join((ctx, out), (ctx, v))
            elif name in CALLS or name in REMATS:
                inner, inside = call_jaxpr(eqn)[0], (*ctx, id(eqn))
                for a, b in _call_pairs(eqn, inner):
                    if joinable(a) and joinable(b) and a.aval.shape == b.aval.shape:
                        join((ctx, a), (inside, b))
                walk(inner, inside)
            elif name in LOOPS:  # its bodies, under the equation's id, as the partitioner runs them
                inside = (*ctx, id(eqn))
                for inner, across, around in body_pairs(eqn):
                    for a, b in across:
                        if joinable(a) and joinable(b) and a.aval.shape == b.aval.shape:
                            join((ctx, a), (inside, b))
                    for a, b in around:
                        if joinable(a) and joinable(b) and a.aval.shape == b.aval.shape:
                            join((inside, a), (inside, b))
                    walk(inner, inside)

    walk(jaxpr, ())
    labels: dict = {}
    for var, label in seeds.items():
        labels.setdefault(find(((), var)), set()).add(label)
    frozen = {root: frozenset(found) for root, found in labels.items()}

    def kin_of(var, ctx: tuple = ()) -> frozenset | None:
        if not isinstance(var, core.Var):
            return frozenset()
        if (ctx, var) not in walked:  # in the body of a form the walk does not know
            return None
        return frozen.get(find((ctx, var)), frozenset())

    return kin_of


def _call_pairs(eqn, inner) -> list[tuple[Any, Any]]:
    """A call's (:data:`CALLS`) operands with its jaxpr's inputs, and its results with its
    jaxpr's outputs; none where they do not line up (a form not known here: nothing is joined
    across it, which costs only chunking, never a value)."""
    extra = len(eqn.invars) - len(inner.invars)
    if extra < 0 or len(eqn.outvars) != len(inner.outvars):
        return []
    return [*zip(eqn.invars[extra:], inner.invars), *zip(eqn.outvars, inner.outvars)]


_WHOLE_REDUCTIONS = frozenset("reduce_sum reduce_max reduce_min".split())
_MOVES = frozenset("reshape squeeze expand_dims broadcast_in_dim transpose reduce_sum reduce_max reduce_min".split())
"""Shape ops that, where their result has their operand's element count, move no element:
:func:`update_only` keeps the two in one family."""


def _size(var) -> int:
    return math.prod(getattr(var.aval, "shape", ()))


def update_only(jaxpr) -> Callable[[Any, tuple], bool]:
    """Whether a variable of ``jaxpr`` (under the calls ``ctx``, as in :func:`kin`) belongs to an
    elementwise family (variables joined by shape-keeping elementwise equations, into and out of
    calls, and through shape ops that move no element) read by nothing but shape-keeping
    elementwise ops, reductions and the outputs: an
    optimizer's update of a gradient (``g * g``, ``mu * b1 + g * (1 - b1)``, ``w - lr * u``), which
    can run on chunks from end to end. A batch statistic's family is not: the forward or backward
    pass broadcasts it over the rows, so it is needed whole. Only computed variables count: the
    reads of ``jaxpr``'s inputs (a weight's use in the forward pass) do not, and the inputs join no
    family. A loop's, a branch's or a remat's body is read on its own (its inputs are not computed
    there). Returns ``is_update_only(var, ctx=())``."""
    families = _Families()
    find, join = families.find, families.join
    opened: list = []
    computed: set = set()

    def walk(jaxpr, ctx: tuple, members: set) -> None:
        member = members | {v for eqn in jaxpr.eqns for v in eqn.outvars if isinstance(v, core.Var)}
        computed.update((ctx, v) for v in member)
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            ins = [v for v in eqn.invars if isinstance(v, core.Var) and v in member]
            out = eqn.outvars[0] if eqn.outvars else None
            shape = getattr(getattr(out, "aval", None), "shape", None)
            if name in SHAPE_KEEPING and shape:
                for v in [*ins, *(o for o in eqn.outvars[1:] if isinstance(o, core.Var))]:
                    if v.aval.shape == shape:
                        join((ctx, v), (ctx, out))
                    else:
                        opened.append((ctx, v))  # a scalar or broadcast operand: read otherwise
            elif name in CALLS:
                inner, inside = call_jaxpr(eqn)[0], (*ctx, id(eqn))
                pairs = _call_pairs(eqn, inner)
                entering = set()
                for a, b in pairs[: len(inner.invars) if pairs else 0]:
                    if isinstance(a, core.Var) and a in member:
                        entering.add(b)
                        join((ctx, a), (inside, b))
                for a, b in pairs[len(inner.invars) if pairs else 0 :]:
                    if isinstance(a, core.Var) and isinstance(b, core.Var):
                        join((ctx, a), (inside, b))
                walk(inner, inside, entering)
            elif name in _MOVES and len(ins) == 1 and len(eqn.outvars) == 1 and _size(ins[0]) == _size(out):
                join((ctx, ins[0]), (ctx, out))  # moves no element (a unit axis, a transpose): one family
            else:
                if name not in _WHOLE_REDUCTIONS:
                    opened.extend((ctx, v) for v in ins)
                inside = (*ctx, id(eqn)) if name in REMATS or name in LOOPS else ctx  # as the partitioner names them
                for sub in sub_jaxprs(eqn):  # a body of its own, read as the partitioner runs it
                    walk(sub, inside, set())

    walk(jaxpr, (), set())
    roots = {find(k) for k in opened}

    def is_update_only(var, ctx: tuple = ()) -> bool:
        return (ctx, var) in computed and find((ctx, var)) not in roots

    return is_update_only
