"""podscale: run an unmodified single-device JAX training step data-parallel on all devices."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import warnings

from podscale.parallel.checks import PodscaleWarning
from podscale.train import distributed, supervise
from podscale.train.interrupt import Interrupted

# The modules that load JAX (the parallel layer, checkpoints, the trainer) are imported where a
# command needs them: ``podscale launch`` and the supervisor of each process of a multi-process
# run (``_supervise_before_jax``) start without loading JAX.


def parse_shape(text: str) -> tuple[int, ...]:
    """``--mesh``: argparse shows an ``ArgumentTypeError``'s own message."""
    from podscale.parallel.mesh import parse_shape as _parse_shape

    try:
        return _parse_shape(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix(f"--mesh {text!r}: ")) from None


DRY_RUN_HELP = (
    "check every flag, output path and the mesh and batch arithmetic, as a run does before any work, "
    "then exit 0 without running (with --json: one object saying what would run)"
)


def _dry_run_result(args, what: dict) -> int:
    """What ``--dry-run`` prints once every check has passed: nothing was run."""
    if getattr(args, "json", False):
        print(json.dumps({"dry_run": True, **what}), file=_JSON_OUT[0] or sys.stdout, flush=True)
    else:
        shown = ", ".join(
            f"{k} {v}" for k, v in what.items() if v is not None and k != "dry_run" and not isinstance(v, list)
        )
        print(f"podscale {args.command}: dry run: the flags check out ({shown}); nothing was run")
        for v in what.values():
            if isinstance(v, list):
                print("\n".join(f"  {item}" for item in v))
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse's own refusals (an unknown flag, ``--steps x``) as podscale's: one ``podscale:
    error:`` line after the usage, exit code 2, and under ``--json`` one JSON object on stdout."""

    argv: list[str] = []

    def error(self, message: str):
        text = f"{self.prog}: {message} ({self.prog} --help lists what it takes)"
        print(f"podscale: error: {text.removeprefix('podscale: ')}", file=sys.stderr)
        command = self.argv[: self.argv.index("--")] if "--" in self.argv else self.argv
        if "--json" in command:
            print(json.dumps({"error": text, "exit_code": 2}), flush=True)
        sys.exit(2)


def _dry_run_launch(args, cmd: list[str]) -> int:
    """``launch --dry-run``: launch's flags, then a podscale command's dry run as process 0 of
    ``--processes`` (a child process, as launch would start it, that joins nothing)."""
    import subprocess

    child = distributed.check_launch(args.processes, cmd, args.grace)
    if child[1:3] != ["-m", "podscale.cli"]:
        print(f"podscale launch: dry run: {args.processes} processes of {' '.join(cmd)}; nothing was run")
        return 0
    env = dict(
        os.environ,
        **{
            distributed.ENV_COORDINATOR: "127.0.0.1:1",
            distributed.ENV_NUM_PROCESSES: str(args.processes),
            distributed.ENV_PROCESS_ID: "0",
        },
    )
    return subprocess.run([*child, "--dry-run"], env=env).returncode


def _train_parser(sub) -> None:
    from podscale.parallel.strategy import add_flags
    from podscale.train.trainer import TrainConfig

    p = sub.add_parser("train", help="train a model data-parallel on all devices")
    defaults = TrainConfig()
    p.add_argument(
        "--model",
        default=defaults.model,
        help="mlp, cnn, resnet, transformer, or an MLPerf workload: resnet50, transformer-big, bert-large, gnmt, ssd",
    )
    p.add_argument("--config", default=None, help="MLPerf workloads: tiny (trains on CPU) or full (MLPerf size)")
    p.add_argument("--data", default=None, help="digits or synthetic (default); MLPerf workloads bring their own")
    p.add_argument(
        "--optimizer",
        default=None,
        help="sgd, momentum, adam (default), adamw, lamb, lars, ...; MLPerf workloads default to their recipe",
    )
    p.add_argument(
        "--learning-rate", type=float, default=None, help="default 1e-3; MLPerf workloads: the recipe's peak"
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="global batch size over all replicas (default 64, or the workload config's)",
    )
    p.add_argument(
        "--precision",
        default=defaults.precision,
        choices=["bf16", "float32"],
        help="MLPerf workloads: bf16 compute with float32 state (default), or float32 throughout",
    )
    p.add_argument(
        "--bn-group-size",
        type=int,
        default=1,
        help="average batch-norm statistics over groups of this many neighbouring replicas",
    )
    p.add_argument("--mllog", default=None, help="MLPerf-format log file (default: WORKDIR/mllog.txt)")
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--eval-every", type=int, default=defaults.eval_every, help="0: evaluate only at the end")
    p.add_argument("--eval-batch-size", type=int, default=None)
    p.add_argument("--checkpoint-every", type=int, default=None, help="with --workdir (default 100)")
    p.add_argument("--workdir", default=None, help="checkpoints and metrics.jsonl go here")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --workdir")
    p.add_argument(
        "--resume-fallback",
        action="store_true",
        help="with --resume: set a damaged latest checkpoint aside (saying so) and resume from the newest intact one",
    )
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument(
        "--target",
        type=float,
        default=None,
        help="held-out metric (accuracy; exact_match or mlm_accuracy for workloads) to stop at; reports time to target",
    )
    p.add_argument(
        "--mesh", type=parse_shape, default=None, help="mesh shape such as 8 or 4x2 (default: all devices, 1-D)"
    )
    p.add_argument("--metrics-file", default=None, help="JSON-lines metrics (default: WORKDIR/metrics.jsonl)")
    p.add_argument("--export", default=None, help="write the final parameters to this .npz file")
    p.add_argument("--json", action="store_true", help="print one JSON summary object at the end")
    p.add_argument("--no-progress", action="store_true", help="do not show the progress bar")
    p.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    add_flags(p)
    g = p.add_argument_group("devices and processes")
    g.add_argument(
        "--replicas",
        type=int,
        default=None,
        help=f"total replicas; on CPU this many devices are simulated (default {distributed.DEFAULT_CPU_REPLICAS} on CPU, all devices elsewhere)",
    )
    g.add_argument("--coordinator-address", default=None, help="host:port of process 0 (multi-process)")
    g.add_argument("--num-processes", type=int, default=None)
    g.add_argument("--process-id", type=int, default=None)
    g.add_argument(
        "--distributed-auto",
        action="store_true",
        help="let jax.distributed.initialize() detect the cluster (SLURM, TPU pods)",
    )
    g.add_argument(
        "--heartbeat-timeout", type=int, default=HEARTBEAT_S, help="seconds before a silent peer is declared dead"
    )
    g.add_argument(
        "--join-timeout",
        type=int,
        default=JOIN_S,
        help="seconds the processes wait for each other to reach the coordinator",
    )


HEARTBEAT_S, JOIN_S = 30, 60
"""``--heartbeat-timeout`` and ``--join-timeout``'s defaults."""

