"""``podscale.verify``: a user's own step, under every strategy the mesh allows, against one device.

The specification is the single-device step on the whole global batch. :func:`verify` runs ``steps``
steps of it on one device, then the same steps under each strategy (each weight update, the 2-D sum
and data x FSDP on two data axes, spatial and tensor partitioning, the compositions the mesh
allows), and compares every state leaf and metric after every step.

What "equal" means is measured, not assumed. The **noise floor** of a leaf is how far one device's
own result moves under rounding-level changes of its inputs: :data:`RUNS` more single-device runs,
each with every nonzero float element of the batch moved by one unit in the last place, all of a
leaf the same way (up or down at random per leaf, so equal elements stay equal and the order is
kept: a tie in a max-pool over equal pixels stays a tie, as under any strategy). A batch without
floats (token ids) has the state's float leaves moved so instead, once, before the first step, by
an ulp of the precision the step's matrix products take (bfloat16 under the workloads' policy: a
float32 ulp would be lost in the cast, and the floor would miss the roundings a strategy moves). The
rows stay where they are, so a row's dropout mask, its random draws, its place in a scan and its
weight by position are the specification's: only the roundings change, and with them the low bits
of every sum, which is all a strategy changes. (Moving the state for a batch with floats would
re-round every row's own arithmetic too, which no strategy changes: on the built-in ``cnn`` that
flips the sign of a gradient that is zero up to rounding, 1e-2 where strategies are within 1e-5.)
At step ``s`` a leaf's floor is its worst relative error over those runs against the
specification, and never below :data:`ULPS` units in the last place of its dtype (an exactly-zero
floor, a step whose sums are exact, still admits roundoff).

A strategy **passes** when every leaf at every step is within :data:`MULTIPLE` times its floor; it
**fails** (it *leaves the floor*) at the first step and leaf beyond that. Where a leaf's floor is
beyond :data:`MAX_FLOOR` (one device's step moves that far when its inputs move by an ulp: a
discontinuous or chaotic step, or a leaf decided by rounding noise), there is no honest floor for
that leaf: a strategy that differs there by more than ``MULTIPLE`` x ``ULPS`` ulps is **not judged**
(``outcome == "cannot judge"``), never passed.

A leaf's relative error is ``max |x - y| / max(max |y|, SCALE_FLOOR)`` (``y`` the specification's;
a leaf near zero compares absolutely), PRNG keys by their key data, integer leaves exactly.

Dropout and batch norm are the single device's (podscale's definition): each replica draws its rows
of the one-device mask, and statistics are over the whole batch."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from podscale.parallel import checks
from podscale.parallel.engine import data_parallel
from podscale.parallel.program import path_str, trace_global
from podscale.parallel.strategy import WEIGHT_UPDATES, Strategy
from podscale.parallel.tensor import path_name

MULTIPLE = 10.0
"""A strategy passes while every leaf is within this many times its noise floor (the contract
suite holds lbfgs, the touchiest optimizer, to 4 times one device's own distance; 10 leaves room
for the longer runs of a user's step while a real error, a gradient off by a factor, is orders of
magnitude beyond)."""
ULPS = 8
"""The floor is never below this many units in the last place of a leaf's dtype (float32: 9.5e-7)."""
SCALE_FLOOR = 1e-3
"""A leaf whose largest magnitude is below this compares absolutely (a bias still near zero)."""
RUNS = 3
"""Single-device runs with their batch (or state) moved by an ulp that measure the floor."""
MAX_FLOOR = 1e-2
"""A leaf whose floor is wider than this relative error has no honest floor (within ten times it
a gradient off by a tenth would pass): a strategy beyond ``ULPS`` x ``MULTIPLE`` ulps there is not judged."""
EXIT_CANNOT_JUDGE = 4
"""``podscale verify``'s exit code when no strategy failed but one could not be judged (0: every strategy
passed, 1: one failed, 2: a bad input)."""
_FLOATS = tuple(np.dtype(t) for t in (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64))


