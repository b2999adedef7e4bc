"""``podscale project --validate``: the performance model checked on this machine, not fitted to it.

This CPU is described by measurement, for each device count ``n`` in 1, 2, 4, 8 (the simulated
devices share the machine's cores, so a device's share depends on how many work at once): the
matrix-product rate and the memory bandwidth per device while all ``n`` work, the fixed cost of one
op (a chain of tiny products), and for each collective over the ``n`` devices its latency and its
cost per byte (two buffer sizes, a straight line through them). None of these is the step being
predicted; then each workload's tiny config is compiled at 1, 2, 4 and 8 replicas, costed by the
same code as ``podscale project`` (one op: ``overhead + max(matmul FLOPs / rate, bytes / bandwidth)``;
collectives by the measured lines; no overlap: this CPU runs collectives synchronously), run, and
timed (the fastest of the timed steps, as every machine figure is the fastest of its repeats: on a
shared machine other work only adds time). The table prints predicted over measured per row and
the worst row.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from podscale.compiled import hlo, hlo_cost
from podscale.compiled.network import Path
from podscale.compiled.systems import System
from podscale.parallel import checks
from podscale.projection.cost import cost
from podscale.projection.mesh import compile_mesh

COUNTS = (1, 2, 4, 8)
CONV_CHANNELS = (8, 16, 32, 64)
_SMALL, _LARGE = 4096, 4 * 2**20  # bytes per device for the collective lines


@dataclasses.dataclass(frozen=True)
class Measured:
    """This CPU with ``devices`` devices working at once."""

    devices: int
    matmul_flops: dict[str, float]
    """dtype (``f32``, ``bf16``) -> FLOP/s per device of a matrix product."""
    conv_flops: dict[str, dict[int, float]]
    """dtype -> {channels: FLOP/s per device} of a 3x3 convolution with that many input and output
    features (XLA:CPU runs few-channel convolutions far below its matrix-product rate); an op
    takes the rate measured at the nearest channel count."""
    vector_flops: dict[str, float]
    """dtype -> FLOP/s per device of elementwise arithmetic (this CPU emulates bf16 arithmetic)."""
    bandwidth: float
    """Bytes/s per device of a float32 elementwise op on arrays far larger than the caches."""
    overhead: float
    """Seconds of one small op."""
    collectives: dict[str, tuple[float, float]]
    """kind -> (seconds, seconds per buffer byte) over all ``devices``."""

    def op_time(self, op: hlo_cost.Op) -> float:
        def rate(table, dtype):
            return table["bf16" if dtype in ("bf16", "f16") else "f32"]

        dots = op.matmul_flops - op.conv_flops
        matmul = dots / rate(self.matmul_flops, op.matmul_dtype) if dots else 0.0
        if op.conv_flops:
            rates = rate(self.conv_flops, op.matmul_dtype)
            nearest = min(rates, key=lambda c: abs(math.log2(c) - math.log2(max(op.conv_channels, 1))))
            matmul += op.conv_flops / rates[nearest]
        vector = (op.flops - op.matmul_flops) / rate(self.vector_flops, op.dtype)
        return self.overhead + max(matmul, vector, op.bytes / self.bandwidth)

    def time(self, kind: str, groups, nbytes: float) -> tuple[float, Path]:
        if len(groups[0]) <= 1 and kind != "collective-permute":
            return 0.0, Path(1, 0.0, 0.0, False, where="one device")
        a, b = self.collectives[kind]
        return a + b * nbytes, Path(len(groups[0]), 1 / b if b else 0.0, a, False, where=f"measured on {self.devices}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _best_time(fn, *args, repeats: int = 7) -> float:
    """The fastest of ``repeats`` runs: on a shared machine, other work only adds time."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return min(times)


