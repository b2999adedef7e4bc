"""What podscale's commands print as tables, readable at 80 columns on a terminal or piped: a
step's plan (``podscale plan``; the plan itself, :mod:`podscale.parallel.plan`, is data and this is
its one rendering), the workloads (``podscale models``), the systems (``podscale project
--list-systems``) and the benchmarks' results (``podscale bench``). Under ``--json`` the commands
print the same data as JSON instead."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from podscale import report
from podscale.compiled import systems
from podscale.compiled.hlo import device_bytes
from podscale.report import show, size

if TYPE_CHECKING:
    from podscale.parallel.plan import Plan


def plan(plan: Plan, console: Console | None = None) -> None:
    """A plan (:class:`podscale.parallel.plan.Plan`, what ``podscale plan`` prints), readable at 80 columns, on a terminal or piped: numbers are never cut, paths fold."""
    console = console or Console()
    console.print(f"weight update: [bold]{plan.weight_update}[/] on {plan.replicas} replicas, mesh {plan.mesh}")
    g = plan.grad_sum
    explicit = g["mode"] == "2d" and g.get("phases") != "xla"
    how = " then ".join(g["order"]) if explicit else ",".join(g["order"])
    extra = (f", {g['chunks']} chunks" if explicit else "") + (f", summed in {g['dtype']}" if g["dtype"] else "")
    console.print(f"gradient sum: [bold]{g['mode']}[/] over {how}{extra}: {g['reason']}")
    leaves = Table(title="state layout (per device)")
    leaves.add_column("state leaf", overflow="fold", ratio=3)
    leaves.add_column("shape", no_wrap=True)
    leaves.add_column("layout", no_wrap=True)
    leaves.add_column("bytes", justify="right", no_wrap=True)
    leaves.add_column("why", overflow="fold", ratio=2)
    for leaf in plan.leaves:
        leaves.add_row(
            leaf["path"],
            "x".join(map(str, leaf["shape"])) or "()",
            f"1/{plan.replicas} on dim {leaf['fsdp_dim']}"
            + (f", 1/{leaf['model_split']} on dim {leaf['model_dim']}" if leaf["model_dim"] is not None else "")
            if leaf.get("fsdp_dim") is not None
            else f"1/{plan.replicas * leaf['split']}"
            if leaf["sharded"]
            else f"rows 1/{plan.replicas}"
            if leaf.get("table_rows")
            else (f"1/{leaf['model_split']} on dim {leaf['model_dim']}" if leaf["model_dim"] is not None else "whole"),
            size(leaf["bytes_per_device"]),
            leaf["reason"],
        )
    show(leaves, console)
    collectives = Table(title="collectives per step (podscale's)")
    collectives.add_column("collective", no_wrap=True)
    collectives.add_column("axes", no_wrap=True)
    collectives.add_column("buffer", justify="right", no_wrap=True)
    collectives.add_column("tensors", justify="right", no_wrap=True)
    collectives.add_column("what", overflow="fold")
    for c in plan.collectives:
        chunks = f" x{c['chunks']}" if c["chunks"] > 1 else ""
        chunks += f" ({c['runs']} runs)" if c.get("runs", 1) > 1 else ""
        collectives.add_row(
            c["kind"] + chunks, ",".join(c["axes"]), size(c["bytes_per_device"]), str(c["tensors"]), c["why"]
        )
    show(collectives, console)
    if plan.compiled is not None:
        table = Table(title="collectives per step (the compiled module)")
        table.add_column("collective", no_wrap=True)
        table.add_column("axes", no_wrap=True)
        table.add_column("dtype", no_wrap=True)
        table.add_column("runs", justify="right", no_wrap=True)
        table.add_column("buffer", justify="right", no_wrap=True)
        table.add_column("sent", justify="right", no_wrap=True)
        for c in plan.compiled["collectives"]:
            table.add_row(
                c["kind"],
                ",".join(c["axes"]) or "?",
                c["dtype"],
                str(c["runs"]),
                size(c["buffer_bytes"]),
                size(c["moved_bytes"]),
            )
        show(table, console)
        if plan.compiled["unknown_trip_counts"]:
            console.print(
                f"[yellow]loops without a known trip count (counted once):[/] {plan.compiled['unknown_trip_counts']}"
            )
        copies, moved = plan.compiled.get("copy_bytes", {}), plan.compiled.get("op_bytes", {})
        relaid = plan.compiled.get("relayout_bytes", {})
        if any(copies.values()):
            console.print(
                "copies in the compiled module, bytes per device per step (of them relayouts; the rest keep "
                "their layout: buffers XLA could not write in place, such as a collective's result the step "
                "returns): "
                + ", ".join(
                    f"{p} {size(copies[p])}"
                    + (f" (relayouts {size(relaid[p])})" if p in relaid else "")
                    + f" of {size(moved.get(p, 0))}"
                    for p in copies
                )
            )
    sp = plan.spatial
    if sp:
        halo = (
            f"; halo exchanges (collective-permute) {sp['halo_exchanges']} per step, "
            f"{size(sp['halo_bytes_per_device'])} per device"
            if "halo_bytes_per_device" in sp
            else ""
        )
        console.print(
            f"spatial: each image's height split {sp['partitions']} ways over {sp['axis']!r} "
            f"({sp['layers']} convolution and pooling layers){halo}"
        )
        for note in sp["uneven_layers"]:
            console.print(f"  [yellow]{note}[/]")
        if sp.get("gathers"):
            title = (
                f"gathered or summed over the space axis {sp['axis']!r}, per layer "
                f"({size(sp['gather_bytes_per_device'])} per device)"
            )
            _per_layer(title, sp["gathers"], console)
    tp = plan.tensor
    if tp:
        console.print(
            f"tensor: weights split {tp['partitions']} ways over {tp['axis']!r} by the rules {tp['rules']!r}: "
            f"{tp['split_leaves']} leaves, {size(tp['split_bytes_per_device'])} per device of "
            f"{size(tp['split_bytes'])}"
        )
        for note in tp["notes"]:
            console.print(f"  [yellow]{note}[/]")
        if tp.get("collectives"):
            _per_layer(f"collectives over the model axis {tp['axis']!r}, per layer", tp["collectives"], console)
        if "reshuffles" in tp:
            r = tp["reshuffles"]
            console.print(
                f"reshuffles over the model axis {tp['axis']!r}: {r['all-to-all']} all-to-all, "
                f"{r['collective-permute']} collective-permute ({size(r['bytes_per_device'])} per device); "
                f"{tp['chunked_per_partition']} sharded leaves chunked per model partition"
            )
    if plan.tables:
        _tables(plan.tables, console)
    t = plan.traffic
    if t:
        console.print(
            f"bytes sent per device per step: gradient sum + weight gather {size(t['update_bytes'])} = "
            f"{t['ratio']:.3f}x one all-reduce of the gradients ({size(t['all_reduce_bytes'])}); "
            f"the model's own collectives {size(t['model_bytes'])}"
        )
    m = plan.memory
    lines = [
        f"weights {size(m['weights'])} (replicated {size(m['weights_replicated'])})",
        f"optimizer state {size(m['optimizer_state'])} (replicated {size(m['optimizer_state_replicated'])})",
        f"local gradients {size(m['gradients'])}",
    ]
    if "temporaries" in m:
        lines += [
            f"temporaries (activations, gradients, workspace) {size(m['temporaries'])}",
            f"peak {size(device_bytes(m))}"
            + (
                " (the device's buffers together: with an offload, XLA's own peak counts host memory)"
                if m.get("host_temporaries")
                else f" live at once (all buffers together {size(m['peak'])})"
                if "allocated" in m
                else ""
            ),
        ]
        if m.get("host_temporaries"):
            lines.append(f"offloaded to host memory {size(m['host_temporaries'])} (not in the peak)")
    console.print("memory per device: " + "; ".join(lines))
    e = plan.eval
    if e:
        train = f" (the train step's peak {size(device_bytes(m))})" if "peak" in m else ""
        console.print(
            f"evaluation memory per device: arguments {size(e['arguments'])}; temporaries {size(e['temporaries'])}; "
            f"peak {size(e['peak'])}{train}"
        )
    for r in plan.regions:
        how = (
            f"by hand over {r['axis']!r} ({r['partitions']} partitions), its sums {size(r['summed_bytes_per_device'])} per device"
            if r["by_hand"]
            else f"left to XLA: {r['why']}"
        )
        compiled = f"; compiled: {size(r['compiled_bytes_per_device'])}" if "compiled_bytes_per_device" in r else ""
        console.print(f"region {r['name']} ({r['rule']}, {'+'.join(r['passes'])}): {how}{compiled}")
    if plan.whole_ops:
        console.print(f"[yellow]computed on whole (gathered) values:[/] {', '.join(plan.whole_ops)}")
    if plan.gathered_ops:
        console.print(f"[yellow]computed on gathered values (not sharded):[/] {', '.join(plan.gathered_ops)}")


def _tables(tables: dict[str, Any], console: Console) -> None:
    """Where each embedding table went, then its lookups' and gradients' collectives by kind."""
    table = Table(
        title=f"embedding tables (split by rows from {tables['min_table_rows']:,} rows or more; each from the ids a step looks up in it)",
        title_justify="left",
    )
    table.add_column("table", overflow="fold", ratio=2)
    table.add_column("shape", no_wrap=True)
    table.add_column("placement", no_wrap=True)
    table.add_column("bytes/device", justify="right", no_wrap=True)
    for t in tables["tables"]:
        table.add_row(t["path"], "x".join(map(str, t["shape"])), t["placement"], size(t["bytes_per_device"]))
    show(table, console)
    grouped: dict[tuple[str, str], list[int]] = {}
    for c in tables["collectives"]:
        grouped.setdefault((c["kind"], c["why"]), []).append(c["bytes_per_device"])
    if grouped:
        ops = Table(title="lookups and table gradients: collectives per step", title_justify="left")
        ops.add_column("collective", no_wrap=True)
        ops.add_column("runs", justify="right", no_wrap=True)
        ops.add_column("buffers", justify="right", no_wrap=True)
        ops.add_column("what", overflow="fold")
        for (kind, why), sizes in grouped.items():
            ops.add_row(kind, str(len(sizes)), size(sum(sizes)), why)
        show(ops, console)


def _per_layer(title: str, rows: list[dict[str, Any]], console: Console) -> None:
    table = Table(title=title, title_justify="left")
    table.add_column("layer", overflow="fold")
    table.add_column("kind", no_wrap=True)
    table.add_column("runs", justify="right", no_wrap=True)
    table.add_column("bytes/device", justify="right", no_wrap=True)
    for c in rows:
        table.add_row(c["layer"] or "?", c["kind"], str(c["runs"]), size(c["bytes_per_device"]))
    show(table, console)


def models(rows: list[dict[str, Any]]) -> None:
    """What ``podscale models`` prints: the workloads (rows as ``--json`` gives them) and their sources."""
    numbers = ("params (full)", "published", "diff", "params (tiny)", "batch (per core)")
    table = report.table(
        "model",
        *numbers,
        "metric",
        title="MLPerf reference workloads (podscale train --model NAME --config full|tiny)",
        numbers=numbers,
    )
    for r in rows:
        table.add_row(
            r["name"],
            f"{r['params_full']:,}",
            f"{r['reference_params']:,}",
            f"{r['relative_difference']:+.1%}",
            f"{r['params_tiny']:,}",
            f"{r['global_batch']:,} ({r['per_core_batch']})",
            r["eval_metric"],
        )
    console = Console()
    report.show(table, console)
    for r in rows:
        console.print(
            f"[bold]{r['name']}[/]: {r['description']}\n  parameters: {r['reference_source']}\n  recipe: {r['hyperparameters_source']}"
        )


def list_systems() -> None:
    """What ``podscale project --list-systems`` prints: each system's figures per chip, and each
    figure's source (or, for an assumed one, its range)."""
    numbers = ("bf16 TFLOP/s", "HBM GiB", "HBM GB/s", "link GB/s", "max chips")
    table = report.table("system", *numbers, title="systems (per chip; links one way)", numbers=numbers)
    for s in systems.SYSTEMS.values():
        link = s.link_bandwidth or s.nvlink_bandwidth
        table.add_row(
            s.name,
            f"{s.peak_flops / 1e12:g}",
            f"{s.hbm_bytes / 2**30:.0f}",
            f"{s.hbm_bandwidth / 1e9:g}",
            f"{link / 1e9:g}",
            str(s.max_chips),
        )
    console = Console()
    report.show(table, console)
    for s in systems.SYSTEMS.values():
        console.print(f"[bold]{s.name}[/]: {s.description}\n  " + "; ".join(s.sources), markup=True)
        for field, value, source in systems.figures(s):
            console.print(f"    {field} = {value}: {source}", markup=False)


