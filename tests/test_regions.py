"""Regions partitioned by hand (``podscale.sum_over_blocks``): each partition of the space axis
computes its own rows' share and one sum crosses the axis; the step equals one device's (float64,
summation order only), forward and backward, with the arguments' gradients summed, a leaf the
axis does not divide padded, and a region that is not row by row over the data axes left to XLA."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import max_relative_diff

from podscale import data_parallel, distributed_eval, make_mesh, sum_over_blocks
from podscale.compiled import hlo
from podscale.parallel.plan import make_plan
from podscale.parallel.tensor import Rules
from podscale.workloads import rcnn

STEPS = 3
HEIGHTS = (16, 8, 4)  # the pyramid's levels 2-4 of a 64-pixel image: 1x8 splits level 4 unevenly
TOLERANCE = 1e-12
"""Relative, float64: the partitioned sums reorder one device's (measured: about 1e-16)."""


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def _pooled(state, batch):
    """A pyramid of strided convolutions of the image, RoIAlign of each box on its level (a region
    over the maps' rows, scaled per channel by a weight passed as its argument)."""
    x = batch["image"]
    maps = [
        jax.lax.conv_general_dilated(x, w, (64 // h,) * 2, "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        for w, h in zip(state["conv"], HEIGHTS, strict=True)
    ]
    heights = [m.shape[1] for m in maps]

    def rows(blocks, starts, boxes, scale):
        pool = functools.partial(
            rcnn.multilevel_roi_align,
            levels=range(2, 5),
            output=3,
            sampling_ratio=2,
            canonical=(8.0, 3),
            starts=starts,
            heights=heights,
        )
        return jax.vmap(lambda fm, b: pool(fm, b))(blocks, boxes) * scale

    return sum_over_blocks(rows, maps, batch["boxes"], state["scale"], dim=1, name="pool")


def _step(tx):
    def step(state, batch):
        params, opt = state

        def loss(p):
            pooled = _pooled(p, batch)
            return jnp.mean(jnp.square(pooled - batch["target"]).sum((1, 2, 3, 4)))

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), {"loss": value}

    return step


def _setup(rows=16):
    rng = np.random.default_rng(0)
    params = {"conv": [rng.normal(size=(3, 3, 2, 4)) * 0.3 for _ in HEIGHTS], "scale": rng.normal(size=(4,))}
    corners = np.sort(rng.uniform(-4, 68, size=(STEPS, rows, 5, 2, 2)), axis=3)  # x0 < x1, y0 < y1
    batches = [
        {
            "image": rng.normal(size=(rows, 64, 64, 2)),
            "boxes": corners[s].transpose(0, 1, 3, 2).reshape(rows, 5, 4),
            "target": rng.normal(size=(rows, 5, 3, 3, 4)),
        }
        for s in range(STEPS)
    ]
    tx = optax.sgd(0.01, momentum=0.9)
    return _step(tx), (params, tx.init(params)), batches


def _one_device(step, state, batches):
    jstep = jax.jit(step)
    for batch in batches:
        state, _ = jstep(state, batch)
    return jax.device_get(state)


@pytest.mark.parametrize(
    ("shape", "weight_update"),
    [((4, 2), "replicated"), ((4, 2), "sharded"), ((2, 4), "replicated"), ((2, 4), "sharded"), ((1, 8), "sharded")],
    ids=["k2-replicated", "k2-sharded", "k4-replicated", "k4-sharded", "1x8-uneven-sharded"],
)
def test_region_by_hand_equals_one_device(shape, weight_update):
    step, state, batches = _setup()
    want = _one_device(step, state, batches)
    assert max_relative_diff(want, state) > 1e-3, "the parameters did not move: the check would be empty"
    dp = data_parallel(step, make_mesh(shape), spatial=shape[-1], weight_update=weight_update, min_shard_size=8)
    placed = dp.place_state(state, batches[0])
    for batch in batches:
        placed, _ = dp(placed, batch)
    assert max_relative_diff(dp.gather_state(placed), want) <= TOLERANCE
    (row,) = make_plan(dp.placement, dp.trace, dp.grad_sum, dp.strategy).regions
    assert row["name"] == "pool" and row["by_hand"], row.get("why")
    assert row["name"] == "pool" and row["by_hand"] and row["passes"] == ["fwd", "bwd"]
    assert (row["axis"], row["partitions"]) == ("y", shape[-1])
    pooled = 16 // shape[0] * 5 * 3 * 3 * 4 * 8  # one replica's rows x boxes x 3 x 3 x channels, float64
    assert row["summed_bytes_per_device"] >= pooled


def test_the_compiled_region_sums_its_pooled_regions_once_over_the_space_axis():
    """Bytes over the space axis for the region: the pooled regions' all-reduce (what XLA's own
    partitioning of the gathers would replace by all-reducing every gathered sample)."""
    step, state, batches = _setup()
    dp = data_parallel(step, make_mesh((2, 4)), spatial=4)
    dp.place_state(state, batches[0])
    module = hlo.read(dp.lower(dp.placement.stored_shapes(), batches[0]).compile(), dp.mesh)
    (row,) = make_plan(dp.placement, dp.trace, dp.grad_sum, dp.strategy, module).regions
    pooled = 8 * 5 * 3 * 3 * 4 * 8
    assert pooled <= row["compiled_bytes_per_device"] <= 2 * pooled, row


def test_without_a_space_axis_the_region_is_the_plain_call():
    step, state, batches = _setup()
    want = _one_device(step, state, batches)
    dp = data_parallel(step, make_mesh((8,)))
    placed = dp.place_state(state, batches[0])
    for batch in batches:
        placed, _ = dp(placed, batch)
    assert max_relative_diff(dp.gather_state(placed), want) <= TOLERANCE
    assert make_plan(dp.placement, dp.trace, dp.grad_sum, dp.strategy).regions == []


def test_a_region_that_mixes_rows_is_left_to_xla_and_stays_exact():
    """A region whose rows each read the whole batch (a running sum over the images) needs a
    collective over the data axes: the partitioner's own rules run it, and the plan says why it
    was not partitioned by hand."""

    def step(w, batch):
        def loss(w):
            x = jax.lax.conv_general_dilated(
                batch["image"], w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
            )
            scaled = sum_over_blocks(lambda b, s: jnp.sum(jnp.cumsum(b[0], 0), 1) / 64, [x], dim=1, name="scaled")
            return jnp.sum(jnp.sin(scaled))

        value, g = jax.value_and_grad(loss)(w)
        return w - 0.1 * g, {"loss": value}

    rng = np.random.default_rng(1)
    w = rng.normal(size=(3, 3, 2, 4))
    batches = [{"image": rng.normal(size=(8, 16, 16, 2))} for _ in range(STEPS)]
    want = _one_device(step, w, batches)
    dp = data_parallel(step, make_mesh((2, 4)), spatial=4)
    placed = dp.place_state(w, batches[0])
    for batch in batches:
        placed, _ = dp(placed, batch)
    assert max_relative_diff(dp.gather_state(placed), want) <= TOLERANCE
    (row,) = make_plan(dp.placement, dp.trace, dp.grad_sum, dp.strategy).regions
    assert not row["by_hand"] and "need a collective inside it: " in row["why"], row["why"]


def test_a_region_that_slices_a_weight_at_its_start_runs_by_hand_and_stays_exact():
    """A positional weight sliced at each block's start (its gradient put back at the start of a
    zero weight): row by row over the data axes, so partitioned by hand over the space axis."""

    def step(p, batch):
        def loss(p):
            x = jax.lax.conv_general_dilated(
                batch["image"], p["w"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
            )

            def fn(b, s, pos):
                rows = b[0].shape[1]  # pos padded: a block running past the map's end reads zeros
                weight = jax.lax.dynamic_slice_in_dim(jnp.pad(pos, (0, rows)), s[0], rows)
                return jnp.sum(b[0] * weight[None, :, None, None], 1)

            return jnp.sum(jnp.sin(sum_over_blocks(fn, [x], p["pos"], dim=1, name="positional")))

        value, g = jax.value_and_grad(loss)(p)
        return jax.tree.map(lambda a, b: a - 1e-3 * b, p, g), {"loss": value}

    rng = np.random.default_rng(1)
    params = {"w": rng.normal(size=(3, 3, 2, 4)), "pos": rng.normal(size=(16,))}
    batches = [{"image": rng.normal(size=(8, 16, 16, 2))} for _ in range(STEPS)]
    want = _one_device(step, params, batches)
    assert max_relative_diff(want, params) > 1e-3, "the parameters did not move: the check would be empty"
    dp = data_parallel(step, make_mesh((2, 4)), spatial=4)
    placed = dp.place_state(params, batches[0])
    for batch in batches:
        placed, _ = dp(placed, batch)
    assert max_relative_diff(dp.gather_state(placed), want) <= TOLERANCE
    (row,) = make_plan(dp.placement, dp.trace, dp.grad_sum, dp.strategy).regions
    assert row["by_hand"], row["why"]


def test_bad_regions_are_refused_naming_the_argument():
    x = jnp.zeros((2, 4, 3))
    with pytest.raises(ValueError, match=r"dim=3 is not a dimension of x\[0\] \(shape \[2, 4, 3\]\)"):
        sum_over_blocks(lambda b, s: b[0], [x], dim=3, name="r")
    with pytest.raises(ValueError, match="over='data' is not a role"):
        sum_over_blocks(lambda b, s: b, x, dim=1, name="r", over="data")
    with pytest.raises(ValueError, match="give the region a name"):
        sum_over_blocks(lambda b, s: b, x, dim=1, name="")
    with pytest.raises(TypeError, match="fn must be a function"):
        sum_over_blocks("pool", x, dim=1, name="r")
    with pytest.raises(TypeError, match=r"dim must be an int .* got 2.0"):
        sum_over_blocks(lambda b, s: b.sum(1), x, dim=2.0, name="r")
    with pytest.raises(ValueError, match=r"dim=-1 counts from the end, and x's leaves have ranks \[2, 3\]"):
        sum_over_blocks(lambda b, s: b[0].sum(-1) + b[1].sum(), [x, x[0]], dim=-1, name="r")
    # One device: the function on the whole input, every start 0; a dimension from the end.
    out = sum_over_blocks(lambda b, s: b.sum(1), x + 1.0, dim=-2, name="r")
    np.testing.assert_array_equal(out, jnp.full((2, 3), 4.0))


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize(
    "fn",
    [
        lambda b, s: jnp.max(b[0], 1),  # a max of the block, not a share of a sum
        lambda b, s: jnp.sum(b[0] * jnp.arange(b[0].shape[1])[None, :, None], 1),  # its rows' places, not starts
        lambda b, s: jnp.sum(b[0] + 1.0, 1),  # rows of zeros past the end add to it
    ],
    ids=["max", "index in the block", "zero rows count"],
)
def test_a_function_that_is_not_a_sum_over_blocks_is_refused_naming_the_region(fn, traced):
    """The contract is checked on the first trace, on one device too (where the whole is all that
    runs): a function whose blocks' results do not add up would be silently wrong once split."""
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 8, 3)))
    call = functools.partial(sum_over_blocks, fn, dim=1, name="bad region")
    with pytest.raises(
        ValueError, match=r"region 'bad region' is not a sum over blocks of dim 1: .* rows \[\(4, 8\)\]"
    ):
        (jax.jit(lambda x: call([x])) if traced else lambda x: call([x]))(x)
    ok = sum_over_blocks(
        lambda b, s: jnp.sum(b[0] * (s[0] + jnp.arange(b[0].shape[1]))[None, :, None], 1),
        [x],
        dim=1,
        name="rows by place",
    )
    np.testing.assert_allclose(ok, jnp.sum(x * jnp.arange(8)[None, :, None], 1))


