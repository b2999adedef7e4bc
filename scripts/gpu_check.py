#!/usr/bin/env python3
"""A GPU check of ``podscale project``'s compute term (issue 14, item 3): measured against predicted.

For each workload, on ONE GPU:

(a) **measured**: the step time of podscale's own step, ``podscale.data_parallel(step, mesh)`` on a
    1-device mesh as the trainer builds it (``make_train_step`` of the workload's recipe, the
    replicated update, ``donate_state=True``), compiled once by ``dp.lower(...).compile()`` and that
    executable called directly, so that the program timed is the very module costed in (b).
    3 warm-up steps, then 20 steps each ended by ``jax.block_until_ready``: median and min per step
    (and the mean of 20 more steps dispatched back to back, the trainer's way).
(b) **predicted from XLA:GPU's module**: that compiled executable read by
    ``podscale.compiled.hlo.read(compiled, mesh)`` and costed by ``podscale.projection.cost.cost`` on
    the systems ``h200`` and ``h100`` (``podscale.compiled.systems``), as
    ``podscale.projection.project._project_one`` costs a row (1 chip, strategy ``replicated``): the row
    podscale would give if it compiled with XLA:GPU (``xla_gpu``). XLA:GPU calls cuBLAS and cuDNN
    for matrix products and convolutions (``custom-call``s); podscale's reader costs each cuBLAS
    gemm (``__cublas$gemm``, ``__cublas$lt$matmul``...) and cuDNN convolution (``__cudnn$conv...``)
    as the dot or convolution it runs (``podscale.compiled.hlo_library``: FLOPs from its shapes,
    ``dot_dimension_numbers``, window and ``dim_labels``; bytes without the scratch workspace).
    (Records of earlier runs hold ``as_is``, podscale's reader before it read these calls, and
    ``custom_calls``, this script's shim that costed them then; ``--compare`` reads either.)

(c) **predicted from XLA:CPU's module** (what ``podscale project --system h200 --chips 1`` gives
    today): not on the GPU machine. ``--xla-cpu`` computes it on a CPU for the same workloads,
    configurations and batches, with podscale's own ``_compile`` and the same costing
    (for resnet50 and transformer-big also ``podscale project ... --compiler cpu``; see the
    commands printed by ``--commands``).

Usage (repository root, ``PYTHONPATH=.``)::

    python3 scripts/gpu_check.py                      # on the GPU machine: (a) and (b)
    python3 scripts/gpu_check.py --smoke              # tiny configs, 2 steps, any backend (CPU here)
    python3 scripts/gpu_check.py --xla-cpu            # (c), on a CPU
    python3 scripts/gpu_check.py --commands           # the podscale project commands for (c)

Workloads (``--workloads``, ``NAME@BATCH`` each; the batch is the one GPU's):

* ``resnet50@256``: the full config (ResNet-50 v1.5, 224x224, LARS), bf16 compute as its policy.
* ``transformer-big@40``: the full config (6+6 layers, hidden 1024, 256 tokens, Adam), 40 sequences
  (10,240 tokens, a GPU-sized batch), and ``transformer-big@4``: the config's per-core batch, which
  ``podscale project --system h200`` uses by default (one TPU v3 core's 4 sequences).
* ``dlrm@6912``: the full network with each of the 26 tables' rows divided by 4
  (``--dlrm-table-divisor``; 47 M rows, 24 GB of float32 weights, 48 GB with their dense
  gradients, so weights, gradients and XLA's temporaries stay well inside the H200's 141 GB with
  one compile), batch 6,912 (the recipe's global 55,296 over one node of 8 GPUs), SGD as the recipe.

At 1 chip podscale opens no update scope (one replica sums nothing), so ``update_s`` is 0 and the
optimizer's ops count in the compute term, in (b) and (c) alike: the check is of the whole step.

JAX: written for podscale's JAX 0.10.2 and run on the GPU machine's 0.11.2, where one of podscale's
rules reads ``scan`` parameters that 0.11 renamed; ``jax_shims`` adapts that rule here, podscale
unchanged (see its docstring). ``--lower-only`` traces and lowers each step and stops (a check of
that on any backend); ``--compare GPU_JSON CPU_JSON`` prints (a), (b) and (c) side by side.

Output: one JSON line per workload on stdout (the summary) and in ``$OUT/gpu_check.json`` (the full
record, JSON lines, rewritten after each workload), and each compiled module's optimized HLO as
``$OUT/hlo_<workload>_b<batch>.txt.gz`` so that it can be costed again elsewhere. A workload that
fails is printed with its exception and the next one runs. ``--deadline-s`` (default 320) stops
starting workloads (and cuts timing short) so that the whole run ends within about 6 minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import gzip
import json
import math
import os
import re
import statistics
import sys
import time
import traceback

START = time.perf_counter()

DEFAULT_GPU = "resnet50@256,transformer-big@40,dlrm@6912,transformer-big@4"
DEFAULT_SMOKE = "resnet50,transformer-big,dlrm"  # tiny configs at their per-core batch
SYSTEMS = ("h200", "h100")


def log(message: str) -> None:
    print(f"[gpu_check {time.perf_counter() - START:6.1f}s] {message}", file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny configs, 1 warm-up and 2 timed steps, any backend")
    p.add_argument("--xla-cpu", action="store_true", help="(c): cost XLA:CPU's module of the same steps (on a CPU)")
    p.add_argument("--commands", action="store_true", help="print the podscale project commands for (c) and exit")
    p.add_argument("--workloads", default=None, help=f"NAME@BATCH,... (default {DEFAULT_GPU}; --smoke: tiny configs)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 3; --smoke 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 20; --smoke 2)")
    p.add_argument("--dlrm-table-divisor", type=int, default=4, help="rows of each DLRM table divided by this")
    p.add_argument("--deadline-s", type=float, default=320.0, help="no workload starts past this (seconds)")
    p.add_argument("--reserve-s", type=float, default=75.0, help="time a workload is assumed to need at least")
    p.add_argument("--out", default=None, help="output folder (default $OUT, else /tmp/gpu_check_out)")
    p.add_argument("--no-hlo", action="store_true", help="do not write the compiled modules' text")
    p.add_argument("--lower-only", action="store_true", help="trace and lower each step, then stop (a check)")
    p.add_argument(
        "--compare",
        nargs=2,
        metavar=("GPU_JSON", "CPU_JSON"),
        help="print measured (a) against (b) and (c) from this script's two outputs, and exit",
    )
    args = p.parse_args(argv)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 3)
    args.steps = args.steps if args.steps is not None else (2 if args.smoke else 20)
    args.workloads = args.workloads or (DEFAULT_SMOKE if args.smoke else DEFAULT_GPU)
    args.out = args.out or os.environ.get("OUT") or "/tmp/gpu_check_out"
    return args


def specs(args) -> list[tuple[str, int | None]]:
    out = []
    for item in args.workloads.split(","):
        name, _, batch = item.strip().partition("@")
        out.append((name, int(batch) if batch else None))
    return out


# -- JAX 0.11 shim -------------------------------------------------------------------------------


def jax_shims() -> list[str]:
    """Makes podscale (written for JAX 0.10.2) run under a newer JAX, here only, podscale unchanged.
    Returns what was shimmed.

    * JAX 0.11 gives ``scan`` equations ``ft_in`` / ``ft_out`` (``FlatTree``s of consts, carry and
      xs; carry and ys) instead of ``num_consts`` / ``num_carry``, which podscale's partitioner
      reads (``podscale.parallel.partition.control._scan``, KeyError 'num_consts'). The shim gives
      that rule the two counts, read from ``ft_in``; the equation it binds is ``lax.scan``'s own."""
    from podscale.parallel.partition import control

    done = []
    original = control.CONTROL["scan"]
    if getattr(original, "_gpu_check_shim", False):
        return ["scan: num_consts/num_carry from ft_in where missing"]

    def scan(p, eqn, ins):
        prm = eqn.params
        if "num_consts" not in prm and "ft_in" in prm:
            consts, carry, _ = prm["ft_in"].unpack()
            eqn = eqn.replace(params={**prm, "num_consts": len(consts), "num_carry": len(carry)})
        return original(p, eqn, ins)

    scan._gpu_check_shim = True
    control.CONTROL["scan"] = scan  # core.py holds the same dict
    done.append("scan: num_consts/num_carry from ft_in where missing")
    return done


