"""The two exact ways to look up rows of a table split by rows, side by side: ``podscale bench
embedding``'s ``lookups`` figures.

A table of ``rows x dim`` float32 is split by rows over the devices (``rows / n`` each), and each
device holds ``batch / n`` of the batch's ids. Both ways give each device the rows of its own ids,
bit for bit ``table[ids]``, and the gradient of a loss of those rows into each device's own rows
(the single device's scatter-add, up to the order of the sums of a row looked up twice):

- **masked gather** (what :mod:`podscale.parallel.partition.tables` does): the ids are
  all-gathered, each device gathers the rows it holds (an id outside its block reads a zero row),
  and a reduce-scatter of the ``batch x dim`` rows returns each device's own;
- **all-to-all**: each device sends each id to the device holding its row and gets the row back
  (two ``all_to_all``). XLA's all-to-all has static shapes, so an exact one must have room for the
  worst case, all of a device's ids held by one device: ``batch / n`` ids to every device, so a
  send buffer of ``batch x dim`` rows, the masked gather's reduce-scatter buffer. It moves the same
  bytes, plus the sorting of ids into the buffer. An all-to-all of the ids' real counts
  (TorchRec's, JAX's ``lax.ragged_all_to_all`` on GPU and TPU; XLA:CPU has none) would move about
  ``batch / n x dim`` rows per device, ``n`` times fewer; a fixed smaller room drops ids where
  Zipf's frequent ones meet on one device, which podscale's rule forbids.

Figures: the bytes each device's collectives move (from the compiled program), the median time of
the lookup with its gradient, and the largest difference from ``table[ids]`` and from the single
device's gradient.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from podscale.compiled import hlo


def _own_block(ids, index, local_rows: int):
    """``ids`` into this device's block of ``local_rows`` rows; one past it where outside."""
    local = ids - index * local_rows
    return jnp.where((local >= 0) & (local < local_rows), local, local_rows)


def masked_gather(table, ids, axis: str):
    """This device's ids' rows: all-gathered ids, the rows held here, a reduce-scatter."""
    every = jax.lax.all_gather(ids, axis, tiled=True)
    local = _own_block(every, jax.lax.axis_index(axis), table.shape[0])
    rows = table.at[local].get(mode="fill", fill_value=0)
    return jax.lax.psum_scatter(rows, axis, scatter_dimension=0, tiled=True)


def all_to_all(table, ids, axis: str, n: int):
    """This device's ids' rows: each id sent to the device holding its row, the row sent back, in
    buffers with room for every id at one device (exact)."""
    local_rows, room = table.shape[0], ids.shape[0]
    owner = ids // local_rows
    mine = owner[:, None] == jnp.arange(n)
    slot = jnp.sum(jnp.cumsum(mine, axis=0) * mine, axis=1) - 1  # the id's place among its owner's
    send = jnp.full((n, room), -1, ids.dtype).at[owner, slot].set(ids)
    asked = jax.lax.all_to_all(send, axis, 0, 0, tiled=True)  # [source, room]: ids held here
    local = _own_block(asked, jax.lax.axis_index(axis), local_rows)
    rows = table.at[local].get(mode="fill", fill_value=0)  # [source, room, dim]
    back = jax.lax.all_to_all(rows, axis, 0, 0, tiled=True)  # [owner, room, dim]
    return back[owner, slot]


def bench_lookups(rows: int, dim: int, ids: np.ndarray, mesh, steps: int) -> dict[str, Any]:
    """Both lookups with their gradients on ``mesh`` (one axis of ``n`` devices) of the batch's
    ``ids`` into ``rows`` rows; see the module docstring."""
    (axis,) = mesh.axis_names
    n = mesh.shape[axis]
    ids = jnp.asarray(ids, jnp.int32)
    table = jax.random.normal(jax.random.key(1), (rows, dim), jnp.float32)
    cotangent = jax.random.normal(jax.random.key(2), (ids.shape[0], dim), jnp.float32)
    want_rows = np.asarray(table)[np.asarray(ids)]
    want_grad = np.asarray(jnp.zeros_like(table).at[ids].add(cotangent))
    split = NamedSharding(mesh, P(axis))
    placed = [jax.device_put(x, split) for x in (table, ids, cotangent)]
    ways = {
        "masked gather": lambda t, i: masked_gather(t, i, axis),
        "all-to-all": lambda t, i: all_to_all(t, i, axis, n),
    }
    out: dict[str, Any] = {}
    for name, lookup in ways.items():

        def both(t, i, c, lookup=lookup):
            looked_up, pull = jax.vjp(lambda t: lookup(t, i), t)
            return looked_up, pull(c)[0]

        program = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=(P(axis),) * 3, out_specs=(P(axis), P(axis))))
        compiled = program.lower(*placed).compile()
        got_rows, got_grad = compiled(*placed)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            jax.block_until_ready(compiled(*placed))
            times.append(time.perf_counter() - start)
        sent: dict[str, float] = {}
        for c in hlo.read(compiled, mesh).collectives:
            sent[c.kind] = sent.get(c.kind, 0.0) + c.moved_bytes * c.count
        out[name] = {
            "sent_bytes_per_device": sent,
            "seconds": statistics.median(times),
            "rows_max_difference": float(np.max(np.abs(np.asarray(got_rows) - want_rows))),
            "gradient_max_difference": float(np.max(np.abs(np.asarray(got_grad) - want_grad))),
        }
    return out