@dataclasses.dataclass(frozen=True)
class StrategyResult:
    """One strategy against the specification."""

    name: str
    strategy: str
    applies: bool = True
    reason: str = ""
    """Why it does not apply (the refusal of ``data_parallel``), or the error it ran into."""
    error: float = 0.0
    """The worst judged leaf's relative error against the specification, over every step."""
    leaf: str = ""
    step: int = 0
    ratio: float = 0.0
    """``error`` over that leaf's noise floor at that step."""
    left_floor: dict[str, Any] | None = None
    """The first step and leaf beyond ``MULTIPLE`` times its floor: ``{"step", "leaf", "error", "floor"}``."""
    unjudged: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Leaves whose floor is beyond ``MAX_FLOOR`` it differs on, first step each: ``{"step", "leaf", "error", "floor"}``."""
    whole_ops: list[str] = dataclasses.field(default_factory=list)
    gathered_ops: list[str] = dataclasses.field(default_factory=list)

    @property
    def outcome(self) -> str:
        """``"pass"``, ``"fail"``, ``"cannot judge"`` or ``"does not apply"``."""
        if not self.applies:
            return "does not apply"
        if self.reason or self.left_floor is not None:
            return "fail"
        return "cannot judge" if self.unjudged else "pass"

    @property
    def passed(self) -> bool:
        """Passed, or (only among the default strategies) does not apply on this mesh."""
        return self.outcome in ("pass", "does not apply")


@dataclasses.dataclass(frozen=True)
class Verification:
    """What :func:`verify` found: the floors and a :class:`StrategyResult` per strategy."""

    steps: int
    floor: list[float]
    """Per step: the widest judged leaf floor (at least ``ULPS`` ulps of its dtype)."""
    floor_leaf: list[str]
    results: list[StrategyResult]
    leaf_floors: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    """Per leaf, per step: how far one device's result moved over the ``RUNS`` runs (before the ulps)."""
    no_floor: list[str] = dataclasses.field(default_factory=list)
    """Leaves whose floor is beyond ``MAX_FLOOR`` at some step: not judged beyond ``ULPS`` x ``MULTIPLE`` ulps."""
    multiple: float = MULTIPLE
    ulps: int = ULPS
    runs: int = RUNS
    max_floor: float = MAX_FLOOR

    @property
    def outcome(self) -> str:
        """``"passed"``, ``"failed"`` (a strategy failed) or ``"cannot judge"`` (none failed, one
        could not be judged: a floor too wide to mean anything)."""
        ran = [r.outcome for r in self.results if r.applies]
        return "failed" if "fail" in ran else "cannot judge" if "cannot judge" in ran else "passed"

    @property
    def passed(self) -> bool:
        return self.outcome == "passed"

    @property
    def failed(self) -> list[str]:
        return [r.name for r in self.results if r.outcome == "fail"]

    @property
    def not_judged(self) -> list[str]:
        return [r.name for r in self.results if r.outcome == "cannot judge"]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for r, out in zip(self.results, d["results"], strict=True):
            out["passed"], out["outcome"] = r.passed, r.outcome
        return {
            **d,
            "outcome": self.outcome,
            "passed": self.passed,
            "failed": self.failed,
            "not_judged": self.not_judged,
        }

    def lines(self) -> list[str]:
        """What ``podscale verify`` prints: the floor, then a line or more per strategy, then the verdict."""
        out = [
            f"noise floor (one device, its batch's floats, or its state's, moved by an ulp, {self.runs} runs), "
            "the widest leaf's per step: "
            + ", ".join(f"{f:.2e}" for f in self.floor)
            + (f" ({self.floor_leaf[-1]})" if self.floor_leaf and self.floor_leaf[-1] else "")
            + f"; a strategy passes within {self.multiple:g}x each leaf's floor (never below {self.ulps} ulps of "
            "its dtype)"
        ]
        if self.no_floor:
            out.append(
                f"  no floor (one device moves beyond {self.max_floor:g} when its inputs move by an ulp; "
                f"judged only to {self.multiple:g} x {self.ulps} ulps): {', '.join(self.no_floor)}"
            )
        for r in self.results:
            if not r.applies:
                out.append(f"  {r.name:<24} does not apply: {r.reason}")
                continue
            if r.reason:
                out.append(f"  {r.name:<24} FAIL  {r.reason}")
                continue
            verdict = {"pass": "PASS", "fail": "FAIL", "cannot judge": "CANNOT JUDGE"}[r.outcome]
            worst = (
                f"worst {r.error:.2e} at step {r.step} {r.leaf} ({r.ratio:.3g}x its floor)"
                if r.leaf
                else "no leaf with a floor"
            )
            out.append(f"  {r.name:<24} {verdict}  {worst}")
            if r.left_floor:
                lf = r.left_floor
                out.append(
                    f"  {'':<24}       left the floor at step {lf['step']}, {lf['leaf']}: {lf['error']:.2e} "
                    f"> {self.multiple:g} x {lf['floor']:.2e}"
                )
            for u in r.unjudged:
                out.append(
                    f"  {'':<24}       cannot judge {u['leaf']}: {u['error']:.2e} at step {u['step']}, where one "
                    f"device's own floor is {u['floor']:.2e}"
                )
            ops = [f"whole: {o}" for o in r.whole_ops] + [f"gathered: {o}" for o in r.gathered_ops]
            out.append(f"  {'':<24}       ops on gathered values: {', '.join(ops) if ops else 'none'}")
        if self.outcome == "passed":
            verdict = "every strategy within the floor"
        elif self.outcome == "failed":
            verdict = "FAILED: " + ", ".join(self.failed)
            if self.not_judged:
                verdict += "; cannot judge: " + ", ".join(self.not_judged)
        else:
            verdict = (
                "CANNOT JUDGE: " + ", ".join(self.not_judged) + f" (they differ where one device's own step moves "
                f"beyond {self.max_floor:g} when its inputs move by an ulp, so no floor says whether they are "
                "right: sums rounded to 16 bits, a discontinuity, or a leaf decided by rounding noise)"
            )
        out.append("verify: " + verdict)
        return out


