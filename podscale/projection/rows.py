"""A projection's results: a :class:`Row` per chip count and strategy (its figures gathered and
built into the row: step time, examples/s, MFU, memory per chip), the fastest marked, and their
table and plot.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from podscale.compiled import hlo
from podscale.compiled.systems import System
from podscale.parallel.strategy import Strategy


@dataclasses.dataclass(frozen=True)
class Row:
    """One chip count and strategy, projected; or, with ``not_applicable`` set, a strategy that
    does not apply at that chip count (its mesh cannot be made there): the reason, and the
    figures ``None``."""

    chips: int
    strategy: str
    devices: int
    topology: str
    mesh: dict[str, int] = dataclasses.field(default_factory=dict)
    global_batch: int | None = None
    replica_batch: int | None = None
    compute_s: float | None = None
    update_s: float | None = None
    communication_s: float | None = None
    """Every collective's time, hidden or not."""
    exposed_s: float | None = None
    hidden_s: float | None = None
    step_s: float | None = None
    examples_per_s: float | None = None
    mfu: float | None = None
    memory_per_chip: float | None = None
    """The chip's memory the program holds at its peak (:func:`~podscale.compiled.hlo.device_bytes`)."""
    host_memory_per_chip: float | None = None
    """Host memory per chip the program's offloaded buffers take (a remat policy's offload), not
    in :attr:`memory_per_chip`."""
    hbm_per_chip: float | None = None
    fits: bool | None = None
    """Whether the program fits the chip: XLA:TPU's verdict where it compiled the row (it refuses a
    program over its memory limit), else :attr:`memory_per_chip` against the datasheet's HBM."""
    collectives: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Per (kind, axes, update or model): runs, buffer bytes, seconds per step, the path."""
    flops_per_device: float | None = None
    halo_bytes: float | None = None
    """Bytes each device sends per step in the halo exchanges: the collective-permutes over the
    space or model axis (:func:`partition_bytes`); ``None`` without such an axis."""
    model_axis_bytes: float | None = None
    """Bytes each device contributes per step to the other collectives over the space or model
    axis (batch-norm statistics, gathers of activations, tensor partitioning's all-reduces, the
    weights' gradients summed over the axis); ``None`` without such an axis."""
    compiled_mesh: dict[str, int] = dataclasses.field(default_factory=dict)
    """The mesh the step was compiled on: the target's, or (past this machine's CPU devices) one
    with a smaller first axis, scaled as :func:`~podscale.projection.cost.cost` says."""
    compiler: str = ""
    """Which compiler made the module costed: ``XLA:TPU v3:4x4`` (the slice compiled for), ``XLA:GPU h100:2x8``
    (nodes x GPUs compiled for) or ``XLA:CPU``."""
    compile_s: float | None = None
    """Seconds the compile of :attr:`compiled_mesh` took (``None``: reused from another row)."""
    does_not_fit: str | None = None
    """The TPU compiler's refusal when the program does not fit the chip's memory (the row's
    figures are then ``None`` but for memory)."""
    terms: dict[str, float] = dataclasses.field(default_factory=dict)
    """The step split by what bounds each op (:func:`~podscale.projection.cost.terms`): ``mxu``,
    ``vector``, ``memory``, ``fixed`` (kernel starts) and ``communication`` (exposed), seconds."""
    step_fast_s: float | None = None
    step_slow_s: float | None = None
    """The step time with every assumed figure of the system at the end of its range that makes
    the step quicker (slower) (:attr:`~podscale.compiled.systems.System.assumed`): the range the
    unsourced constants leave."""
    bn_group_size: int = 1
    """Replicas per batch-norm group (1: batch norm over the whole global batch)."""
    tokens_per_s_per_chip: float | None = None
    """A language model's throughput: the tokens its examples predict per second, per chip
    (``project(..., tokens_per_example=...)``; ``None`` for other workloads)."""
    fastest: bool = False
    not_applicable: str | None = None
    """Why this strategy does not apply at this chip count (``None``: it does, the row is projected)."""

    @property
    def applicable(self) -> bool:
        return self.not_applicable is None

    @property
    def dominant(self) -> str:
        """The term the step spends most in (``""`` without terms)."""
        return max(self.terms, key=self.terms.get) if self.terms else ""

    @property
    def costed(self) -> bool:
        """Whether the row has a step time (it applies, and its program fits the chip)."""
        return self.applicable and self.does_not_fit is None

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "dominant": self.dominant}


