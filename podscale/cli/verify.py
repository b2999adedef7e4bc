"""``podscale verify``: a built-in model's step under every strategy the mesh allows, against the
single-device step (:func:`podscale.verification.verify`); exit code 1 if a strategy leaves the
floor, 4 if none did but one could not be judged (a floor too wide to mean anything)."""

from __future__ import annotations

import json

from podscale.cli.messages import dry_run_result
from podscale.train import distributed


def _names(text: str, choices) -> list[str]:
    """``--strategies``'s names: comma-separated, none empty, each known, none twice."""
    from podscale.parallel.checks import some_of

    items = [item.strip() for item in text.split(",")]
    if any(not item for item in items):
        raise ValueError(
            f"--strategies {text!r}: an empty name; give comma-separated names, e.g. replicated,sharded "
            f"(of {', '.join(choices)}), or leave the flag out for every one"
        )
    return some_of("--strategies", items, list(choices), "strategy")


def run_verify(args) -> int:
    if args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}")
    if not 0 <= args.seed < 2**63:
        raise ValueError(f"--seed must be 0 or more and below 2**63 (it seeds JAX's generators), got {args.seed}")
    distributed.setup(args.replicas, distributed.ClusterSpec())

    import jax

    from podscale import workloads
    from podscale.parallel.mesh import make_mesh
    from podscale.parallel.tensor import RULES
    from podscale.train.tasks import make_task, make_task_optimizer, make_train_step
    from podscale.verification import EXIT_CANNOT_JUDGE, check, run, strategies_for
    from podscale.workloads.precision import FLOAT32, policy_by_name

    if args.precision is not None and args.model not in workloads.NAMES:
        raise ValueError(
            f"--precision is for the MLPerf and Llama workloads ({', '.join(workloads.NAMES)}); {args.model!r} computes "
            "in float32 and takes none: drop --precision"
        )
    # float32 by default: the strategies' arithmetic is checked to float32's floor. The workloads
    # train in bf16, whose products move one device's own Adam step by 1-9% when its inputs move
    # by an ulp (beyond MAX_FLOOR: nothing could be judged); --precision bf16 checks that program.
    precision = args.precision or "float32"
    policy = FLOAT32 if precision == "float32" else policy_by_name(precision)
    task = make_task(args.model, args.data, config=args.config, policy=policy)
    tx = make_task_optimizer(task, args.optimizer, args.learning_rate, steps=max(args.steps, 10))
    mesh = make_mesh(args.mesh)
    batch_size = args.batch_size or (task.config.per_core_batch * mesh.size if task.workload else 64)
    if batch_size < 1 or batch_size % mesh.size:
        raise ValueError(f"--batch-size {batch_size} is not divisible by the mesh's {mesh.size} devices")
    rules = RULES.get(args.model)
    chosen = None  # every strategy the mesh allows, those that do not apply named
    if args.strategies is not None:
        every = strategies_for(mesh, rules)
        chosen = {s: every[s] for s in _names(args.strategies, every)}
    batch = task.example_batch(batch_size)
    step = make_train_step(task, tx, args.seed)
    key = jax.random.key(args.seed)
    if args.dry_run:  # every check on the state's shapes: nothing initialised or compiled
        state = task.state_shapes(tx, batch, key)
        checked = check(step, state, batch, mesh, chosen, rules=None if chosen else rules, what="--strategies")
        names = [
            f"{n}: " + (f"does not apply ({p})" if isinstance(p, str) else "would run")
            for n, (_, p) in checked.prepared.items()
        ]
        what = {"mesh": dict(mesh.shape), "batch_size": batch_size, "steps": args.steps}
        if task.workload:
            what["precision"] = precision
        return dry_run_result(args, {**what, "strategies": names})
    state = task.init_state(key, tx, batch)
    checked = check(step, state, batch, mesh, chosen, rules=None if chosen else rules, what="--strategies")
    result = run(checked, steps=args.steps, seed=args.seed)
    if args.json:
        precision_field = {"precision": precision} if task.workload else {}
        print(
            json.dumps(
                {
                    "model": args.model,
                    "mesh": dict(mesh.shape),
                    "batch_size": batch_size,
                    **precision_field,
                    **result.to_dict(),
                }
            )
        )
    else:
        print(
            f"model {args.model}, mesh {dict(mesh.shape)}, global batch {batch_size}, {args.steps} steps"
            + (f", precision {precision}" if task.workload else "")
        )
        print("\n".join(result.lines()))
    return {"passed": 0, "failed": 1}.get(result.outcome, EXIT_CANNOT_JUDGE)