def measure(n: int) -> Measured:
    """Measures this CPU with ``n`` devices at once (see the module docstring)."""
    mesh = compile_mesh({"data": n})
    spec = NamedSharding(mesh, P("data"))

    def per_device(body, shape, dtype=jnp.float32):
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
        x = jax.device_put(jnp.ones((n * shape[0], *shape[1:]), dtype), spec)
        return fn, x

    size, reps = 256, 16
    matmul, vector, conv = {}, {}, {}
    for name, dtype in (("f32", jnp.float32), ("bf16", jnp.bfloat16)):

        def matmuls(x, dtype=dtype):
            w = jnp.full((size, size), 1.0 / size, dtype)
            return lax.fori_loop(0, reps, lambda i, y: y @ w, x)

        fn, x = per_device(matmuls, (size, size), dtype)
        matmul[name] = 2 * size**3 * reps / _best_time(fn, x)
        elems_v, chain_v = 65536, 32

        def arithmetic(x):
            for _ in range(chain_v):
                x = lax.optimization_barrier(x * 1.01 + 0.5)
            return x

        fn, x = per_device(arithmetic, (elems_v,), dtype)
        vector[name] = 2 * elems_v * chain_v / _best_time(fn, x)
        conv[name] = {}
        side, images = 16, 8
        for channels in CONV_CHANNELS:

            def convs(x, dtype=dtype, channels=channels):
                k = jnp.full((3, 3, channels, channels), 1.0 / (9 * channels), dtype)
                dims = ("NHWC", "HWIO", "NHWC")
                return lax.fori_loop(
                    0, 8, lambda i, y: lax.conv_general_dilated(y, k, (1, 1), "SAME", dimension_numbers=dims), x
                )

            fn, x = per_device(convs, (images, side, side, channels), dtype)
            conv[name][channels] = 2 * images * side * side * channels * 9 * channels * 8 / _best_time(fn, x)
    elems, reps_bw = 4 * 2**20 // 4 * 4, 4  # 16 MiB per device

    def stream(x):
        return lax.fori_loop(0, reps_bw, lambda i, y: y * 1.0001 + 1e-3, x)

    fn, x = per_device(stream, (elems,))
    bandwidth = 2 * elems * 4 * reps_bw / _best_time(fn, x)
    chain = 64

    def tiny(x):
        w = jnp.eye(4, dtype=jnp.float32)
        for _ in range(chain):
            x = x @ w
        return x

    fn, x = per_device(tiny, (4, 4))
    overhead = _best_time(fn, x) / chain
    lines = {}
    if n > 1:
        for kind in ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute"):
            lines[kind] = _collective_line(mesh, kind, n)
    return Measured(n, matmul, conv, vector, bandwidth, overhead, lines)


def _collective_line(mesh, kind: str, n: int) -> tuple[float, float]:
    reps = 8
    perm = [(i, (i + 1) % n) for i in range(n)]

    def body(x):
        def one(i, y):
            if kind == "all-reduce":
                return lax.pcast(lax.psum(y, "data") * (1.0 / n), "data", to="varying")
            if kind == "reduce-scatter":
                return jnp.tile(lax.psum_scatter(y, "data", tiled=True), n)
            if kind == "all-gather":
                return lax.all_gather(y, "data", tiled=True)[: y.shape[0]]
            if kind == "all-to-all":
                return lax.all_to_all(y, "data", 0, 0, tiled=True)
            return lax.ppermute(y, "data", perm)

        return lax.fori_loop(0, reps, one, x)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    times = {}
    for nbytes in (_SMALL, _LARGE):
        elems = nbytes // 4
        elems -= elems % n
        x = jax.device_put(jnp.ones((n * elems,), jnp.float32), NamedSharding(mesh, P("data")))
        times[elems * 4] = _best_time(fn, x) / reps
    (s0, t0), (s1, t1) = sorted(times.items())
    per_byte = max(0.0, (t1 - t0) / (s1 - s0))
    return max(0.0, t0 - per_byte * s0), per_byte


