import jax
import numpy as np
import optax

from podscale import distributed_eval, make_mesh
from podscale.parallel.engine import data_parallel
from podscale.train.data import padded_eval_batches
from podscale.train.tasks import make_eval_fn, make_task, make_train_step


def test_distributed_eval_equals_single_device_eval_on_an_indivisible_set():
    task = make_task("resnet", "digits")  # 360 held-out images: batches of 64 leave 40, padded
    tx = optax.sgd(0.1)
    state = task.init_state(jax.random.key(0), tx)
    state, _ = jax.jit(make_train_step(task, tx))(state, task.train_data.get(np.arange(64)))
    mesh = make_mesh()
    dp = data_parallel(make_train_step(task, tx), mesh)
    got = distributed_eval(make_eval_fn(task), mesh)(dp.place_state(state), padded_eval_batches(task.eval_data, dp, 64))

    per = jax.jit(make_eval_fn(task))(state, task.eval_data.get(np.arange(len(task.eval_data))))
    correct = float(np.sum(np.asarray(per["accuracy"])))
    assert got["accuracy"] == correct / 360  # counts of 0/1 in float32 are exact
    np.testing.assert_allclose(got["loss"], float(np.mean(np.asarray(per["loss"], np.float64))), rtol=1e-6)


def test_on_cpu_each_batch_program_ends_before_the_next_is_launched():
    """XLA:CPU stalls, then aborts, when evaluation launches batch programs (collectives, then the
    adds of their sums) ahead of each other (evaluate._one_program_at_a_time): each batch's
    program must be done when the next one is launched."""
    task = make_task("resnet", "digits")
    tx = optax.sgd(0.1)
    mesh = make_mesh()
    dp = data_parallel(make_train_step(task, tx), mesh)
    state = dp.place_state(task.init_state(jax.random.key(0), tx))
    run = distributed_eval(make_eval_fn(task), mesh)
    compiled, launched = run._compiled, []

    def watched(batch, rows=False):
        program = compiled(batch, rows)

        def call(*args):
            assert all(x.is_ready() for x in jax.tree.leaves(launched)), f"batch {len(launched)} launched early"
            launched.append(program(*args))
            return launched[-1]

        return call

    run._compiled = watched
    run(state, padded_eval_batches(task.eval_data, dp, 64))
    assert len(launched) == 6  # 360 held-out images in batches of 64
