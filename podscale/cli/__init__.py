"""podscale's command line, ``podscale train | launch | plan | models | bench | project | verify``: here the
command line is read and dispatched (:func:`main`, the console script), with one error path.

Each idea has a module: :mod:`~podscale.cli.flags` (the parsers), :mod:`~podscale.cli.messages`
(refusals and warnings in flags, dry runs), :mod:`~podscale.cli.processes` (``podscale launch``
and each process's supervisor), and a module per command: :mod:`~podscale.cli.train`,
:mod:`~podscale.cli.plan`, :mod:`~podscale.cli.models`, :mod:`~podscale.cli.project`,
:mod:`~podscale.cli.bench`. Tables are drawn by :mod:`podscale.render`.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

from podscale.cli.bench import run_bench
from podscale.cli.flags import (
    DESCRIPTION,
    Parser,
    bench_parser,
    launch_parser,
    models_parser,
    parse_shape,
    plan_parser,
    project_parser,
    train_parser,
    verify_parser,
)
from podscale.cli.messages import JSON_OUT, as_flags, refusals, show_warning
from podscale.cli.models import run_models
from podscale.cli.plan import run_plan
from podscale.cli.processes import dry_run_launch, run_supervised, supervise_before_jax
from podscale.cli.project import run_project
from podscale.cli.train import run_train
from podscale.cli.verify import run_verify
from podscale.train import distributed, supervise
from podscale.train.interrupt import Interrupted

# The modules that load JAX (the parallel layer, checkpoints, the trainer) are imported where a
# command needs them: ``podscale launch`` and the supervisor of each process of a multi-process
# run (``supervise_before_jax``) start without loading JAX.

__all__ = ["main", "parse_shape"]


def main(argv: list[str] | None = None) -> int:  # noqa: C901
    Parser.argv = list(sys.argv[1:] if argv is None else argv)
    supervised = supervise_before_jax(Parser.argv)
    if supervised is not None:
        return supervised
    parser = Parser(prog="podscale", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    if Parser.argv[:1] != ["launch"]:  # the launcher reads its own flags only, without loading JAX
        train_parser(sub)
        plan_parser(sub)
        bench_parser(sub)
        project_parser(sub)
        models_parser(sub)
        verify_parser(sub)
    launch_parser(sub)
    args = parser.parse_args(argv)
    with warnings.catch_warnings():
        warnings.showwarning = show_warning
        return _dispatch(args, argv)


def _dispatch(args, argv) -> int:  # noqa: C901
    try:
        if args.command == "launch":
            cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
            if args.dry_run:
                return dry_run_launch(args, cmd)
            return distributed.launch(args.processes, cmd, grace_s=args.grace)
        if args.command == "models":
            return run_models(args)
        if args.command == "bench":
            return run_bench(args)
        if args.command == "plan":
            return run_plan(args)
        if args.command == "project":
            return run_project(args)
        if args.command == "verify":
            return run_verify(args)
        supervised = None if args.dry_run else run_supervised(args, sys.argv[1:] if argv is None else list(argv))
        if supervised is not None:
            return supervised
        try:
            return run_train(args)
        except Exception as e:
            # A collective whose peer went away: the distributed service names the lost process
            # shortly (see podscale.train.supervise); wait for it rather than print this.
            if os.environ.get(supervise.ENV_SUPERVISED) and "gloo" in str(e).lower():
                supervise.wait_for_verdict(e, args.heartbeat_timeout, JSON_OUT[0] if args.json else None)
            raise
    except Interrupted as e:
        print(f"podscale: {e}", file=sys.stderr)
        return 128 + e.signum
    except OSError as e:
        import errno

        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise
        # A write the system refused where podscale names no output itself: the same one line.
        from podscale.train.config import write_error

        message = str(write_error(e.filename or "an output", e))
        print(f"podscale: error: {message}", file=sys.stderr)
        if getattr(args, "json", False):
            print(json.dumps({"error": message, "exit_code": 2}), file=JSON_OUT[0] or sys.stdout, flush=True)
        return 2
    except refusals() as e:
        message = as_flags(str(e))
        if distributed.note_refusal(message):  # under launch, process 0 says it (launch: what differs)
            print(f"podscale: error: {message}", file=sys.stderr)
        if getattr(args, "json", False):  # scripts read one JSON object either way
            print(json.dumps({"error": message, "exit_code": 2}), file=JSON_OUT[0] or sys.stdout, flush=True)
        return 2
