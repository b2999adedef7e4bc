"""``podscale bench embedding``: embedding tables split by rows against replicated ones, on 8 devices.

A click model of ``tables`` embedding tables of ``rows x dim`` float32 (one id per table and
example, Zipf-distributed as click logs are: :class:`podscale.workloads.clicks.ClickLogs`), the
looked-up rows and the dense features concatenated into a logit by a dense layer, binary cross-entropy, SGD. The same
unmodified step runs twice on the same devices, steps interleaved:

- **split**: each table split by rows over the data axes (:mod:`podscale.parallel.tables`): a
  lookup all-gathers the batch's ids and reduce-scatters the looked-up rows, the gradient
  all-gathers the rows' cotangents and each device adds them into its own rows;
- **replicated** (``min_table_rows`` above the tables' rows): every device holds every table, and
  the tables' gradients are all-reduced densely with the dense layer's.

Figures per run, from the compiled step (:mod:`podscale.compiled.hlo`) and the placement: bytes each
device's collectives move per step by kind, the tables' bytes per device, the compiled step's
temporaries and peak per device, the median step time; both runs compute one device's step (their
losses agree to float32 summation order). Beside them, the lookup of one table with its gradient
two exact ways, the masked gather podscale uses against an all-to-all (:mod:`podscale.bench.lookups`).

What a CPU cannot show: the 8 devices are threads sharing one memory, so an all-reduce is a copy,
not link hops; the bytes and the memory are what a pod's devices would hold and send.
"""

from __future__ import annotations

import statistics
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from podscale.bench.lookups import bench_lookups
from podscale.bench.spatial import interleave
from podscale.compiled import hlo
from podscale.parallel import checks
from podscale.parallel.engine import data_parallel
from podscale.parallel.mesh import make_mesh
from podscale.workloads.clicks import ClickLogs

RUNS = {"split": None, "replicated": 2**62}
"""Each run's ``min_table_rows`` (``None``: the default, the global batch's rows)."""


class Clicks(nn.Module):
    """Embedding tables looked up by id (``table[ids]``), concatenated, a dense layer: one logit."""

    rows: int
    dim: int
    tables: int

    @nn.compact
    def __call__(self, dense, sparse):
        init = nn.initializers.uniform(1.0 / self.rows**0.5)
        vectors = [self.param(f"table_{t}", init, (self.rows, self.dim))[sparse[:, t]] for t in range(self.tables)]
        x = jnp.concatenate([dense, *vectors], axis=1)
        return nn.Dense(1)(x)[:, 0]


def click_step(model, tx):
    """The plain single-device step: mean binary cross-entropy, the optimizer's update."""

    def step(state, batch):
        params, opt = state

        def loss_fn(p):
            logit = model.apply({"params": p}, batch["dense"], batch["sparse"])
            return optax.sigmoid_binary_cross_entropy(logit, batch["label"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), {"loss": loss}

    return step


def bench_embedding(
    rows: int = 65536, dim: int = 64, tables: int = 2, batch: int = 512, steps: int = 4
) -> dict[str, Any]:
    """Runs the benchmark (see the module docstring). Every argument is checked first."""
    rows, dim, tables = checks.whole("rows", rows), checks.whole("dim", dim), checks.whole("tables", tables)
    batch, steps = checks.whole("batch", batch), checks.whole("steps", steps, what=" (timed steps)")
    n = len(jax.devices())
    if batch % n:
        raise ValueError(
            f"batch={batch} must be a multiple of the {n} devices (replicas); give a batch or replicas that divide it"
        )
    if rows < batch:
        raise ValueError(f"rows={rows}: a table is split by rows from the global batch's {batch} rows; give more")
    model = Clicks(rows, dim, tables)
    tx = optax.sgd(0.5)
    data = ClickLogs(batch * (steps + 1), (rows,) * tables)
    batches = [data.get(jnp.arange(i * batch, (i + 1) * batch)) for i in range(steps + 1)]
    params = jax.jit(model.init)(jax.random.key(0), batches[0]["dense"], batches[0]["sparse"])["params"]
    state = (params, tx.init(params))
    step = click_step(model, tx)
    mesh = make_mesh()
    runs = {}
    for name, min_rows in RUNS.items():
        dp = data_parallel(step, mesh, min_table_rows=min_rows, strict=True)
        placed = dp.place_state(state, batches[0])
        compiled = dp.lower(placed, batches[0]).compile()
        runs[name] = {"dp": dp, "state": placed, "compiled": compiled, "plan": dp.plan(), "times": []}
    interleave(runs.values(), batches)
    out: dict[str, Any] = {
        "config": {"rows": rows, "dim": dim, "tables": tables, "batch": batch, "devices": n, "steps": steps}
    }
    for name, r in runs.items():
        module = hlo.read(r["compiled"], r["dp"].mesh)
        sent: dict[str, float] = {}
        for c in module.collectives:
            sent[c.kind] = sent.get(c.kind, 0.0) + c.moved_bytes * c.count
        plan = r["plan"]
        table_leaves = [leaf for leaf in plan.leaves if leaf["path"].startswith("[0]['table_")]
        out[name] = {
            "table_bytes_per_device": sum(leaf["bytes_per_device"] for leaf in table_leaves),
            "tables_split": sum(bool(leaf["table_rows"]) for leaf in table_leaves),
            "sent_bytes_per_device": sent,
            "temporaries_bytes": module.memory.get("temporaries", 0),
            "peak_bytes": module.memory.get("peak", 0),
            "step_s": statistics.median(r["times"]),
            "final_loss": r["loss"],
        }
    # The lookup alone, two exact ways (podscale.bench.lookups): the first table's ids of a batch.
    ids = np.asarray(batches[0]["sparse"][:, 0])
    out["lookups"] = bench_lookups(rows, dim, ids, mesh, max(steps, 3))
    return out
