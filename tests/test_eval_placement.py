"""Evaluation placed as the train step is: the stored state as it lives (split weights split over
the model axis, optimizer-state chunks as chunks), rows over the data axes only; the same metrics
as one device, and no more memory per device than the step."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from podscale import data_parallel, distributed_eval, make_mesh
from podscale.compiled import hlo
from podscale.train.data import padded_eval_batches
from podscale.train.tasks import make_eval_fn, make_task, make_train_step
from podscale.workloads.precision import FLOAT32


class _First:
    """The first ``n`` examples of a data set."""

    def __init__(self, source, n):
        self.source, self.n = source, n

    def __len__(self):
        return self.n

    def get(self, indices):
        return self.source.get(indices)


def _gathered_shape(text: str, name: str) -> tuple[int, ...]:
    m = re.search(rf"%{re.escape(name)} = \w+\[([\d,]*)\]", text)
    assert m, name
    return tuple(int(d) for d in m.group(1).split(",") if d)


def test_eval_of_a_model_parallel_step_keeps_the_split_weights_split_and_needs_no_more_memory():
    """bert-large tiny on a 2x4 mesh, --model-parallel 4, the sharded update: the eval step's
    split weights arrive as the state stores them (split over the model axis; the optimizer-state
    chunks are not read, so not passed), no all-gather over the model axis rebuilds a split
    weight (or one layer's slice of it), and its memory per device is at most the train step's."""
    task = make_task("bert-large", config="tiny", policy=FLOAT32)
    tx = task.workload.make_optimizer(task.config, 10)
    batch = task.batch_shapes(32)
    state = jax.eval_shape(lambda b: task.init_state(jax.random.key(0), tx, b), batch)
    dp = data_parallel(
        make_train_step(task, tx), make_mesh((2, 4)), model_parallel=4, rules="bert-large", weight_update="sharded"
    )
    dp.prepare(state, batch)
    stored = dp.placement.stored_shapes()
    train = dp.lower(stored, batch).compile()
    evaluate = distributed_eval(make_eval_fn(task), dp)
    step = evaluate.lower(stored, {**batch, "mask": jax.ShapeDtypeStruct((32,), jnp.float32)}).compile()

    train_memory, eval_memory = hlo.memory_of(train), hlo.memory_of(step)
    assert eval_memory["peak"] <= train_memory["peak"], (eval_memory, train_memory)
    total = lambda m: m["arguments"] + m["outputs"] + m["temporaries"]  # noqa: E731
    assert total(eval_memory) <= total(train_memory)

    layout = dp.layout
    split = [leaf for leaf in layout.leaves if leaf.model_dim is not None and leaf.weight]
    assert len(split) >= 8
    given = jax.tree.leaves(step.input_shardings[0][0], is_leaf=lambda x: x is None)  # None: not read
    wanted = jax.tree.leaves(layout.shardings())
    read = 0
    for leaf, got, want in zip(layout.leaves, given, wanted, strict=True):
        if leaf.sharded:
            assert got is None, f"{leaf.path}: an optimizer-state chunk the eval does not read"
        elif got is not None and leaf.model_dim is not None:
            assert got.is_equivalent_to(want, len(leaf.shape)), (leaf.path, got, want)
            read += 1
    assert read == len(split)

    module = hlo.read(step, dp.mesh)
    text = step.as_text()
    whole = {leaf.shape for leaf in split} | {leaf.shape[1:] for leaf in split}  # a leaf, one layer's slice
    over_model = [c for c in module.collectives if c.kind == "all-gather" and dp.roles.model in c.axes]
    for c in over_model:
        assert _gathered_shape(text, c.name) not in whole, (c.name, c.op_name)
    assert any(c.kind == "all-reduce" and dp.roles.model in c.axes for c in module.collectives)  # XLA partitioned it


@pytest.mark.parametrize(
    ("name", "shape", "options"),
    [
        ("bert-large", (4, 2), {"model_parallel": 2, "rules": "bert-large", "weight_update": "sharded"}),
        # min_shard_size=16: batch norm's running statistics, which only the eval reads, are chunked
        ("resnet", (8,), {"weight_update": "sharded", "min_shard_size": 16}),
    ],
)
def test_eval_on_the_steps_placement_equals_one_device(name, shape, options):
    """A model-parallel 4x2 step (bert-large tiny) and an 8-replica sharded update (the small
    ResNet, momentum chunked, its batch-norm statistics chunked and gathered for the eval):
    the held-out metrics equal one device's on the whole set within 1e-6 relative."""
    if name == "resnet":
        task, tx, n, rows = make_task("resnet", "digits"), optax.sgd(0.1, momentum=0.9), 360, 64
    else:
        task, n, rows = make_task(name, config="tiny", policy=FLOAT32), 100, 32
        tx = task.workload.make_optimizer(task.config, 10)
    state = task.init_state(jax.random.key(0), tx)
    first = task.train_data.get(np.arange(16))
    state, _ = jax.jit(make_train_step(task, tx))(state, first)  # batch norm's statistics move
    dp = data_parallel(make_train_step(task, tx), make_mesh(shape), **options)
    stored = dp.place_state(state, first)
    if name == "resnet":
        assert any((leaf.sharded or leaf.chunked) and leaf.path.startswith(".batch_stats") for leaf in dp.layout.leaves)
    source = _First(task.eval_data, n)
    got = distributed_eval(make_eval_fn(task), dp)(stored, padded_eval_batches(source, dp, rows))

    per = jax.jit(make_eval_fn(task))(state, source.get(np.arange(n)))
    assert set(got) == set(per)
    for k, v in per.items():
        np.testing.assert_allclose(got[k], np.mean(np.asarray(v, np.float64)), rtol=1e-6, err_msg=k)
