"""Several processes: ``podscale launch`` (N local processes of one run) and the supervisor each
process of a multi-process ``podscale train`` runs under (:mod:`podscale.train.supervise`). Neither
loads JAX: the supervisor reads the cluster's flags only (:func:`supervise_before_jax`), and the
child it starts reads and checks them all."""

from __future__ import annotations

import argparse
import os

from podscale.cli.flags import JOIN_S, add_cluster_flags
from podscale.train import distributed, supervise


def dry_run_launch(args, cmd: list[str]) -> int:
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


def cluster_spec(args) -> distributed.ClusterSpec:
    return distributed.ClusterSpec.from_env(
        coordinator_address=args.coordinator_address,
        num_processes=args.num_processes,
        process_id=args.process_id,
        auto=args.distributed_auto or None,
        heartbeat_timeout_s=args.heartbeat_timeout,
        join_timeout_s=args.join_timeout,
    )


def run_supervised(args, argv: list[str]) -> int | None:
    """A process of a multi-process run trains in a child under :mod:`podscale.train.supervise`;
    returns ``None`` where this process is to train itself (one process, or the child)."""
    if os.environ.get(supervise.ENV_SUPERVISED):
        return None
    return _supervise(cluster_spec(args), argv, args.json)


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
    """Flags that :func:`supervise_before_jax`'s short reading cannot take."""


class _ClusterFlags(argparse.ArgumentParser):
    def error(self, message: str):
        raise _Unreadable(message)


def supervise_before_jax(argv: list[str]) -> int | None:
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
    add_cluster_flags(p)
    for flag in ("--json", "--dry-run", "--help", "-h"):
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
        spec = cluster_spec(flags)
        if not (spec.auto or (spec.explicit and spec.num_processes > 1)):
            return None
    except (_Unreadable, ValueError):  # the whole reading refuses it, with its message and exit code
        return None
    return _supervise(spec, argv, flags.json)