def strategies_for(mesh, rules=None) -> dict[str, Strategy]:
    """The strategies to check on ``mesh``, by name: each weight update, with the 2-D sum where two
    data axes of at least 2 devices remain, over no partition axis, the last axis as the space axis
    (spatial partitioning; refused, so not applying, for a step without images) and, with ``rules``,
    as the model axis, with three axes or more the last two as space and model; data x FSDP
    (``data-x-fsdp``: chunks over the last data axis, copies over the others) on 2+ data axes."""
    _check_mesh(mesh)
    names, shape = tuple(mesh.axis_names), dict(mesh.shape)
    parts: list[tuple[str, dict, tuple[str, ...]]] = [("", {}, ())]
    if len(names) >= 2 and shape[names[-1]] > 1:
        parts.append(("spatial", {"space_axis": names[-1]}, names[-1:]))
        if rules is not None:
            parts.append(("model", {"model_axis": names[-1], "rules": rules}, names[-1:]))
    if len(names) >= 3 and rules is not None and shape[names[-2]] > 1 and shape[names[-1]] > 1:
        parts.append(("spatial+model", {"space_axis": names[-2], "model_axis": names[-1], "rules": rules}, names[-2:]))
    out = {}
    for part, fields, taken in parts:
        data = [a for a in names if a not in taken]
        sums = ["1d"] + (["2d"] if len(data) == 2 and all(shape[a] > 1 for a in data) else [])
        for update in WEIGHT_UPDATES:
            for grad_sum in sums:
                name = "+".join(x for x in (update, "2d" if grad_sum == "2d" else "", part) if x)
                out[name] = Strategy(weight_update=update, grad_sum=grad_sum, **fields)
        if not taken and len(data) >= 2 and all(shape[a] > 1 for a in data):
            out["data-x-fsdp"] = Strategy(weight_update="fsdp", fsdp_axes=tuple(data[-1:]))
    return out