# -- the workloads ---------------------------------------------------------------------------------


def build(name: str, batch: int | None, args):
    """(task, optimizer, step, batch, description) as ``podscale project`` and the trainer build them
    (``make_task``, the recipe's optimizer over its ``train_steps``, ``make_train_step``, seed 0)."""
    from podscale import workloads
    from podscale.train.tasks import Task, make_task, make_task_optimizer, make_train_step

    config = "tiny" if args.smoke else "full"
    task = make_task(name, config=config, with_data=False)
    note = f"{name} {config}"
    if name == "dlrm" and not args.smoke and args.dlrm_table_divisor != 1:
        d = args.dlrm_table_divisor
        cfg = dataclasses.replace(
            task.config, cardinalities=tuple(max(1, math.ceil(v / d)) for v in task.config.cardinalities)
        )
        workload = workloads.get(name)
        task = Task(workload.make_model(cfg, _policy(), None), name, None, None, workload=workload, config=cfg)
        rows = sum(cfg.cardinalities)
        note += f", each table's rows / {d} ({rows:,} rows, {rows * cfg.embed_dim * 4 / 1e9:.1f} GB of float32 tables)"
    tx = make_task_optimizer(task, None, None, steps=task.config.train_steps)
    step = make_train_step(task, tx)
    batch = batch or task.config.per_core_batch
    return task, tx, step, batch, note


