"""``podscale models``: the MLPerf reference workloads, their parameter counts against the
published ones, their batches and metrics."""

from __future__ import annotations

import json


def run_models(args) -> int:
    from podscale import render, workloads

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
    render.models(rows)
    return 0