def not_applicable_row(topology, name: str, strategy: Strategy, replica_batch: int, reason: str) -> Row:
    k = strategy.spatial or strategy.model_parallel or 1
    replicas = topology.devices // k if topology.devices % k == 0 else None
    return Row(
        chips=topology.chips,
        strategy=name,
        devices=topology.devices,
        topology=topology.describe(),
        global_batch=replica_batch * replicas if replicas else None,
        replica_batch=replica_batch,
        hbm_per_chip=float(topology.system.hbm_bytes),
        not_applicable=reason,
    )


class _Draft(dict):
    """A row's figures while they are gathered (see :func:`draft_row`)."""

    def _replace(self, **fields):
        self.update(fields)
        return self

    def build(self) -> Row:
        system, topology, module, dp = self["system"], self["topology"], self["module"], self["dp"]
        phases, factor = self["phases"], self["factor"]
        compute = phases["forward"] + phases["backward"]
        step_s = compute + phases["update"] + self["exposed"]
        model_flops = sum(o.matmul_flops * o.count for o in module.ops if o.phase != "update")
        # the compiler's peak of its buffer assignment where it gives one (what is live at once),
        # less what a remat policy offloads to host memory
        per_device = hlo.device_bytes(module.memory)
        if factor > 1 and self["strategy"].state_scales(next(iter(self["target"]))):
            # the sharded (or FSDP-chunked) state's shards are ``factor`` times smaller at the target
            shards = sum(leaf.bytes_per_device() for leaf in dp.placement.state.leaves if leaf.sharded or leaf.chunked)
            per_device -= shards * (1 - 1 / factor)
        memory = per_device * system.devices_per_chip
        k = self["strategy"].spatial or self["strategy"].model_parallel or 1
        global_batch = self["replica_batch"] * self["replicas"]
        return Row(
            chips=topology.chips,
            strategy=self["name"],
            devices=topology.devices,
            mesh=self["target"],
            topology=topology.describe(),
            global_batch=global_batch,
            replica_batch=self["replica_batch"],
            compute_s=compute,
            update_s=phases["update"],
            communication_s=sum(c["seconds"] for c in self["collectives"]),
            exposed_s=self["exposed"],
            hidden_s=self["hidden"],
            step_s=step_s,
            examples_per_s=global_batch / step_s if step_s else 0.0,
            mfu=model_flops / (step_s * system.device_peak("bf16")) if step_s else 0.0,
            memory_per_chip=float(memory),
            host_memory_per_chip=float(module.memory.get("host_temporaries", 0) * system.devices_per_chip),
            hbm_per_chip=float(system.hbm_bytes),
            # the compiler's verdict where it checks the chip's memory (XLA:TPU), else the datasheet's
            fits=True if self.get("memory_checked") else memory <= system.hbm_bytes,
            collectives=self["collectives"],
            flops_per_device=module.flops(),
            **dict(zip(("halo_bytes", "model_axis_bytes"), partition_bytes(self["collectives"], self["target"], k))),
            compiled_mesh=self["compiled_shape"],
            compiler=self["compiler"],
            compile_s=self.get("compile_s"),
            terms=dict(self.get("terms") or {}),
            step_fast_s=self.get("step_fast_s"),
            step_slow_s=self.get("step_slow_s"),
        )


def partition_bytes(
    collectives: list[dict[str, Any]], mesh: dict[str, int], k: int
) -> tuple[float | None, float | None]:
    """(halo bytes, model-axis bytes) per device per step of a projected row's ``collectives``
    (:func:`~podscale.projection.cost.cost`'s rows, buffer bytes times runs) on ``mesh``, whose
    last axis is the space or model axis of ``k`` devices: the collective-permutes over it, and
    the other collectives over it (alone or with data axes). A collective whose groups follow no
    mesh axis (XLA's groups within a replica, e.g. pairs of the 4 devices of an image split where
    the height is uneven) counts as over it when its groups are no larger than a replica's ``k``
    devices and divide them. ``(None, None)`` when ``k`` is 1."""
    if k <= 1 or not mesh:
        return None, None
    axis = list(mesh)[-1]
    halo = other = 0.0
    for c in collectives:
        axes = c["axes"]
        inside = axis in axes or (not axes and c["group_size"] <= k and k % c["group_size"] == 0)
        if not inside:
            continue
        if c["kind"] == "collective-permute":
            halo += c["buffer_bytes"]
        else:
            other += c["buffer_bytes"]
    return halo, other


