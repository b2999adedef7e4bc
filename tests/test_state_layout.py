"""``state_layout.decide`` on abstract states: which leaves are stored as flat 1/N chunks and which
stay whole, their chunk lengths, padding, stored shapes and shardings (with the ``parts`` axes left
to XLA and a ``model`` axis), the checks of a state against the layout, and placing then fetching a
state (bit for bit, whatever the replica count divides). No step is traced or compiled."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from podscale import make_mesh
from podscale.parallel import state_layout

S = jax.ShapeDtypeStruct
KEY = jax.eval_shape(lambda: jax.random.key(0))


def _state():
    """Flat order (keys sorted): key, mu, params.b, params.w, step, v16."""
    return {
        "key": KEY,
        "mu": S((100,), jnp.float32),  # 8 replicas: chunks of 13, 4 elements of padding
        "params": {"b": S((3,), jnp.float32), "w": S((10, 10), jnp.float32)},
        "step": S((), jnp.int32),
        "v16": S((4, 4), jnp.bfloat16),  # exactly min_shard_size elements, 8 divides it
    }


def _by_path(layout):
    return {leaf.path: leaf for leaf in layout.leaves}


def test_which_leaves_are_chunked_and_why():
    layout = state_layout.decide(_state(), make_mesh(), {2, 3}, 16)
    leaves = _by_path(layout)
    assert [p for p, leaf in leaves.items() if leaf.sharded] == ["['mu']", "['v16']"]
    assert leaves["['mu']"].reason == "sharded" and not leaves["['mu']"].weight
    assert (leaves["['mu']"].stored.length, leaves["['mu']"].stored.padding) == (13, 4)
    assert (leaves["['v16']"].stored.length, leaves["['v16']"].stored.padding) == (2, 0)
    assert leaves["['params']['w']"].weight and leaves["['params']['w']"].reason.startswith("weight: the forward pass")
    assert leaves["['params']['b']"].reason == "small: 3 < min_shard_size 16"
    assert leaves["['step']"].reason == "not a float (int32)"
    assert leaves["['key']"].reason.startswith("not a float (key<")
    assert layout.n == 8 and layout.any_sharded and not layout.any_split
    assert leaves["['mu']"].padding_bytes == 16 and leaves["['mu']"].bytes_per_device() == 13 * 4
    assert leaves["['v16']"].bytes_per_device() == 2 * 2 and leaves["['params']['w']"].bytes_per_device() == 400
    # One element under min_shard_size stays whole; without the forward set the weight is chunked.
    assert not _by_path(state_layout.decide(_state(), make_mesh(), {2, 3}, 17))["['v16']"].sharded
    assert _by_path(state_layout.decide(_state(), make_mesh(), None, 16))["['params']['w']"].sharded


def test_the_replicated_update_chunks_nothing():
    layout = state_layout.decide(_state(), make_mesh(), {2, 3}, 1, shard=False)
    assert not layout.any_sharded
    assert {leaf.reason for leaf in layout.leaves if jnp.issubdtype(leaf.dtype, jnp.floating)} == {
        "weight_update='replicated'"
    }
    assert jax.tree.leaves(layout.specs(), is_leaf=lambda x: isinstance(x, P)) == [P()] * 6


def test_stored_shapes_are_flat_padded_chunks_with_their_shardings():
    mesh = make_mesh()
    layout = state_layout.decide(_state(), mesh, {2, 3}, 16)
    stored = layout.stored_shapes()
    assert jax.tree.structure(stored) == jax.tree.structure(_state())
    assert stored["mu"].shape == (104,) and stored["mu"].dtype == jnp.float32
    assert stored["v16"].shape == (16,) and stored["v16"].dtype == jnp.bfloat16
    assert stored["params"]["w"].shape == (10, 10) and stored["step"].shape == ()
    assert stored["mu"].sharding == NamedSharding(mesh, P(("data",)))
    assert stored["params"]["w"].sharding == NamedSharding(mesh, P())
    assert layout.specs()["mu"] == P(("data",)) and layout.specs()["params"]["b"] == P()
    weak = state_layout.decide({"lr": S((), jnp.float32, weak_type=True)}, mesh, set(), 1)
    assert weak.stored_shapes()["lr"].weak_type


def test_a_chunk_is_split_over_the_parts_axes_too():
    mesh = jax.make_mesh((4, 2), ("data", "space"))
    state = {"odd": S((99,), jnp.float32), "w": S((8, 8), jnp.float32)}
    layout = state_layout.decide(state, mesh, {1}, 1, order=("data",), parts=("space",))
    odd, w = layout.leaves
    # ceil(99 / 4) = 25 rounded up to a multiple of the 2 space devices: 26; 4 x 26 - 99 = 5.
    assert (odd.stored.length, odd.stored.padding, odd.stored.split) == (26, 5, 2)
    assert odd.reason == "sharded over 4 replicas x 2 partitions" and odd.bytes_per_device() == 13 * 4
    assert layout.n == 4 and not w.sharded
    stored = layout.stored_shapes()
    assert stored["odd"].shape == (104,)
    assert stored["odd"].sharding == NamedSharding(mesh, P(("data", "space")))
    assert layout.specs()["odd"] == P(("data",))  # what the shard_map, manual over data, sees


def test_a_model_dim_splits_a_leaf_in_its_own_shape():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    state = {"m": S((6, 8), jnp.float32), "w": S((6, 8), jnp.float32), "z": S((5,), jnp.float32)}
    kw = dict(order=("data",), parts=("model",), model="model", model_dims=(1, 1, None))
    layout = state_layout.decide(state, mesh, {1}, 8, **kw)
    m, w, z = layout.leaves
    assert w.model_dim == 1 and w.model_split == 2 and not w.sharded
    assert w.reason == "dimension 1 split over model axis 'model' (2 devices), whole over the replicas"
    assert w.bytes_per_device() == 6 * 8 * 4 // 2
    # Optimizer state under a rule is chunked over data x model instead, flat.
    assert m.sharded and m.model_dim is None and (m.stored.length, m.stored.padding, m.stored.split) == (12, 0, 2)
    assert not z.sharded and z.model_dim is None  # small, no rule: replicated
    stored = layout.stored_shapes()
    assert stored["w"].shape == (6, 8) and stored["w"].sharding == NamedSharding(mesh, P(None, "model"))
    assert stored["m"].shape == (48,) and stored["m"].sharding == NamedSharding(mesh, P(("data", "model")))
    assert stored["z"].sharding == NamedSharding(mesh, P())
    assert layout.any_split
    # The replicated update keeps the split of every leaf with a rule, optimizer state's too.
    replicated = state_layout.decide(state, mesh, {1}, 8, shard=False, **kw)
    assert [leaf.model_dim for leaf in replicated.leaves] == [1, 1, None]
    assert replicated.stored_shapes()["m"].sharding == NamedSharding(mesh, P(None, "model"))


def test_check_user_refuses_other_shapes_and_names_the_leaf():
    layout = state_layout.decide(_state(), make_mesh(), {2, 3}, 16)
    ok = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), {k: v for k, v in _state().items() if k != "key"})
    ok["key"] = jax.random.key(1)
    layout.check_user(ok)
    bad = dict(ok, params={"b": ok["params"]["b"], "w": np.zeros((10, 11), np.float32)})
    with pytest.raises(ValueError, match=r"state\['params'\]\['w'\] is float32\[10, 11\], but this step was prepared "):
        layout.check_user(bad)
    with pytest.raises(ValueError, match=r"params\['mu'\] is float32\[104\] \(the stored, flat layout"):
        layout.check_user(dict(ok, mu=np.zeros(104, np.float32)), "params")
    with pytest.raises(ValueError, match=r"state\['step'\] is float32\[\]"):
        layout.check_user(dict(ok, step=np.zeros((), np.float32)))
    with pytest.raises(ValueError, match="has structure"):
        layout.check_user({k: v for k, v in ok.items() if k != "step"})
    # check_stored: the user layout of a chunked leaf is not its stored one.
    with pytest.raises(ValueError, match=r"state\['mu'\] has shape \[100\].*a flat \[104\].*place it with"):
        layout.check_stored(ok)


def _values(shape, dtype, seed):
    x = np.random.default_rng(seed).standard_normal(shape).astype(dtype)
    if x.size > 2:
        x.reshape(-1)[:3] = [np.nan, -0.0, np.inf]
    return x


def _same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.mark.parametrize(
    "shape,names,order,parts",
    [
        ((8,), ("data",), None, ()),
        ((4, 2), ("x", "y"), ("y", "x"), ()),
        ((4, 2), ("data", "space"), ("data",), ("space",)),
    ],
)
def test_place_then_fetch_is_bit_for_bit(shape, names, order, parts):
    mesh = jax.make_mesh(shape, names)
    state = {
        "odd": _values((7, 13), np.float32, 0),  # 91 elements: 8 and 4 replicas leave padding
        "half": _values((5, 3), jnp.bfloat16, 1),
        "w": _values((4, 4), np.float32, 2),
        "step": np.int32(7),
        "key": jax.random.key(3),
    }
    layout = state_layout.decide(state, mesh, {4}, 8, order=order, parts=parts)  # w is read by the forward pass
    assert [leaf.sharded for leaf in layout.leaves] == [True, False, True, False, False]  # half, key, odd, step, w
    placed = layout.place(state)
    layout.check_stored(placed)
    odd = layout.leaves[2]
    assert placed["odd"].shape == (odd.stored.length * layout.n,) and odd.stored.padding > 0
    assert placed["odd"].sharding == layout.stored_shapes()["odd"].sharding
    padded = np.asarray(placed["odd"])
    assert _same_bits(padded[91:], np.zeros(odd.stored.padding, np.float32))  # zero padding at the end
    back = layout.fetch(placed)
    for name in ("odd", "half", "w", "step"):
        assert _same_bits(back[name], state[name]), name
    assert _same_bits(jax.random.key_data(back["key"]), jax.random.key_data(state["key"]))
    # store / unstore, the same conversion as pure functions
    stored = layout.store({k: jnp.asarray(v) if k != "key" else v for k, v in state.items()})
    assert _same_bits(stored["odd"], padded)
    assert _same_bits(layout.unstore(stored)["odd"], state["odd"])


def test_chunks_follow_the_order_of_the_axes():
    """Chunk i lands on device i of ``order``: with (y, x) chunk 1 is on mesh position x=1, y=0."""
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    x = np.arange(20, dtype=np.float32)  # chunks of 3, 4 elements of padding
    for order, device in ((None, mesh.devices[0, 1]), (("y", "x"), mesh.devices[1, 0])):
        layout = state_layout.decide([S(x.shape, x.dtype)], mesh, set(), 1, order=order)
        (placed,) = layout.place([x])
        (one,) = [s for s in placed.addressable_shards if s.device == device]
        assert np.asarray(one.data).tolist() == [3.0, 4.0, 5.0]
        assert np.asarray(placed).tolist() == [*range(20), 0, 0, 0, 0]
        assert state_layout.stored_chunk(placed) == (order or ("x", "y"))
    with pytest.raises(ValueError, match=r"state\[0\] is a flat \[24\] split over mesh axes \('y', 'x'\)"):
        state_layout.refuse_stored([placed], "state", "step")
    state_layout.refuse_stored([x], "state", "step")  # host data is never a stored chunk