def verify(
    step,
    state,
    batch,
    mesh,
    strategies: Mapping[str, Strategy] | Sequence[Strategy] | None = None,
    steps: int = 3,
    *,
    rules=None,
    seed: int = 0,
) -> Verification:
    """Runs ``steps`` steps of ``step(state, batch) -> (state, metrics)`` on one device (the
    specification), :data:`RUNS` times more with its batch's floats moved by an ulp (or, for a batch
    of token ids, its state's; the noise floor), and under each strategy on ``mesh``, all from ``state`` on the same global
    ``batch`` each step; compares every state leaf and metric after every step (see the module).

    ``strategies``: a dict of name -> :class:`~podscale.Strategy`, a list of them (named by their
    fields), or ``None`` for every one :func:`strategies_for` lists (``rules``: sharding rules, a
    :class:`~podscale.parallel.tensor.Rules` or a built-in's name, for tensor partitioning); of
    those, one that does not apply on ``mesh`` is reported as such. Strategies given must each
    apply: one that does not is refused (``ValueError``), as is an empty list, before any step
    runs. ``seed`` picks the ulps moved. Returns a :class:`Verification`: ``.outcome`` is
    ``"passed"``, ``"failed"`` or ``"cannot judge"`` (a floor too wide to mean anything), and
    ``.passed`` is true for the first only."""
    steps = checks.whole("steps", steps, what=" (steps compared)")
    seed = checks.whole("seed", seed, at_least=0, what=" (it picks the ulps moved for the floor)")
    return run(check(step, state, batch, mesh, strategies, rules=rules), steps, seed=seed)


@dataclasses.dataclass(frozen=True)
class Checked:
    """A verification checked and prepared, not yet run (:func:`check`; :func:`run` runs it)."""

    step: Any
    state: Any
    batch: Any
    mesh: Mesh
    prepared: dict[str, tuple[Strategy, Any]]
    """Per name: the strategy and its prepared step, or the reason it does not apply."""

    @property
    def names(self) -> list[str]:
        return list(self.prepared)


def run(checked: Checked, steps: int = 3, *, seed: int = 0) -> Verification:
    """Runs a :class:`Checked` verification (see :func:`verify`)."""
    steps = checks.whole("steps", steps, what=" (steps compared)")
    seed = checks.whole("seed", seed, at_least=0, what=" (it picks the ulps moved for the floor)")
    state, batch = jax.device_get(checked.state), jax.device_get(checked.batch)
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves((state, batch))):
        raise TypeError("state and batch: give arrays to run a verification (shapes only check it)")
    jstep = jax.jit(checked.step)
    spec = _single(jstep, state, batch, steps)
    rng = np.random.default_rng(seed)
    narrow = None if _floats(batch) else _compute_dtype(checked.step, state, batch)
    moved = [_single(jstep, state, batch, steps, rng, narrow) for _ in range(RUNS)]
    spread: dict[str, list[float]] = {}
    ulp: dict[str, float] = {}
    for one in moved:
        for s, (ref, got) in enumerate(zip(spec, one, strict=True)):
            for leaf, err, u in _errors(got, ref):
                row = spread.setdefault(leaf, [0.0] * steps)
                row[s] = max(row[s], err)
                ulp[leaf] = u
    floors, floor_leaves = [], []
    for s in range(steps):
        judged = [(max(f[s], ulp[leaf]), leaf) for leaf, f in spread.items() if f[s] <= MAX_FLOOR]
        worst, leaf = max(judged, default=(0.0, ""))
        floors.append(worst)
        floor_leaves.append(leaf)
    no_floor = [leaf for leaf, f in spread.items() if not all(x <= MAX_FLOOR for x in f)]
    results = [
        _check(name, st, dp, state, batch, steps, spec, spread, ulp) for name, (st, dp) in checked.prepared.items()
    ]
    return Verification(steps, floors, floor_leaves, results, leaf_floors=spread, no_floor=no_floor)


