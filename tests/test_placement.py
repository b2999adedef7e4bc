"""The placement a strategy resolves into (``parallel/placement.py``), and the plan made from it
(``parallel/plan.py``), read directly on small steps: immutable, made once, with named roles; the
plan's figures worked out by hand from the leaves."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from podscale import Strategy, data_parallel, make_mesh
from podscale.parallel.placement import BatchPlacement, Placement, Roles
from podscale.parallel.plan import make_plan

TX = optax.adam(1e-2)


def _step(state, batch):
    params, opt = state

    def loss(p):
        h = jnp.tanh(batch["x"] @ p["w"] + p["b"])
        return jnp.mean((h.sum(axis=1) - batch["y"]) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    updates, opt = TX.update(grads, opt, params)
    return (optax.apply_updates(params, updates), opt), {"loss": value}


def _state():
    params = {"w": jnp.full((16, 8), 0.1, jnp.float32), "b": jnp.zeros((8,), jnp.float32)}
    return params, TX.init(params)


def _batch(rows=16):
    rng = np.random.default_rng(0)
    return {"x": rng.normal(size=(rows, 16)).astype(np.float32), "y": rng.normal(size=(rows,)).astype(np.float32)}


def _conv_step(state, batch):
    kernel = state
    y = jax.lax.conv_general_dilated(batch["image"], kernel, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    grad = jax.grad(
        lambda k: jnp.sum(
            jnp.tanh(
                jax.lax.conv_general_dilated(
                    batch["image"], k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
                )
            )
        )
    )(kernel)
    return kernel - 0.1 * grad, {"mean": y.mean() + batch["label"].mean()}


def test_roles_are_named_and_checked_once_when_the_step_is_built():
    mesh = jax.make_mesh((2, 2, 2), ("data", "space", "model"))
    roles = Roles.of(Strategy(space_axis="space", model_axis="model", rules="transformer"), mesh)
    assert roles == Roles(data=("data",), space="space", model="model", group=None)
    assert (roles.partitions, roles.split(mesh), roles.replicas(mesh)) == (("space", "model"), 4, 2)
    assert Roles.of(Strategy(), make_mesh((4, 2))) == Roles(data=("x", "y"))
    with pytest.raises(ValueError, match="space_axis='depth' is not an axis of the mesh"):
        data_parallel(_step, mesh, Strategy(space_axis="depth"))


def test_prepare_returns_one_frozen_placement_that_never_changes():
    dp = data_parallel(_step, make_mesh(), weight_update="sharded", min_shard_size=8)
    assert dp.layout is None and dp.trace is None  # nothing is decided before prepare
    placement = dp.prepare(_state(), _batch())
    assert isinstance(placement, Placement) and placement.roles == dp.roles
    with pytest.raises(dataclasses.FrozenInstanceError):
        placement.state = None
    # Made once: the same object for the same state, from prepare and place_state alike.
    assert dp.prepare(_state(), _batch()) is placement
    dp.place_state(_state(), _batch())
    assert dp.placement is placement and dp.layout is placement.state
    # Another state signature is refused, naming the leaf; the placement stays.
    params = {"w": jnp.zeros((16, 4)), "b": jnp.zeros((8,))}
    with pytest.raises(ValueError, match=r"\['w'\]"):
        dp.prepare((params, TX.init(params)), _batch())
    assert dp.placement is placement
    # The layout: the weights are read by the forward pass (whole), Adam's moments are chunks.
    sharded = {leaf.path for leaf in placement.state.leaves if leaf.sharded or leaf.chunked}
    assert sharded == {"[1][0].mu['w']", "[1][0].nu['w']", "[1][0].mu['b']", "[1][0].nu['b']"}
    assert placement.batch_specs() == (P(("data",)), P(("data",)))
    assert placement.batch.images == (False, False)


def test_the_traced_body_does_not_set_attributes_of_the_step():
    """The trace of each batch signature is recorded by signature; ``dp.trace`` reads the last
    signature called, and calling another batch size does not change the placement."""
    dp = data_parallel(_step, make_mesh(), donate_state=False)
    state = dp.place_state(_state(), _batch())
    placement = dp.placement
    before = dict(vars(dp))
    dp(state, _batch(16))
    first = dp.trace
    dp(state, _batch(32))
    assert dp.trace is not first and dp.placement is placement
    assert "trace" not in vars(dp)
    changed = {k for k in vars(dp) if k in before and vars(dp)[k] is not before[k]}
    assert changed <= {"_last"}, changed  # caches by signature only


def test_a_space_axis_places_images_by_height_per_batch_signature():
    mesh = jax.make_mesh((4, 2), ("data", "space"))
    dp = data_parallel(_conv_step, mesh, Strategy(space_axis="space"), donate_state=False)
    kernel = jnp.full((3, 3, 2, 4), 0.1, jnp.float32)
    batch = {"image": np.ones((8, 8, 8, 2), np.float32), "label": np.ones((8,), np.float32)}
    placement = dp.prepare(kernel, batch)
    assert placement.batch.images == (True, False)
    assert placement.batch_specs() == (P(("data",), "space"), P(("data",)))
    assert [w.height_in for w in placement.batch.windows] == [8, 8]  # the convolution and its kernel gradient
    shardings = placement.batch_shardings(batch)
    assert shardings["image"].spec == P(("data",), "space") and shardings["label"].spec == P(("data",))
    # Another image size is its own signature: its own windows, the example's placement unchanged.
    other = {"image": np.ones((8, 4, 4, 2), np.float32), "label": np.ones((8,), np.float32)}
    dp(dp.place_state(kernel, batch), other)
    assert dp.placement is placement and placement.batch.windows[0].height_in == 8
    # its images (placed by height over the space axis) are found from its own windows, 4 high
    assert placement.batch_shardings(other)["image"].spec == P(("data",))  # the example's windows: 8 high
    assert dp.batch_shardings(other)["image"].spec == P(("data",), "space")  # every signature's
    assert dp.plan().spatial["image_leaves"] == 1  # the plan reads the last signature called


@pytest.mark.parametrize("weight_update", ["replicated", "sharded"])
def test_the_plan_is_made_from_the_placement_and_the_trace(weight_update):
    """``make_plan`` reads the placement and one signature's trace: the leaves' bytes, the memory
    per device and the traffic against one all-reduce, each worked out here from the shapes."""
    mesh = make_mesh()
    dp = data_parallel(_step, mesh, weight_update=weight_update, min_shard_size=8)
    plan = dp.plan(_state(), _batch())
    assert plan == make_plan(dp.placement, dp.trace, dp.grad_sum, dp.strategy)
    weights = (16 * 8 + 8) * 4  # w and b, float32
    assert plan.memory["weights"] == plan.memory["weights_replicated"] == weights
    assert plan.memory["gradients"] == weights
    moments = 2 * weights  # Adam's mu and nu (its count is an int32 scalar)
    per_device = {"replicated": moments, "sharded": 2 * (16 + 1) * 4}  # 128/8 and 8/8 elements each
    assert plan.memory["optimizer_state_replicated"] == moments + 4
    assert plan.memory["optimizer_state"] == per_device[weight_update] + 4
    assert (plan.replicas, plan.mesh, plan.weight_update) == (8, {"data": 8}, weight_update)
    assert plan.traffic["gradient_bytes"] == weights
    assert plan.traffic["all_reduce_bytes"] == 2 * 7 * weights / 8  # a ring all-reduce of them
    assert plan.grad_sum["mode"] == "1d" and plan.spatial is None and plan.tensor is None
    kinds = {c["kind"] for c in plan.collectives}
    if weight_update == "replicated":
        assert kinds == {"all-reduce"}
    else:  # the chunks' gradients reduce-scattered and the new weights gathered
        assert {"reduce-scatter", "all-gather"} <= kinds
    by_path = {leaf["path"]: leaf for leaf in plan.leaves}
    assert by_path["[1][0].mu['w']"]["sharded"] is (weight_update == "sharded")
    assert by_path["[0]['w']"]["role"] == "weight" and by_path["[1][0].mu['w']"]["role"] == "state"


def test_a_batch_placement_of_no_space_axis_has_no_images():
    assert BatchPlacement((False,)).images == (False,) and BatchPlacement().windows == ()
