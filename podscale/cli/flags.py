"""The command line's parsers: every command's flags, each group that commands share declared once
(:func:`add_model_flags`, :func:`add_cluster_flags`; the strategy's flags come from
:func:`podscale.parallel.strategy.add_flags`), and argparse's refusals as podscale's (:class:`Parser`).
Nothing here loads JAX until a parser is built for a command that needs it."""

from __future__ import annotations

import argparse
import json
import sys

import podscale.workloads as workloads  # the registry (no flax): every help's list of workloads is read from it
from podscale.train import distributed

DESCRIPTION = "podscale: run an unmodified single-device JAX training step data-parallel on all devices."
"""What ``podscale --help`` says first."""


def parse_shape(text: str) -> tuple[int, ...]:
    """``--mesh``: argparse shows an ``ArgumentTypeError``'s own message."""
    from podscale.parallel.mesh import parse_shape as _parse_shape

    try:
        return _parse_shape(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix(f"--mesh {text!r}: ")) from None


LIBTPU_HELP = (
    "XLA:TPU's options as a TPU run passes them in LIBTPU_INIT_ARGS, e.g. MaxText's asynchronous collectives "
    "(--libtpu-args='--xla_tpu_enable_async_collective_fusion=true ...'): the module is compiled, and its overlap "
    "costed, with them (default: $LIBTPU_INIT_ARGS, where set)"
)
DRY_RUN_HELP = (
    "check every flag, output path and the mesh and batch arithmetic, as a run does before any work, "
    "then exit 0 without running (with --json: one object saying what would run)"
)


class Parser(argparse.ArgumentParser):
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


def system_names(kind: str | None = None) -> list[str]:
    """The systems ``--system`` takes (of ``kind``: ``tpu`` or ``gpu``), from :mod:`podscale.compiled.systems`."""
    from podscale.compiled import systems

    return [name for name, system in systems.SYSTEMS.items() if kind is None or system.kind == kind]


HEARTBEAT_S, JOIN_S = 30, 60
"""``--heartbeat-timeout`` and ``--join-timeout``'s defaults."""


def add_model_flags(p, model: str = "mlp") -> None:
    """The step's model, data and optimizer, which ``train``, ``plan`` and ``project`` build it from."""
    p.add_argument(
        "--model",
        default=model,
        help=f"mlp, cnn, resnet, transformer, or an MLPerf workload: {', '.join(workloads.NAMES)}",
    )
    p.add_argument(
        "--config",
        default=None,
        help="MLPerf workloads: tiny (trains on CPU) or full (MLPerf size); Llama also full-offload (layer inputs on host)",
    )
    p.add_argument("--data", default=None, help="digits or synthetic (default); MLPerf workloads bring their own")
    p.add_argument(
        "--optimizer",
        default=None,
        help="sgd, momentum, adam (default), adamw, lamb, lars, ...; MLPerf workloads default to their recipe",
    )
    p.add_argument(
        "--learning-rate", type=float, default=None, help="default 1e-3; MLPerf workloads: the recipe's peak"
    )


def add_cluster_flags(g) -> None:
    """The cluster's flags of one process of a multi-process run: ``train`` reads them, and so does
    its supervisor's short reading before JAX loads (:func:`podscale.cli.processes.supervise_before_jax`)."""
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


def train_parser(sub) -> None:
    from podscale.parallel.strategy import add_flags
    from podscale.train.config import TrainConfig

    p = sub.add_parser("train", help="train a model data-parallel on all devices")
    defaults = TrainConfig()
    add_model_flags(p, defaults.model)
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
    p.add_argument(
        "--mllog",
        default=None,
        help="MLPerf-format log file (default: WORKDIR/mllog.txt); a --resume run logs to the next "
        "segment beside it (mllog.1.txt, mllog.2.txt, ...)",
    )
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument(
        "--schedule-steps",
        type=int,
        default=None,
        help="MLPerf recipes: the steps the learning-rate schedule spans (default --steps), kept on --resume; "
        "start with the most steps a run may be extended to",
    )
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
        help="the held-out metric to stop at, a fraction (accuracy; an MLPerf workload's own, e.g. exact_match, "
        "auc, map: podscale models lists each); reports time to target",
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
    add_cluster_flags(g)