def check(step, state, batch, mesh, strategies=None, *, rules=None, what: str = "strategies") -> Checked:
    """Every check :func:`verify` makes before it runs a step (arrays or ``jax.ShapeDtypeStruct``
    for ``state`` and ``batch``): the arguments' types, a batch with rows, a step without
    collectives, and each strategy's placement (traced, nothing compiled). Returns a
    :class:`Checked` for :func:`run`; raises ``TypeError`` or ``ValueError`` naming the argument (``what``
    names the strategies in messages: the command line's ``--strategies``)."""
    if not callable(step):
        raise TypeError(f"step={step!r} is {checks.described(step)}; give the function step(state, batch)")
    _check_mesh(mesh)
    named = _named(strategies, mesh, rules, what)
    _check_batch(batch)
    trace_global(step, state, batch)  # a step calling lax.pmean/psum: data_parallel's refusal, named
    prepared: dict[str, tuple] = {}
    for name, strategy in named.items():
        try:
            dp = data_parallel(step, mesh, strategy)
            dp.prepare(state, batch)
        except (ValueError, TypeError, NotImplementedError) as e:  # refused before any work: not this step's
            prepared[name] = (strategy, str(e).split("\n")[0])
            continue
        prepared[name] = (strategy, dp)
    refused = {name: dp for name, (_, dp) in prepared.items() if isinstance(dp, str)}
    if strategies is not None and refused:
        name, reason = next(iter(refused.items()))
        raise ValueError(
            f"{what}: {name} does not apply to this step on mesh {dict(mesh.shape)} ({reason}); "
            "drop it, or check it on a mesh and a step where it applies"
        )
    if len(refused) == len(prepared):
        why = "; ".join(f"{n}: {r}" for n, r in refused.items())
        raise ValueError(
            f"no strategy applies to this step on mesh {dict(mesh.shape)}, so nothing can be checked: {why}"
        )
    return Checked(step, state, batch, mesh, prepared)


def _check_mesh(mesh) -> None:
    if not isinstance(mesh, Mesh):
        example = (
            f"podscale.make_mesh({tuple(mesh)!r})" if isinstance(mesh, tuple | list) else "podscale.make_mesh((4, 2))"
        )
        raise TypeError(f"mesh={mesh!r} is {checks.described(mesh)}; give a jax.sharding.Mesh, e.g. {example}")


def _named(strategies, mesh, rules, what: str) -> dict[str, Strategy]:
    """``strategies`` as ``{name: Strategy}``: a dict, a list or tuple (named by their fields), or
    ``None`` for :func:`strategies_for`; none empty, unnamed or twice."""
    if strategies is None:
        return strategies_for(mesh, rules)
    if rules is not None:
        raise ValueError(
            f"rules={rules!r} with {what} given: rules make the default strategies' model axis; give each "
            "Strategy its own (Strategy(model_axis=..., rules=...)), or leave the strategies out"
        )
    example = "[podscale.Strategy(weight_update='sharded')] or {'sharded': podscale.Strategy(weight_update='sharded')}"
    if isinstance(strategies, Mapping):
        items = list(strategies.items())
        for name, s in items:
            if not isinstance(name, str) or not name:
                raise TypeError(
                    f"{what}: the name {name!r} is {checks.described(name)}; name each strategy by a non-empty str"
                )
            if not isinstance(s, Strategy):
                raise TypeError(
                    f"{what}[{name!r}]={s!r} is {checks.described(s)}; give a podscale.Strategy, e.g. {example}"
                )
    elif isinstance(strategies, list | tuple):
        for i, s in enumerate(strategies):
            if not isinstance(s, Strategy):
                raise TypeError(f"{what}[{i}]={s!r} is {checks.described(s)}; give a podscale.Strategy, e.g. {example}")
        items = [(_describe(s), s) for s in strategies]
        twice = sorted({n for n, _ in items if [m for m, _ in items].count(n) > 1})
        if twice:
            raise ValueError(f"{what}: {', '.join(twice)} given twice; give each strategy once")
    else:
        raise TypeError(
            f"{what}={strategies!r} is {checks.described(strategies)}; give None (every strategy the mesh allows), "
            f"a list of podscale.Strategy or a dict of name -> Strategy, e.g. {example}"
        )
    if not items:
        raise ValueError(
            f"{what}: no strategy given, so nothing would be checked; give at least one, or None for every one "
            f"the mesh allows ({', '.join(strategies_for(mesh, rules))})"
        )
    return dict(items)


