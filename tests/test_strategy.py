"""The strategy is one value: the API, the trainer config and the CLI flags all come from it."""

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import pytest
from helpers import max_abs_diff, run_parallel

from podscale import Strategy, data_parallel, make_mesh
from podscale.parallel.strategy import add_flags, flag_name, from_flags
from podscale.train.trainer import TrainConfig


def _step(w, batch):
    g = jax.grad(lambda w: jnp.sum((batch["x"] @ w) ** 2))(w)
    return w - 1e-3 * g, {}


def test_a_strategy_value_and_keywords_give_the_same_step():
    w, batches = jnp.ones((4, 512)), [{"x": jnp.arange(32.0 * 4).reshape(32, 4) / 100}]
    by_value = data_parallel(_step, make_mesh(), Strategy(weight_update="sharded", min_shard_size=64))
    by_keywords = data_parallel(_step, make_mesh(), weight_update="sharded", min_shard_size=64)
    changed = data_parallel(_step, make_mesh(), Strategy(weight_update="sharded"), min_shard_size=64)
    outs = [run_parallel(dp, w, batches)[0] for dp in (by_value, by_keywords, changed)]
    assert by_value.strategy == by_keywords.strategy == changed.strategy
    assert max_abs_diff(outs[0], outs[1]) == 0 and max_abs_diff(outs[0], outs[2]) == 0
    assert any(c.kind == "reduce-scatter" for c in by_value.trace.collectives)  # the sharded update ran


def test_bad_strategies_name_the_parameter():
    with pytest.raises(ValueError, match="weight_update='zero3'"):
        Strategy(weight_update="zero3")
    with pytest.raises(ValueError, match="min_shard_size must be at least 1"):
        Strategy(min_shard_size=0)
    with pytest.raises(TypeError, match=r"unknown options \['shard_everything'\]"):
        data_parallel(_step, make_mesh(), shard_everything=True)
    with pytest.raises(TypeError, match="strategy must be a podscale.Strategy"):
        data_parallel(_step, make_mesh(), "sharded")


def test_data_axes_are_named_once_and_checked_against_the_mesh():
    mesh = make_mesh((4, 2))
    assert data_parallel(_step, mesh, data_axes=("x", "y")).axes == ("x", "y")
    with pytest.raises(ValueError, match=r"mesh axes \['y'\] are not data axes"):
        data_parallel(_step, mesh, data_axes=("x",))
    with pytest.raises(ValueError, match=r"data_axes \['z'\] are not axes of the mesh"):
        data_parallel(_step, mesh, data_axes=("z",))


def test_every_field_is_a_flag_and_the_flags_make_the_same_strategy():
    parser = argparse.ArgumentParser()
    add_flags(parser)
    flags = {a.option_strings[0] for a in parser._actions if a.option_strings}
    fields = [f.name for f in dataclasses.fields(Strategy) if f.metadata.get("cli", True)]
    assert {flag_name(f) for f in fields} <= flags
    args = parser.parse_args(["--weight-update", "sharded", "--grad-sum-chunks", "3", "--strict"])
    assert from_flags(args) == Strategy(weight_update="sharded", grad_sum_chunks=3, strict=True)
    assert TrainConfig().strategy == Strategy()
