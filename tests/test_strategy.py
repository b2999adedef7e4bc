"""The strategy is one value: the API, the trainer config and the CLI flags all come from it."""

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import max_abs_diff, run_parallel

from podscale import Strategy, data_parallel, make_mesh
from podscale.parallel.strategy import add_flags, flag_name, from_flags
from podscale.parallel.tensor import RULES, Rules, with_model_rules
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
    assert data_parallel(_step, mesh, data_axes=("x", "y")).roles.data == ("x", "y")
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


# -- Every field checks its type where it is declared (issue 23, findings 13 and 15) ----------------
# One table of wrong values per kind of field; every field must have its row, so a new field
# cannot go unchecked.

_INT = ["2", 2.5, 2.0, True, [2], b"2"]
WRONG_TYPES = {
    "data_axes": ["data", 3, ("x", 1), ("x", ""), {"x": 1}],
    "weight_update": [2, None, True, b"sharded", ("sharded",)],
    "min_shard_size": [*_INT, None],
    "bucket_bytes": [*_INT, None],
    "grad_sum": [2, None, True, ("2d",)],
    "grad_sum_chunks": _INT,
    "grad_sum_phases": [2, True, ("xla",)],
    "min_table_rows": _INT,
    "grad_sum_dtype": [3, True, "big", object()],
    "axis_costs": [3, ["x"], {"x": 1e9}, {1: None}],
    "strict": [1, 0, "yes", None, "True"],
    "rng": [1, None, True],
    "spatial": _INT,
    "model_parallel": _INT,
    "space_axis": [3, True, ("space",), ""],
    "fsdp_axes": [3, True, (3,), b"y", ("y", "")],
    "model_axis": [3, True, ("model",), b"model"],
    "rules": [3, ("w", 0), True, [("w", 0)]],
}
OUT_OF_RANGE = {
    "min_shard_size": [0, -1],
    "bucket_bytes": [0, -5],
    "grad_sum_chunks": [0, -1],
    "min_table_rows": [0, -1],
    "spatial": [0, -2],
    "model_parallel": [0, -2],
    "weight_update": ["zero3", ""],
    "grad_sum": ["ring"],
    "grad_sum_phases": ["ring", ""],
    "rng": ["per-device"],
    "grad_sum_dtype": ["int32", "bool"],
    "axis_costs": ["x=fast"],
    "rules": ["resnet"],
    "data_axes": [()],
    "fsdp_axes": [()],
}


def test_every_field_has_wrong_type_cases():
    assert set(WRONG_TYPES) == {f.name for f in dataclasses.fields(Strategy)}


@pytest.mark.parametrize(
    ("field", "value"),
    [(f, v) for f, values in WRONG_TYPES.items() for v in values],
    # ids must be the same in every pytest-xdist worker: an object's repr holds its address
    ids=[
        f"{f}={type(v).__name__}:{v!r}"[:60] if type(v) is not object else f"{f}=object"
        for f, values in WRONG_TYPES.items()
        for v in values
    ],
)
def test_a_wrong_type_is_a_type_error_naming_the_field_the_value_and_its_type(field, value):
    with pytest.raises(TypeError) as e:
        Strategy(**{field: value})
    message = str(e.value)
    assert f"{field}" in message and "give" in message, message
    assert "not supported" not in message and "unpack" not in message


@pytest.mark.parametrize(
    ("field", "value"),
    [(f, v) for f, values in OUT_OF_RANGE.items() for v in values],
    ids=[f"{f}={v!r}" for f, values in OUT_OF_RANGE.items() for v in values],
)
def test_a_value_out_of_range_is_a_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        Strategy(**{field: value})


def test_numpy_scalars_are_taken_as_the_python_values_they_equal():
    s = Strategy(min_shard_size=np.int64(64), grad_sum_chunks=np.int32(2), strict=np.bool_(True))
    assert (s.min_shard_size, s.grad_sum_chunks, s.strict) == (64, 2, True)
    assert type(s.min_shard_size) is int and type(s.strict) is bool
    assert Strategy(data_axes=["x", "y"]).data_axes == ("x", "y")
    assert Strategy(grad_sum_dtype=jnp.bfloat16).grad_sum_dtype is jnp.bfloat16


def test_a_single_string_of_data_axes_is_refused_with_advice():
    with pytest.raises(TypeError, match=r"data_axes='data' is one string.*data_axes=\('data',\)"):
        Strategy(data_axes="data")