def draft_row(system, topology, name, strategy, replica_batch, target, compiled_shape, factor, dp, module) -> _Draft:
    k = strategy.spatial or strategy.model_parallel or 1
    return _Draft(
        system=system,
        topology=topology,
        name=name,
        strategy=strategy,
        replica_batch=replica_batch,
        replicas=topology.devices // k,
        target=target,
        compiled_shape=compiled_shape,
        factor=factor,
        dp=dp,
        module=module,
    )


def mark_fastest(rows: list[Row]) -> list[Row]:
    """The rows, with ``fastest`` set on the quickest strategy that fits at each chip count (rows
    that do not apply are never the fastest)."""
    best: dict[int, Row] = {}
    for r in rows:
        if r.costed and r.fits and (r.chips not in best or r.step_s < best[r.chips].step_s):
            best[r.chips] = r
    return [dataclasses.replace(r, fastest=best.get(r.chips) is r) for r in rows]


def render(rows: list[Row], system: System, what: str, console=None) -> None:
    from rich.console import Console

    from podscale import report

    console = console or Console()
    partitioned = any(r.halo_bytes is not None for r in rows)
    moved = ("halo MB", "model-axis MB") if partitioned else ()
    tokens = any(r.tokens_per_s_per_chip is not None for r in rows)
    numbers = (
        "compute ms",
        "update ms",
        "comm ms (hidden)",
        *moved,
        "step ms",
        "range ms",
        "examples/s",
        *(("tokens/s/chip",) if tokens else ()),
        "MFU",
        "GiB/chip",
    )
    table = report.table(
        "chips",
        "strategy",
        *numbers,
        "fits",
        "bound by",
        "compiled (mesh, seconds)",
        title=f"{what} projected to {system.name} (per step; * fastest that fits; n/a: does not apply, see below)",
        numbers=("chips", *numbers),
    )
    for r in rows:
        if not r.costed:
            memory = f"{r.memory_per_chip / 2**30:.2f}/{r.hbm_per_chip / 2**30:.0f}" if r.memory_per_chip else "-"
            fits = "n/a" if not r.applicable else "NO"
            table.add_row(str(r.chips), r.strategy, *(["-"] * (len(numbers) - 1)), memory, fits, "-", compiled_text(r))
            continue
        table.add_row(
            str(r.chips),
            r.strategy + (" *" if r.fastest else ""),
            f"{r.compute_s * 1e3:.3f}",
            f"{r.update_s * 1e3:.3f}",
            f"{r.exposed_s * 1e3:.3f} ({r.hidden_s * 1e3:.3f})",
            *([_mb(r.halo_bytes), _mb(r.model_axis_bytes)] if partitioned else []),
            f"{r.step_s * 1e3:.3f}",
            _range(r),
            f"{r.examples_per_s:,.0f}",
            *([f"{r.tokens_per_s_per_chip:,.0f}"] if tokens else []),
            f"{r.mfu:.1%}",
            f"{r.memory_per_chip / 2**30:.2f}/{r.hbm_per_chip / 2**30:.0f}",
            "yes" if r.fits else "NO",
            bound_text(r),
            compiled_text(r),
        )
    report.show(table, console)
    seen = set()
    for r in rows:
        if r.chips in seen:
            continue
        seen.add(r.chips)
        batch = next((x for x in rows if x.chips == r.chips and x.global_batch is not None), r)
        groups = (
            f"; batch norm over groups of {r.bn_group_size} replicas ({r.bn_group_size * batch.replica_batch} examples)"
            if r.bn_group_size > 1
            else ""
        )
        console.print(
            f"{r.chips} chips: {r.topology}; global batch {batch.global_batch} ({batch.replica_batch} per replica)"
            + groups
        )
    for r in rows:
        if not r.applicable:
            console.print(f"  {r.chips} chips, {r.strategy}: not applicable: {r.not_applicable}", markup=False)
        elif r.does_not_fit:
            console.print(f"  {r.chips} chips, {r.strategy}: does not fit: {r.does_not_fit}", markup=False)
        elif r.compiled_mesh != r.mesh:
            console.print(f"  {r.chips} chips, {r.strategy}: compiled on mesh {r.compiled_mesh}, scaled to {r.mesh}")
        if r.host_memory_per_chip:
            console.print(
                f"  {r.chips} chips, {r.strategy}: {r.host_memory_per_chip / 2**30:.2f} GiB per chip offloaded to host "
                "memory (not in GiB/chip)"
            )
    if partitioned:
        console.print(
            "halo MB, model-axis MB = per device per step, the collective-permutes over the space or model axis (the "
            "halos), and its other collectives' buffers (batch-norm statistics, gathered activations, partial sums)"
        )
    console.print(
        "comm = exposed communication; (hidden) = communication overlapped with compute (XLA:TPU's and XLA:GPU's "
        "modules: by their schedule, between each collective's start and done; XLA:CPU's: the gradient sums but the "
        "last, behind the backward pass). range = the step with every assumed figure of the system (HBM efficiency, kernel start, "
        "transcendental rate, hop latency) at either end of its range; bound by = the terms the step spends most in "
        "(mxu, vector, memory, fixed kernel starts, exposed communication). "
        "Costs and sources: podscale project --list-systems; formulas: docs/benchmarks.md"
    )