def _cpu_system(n: int) -> System:
    return System(
        f"cpu-{n}",
        f"this machine's CPU, {n} simulated devices (measured)",
        "measured",
        0.0,
        0.0,
        0.0,
        0.0,
        max_chips=n,
        overlaps=False,
    )


def predict(measured: Measured, module: hlo.Module, shape: dict[str, int]) -> dict[str, float]:
    phases, collectives, exposed, _ = cost(_cpu_system(measured.devices), measured, module, shape, measured.op_time)
    return {
        "compute_s": phases["forward"] + phases["backward"],
        "update_s": phases["update"],
        "communication_s": exposed,
        "step_s": phases["forward"] + phases["backward"] + phases["update"] + exposed,
    }


def _time_steps(run, state, batches, steps: int) -> float:
    times = []
    for i in range(steps + 2):  # two warm-up steps
        start = time.perf_counter()
        state, _ = run(state, batches[i % len(batches)])
        jax.block_until_ready(state)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return min(times)


def _workload_rows(name: str, measured: dict[int, Measured], steps: int, log) -> list[dict[str, Any]]:
    from podscale.parallel.engine import data_parallel
    from podscale.train.tasks import make_task, make_train_step

    task = make_task(name, config="tiny")
    cfg = task.config
    tx = task.workload.make_optimizer(cfg, cfg.train_steps)
    step = make_train_step(task, tx)
    host_state = jax.device_get(task.init_state(jax.random.key(0), tx))
    rows = []
    for n in COUNTS:
        log(f"{name}: {n} replica(s)")
        mesh = compile_mesh({"data": n})
        dp = data_parallel(step, mesh, weight_update="sharded" if n > 1 else "replicated", donate_state=False)
        global_batch = cfg.per_core_batch * n
        host = [task.train_data.get(np.arange(i * global_batch, (i + 1) * global_batch)) for i in range(2)]
        dp.prepare(host_state, host[0])
        batches = [dp.place_batch(b, global_batch) for b in host]
        state = dp.place_state(host_state, host[0])
        module = hlo.read(dp.lower(state, batches[0]).compile(), mesh)
        predicted = predict(measured[n], module, dict(mesh.shape))
        measured_s = _time_steps(dp, state, batches, steps)
        rows.append(_row(f"{name} (tiny)", f"{n} replica(s), {dp.strategy.weight_update}", predicted, measured_s))
    return rows


def _wus_rows(measured: Measured, steps: int, log, width=256, depth=4, vocab=4096) -> list[dict[str, Any]]:
    import optax

    from podscale.bench.wus import Variant, decoder_task
    from podscale.train.tasks import make_train_step

    n = measured.devices
    mesh = compile_mesh({"data": n})
    task = decoder_task(width, depth, vocab, 128)
    tx = optax.adam(1e-4)
    step = make_train_step(task, tx)
    host_state = jax.device_get(task.init_state(jax.random.key(0), tx))
    from podscale.parallel.engine import data_parallel

    placer = data_parallel(lambda s, b: (s, {}), mesh)
    batches = [placer.place_batch(task.train_data.get(np.arange(i * n, (i + 1) * n)), n) for i in range(2)]
    rows = []
    for variant in ("replicated", "sharded", "gspmd"):
        log(f"bench wus: {variant}")
        run = Variant(variant, step, mesh, host_state, batches[0])
        module = hlo.read(run.compiled, mesh)
        predicted = predict(measured, module, dict(mesh.shape))
        times = []
        for i in range(steps + 2):
            start = time.perf_counter()
            run.step(batches[i % 2], timed=False)
            if i >= 2:
                times.append(time.perf_counter() - start)
        rows.append(_row(f"bench wus decoder {width}x{depth}", f"{n} replicas, {variant}", predicted, min(times)))
    return rows


def _row(what: str, how: str, predicted: dict[str, float], measured_s: float) -> dict[str, Any]:
    return {
        "workload": what,
        "run": how,
        **{f"predicted_{k}": v for k, v in predicted.items()},
        "measured_step_s": measured_s,
        "ratio": predicted["step_s"] / measured_s if measured_s else math.nan,
    }