@pytest.mark.parametrize("rules", [*RULES, "custom"])
def test_rules_without_model_parallel_are_refused(rules):
    given = Rules(((r"kernel$", -1),)) if rules == "custom" else rules
    with pytest.raises(ValueError, match=rf"rules='{rules}' is given without model_parallel"):
        Strategy(rules=given)
    with pytest.raises(ValueError, match="without model_parallel"):
        dataclasses.replace(Strategy(model_parallel=2, rules=given), model_parallel=None)
    # One partition is plain data parallelism: nothing for the rules to split.
    assert Strategy(model_parallel=1, rules=given) == Strategy()
    assert dataclasses.replace(Strategy(model_parallel=1, rules=given), weight_update="sharded").rules is None


def test_the_model_s_own_rules_are_still_filled_in_for_model_parallel():
    assert with_model_rules(Strategy(model_parallel=2), "transformer").rules is RULES["transformer"]
    assert with_model_rules(Strategy(), "transformer").rules is None  # no model_parallel: no rules
    with pytest.raises(ValueError, match=r"model_parallel=2: model 'mlp' has no built-in sharding rules"):
        with_model_rules(Strategy(model_parallel=2), "mlp")


def test_rules_without_model_parallel_are_refused_on_the_command_line(capsys):
    from podscale.cli import main

    assert main(["plan", "--model", "transformer", "--rules", "transformer"]) == 2
    err = capsys.readouterr().err
    assert "--rules transformer is given without --model-parallel" in err and "Traceback" not in err


# -- Axis roles by name ----------------------------------------------------------------------------


def test_named_roles_resolve_by_name_and_the_counts_by_position():
    mesh = make_mesh((2, 2, 2), ("space", "data", "more"))
    assert Strategy(space_axis="space").space_of(mesh) == "space"
    assert Strategy(space_axis="space").axes(mesh) == ("data", "more")
    assert Strategy(model_axis="data", data_axes=("space", "more")).axes(mesh) == ("space", "more")
    assert Strategy(spatial=2).space_of(mesh) == "more"  # a count names no axis: the last one
    assert Strategy(space_axis="space", spatial=2).space_of(mesh) == "space"  # both given, and they agree
    assert Strategy().partitions_of(mesh) == ()
    both = Strategy(space_axis="space", model_axis="more", rules="transformer")
    assert (both.partitions_of(mesh), both.axes(mesh)) == (("space", "more"), ("data",))
    assert Strategy(space_axis="space", model_parallel=2, rules="transformer").partitions_of(mesh) == ("space", "more")


@pytest.mark.parametrize(
    ("strategy", "mesh", "message"),
    [
        (dict(space_axis="s"), ((2, 4), ("data", "space")), r"space_axis='s' is not an axis of the mesh"),
        (dict(model_axis="model"), ((8, 1), ("data", "model")), r"model_axis='model' has 1 device"),
        (dict(space_axis="space", spatial=2), ((2, 4), ("data", "space")), r"spatial=2 and space_axis='space'"),
        (dict(model_axis="m"), ((8,), ("m",)), r"no data axis beside the model axis"),
        (dict(space_axis="y", data_axes=("x", "y")), ((2, 4), ("x", "y")), r"data_axes \('x', 'y'\) include 'y'"),
    ],
    ids=["unknown axis", "one device", "count disagrees", "no data axis", "also a data axis"],
)
def test_a_named_role_that_does_not_fit_the_mesh_is_refused_naming_the_axis(strategy, mesh, message):
    shape, names = mesh
    with pytest.raises(ValueError, match=message):
        data_parallel(_step, make_mesh(shape, names, devices=jax.devices()[: int(np.prod(shape))]), **strategy)


def test_space_and_model_by_count_are_refused_before_any_mesh():
    with pytest.raises(
        ValueError, match=r"spatial=2 and model_parallel=2 would both take the mesh.s last axis: to split images and"
    ):
        Strategy(spatial=2, model_parallel=2)


@pytest.mark.parametrize(
    ("strategy", "shape", "message"),
    [
        (dict(space_axis="space", model_parallel=2), (4, 2), r"space axis and the model axis are both .space."),
        (dict(space_axis="space", model_axis="data"), (4, 2), r"has no data axis beside the space axis"),
    ],
    ids=["the same axis", "no data axis left"],
)
def test_space_and_model_roles_that_leave_no_data_axis_or_share_one_are_refused(strategy, shape, message):
    mesh = make_mesh(shape, ("data", "space"))
    strategy = Strategy(**strategy, rules="transformer")
    with pytest.raises(ValueError, match=message):
        strategy.axes(mesh)


def test_one_axis_has_one_role():
    with pytest.raises(ValueError, match="one axis has one role"):
        Strategy(space_axis="x", model_axis="x")
