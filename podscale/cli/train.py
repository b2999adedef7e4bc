"""``podscale train``: the flags made a :class:`~podscale.train.config.TrainConfig`, the devices and
processes set up, the run checked (``--dry-run`` stops there) and trained, and its summary printed
(under ``--json`` one JSON object on stdout, whatever native libraries print)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from podscale.cli.messages import JSON_OUT, dry_run_result
from podscale.cli.processes import cluster_spec
from podscale.train import distributed, supervise


def run_train(args) -> int:
    from podscale.parallel.strategy import from_flags

    out = sys.stdout
    if args.json:
        # Keep stdout for the one JSON object: native libraries (gloo prints "[Gloo] Rank ..."
        # from C++) write to file descriptor 1, so point it at stderr for the rest of the run.
        sys.stdout.flush()
        out = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
        JSON_OUT[0] = out
    spec = cluster_spec(args)
    from podscale.train.config import TrainConfig
    from podscale.train.prepare import check
    from podscale.train.trainer import train

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in fields}
    values["strategy"] = from_flags(args)
    values["progress"] = not args.no_progress
    if spec.explicit:  # which process this is decides which output paths it checks (process 0 writes files)
        os.environ[distributed.ENV_PROCESS_ID] = str(spec.process_id)
    config = TrainConfig(**values)  # flags and output paths, before joining any cluster
    if args.dry_run and (spec.auto or spec.explicit):
        local = distributed.check_devices(args.replicas, spec)
        return dry_run_result(
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

    if args.dry_run:  # a resume reads and verifies the checkpoint it would restore
        from podscale.train.prepare import resume_step

        run = check(config)
        return dry_run_result(args, run.dry_run_summary() | {"resume_from": resume_step(config, run)})
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
        from podscale.train.goodput import lines

        print("\n".join(lines(summary["goodput"])), file=sys.stderr if args.json else sys.stdout)
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
