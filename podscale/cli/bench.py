"""``podscale bench``: the benchmarks (``wus``, ``gradsum``, ``spatial``, ``tp``, ``checkpoint``,
``embedding``) run, their
flags checked before any work; results as tables (:mod:`podscale.render`) or one JSON object."""

from __future__ import annotations

import json

from podscale.cli.messages import dry_run_result
from podscale.train import distributed


def run_bench(args) -> int:
    import importlib

    from podscale.bench import check_flags

    kwargs = check_flags(args.which, vars(args))  # every flag, before any work
    distributed.setup(args.replicas, distributed.ClusterSpec())
    if args.dry_run:
        return dry_run_result(args, {"benchmark": args.which, **kwargs})
    # Each benchmark is ``podscale.bench.WHICH.bench_WHICH``, its table ``podscale.render.bench_WHICH``.
    bench = getattr(importlib.import_module(f"podscale.bench.{args.which}"), f"bench_{args.which}")
    result = bench(**kwargs, progress=True) if args.which == "wus" else bench(**kwargs)
    if args.json:
        print(json.dumps(result))
        return 0
    from podscale import render

    getattr(render, f"bench_{args.which}")(result)
    return 0
