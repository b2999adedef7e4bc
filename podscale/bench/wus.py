"""``podscale bench wus``: replicated vs sharded vs FSDP vs GSPMD weight update, side by side in one run.

A decoder-only Transformer (about 29M parameters at the default size) at a per-replica batch of
one 128-token sequence, with each optimizer, or (``model=``) an MLPerf workload's tiny config at
its per-core batch with its own recipe, four ways:

* ``replicated``: ``data_parallel(step, mesh)``: one fused all-reduce, every replica updates all;
* ``sharded``: ``data_parallel(step, mesh, weight_update="sharded")``;
* ``fsdp``: ``data_parallel(step, mesh, weight_update="fsdp")`` (weights stored 1/N too, gathered at use);
* ``gspmd``: ``jax.jit`` of the plain step with the optimizer state given a data-axis
  ``NamedSharding`` (first dimension divisible by the replica count) and XLA inserting the
  collectives.

Figures per variant: ``step_s`` (median over timed steps), ``update_s`` (``step_s`` minus the
median step of the same variant with plain SGD, whose update is one multiply-add: the cost of
the optimizer beyond SGD, timed in the same interleaved loop), ``peak_bytes_per_device`` (``compiled.memory_analysis()``: arguments
+ outputs + temporaries - aliased), ``collectives`` (kind -> bytes of the buffers each device
contributes per step, read from the compiled module), ``bytes_vs_limit`` (bytes every collective of the compiled module sends
per device per step, loops counted with their trip counts, over one ring all-reduce of the float32
gradients: 1.0 is the limit of the sharded update; ``podscale.compiled.hlo``), ``max_abs_param_diff``
against ``replicated`` after the same steps.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from rich.console import Console
from rich.progress import Progress

from podscale import workloads
from podscale.bench import WUS_HEADS
from podscale.compiled import hlo
from podscale.parallel import checks
from podscale.parallel.engine import data_parallel
from podscale.parallel.mesh import make_mesh
from podscale.report import Ticker
from podscale.train import models
from podscale.train.tasks import Task, make_task, make_train_step
from podscale.workloads import datasets


def _peak(compiled) -> int | None:
    m = compiled.memory_analysis()
    if m is None:
        return None
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def decoder_task(width: int, depth: int, vocab: int, seq: int) -> Task:
    """The decoder language model that ``podscale bench wus`` and ``podscale project --validate``
    time: ``depth`` blocks of ``width``, on synthetic tokens of length ``seq``."""
    model = models.Transformer(
        vocab_size=vocab, width=width, depth=depth, num_heads=WUS_HEADS, mlp_dim=4 * width, max_len=seq
    )
    tokens = datasets.SyntheticTokens(1024, seq_len=seq, vocab_size=vocab)
    return Task(model=model, kind="lm", train_data=tokens, eval_data=tokens)


def _gspmd(step, mesh, state):
    n = mesh.devices.size
    replicated = NamedSharding(mesh, P())

    def spec(path, x):
        is_opt = "opt_state" in jax.tree_util.keystr(path)
        if is_opt and np.ndim(x) and np.shape(x)[0] % n == 0:
            return NamedSharding(mesh, P(mesh.axis_names))
        return replicated

    shardings = jax.tree_util.tree_map_with_path(spec, state)
    batch_sharding = NamedSharding(mesh, P(mesh.axis_names))
    jitted = jax.jit(
        step, in_shardings=(shardings, batch_sharding), out_shardings=(shardings, replicated), donate_argnums=0
    )
    place = lambda s: jax.device_put(s, shardings)  # noqa: E731
    gather = lambda s: jax.tree.map(np.asarray, jax.device_get(s))  # noqa: E731
    return jitted, place, gather, lambda s, b: jitted.lower(s, b).compile()


class Variant:
    """One way of running the step: placed state, compiled program, and its timings."""

    def __init__(self, name, step, mesh, state, batch):
        if name == "gspmd":
            self.run, place, self.gather, compile_ = _gspmd(step, mesh, state)
        else:
            dp = data_parallel(step, mesh, weight_update=name)
            dp.prepare(state, batch)
            self.run, place, self.gather = dp, dp.place_state, dp.gather_state
            compile_ = lambda s, b: dp.lower(s, b).compile()  # noqa: E731
        self.state = place(state)
        self.compiled = compile_(self.state, batch)
        self.times: list[float] = []

    def step(self, batch, timed: bool) -> None:
        start = time.perf_counter()
        self.state, _ = self.run(self.state, batch)
        jax.block_until_ready(self.state)
        if timed:
            self.times.append(time.perf_counter() - start)

    def report(self, mesh, limit: float) -> dict[str, Any]:
        module = hlo.read(self.compiled, mesh)
        return {
            "step_s": statistics.median(self.times),
            "peak_bytes_per_device": _peak(self.compiled),
            "collectives": module.by_kind(),
            "bytes_vs_limit": module.moved_bytes() / limit if limit else None,
        }


VARIANTS = ("replicated", "sharded", "fsdp", "gspmd")


class _Progress:
    """rich's bar on a terminal; elsewhere (stderr piped to a file or a CI log, where the bar does
    not show) a line to stderr for each ``line=True`` update and at most every few seconds for the
    others, with the time since the start (:class:`podscale.report.Ticker`)."""

    EVERY_S = 5.0

    def __init__(self, enabled: bool, total: int):
        console = Console(stderr=True)
        self.ticker = Ticker("podscale bench wus", self.EVERY_S, enabled=enabled and not console.is_terminal)
        self.bar = Progress(console=console, transient=True, disable=not enabled or self.ticker.enabled)
        self.total = total

    def __enter__(self):
        self.bar.__enter__()
        self.work = self.bar.add_task("bench wus", total=self.total)
        return self

    def __exit__(self, *exc):
        return self.bar.__exit__(*exc)

    def update(self, description: str, line: bool = False) -> None:
        self.bar.update(self.work, description=description)
        self.ticker(description, force=line)

    def advance(self) -> None:
        self.bar.advance(self.work)


def bench_wus(
    optimizers=("adam", "lamb"),
    steps: int = 4,
    variants=VARIANTS,
    width: int = 512,
    depth: int = 8,
    vocab: int = 8192,
    seq: int = 128,
    per_replica_batch: int = 1,
    model: str | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Runs the benchmark; see the module docstring. Steps of all variants of one optimizer (and
    of its plain-SGD baselines) are interleaved, so that the machine's noise hits them alike.
    ``model``: an MLPerf workload (tiny config, its recipe as the one optimizer, ``"recipe"``).
    ``progress``: a bar on a terminal, else a line to stderr per variant compiled and every few
    seconds while stepping. Every argument is checked before any work."""
    steps = checks.whole("steps", steps, what=" (timed steps)")
    for name, value in (("depth", depth), ("vocab", vocab), ("seq", seq), ("per_replica_batch", per_replica_batch)):
        checks.whole(name, value)
    if checks.whole("width", width) % WUS_HEADS:
        raise ValueError(f"width={width} must be a multiple of the decoder's {WUS_HEADS} attention heads")
    if model is not None and model not in workloads.NAMES:
        raise ValueError(f"model={model!r}: bench wus takes an MLPerf workload: {', '.join(workloads.NAMES)}")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        raise ValueError(f"variants={tuple(variants)!r}: choose from {', '.join(VARIANTS)}")
    missing = [o for o in optimizers if o not in ("sgd", "adam", "lamb") and not callable(getattr(optax, o, None))]
    if missing or not optimizers:
        raise ValueError(f"optimizers={tuple(optimizers)!r}: give names of optax optimizers, e.g. ('adam', 'lamb')")
    mesh = make_mesh()
    n = mesh.devices.size
    makers = {"sgd": lambda: optax.sgd(1e-3), "adam": lambda: optax.adam(1e-4), "lamb": lambda: optax.lamb(1e-4)}
    if model is None:
        task = decoder_task(width, depth, vocab, seq)
    else:
        task = make_task(model, config="tiny")
        cfg = task.config
        per_replica_batch, optimizers = cfg.per_core_batch, ("recipe",)
        makers["recipe"] = lambda: task.workload.make_optimizer(cfg, cfg.train_steps)
    global_batch = n * per_replica_batch
    dp_for_batches = data_parallel(lambda s, b: (s, {}), mesh)
    batches = [
        dp_for_batches.place_batch(
            task.train_data.get(np.arange(i * global_batch, (i + 1) * global_batch)), global_batch
        )
        for i in range(steps + 1)
    ]
    shapes = task.state_shapes(optax.sgd(0.1)).params
    floats = [x for x in jax.tree.leaves(shapes) if jax.numpy.issubdtype(x.dtype, jax.numpy.floating)]
    limit = hlo.ring_bytes("all-reduce", n, sum(int(np.prod(x.shape)) * 4 for x in floats))
    results: dict[str, Any] = {}
    with _Progress(progress, len(optimizers) * 2 * len(variants) * (len(batches) + 1)) as bar:
        for opt in optimizers:
            runs = {}
            for which in (opt, "sgd"):
                tx = makers[which]() if which in makers else getattr(optax, which)(1e-4)
                step = make_train_step(task, tx)
                state = jax.device_get(task.init_state(jax.random.key(0), tx))
                for variant in variants:
                    bar.update(f"{opt}: compiling {variant}" + (" (sgd)" if which != opt else ""), line=True)
                    runs[which, variant] = Variant(variant, step, mesh, state, batches[0])
                    bar.advance()
            for i, batch in enumerate(batches):
                bar.update(f"{opt}: step {i + 1}/{len(batches)}")
                for run in runs.values():
                    run.step(batch, timed=i > 0)  # the first step warms up
                    bar.advance()
            per = {v: runs[opt, v].report(mesh, limit) for v in variants}
            ref = runs[opt, variants[0]].gather(runs[opt, variants[0]].state).params
            for v in variants:
                got = runs[opt, v].gather(runs[opt, v].state).params
                per[v]["max_abs_param_diff"] = max(
                    float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got), strict=True)
                )
                per[v]["update_s"] = per[v]["step_s"] - statistics.median(runs["sgd", v].times)
            results[opt] = per
            del runs
    results["config"] = {
        "model": model or "decoder",
        "parameters": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes)),
        "replicas": n,
        "per_replica_batch": per_replica_batch,
        "timed_steps": steps,
        **({"seq_len": seq, "width": width, "depth": depth, "vocab": vocab} if model is None else {}),
    }
    return results