def check(models=None, steps: int = 5) -> list[str]:
    """Refuses :func:`validate`'s arguments before any measurement; returns the workloads."""
    from podscale import workloads

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"--steps {steps!r}: timed steps per run, a whole number of at least 1")
    if models is None:
        return list(workloads.NAMES)
    return checks.some_of("--validate-models", models, workloads.NAMES, "workload")


def validate(models=None, steps: int = 5, progress: bool = True) -> dict[str, Any]:
    models = check(models, steps)
    if len(jax.devices()) < max(COUNTS):
        raise ValueError(f"--validate needs {max(COUNTS)} devices (podscale project --validate starts them)")
    started = time.perf_counter()

    def log(message: str) -> None:
        if progress:
            import sys

            print(f"validate [{time.perf_counter() - started:.0f} s]: {message}", file=sys.stderr, flush=True)

    measured = {}
    for n in COUNTS:
        log(f"measuring this CPU with {n} device(s)")
        measured[n] = measure(n)
    rows = []
    for name in models:
        rows += _workload_rows(name, measured, steps, log)
    rows += _wus_rows(measured[max(COUNTS)], steps, log)
    worst = max(rows, key=lambda r: abs(math.log(r["ratio"])))
    return {"machine": {n: m.to_dict() for n, m in measured.items()}, "rows": rows, "worst": worst}


def print_validation(result: dict[str, Any]) -> None:
    from rich.console import Console

    from podscale import report

    console = Console()
    machine = report.table(
        "devices",
        "matmul GFLOP/s f32/bf16",
        "conv GFLOP/s f32/bf16 (8-64 ch)",
        "vector GFLOP/s f32/bf16",
        "GB/s",
        "op us",
        "all-reduce us + ns/KiB",
        title="this CPU, per device (measured)",
        numbers=("devices", "GB/s", "op us"),
    )
    for n, m in result["machine"].items():
        ar = m["collectives"].get("all-reduce")
        machine.add_row(
            str(n),
            f"{m['matmul_flops']['f32'] / 1e9:.1f}/{m['matmul_flops']['bf16'] / 1e9:.1f}",
            f"{min(m['conv_flops']['f32'].values()) / 1e9:.0f}-{max(m['conv_flops']['f32'].values()) / 1e9:.0f}/"
            f"{min(m['conv_flops']['bf16'].values()) / 1e9:.0f}-{max(m['conv_flops']['bf16'].values()) / 1e9:.0f}",
            f"{m['vector_flops']['f32'] / 1e9:.1f}/{m['vector_flops']['bf16'] / 1e9:.1f}",
            f"{m['bandwidth'] / 1e9:.1f}",
            f"{m['overhead'] * 1e6:.1f}",
            f"{ar[0] * 1e6:.0f} + {ar[1] * 1024 * 1e9:.0f}" if ar else "-",
        )
    report.show(machine, console)
    numbers = ("compute ms", "update ms", "comm ms", "predicted ms", "measured ms", "pred/meas")
    table = report.table("workload", "run", *numbers, title="predicted over measured step time", numbers=numbers)
    for r in result["rows"]:
        table.add_row(
            r["workload"],
            r["run"],
            f"{r['predicted_compute_s'] * 1e3:.2f}",
            f"{r['predicted_update_s'] * 1e3:.2f}",
            f"{r['predicted_communication_s'] * 1e3:.2f}",
            f"{r['predicted_step_s'] * 1e3:.2f}",
            f"{r['measured_step_s'] * 1e3:.2f}",
            f"{r['ratio']:.2f}",
        )
    report.show(table, console)
    w = result["worst"]
    within = sum(1 for r in result["rows"] if 0.8 <= r["ratio"] <= 1.25)
    console.print(
        f"worst row: {w['workload']} {w['run']}: predicted / measured {w['ratio']:.2f}; "
        f"{within} of {len(result['rows'])} rows within 20%"
    )