def _check_batch(batch) -> None:
    """One global batch: at least one leaf, each an array with a leading batch dimension of the same
    size, at least 1."""
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    if not leaves:
        raise ValueError(f"batch={batch!r} has no arrays; give the global batch, each leaf with one row per example")
    first = None
    for path, x in leaves:
        shape = np.shape(x)
        if not shape:
            raise ValueError(
                f"batch{path_str(path)} is a scalar; every batch leaf needs a leading batch dimension (one row per "
                "example): pass per-batch constants in the state"
            )
        if shape[0] == 0:
            raise ValueError(f"batch{path_str(path)} has no rows (shape {list(shape)}); give at least one example")
        if first is None:
            first = (path, shape)
        elif shape[0] != first[1][0]:
            raise ValueError(
                f"batch{path_str(path)} has {shape[0]} rows (shape {list(shape)}) but batch{path_str(first[0])} has "
                f"{first[1][0]}: every batch leaf needs the same leading batch size; give one global batch"
            )


def _describe(strategy: Strategy) -> str:
    default = Strategy()
    changed = [
        f"{f.name}={getattr(strategy, f.name)!r}"
        for f in dataclasses.fields(Strategy)
        if getattr(strategy, f.name) != getattr(default, f.name)
    ]
    return ", ".join(changed) or "replicated"


def _nudge(tree, rng: np.random.Generator):
    """Every nonzero float element of ``tree`` (on the host) one unit in the last place up, or every
    one down, at random per leaf: all move the same way, so equal elements stay equal and the order
    is kept (a tie in a max-pool over equal pixels stays a tie, as under any strategy), while every
    product and sum rounds anew."""

    def one(x):
        x = np.asarray(x) if isinstance(x, np.ndarray | np.generic) else x
        if not isinstance(x, np.ndarray | np.generic) or x.dtype not in _FLOATS:
            return x  # an integer, a bool, a PRNG key
        moved = np.nextafter(x, np.array(np.inf if rng.random() < 0.5 else -np.inf, x.dtype))
        return np.where(x == 0, x, moved)

    return jax.tree.map(one, tree)


