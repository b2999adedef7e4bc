"""Shared helpers for the tests: plain single-device reference runs."""

from __future__ import annotations

import os

import jax
import numpy as np

# conftest.py compiles without FMA unless PODSCALE_TEST_FMA=1; see there. With FMA contraction on,
# two programs computing the same float32 update may differ by an ulp or two.
FMA_OFF = "--xla_cpu_max_isa" in os.environ.get("XLA_FLAGS", "")
EXACT = 0.0 if FMA_OFF else 1e-7


def long_run_env() -> dict[str, str]:
    """The environment of a CLI run that trains for hundreds of steps (a time-to-target run): XLA's
    default emitters with LLVM at level 1, whose steps run about 3x faster than the suite's
    fast-compiling ones (conftest.py) and as fast as at the default level 2, which compiles longer
    (measured, tiny Mask R-CNN's run: 130 -> 114 s, the same metrics; transformer-big's: 61 s at
    both); the machine's whole ISA, FMA included, as a user's run has it (these runs compare no
    bits: measured, SSD then reaches its target at step 384 as docs/benchmarks.md's run does, in 97
    CPU-seconds where it took 110 to step 448 without FMA; BERT's 128 for 140); and a compilation
    cache of their own (the cache's key reads XLA_FLAGS)."""
    env = dict(os.environ)
    flags = env.pop("PODSCALE_TEST_LONG_RUN_XLA_FLAGS")
    env["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=1".strip()
    env["JAX_COMPILATION_CACHE_DIR"] = os.path.join(env["PODSCALE_TEST_XLA_CACHE"], "long-runs")
    return env


def _plain(x):
    """Typed PRNG keys compare by their key data."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(x)
    return x


def max_abs_diff(a, b) -> float:
    a, b = jax.tree.map(_plain, a), jax.tree.map(_plain, b)
    diffs = jax.tree.map(
        lambda x, y: float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)), initial=0.0)), a, b
    )
    return max(jax.tree.leaves(diffs), default=0.0)


def run_single(step, state, batches):
    """The plain step on one device, jitted, over ``batches``."""
    jstep = jax.jit(step)
    metrics = None
    for batch in batches:
        state, metrics = jstep(state, batch)
    return jax.device_get(state), jax.device_get(metrics)


def run_parallel(dp, state, batches):
    state = dp.place_state(jax.device_get(state), batches[0] if dp.layout is None else None)
    metrics = None
    for batch in batches:
        state, metrics = dp(state, batch)
    return dp.gather_state(state), jax.device_get(metrics)


def reordered_runs(step, state, batches, seeds=(0, 1)) -> list:
    """One device's final state on ``batches`` with each batch's rows permuted, per seed: the same
    computation in another summation order, for a step whose result does not depend on the rows'
    order (batch norm over the whole batch, per-row losses averaged). How far these land from the
    run on the batches as they are is the spec's own spread on this machine's kernels (XLA:CPU's
    dot and convolution libraries pick their blocking by the CPU, and so their summation order): a
    bound on podscale's difference, which changes the order too, is stated against it."""
    outs = []
    for seed in seeds:
        perm = np.random.default_rng(seed).permutation(len(jax.tree.leaves(batches[0])[0]))
        outs.append(run_single(step, state, [jax.tree.map(lambda x: np.asarray(x)[perm], b) for b in batches])[0])
    return outs


def relative_error(a, b, floor: float = 1e-3, norm: str = "max") -> float:
    """The suite's one relative error: over the leaves (PRNG keys by their key data), the largest
    ``|x - y| / |y|`` of a leaf, ``|.|`` the leaf's ``norm``:

    - ``"max"``: its largest magnitude, at least ``floor`` (a leaf near zero compares absolutely);
    - ``"2"``: its 2-norm, at least ``floor`` times the square root of its size (a leaf whose
      entries are roundoff, an attention key bias whose gradient is exactly zero, compares
      absolutely).

    ``b`` is the reference (one device's)."""
    worst = 0.0
    for x, y in zip(jax.tree.leaves(jax.tree.map(_plain, a)), jax.tree.leaves(jax.tree.map(_plain, b)), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        if not y.size:
            continue
        if norm == "max":
            diff, scale = float(np.max(np.abs(x - y))), max(float(np.max(np.abs(y))), floor)
        else:
            diff = float(np.linalg.norm(x - y))
            scale = max(float(np.linalg.norm(y)), floor * float(np.sqrt(y.size)))
        worst = max(worst, diff / scale)
    return worst


def max_relative_diff(a, b, floor: float = 1e-3) -> float:
    """:func:`relative_error` by each leaf's largest magnitude."""
    return relative_error(a, b, floor)


def leaf_relative_error(a, b, floor: float = 1e-3) -> float:
    """:func:`relative_error` by each leaf's 2-norm."""
    return relative_error(a, b, floor, norm="2")


def podscale_main(argv: list[str]) -> int:
    """``podscale ARGV`` in this process: the exit code the command would end with (argparse's
    refusals end in SystemExit, the others are main's return value)."""
    from podscale import cli

    try:
        return cli.main(argv)
    except SystemExit as exit_:
        return exit_.code


def two_layer(width: int, hidden, tx, seed: int = 0, scale: float = 0.3):
    """A regression step over two ``[width, width]`` weights ``w1``, ``w2`` (optax ``tx``; loss
    ``mean((hidden(x @ w1) @ w2 - y) ** 2)``) and its initial ``(params, opt_state)``."""
    import optax

    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {"w1": jax.random.normal(k1, (width, width)) * scale, "w2": jax.random.normal(k2, (width, width)) * scale}

    def step(state, batch):
        p, opt = state
        loss, g = jax.value_and_grad(lambda p: ((hidden(batch["x"] @ p["w1"]) @ p["w2"] - batch["y"]) ** 2).mean())(p)
        updates, opt = tx.update(g, opt, p)
        return (optax.apply_updates(p, updates), opt), {"loss": loss}

    return step, (params, tx.init(params))


def regression_batches(rows: int, width: int, count: int, seed: int = 0) -> list[dict]:
    """``count`` batches of ``rows`` normal float32 inputs ``x`` and targets ``y``, ``width`` wide."""
    rng = np.random.default_rng(seed)
    return [
        {"x": rng.normal(size=(rows, width)).astype(np.float32), "y": rng.normal(size=(rows, width)).astype(np.float32)}
        for _ in range(count)
    ]