def test_shapes_only_skips_the_contract_check_and_the_next_trace_that_computes_checks_it():
    """Counting a model's parameters (``jax.eval_shape`` of its init) reads shapes only: no check's
    program is compiled there (a full Mask R-CNN's took seconds), and the function is not taken as
    checked, so its first use that computes still refuses it."""
    from podscale.parallel.regions import shapes_only

    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 8, 3)))

    def bad(b, s):  # the region's own function (the check is kept per function)
        return jnp.max(b[0], 1)

    def call(x):
        return sum_over_blocks(bad, [x], dim=1, name="counted")

    with shapes_only():
        assert jax.eval_shape(call, x).shape == (2, 3)
    with pytest.raises(ValueError, match="region 'counted' is not a sum over blocks"):
        jax.jit(lambda x: call(x))(x)  # a new trace (jax.jit(call) would reuse eval_shape's)


def test_the_evaluation_runs_the_region_by_hand_on_the_steps_placement():
    """``distributed_eval`` on a 2x4 spatial step: the eval program is not replayed by the
    partitioner, so the region runs by hand as it is traced; the metrics equal one device's, and
    the compiled program's only collective over the space axis naming the region is the sum of
    the pooled regions."""
    step, state, batches = _setup()
    dp = data_parallel(step, make_mesh((2, 4)), spatial=4)
    stored = dp.place_state(state, batches[0])

    def eval_fn(state, batch):
        pooled = _pooled(state[0], batch)
        return {"error": jnp.square(pooled - batch["target"]).sum((1, 2, 3, 4))}

    batch = dict(batches[1], mask=np.ones(16, np.float32))
    run = distributed_eval(eval_fn, dp)
    got = run(stored, [batch])
    want = np.mean(np.asarray(jax.jit(eval_fn)(state, batches[1])["error"]))
    np.testing.assert_allclose(got["error"], want, rtol=1e-6)  # the eval sums its metrics in float32
    module = hlo.read(run.lower(dp.placement.stored_shapes(), batch).compile(), dp.mesh)
    sums = [c for c in module.collectives if "y" in c.axes and "pool" in c.op_name]
    assert [c.kind for c in sums] == ["all-reduce"] and sums[0].buffer_bytes == 8 * 5 * 3 * 3 * 4 * 8