def _policy():
    from podscale.workloads.precision import BF16

    return BF16  # make_task's default: bf16 compute, float32 weights


def synthetic_batch(task, n: int, seed: int = 0) -> dict:
    """A batch of ``task.batch_shapes(n)``'s shapes and dtypes with valid values: class labels below
    the classes, tokens above PAD and BOS below the vocabulary, each table's ids below its rows,
    click labels 0 or 1, images and dense features standard normal."""
    import numpy as np

    from podscale.workloads.synthetic import BOS, PAD

    rng = np.random.default_rng(seed)
    cfg = task.config
    out = {}
    for key, s in task.batch_shapes(n).items():
        dtype = np.dtype(s.dtype)
        if np.issubdtype(dtype, np.floating):
            if key == "label":  # DLRM's clicks
                out[key] = rng.integers(0, 2, s.shape).astype(dtype)
            else:
                out[key] = rng.standard_normal(s.shape, dtype=np.float32).astype(dtype)
            continue
        if key == "sparse":
            high = np.asarray(cfg.cardinalities, dtype=np.int64)[None, :]
            out[key] = rng.integers(0, high, s.shape).astype(dtype)
        elif key in ("inputs", "targets"):
            out[key] = rng.integers(max(PAD, BOS) + 1, cfg.vocab_size, s.shape).astype(dtype)
        elif key == "label":
            out[key] = rng.integers(0, getattr(cfg, "num_classes", 2), s.shape).astype(dtype)
        else:
            out[key] = np.zeros(s.shape, dtype)
    return out


def state_shapes(task, tx):
    """The state as ``podscale project`` traces it (``ShapeDtypeStruct`` leaves, from one example)."""
    import jax

    return jax.eval_shape(lambda b: task.init_state(jax.random.key(0), tx, b), task.batch_shapes(1))


# -- costing ---------------------------------------------------------------------------------------


class Instructions(dict):
    """Instructions by name: (type, opcode, operand types, attributes); ``bodies``: each
    computation's instruction names."""

    bodies: dict[str, list[str]]


def parse_instructions(text: str) -> Instructions:
    """Every instruction of an HLO module text, with podscale's own patterns
    (``podscale.compiled.hlo``). Names are unique within a module."""
    from podscale.compiled import hlo

    raw, types, bodies, current = {}, {}, {}, ""
    for line in text.splitlines():
        h = hlo._HEADER.match(line)
        if h:
            current = h.group(2)
            bodies[current] = []
            continue
        m = hlo._INSTR.match(line)
        if not m:
            continue
        name, type_text, opcode, rest = m.groups()
        operands, attrs = hlo._split_operands(rest)
        raw[name] = (type_text, opcode, operands, attrs)
        types[name] = type_text
        bodies.setdefault(current, []).append(name)
    out = Instructions({n: (t, opc, [types.get(o, "") for o in ops], a) for n, (t, opc, ops, a) in raw.items()})
    out.bodies = bodies
    return out