def _range(row: Row) -> str:
    if row.step_fast_s is None or row.step_slow_s is None:
        return "-"
    return f"{row.step_fast_s * 1e3:.3g}-{row.step_slow_s * 1e3:.3g}"


def bound_text(row: Row) -> str:
    """The two largest terms of a row's step and their shares: ``mxu 61%, memory 22%``."""
    total = sum(row.terms.values())
    if not total:
        return "-"
    top = sorted(row.terms.items(), key=lambda kv: -kv[1])[:2]
    return ", ".join(f"{k} {v / total:.0%}" for k, v in top if v > 0)


def _mb(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e6:.2f}"


def compiled_text(row: Row) -> str:
    """Which compiler made a row's module, for which mesh, and how long it took:
    ``XLA:TPU v3:4x4 32 (74 s)``; ``(reused)`` when another row's compile is costed again."""
    if not row.compiler:
        return "-"
    mesh = "x".join(map(str, row.compiled_mesh.values()))
    took = "reused" if row.compile_s is None else f"{row.compile_s:.0f} s"
    return f"{row.compiler} {mesh} ({took})"


def plot_formats() -> dict[str, str]:
    """The file suffixes (without the dot) matplotlib writes here -> their description."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    return Figure().canvas.get_supported_filetypes()


def check_plot_path(path: str, what: str = "--plot") -> None:
    """Refuses, before any work, a plot path that cannot be written: a suffix matplotlib does not
    write, a folder that does not exist or is not writable (probed by creating a file there, as
    permission bits say nothing to root), a folder given as the file. ``what`` names it."""
    import os
    import tempfile

    formats = plot_formats()
    choices = ", ".join(f".{f}" for f in sorted(formats))
    if not path or not path.strip():
        raise ValueError(f"{what} {path!r}: give a file name, e.g. scaling.png")
    if os.path.isdir(path):
        raise ValueError(f"{what} {path!r}: a folder; give a file name in it, e.g. {os.path.join(path, 'scaling.png')}")
    suffix = os.path.splitext(path)[1].lower().lstrip(".")
    if suffix not in formats:
        said = f"the suffix .{suffix}" if suffix else "no suffix"
        raise ValueError(f"{what} {path!r}: {said}; name a file matplotlib can write: {choices}")
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"{what} {path!r}: {folder} is a file, not a folder; write elsewhere")
    if not os.path.isdir(folder):
        raise ValueError(f"{what} {path!r}: the folder {folder} does not exist; create it or write elsewhere")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".podscale-plot-probe-"):
            pass
    except OSError as e:
        raise ValueError(f"{what} {path!r}: cannot write in {folder} ({e.strerror or e}); write elsewhere") from None


def plot(rows: list[Row], path: str, title: str = "") -> None:
    """Step time and throughput against chips, a line per strategy (rows that do not apply are
    left out); around each step-time line, the range the assumed figures leave."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    applicable = [r for r in rows if r.costed]
    for name in dict.fromkeys(r.strategy for r in applicable):
        mine = sorted((r for r in applicable if r.strategy == name), key=lambda r: r.chips)
        chips = [r.chips for r in mine]
        (line,) = left.plot(chips, [r.step_s * 1e3 for r in mine], marker="o", label=name)
        ranged = [r for r in mine if r.step_fast_s is not None and r.step_slow_s is not None]
        if ranged:  # the range the assumed figures leave
            left.fill_between(
                [r.chips for r in ranged],
                [r.step_fast_s * 1e3 for r in ranged],
                [r.step_slow_s * 1e3 for r in ranged],
                color=line.get_color(),
                alpha=0.2,
                linewidth=0,
            )
        right.plot(chips, [r.examples_per_s for r in mine], marker="o", label=name)
    for ax, label in ((left, "step time (ms)"), (right, "examples / s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("chips")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    right.set_yscale("log")
    left.legend()
    fig.suptitle(title)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)