_JSON_OUT = [None]
"""Where ``--json`` output goes once ``train`` has pointed file descriptor 1 at stderr."""


def _cluster_spec(args) -> distributed.ClusterSpec:
    return distributed.ClusterSpec.from_env(
        coordinator_address=args.coordinator_address,
        num_processes=args.num_processes,
        process_id=args.process_id,
        auto=args.distributed_auto or None,
        heartbeat_timeout_s=args.heartbeat_timeout,
        join_timeout_s=args.join_timeout,
    )


def _run_supervised(args, argv: list[str]) -> int | None:
    """A process of a multi-process run trains in a child under :mod:`podscale.train.supervise`;
    returns ``None`` where this process is to train itself (one process, or the child)."""
    if os.environ.get(supervise.ENV_SUPERVISED):
        return None
    return _supervise(_cluster_spec(args), argv, args.json)


def _supervise(spec: distributed.ClusterSpec, argv: list[str], json_out: bool) -> int | None:
    if not (spec.auto or (spec.explicit and spec.num_processes > 1)):
        return None
    return supervise.run(
        argv,
        process_id=spec.process_id,
        num_processes=spec.num_processes,
        coordinator=spec.coordinator_address,
        heartbeat_s=spec.heartbeat_timeout_s,
        join_s=spec.join_timeout_s or (JOIN_S if spec.explicit else None),
        json_out=json_out,
    )


class _Unreadable(Exception):
    """Flags that :func:`_supervise_before_jax`'s short reading cannot take."""


class _ClusterFlags(argparse.ArgumentParser):
    def error(self, message: str):
        raise _Unreadable(message)


