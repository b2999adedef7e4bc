"""``podscale verify``: a built-in model's step under every strategy the mesh allows, against the
single-device step (:func:`podscale.verification.verify`); exit code 1 if a strategy leaves the floor."""

from __future__ import annotations

import json

from podscale.cli.messages import _dry_run_result
from podscale.train import distributed


def _run_verify(args) -> int:
    if args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}")
    distributed.setup(args.replicas, distributed.ClusterSpec())

    import jax

    from podscale.parallel.mesh import make_mesh
    from podscale.parallel.tensor import RULES
    from podscale.train.tasks import make_task, make_task_optimizer, make_train_step
    from podscale.verification import strategies_for, verify

    task = make_task(args.model, args.data, config=args.config)
    tx = make_task_optimizer(task, args.optimizer, args.learning_rate, steps=max(args.steps, 10))
    mesh = make_mesh(args.mesh)
    batch_size = args.batch_size or (task.config.per_core_batch * mesh.size if task.workload else 64)
    if batch_size < 1 or batch_size % mesh.size:
        raise ValueError(f"--batch-size {batch_size} is not divisible by the mesh's {mesh.size} devices")
    strategies = strategies_for(mesh, RULES.get(args.model))
    if args.strategies:
        wanted = [s.strip() for s in args.strategies.split(",") if s.strip()]
        unknown = [s for s in wanted if s not in strategies]
        if unknown:
            raise ValueError(
                f"--strategies {','.join(unknown)}: not one on mesh {dict(mesh.shape)}; choose from {', '.join(strategies)}"
            )
        strategies = {s: strategies[s] for s in wanted}
    if args.dry_run:
        what = {"mesh": dict(mesh.shape), "batch_size": batch_size, "steps": args.steps}
        return _dry_run_result(args, {**what, "strategies": list(strategies)})
    batch = task.example_batch(batch_size)
    state = task.init_state(jax.random.key(args.seed), tx, batch)
    result = verify(make_train_step(task, tx, args.seed), state, batch, mesh, strategies, steps=args.steps)
    if args.json:
        print(json.dumps({"model": args.model, "mesh": dict(mesh.shape), "batch_size": batch_size, **result.to_dict()}))
    else:
        print(f"model {args.model}, mesh {dict(mesh.shape)}, global batch {batch_size}, {args.steps} steps")
        print("\n".join(result.lines()))
    return 0 if result.passed else 1