def bench_wus(result: dict[str, Any]) -> None:
    """What ``podscale bench wus`` prints: each optimizer's variants, and their collectives."""
    cfg = result.pop("config")
    numbers = ("step s", "update s", "peak MiB", "bytes/limit", "max|dp|")
    table = report.table(
        "optimizer",
        "variant",
        *numbers,
        title=f"weight update, {cfg['model']}, {cfg['parameters'] / 1e6:.1f}M parameters, {cfg['replicas']} replicas",
        numbers=numbers,
    )
    lines = []
    for opt, per in result.items():
        for variant, r in per.items():
            peak = r["peak_bytes_per_device"]
            table.add_row(
                opt,
                variant,
                f"{r['step_s']:.3f}",
                f"{r['update_s']:.3f}",
                f"{peak / 2**20:.1f}" if peak else "-",
                f"{r['bytes_vs_limit']:.3f}",
                f"{r['max_abs_param_diff']:.1e}",
            )
            coll = ", ".join(f"{k} {v / 1024:,.0f}" for k, v in sorted(r["collectives"].items()))
            lines.append(f"{opt} {variant}: {coll or 'none'}")
    console = Console()
    report.show(table, console)
    console.print("collectives, KiB per device per step:")
    for line in lines:
        console.print("  " + line)