def _supervise_before_jax(argv: list[str]) -> int | None:
    """``podscale train`` as one process of a multi-process run: its supervisor, before anything
    loads JAX. It reads the cluster's flags only; the child it starts reads and checks them all,
    and the child's refusals reach this process's stderr, stdout and exit code as they are.
    ``None`` where the whole command line is to be read here: another command, one process, the
    supervised child itself, ``--dry-run`` or ``--help``, or cluster flags that this reading cannot
    take (an abbreviation, a value that is not a number, an incomplete cluster: the whole reading
    refuses them with its own message and exit code)."""
    if argv[:1] != ["train"] or os.environ.get(supervise.ENV_SUPERVISED):
        return None
    p = _ClusterFlags(add_help=False, allow_abbrev=False)
    p.add_argument("--coordinator-address")
    for name, default in (("num-processes", None), ("process-id", None), ("heartbeat-timeout", HEARTBEAT_S)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--join-timeout", type=int, default=JOIN_S)
    for flag in ("--distributed-auto", "--json", "--dry-run", "--help", "-h"):
        p.add_argument(flag, action="store_true")
    known = [a for action in p._actions for a in action.option_strings]
    for token in argv[1:]:
        flag = token.split("=", 1)[0]
        if flag.startswith("--") and flag not in known and any(k.startswith(flag) for k in known):
            return None  # an abbreviation: argparse's whole reading decides what it means
    try:
        flags, _ = p.parse_known_args(argv[1:])
        if flags.dry_run or flags.help or flags.h:
            return None
        spec = _cluster_spec(flags)
        if not (spec.auto or (spec.explicit and spec.num_processes > 1)):
            return None
    except (_Unreadable, ValueError):  # the whole reading refuses it, with its message and exit code
        return None
    return _supervise(spec, argv, flags.json)


def _run_train(args) -> int:
    from podscale.parallel.strategy import from_flags

    out = sys.stdout
    if args.json:
        # Keep stdout for the one JSON object: native libraries (gloo prints "[Gloo] Rank ..."
        # from C++) write to file descriptor 1, so point it at stderr for the rest of the run.
        sys.stdout.flush()
        out = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
        _JSON_OUT[0] = out
    spec = _cluster_spec(args)
    from podscale.train.trainer import TrainConfig, check, train

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in fields}
    values["strategy"] = from_flags(args)
    values["progress"] = not args.no_progress
    if spec.explicit:  # which process this is decides which output paths it checks (process 0 writes files)
        os.environ[distributed.ENV_PROCESS_ID] = str(spec.process_id)
    config = TrainConfig(**values)  # flags and output paths, before joining any cluster
    if args.dry_run and (spec.auto or spec.explicit):
        local = distributed.check_devices(args.replicas, spec)
        return _dry_run_result(
            args,
            {
                "processes": spec.num_processes,
                "cpu_devices_per_process": local,
                "devices": "the rest is checked once the processes join (a multi-process run's mesh)",
            },
        )
    if os.environ.get(supervise.ENV_SUPERVISED):
        supervise.watch_parent()
    distributed.setup(args.replicas, spec)

    import jax

    if args.dry_run:
        return _dry_run_result(args, check(config).dry_run_summary())
    summary = train(config)
    if jax.process_index() == 0:
        if summary["time_to_target_s"] is not None:
            print(
                f"time to target: {summary['time_to_target_s']:.1f} s (held-out "
                + ", ".join(f"{k} {summary['eval'][k]:.4f} >= {v}" for k, v in summary["targets"].items())
                + f" at step {summary['target_step']})",
                file=sys.stderr if args.json else sys.stdout,
            )
        elif summary["target"] is not None:
            print(
                f"targets {summary['targets']} not reached in {summary['steps']} steps (held-out "
                + ", ".join(f"{k} {summary['eval'].get(k)}" for k in summary["targets"])
                + ")",
                file=sys.stderr,
            )
        if args.json:
            print(json.dumps(summary), file=out, flush=True)
        else:
            ev = summary["eval_value"]
            eps = summary["examples_per_s"]
            print(
                f"steps {summary['steps']}  final train loss {summary['final_train_loss']}  held-out {summary['eval_metric']} "
                f"{ev if ev is None else round(ev, 4)}  {eps and round(eps)} examples/s on {summary['replicas']} replicas"
            )
    return 0 if summary["target"] is None or summary["time_to_target_s"] is not None else 1


