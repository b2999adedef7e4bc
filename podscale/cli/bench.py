"""``podscale bench``: the benchmarks (``wus``, ``gradsum``, ``spatial``, ``tp``, ``checkpoint``) run, their
flags checked before any work; results as tables (:mod:`podscale.render`) or one JSON object."""

from __future__ import annotations

import json

from podscale.cli.messages import _dry_run_result
from podscale.train import distributed


def _run_bench(args) -> int:
    from podscale.bench import check_flags

    kwargs = check_flags(args.which, vars(args))  # every flag, before any work
    distributed.setup(args.replicas, distributed.ClusterSpec())
    if args.dry_run:
        return _dry_run_result(args, {"benchmark": args.which, **kwargs})
    if args.which == "gradsum":
        return _run_bench_gradsum(args, kwargs)
    if args.which == "spatial":
        return _run_bench_spatial(args, kwargs)
    if args.which == "tp":
        return _run_bench_tp(args, kwargs)
    if args.which == "checkpoint":
        return _run_bench_checkpoint(args, kwargs)

    from podscale import render
    from podscale.bench.wus import bench_wus

    result = bench_wus(**kwargs, progress=True)
    if args.json:
        print(json.dumps(result))
        return 0
    render.bench_wus(result)
    return 0


def _run_bench_spatial(args, kwargs: dict) -> int:
    from podscale import render
    from podscale.bench.spatial import bench_spatial

    result = bench_spatial(**kwargs)
    if args.json:
        print(json.dumps(result))
        return 0
    render.bench_spatial(result)
    return 0


def _run_bench_tp(args, kwargs: dict) -> int:
    from podscale import render
    from podscale.bench.tp import bench_tp

    result = bench_tp(**kwargs)
    if args.json:
        print(json.dumps(result))
        return 0
    render.bench_tp(result)
    return 0


def _run_bench_gradsum(args, kwargs: dict) -> int:
    from podscale import render
    from podscale.bench.gradsum import bench_gradsum

    result = bench_gradsum(**kwargs)
    if args.json:
        print(json.dumps(result))
        return 0
    render.bench_gradsum(result)
    return 0


def _run_bench_checkpoint(args, kwargs: dict) -> int:
    from podscale import render
    from podscale.bench.checkpoint import bench_checkpoint

    result = bench_checkpoint(**kwargs)
    if args.json:
        print(json.dumps(result))
        return 0
    render.bench_checkpoint(result)
    return 0