def category(op, instrs: Instructions) -> str:
    """A coarse kind of op, for the breakdown."""
    instr = instrs.get(op.name)
    if instr is None:
        return op.opcode
    from podscale.compiled import hlo_library

    _, opcode, _, attrs = instr[:4]
    if opcode == "custom-call":
        target = hlo_library.target(attrs) or "?"
        if target in hlo_library.GEMM_TARGETS:
            return "cublas gemm"
        if target in hlo_library.CONV_TARGETS:
            return "cudnn conv " + re.sub(r"(?<!^)(?=[A-Z])", "-", target.split("$conv", 1)[1]).lower()
        return f"custom-call {target}"
    if opcode == "fusion":
        kind = re.search(r"kind=(k\w+)", attrs)
        backend = re.search(r'"kind"\s*:\s*"([^"]+)"', attrs)
        what = "fusion " + (kind.group(1) if kind else "?")
        if backend:
            what += " " + backend.group(1)
        if op.matmul_flops:
            what += " (with dot/conv)"
        return what
    return opcode


def row_of(system, module, dp, strategy, replica_batch: int, compiler: str) -> dict:
    """The row ``podscale.projection.project._project_one`` builds for 1 chip (target mesh {"data": 1})."""
    from podscale.compiled.network import Topology
    from podscale.projection.cost import cost
    from podscale.projection.rows import draft_row

    topology = Topology(system, 1, "torus")
    target = {"data": 1}
    phases, collectives, exposed, hidden = cost(system, topology, module, target)
    row = (
        draft_row(system, topology, "replicated", strategy, replica_batch, target, target, 1, dp, module)
        ._replace(phases=phases, collectives=collectives, exposed=exposed, hidden=hidden, compiler=compiler)
        .build()
    )
    keep = ("compute_s", "update_s", "exposed_s", "step_s", "examples_per_s", "mfu", "flops_per_device")
    out = {k: getattr(row, k) for k in keep}
    out["forward_s"], out["backward_s"] = phases["forward"], phases["backward"]
    out["memory_per_chip_gb"] = row.memory_per_chip / 1e9
    out["matmul_flops"] = sum(o.matmul_flops * o.count for o in module.ops)
    out["op_bytes"] = module.op_bytes()
    return out


def breakdown(system, module, instrs: dict, top: int = 25) -> tuple[list, list]:
    """Per kind of op: runs, matmul FLOPs, bytes and predicted seconds; and the ``top`` ops by the
    latter."""
    from podscale.projection.cost import op_time

    kinds: dict[str, dict] = {}
    rows = []
    for op in module.ops:
        seconds = op_time(system, op) * op.count
        kind = category(op, instrs)
        k = kinds.setdefault(kind, {"kind": kind, "ops": 0, "runs": 0, "flops": 0.0, "bytes": 0.0, "predicted_s": 0.0})
        k["ops"] += 1
        k["runs"] += op.count
        k["flops"] += op.matmul_flops * op.count
        k["bytes"] += op.bytes * op.count
        k["predicted_s"] += seconds
        rows.append(
            {
                "name": op.name,
                "kind": kind,
                "phase": op.phase,
                "runs": op.count,
                "matmul_flops": op.matmul_flops,
                "dtype": op.matmul_dtype,
                "bytes": op.bytes,
                "predicted_s": seconds,
                "op_name": op.op_name[-160:],
            }
        )
    rows.sort(key=lambda r: -r["predicted_s"])
    return sorted(kinds.values(), key=lambda k: -k["predicted_s"]), rows[:top]


def xla_cost_analysis(compiled) -> dict:
    """XLA's own ``cost_analysis()`` (a loop body counted once)."""
    try:
        ca = compiled.cost_analysis()
        if isinstance(ca, list | tuple):
            ca = ca[0] if ca else {}
        return {k: float(ca[k]) for k in ("flops", "bytes accessed", "transcendentals") if k in (ca or {})}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}


# -- (a) and (b): on the device ---------------------------------------------------------------------


