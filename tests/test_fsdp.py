"""FSDP (``weight_update="fsdp"``): weights, gradients and optimizer state stored 1/N per replica,
each weight gathered where it is used, and in a scan over layers (flax ``nn.scan``) one layer at a
time, inside the loop, its gradient reduce-scattered there. Checked on the compiled module: the
per-layer collectives run inside the loop, once per layer, and the whole stack is never live."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import max_abs_diff, relative_error, reordered_runs, run_parallel, run_single
from jax.ad_checkpoint import checkpoint_name

from podscale import Strategy, data_parallel, make_mesh
from podscale.compiled import hlo
from podscale.parallel.partition.layouts import chunk_dim

LAYERS, WIDTH, ROWS = 4, 64, 32


class _Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return jnp.tanh(nn.Dense(WIDTH)(h)) + h, None


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        stack = nn.scan(_Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS)
        h, _ = stack()(x, None)
        return nn.Dense(4)(h)


_NET = _Net()
_TX = optax.adam(1e-2)


def _step_of(net):
    def step(state, batch):
        params, opt = state

        def loss_fn(p):
            logits = net.apply({"params": p}, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt = _TX.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), {"loss": loss}

    return step


_step = _step_of(_NET)


def _data(i):
    kx, ky = jax.random.split(jax.random.key(i))
    return {"x": jax.random.normal(kx, (ROWS, WIDTH)), "y": jax.random.randint(ky, (ROWS,), 0, 4)}


@pytest.fixture(scope="module")
def scanned():
    params = _NET.init(jax.random.key(0), jnp.ones((ROWS, WIDTH)))["params"]
    return (params, _TX.init(params)), [_data(i) for i in range(3)]


def _dp(weight_update):
    return data_parallel(_step, make_mesh((8,)), Strategy(weight_update=weight_update), donate_state=False)


def test_chunk_dim_commutes_with_stacking():
    """A layer's chunk dimension, shifted by one, is its stack's: the gradient a scan's iteration
    reduce-scatters stacks into the layout the stack is stored in."""
    for shape in [(64, 64), (64, 8), (8, 64), (64,), (3, 3, 16, 32), (1024, 16, 64), (48, 24)]:
        inner = chunk_dim(shape, 8)
        assert chunk_dim((24, *shape), 8) == (None if inner is None else inner + 1) or inner is None
    assert chunk_dim((3, 5), 8) is None and chunk_dim((16, 3, 5), 8) == 0
    assert chunk_dim((), 8) is None


def test_a_matrix_is_chunked_along_the_dim_whose_chunk_fills_its_tiles():
    """XLA:TPU lays a matrix in ``(8, 128)`` tiles: 2 columns of a ``[512, 512]`` kernel over 256
    replicas take as much memory as all 512, 2 rows a quarter of 8. The rows where both fill their
    tiles; the columns where only they do."""
    assert chunk_dim((512, 512), 256) == 0  # 2 rows of 8, not 2 lanes of 128
    assert chunk_dim((3, 3, 512, 512), 256) == 2  # a convolution's input features
    assert chunk_dim((1024, 4096), 8) == 0  # both fill their tiles: the rows
    assert chunk_dim((256, 65536), 256) == 1  # 1 row of 8, against 256 whole lanes
    assert chunk_dim((2048, 1000), 256) == 0  # the columns do not divide
    assert chunk_dim((6, 512, 512), 256) == 1 + chunk_dim((512, 512), 256)


def test_kernels_chunked_along_their_rows_and_lars_norms_on_chunks_equal_one_device():
    """Kernels of at least 128 rows are chunked along their rows (``chunk_dim``'s tiles), and under
    the sharded update, which keeps the weights whole, LARS's weight norms are summed over the
    replicas' chunks of them: the sharded update and FSDP equal one device within the spread of
    its own row orders."""
    tx = optax.lars(0.1)

    def step(state, batch):
        params, opt = state

        def loss_fn(p):
            h = jnp.tanh(batch["x"] @ p["w1"])
            return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"], batch["y"]).mean()

        grads = jax.grad(loss_fn)(params)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), {}

    k1, k2 = jax.random.split(jax.random.key(3))
    params = {"w1": jax.random.normal(k1, (128, 256)) / 16, "w2": jax.random.normal(k2, (256, 4)) / 16}
    assert chunk_dim((128, 256), 8) == 0 and chunk_dim((256, 4), 8) == 0
    state = (params, tx.init(params))
    batches = [{"x": jax.random.normal(jax.random.key(i), (32, 128)), "y": jnp.arange(32) % 4} for i in range(3)]
    ref = run_single(step, state, batches)[0]
    spread = max(relative_error(r, ref) for r in reordered_runs(step, state, batches))
    for weight_update in ("sharded", "fsdp"):
        dp = data_parallel(step, make_mesh((8,)), Strategy(weight_update=weight_update), donate_state=False)
        got, _ = run_parallel(dp, state, batches)
        assert relative_error(got, ref) <= max(1e-6, 4 * spread), weight_update
        if weight_update == "sharded":  # w1's norms (safe_norm takes two), of its chunks and its update's
            norms = [c for c in dp.trace.collectives if "norms" in c.why]
            assert len(norms) == 4, dp.trace.collectives


def test_fsdp_equals_the_replicated_update_and_one_device(scanned):
    state, batches = scanned
    ref = run_single(_step, state, batches)[0]
    fsdp, _ = run_parallel(_dp("fsdp"), state, batches)
    replicated, _ = run_parallel(_dp("replicated"), state, batches)
    assert max_abs_diff(fsdp, replicated) == 0.0  # the same sums (a reduce-scatter's are an all-reduce's)
    spread = max(relative_error(r, ref) for r in reordered_runs(_step, state, batches))
    assert relative_error(fsdp, ref) <= max(1e-6, 4 * spread)


def test_every_leaf_is_stored_one_eighth_per_device(scanned):
    state, batches = scanned
    dp = _dp("fsdp")
    stored = dp.place_state(state, batches[0])
    for leaf, x in zip(dp.placement.state.leaves, jax.tree.leaves(stored), strict=True):
        if leaf.chunked:
            assert {s.data.size for s in x.addressable_shards} == {x.size // 8}, leaf.path
            assert leaf.bytes_per_device() * 8 == leaf.bytes
    stacked = [leaf for leaf in dp.placement.state.leaves if leaf.shape == (LAYERS, WIDTH, WIDTH)]
    assert len(stacked) == 3  # the stacked kernel, and Adam's two moments of it
    assert all(leaf.chunked and leaf.stored.dim != 0 for leaf in stacked)  # never the layer axis
    small = [leaf for leaf in dp.placement.state.leaves if not leaf.chunked and np.prod(leaf.shape) >= 1024]
    assert not small, [leaf.path for leaf in small]


def test_a_scanned_stack_is_gathered_one_layer_at_a_time_inside_the_loop(scanned):
    state, batches = scanned
    dp = _dp("fsdp")
    stored = dp.place_state(state, batches[0])
    compiled = dp.lower(stored, batches[0]).compile()
    module = hlo.read(compiled, dp.mesh)
    layer_chunk = WIDTH * WIDTH // 8 * 4  # one layer's kernel chunk, float32
    in_loop = [c for c in module.collectives if c.count == LAYERS]
    gathers = [c for c in in_loop if c.kind == "all-gather" and c.buffer_bytes == layer_chunk]
    scatters = [c for c in in_loop if c.kind == "reduce-scatter" and c.buffer_bytes == layer_chunk * 8]
    assert len(gathers) == 2, module.collectives  # forward and backward, each once per layer
    assert len(scatters) == 1, module.collectives  # the layer's gradient, once per layer
    stack = LAYERS * WIDTH * WIDTH * 4
    assert all(c.buffer_bytes < stack // 8 or c.count == LAYERS for c in module.collectives)
    memory = hlo.memory_of(compiled)
    assert memory["temporaries"] < stack, memory  # never the whole stack (nor its gradient) at once
    replicated = _dp("replicated")
    whole = hlo.memory_of(replicated.lower(replicated.place_state(state, batches[0]), batches[0]).compile())
    assert memory["arguments"] * 4 < whole["arguments"]
    runs = {c.runs for c in dp.trace.collectives if c.kind == "all-gather" and c.bytes_per_device == layer_chunk}
    assert runs == {LAYERS}  # the plan's record: a per-layer gather runs once per layer


def test_fsdp_state_keeps_its_type_and_stays_chunked_across_steps(scanned):
    state, batches = scanned
    dp = _dp("fsdp")
    stored = dp.place_state(state, batches[0])
    types = jax.tree.map(jax.typeof, stored)
    shardings = jax.tree.map(lambda x: x.sharding, stored)
    for batch in batches:
        stored, _ = dp(stored, batch)
    assert jax.tree.map(jax.typeof, stored) == types
    assert jax.tree.map(lambda x: x.sharding, stored) == shardings
    gathered = dp.gather_state(stored)
    assert jax.tree.structure(gathered) == jax.tree.structure(state)
    assert all(np.shape(a) == np.shape(b) for a, b in zip(jax.tree.leaves(gathered), jax.tree.leaves(state)))


class _NamedBlock(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        h = checkpoint_name(h, "layer_input")  # what MaxText's remat policies name
        return jnp.tanh(nn.Dense(WIDTH)(h)) + h, None


_OFFLOAD = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[],
    names_which_can_be_offloaded=["layer_input"],
    offload_src="device",
    offload_dst="pinned_host",
)


class _OffloadNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        block = nn.remat(_NamedBlock, policy=_OFFLOAD, prevent_cse=False)
        stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS)
        h, _ = stack()(x, None)
        return nn.Dense(4)(h)


@pytest.mark.parametrize("weight_update", ["fsdp", "replicated"])
def test_named_and_offloaded_activations_stay_split_by_rows(weight_update):
    """A remat policy that offloads named activations to host memory (MaxText's ``offload``
    remat): ``checkpoint_name`` and the moves to and from host memory run on each replica's rows,
    as one device's step runs them on all. Neither had a rule: each gathered the global batch's
    activations whole on every replica (3x one device's activation memory at 8 replicas, and the
    offload then moved the whole batch)."""
    net = _OffloadNet()
    step = _step_of(net)
    params = net.init(jax.random.key(0), jnp.ones((ROWS, WIDTH)))["params"]
    state, batches = (params, _TX.init(params)), [_data(i) for i in range(2)]
    dp = data_parallel(step, make_mesh((8,)), Strategy(weight_update=weight_update), donate_state=False)
    assert dp.plan(state, batches[0]).whole_ops == []
    got, _ = run_parallel(dp, state, batches)
    ref = run_single(step, state, batches)[0]
    spread = max(relative_error(r, ref) for r in reordered_runs(step, state, batches))
    assert relative_error(got, ref) <= max(1e-6, 4 * spread)


def _data_x_fsdp():
    """Chunks over the mesh's ``fsdp`` axis (4 replicas), whole copies of them over ``data`` (2)."""
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
    return data_parallel(_step, mesh, Strategy(weight_update="fsdp", fsdp_axes="fsdp"), donate_state=False)


def test_data_x_fsdp_stores_a_quarter_per_device_copied_over_the_data_axis(scanned):
    """``fsdp_axes``: each leaf is chunked over the named axis only (1/4 per device, not 1/8), each
    chunk held by both of the data axis's replicas; the step equals one device."""
    state, batches = scanned
    dp = _data_x_fsdp()
    stored = dp.place_state(state, batches[0])
    chunked = [
        (leaf, x) for leaf, x in zip(dp.placement.state.leaves, jax.tree.leaves(stored), strict=True) if leaf.chunked
    ]
    assert chunked and all(leaf.stored.axes == ("fsdp",) for leaf, _ in chunked)
    for leaf, x in chunked:
        assert {s.data.size for s in x.addressable_shards} == {x.size // 4}, leaf.path
        assert leaf.bytes_per_device() * 4 == leaf.bytes
        spec = x.sharding.spec[leaf.stored.dim]
        assert spec in ("fsdp", ("fsdp",)), (leaf.path, x.sharding.spec)  # nothing over data: copies
    ref = run_single(_step, state, batches)[0]
    got, _ = run_parallel(dp, state, batches)
    spread = max(relative_error(r, ref) for r in reordered_runs(_step, state, batches))
    assert relative_error(got, ref) <= max(1e-6, 4 * spread)


def test_data_x_fsdp_gathers_each_layer_over_its_axis_and_sums_across_the_copies(scanned):
    """Inside the scan over layers, once per layer: the layer's chunk all-gathered over the fsdp
    axis (groups of 4, forward and backward), its gradient reduce-scattered over it, and the
    gradient chunk all-reduced over the data axis (groups of 2); nothing over all 8 devices is of
    a layer's size."""
    state, batches = scanned
    dp = _data_x_fsdp()
    stored = dp.place_state(state, batches[0])
    module = hlo.read(dp.lower(stored, batches[0]).compile(), dp.mesh)
    layer_chunk = WIDTH * WIDTH // 4 * 4  # a quarter of a layer's kernel, float32
    in_loop = [c for c in module.collectives if c.count == LAYERS]
    gathers = [c for c in in_loop if c.kind == "all-gather" and c.buffer_bytes == layer_chunk]
    scatters = [c for c in in_loop if c.kind == "reduce-scatter" and c.buffer_bytes == layer_chunk * 4]
    across = [c for c in in_loop if c.kind == "all-reduce" and c.buffer_bytes == layer_chunk]
    assert len(gathers) == 2 and all(c.group_size == 4 for c in gathers), module.collectives
    assert len(scatters) == 1 and scatters[0].group_size == 4, module.collectives
    assert len(across) == 1 and across[0].group_size == 2, module.collectives
    plan = dp.plan()
    assert {c["axes"] for c in plan.collectives if c["why"].startswith("chunks summed across")} == {("data",)}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"weight_update": "sharded", "fsdp_axes": ("fsdp",)}, "add weight_update='fsdp'"),
        ({"weight_update": "fsdp", "fsdp_axes": ("slice",)}, "'slice' is not an axis of the mesh"),
        ({"weight_update": "fsdp", "fsdp_axes": ("model",), "model_axis": "model"}, "'model' is not a data axis"),
        ({"weight_update": "fsdp", "fsdp_axes": ("fsdp", "fsdp")}, "name each axis once"),
    ],
)
def test_fsdp_axes_are_checked_before_anything_runs(fields, message):
    mesh = jax.make_mesh((2, 4), ("fsdp", "model") if "model_axis" in fields else ("data", "fsdp"))
    with pytest.raises(ValueError, match=message):
        data_parallel(_step, mesh, Strategy(**fields))


