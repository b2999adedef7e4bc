"""``podscale bench tp``: one Transformer's weights split k = 1, 2, 4, 8 ways on 8 devices, side by side.

MLPerf v0.7's Transformer could not grow its global batch past 2048, so at 4096 chips it split
each layer over 4 (tensor partitioning). This bench holds the global batch fixed on 8 CPU
devices, a mesh ``(8 / k, k)`` for k = 1, 2, 4 (k = 8 would leave one replica, which podscale
refuses for now: XLA's partitioner rejects the data-axis sums there): 8/k replicas, each weight the built-in rules name split k ways
(:mod:`podscale.parallel.tensor`), with :class:`podscale.train.models.Transformer` (8 heads, so
every k divides them) and Adam. Figures per k, read from the compiled step
(:mod:`podscale.compiled.hlo`) and the layout: FLOPs per device (``cost_analysis``; the model has no
loops, so nothing is counted once for many; at a fixed global batch each device's share of the
work stays the same, and a replica's batch costs each of its k devices about 1/k of what it
costs one device), weight and optimizer-state bytes per device, bytes
each device's collectives move per mesh axis per step (the data axis's gradient sum, the model
axis's all-reduces), and the median step time. Every k computes the same step: the final losses
agree to float32 summation order.

What a CPU cannot show: the 8 "devices" are threads of one process sharing memory, so a
model-axis all-reduce is a memory copy, not a hop over a torus link, and the step time shows the
partitioned program's overhead rather than the compute a k-times-smaller slice saves on a chip.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

import jax
import numpy as np
import optax

from podscale.bench import TP_HEADS, TP_WAYS, tp_problem
from podscale.bench.spatial import interleave
from podscale.compiled import hlo
from podscale.parallel import checks
from podscale.parallel.engine import data_parallel
from podscale.parallel.mesh import make_mesh
from podscale.train.models import Transformer


def lm_step(model, tx):
    """The plain single-device step of a language model: next-token cross-entropy."""

    def step(state, batch):
        params, opt = state

        def loss_fn(p):
            logits = model.apply({"params": p}, batch["tokens"][:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), {"loss": loss}

    return step


def bench_tp(
    ks=TP_WAYS,
    batch: int = 16,
    seq: int = 64,
    width: int = 256,
    heads: int = TP_HEADS,
    depth: int = 2,
    vocab: int = 512,
    steps: int = 4,
    weight_update: str = "replicated",
) -> dict[str, Any]:
    """Runs the benchmark (see the module docstring); steps of every k are interleaved. Every
    argument is checked first."""
    for name, value in (("batch", batch), ("seq", seq), ("width", width), ("heads", heads), ("depth", depth)):
        checks.whole(name, value)
    vocab = checks.whole("vocab", vocab)
    steps = checks.whole("steps", steps, what=" (timed steps)")
    if isinstance(ks, str) or not isinstance(ks, tuple | list) or not ks:
        raise TypeError(f"ks={ks!r}: give a non-empty tuple of ways to split the weights, e.g. (1, 2, 4)")
    ks = tuple(checks.whole("ks", k, what=" (devices per replica)") for k in ks)
    checks.one_of("weight_update", weight_update, ("replicated", "sharded"))
    n = len(jax.devices())
    if n % max(ks) or n // max(ks) < 2:
        raise ValueError(
            f"podscale bench tp splits weights up to {max(ks)} ways and needs at least two replicas for each, so "
            f"{2 * max(ks)} devices or a multiple; there are {n}: pass --replicas {2 * max(ks)}"
        )
    problem = tp_problem(width, heads, vocab, max(ks))
    if problem:
        raise ValueError(f"podscale bench tp: {problem}")
    model = Transformer(vocab_size=vocab, width=width, depth=depth, num_heads=heads, mlp_dim=4 * width, max_len=seq)
    tx = optax.adam(1e-3)
    rng = np.random.default_rng(0)
    data = [{"tokens": rng.integers(0, vocab, (batch, seq + 1)).astype(np.int32)} for _ in range(steps + 1)]
    params = model.init(jax.random.key(0), data[0]["tokens"][:, :-1])["params"]
    state = (params, tx.init(params))
    step = lm_step(model, tx)
    runs = {}
    for k in ks:
        mesh = make_mesh((n // k, k))
        dp = data_parallel(step, mesh, model_parallel=k, rules="transformer", weight_update=weight_update)
        placed = dp.place_state(state, data[0])
        compiled = dp.lower(placed, data[0]).compile()
        plan = dp.plan(compile=False)
        runs[k] = {"dp": dp, "state": placed, "compiled": compiled, "plan": plan, "times": []}
    interleave(runs.values(), data)
    out: dict[str, Any] = {
        "config": {
            "batch": batch,
            "seq": seq,
            "width": width,
            "heads": heads,
            "depth": depth,
            "vocab": vocab,
            "devices": n,
            "steps": steps,
            "weight_update": weight_update,
        }
    }
    base = None
    for k, r in runs.items():
        module = hlo.read(r["compiled"], r["dp"].mesh)
        cost = r["compiled"].cost_analysis()
        flops = float((cost[0] if isinstance(cost, list) else cost).get("flops", 0.0))
        base = base or flops
        per_axis: dict[str, float] = defaultdict(float)
        for c in module.collectives:
            per_axis[",".join(c.axes) or "?"] += c.moved_bytes * c.count
        memory = r["plan"].memory
        out[str(k)] = {
            "mesh": dict(r["dp"].mesh.shape),
            "flops_per_device": flops,
            # A replica's batch on k devices against that batch on one device (k x the k=1 figure,
            # whose replica holds 1/k of it): about 1/k when XLA splits the work, not repeats it.
            "flops_vs_replica_on_one_device": flops / (k * base) if base else None,
            "weight_bytes_per_device": memory["weights"],
            "optimizer_bytes_per_device": memory["optimizer_state"],
            "collective_bytes_per_axis": dict(per_axis),
            "rule_notes": len(r["dp"].placement.rule_notes),
            "step_s": statistics.median(r["times"]),
            "final_loss": r["loss"],
        }
    return out