def plan_parser(sub) -> None:
    from podscale.parallel.strategy import Strategy, add_flags

    p = sub.add_parser("plan", help="show what the step does on the mesh, without running it")
    add_model_flags(p)
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
        help=f"with --chips: compile for that TPU slice with XLA:TPU ({', '.join(system_names('tpu'))}; "
        "libtpu's compile-only devices, pip install 'podscale[tpu]') and show its module's collectives and memory",
    )
    p.add_argument("--chips", type=int, default=None, help="with --system: the slice's chips (--mesh: its devices)")
    p.add_argument("--libtpu-args", default=None, help="with --system: " + LIBTPU_HELP)
    p.add_argument(
        "--eval",
        action="store_true",
        help="also compile the evaluation step (on the step's placement, a global batch of the same shapes) and "
        "show its memory per device beside the train step's",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    add_flags(p, Strategy(weight_update="sharded"))


def verify_parser(sub) -> None:
    p = sub.add_parser(
        "verify",
        help="run a model's step under every strategy the mesh allows and compare it with one device, against "
        "the noise floor of one device's own step with its batch's floats moved by an ulp (exit code 1 "
        "beyond it; 4: cannot judge, a floor beyond 1e-2)",
    )
    add_model_flags(p)
    p.add_argument(
        "--batch-size", type=int, default=None, help="global batch (default 64; workloads: per-core x devices)"
    )
    p.add_argument("--steps", type=int, default=3, help="steps compared, each after the last")
    p.add_argument(
        "--mesh", type=parse_shape, default=None, help="mesh shape such as 8 or 4x2 (default: all devices, 1-D)"
    )
    p.add_argument("--replicas", type=int, default=None, help="CPU devices to simulate (default 8 on CPU)")
    p.add_argument(
        "--strategies",
        default=None,
        help="comma-separated names of the strategies to check, each once and each one that applies "
        "(default: every one, those that do not apply named)",
    )
    p.add_argument("--seed", type=int, default=0, help="0 or more: the model's init and the ulps the floor moves")
    p.add_argument(
        "--precision",
        default=None,
        choices=["bf16", "float32"],
        help="the MLPerf and Llama workloads: float32 throughout (default: the strategies checked to float32's "
        "floor), or bf16 compute with float32 state as they train (bf16's own floor is often beyond 1e-2 under "
        "Adam: cannot judge)",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)


def project_parser(sub) -> None:
    from podscale.parallel.strategy import Strategy, add_flags

    p = sub.add_parser(
        "project",
        help="project the step time of a model's compiled step to 16-4096 chips of a TPU or GPU system",
    )
    add_model_flags(p)
    p.add_argument("--system", default="tpu-v3", help=", ".join(system_names()))
    p.add_argument("--chips", default="16,64,256,1024", help="comma-separated chip counts")
    b = p.add_mutually_exclusive_group()
    b.add_argument("--per-chip-batch", type=int, default=None, help="examples per chip (default: the workload's)")
    b.add_argument("--global-batch", type=int, default=None, help="the global batch at every chip count")
    p.add_argument(
        "--strategies",
        default=None,
        help="comma-separated: replicated, sharded, replicated-2d, sharded-2d, fsdp, fsdp-2d, data-x-fsdp (weight "
        "update and gradient sum; data-x-fsdp: FSDP within the first torus dimension or a GPU node, data parallelism "
        f"across the rest; default {','.join(project_strategies())}, or a workload's recipe's (llama3-*: sharded,fsdp), "
        "where one that does not apply at a chip count is a row saying why)",
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
        choices=("auto", "tpu", "gpu", "cpu"),
        default="auto",
        help="whose module is costed: tpu (XLA:TPU for the target slice, compile-only, needs libtpu: "
        "pip install 'podscale[tpu]'), gpu (XLA:GPU for the target's GPUs, compile-only, needs JAX's CUDA plugin: "
        "pip install 'podscale[gpu-compile]'), cpu (XLA:CPU on this machine), auto (tpu or gpu for a TPU or GPU "
        "system where its compiler is installed, else cpu)",
    )
    p.add_argument(
        "--slices",
        type=int,
        default=None,
        help="TPU slices the chips are split into, joined by the data-centre network (MaxText's num_slices); "
        "default: one up to the system's largest slice, past it the fewest of a power-of-two size. Needs the "
        "system's DCN bandwidth (tpu-v5p, tpu-v5e); data-x-fsdp is then FSDP within each slice",
    )
    p.add_argument(
        "--bn-group-size",
        type=int,
        default=None,
        help="replicas per batch-norm group, neighbours on the mesh (1: the whole global batch, podscale's exact "
        "default); default: the MLPerf recipe's at each chip count (ssd: 4; resnet50: 8 from 2048 replicas up; "
        "1 for the others)",
    )
    p.add_argument("--libtpu-args", default=None, help=LIBTPU_HELP)
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
    p.add_argument(
        "--validate-models",
        default=None,
        help=f"--validate: comma-separated workloads, of {', '.join(workloads.NAMES)} (default all)",
    )
    p.add_argument("--steps", type=int, default=8, help="--validate: timed steps per run (the fastest counts)")
    add_flags(p, Strategy(weight_update="sharded"))
    for action in p._actions:  # each strategy of --strategies sets these two: refused if given
        if action.dest in ("weight_update", "grad_sum"):
            action.help = argparse.SUPPRESS
    # Which flags were given (a flag --validate or --list-systems would ignore is refused): every
    # flag's default is None here, a given flag never is; _project_given puts the defaults back.
    defaults = vars(p.parse_args([]))
    p.set_defaults(**dict.fromkeys(defaults, None), project_defaults=defaults)


def project_strategies() -> tuple[str, ...]:
    from podscale.projection.mesh import DEFAULT_STRATEGIES

    return DEFAULT_STRATEGIES


def bench_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmarks: wus (replicated vs sharded vs FSDP vs GSPMD weight update), gradsum (1-D vs 2-D), "
        "spatial (one replica's images over k = 1, 2, 4, 8 devices), tp (a Transformer's weights split "
        "k = 1, 2, 4 ways), checkpoint (a workload's sharded state saved async vs sync: stall and memory), embedding (tables "
        "split by rows over 8 devices vs replicated: bytes, memory, step time)",
    )
    from podscale.bench import BENCHMARKS

    p.add_argument("which", choices=BENCHMARKS)
    p.add_argument(
        "--model",
        default=None,
        help="wus: an MLPerf workload (tiny config, its recipe) instead of the decoder; checkpoint: the "
        f"workload whose state is saved (default transformer-big); one of {', '.join(workloads.NAMES)}",
    )
    p.add_argument("--config", default=None, help="checkpoint: the workload's config, full (default) or tiny")
    p.add_argument("--sizes", default=None, help="gradsum: gradient sizes in MiB per device (default 1,16,128)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per variant")
    p.add_argument("--width", type=int, default=None, help="wus and tp: the Transformer's width (default 512; tp 256)")
    p.add_argument("--depth", type=int, default=None, help="wus and tp: its layers (default 8; tp 2)")
    p.add_argument("--vocab", type=int, default=None, help="wus and tp: its vocabulary (default 8192; tp 512)")
    p.add_argument("--replicas", type=int, default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)


def models_parser(sub) -> None:
    mp = sub.add_parser("models", help="list the MLPerf reference workloads with their parameter counts")
    mp.add_argument("--json", action="store_true")


def launch_parser(sub) -> None:
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