def bench_spatial(result: dict[str, Any]) -> None:
    """What ``podscale bench spatial`` prints: one replica's images over k devices."""
    cfg = result.pop("config")
    numbers = ("temporaries", "vs k=1", "halo/step", "halo/temps", "step s")
    table = report.table(
        "k",
        *numbers,
        title=f"spatial: {cfg['batch']} images {cfg['image']}x{cfg['image']}, one replica over k devices",
        numbers=("k", *numbers),
    )
    for k, r in result.items():
        temps = r["temporaries_bytes_per_device"]  # None where the backend has no memory_analysis
        table.add_row(
            k,
            report.size(temps) if temps is not None else "-",
            f"{r['temporaries_vs_k1']:.2f}x" if r["temporaries_vs_k1"] is not None else "-",
            report.size(r["halo_bytes_per_device"]),
            f"{r['halo_vs_temporaries']:.3f}" if r["halo_vs_temporaries"] is not None else "-",
            f"{r['step_s']:.4f}",
        )
    console = Console()
    report.show(table, console)
    console.print(
        "temporaries: activations, their gradients and workspace per device (memory_analysis); halo: "
        "collective-permute bytes per device per step. CPU devices share one memory: a halo is a copy "
        "here, a torus link hop on a TPU."
    )


def bench_tp(result: dict[str, Any]) -> None:
    """What ``podscale bench tp`` prints: a Transformer's weights split k ways."""
    cfg = result.pop("config")
    numbers = ("GFLOP/device", "vs 1 device", "weights", "opt state", "data axis", "model axis", "other", "step s")
    table = report.table(
        "k",
        "mesh",
        *numbers,
        title=(
            f"tp: transformer width {cfg['width']}, {cfg['heads']} heads, {cfg['depth']} layers, batch {cfg['batch']} "
            f"x {cfg['seq']} tokens on {cfg['devices']} devices"
        ),
        numbers=("k", *numbers),
    )
    for k, r in result.items():
        data_axis, model_axis = r["mesh"]
        axes = r["collective_bytes_per_axis"]
        other = sum(v for a, v in axes.items() if a not in (data_axis, model_axis))
        table.add_row(
            k,
            "x".join(str(v) for v in r["mesh"].values()),
            f"{r['flops_per_device'] / 1e9:.3f}",
            f"{r['flops_vs_replica_on_one_device']:.3f}",
            report.size(r["weight_bytes_per_device"]),
            report.size(r["optimizer_bytes_per_device"]),
            report.size(axes.get(data_axis, 0)),
            report.size(axes.get(model_axis, 0)),
            report.size(other),
            f"{r['step_s']:.4f}",
        )
    console = Console()
    report.show(table, console)
    console.print(
        "vs 1 device: a replica's batch on its k devices against that batch on one device (about 1/k when the work "
        "is split). Axes: bytes each device's collectives move per step (data: the gradient sum; model: the "
        "layers' all-reduces; other: collectives over both axes). CPU devices share one memory: a collective is "
        "a copy here, link hops on a TPU."
    )


