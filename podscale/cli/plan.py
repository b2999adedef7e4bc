"""``podscale plan``: what the step does on the mesh (layouts, collectives, memory), from the
module XLA compiles for this machine's devices or, with ``--system`` and ``--chips``, for a TPU
slice (libtpu's compile-only devices); nothing is run."""

from __future__ import annotations

import dataclasses
import json

from podscale.cli.messages import dry_run_result
from podscale.train import distributed


def _plan_devices(args) -> list | None:
    """The compile-only TPU devices ``plan --system S --chips N`` compiles for (``None``: this
    machine's devices); refuses an incomplete or impossible request before any work."""
    if args.system is None and args.chips is None:
        if args.libtpu_args is not None:
            raise ValueError("--libtpu-args: XLA:TPU's options, for a TPU slice: add --system and --chips, or drop it")
        return None
    if args.system is None or args.chips is None:
        given, missing = ("--system", "--chips") if args.chips is None else ("--chips", "--system")
        raise ValueError(f"{given} needs {missing}: name the TPU system and its chips, e.g. --system tpu-v3 --chips 16")
    from podscale.compiled import systems, tpu

    system = systems.get(args.system)
    if system.kind != "tpu":
        tpus = ", ".join(s.name for s in systems.SYSTEMS.values() if s.kind == "tpu")
        raise ValueError(f"--system {args.system}: XLA:TPU compiles for TPU systems only ({tpus})")
    if args.replicas is not None:
        raise ValueError("--replicas with --system: the slice's devices are the replicas; give --mesh for its shape")
    if not tpu.available():
        raise ValueError(f"--system {args.system}: {tpu.MISSING.split(':')[0]}; pip install 'podscale[tpu]'")
    tpu.compile_options()  # LIBTPU_INIT_ARGS (or --libtpu-args), checked before anything is compiled
    return list(tpu.devices(system.name, tpu.topology_name(system, args.chips)))


def run_plan(args) -> int:
    from podscale.compiled import tpu

    with tpu.libtpu_args(args.libtpu_args):  # as a run's LIBTPU_INIT_ARGS, restored after
        return _run_plan(args)


def _run_plan(args) -> int:
    from podscale.parallel.strategy import from_flags

    if args.batch_size is not None and not 1 <= args.batch_size < 2**31:
        raise ValueError(
            f"--batch-size must be at least 1 and below 2**31 (XLA's 32-bit dimensions), got {args.batch_size}"
        )
    tpu_devices = _plan_devices(args)
    distributed.setup(args.replicas, distributed.ClusterSpec())

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
    state = task.state_shapes(tx, batch)
    dp = data_parallel(make_train_step(task, tx), mesh, with_model_rules(from_flags(args), args.model))
    dp.prepare(state, batch)  # traces the step: spatial and rule checks, the layout
    compiler = (
        f"XLA:TPU for {args.system} {args.chips} chips ({len(tpu_devices)} devices)" if tpu_devices else "XLA:CPU"
    )
    if args.dry_run:
        return dry_run_result(
            args, {"mesh": dict(mesh.shape), "replicas": dp.replicas, "batch_size": batch_size, "compiler": compiler}
        )

    def compiled_plan():
        plan = dp.plan(state, batch, compile=True)
        if args.eval:
            plan = dataclasses.replace(plan, eval=_eval_memory(task, dp, batch))
        return plan

    if tpu_devices:
        from podscale._jax import jax_config

        with jax_config.enable_compilation_cache(False):  # a compile-only client's executables are not cached
            plan = compiled_plan()
    else:
        plan = compiled_plan()
    if args.json:
        print(json.dumps({**plan.to_dict(), "compiler": compiler}))
    else:
        from podscale import render

        render.plan(plan)
        print(f"the compiled module: {compiler}, mesh {dict(mesh.shape)}")
    return 0


def _eval_memory(task, dp, batch) -> dict[str, int]:
    """The evaluation step's memory per device (``memory_analysis()``), compiled: ``distributed_eval``
    on the train step's placement, one global batch of the train batch's shapes with its mask."""
    import jax
    import jax.numpy as jnp

    from podscale.compiled import hlo, tpu
    from podscale.train.evaluate import distributed_eval
    from podscale.train.tasks import make_eval_fn

    rows = jax.tree.leaves(batch)[0].shape[0]
    eval_batch = {**batch, "mask": jax.ShapeDtypeStruct((rows,), jnp.float32)}
    lowered = distributed_eval(make_eval_fn(task), dp).lower(dp.placement.stored_shapes(), eval_batch)
    return hlo.memory_of(lowered.compile(tpu.options_for(dp.mesh)))
