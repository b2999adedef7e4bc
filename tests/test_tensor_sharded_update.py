"""Tensor partitioning with the sharded weight update: a split weight's chunks lie in its own
model partition's slice (``weight_update.ByPartition``), so the compiled step moves nothing
between the model axis's partitions to sum, update or gather them: no all-to-all and no
collective-permute over the model axis, and the update's collectives run over the data axes only."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from podscale import data_parallel, make_mesh
from podscale.compiled import hlo
from podscale.compiled.hlo import UPDATE_SCOPE
from podscale.parallel.plan import RESHUFFLES, make_plan
from podscale.train.tasks import make_task, make_train_step


@pytest.mark.parametrize("grad_sum", ["1d", "2d"])
def test_the_sharded_update_of_split_weights_moves_nothing_over_the_model_axis(grad_sum):
    """The small Transformer (Adam) on a 4x2 mesh, model axis of 2 (and 2x2x2 for the 2-D sum):
    the compiled module, read by podscale's HLO reader with each collective's mesh axes, has no
    all-to-all or collective-permute over the model axis, and in the update (the gradients' reduce-
    scatter, the update, the weights' all-gather) no collective over it but the all-gather of the
    weights it keeps whole (at most their bytes); the plan reports zero reshuffles. With flat chunks (1-D sum) the same step ran 36 all-to-alls, 29
    collective-permutes and 64 all-gathers over the model axis."""
    task = make_task("transformer", "synthetic", seed=0)
    tx = optax.adam(1e-3)
    batch = task.train_data.get(np.arange(16))
    state = task.init_state(jax.random.key(0), tx)
    shape = (4, 2) if grad_sum == "1d" else (2, 2, 2)
    mesh = make_mesh(shape)
    dp = data_parallel(
        make_train_step(task, tx),
        mesh,
        model_parallel=2,
        rules="transformer",
        weight_update="sharded",
        grad_sum=grad_sum,
        min_shard_size=64,
        donate_state=False,
    )
    stored = dp.place_state(state, batch)
    chunked = [leaf for leaf in dp.layout.leaves if leaf.sharded and leaf.stored.by is not None]
    assert chunked, "no optimizer state of a split weight is chunked per model partition"
    module = hlo.read(dp.lower(stored, batch).compile(), dp.mesh)
    model = dp.roles.model
    over_model = [c for c in module.collectives if model in c.axes]
    assert not [c for c in over_model if c.kind in RESHUFFLES], [(c.kind, c.op_name) for c in over_model]
    # In the update, the model axis only gathers the updated pieces of the weights the rules keep
    # whole (layer norms, biases: their chunks are split over data x model too).
    update = [c for c in over_model if UPDATE_SCOPE in c.op_name]
    assert {c.kind for c in update} <= {"all-gather"}, [(c.kind, c.op_name) for c in update]
    whole = sum(leaf.bytes for leaf in dp.layout.leaves if leaf.weight and leaf.model_dim is None)
    assert sum(c.buffer_bytes * c.count for c in update) <= whole
    assert any(c.kind == "reduce-scatter" and UPDATE_SCOPE in c.op_name for c in module.collectives)
    plan = make_plan(dp.placement, dp.trace, dp.grad_sum, dp.strategy, module)
    assert plan.tensor["reshuffles"] == {"all-to-all": 0, "collective-permute": 0, "bytes_per_device": 0}
    assert plan.tensor["chunked_per_partition"] == len(chunked)


def test_bert_large_tiny_on_2x4_compiles_without_involuntary_rematerialization(capfd):
    """XLA's SPMD partitioner prints "Involuntary full rematerialization" (on stderr, from C++)
    where it cannot move a value between two shardings but by replicating it. bert-large tiny on
    a 2x4 mesh (model axis of 4, the sharded update) printed it 8 times with flat chunks: the
    scanned layers' gradients went from their heads split to the flat chunks' split. Chunked per
    model partition they keep their split. Compiled here with the persistent cache off, so that
    XLA partitions it (and would print) in this process."""
    from podscale._jax import jax_config
    from podscale.parallel.program import shape_structs

    task = make_task("bert-large", config="tiny")
    tx = task.workload.make_optimizer(task.config, 10)
    batch = task.train_data.get(np.arange(16))
    state = task.init_state(jax.random.key(0), tx)
    dp = data_parallel(
        make_train_step(task, tx), make_mesh((2, 4)), model_parallel=4, rules="bert-large", weight_update="sharded"
    )
    dp.prepare(shape_structs(state), batch)
    capfd.readouterr()
    with jax_config.enable_compilation_cache(False):
        dp.lower(dp.placement.stored_shapes(), shape_structs(batch)).compile()
    err = capfd.readouterr().err
    assert "Involuntary full rematerialization" not in err, err[:2000]


def test_two_weights_of_one_shape_split_along_different_dimensions_each_keep_their_own_chunks():
    """A Megatron MLP of square weights: ``w1`` [16, 16] split by columns, ``w2`` [16, 16] by rows.
    A gradient is chunked as the state leaves it is updated with are split (their kin in the
    step's data flow), not as every leaf of its shape: each weight's Adam moments are chunked per
    model partition along that weight's own dimension (keyed by shape, both fell back to flat
    chunks), no update op runs on gathered values, and 3 steps equal one device's."""
    from helpers import regression_batches, relative_error, run_parallel, run_single, two_layer

    from podscale.parallel.tensor import Rules

    step, state = two_layer(16, jnp.tanh, optax.adam(1e-2), seed=1)
    batches = regression_batches(16, 16, 3)
    rules = Rules(((r"w1$", 1), (r"w2$", 0)), name="column then row")
    dp = data_parallel(
        step, make_mesh((4, 2)), model_parallel=2, rules=rules, weight_update="sharded", min_shard_size=64
    )
    got, _ = run_parallel(dp, state, batches)
    moments = {leaf.path: (leaf.stored.by and leaf.stored.by.dim) for leaf in dp.layout.leaves if leaf.sharded}
    assert moments == {
        "[1][0].mu['w1']": 1,
        "[1][0].mu['w2']": 0,
        "[1][0].nu['w1']": 1,
        "[1][0].nu['w2']": 0,
    }
    assert not dp.trace.gathered_ops, dp.trace.gathered_ops
    want, _ = run_single(step, state, batches)
    assert relative_error(got, want, floor=1e-12) <= 1e-6
