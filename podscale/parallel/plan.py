"""The plan of a data-parallel step, before running it: layouts, collectives, memory."""

from __future__ import annotations

import dataclasses
from typing import Any

from rich.console import Console
from rich.table import Table


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every state leaf's layout, every collective of the step, and per-device memory.

    ``bytes_per_device`` of a collective is the size of the buffer each device contributes.
    Memory figures count the state only (weights and optimizer state), not activations.
    """

    weight_update: str
    replicas: int
    mesh: dict[str, int]
    grad_sum: dict[str, Any]
    """``mode`` (1d/2d), ``order`` (the axis the 2-D sum goes along first, then the other),
    ``chunks``, ``dtype`` (summation dtype) and ``reason`` (why that order)."""
    leaves: list[dict[str, Any]]
    collectives: list[dict[str, Any]]
    gathered_ops: list[str]
    memory: dict[str, int]
    whole_ops: list[str] = dataclasses.field(default_factory=list)
    """Ops of the step that met split data without a rule to run on pieces: computed on
    all-gathered (whole) values. Correct; each costs a collective of its operands."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def render(self, console: Console | None = None) -> None:
        console = console or Console()
        console.print(f"weight update: [bold]{self.weight_update}[/] on {self.replicas} replicas, mesh {self.mesh}")
        g = self.grad_sum
        how = " then ".join(g["order"]) if g["mode"] == "2d" else ",".join(g["order"])
        extra = (f", {g['chunks']} chunks" if g["mode"] == "2d" else "") + (
            f", summed in {g['dtype']}" if g["dtype"] else ""
        )
        console.print(f"gradient sum: [bold]{g['mode']}[/] over {how}{extra}: {g['reason']}")
        leaves = Table("state leaf", "shape", "layout", "shard", "padding", "why", title="state layout")
        for leaf in self.leaves:
            leaves.add_row(
                leaf["path"],
                str(tuple(leaf["shape"])),
                "sharded" if leaf["sharded"] else "replicated",
                str(leaf["shard_shape"]),
                str(leaf["padding_bytes"]),
                leaf["reason"],
            )
        console.print(leaves)
        collectives = Table(
            "collective", "mesh axes", "bytes per device", "chunks", "tensors", "what", title="collectives per step"
        )
        for c in self.collectives:
            collectives.add_row(
                c["kind"],
                ",".join(c["axes"]),
                f"{c['bytes_per_device']:,}",
                str(c["chunks"]),
                str(c["tensors"]),
                c["why"],
            )
        console.print(collectives)
        m = self.memory
        console.print(
            f"per-device state bytes: weights {m['weights_replicated']:,} -> {m['weights']:,}; "
            f"optimizer state {m['optimizer_state_replicated']:,} -> {m['optimizer_state']:,}"
        )
        if self.whole_ops:
            console.print(f"[yellow]computed on whole (gathered) values:[/] {', '.join(self.whole_ops)}")
        if self.gathered_ops:
            console.print(f"[yellow]computed on gathered values (not sharded):[/] {', '.join(self.gathered_ops)}")


def make_plan(dp) -> Plan:
    layout, trace = dp.layout, dp.trace
    leaves = [
        {
            "path": leaf.path,
            "shape": list(leaf.shape),
            "dtype": str(leaf.dtype),
            "sharded": leaf.sharded,
            "shard_shape": [leaf.shard_len] if leaf.sharded else list(leaf.shape),
            "padding_elements": leaf.padding,
            "padding_bytes": leaf.padding_bytes,
            "role": "weight" if leaf.weight else "state",
            "reason": leaf.reason,
        }
        for leaf in layout.leaves
    ]
    weights = [leaf for leaf in layout.leaves if leaf.weight]
    others = [leaf for leaf in layout.leaves if not leaf.weight]
    memory = {
        "weights_replicated": sum(leaf.bytes for leaf in weights),
        "weights": sum(leaf.bytes_per_device() for leaf in weights),
        "optimizer_state_replicated": sum(leaf.bytes for leaf in others),
        "optimizer_state": sum(leaf.bytes_per_device() for leaf in others),
        "padding": sum(leaf.padding_bytes for leaf in layout.leaves),
    }
    return Plan(
        weight_update=dp.weight_update,
        replicas=dp.replicas,
        mesh=dict(dp.mesh.shape),
        grad_sum={
            "mode": dp.grad_sum.mode,
            "order": list(dp.grad_sum.order),
            "chunks": dp.grad_sum.chunks,
            "dtype": None if dp.grad_sum.dtype is None else str(dp.grad_sum.dtype),
            "reason": dp.grad_sum.reason,
        },
        leaves=leaves,
        collectives=[dataclasses.asdict(c) for c in trace.collectives],
        gathered_ops=list(trace.gathered_ops),
        whole_ops=list(getattr(trace, "whole_ops", [])),
        memory=memory,
    )
