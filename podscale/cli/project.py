"""``podscale project``: a model's compiled step costed on 16-4096 chips of a TPU or GPU system,
per strategy, every flag and chip count checked before anything is compiled; ``--validate``
(predicted over measured on this CPU) and ``--list-systems`` are modes of it."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys

from podscale.cli.messages import dry_run_result
from podscale.train import distributed

_VALIDATE_ONLY = ("validate_models", "steps")
_PROJECT_MODES = ("json", "validate", "list_systems", "dry_run")


def _project_given(args) -> list[str]:
    """The ``project`` flags given (as dests, in the parser's order); the others get their defaults."""
    given = []
    for dest, default in args.project_defaults.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
        else:
            given.append(dest)
    return given


def _parse_list(flag: str, text: str, example: str) -> list[str]:
    """A comma-separated flag's items: none empty, none twice."""
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise ValueError(f"{flag} {text!r}: an empty item; give comma-separated items, e.g. {example}")
    twice = sorted({item for item in items if items.count(item) > 1})
    if twice:
        raise ValueError(f"{flag} {text!r}: {', '.join(twice)} given twice; give each once")
    return items


def _parse_chips(text: str) -> list[int]:
    example = "16,64,256,1024"
    try:
        chips = [int(c) for c in _parse_list("--chips", text, example)]
    except ValueError as e:
        if str(e).startswith("--chips"):
            raise
        raise ValueError(f"--chips {text!r}: comma-separated whole numbers, e.g. {example}") from None
    if any(c < 1 for c in chips):
        raise ValueError(f"--chips {text!r}: chip counts are whole numbers of at least 1, e.g. {example}")
    return chips


def _check_project_flags(args, given: list[str]) -> None:
    """Refuses, before any work, flags the chosen mode would ignore and numbers out of range."""
    flags = {dest: "--" + dest.replace("_", "-") for dest in given}
    if args.validate and args.list_systems:
        raise ValueError("--validate and --list-systems: give one (each is a command of its own)")
    mode = "--validate" if args.validate else "--list-systems" if args.list_systems else None
    if mode:
        does = {
            "--validate": "measures this CPU and runs fixed tiny workloads (choose them with --validate-models)",
            "--list-systems": "prints the systems and their sources",
        }[mode]
        allowed = {*_PROJECT_MODES, *(_VALIDATE_ONLY if mode == "--validate" else ())}
        ignored = [flags[d] for d in given if d not in allowed]
        if ignored:
            raise ValueError(
                f"{', '.join(ignored)} with {mode}: {mode} {does}, so {'they' if len(ignored) > 1 else 'it'} would "
                f"be ignored; drop {'them' if len(ignored) > 1 else 'it'}, or drop {mode} to project a model"
            )
        if args.validate and args.steps < 1:
            raise ValueError(f"--steps {args.steps}: timed steps per run, a whole number of at least 1")
        return
    ignored = [flags[d] for d in given if d in _VALIDATE_ONLY]
    if ignored:
        raise ValueError(
            f"{', '.join(ignored)}: only with --validate (measuring this CPU); add --validate, or drop "
            f"{'them' if len(ignored) > 1 else 'it'} to project a model"
        )
    for dest in ("weight_update", "grad_sum"):
        if dest in given:
            raise ValueError(
                f"{flags[dest]} {getattr(args, dest)}: podscale project sets the weight update and the gradient sum per "
                f"strategy; drop it and list the strategies with --strategies (of {', '.join(_strategy_names())})"
            )
    for dest in ("per_chip_batch", "global_batch"):
        if dest in given and getattr(args, dest) < 1:
            raise ValueError(f"{flags[dest]} {getattr(args, dest)}: examples, a whole number of at least 1")
        if dest in given and getattr(args, dest) >= 2**31:
            raise ValueError(
                f"{flags[dest]} {getattr(args, dest)}: a batch dimension must be below 2**31 (XLA's 32-bit dimensions)"
            )
    if "bn_group_size" in given and args.bn_group_size < 1:
        raise ValueError(
            f"--bn-group-size {args.bn_group_size}: replicas per batch-norm group, a whole number of at least 1 "
            "(1: the whole global batch)"
        )
    if "learning_rate" in given and not (math.isfinite(args.learning_rate) and args.learning_rate > 0):
        raise ValueError(f"--learning-rate {args.learning_rate}: a positive number, e.g. 1e-3")


def _strategy_names() -> tuple[str, ...]:
    from podscale.projection.mesh import STRATEGIES

    return tuple(STRATEGIES)


def run_project(args) -> int:
    from podscale.compiled import tpu

    with tpu.libtpu_args(args.libtpu_args):  # as a run's LIBTPU_INIT_ARGS, restored after
        return _run_project(args)


def _run_project(args) -> int:
    from podscale.parallel.mesh import MAX_CPU_DEVICES
    from podscale.parallel.strategy import from_flags

    given = _project_given(args)
    _check_project_flags(args, given)

    def progress(message: str) -> None:  # stderr, also under --json: stdout keeps the one result
        print(f"podscale project: {message}", file=sys.stderr, flush=True)

    if args.validate:
        models = args.validate_models
        models = None if models is None else _parse_list("--validate-models", models, "gnmt,ssd")
        distributed.setup(8, distributed.ClusterSpec())
        from podscale.projection.validate import check, print_validation, validate

        if args.dry_run:
            return dry_run_result(args, {"validate": ",".join(check(models, args.steps)), "steps": args.steps})
        result = validate(models=models, steps=args.steps, progress=True)
        print(json.dumps(result)) if args.json else print_validation(result)
        return 0
    if args.list_systems:
        return dry_run_result(args, {"list_systems": True}) if args.dry_run else _print_systems(args.json)
    from podscale.compiled import systems, tpu
    from podscale.compiled.network import Topology
    from podscale.projection import mesh as project_mesh
    from podscale.projection import project as proj
    from podscale.projection import rows as project_rows

    system = systems.get(args.system)
    if "multi_axis" in given and system.kind != "tpu":
        raise ValueError(
            f"--multi-axis {args.multi_axis}: system {system.name} is {system.kind} nodes on a network, not a torus; "
            "--multi-axis says how a collective over several torus dimensions of a TPU slice is costed, and would "
            "change nothing here: drop it"
        )
    chips = _parse_chips(args.chips)
    names = None if args.strategies is None else _parse_list("--strategies", args.strategies, "replicated,sharded")
    from podscale import workloads

    if names is None and args.model in workloads.NAMES:
        names = workloads.get(args.model).project_strategies and list(workloads.get(args.model).project_strategies)
    effective = names or list(project_mesh.DEFAULT_STRATEGIES)
    from podscale.parallel.tensor import with_model_rules

    # the 2-D strategies' knobs: each strategy sets grad_sum itself
    if args.axis_costs is not None or args.grad_sum_phases is not None:
        args.grad_sum = "2d"
    strategy = with_model_rules(from_flags(args), args.model)
    unknown = [s for s in effective if s not in project_mesh.STRATEGIES]
    if unknown:
        raise ValueError(f"--strategies {unknown}: unknown; choose from {', '.join(project_mesh.STRATEGIES)}")
    two_d = [s for s in effective if project_mesh.STRATEGIES[s]["grad_sum"] == "2d"]
    sharded = [s for s in effective if project_mesh.STRATEGIES[s]["weight_update"] in ("sharded", "fsdp")]
    for dest, needed, kind in (
        ("grad_sum_chunks", two_d, "2-D (replicated-2d, sharded-2d)"),
        ("grad_sum_phases", two_d, "2-D (replicated-2d, sharded-2d)"),
        ("axis_costs", two_d, "2-D (replicated-2d, sharded-2d)"),
        ("min_shard_size", sharded, "sharded or fsdp (sharded, sharded-2d, fsdp, fsdp-2d, data-x-fsdp)"),
    ):
        if dest in given and not needed:
            raise ValueError(
                f"--{dest.replace('_', '-')} applies to the {kind} strategies, and --strategies {','.join(effective)} "
                "has none: it would be ignored; drop it or add such a strategy"
            )
    if args.axis_costs == "calibrate":
        raise ValueError(
            "--axis-costs calibrate measures this machine's links, not the target's: give AXIS=BYTES_PER_S:LATENCY_S "
            "for the target mesh's axes (x, y), or leave it out"
        )
    if args.plot is not None:
        project_rows.check_plot_path(args.plot)
    k = strategy.spatial or strategy.model_parallel or 1
    groups = _bn_groups(args, chips, system.devices_per_chip, k, progress)
    # Every mesh, strategy and chip count: refused, or a strategy that does not apply at a chip
    # count noted (a row saying why), before anything is built or compiled.
    reasons = project_mesh.applicability(
        system, chips, names, strategy, args.multi_axis, what="--strategies", bn_group_size=groups, slices=args.slices
    )
    live = [c for c in chips if any(reasons[c, s] is None for s in effective)]
    import jax

    chosen = proj.compiler_for(system, args.compiler, progress)  # tpu, gpu or cpu
    if args.libtpu_args is not None and chosen != "tpu":
        raise ValueError(
            f"--libtpu-args: XLA:TPU's options, and this projection's module is XLA:{chosen.upper()}'s: drop it, or "
            "project a TPU system with --compiler tpu"
        )
    libtpu_args = os.environ.get(tpu.OPTIONS_ENV, "") if chosen == "tpu" else ""  # run_project set --libtpu-args
    tpu.compile_options(libtpu_args)  # an inherited LIBTPU_INIT_ARGS too is checked before anything is compiled
    if libtpu_args:
        progress(f"XLA:TPU's options, as a run's LIBTPU_INIT_ARGS: {libtpu_args}")
    devices = 0 if chosen != "cpu" else min(MAX_CPU_DEVICES, max(c * system.devices_per_chip for c in live))
    if not args.dry_run and chosen == "cpu":  # a dry run compiles nothing: it leaves the devices as they are
        jax.config.update("jax_num_cpu_devices", devices)
    from podscale import workloads
    from podscale.train.tasks import make_task, make_task_optimizer, make_train_step

    task = make_task(args.model, args.data, config=args.config, with_data=args.model not in workloads.NAMES)
    steps = task.config.train_steps if task.workload else 100
    tx = make_task_optimizer(task, args.optimizer, args.learning_rate, steps=steps)
    per_device = task.config.per_core_batch if task.workload else 32
    replica_batches = {c: per_device * k for c in chips}
    for c in live:  # every batch is checked before anything is compiled
        devices_c = c * system.devices_per_chip
        replicas = devices_c // k
        if args.global_batch is not None:
            if args.global_batch % replicas:
                raise ValueError(
                    f"--global-batch {args.global_batch}: the {replicas} replicas of {c} chips "
                    f"({devices_c} devices / {k}) do not divide it; use a multiple of {replicas}"
                )
            replica_batches[c] = args.global_batch // replicas
        elif args.per_chip_batch is not None:
            total = args.per_chip_batch * c
            if total % replicas:
                raise ValueError(
                    f"--per-chip-batch {args.per_chip_batch}: {c} chips x {args.per_chip_batch} = {total} examples "
                    f"do not split over {replicas} replicas; use a multiple of {replicas // math.gcd(replicas, c)}"
                )
            replica_batches[c] = total // replicas
    state = task.state_shapes(tx, task.batch_shapes(k))
    if args.dry_run:
        rows = [
            f"{c} chips: {s} " + (f"n/a ({reasons[c, s]})" if reasons[c, s] else "would compile")
            for c in chips
            for s in effective
        ]
        compiler = {"tpu": "XLA:TPU (libtpu, compile-only)", "gpu": "XLA:GPU (CUDA plugin, compile-only)"}.get(
            chosen, "XLA:CPU"
        )
        return dry_run_result(args, {"system": system.name, "compiler": compiler, "cpu_devices": devices, "rows": rows})
    from podscale.parallel.mesh import BN_GROUP

    rows = []
    for group in dict.fromkeys(groups[c] for c in chips):  # one projection per group size (its model differs)
        these = [c for c in chips if groups[c] == group]
        applies = [s for s in effective if any(reasons[c, s] is None for c in these)]
        if applies:
            grouped = (
                task if group == 1 else make_task(args.model, config=args.config, with_data=False, bn_axis=BN_GROUP)
            )
            rows += proj.project(
                make_train_step(grouped, tx),
                state,
                grouped.batch_shapes,
                system=system,
                chips=these,
                strategies=applies,
                base=strategy,
                replica_batch=replica_batches,
                multi_axis=args.multi_axis,
                progress=progress,
                compiler=chosen,
                bn_group_size=group,
                slices=args.slices,
                tokens_per_example=(
                    task.workload.tokens_per_example(task.config)
                    if task.workload and task.workload.tokens_per_example
                    else None
                ),
            )
        for c in these:
            for s in effective:
                if s not in applies:  # applies at none of this group's chip counts: its row says why
                    topology = Topology(system, c, args.multi_axis, args.slices)
                    row = project_rows.not_applicable_row(
                        topology,
                        s,
                        project_mesh.strategy_for(strategy, s, args.multi_axis, system.kind),
                        replica_batches[c],
                        reasons[c, s],
                    )
                    rows.append(dataclasses.replace(row, bn_group_size=group))
    order = {(c, s): i for i, (c, s) in enumerate((c, s) for c in chips for s in effective)}
    rows = project_rows.mark_fastest(sorted(rows, key=lambda r: order[r.chips, r.strategy]))
    if args.json:
        out = {"system": dataclasses.asdict(system), "libtpu_args": libtpu_args, "rows": [r.to_dict() for r in rows]}
        print(json.dumps(out), flush=True)
    else:
        project_rows.render(rows, system, f"{args.model} ({args.config or 'default'})")
        if libtpu_args:
            print(f"compiled by XLA:TPU with LIBTPU_INIT_ARGS={libtpu_args}")
    if args.plot is not None:
        try:
            project_rows.plot(rows, args.plot, title=f"{args.model} ({args.config or 'default'}) on {system.name}")
        except Exception as e:  # the table is out already: say what failed, keep it
            print(
                f"podscale: error: --plot {args.plot!r}: could not write the plot ({type(e).__name__}: {e}); "
                "the projection above is complete",
                file=sys.stderr,
            )
            return 1
    return 0


def _bn_groups(args, chips: list[int], devices_per_chip: int, k: int, say) -> dict[int, int]:
    """Replicas per batch-norm group at each chip count: ``--bn-group-size`` at every one, or the
    workload's recipe (:func:`~podscale.workloads.base.recipe_bn_group_size`) where its model
    averages batch norm over groups (1 for the others)."""
    from podscale import workloads
    from podscale.train.tasks import bn_group_workloads

    grouped = args.model in bn_group_workloads()
    if args.bn_group_size is not None:
        if args.bn_group_size > 1 and not grouped:
            raise ValueError(
                f"--bn-group-size {args.bn_group_size}: batch-norm groups are for the MLPerf workloads whose batch norm "
                f"takes the group axis ({', '.join(bn_group_workloads())}); model {args.model!r} is not one: drop the "
                "flag"
            )
        return dict.fromkeys(chips, args.bn_group_size)
    if not grouped or args.config is None:
        return dict.fromkeys(chips, 1)
    from podscale.workloads.base import recipe_bn_group_size

    config = workloads.get(args.model).config(args.config)
    groups = {}
    for c in chips:
        replicas = max(1, c * devices_per_chip // k)
        group = recipe_bn_group_size(config, replicas)
        if group > 1 and replicas % group:
            say(
                f"{c} chips: the recipe's batch-norm groups of {group} replicas do not divide its {replicas} replicas: "
                "batch norm over the whole batch there (give --bn-group-size to choose)"
            )
            group = 1
        groups[c] = group
    named = {c: g for c, g in groups.items() if g > 1}
    if named:
        say(
            "batch norm over groups of replicas, as the MLPerf recipe: "
            + ", ".join(f"{c} chips: {g}" for c, g in named.items())
            + " (--bn-group-size 1: over the whole batch)"
        )
    return groups


def _print_systems(as_json: bool) -> int:
    from podscale import render
    from podscale.compiled import systems

    if as_json:
        print(json.dumps([dataclasses.asdict(s) for s in systems.SYSTEMS.values()]))
        return 0
    render.list_systems()
    return 0