def _plan_parser(sub) -> None:
    from podscale.parallel.strategy import Strategy, add_flags

    p = sub.add_parser("plan", help="show what the step does on the mesh, without running it")
    p.add_argument("--model", default="mlp")
    p.add_argument("--config", default=None, help="MLPerf workloads: tiny or full")
    p.add_argument("--data", default=None)
    p.add_argument("--optimizer", default=None, help="default adam; MLPerf workloads: their recipe")
    p.add_argument("--learning-rate", type=float, default=None)
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="global batch (default 64; MLPerf workloads: their per-core batch x replicas)",
    )
    p.add_argument("--replicas", type=int, default=None)
    p.add_argument("--mesh", type=parse_shape, default=None, help="mesh shape such as 8 or 4x2")
    p.add_argument(
        "--system",
        default=None,
        help="with --chips: compile for that TPU slice with XLA:TPU (tpu-v3, tpu-v4, tpu-v5p, tpu-v5e, tpu-v6e; "
        "libtpu's compile-only devices, pip install 'podscale[tpu]') and show its module's collectives and memory",
    )
    p.add_argument("--chips", type=int, default=None, help="with --system: the slice's chips (--mesh: its devices)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    add_flags(p, Strategy(weight_update="sharded"))


def _plan_devices(args) -> list | None:
    """The compile-only TPU devices ``plan --system S --chips N`` compiles for (``None``: this
    machine's devices); refuses an incomplete or impossible request before any work."""
    if args.system is None and args.chips is None:
        return None
    if args.system is None or args.chips is None:
        given, missing = ("--system", "--chips") if args.chips is None else ("--chips", "--system")
        raise ValueError(f"{given} needs {missing}: name the TPU system and its chips, e.g. --system tpu-v3 --chips 16")
    from podscale.perf import systems, tpu

    system = systems.get(args.system)
    if system.kind != "tpu":
        tpus = ", ".join(s.name for s in systems.SYSTEMS.values() if s.kind == "tpu")
        raise ValueError(f"--system {args.system}: XLA:TPU compiles for TPU systems only ({tpus})")
    if args.replicas is not None:
        raise ValueError("--replicas with --system: the slice's devices are the replicas; give --mesh for its shape")
    if not tpu.available():
        raise ValueError(f"--system {args.system}: {tpu.MISSING.split(':')[0]}; pip install 'podscale[tpu]'")
    return list(tpu.devices(system.name, tpu.topology_name(system, args.chips)))


def _run_plan(args) -> int:
    from podscale.parallel.strategy import from_flags

    if args.batch_size is not None and not 1 <= args.batch_size < 2**31:
        raise ValueError(
            f"--batch-size must be at least 1 and below 2**31 (XLA's 32-bit dimensions), got {args.batch_size}"
        )
    tpu_devices = _plan_devices(args)
    distributed.setup(args.replicas, distributed.ClusterSpec())

    import jax

    from podscale import workloads
    from podscale.parallel.engine import data_parallel
    from podscale.parallel.mesh import make_mesh
    from podscale.parallel.tensor import with_model_rules
    from podscale.train.tasks import make_task, make_task_optimizer, make_train_step

    # A workload's plan needs no data set: every size comes from the config's shapes.
    task = make_task(args.model, args.data, config=args.config, with_data=args.model not in workloads.NAMES)
    steps = task.config.train_steps if task.workload else 100
    tx = make_task_optimizer(task, args.optimizer, args.learning_rate, steps=steps)
    mesh = make_mesh(args.mesh, devices=tpu_devices)
    batch_size = args.batch_size
    if batch_size is None:
        batch_size = task.config.per_core_batch * mesh.size if task.workload else 64
    batch = task.batch_shapes(batch_size)
    state = jax.eval_shape(lambda b: task.init_state(jax.random.key(0), tx, b), batch)
    dp = data_parallel(make_train_step(task, tx), mesh, with_model_rules(from_flags(args), args.model))
    dp.prepare(state, batch)  # traces the step: spatial and rule checks, the layout
    compiler = (
        f"XLA:TPU for {args.system} {args.chips} chips ({len(tpu_devices)} devices)" if tpu_devices else "XLA:CPU"
    )
    if args.dry_run:
        return _dry_run_result(
            args, {"mesh": dict(mesh.shape), "replicas": dp.replicas, "batch_size": batch_size, "compiler": compiler}
        )
    if tpu_devices:
        from podscale._jax import jax_config

        with jax_config.enable_compilation_cache(False):  # a compile-only client's executables are not cached
            plan = dp.plan(state, batch, compile=True)
    else:
        plan = dp.plan(state, batch, compile=True)
    if args.json:
        print(json.dumps({**plan.to_dict(), "compiler": compiler}))
    else:
        from podscale import render

        render.plan(plan)
        print(f"the compiled module: {compiler}, mesh {dict(mesh.shape)}")
    return 0


def _run_models(args) -> int:
    from rich.console import Console

    from podscale import report, workloads

    rows = []
    for name in workloads.NAMES:
        w = workloads.get(name)
        full, tiny = w.param_count("full"), w.param_count("tiny")
        rows.append(
            {
                "name": name,
                "description": w.description,
                "params_full": full,
                "params_tiny": tiny,
                "reference_params": w.reference.params,
                "reference_source": w.reference.source,
                "relative_difference": (full - w.reference.params) / w.reference.params,
                "global_batch": w.configs["full"].global_batch,
                "per_core_batch": w.configs["full"].per_core_batch,
                "hyperparameters_source": w.configs["full"].source,
                "eval_metric": w.eval_metric,
            }
        )
    if args.json:
        print(json.dumps(rows))
        return 0
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
    return 0


def _project_parser(sub) -> None:
    from podscale.parallel.strategy import Strategy, add_flags

    p = sub.add_parser(
        "project",
        help="project the step time of a model's compiled step to 16-4096 chips of a TPU or GPU system",
    )
    p.add_argument("--model", default="mlp")
    p.add_argument("--config", default=None, help="MLPerf workloads: tiny or full")
    p.add_argument("--data", default=None)
    p.add_argument("--optimizer", default=None, help="default adam; MLPerf workloads: their recipe")
    p.add_argument("--learning-rate", type=float, default=None)
    p.add_argument("--system", default="tpu-v3", help="tpu-v3, tpu-v4, tpu-v5p, tpu-v5e, tpu-v6e, a100, h100, h200")
    p.add_argument("--chips", default="16,64,256,1024", help="comma-separated chip counts")
    b = p.add_mutually_exclusive_group()
    b.add_argument("--per-chip-batch", type=int, default=None, help="examples per chip (default: the workload's)")
    b.add_argument("--global-batch", type=int, default=None, help="the global batch at every chip count")
    p.add_argument(
        "--strategies",
        default=None,
        help="comma-separated: replicated, sharded, replicated-2d, sharded-2d (weight update and gradient sum; "
        f"default {','.join(project_strategies())}, where one that does not apply at a chip count is a row saying why)",
    )
    p.add_argument(
        "--multi-axis",
        choices=("torus", "ring"),
        default="torus",
        help="a collective over several torus dimensions: torus (dimension by dimension, as XLA on a TPU "
        "slice) or ring (one ring through them all, paper 1's 1-D summation)",
    )
    p.add_argument(
        "--compiler",
        choices=("auto", "tpu", "cpu"),
        default="auto",
        help="whose module is costed: tpu (XLA:TPU for the target slice, compile-only, needs libtpu: "
        "pip install 'podscale[tpu]'), cpu (XLA:CPU on this machine), auto (tpu for a TPU system where libtpu "
        "is installed, else cpu)",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--plot", default=None, help="write step time and throughput against chips to this file (.png, .pdf, .svg, ...)"
    )
    p.add_argument("--list-systems", action="store_true", help="print the systems and their figures' sources")
    p.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    p.add_argument(
        "--validate",
        action="store_true",
        help="measure this CPU, predict each workload's step at 1, 2, 4, 8 replicas and podscale bench wus's "
        "variants, run them, print predicted / measured",
    )
    p.add_argument("--validate-models", default=None, help="--validate: comma-separated workloads (default all)")
    p.add_argument("--steps", type=int, default=8, help="--validate: timed steps per run (the fastest counts)")
    add_flags(p, Strategy(weight_update="sharded"))
    for action in p._actions:  # each strategy of --strategies sets these two: refused if given
        if action.dest in ("weight_update", "grad_sum"):
            action.help = argparse.SUPPRESS
    # Which flags were given (a flag --validate or --list-systems would ignore is refused): every
    # flag's default is None here, a given flag never is; _project_given puts the defaults back.
    defaults = vars(p.parse_args([]))
    p.set_defaults(**dict.fromkeys(defaults, None), project_defaults=defaults)


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


def project_strategies() -> tuple[str, ...]:
    from podscale.perf.project_mesh import DEFAULT_STRATEGIES

    return DEFAULT_STRATEGIES


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
    if "learning_rate" in given and not (math.isfinite(args.learning_rate) and args.learning_rate > 0):
        raise ValueError(f"--learning-rate {args.learning_rate}: a positive number, e.g. 1e-3")


def _strategy_names() -> tuple[str, ...]:
    from podscale.perf.project_mesh import STRATEGIES

    return tuple(STRATEGIES)


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
        from podscale.perf.validate import check, print_validation, validate

        if args.dry_run:
            return _dry_run_result(args, {"validate": ",".join(check(models, args.steps)), "steps": args.steps})
        result = validate(models=models, steps=args.steps, progress=True)
        print(json.dumps(result)) if args.json else print_validation(result)
        return 0
    if args.list_systems:
        return _dry_run_result(args, {"list_systems": True}) if args.dry_run else _print_systems(args.json)
    from podscale.perf import project as proj
    from podscale.perf import project_mesh, project_rows, systems

    system = systems.get(args.system)
    chips = _parse_chips(args.chips)
    names = None if args.strategies is None else _parse_list("--strategies", args.strategies, "replicated,sharded")
    effective = names or list(project_mesh.DEFAULT_STRATEGIES)
    from podscale.parallel.tensor import with_model_rules

    if args.axis_costs is not None:  # the 2-D strategies' knob: each strategy sets grad_sum itself
        args.grad_sum = "2d"
    strategy = with_model_rules(from_flags(args), args.model)
    unknown = [s for s in effective if s not in project_mesh.STRATEGIES]
    if unknown:
        raise ValueError(f"--strategies {unknown}: unknown; choose from {', '.join(project_mesh.STRATEGIES)}")
    two_d = [s for s in effective if project_mesh.STRATEGIES[s]["grad_sum"] == "2d"]
    sharded = [s for s in effective if project_mesh.STRATEGIES[s]["weight_update"] == "sharded"]
    for dest, needed, kind in (
        ("grad_sum_chunks", two_d, "2-D (replicated-2d, sharded-2d)"),
        ("axis_costs", two_d, "2-D (replicated-2d, sharded-2d)"),
        ("min_shard_size", sharded, "sharded (sharded, sharded-2d)"),
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
    # Every mesh, strategy and chip count: refused, or a strategy that does not apply at a chip
    # count noted (a row saying why), before anything is built or compiled.
    reasons = project_mesh.applicability(system, chips, names, strategy, args.multi_axis, what="--strategies")
    k = strategy.spatial or strategy.model_parallel or 1
    live = [c for c in chips if any(reasons[c, s] is None for s in effective)]
    import jax

    on_tpu = proj.use_tpu_compiler(system, args.compiler, progress)
    devices = 0 if on_tpu else min(MAX_CPU_DEVICES, max(c * system.devices_per_chip for c in live))
    if not args.dry_run and not on_tpu:  # a dry run compiles nothing: it leaves the devices as they are
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
    state = jax.eval_shape(lambda b: task.init_state(jax.random.key(0), tx, b), task.batch_shapes(k))
    if args.dry_run:
        rows = [
            f"{c} chips: {s} " + (f"n/a ({reasons[c, s]})" if reasons[c, s] else "would compile")
            for c in chips
            for s in effective
        ]
        compiler = "XLA:TPU (libtpu, compile-only)" if on_tpu else "XLA:CPU"
        return _dry_run_result(
            args, {"system": system.name, "compiler": compiler, "cpu_devices": devices, "rows": rows}
        )
    rows = proj.project(
        make_train_step(task, tx),
        state,
        task.batch_shapes,
        system=system,
        chips=chips,
        strategies=names,
        base=strategy,
        replica_batch=replica_batches,
        multi_axis=args.multi_axis,
        progress=progress,
        compiler="tpu" if on_tpu else "cpu",
    )
    if args.json:
        print(json.dumps({"system": dataclasses.asdict(system), "rows": [r.to_dict() for r in rows]}), flush=True)
    else:
        project_rows.render(rows, system, f"{args.model} ({args.config or 'default'})")
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


def _print_systems(as_json: bool) -> int:
    from rich.console import Console

    from podscale import report
    from podscale.perf import systems

    if as_json:
        print(json.dumps([dataclasses.asdict(s) for s in systems.SYSTEMS.values()]))
        return 0
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
        console.print(f"[bold]{s.name}[/]: {s.description}\n  " + "; ".join(s.sources))
    return 0


def _bench_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmarks: wus (replicated vs sharded vs GSPMD weight update), gradsum (1-D vs 2-D), "
        "spatial (one replica's images over k = 1, 2, 4, 8 devices), tp (a Transformer's weights split "
        "k = 1, 2, 4 ways)",
    )
    from podscale.bench import BENCHMARKS

    p.add_argument("which", choices=BENCHMARKS)
    p.add_argument(
        "--model",
        default=None,
        help="wus: an MLPerf workload (tiny config, its recipe) instead of the decoder",
    )
    p.add_argument("--sizes", default=None, help="gradsum: gradient sizes in MiB per device (default 1,16,128)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per variant")
    p.add_argument("--width", type=int, default=None, help="wus and tp: the Transformer's width (default 512; tp 256)")
    p.add_argument("--depth", type=int, default=None, help="wus and tp: its layers (default 8; tp 2)")
    p.add_argument("--vocab", type=int, default=None, help="wus and tp: its vocabulary (default 8192; tp 512)")
    p.add_argument("--replicas", type=int, default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)


def _run_bench(args) -> int:
    from podscale.bench import check_flags

    kwargs = check_flags(args.which, vars(args))  # every flag, before any work
    distributed.setup(args.replicas, distributed.ClusterSpec())
    if args.dry_run:
        return _dry_run_result(args, {"benchmark": args.which, **kwargs})
    from rich.console import Console

    from podscale import report

    if args.which == "gradsum":
        return _run_bench_gradsum(args, kwargs)
    if args.which == "spatial":
        return _run_bench_spatial(args, kwargs)
    if args.which == "tp":
        return _run_bench_tp(args, kwargs)

    from podscale.bench.wus import bench_wus

    result = bench_wus(**kwargs, progress=True)
    if args.json:
        print(json.dumps(result))
        return 0
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
    return 0


def _run_bench_spatial(args, kwargs: dict) -> int:
    from rich.console import Console

    from podscale import report
    from podscale.bench.spatial import bench_spatial

    result = bench_spatial(**kwargs)
    if args.json:
        print(json.dumps(result))
        return 0
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
    return 0


def _run_bench_tp(args, kwargs: dict) -> int:
    from rich.console import Console

    from podscale import report
    from podscale.bench.tp import bench_tp

    result = bench_tp(**kwargs)
    if args.json:
        print(json.dumps(result))
        return 0
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
    return 0


def _run_bench_gradsum(args, kwargs: dict) -> int:
    from podscale import report
    from podscale.bench.gradsum import bench_gradsum

    result = bench_gradsum(**kwargs)
    if args.json:
        print(json.dumps(result))
        return 0
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
    for size, per in result.items():
        base = per.get("1d", {}).get("median_s")
        for name, r in per.items():
            axes = ", ".join(f"{a}: {b / 2**20:,.2f} MiB" for a, b in r["bytes_per_axis"].items())
            table.add_row(
                size,
                name,
                f"{r['median_s']:.4f}",
                f"{r['median_s'] / base:.2f}x" if base else "-",
                axes,
                f"{r['max_abs_error']:.1e}",
            )
    report.show(table)
    return 0


def main(argv: list[str] | None = None) -> int:  # noqa: C901
    _Parser.argv = list(sys.argv[1:] if argv is None else argv)
    supervised = _supervise_before_jax(_Parser.argv)
    if supervised is not None:
        return supervised
    parser = _Parser(prog="podscale", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    if _Parser.argv[:1] != ["launch"]:  # the launcher reads its own flags only, without loading JAX
        _train_parser(sub)
        _plan_parser(sub)
        _bench_parser(sub)
        _project_parser(sub)
        mp = sub.add_parser("models", help="list the MLPerf reference workloads with their parameter counts")
        mp.add_argument("--json", action="store_true")
    lp = sub.add_parser("launch", help="run a command as N local processes of one JAX run")
    lp.add_argument("--processes", type=int, required=True)
    lp.add_argument(
        "--grace",
        type=float,
        default=60.0,
        help="seconds the others get to stop after one fails (0: killed at once)",
    )
    lp.add_argument(
        "--dry-run",
        action="store_true",
        help="check launch's flags and, for a podscale command, its own flags as process 0 would (--dry-run)",
    )
    lp.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command, e.g. podscale train ...")
    args = parser.parse_args(argv)
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        return _dispatch(args, argv)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """On the command line a podscale warning is one line in flags, like its errors."""
    if issubclass(category, PodscaleWarning):
        print(f"podscale: warning: {_as_flags(str(message))}", file=sys.stderr)
    else:
        warnings._showwarning_orig(message, category, filename, lineno, file, line)


def _dispatch(args, argv) -> int:  # noqa: C901
    try:
        if args.command == "launch":
            cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
            if args.dry_run:
                return _dry_run_launch(args, cmd)
            return distributed.launch(args.processes, cmd, grace_s=args.grace)
        if args.command == "models":
            return _run_models(args)
        if args.command == "bench":
            return _run_bench(args)
        if args.command == "plan":
            return _run_plan(args)
        if args.command == "project":
            return _run_project(args)
        supervised = None if args.dry_run else _run_supervised(args, sys.argv[1:] if argv is None else list(argv))
        if supervised is not None:
            return supervised
        try:
            return _run_train(args)
        except Exception as e:
            # A collective whose peer went away: the distributed service names the lost process
            # shortly (see podscale.train.supervise); wait for it rather than print this.
            if os.environ.get(supervise.ENV_SUPERVISED) and "gloo" in str(e).lower():
                supervise.wait_for_verdict(e, args.heartbeat_timeout, _JSON_OUT[0] if args.json else None)
            raise
    except Interrupted as e:
        print(f"podscale: {e}", file=sys.stderr)
        return 128 + e.signum
    except _refusals() as e:
        message = _as_flags(str(e))
        print(f"podscale: error: {message}", file=sys.stderr)
        if getattr(args, "json", False):  # scripts read one JSON object either way
            print(json.dumps({"error": message, "exit_code": 2}), file=_JSON_OUT[0] or sys.stdout, flush=True)
        return 2


def _refusals() -> tuple[type[Exception], ...]:
    """What a command refuses with one ``podscale: error:`` line and exit code 2: a ValueError, or a
    CheckpointError where checkpoints were read (evaluated as an exception reaches it: the
    checkpoint module loads JAX, and a command that never loaded it raises none)."""
    checkpoint = sys.modules.get("podscale.train.checkpoint")
    return (ValueError,) if checkpoint is None else (ValueError, checkpoint.CheckpointError)


def _as_flags(message: str) -> str:
    """Library errors name parameters (``grad_sum='2d'``, ``strict=True``, ``min_shard_size must``,
    ``drop model_parallel``, ``make_mesh((4, 2))``); on the command line they are flags
    (``--grad-sum 2d``, ``--strict``, ``--min-shard-size must``, ``drop --model-parallel``,
    ``--mesh 4x2``). The one place the two meet. Python-only advice (``rules=Rules(...)``) is left
    as it is."""
    import re

    from podscale.parallel.strategy import Strategy, flag_name

    for f in sorted(dataclasses.fields(Strategy), key=lambda f: -len(f.name)):  # grad_sum_chunks before grad_sum
        if not f.metadata.get("cli", True):
            continue  # no flag (data_axes)
        flag = flag_name(f.name)
        if f.type in ("bool", bool):  # a switch: strict=True is --strict
            message = re.sub(rf"\b{f.name}=True\b", flag, message)
            message = re.sub(rf"\b{f.name}=False\b", f"no {flag}", message)
        message = re.sub(rf"\b{f.name}=(['\"]?)([^'\"\s,;()]*)\1(?![\w(])", rf"{flag} \2", message)
        message = re.sub(rf"\b{f.name} must\b", f"{flag} must", message)
        if "_" in f.name:  # a bare parameter name of two words cannot be plain English: the flag
            message = re.sub(rf"(?<![\w.-]){f.name}\b(?![=(])", flag, message)
    message = re.sub(r"\bbn_group_size=(\d+)", r"--bn-group-size \1", message)  # make_mesh's, a train flag
    message = re.sub(r"make_mesh\(\((\d+(?:, \d+)*),?\)\)", lambda m: "--mesh " + "x".join(m[1].split(", ")), message)
    return message


if __name__ == "__main__":
    sys.exit(main())
