import jax
import numpy as np
import pytest

from podscale import data_parallel, make_mesh
from podscale.parallel.placement import batch_sharding
from podscale.train.data import Loader, batch_indices, padded_eval_batches
from podscale.workloads.datasets import Digits, SyntheticImages, SyntheticTokens


def _identity_step(state, batch):
    return state, {}


def test_batch_order_is_a_pure_function_of_seed_and_step():
    a = batch_indices(seed=3, step=17, global_batch=64, n=1000)
    b = batch_indices(seed=3, step=17, global_batch=64, n=1000)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, batch_indices(seed=4, step=17, global_batch=64, n=1000))
    # Rows of one process are exactly those rows of the global batch.
    np.testing.assert_array_equal(batch_indices(3, 17, 64, 1000, slice(16, 32)), a[16:32])


def test_each_epoch_visits_every_example_once():
    n, batch = 96, 32
    seen = np.concatenate([batch_indices(0, s, batch, n) for s in range(3)])
    np.testing.assert_array_equal(np.sort(seen), np.arange(n))


def test_digits_split_is_fixed_and_disjoint():
    train, test = Digits("train"), Digits("test")
    assert (len(train), len(test)) == (1437, 360)
    assert set(train._rows).isdisjoint(test._rows)
    x = train.get(np.arange(4))
    assert x["image"].shape == (4, 8, 8) and x["image"].dtype == np.float32
    assert 0.0 <= x["image"].min() and x["image"].max() <= 1.0
    with pytest.raises(ValueError, match="split"):
        Digits("validation")


def test_synthetic_examples_are_pure_functions_of_the_index():
    for source in (SyntheticImages(100, seed=1), SyntheticTokens(100, seed=1)):
        a = source.get(np.array([5, 9]))
        b = source.get(np.array([9]))
        for key in a:
            np.testing.assert_array_equal(a[key][1:], b[key])
    tokens = SyntheticTokens(10, seq_len=8, vocab_size=32).get(np.arange(3))
    np.testing.assert_array_equal(tokens["tokens"][:, 1:], tokens["targets"][:, :-1])


def test_loader_builds_global_batches_in_order_from_a_resumed_step():
    source = SyntheticImages(256)
    dp = data_parallel(_identity_step, make_mesh())
    loader = Loader(source, dp, global_batch=32, seed=5, start_step=7)
    try:
        it = iter(loader)
        for expected_step in (7, 8):
            step, batch = next(it)
            assert step == expected_step
            assert batch["image"].sharding == batch_sharding(dp.mesh, dp.roles)
            want = source.get(batch_indices(5, step, 32, len(source)))
            np.testing.assert_array_equal(np.asarray(batch["image"]), want["image"])
    finally:
        loader.close()


def test_loader_rejects_a_batch_larger_than_the_data():
    dp = data_parallel(_identity_step, make_mesh())
    with pytest.raises(ValueError, match="larger than the data set"):
        Loader(SyntheticImages(16), dp, global_batch=32, seed=0)


def test_padded_eval_batches_cover_every_example_once():
    source = SyntheticImages(45)
    dp = data_parallel(_identity_step, make_mesh())
    batches = list(padded_eval_batches(source, dp, batch_size=16))
    masks = np.concatenate([np.asarray(b["mask"]) for b in batches])
    assert masks.sum() == 45 and len(masks) == 48
    images = np.concatenate([np.asarray(b["image"]) for b in batches])[masks > 0]
    np.testing.assert_array_equal(images, source.get(np.arange(45))["image"])


def test_local_rows_rejects_indivisible_batch():
    dp = data_parallel(_identity_step, make_mesh())
    assert dp.local_rows(32) == slice(0, 32)  # one process feeds every row
    with pytest.raises(ValueError, match="multiple of 8"):
        dp.local_rows(20)
    assert jax.process_count() == 1


def test_loader_surfaces_a_source_error_and_closes_promptly():
    class Broken(SyntheticImages):
        def get(self, indices):
            raise OSError("disk gone")

    dp = data_parallel(_identity_step, make_mesh())
    loader = Loader(Broken(64), dp, global_batch=16, seed=0)
    with pytest.raises(OSError, match="disk gone"):
        next(iter(loader))
    loader.close()
    assert not loader._thread.is_alive()
