"""``podscale bench gradsum``: 1-D against 2-D gradient summation, side by side in one run.

For each gradient size (MiB per device), each variant sums a float32 buffer of that size over all
devices, exactly as a data-parallel step sums its fused gradient buffers
(``GradSum.all_reduce``), and the variants' repetitions are interleaved so that machine noise
hits them alike:

* ``1d``: one all-reduce over all devices (a 1-D mesh);
* ``2d 4x2`` / ``2d 2x4``: reduce-scatter along the first axis, all-reduce along the second on
  the pieces, all-gather along the first; one chunk;
* ``2d 4x2 k=4`` / ``2d 2x4 k=4``: the same, each buffer cut into 4 pipelined chunks.

Figures: ``median_s`` over the timed repetitions; ``bytes_per_axis``: the bytes each device sends
along each mesh axis under the ring algorithm (reduce-scatter and all-gather send (p-1)/p of their
buffer, an all-reduce twice that), which is what a torus link carries; ``hlo`` (kind -> bytes of
results per device, from the compiled HLO) as a check of what was compiled.

What the CPU can show: that the 2-D scheme is exact and what it costs in collective calls and
copies. What it cannot: simulated CPU devices share one memory, XLA:CPU runs one collective at a
time, and there are no links, so neither the shorter rings nor two axes' links working at once
(the reason for 2-D summation on a torus) nor overlap between chunks appear in the timings.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from podscale.bench import DEFAULT_SIZES, check_sizes
from podscale.compiled import hlo
from podscale.parallel import checks
from podscale.parallel.collectives import Collective
from podscale.parallel.gradsum import GradSum, make_grad_sum
from podscale.parallel.mesh import make_mesh

VARIANTS = {
    "1d": (None, "1d", 1),
    "2d 4x2": ((4, 2), "2d", 1),
    "2d 2x4": ((2, 4), "2d", 1),
    "2d 4x2 k=4": ((4, 2), "2d", 4),
    "2d 2x4 k=4": ((2, 4), "2d", 4),
}


def ring_bytes(phases: list[Collective], sizes: dict[str, int]) -> dict[str, int]:
    """Bytes sent per device along each axis by ring collectives of the recorded phases."""
    out: dict[str, int] = {}
    for ph in phases:
        sent = int(hlo.ring_bytes(ph.kind, int(np.prod([sizes[a] for a in ph.axes])), ph.bytes_per_device))
        key = ",".join(ph.axes)
        out[key] = out.get(key, 0) + sent
    return out


def _program(grad_sum: GradSum, mesh, per_device: int):
    phases: list[Collective] = []
    spec = P(tuple(mesh.axis_names))

    def body(x):
        phases.clear()
        return grad_sum.all_reduce(x[0], phases)[None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    n = len(mesh.devices.flat)
    sharding = NamedSharding(mesh, spec)
    x = jax.jit(lambda: jnp.ones((n, per_device), jnp.float32), out_shardings=sharding)()
    compiled = fn.lower(x).compile()
    return compiled, x, list(phases)


def bench_gradsum(sizes_mib=DEFAULT_SIZES, repeats: int = 5, variants=tuple(VARIANTS)) -> dict:
    """Runs the benchmark (see the module docstring); every argument is checked first."""
    sizes_mib = check_sizes(sizes_mib)
    repeats = checks.whole("repeats", repeats, what=" (timed repetitions)")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    n = jax.device_count()
    if n != 8:
        raise ValueError(
            f"bench gradsum compares 8-device meshes (8, 4x2, 2x4); there are {n} devices: pass --replicas 8"
        )
    result: dict = {}
    for mib in sizes_mib:
        per_device = int(mib * 2**20) // 4
        runs = {}
        for name in variants:
            shape, mode, chunks = VARIANTS[name]
            mesh = make_mesh(shape)
            gs = make_grad_sum(mesh, mode, chunks if mode == "2d" else None)
            compiled, x, phases = _program(gs, mesh, per_device)
            out = compiled(x)
            expected = float(n)  # ones summed over the devices
            err = float(jnp.max(jnp.abs(out - expected)))
            jax.block_until_ready(compiled(x))  # warm
            runs[name] = {
                "compiled": compiled,
                "x": x,
                "times": [],
                "phases": phases,
                "mesh": dict(mesh.shape),
                "err": err,
            }
        for _ in range(repeats):
            for name in variants:
                r = runs[name]
                start = time.perf_counter()
                jax.block_until_ready(r["compiled"](r["x"]))
                r["times"].append(time.perf_counter() - start)
        result[f"{mib:g} MiB"] = {
            name: {
                "median_s": statistics.median(r["times"]),
                "mesh": r["mesh"],
                "bytes_per_axis": ring_bytes(r["phases"], r["mesh"]),
                "collectives": [
                    {
                        "kind": ph.kind,
                        "axes": list(ph.axes),
                        "bytes_per_device": ph.bytes_per_device,
                        "chunks": ph.chunks,
                    }
                    for ph in r["phases"]
                ],
                "hlo": hlo.read(r["compiled"]).by_kind(),
                "max_abs_error": r["err"],
            }
            for name, r in runs.items()
        }
        for r in runs.values():
            del r["x"]
    return result