def bench_embedding(result: dict[str, Any]) -> None:
    """What ``podscale bench embedding``: tables split by rows against replicated ones."""
    cfg = result.pop("config")
    numbers = ("tables/device", "all-reduce", "reduce-scatter", "all-gather", "temporaries", "peak", "step s", "loss")
    table = report.table(
        "tables",
        *numbers,
        title=(
            f"embedding: {cfg['tables']} tables of {cfg['rows']:,} x {cfg['dim']} float32, batch {cfg['batch']} on "
            f"{cfg['devices']} devices, SGD"
        ),
        numbers=numbers,
    )
    lookups = result.pop("lookups", None)
    for name, r in result.items():
        sent = r["sent_bytes_per_device"]
        table.add_row(
            f"{name} ({r['tables_split']} split)" if name == "split" else name,
            report.size(r["table_bytes_per_device"]),
            report.size(sent.get("all-reduce", 0)),
            report.size(sent.get("reduce-scatter", 0)),
            report.size(sent.get("all-gather", 0)),
            report.size(r["temporaries_bytes"]),
            report.size(r["peak_bytes"]),
            f"{r['step_s']:.4f}",
            f"{r['final_loss']:.6f}",
        )
    console = Console()
    report.show(table, console)
    console.print(
        "Bytes each device's collectives send per step, by kind, from the compiled module. split: the lookups' ids "
        "all-gathered, the looked-up rows reduce-scattered, the rows' cotangents all-gathered, each table's gradient "
        "added where its rows live; replicated: the tables' gradients all-reduced densely. CPU devices share one "
        "memory: a collective is a copy here, link hops on a pod."
    )
    if lookups:
        kinds = ("all-gather", "reduce-scatter", "all-to-all")
        numbers = (*kinds, "seconds", "rows off", "gradient off")
        table = report.table(
            "lookup",
            *numbers,
            title=f"one table's lookup and its gradient, {cfg['batch']} ids, split by rows, two exact ways",
            numbers=numbers,
        )
        for name, r in lookups.items():
            sent = r["sent_bytes_per_device"]
            table.add_row(
                name,
                *(report.size(sent.get(k, 0)) for k in kinds),
                f"{r['seconds']:.5f}",
                f"{r['rows_max_difference']:.1e}",
                f"{r['gradient_max_difference']:.1e}",
            )
        report.show(table, console)
        console.print(
            "An exact all-to-all has static room for all of a device's ids at one device: the masked gather's "
            "bytes, plus the sorting of ids. podscale keeps the masked gather (podscale/bench/lookups.py)."
        )


