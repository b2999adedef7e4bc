"""The plan of a data-parallel step, before running it: layouts, collectives, memory."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from podscale.compiled.hlo import layer_of, ring_bytes
from podscale.parallel import spatial

RESHUFFLES = ("all-to-all", "collective-permute")
"""Collectives over a model axis that move a value between its partitions' layouts (no sum, no
gather): XLA's reshuffles, where two layouts of one value disagree."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every state leaf's layout, every collective of the step, and per-device memory.

    ``bytes_per_device`` of a collective is the size of the buffer each device contributes (an
    all-reduce's operand, a reduce-scatter's input, an all-gather's shard). ``memory`` holds the
    state per device (weights, optimizer state), the local gradients, and, when the step was
    compiled, ``memory_analysis()``'s figures per device (``temporaries``: activations, gradients
    and workspace; ``peak``). ``compiled`` is what the compiled module runs per device per step
    (``podscale.compiled.hlo``): collectives by kind, mesh axes and dtype, loops counted with their
    trip counts. ``traffic`` compares the bytes the gradient sum, the norms of the sharded update
    and the weight gather send per device with one ring all-reduce of the gradients.
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
    traffic: dict[str, Any] = dataclasses.field(default_factory=dict)
    compiled: dict[str, Any] | None = None
    spatial: dict[str, Any] | None = None
    """With ``spatial``: the space axis, its partitions, the layers whose height it does not
    divide (XLA pads them), and, compiled, the halo exchanges' bytes per device per step."""

    tensor: dict[str, Any] | None = None
    """With ``model_parallel``: the model axis, its partitions, the rules, what they left undone,
    the split leaves' bytes per device, the sharded leaves chunked per model partition
    (``chunked_per_partition``) and, compiled, the model axis's collectives per layer and its
    ``reshuffles``: the all-to-alls and collective-permutes over it (runs and bytes per device
    per step; zero when every split weight's chunks lie in its model partition's slice)."""

    regions: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """The step's regions partitioned by hand (:func:`podscale.sum_over_blocks`), one row each:
    ``name``, ``rule``, ``axis``, ``partitions``, ``by_hand`` (or ``why`` not), the bytes per
    device its sums over the axis take (``summed_bytes_per_device``: the forward's results, the
    backward's whole inputs' gradients) and, compiled, ``compiled_bytes_per_device``: the buffers
    of the collectives over the axis whose ``op_name`` names the region (one XLA combined with
    another layer's counts whole)."""

    tables: dict[str, Any] | None = None
    """With embedding tables (weights the step looks up by rows): ``min_table_rows`` (the least of
    the tables' thresholds) and, per table, its ``min_rows``, where it went (``rows over data axes`` or ``replicated``, and why) with its bytes per
    device, then the lookups' and gradients' collectives over the data axes with their bytes per
    device per step (:mod:`podscale.parallel.tables`)."""

    fsdp: dict[str, Any] | None = None
    """With ``weight_update="fsdp"``: the leaves stored chunked (``chunked_leaves``) and those left
    whole with why (``whole``), the gathers and reduce-scatters the partitioner adds, each with its
    runs per step (a scanned layer's: once per layer), and, compiled, the module's all-gathers and
    reduce-scatters over the data axes with their runs (``compiled``; those inside a loop run
    once per iteration)."""

    eval: dict[str, int] | None = None
    """The evaluation step's ``memory_analysis()`` figures per device (``arguments``, ``outputs``,
    ``temporaries``, ``peak``), compiled on the same placement and batch shapes; filled by whoever
    knows the eval function (``podscale plan --eval``), ``None`` otherwise."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def make_plan(placement, trace, grad_sum, strategy, compiled=None, batch=None) -> Plan:
    """The plan of a step from what it reads and what its traced program did: its ``placement``
    (:class:`~podscale.parallel.placement.Placement`), the ``trace`` of one batch signature
    (``weight_update.Trace``), its ``grad_sum`` and ``strategy``, and that signature's
    ``batch`` placement (the example batch's by default). ``compiled``: the step's module as
    :func:`podscale.compiled.hlo.read` gives it, or ``None``."""
    layout = placement.state
    batch = placement.batch if batch is None else batch
    leaves = [
        {
            "path": leaf.path,
            "shape": list(leaf.shape),
            "dtype": str(leaf.dtype),
            "sharded": leaf.sharded or leaf.chunked,  # stored 1/N over the replicas: flat, or along a dim
            "table_rows": leaf.stored.rows if leaf.table else 0,
            "shard_shape": leaf.local_shape(),
            "padding_elements": leaf.stored.padding,
            "padding_bytes": leaf.padding_bytes,
            "bytes_per_device": leaf.bytes_per_device(),
            "split": getattr(leaf.stored, "split", 1),
            "model_dim": leaf.model_dim,
            "model_split": leaf.model_split,
            "fsdp_dim": leaf.stored.dim if leaf.chunked else None,
            "role": "weight" if leaf.weight else "state",
            "reason": leaf.reason,
        }
        for leaf in layout.leaves
    ]
    weights = [leaf for leaf in layout.leaves if leaf.weight]
    others = [leaf for leaf in layout.leaves if not leaf.weight]
    summed_weights = [leaf for leaf in weights if not leaf.table]  # a split table's gradient is not summed
    memory = {
        "weights_replicated": sum(leaf.bytes for leaf in weights),
        "weights": sum(leaf.bytes_per_device() for leaf in weights),
        "optimizer_state_replicated": sum(leaf.bytes for leaf in others),
        "optimizer_state": sum(leaf.bytes_per_device() for leaf in others),
        "padding": sum(leaf.padding_bytes for leaf in layout.leaves),
        "gradients": _gradient_bytes(weights, None),
    }
    if compiled is not None:
        memory.update(compiled.memory)
    sizes = dict(placement.mesh.shape)
    update = model = 0.0
    for c in trace.collectives:
        n = math.prod(sizes[a] for a in c.axes)
        sent = ring_bytes(c.kind, n, c.bytes_per_device) * getattr(c, "runs", 1)
        if c.update:
            update += sent
        else:
            model += sent
    summed = _gradient_bytes(summed_weights, grad_sum.dtype, per_device=False)  # as the sum sees them
    # A weight used in several 16-bit products: one device rounds each use's gradient to 16 bits
    # before adding them, so each is summed over the replicas apart (exactness's own bytes).
    apart = getattr(trace, "summed_apart_bytes", 0)
    limit = ring_bytes("all-reduce", placement.replicas, summed + apart)
    traffic = {
        "gradient_bytes": summed,
        "summed_apart_bytes": apart,
        "all_reduce_bytes": limit,
        "update_bytes": update,
        "model_bytes": model,
        "ratio": update / limit if limit else 0.0,
    }
    return Plan(
        weight_update=strategy.weight_update,
        replicas=placement.replicas,
        mesh=dict(placement.mesh.shape),
        grad_sum={
            "mode": grad_sum.mode,
            "order": list(grad_sum.order),
            "chunks": grad_sum.chunks,
            "phases": grad_sum.phases if grad_sum.mode == "2d" else None,
            "dtype": None if grad_sum.dtype is None else str(grad_sum.dtype),
            "reason": grad_sum.reason,
        },
        leaves=leaves,
        collectives=[dataclasses.asdict(c) for c in trace.collectives],
        gathered_ops=list(trace.gathered_ops),
        whole_ops=list(getattr(trace, "whole_ops", [])),
        memory=memory,
        traffic=traffic,
        compiled=None if compiled is None else compiled.to_dict(),
        spatial=_spatial(placement, batch, compiled),
        tensor=_tensor(placement, strategy, compiled),
        regions=_regions(getattr(trace, "regions", []), compiled),
        tables=_tables(placement, trace),
        fsdp=_fsdp(placement, strategy, trace, compiled),
    )


def _fsdp(placement, strategy, trace, compiled) -> dict[str, Any] | None:
    if strategy.weight_update != "fsdp":
        return None
    layout = placement.state
    ours = [c for c in trace.collectives if "chunk" in c.why]
    out = {
        "chunked_leaves": sum(leaf.chunked for leaf in layout.leaves),
        "whole": [{"path": leaf.path, "reason": leaf.reason} for leaf in layout.leaves if not leaf.chunked],
        "collectives": [
            {"kind": c.kind, "bytes_per_device": c.bytes_per_device, "runs": c.runs, "why": c.why} for c in ours
        ],
        "per_layer": sum(1 for c in ours if c.runs > 1),
    }
    if compiled is not None:
        data = set(placement.roles.data)
        out["compiled"] = [
            {"kind": c.kind, "layer": c.layer, "runs": c.count, "buffer_bytes": c.buffer_bytes, "dtype": c.dtype}
            for c in compiled.collectives
            if c.kind in ("all-gather", "reduce-scatter") and set(c.axes) & data
        ]
    return out


def _tables(placement, trace) -> dict[str, Any] | None:
    if not placement.looked_up:
        return None
    layout = placement.state
    rows = []
    for i, least in zip(placement.looked_up, placement.min_table_rows, strict=True):
        leaf = layout.leaves[i]
        if leaf.table:
            where, why = "rows over data axes", f"{leaf.shape[0]:,} rows >= {least:,}"
        else:
            where, why = (
                "replicated",
                leaf.reason
                if leaf.model_dim is not None
                else (
                    f"{leaf.shape[0]:,} rows < {least:,} (the ids a step looks up from it): its gradient is "
                    "all-reduced with the others"
                ),
            )
        state = [o for o in layout.leaves if o.table and not o.weight and o.shape == leaf.shape]
        rows.append(
            {
                "path": leaf.path,
                "shape": list(leaf.shape),
                "placement": where,
                "why": why,
                "min_rows": least,
                "bytes": leaf.bytes,
                "bytes_per_device": leaf.bytes_per_device(),
                "optimizer_state_bytes_per_device": sum(o.bytes_per_device() for o in state),
            }
        )
    table_ops = [c for c in trace.collectives if "table" in c.why or "looked-up rows" in c.why]
    return {
        "min_table_rows": min(placement.min_table_rows),
        "tables": rows,
        "collectives": [dataclasses.asdict(c) for c in table_ops],
    }


def _tensor(placement, strategy, compiled) -> dict[str, Any] | None:
    model = placement.roles.model
    if not model:
        return None
    split = [leaf for leaf in placement.state.leaves if leaf.model_dim is not None]
    out = {
        "axis": model,
        "partitions": placement.mesh.shape[model],
        "rules": strategy.rules.name,
        "notes": list(placement.rule_notes),
        "split_leaves": len(split),
        "split_bytes": sum(leaf.bytes for leaf in split),
        "split_bytes_per_device": sum(leaf.bytes_per_device() for leaf in split),
        "chunked_per_partition": sum(
            1 for leaf in placement.state.leaves if leaf.sharded and leaf.stored.by is not None
        ),
    }
    if compiled is not None:
        per: dict[tuple[str, str], dict[str, Any]] = {}
        for c in compiled.collectives:
            if model not in c.axes:
                continue
            row = per.setdefault(
                (c.layer, c.kind), {"layer": c.layer, "kind": c.kind, "runs": 0, "bytes_per_device": 0}
            )
            row["runs"] += c.count
            row["bytes_per_device"] += c.buffer_bytes * c.count
        out["collectives"] = list(per.values())
        out["collective_bytes_per_device"] = sum(r["bytes_per_device"] for r in per.values())
        moves = [c for c in compiled.collectives if model in c.axes and c.kind in RESHUFFLES]
        out["reshuffles"] = {
            **{kind: sum(c.count for c in moves if c.kind == kind) for kind in RESHUFFLES},
            "bytes_per_device": sum(c.buffer_bytes * c.count for c in moves),
        }
    return out


def _spatial(placement, batch, compiled) -> dict[str, Any] | None:
    space = placement.roles.space
    if not space:
        return None
    out = {
        "axis": space,
        "partitions": placement.mesh.shape[space],
        "image_leaves": sum(batch.images or ()),
        "layers": len(spatial.summary(list(batch.windows))),
        "uneven_layers": list(batch.uneven),
    }
    if compiled is not None:
        halos = [c for c in compiled.collectives if c.kind == "collective-permute"]
        out["halo_exchanges"] = sum(c.count for c in halos)
        out["halo_bytes_per_device"] = sum(c.buffer_bytes * c.count for c in halos)
        # Everything else the space axis moves: what XLA gathers or sums over the partitions
        # (a ranking over the whole image, pooled regions, the weights' gradients), per layer.
        per: dict[tuple[str, str], dict[str, Any]] = {}
        for c in compiled.collectives:
            if c.kind == "collective-permute" or space not in c.axes:
                continue
            layer = _layers(c.op_name)
            row = per.setdefault((layer, c.kind), {"layer": layer, "kind": c.kind, "runs": 0, "bytes_per_device": 0})
            row["runs"] += c.count
            row["bytes_per_device"] += c.buffer_bytes * c.count
        out["gathers"] = sorted(per.values(), key=lambda r: -r["bytes_per_device"])
        out["gather_bytes_per_device"] = sum(r["bytes_per_device"] for r in per.values())
    return out


def _regions(passes: list[dict], compiled) -> list[dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for note in passes:
        row = rows.setdefault(
            note["region"],
            {
                "name": note["region"],
                "rule": note["rule"],
                "axis": note["axis"],
                "partitions": note["partitions"],
                "by_hand": True,
                "passes": [],
                "summed_bytes_per_device": 0,
            },
        )
        row["passes"].append(note["pass"])
        row["summed_bytes_per_device"] += note["summed_bytes_per_device"]
        if not note["by_hand"]:
            row["by_hand"], row["why"] = False, note["why"]
    if compiled is not None:
        for row in rows.values():
            row["compiled_bytes_per_device"] = sum(
                c.buffer_bytes * c.count
                for c in compiled.collectives
                if row["axis"] in c.axes and c.kind != "collective-permute" and row["name"] in c.op_name
            )
    return list(rows.values())


def _layers(op_name: str) -> str:
    """The layers of a collective XLA combined from several (its ``op_name`` joins theirs with
    ``:``), each once, in order: ``roi_align_14x14, rpn_targets (forward)``."""
    names: list[str] = []
    for part in op_name.split(":"):
        layer = layer_of(part).removesuffix(" (forward)").removesuffix(" (backward)")
        if layer and layer not in names:
            names.append(layer)
    if not names:
        return ""
    return ", ".join(names) + (" (backward)" if "transpose(" in op_name else " (forward)")


def _gradient_bytes(weights, dtype, per_device: bool = True) -> int:
    """Bytes per device of the gradients of the float weights (a split weight's are split alike),
    in ``dtype`` (``None``: their own)."""
    total = 0
    for leaf in weights:
        if jnp.issubdtype(leaf.dtype, jnp.inexact) and not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            itemsize = np.dtype(dtype).itemsize if dtype is not None else np.dtype(leaf.dtype).itemsize
            # A table's gradient lives with its rows; a chunked weight's is reduce-scattered into its chunks (FSDP).
            count = leaf.stored.per_device(leaf.shape, leaf.model_split) if per_device else math.prod(leaf.shape)
            total += count * itemsize
    return int(total)
