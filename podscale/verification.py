"""``podscale.verify``: a user's own step, under every strategy the mesh allows, against one device.

The specification is the single-device step on the whole global batch. :func:`verify` runs ``steps``
steps of it on one device, then the same steps under each strategy (replicated and sharded update,
the 2-D sum on two data axes, spatial partitioning, tensor partitioning with sharding rules, and the
compositions the mesh allows), and compares every state leaf and metric after every step.

What "equal" means is measured, not assumed: the **noise floor** is the single-device step with the
batch's rows permuted, which changes the summation order only. At step ``s`` the floor is the worst
relative error of that run against the specification over every leaf, and never below
:data:`ULPS` units in the last place of a leaf's dtype (an exactly-zero floor, a step whose sums
are exact, still admits roundoff). A strategy **passes** when every leaf at every step is within
:data:`MULTIPLE` times the floor; it **leaves the floor** at the first step and leaf beyond that.

A leaf's relative error is ``max |x - y| / max(max |y|, SCALE_FLOOR)`` (``y`` the specification's;
a leaf near zero compares absolutely), PRNG keys by their key data, integer leaves exactly.

Dropout and batch norm are the single device's (podscale's definition): each replica draws its
rows of the one-device mask, and statistics are over the whole batch. A permuted batch moves a
row's mask with it, so for a step with dropout the floor is wider than summation order alone.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from podscale.parallel.engine import data_parallel
from podscale.parallel.strategy import Strategy
from podscale.parallel.tensor import path_name

MULTIPLE = 10.0
"""A strategy passes while every leaf is within this many times the noise floor (the contract
suite holds lbfgs, the touchiest optimizer, to 4 times it; 10 leaves room for the longer runs of a
user's step while a real error, a gradient off by a factor, is orders of magnitude beyond)."""
ULPS = 8
"""The floor is never below this many units in the last place of a leaf's dtype (float32: 9.5e-7)."""
SCALE_FLOOR = 1e-3
"""A leaf whose largest magnitude is below this compares absolutely (a bias still near zero)."""


@dataclasses.dataclass(frozen=True)
class StrategyResult:
    """One strategy against the specification."""

    name: str
    strategy: str
    applies: bool = True
    reason: str = ""
    """Why it does not apply (the refusal of ``data_parallel``), or the error it ran into."""
    error: float = 0.0
    """The worst leaf's relative error against the specification, over every step."""
    leaf: str = ""
    step: int = 0
    ratio: float = 0.0
    """``error`` over that step's noise floor."""
    left_floor: dict[str, Any] | None = None
    """The first step and leaf beyond ``MULTIPLE`` times the floor: ``{"step", "leaf", "error", "floor"}``."""
    whole_ops: list[str] = dataclasses.field(default_factory=list)
    gathered_ops: list[str] = dataclasses.field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.applies or (self.left_floor is None and not self.reason)


@dataclasses.dataclass(frozen=True)
class Verification:
    """What :func:`verify` found: the floor per step and a :class:`StrategyResult` per strategy."""

    steps: int
    floor: list[float]
    """Per step: the permuted batch's worst relative error against the specification."""
    floor_leaf: list[str]
    results: list[StrategyResult]
    multiple: float = MULTIPLE
    ulps: int = ULPS

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    @property
    def failed(self) -> list[str]:
        return [r.name for r in self.results if not r.passed]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for r, out in zip(self.results, d["results"], strict=True):
            out["passed"] = r.passed
        return {**d, "passed": self.passed, "failed": self.failed}

    def lines(self) -> list[str]:
        """What ``podscale verify`` prints: the floor, then a line or more per strategy."""
        out = [
            "noise floor (one device, the batch's rows permuted), per step: "
            + ", ".join(f"{f:.2e}" for f in self.floor)
            + f"; a strategy passes within {self.multiple:g}x the floor (never below {self.ulps} ulps of a leaf's dtype)"
        ]
        for r in self.results:
            if not r.applies:
                out.append(f"  {r.name:<24} does not apply: {r.reason}")
                continue
            verdict = "PASS" if r.passed else "FAIL"
            if r.reason:
                out.append(f"  {r.name:<24} FAIL  {r.reason}")
                continue
            out.append(
                f"  {r.name:<24} {verdict}  worst {r.error:.2e} at step {r.step} {r.leaf} ({r.ratio:.3g}x the floor)"
            )
            if r.left_floor:
                lf = r.left_floor
                out.append(
                    f"  {'':<24}       left the floor at step {lf['step']}, {lf['leaf']}: {lf['error']:.2e} "
                    f"> {self.multiple:g} x {lf['floor']:.2e}"
                )
            ops = [f"whole: {o}" for o in r.whole_ops] + [f"gathered: {o}" for o in r.gathered_ops]
            out.append(f"  {'':<24}       ops on gathered values: {', '.join(ops) if ops else 'none'}")
        out.append(
            "verify: " + ("every strategy within the floor" if self.passed else "FAILED: " + ", ".join(self.failed))
        )
        return out


def strategies_for(mesh, rules=None) -> dict[str, Strategy]:
    """The strategies to check on ``mesh``, by name: both weight updates, with the 2-D sum where two
    data axes of at least 2 devices remain, over no partition axis, the last axis as the space axis
    (spatial partitioning; refused, and so reported as not applying, for a step without images) and,
    with ``rules``, as the model axis, and with three axes or more the last two as space and model."""
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
        for update in ("replicated", "sharded"):
            for grad_sum in sums:
                name = "+".join(x for x in (update, "2d" if grad_sum == "2d" else "", part) if x)
                out[name] = Strategy(weight_update=update, grad_sum=grad_sum, **fields)
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
    specification), with the batch's rows permuted (the noise floor), and under each strategy on
    ``mesh``, all from ``state`` on the same global ``batch`` each step; compares every state leaf
    and metric after every step (see the module).

    ``strategies``: a dict of name -> :class:`~podscale.Strategy`, a list of them (named by their
    fields), or ``None`` for every one :func:`strategies_for` lists (``rules``: sharding rules, a
    :class:`~podscale.parallel.tensor.Rules` or a built-in's name, for tensor partitioning). ``seed``
    picks the permutation. Returns a :class:`Verification`; ``.passed`` is the verdict."""
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps={steps!r}: give a whole number of steps, at least 1")
    if strategies is None:
        strategies = strategies_for(mesh, rules)
    elif not isinstance(strategies, Mapping):
        strategies = {_describe(s): s for s in strategies}
    state, batch = jax.device_get(state), jax.device_get(batch)
    rows = {x.shape[0] for x in jax.tree.leaves(batch) if np.ndim(x)}
    if len(rows) != 1:
        raise ValueError(f"the batch's leaves have different leading sizes {sorted(rows)}: give one global batch")
    (n,) = rows
    perm = np.random.default_rng(seed).permutation(n)
    inverse = np.argsort(perm)

    spec = _single(step, state, batch, steps)
    permuted = _single(step, state, jax.tree.map(lambda x: np.asarray(x)[perm] if np.ndim(x) else x, batch), steps)
    permuted = [(s, jax.tree.map(lambda x: _unpermute(x, n, inverse), m)) for s, m in permuted]
    floors, floor_leaves = [], []
    for ref, got in zip(spec, permuted, strict=True):
        worst, leaf = max(((e, p) for p, e, _ in _errors(got, ref)), default=(0.0, ""))
        floors.append(worst)
        floor_leaves.append(leaf)

    results = [_check(name, st, step, state, batch, mesh, steps, spec, floors) for name, st in strategies.items()]
    return Verification(steps, floors, floor_leaves, results)


def _describe(strategy: Strategy) -> str:
    default = Strategy()
    changed = [
        f"{f.name}={getattr(strategy, f.name)!r}"
        for f in dataclasses.fields(Strategy)
        if getattr(strategy, f.name) != getattr(default, f.name)
    ]
    return ", ".join(changed) or "replicated"


def _unpermute(x, n: int, inverse):
    """A per-example metric of the permuted run, back in the batch's row order."""
    x = np.asarray(x)
    return x[inverse] if x.ndim and x.shape[0] == n else x


def _single(step, state, batch, steps: int) -> list[tuple[Any, Any]]:
    """The plain step, jitted on one device: the (state, metrics) after each step, on the host."""
    device = jax.devices()[0]
    jstep = jax.jit(step)
    current = jax.device_put(state, device)
    placed = jax.device_put(batch, device)
    out = []
    for _ in range(steps):
        current, metrics = jstep(current, placed)
        out.append(jax.device_get((current, metrics)))
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


def _check(name, strategy, step, state, batch, mesh, steps, spec, floors) -> StrategyResult:
    described = _describe(strategy)
    try:
        dp = data_parallel(step, mesh, strategy)
        dp.prepare(state, batch)
    except (ValueError, TypeError, NotImplementedError) as e:  # refused before any work: not this step's
        return StrategyResult(name, described, applies=False, reason=str(e).split("\n")[0])
    worst = (0.0, "", 0, 0.0)  # error, leaf, step, ratio
    left = None
    try:
        placed = dp.place_state(state, batch)
        for s in range(steps):
            placed, metrics = dp(placed, batch)
            got = (dp.gather_state(placed), jax.device_get(metrics))
            for leaf, err, ulps in _errors(got, spec[s]):
                floor = max(floors[s], ulps)
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
        whole_ops=list(plan.whole_ops),
        gathered_ops=list(plan.gathered_ops),
    )
