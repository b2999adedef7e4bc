"""What ``podscale plan`` prints: a step's plan as tables, readable at 80 columns on a terminal or
piped. The plan itself (:mod:`podscale.parallel.plan`) is data; this is its one rendering."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from podscale.report import show, size

if TYPE_CHECKING:
    from podscale.parallel.plan import Plan


def plan(plan: Plan, console: Console | None = None) -> None:
    """A plan (:class:`podscale.parallel.plan.Plan`, what ``podscale plan`` prints), readable at 80 columns, on a terminal or piped: numbers are never cut, paths fold."""
    console = console or Console()
    console.print(f"weight update: [bold]{plan.weight_update}[/] on {plan.replicas} replicas, mesh {plan.mesh}")
    g = plan.grad_sum
    how = " then ".join(g["order"]) if g["mode"] == "2d" else ",".join(g["order"])
    extra = (f", {g['chunks']} chunks" if g["mode"] == "2d" else "") + (
        f", summed in {g['dtype']}" if g["dtype"] else ""
    )
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
            f"1/{plan.replicas * leaf['split']}"
            if leaf["sharded"]
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
            f"peak {size(m['peak'])}",
        ]
    console.print("memory per device: " + "; ".join(lines))
    if plan.whole_ops:
        console.print(f"[yellow]computed on whole (gathered) values:[/] {', '.join(plan.whole_ops)}")
    if plan.gathered_ops:
        console.print(f"[yellow]computed on gathered values (not sharded):[/] {', '.join(plan.gathered_ops)}")


def _per_layer(title: str, rows: list[dict[str, Any]], console: Console) -> None:
    table = Table(title=title, title_justify="left")
    table.add_column("layer", overflow="fold")
    table.add_column("kind", no_wrap=True)
    table.add_column("runs", justify="right", no_wrap=True)
    table.add_column("bytes/device", justify="right", no_wrap=True)
    for c in rows:
        table.add_row(c["layer"] or "?", c["kind"], str(c["runs"]), size(c["bytes_per_device"]))
    show(table, console)
