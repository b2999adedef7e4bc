"""Inputs across the API (issue 23): a state goes through the step object that placed it, advice
is checked to work, and the command line reads library messages as flags."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from podscale import Strategy, data_parallel, make_mesh
from podscale.cli import as_flags
from podscale.parallel.gradsum import make_grad_sum
from podscale.parallel.strategy import flag_name

# -- A stored state goes through the step object that placed it (finding 11) --------------------


def _step(state, batch):
    w, opt = state
    g = jax.grad(lambda w: jnp.mean((batch["x"] @ w) ** 2))(w)
    return (w - 1e-2 * g, {"m": opt["m"] + g}), {}


STATE = (np.linspace(-1, 1, 65 * 3, dtype=np.float32).reshape(65, 3), {"m": np.zeros((65, 3), np.float32)})
BATCH = {"x": np.linspace(0, 1, 16 * 65, dtype=np.float32).reshape(16, 65)}
# A (8 replicas, sharded) stores m's 195 elements as a flat [200]; each other step object stores
# it otherwise: whole, or flat over 4 replicas ([196]).
OTHERS = {
    "replicated": (lambda: data_parallel(_step, make_mesh(), donate_state=False), r"\[65, 3\]"),
    "sharded, another mesh and min_shard_size": (
        lambda: data_parallel(
            _step, make_mesh((4, 2)), weight_update="sharded", min_shard_size=4096, donate_state=False
        ),
        r"\[65, 3\]",
    ),
    "sharded over 4 devices": (
        lambda: data_parallel(
            _step,
            Mesh(np.array(jax.devices()[:4]), ("data",)),
            weight_update="sharded",
            min_shard_size=64,
            donate_state=False,
        ),
        r"a flat \[196\] \(its \[65, 3\] padded and split over the replicas\)",
    ),
}


@pytest.fixture(scope="module")
def placed_by_a():
    a = data_parallel(_step, make_mesh(), weight_update="sharded", min_shard_size=64, donate_state=False)
    stored, _ = a(a.place_state(STATE, BATCH), BATCH)
    assert stored[1]["m"].shape == (200,)  # the stored, flat, padded layout of a (65, 3) leaf
    return a, stored


def test_the_step_that_placed_a_state_gathers_and_steps_it(placed_by_a):
    a, stored = placed_by_a
    gathered = a.gather_state(stored)
    assert gathered[1]["m"].shape == (65, 3)
    again, _ = a(stored, BATCH)
    assert a.gather_state(again)[1]["m"].shape == (65, 3)


@pytest.mark.parametrize("other", list(OTHERS))
def test_another_step_object_refuses_a_state_it_did_not_place_naming_the_leaf_and_shapes(placed_by_a, other):
    a, stored = placed_by_a
    make, expected_shape = OTHERS[other]
    b = make()
    b.place_state(STATE, BATCH)
    expected = (
        rf"state\[1\]\['m'\] has shape \[200\], but this step stores that leaf as {expected_shape}.*"
        "gather it with the step that placed it"
    )
    with pytest.raises(ValueError, match=expected):
        b.gather_state(stored)
    with pytest.raises(ValueError, match=expected):
        b(stored, BATCH)
    with pytest.raises(ValueError, match=r"state\[1\]\['m'\] is float32\[200\].*but this step was prepared for"):
        b.place_state(stored, BATCH)
    assert a.gather_state(stored)[1]["m"].shape == (65, 3)  # A still reads its own


def test_a_step_object_that_placed_nothing_refuses_flat_stored_leaves_rather_than_guess(placed_by_a):
    _, stored = placed_by_a
    fresh = data_parallel(_step, make_mesh(), donate_state=False)
    for doing, call in (("gather", fresh.gather_state), ("place", lambda s: fresh.place_state(s, BATCH))):
        with pytest.raises(
            ValueError, match=rf"state\[1\]\['m'\] is a flat \[200\] split over mesh axes.*cannot {doing}"
        ):
            call(stored)
    assert fresh.layout is None  # nothing was decided from the flat shapes
    # A replicated state of user-layout leaves is read as it is.
    plain = data_parallel(_step, make_mesh(), donate_state=False)
    replicated = plain.place_state(STATE, BATCH)
    np.testing.assert_array_equal(fresh.gather_state(replicated)[0], STATE[0])


def test_a_user_layout_state_passed_to_the_step_says_to_place_it_first(placed_by_a):
    a, _ = placed_by_a
    with pytest.raises(ValueError, match=r"has shape \[65, 3\].*user layout.*place_state first"):
        a(jax.tree.map(jnp.asarray, STATE), BATCH)


def test_a_state_of_the_same_stored_shapes_from_another_mesh_is_read_alike(placed_by_a):
    """A stored leaf is a global value: a step on another mesh with the same chunk count reads it."""
    a, stored = placed_by_a
    d = data_parallel(_step, make_mesh((4, 2)), weight_update="sharded", min_shard_size=64, donate_state=False)
    d.place_state(STATE, BATCH)
    np.testing.assert_array_equal(d.gather_state(stored)[1]["m"], a.gather_state(stored)[1]["m"])


# -- Advice is checked to work (finding 14) -------------------------------------------------------


def _suggested(message: str) -> list[tuple[int, tuple[int, ...]]]:
    """``(k, mesh shape)`` of every ``FIELD=k with make_mesh((a, b))`` or lone ``make_mesh((a, b))``."""
    pairs = re.findall(r"=(\d+) with make_mesh\(\((\d+), (\d+)\)\)", message)
    if pairs:
        return [(int(k), (int(a), int(b))) for k, a, b in pairs]
    lone = re.findall(r"make_mesh\(\((\d+), (\d+)\)\)", message)
    return [(int(b), (int(a), int(b))) for a, b in lone]


@pytest.mark.parametrize("field", ["spatial", "model_parallel"])
@pytest.mark.parametrize("k", [2, 3, 4, 5, 6, 7, 8, 16])
@pytest.mark.parametrize("shape", [(8,), (2, 2, 2), (4, 2)])
def test_mesh_advice_names_meshes_that_work(field, k, shape):
    extra = {"rules": "transformer"} if field == "model_parallel" else {}
    mesh = make_mesh(shape)
    try:
        data_parallel(_step, mesh, **{field: k}, **extra)
        return  # this mesh already fits
    except ValueError as e:
        message = str(e)
    suggestions = _suggested(message)
    if 8 % k:
        assert f"{k} does not divide the 8 devices" in message, message
    for good_k, good_shape in suggestions:
        assert np.prod(good_shape) == 8 and good_shape[-1] == good_k, message
        data_parallel(_step, make_mesh(good_shape), **{field: good_k}, **extra)  # works
    if 8 % k == 0:
        assert suggestions == [(k, (8 // k, k))], message


def test_the_2d_sum_on_three_axes_names_the_real_reason_and_a_mesh_that_works():
    with pytest.raises(ValueError) as e:
        make_grad_sum(make_mesh((2, 2, 2)), "2d")
    message = str(e.value)
    assert "bn_group_size" not in message and "has 3" in message, message
    ((_, good),) = _suggested(message)
    assert make_grad_sum(make_mesh(good), "2d").mode == "2d"
    # A batch-norm group axis is part of the axis it was split from: two axes, or three, still.
    grouped = make_grad_sum(make_mesh((4, 2), bn_group_size=2), "2d")
    assert grouped.groups == (("x",), ("y", "bn_group")) and grouped.order == ("x", "y", "bn_group")
    with pytest.raises(ValueError, match="has 3 .*counts with the axis it was split from"):
        make_grad_sum(make_mesh((2, 2, 2), bn_group_size=2), "2d")


@pytest.mark.parametrize("n", range(1, 9))
def test_the_2d_sum_on_one_axis_advises_a_mesh_of_its_own_devices(n):
    """Followed, the advice works: a 2-D mesh of the same n devices, or none where none exists."""
    mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
    with pytest.raises(ValueError) as e:
        make_grad_sum(mesh, "2d")
    shapes = [tuple(int(d) for d in m.split(", ")) for m in re.findall(r"make_mesh\(\(([\d, ]+)\)\)", str(e.value))]
    if any(n % d == 0 and 2 <= d <= n // 2 for d in range(2, n)):
        ((a, b),) = shapes
        assert a * b == n and min(a, b) >= 2
        two = Mesh(np.array(jax.devices()[:n]).reshape(a, b), ("x", "y"))
        assert make_grad_sum(two, "2d").mode == "2d"
    else:
        assert not shapes and "use grad_sum='1d'" in str(e.value)


def test_bn_group_size_names_every_workload_that_takes_it():
    from podscale.parallel.mesh import BN_GROUP
    from podscale.train.tasks import bn_group_workloads, make_task

    assert bn_group_workloads() == ["resnet50", "ssd", "maskrcnn"]
    with pytest.raises(ValueError, match=r"\(resnet50, ssd, maskrcnn\); model 'resnet' is not one"):
        make_task("resnet", bn_axis=BN_GROUP)


# -- The command line reads library messages as flags (finding 14) --------------------------------

CLI_FIELDS = [f for f in dataclasses.fields(Strategy) if f.metadata.get("cli", True)]


@pytest.mark.parametrize("field", [f.name for f in CLI_FIELDS])
def test_every_parameter_reads_as_its_flag(field):
    flag = flag_name(field)
    assert as_flags(f"{field}=3: no") == f"{flag} 3: no"
    assert as_flags(f"{field}='abc'; no") == f"{flag} abc; no"
    assert as_flags(f"{field} must be at least 1") == f"{flag} must be at least 1"
    assert as_flags(f"{field}=Rules(((r'x', 0),))") == f"{field}=Rules(((r'x', 0),))"  # Python-only advice kept


@pytest.mark.parametrize("field", [f.name for f in CLI_FIELDS if f.type in ("bool", bool)])
def test_a_switch_reads_as_the_bare_flag(field):
    flag = flag_name(field)
    assert as_flags(f"{field}=True: refused before running") == f"{flag}: refused before running"
    assert as_flags(f"drop {field}=True to run") == f"drop {flag} to run"
    assert "True" not in as_flags(f"{field}=True")


@pytest.mark.parametrize("field", [f.name for f in CLI_FIELDS if "_" in f.name])
def test_a_bare_two_word_parameter_reads_as_its_flag(field):
    assert as_flags(f"drop {field}, or give it") == f"drop {flag_name(field)}, or give it"
    assert as_flags(f"make_{field}(x)") == f"make_{field}(x)"  # part of a Python name: kept


@pytest.mark.parametrize("shape", [(4, 2), (1, 8), (2, 2, 2), (8,)])
def test_a_mesh_in_python_reads_as_the_mesh_flag(shape):
    assert as_flags(f"make one with make_mesh({shape})") == "make one with --mesh " + "x".join(map(str, shape))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--spatial", "3"], "--spatial 2 with --mesh 4x2; --spatial 4 with --mesh 2x4; --spatial 8 with --mesh 1x8"),
        (["--spatial", "4"], "make one with --mesh 2x4"),
        (["--model", "transformer", "--model-parallel", "3"], "--model-parallel 2 with --mesh 4x2"),
        (["--mesh", "2x2x2", "--grad-sum", "2d"], "--grad-sum 2d sums along two mesh axes"),
        (["--model", "mlp", "--model-parallel", "2", "--mesh", "4x2"], "or drop --model-parallel"),
        (["--rules", "transformer"], "--rules transformer is given without --model-parallel"),
    ],
)
def test_the_command_line_gives_advice_in_flags(capsys, args, message):
    from podscale.cli import main

    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "make_mesh" not in err and "=" not in err.split("error:")[1], err


# -- A step's own contract: its state keeps its shapes, its batch has rows, placed state only ------


def _growing_step(state, batch):
    w, opt = state
    return (jnp.concatenate([w, w[:1]]), opt), {}


@pytest.mark.parametrize("weight_update", ["replicated", "sharded"])
def test_a_step_that_changes_a_state_leaf_s_shape_is_refused_on_its_first_call(weight_update):
    dp = data_parallel(_growing_step, make_mesh(), weight_update=weight_update, min_shard_size=64, donate_state=False)
    with pytest.raises(ValueError, match=r"new_state\[0\] with shape \[66, 3\], but was given it with shape \[65, 3\]"):
        dp(dp.place_state(STATE, BATCH), BATCH)


@pytest.mark.parametrize("rows", [0])
def test_a_batch_without_rows_is_refused_naming_the_leaf(rows):
    dp = data_parallel(_step, make_mesh(), donate_state=False)
    state = dp.place_state(STATE, BATCH)
    with pytest.raises(ValueError, match=r"batch\['x'\] has no rows .* at least 8 rows"):
        dp(state, {"x": np.zeros((rows, 65), np.float32)})


def test_a_fresh_step_object_called_with_another_s_stored_state_names_the_leaf(placed_by_a):
    _, stored = placed_by_a
    fresh = data_parallel(_step, make_mesh(), weight_update="sharded", min_shard_size=64, donate_state=False)
    with pytest.raises(ValueError, match=r"state\[1\]\['m'\] is a flat \[200\] .* placed by another step object"):
        fresh(stored, BATCH)