def test_data_x_fsdp_evaluates_the_chunks_where_they_are_stored(scanned):
    """Evaluation on a data x FSDP placement gathers each chunk over its own axis, as the step
    does, and gives one device's metrics."""
    from podscale import distributed_eval

    state, batches = scanned
    dp = _data_x_fsdp()
    stored = dp.place_state(state, batches[0])

    def eval_fn(state, batch):
        logits = _NET.apply({"params": state[0]}, batch["x"])
        return {"loss": optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])}

    batch = {**batches[1], "mask": jnp.ones((ROWS,))}
    got = distributed_eval(eval_fn, dp)(stored, [batch])
    want = float(jnp.mean(eval_fn(state, batches[1])["loss"]))
    assert abs(float(got["loss"]) - want) <= 1e-6 * abs(want)


def test_a_batch_statistic_summed_into_chunks_leaves_the_backward_pass_out_of_the_update():
    """FSDP sums a batch statistic wide enough to be chunked (its mean over the rows) into chunks
    and gathers it for its use. The passes that read it are not the update: the compiled module's
    backward products are classed ``backward`` (``podscale project`` costs the update apart, and
    scales it with the pod), as under the replicated update. They were the update's, with all of
    ResNet-50's backward pass under FSDP (9.4 of its 11.4 ms "update" at 1024 TPU v3 chips)."""

    def step(state, batch):
        def loss(p):
            h = batch["x"] @ p["w"]
            # a statistic over the whole batch, WIDTH features, that meets a weight of its shape
            # elementwise: summed into chunks under FSDP whatever else reads it
            h = (h - jnp.mean(h, 0) * p["s"]) * p["s"]
            return jnp.mean(jnp.tanh(h) ** 2)

        value, grads = jax.value_and_grad(loss)(state["p"])
        updates, opt = _TX.update(grads, state["opt"], state["p"])
        return {"p": optax.apply_updates(state["p"], updates), "opt": opt}, {"loss": value}

    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(WIDTH, WIDTH)), jnp.float32), "s": jnp.ones((WIDTH,))}
    state = {"p": params, "opt": _TX.init(params)}
    batch = {"x": jnp.asarray(rng.normal(size=(ROWS, WIDTH)), jnp.float32)}
    for update in ("replicated", "fsdp"):
        dp = data_parallel(step, make_mesh((8,)), weight_update=update, min_shard_size=WIDTH)
        dp.prepare(state, batch)
        if update == "fsdp":  # the case this is about: the statistic summed into chunks
            whys = [c["why"] for c in dp.plan(state, batch).to_dict()["collectives"]]
            # the statistic, its cotangent's sum in the backward pass, s's and w's gradients
            assert whys.count("a partial sum reduce-scattered into chunks") == 4, whys
        module = hlo.read(dp.lower(dp.layout.stored_shapes(), batch).compile(), dp.mesh)
        # the backward pass's products (the chunk's own 1/N work, such as the statistic's share of
        # its gradient, is the update's: it shrinks with the pod)
        backward = [op for op in module.ops if "transpose(" in op.op_name and op.matmul_flops]
        assert backward and all(op.phase == "backward" for op in backward), (
            update,
            sorted({op.op_name for op in backward if op.phase != "backward"})[:5],
        )