def device_check(name: str, batch: int | None, args, deadline: float) -> dict:
    import jax
    import numpy as np

    from podscale.compiled import hlo, systems
    from podscale.parallel.engine import data_parallel
    from podscale.parallel.strategy import Strategy
    from podscale.projection.mesh import compile_mesh, strategy_for

    record: dict = {"workload": name, "errors": {}}
    t = time.perf_counter()
    task, tx, step, batch, note = build(name, batch, args)
    device = jax.devices()[0]
    record.update(
        config=note,
        batch=batch,
        policy="bf16 compute, float32 weights and optimizer state",
        optimizer="the workload's recipe (make_task_optimizer over its train_steps)",
        device=f"{device.platform} {device.device_kind}",
        timed=(
            "podscale.data_parallel(make_train_step(task, recipe), 1-device mesh {'data': 1}, replicated update, "
            "donate_state=True), the executable of dp.lower(stored state, batch).compile() called directly"
        ),
    )
    mesh = compile_mesh({"data": 1}, jax.devices()[:1])
    strategy = strategy_for(Strategy(), "replicated")
    dp = data_parallel(step, mesh, strategy)
    shapes = state_shapes(task, tx)
    batch_shapes = task.batch_shapes(batch)
    dp.prepare(shapes, batch_shapes)
    lowered = dp.lower(dp.placement.stored_shapes(), batch_shapes)
    record["trace_s"] = time.perf_counter() - t
    log(f"{name}@{batch}: traced and lowered in {record['trace_s']:.1f} s; compiling")
    if args.lower_only:
        record["lowered_chars"] = len(lowered.as_text())
        return record
    t = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001  (out of memory, ...): the record says so, the next workload runs
        record["errors"]["compile"] = f"{type(e).__name__}: {str(e)[:2000]}"
        return record
    record["compile_s"] = time.perf_counter() - t
    log(f"{name}@{batch}: compiled in {record['compile_s']:.1f} s")
    text = compiled.as_text()
    record["hlo_chars"] = len(text)
    if not args.no_hlo:
        path = os.path.join(args.out, f"hlo_{name}_b{batch}.txt.gz")
        with gzip.open(path, "wt") as f:
            f.write(text)
        record["hlo_file"] = os.path.basename(path)
    record["xla_cost_analysis"] = xla_cost_analysis(compiled)
    record["compiled_memory"] = hlo.memory_of(compiled)

    # (a) measured
    try:
        t = time.perf_counter()
        stored = dp.placement.stored_shapes()
        same = all(
            tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype
            for a, b in zip(jax.tree.leaves(shapes), jax.tree.leaves(stored), strict=True)
        )
        example = synthetic_batch(task, 1, seed=1)
        if same:  # made on the device in the stored layout: nothing travels through the host
            shardings = jax.tree.map(lambda s: s.sharding, stored)
            init = jax.jit(lambda key, b: task.init_state(key, tx, b), out_shardings=shardings)
            state = init(jax.random.key(0), example)
        else:
            state = dp.place_state(task.init_state(jax.random.key(0), tx, example), batch_shapes)
        record["state_made"] = "on the device, stored layout" if same else "dp.place_state (stored shapes differ)"
        placed = dp.place_batch(synthetic_batch(task, batch, seed=2), batch)
        jax.block_until_ready((state, placed))
        record["init_s"] = time.perf_counter() - t
        for _ in range(args.warmup):
            state, metrics = compiled(state, placed)
            jax.block_until_ready((state, metrics))
        times = []
        for _ in range(args.steps):
            if times and time.perf_counter() > deadline:
                record["errors"]["timing"] = f"cut short at the deadline after {len(times)} steps"
                break
            t0 = time.perf_counter()
            state, metrics = compiled(state, placed)
            jax.block_until_ready((state, metrics))
            times.append(time.perf_counter() - t0)
        n = len(times)
        t0 = time.perf_counter()
        for _ in range(n):
            state, metrics = compiled(state, placed)
        jax.block_until_ready((state, metrics))
        pipelined = (time.perf_counter() - t0) / n
        record["measured"] = {
            "median_s": statistics.median(times),
            "min_s": min(times),
            "pipelined_mean_s": pipelined,
            "warmup": args.warmup,
            "steps": n,
            "per_step_s": times,
            "loss": float(np.asarray(metrics["loss"])),
        }
        stats = device.memory_stats() or {}
        # the process's peak so far (the workloads before this one included), and the allocator's limit
        record["device_memory"] = {
            k: stats[k] for k in ("peak_bytes_in_use", "bytes_limit", "bytes_in_use") if k in stats
        }
        log(f"{name}@{batch}: median {statistics.median(times) * 1e3:.3f} ms, min {min(times) * 1e3:.3f} ms")
        del state, placed, metrics
    except Exception as e:  # noqa: BLE001
        record["errors"]["measure"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()

    # (b) predicted from this module
    try:
        module = hlo.read(compiled, mesh)
        instrs = parse_instructions(text)
        record["predicted"] = {
            s: {"xla_gpu": row_of(systems.get(s), module, dp, strategy, batch, "XLA:GPU")} for s in SYSTEMS
        }
        kinds, top = breakdown(systems.get("h200"), module, instrs)
        record["breakdown_h200"], record["top_ops_h200"] = kinds, top
        record["unknown_trip_counts"] = list(module.unknown_trip_counts)
        record["collectives"] = len(module.collectives)
        if "measured" in record:
            m = record["measured"]["median_s"]
            record["ratio_predicted_over_measured_median"] = {
                s: {k: v["step_s"] / m for k, v in p.items()} for s, p in record["predicted"].items()
            }
    except Exception as e:  # noqa: BLE001
        record["errors"]["predict"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    del compiled, lowered, dp
    gc.collect()
    return record


# -- (c): XLA:CPU's module --------------------------------------------------------------------------


def xla_cpu_check(name: str, batch: int | None, args) -> dict:
    """The row ``podscale project --system S --chips 1 --strategies replicated --compiler cpu``
    gives: podscale's ``_compile`` (XLA:CPU, the accelerators' threefry lowering,
    the state donated) and the same costing as ``_project_one`` for 1 chip."""
    import jax

    from podscale.compiled import systems
    from podscale.parallel.engine import data_parallel
    from podscale.parallel.strategy import Strategy
    from podscale.projection import project as proj
    from podscale.projection.mesh import strategy_for

    task, tx, step, batch, note = build(name, batch, args)
    record: dict = {"workload": name, "config": note, "batch": batch, "errors": {}}
    strategy = strategy_for(Strategy(), "replicated")
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state_shapes(task, tx))
    t = time.perf_counter()
    dp, module = proj._compile(data_parallel, step, shapes, task.batch_shapes, batch, 1, strategy, {"data": 1})
    record["compile_s"] = time.perf_counter() - t
    record["predicted"] = {
        s: {"xla_cpu": row_of(systems.get(s), module, dp, strategy, batch, "XLA:CPU")} for s in SYSTEMS
    }
    instrs = Instructions()
    instrs.bodies = {}
    kinds, top = breakdown(systems.get("h200"), module, instrs)
    record["breakdown_h200"], record["top_ops_h200"] = kinds, top[:10]
    return record


# -- the commands of (c) ----------------------------------------------------------------------------


def commands(args) -> list[str]:
    out = []
    for name, batch in specs(args):
        if name == "dlrm":
            out.append(
                f"# {name}@{batch}: scaled tables, no CLI flag for them: PYTHONPATH=. python3 scripts/gpu_check.py --xla-cpu --workloads {name}@{batch}"
            )
            continue
        out.append(
            f"podscale project --model {name} --config full --system h200 --chips 1 --per-chip-batch {batch} "
            "--strategies replicated --compiler cpu --json"
        )
    return out


# -- main ------------------------------------------------------------------------------------------


def summary(record: dict) -> dict:
    """The one-line figures of a record (the rest is in the file)."""
    keys = ("workload", "config", "batch", "device", "trace_s", "compile_s", "errors", "skipped")
    out = {k: record[k] for k in keys if k in record}
    if "measured" in record:
        m = record["measured"]
        out["measured_ms"] = {k: round(m[k] * 1e3, 3) for k in ("median_s", "min_s", "pipelined_mean_s")}
    for s, p in record.get("predicted", {}).items():
        out[f"predicted_{s}_ms"] = {
            k: {q: round(v[q] * 1e3, 3) for q in ("compute_s", "update_s", "step_s")} for k, v in p.items()
        }
    if "ratio_predicted_over_measured_median" in record:
        out["ratio"] = {
            s: {k: round(v, 3) for k, v in r.items()} for s, r in record["ratio_predicted_over_measured_median"].items()
        }
    return out


def compare(gpu_path: str, cpu_path: str) -> list[str]:
    """A Markdown table: measured (a), predicted from XLA:GPU's module (b) and from XLA:CPU's (c),
    each prediction over the measured median; and the matrix FLOPs and op bytes per step each
    module is costed by (b / c). A record of an earlier run gives its ``custom_calls`` row as (b)."""

    def read(path):
        with open(path) as f:
            return {(r["workload"], r.get("batch")): r for r in map(json.loads, filter(str.strip, f))}

    gpu, cpu = read(gpu_path), read(cpu_path)
    lines = [
        "| workload | batch | system | measured median / min ms | (b) XLA:GPU ms (x) | (c) XLA:CPU ms (x) "
        "| matmul TFLOP b / c | op GB b / c |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, g in gpu.items():
        m = g.get("measured")
        c = cpu.get(key, {}).get("predicted", {})
        for s in SYSTEMS:
            p = g.get("predicted", {}).get(s, {})
            b = p.get("xla_gpu") or p.get("custom_calls")
            if not m or not b:
                why = g.get("skipped") or g.get("errors")
                lines.append(f"| {key[0]} | {key[1]} | {s} | - | {why} | | | |")
                continue
            med = m["median_s"]

            def cell(row, med=med):
                return f"{row['step_s'] * 1e3:.2f} ({row['step_s'] / med:.2f}x)" if row else "-"

            def pair(field, scale, b, x):
                return f"{b[field] / scale:.2f} / " + (f"{x[field] / scale:.2f}" if x else "-")

            xc = c.get(s, {}).get("xla_cpu")
            lines.append(
                f"| {key[0]} | {key[1]} | {s} | {med * 1e3:.2f} / {m['min_s'] * 1e3:.2f} | {cell(b)} | {cell(xc)} "
                f"| {pair('matmul_flops', 1e12, b, xc)} | {pair('op_bytes', 1e9, b, xc)} |"
            )
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compare:
        print("\n".join(compare(*args.compare)))
        return 0
    if args.commands:
        print("\n".join(commands(args)))
        return 0
    if not args.smoke and not args.xla_cpu:
        os.environ.setdefault("JAX_PLATFORMS", "cuda,cpu")  # fail loudly without a GPU (podscale may pin cpu)
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")  # DLRM's tables and gradients
    if args.xla_cpu:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.makedirs(args.out, exist_ok=True)
    import jax

    import podscale  # noqa: F401  (its import-time platform choice, as every podscale run)

    versions = {"jax": jax.__version__, "python": sys.version.split()[0]}
    try:
        import jaxlib

        versions["jaxlib"] = jaxlib.__version__
    except Exception:  # noqa: BLE001
        pass
    versions["shims"] = jax_shims()
    log(f"jax {versions}, devices {jax.devices()}")
    if not (args.smoke or args.xla_cpu or args.lower_only) and jax.devices()[0].platform != "gpu":
        line = json.dumps({"error": f"no GPU: devices {jax.devices()}", "versions": versions})
        with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
            f.write(line + "\n")
        print(line, flush=True)
        return 2
    name = "xla_cpu.json" if args.xla_cpu else "gpu_check.json"
    path = os.path.join(args.out, name)
    records: list[dict] = []
    deadline = START + args.deadline_s
    for wname, batch in specs(args):
        label = f"{wname}@{batch or 'default'}"
        if not args.xla_cpu and time.perf_counter() + args.reserve_s > deadline:
            record = {"workload": wname, "batch": batch, "skipped": f"past the deadline ({args.deadline_s:.0f} s)"}
        else:
            log(f"{label}: start")
            try:
                record = (
                    xla_cpu_check(wname, batch, args) if args.xla_cpu else device_check(wname, batch, args, deadline)
                )
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                record = {"workload": wname, "batch": batch, "errors": {"build": f"{type(e).__name__}: {e}"}}
        record["versions"] = versions
        record["elapsed_s"] = time.perf_counter() - START
        records.append(record)
        with open(path, "w") as f:
            for r in records:
                f.write(json.dumps(r, default=float) + "\n")
        print(json.dumps(summary(record), default=float), flush=True)
        gc.collect()
    log(f"done: {path}")
    for record in records:  # again at the end, where a long log's tail shows them
        print(json.dumps(summary(record), default=float), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