def _compute_dtype(step, state, batch):
    """The narrowest float type the step's matrix products and convolutions take (bfloat16 for
    the workloads' precision policy), or ``None`` when they compute in the state's float32."""
    from podscale.parallel.interpret import sub_jaxprs

    def widths(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
                yield from (np.dtype(v.aval.dtype) for v in eqn.invars if jnp.issubdtype(v.aval.dtype, jnp.floating))
            for sub in sub_jaxprs(eqn):
                yield from widths(sub)

    narrow = [d for d in widths(jax.make_jaxpr(step)(state, batch).jaxpr) if d.itemsize < 4]
    return min(narrow, key=lambda d: d.itemsize) if narrow else None


def _nudge_at(tree, rng: np.random.Generator, dtype):
    """:func:`_nudge` for a state the step computes with in ``dtype`` (its float32 leaves cast to
    bfloat16 at each use): each float32 element moved by one unit in the last place of ``dtype``,
    so the roundings of the products move (a float32 ulp is lost in the cast)."""
    bits = np.finfo(dtype).nmant  # explicit significand bits: 7 for bfloat16, 10 for float16

    def one(x):
        x = np.asarray(x) if isinstance(x, np.ndarray | np.generic) else x
        if not isinstance(x, np.ndarray | np.generic) or x.dtype != np.float32:
            return x
        up = rng.random() < 0.5
        with np.errstate(divide="ignore", invalid="ignore"):  # a zero's ulp is unused (kept zero below)
            ulp = np.ldexp(np.float32(1.0), (np.floor(np.log2(np.abs(x))) - bits).astype(np.int32))
        return np.where(x == 0, x, x + (ulp if up else -ulp)).astype(np.float32)

    return jax.tree.map(one, tree)


def _floats(tree) -> bool:
    return any(isinstance(x, np.ndarray | np.generic) and x.dtype in _FLOATS for x in jax.tree.leaves(tree))


def _single(jstep, state, batch, steps: int, rng=None, narrow=None) -> list[tuple[Any, Any]]:
    """The plain step, jitted on one device: the (state, metrics) after each step, on the host.
    With ``rng``, the batch's floats are moved by an ulp (:func:`_nudge`), or where the batch has
    none (token ids), the state's floats before the first step (by an ulp of ``narrow``, the
    precision the products take, where given: :func:`_nudge_at`)."""
    device = jax.devices()[0]
    if rng is not None:
        if _floats(batch):
            batch = _nudge(batch, rng)
        elif narrow is not None:
            state = _nudge_at(state, rng, narrow)
        else:
            state = _nudge(state, rng)
    placed = jax.device_put(batch, device)
    current = state
    out = []
    for _ in range(steps):
        current, metrics = jstep(jax.device_put(current, device), placed)
        current, metrics = jax.device_get((current, metrics))
        out.append((current, metrics))
    return out


def _plain(x):
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(x)
    return x


def _ulp_floor(dtype) -> float:
    return ULPS * float(np.finfo(dtype).eps) if np.issubdtype(dtype, np.inexact) else 0.0


def _errors(got, ref):
    """Per leaf of ``(state, metrics)``: its path, relative error against ``ref``, and its floor in ulps."""
    got, ref = jax.tree.map(_plain, got), jax.tree.map(_plain, ref)
    got_leaves = jax.tree.leaves(got)
    for (path, y), x in zip(jax.tree_util.tree_leaves_with_path(ref), got_leaves, strict=True):
        y64, x64 = np.asarray(y, np.float64), np.asarray(x, np.float64)
        if y64.shape != x64.shape:
            yield _name(path), math.inf, 0.0
            continue
        if not y64.size:
            continue
        diff = float(np.max(np.abs(x64 - y64)))
        if np.isnan(diff):
            diff = (
                0.0
                if np.array_equal(np.isnan(x64), np.isnan(y64)) and np.allclose(x64, y64, equal_nan=True)
                else math.inf
            )
        scale = max(float(np.max(np.abs(y64))), SCALE_FLOOR)
        yield _name(path), diff / scale, _ulp_floor(np.asarray(y).dtype)


def _name(path) -> str:
    head, *rest = path  # (state, metrics)
    return ("state" if head.idx == 0 else "metrics") + ("/" + path_name(rest) if rest else "")


def _check(name, strategy, dp, state, batch, steps, spec, spread, ulp) -> StrategyResult:
    described = _describe(strategy)
    if isinstance(dp, str):  # does not apply (among the default strategies only)
        return StrategyResult(name, described, applies=False, reason=dp)
    worst = (0.0, "", 0, 0.0)  # error, leaf, step, ratio
    left = None
    unjudged: dict[str, dict[str, Any]] = {}
    try:
        placed = dp.place_state(state, batch)
        for s in range(steps):
            placed, metrics = dp(placed, batch)
            got = (dp.gather_state(placed), jax.device_get(metrics))
            for leaf, err, ulps in _errors(got, spec[s]):
                measured = spread.get(leaf, [0.0] * steps)[s]
                floor = max(measured, ulps)
                if not measured <= MAX_FLOOR:  # no honest floor: judged only to the ulps
                    if err > MULTIPLE * ulps and leaf not in unjudged:
                        unjudged[leaf] = {"step": s + 1, "leaf": leaf, "error": err, "floor": measured}
                    continue
                ratio = err / floor if floor else (0.0 if err == 0 else math.inf)
                if ratio > worst[3] or (worst[1] == "" and err >= worst[0]):
                    worst = (err, leaf, s + 1, ratio)
                if left is None and ratio > MULTIPLE:
                    left = {"step": s + 1, "leaf": leaf, "error": err, "floor": floor}
        plan = dp.plan()
    except Exception as e:  # noqa: BLE001  (a strategy that fails while running fails verification, named)
        return StrategyResult(name, described, reason=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return StrategyResult(
        name,
        described,
        error=worst[0],
        leaf=worst[1],
        step=worst[2],
        ratio=worst[3],
        left_floor=left,
        unjudged=list(unjudged.values()),
        whole_ops=list(plan.whole_ops),
        gathered_ops=list(plan.gathered_ops),
    )