def _lookup(table, start, ids):
    """The rows ``ids`` of a table whose block from row ``start`` is ``table``, zero elsewhere."""
    local = ids - start
    held = (local >= 0) & (local < table.shape[0])
    return jnp.where(held[..., None], table[jnp.clip(local, 0, table.shape[0] - 1)], 0.0)


@pytest.mark.parametrize("weight_update", ["replicated", "sharded"])
def test_a_region_over_the_model_axis_looks_up_a_split_table_by_hand(weight_update):
    """An embedding table split by rows over the model axis (a sharding rule), looked up by a
    region over the model axis: each partition gathers the ids it holds (masked), one sum of the
    looked-up rows crosses the axis; the gradient stays with each partition's rows."""
    rng = np.random.default_rng(2)
    params = {"table": rng.normal(size=(64, 8)), "w": rng.normal(size=(8,))}
    tx = optax.adam(0.05)

    def step(state, batch):
        params, opt = state

        def loss(p):
            rows = sum_over_blocks(_lookup, p["table"], batch["ids"], dim=0, name="embed", over="model")
            return jnp.mean(jnp.square(rows.sum(1) @ p["w"] - batch["y"]))

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), {"loss": value}

    batches = [{"ids": rng.integers(0, 64, (16, 3)), "y": rng.normal(size=(16,))} for _ in range(STEPS)]
    state = (params, tx.init(params))
    want = _one_device(step, state, batches)
    rules = Rules(((r"table$", 0), (r"w$", None)), name="the table rows")
    dp = data_parallel(
        step, make_mesh((2, 4)), model_parallel=4, rules=rules, weight_update=weight_update, min_shard_size=8
    )
    placed = dp.place_state(state, batches[0])
    for batch in batches:
        placed, _ = dp(placed, batch)
    assert max_relative_diff(dp.gather_state(placed), want) <= TOLERANCE
    (row,) = make_plan(dp.placement, dp.trace, dp.grad_sum, dp.strategy).regions
    assert row["by_hand"] and (row["axis"], row["partitions"]) == ("y", 4), row.get("why")