def bench_gradsum(result: dict[str, Any]) -> None:
    """What ``podscale bench gradsum`` prints: each gradient size's variants."""
    table = report.table(
        "gradient",
        "variant",
        "median s",
        "vs 1d",
        "sent per device, per axis (ring)",
        "max |error|",
        title="gradient summation on 8 CPU devices",
        numbers=("median s", "vs 1d", "max |error|"),
    )
    for gradient, per in result.items():
        base = per.get("1d", {}).get("median_s")
        for name, r in per.items():
            axes = ", ".join(f"{a}: {b / 2**20:,.2f} MiB" for a, b in r["bytes_per_axis"].items())
            table.add_row(
                gradient,
                name,
                f"{r['median_s']:.4f}",
                f"{r['median_s'] / base:.2f}x" if base else "-",
                axes,
                f"{r['max_abs_error']:.1e}",
            )
    report.show(table)


def bench_checkpoint(result: dict[str, Any]) -> None:
    """What ``podscale bench checkpoint`` prints: a sharded state's save, async against sync."""
    table = report.table(
        "save",
        "stall per save s",
        "host memory growth",
        title=(
            f"checkpoint: {result['model']} ({result['config']}) state of {report.size(result['state_bytes'])}, "
            f"{result['replicas']} replicas, sharded update; median of {result['saves']} saves"
        ),
        numbers=("stall per save s", "host memory growth"),
    )
    for mode in ("async", "sync"):
        table.add_row(mode, f"{result[f'{mode}_stall_s']:.3f}", report.size(result[f"{mode}_host_peak_bytes"]))
    console = Console()
    report.show(table, console)
    console.print(
        f"state per device {report.size(result['device_state_bytes'])} of {report.size(result['state_bytes'])}; "
        f"largest buffer written {report.size(result['largest_saved_buffer_bytes'])}; this process writes "
        f"{report.size(result['process_shard_bytes'])}; restored, its fingerprints equal the saved state's: {result['restored_fingerprints_equal']}"
    )
