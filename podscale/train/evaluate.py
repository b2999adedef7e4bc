"""Evaluation sharded over every replica, metrics combined with collectives.

``eval_fn(state, batch)`` returns per-example metrics (shape ``[batch]``). Each replica sums its
examples' metrics weighted by the ``mask`` leaf (0 for padding), the sums and the example count
are ``psum``-ed over the mesh, and running totals stay on the devices; the host only divides at
the end. No example is dropped or counted twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from podscale.parallel.mesh import auto_axes


def distributed_eval(eval_fn: Callable, mesh: Mesh) -> Callable[[object, Iterable], dict[str, float]]:
    """Returns ``run(state, batches) -> {metric: mean over real examples}``."""
    mesh = auto_axes(mesh)  # a jax.make_mesh mesh's Explicit axes are taken as Auto
    axes = tuple(mesh.axis_names)

    def body(state, batch):
        mask = batch["mask"]
        per = eval_fn(state, {k: v for k, v in batch.items() if k != "mask"})
        sums = {k: jax.lax.psum(jnp.sum(v.astype(jnp.float32) * mask), axes) for k, v in per.items()}
        return sums, jax.lax.psum(jnp.sum(mask), axes)

    replicated = NamedSharding(mesh, P())
    sharded = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), P(axes)), out_specs=(P(), P())),
        out_shardings=(replicated, replicated),
    )

    def run(state, batches: Iterable) -> dict[str, float]:
        totals, count = None, None
        for batch in batches:
            sums, n = sharded(state, batch)
            totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
            count = n if count is None else count + n
        if totals is None:
            raise ValueError("evaluation got no batches: the held-out data set is empty")
        count = float(count)
        return {k: float(v) / count for k, v in totals.items()}

    return run
