"""Embedding tables split by rows over the data axes (podscale/parallel/tables.py): a small DLRM's
step on 8 replicas against one device, its tables' layout through the step, and the compiled
module's collectives (none of a table's size); its evaluation (metrics, predictions and AUC) on the
tables as stored, against one device, and the eval program's collectives and memory."""

import dataclasses
import functools
import re

import jax
import numpy as np
import optax
import pytest
from helpers import relative_error, run_parallel, run_single

from podscale import data_parallel, distributed_eval, make_mesh
from podscale.train.data import padded_eval_batches
from podscale.train.tasks import Task, make_eval_fn, make_train_step
from podscale.workloads import dlrm
from podscale.workloads.clicks import ClickLogs
from podscale.workloads.precision import FLOAT32

CFG = dataclasses.replace(
    dlrm.TINY, cardinalities=(100, 37, 5, 64), embed_dim=8, bottom=(16, 8), top=(16, 1), global_batch=32
)
"""Tables of 100, 37 (8 replicas do not divide it: padded to 8 x 5 rows), 5 and 64 rows; with a
global batch of 32 the three of 37 rows or more are split by rows, the one of 5 replicated."""

OPTIMIZERS = {"sgd": lambda: dlrm.make_optimizer(CFG, 10), "adagrad": lambda: optax.adagrad(0.05)}


@functools.cache
def _task():
    data = ClickLogs(4096, CFG.cardinalities)
    return Task(dlrm.make_model(CFG, FLOAT32), "dlrm", data, None, workload=dlrm.WORKLOAD, config=CFG)


def _batches(n=10):
    return [_task().train_data.get(np.arange(i * 32, (i + 1) * 32)) for i in range(n)]


@functools.cache
def _single(optimizer):
    task, tx = _task(), OPTIMIZERS[optimizer]()
    state = task.init_state(jax.random.key(0), tx)
    return state, run_single(make_train_step(task, tx), state, _batches())


@pytest.mark.parametrize("weight_update", ["replicated", "sharded"])
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_ten_steps_with_tables_split_by_rows_equal_one_device(optimizer, weight_update):
    task, tx = _task(), OPTIMIZERS[optimizer]()
    state, (want, want_metrics) = _single(optimizer)
    # min_shard_size 64: the sharded update shards every dense kernel and its optimizer state
    dp = data_parallel(
        make_train_step(task, tx), make_mesh(), weight_update=weight_update, min_shard_size=64, strict=True
    )
    got, metrics = run_parallel(dp, state, _batches())
    if weight_update == "sharded":  # the dense layers' gradients reduce-scattered, updated on 1/8 chunks
        assert any(c.kind == "reduce-scatter" and c.update for c in dp.trace.collectives)
        assert sum(leaf.sharded or leaf.chunked for leaf in dp.layout.leaves) == (0 if optimizer == "sgd" else 3)
    tables = {leaf.path: leaf for leaf in dp.layout.leaves if leaf.table}
    split = [p for p in tables if p.startswith(".params")]
    assert sorted(split) == [".params['table_0']", ".params['table_1']", ".params['table_3']"], split
    if optimizer == "adagrad":  # its accumulators of the tables' shapes live with their rows
        assert sum(p.startswith(".opt_state") for p in tables) == 3
    assert tables[".params['table_1']"].stored.rows == 5  # 37 rows: 8 blocks of 5, the last 2 of padding
    assert relative_error(got, want) <= 1e-5  # summation order only (the dense layers' gradient sums)
    np.testing.assert_allclose(metrics["loss"], want_metrics["loss"], rtol=1e-5)


def test_a_table_stays_split_by_rows_through_the_step_and_no_collective_has_its_size():
    """Each device holds 1/8 of a split table's rows before and after the step; the compiled step
    sums no gradient of a table's size (the dense layers' all-reduce only) and moves the lookups'
    rows by reduce-scatters and all-gathers of the batch's rows."""
    task, tx = _task(), OPTIMIZERS["adagrad"]()
    state, _ = _single("adagrad")
    dp = data_parallel(make_train_step(task, tx), make_mesh(), weight_update="sharded", donate_state=False)
    batch = _batches(1)[0]
    placed = dp.place_state(jax.device_get(state), batch)
    after, _ = dp(placed, batch)
    for stored in (placed, after):
        table = stored.params["table_0"]
        assert {s.data.shape for s in table.addressable_shards} == {(13, 8)}  # 100 rows: 8 x 13 (4 padding)
        assert {s.data.shape for s in stored.opt_state[0].sum_of_squares["table_0"].addressable_shards} == {(13, 8)}
    text = dp.lower(dp.layout.stored_shapes(), batch).compile().as_text()
    dense = sum(leaf.bytes for leaf in dp.layout.leaves if leaf.path.startswith(".params") and not leaf.table)
    sizes = []
    for kind in ("all-reduce", "reduce-scatter", "all-gather"):
        for shape in re.findall(rf"= (\w+\[[\d,]*\])[^\n]*? {kind}(?:-start)?\(", text):
            dims = [int(d) for d in re.findall(r"\d+", shape.split("[")[1])] or [1]
            sizes.append((kind, int(np.prod(dims)) * 4))
    assert any(kind == "reduce-scatter" for kind, _ in sizes), sizes  # the looked-up rows, to their examples
    summed = sum(size for kind, size in sizes if kind == "all-reduce")
    assert dense <= summed <= dense + 16, (dense, sizes)  # the dense gradients (and the metrics) only
    plan = dp.plan()
    why = [c["why"] for c in plan.collectives]
    assert any("looked-up rows" in w for w in why), why


def test_the_full_dlrm_compiles_on_8_devices_with_its_large_tables_an_eighth_per_device():
    """MLPerf v0.7's DLRM (24 billion parameters, 89.5 GiB of tables) at its per-core batch on 8
    replicas, compiled only: every table with at least the global batch's 3,456 rows is split by
    rows (15 of 26, the largest 39,979,771 rows), the weights per device are about 1/8, and the
    compiled step's all-reduces carry the dense layers' and the small tables' gradients only."""
    from podscale.train.tasks import make_task

    task = make_task("dlrm", config="full", with_data=False)
    cfg = task.config
    tx = task.workload.make_optimizer(cfg, cfg.train_steps)
    batch = task.batch_shapes(cfg.per_core_batch * 8)
    state = jax.eval_shape(lambda b: task.init_state(jax.random.key(0), tx, b), batch)
    dp = data_parallel(make_train_step(task, tx), make_mesh())
    plan = dp.plan(state, batch, compile=True)
    split = [t for t in plan.tables["tables"] if t["placement"] == "rows over data axes"]
    assert len(split) == 15 and min(t["shape"][0] for t in split) >= 3456
    for t in split:
        assert t["bytes_per_device"] * 8 <= t["bytes"] + 8 * 128 * 4  # 1/8, up to a padded row
    m = plan.memory
    assert m["weights"] <= m["weights_replicated"] / 8 * 1.01
    summed = [c for c in plan.compiled["collectives"] if c["kind"] == "all-reduce"]
    small = sum(leaf["bytes_per_device"] for leaf in plan.leaves if not leaf["table_rows"])
    assert sum(c["buffer_bytes"] for c in summed) <= small + 64
    assert {c["kind"] for c in plan.compiled["collectives"]} == {"all-reduce", "all-gather", "reduce-scatter"}


def test_a_flax_embed_looked_up_by_jnp_take_is_a_table_and_a_tied_one_is_not():
    """``nn.Embed`` looks up through ``jnp.take`` (a call in the traced step): its rows are
    activations, so the table is one; ``Embed.attend`` (a tied output layer) reads the same table
    in a matrix product, so a tied embedding stays a weight."""
    import flax.linen as nn
    import jax.numpy as jnp

    from podscale.parallel import tables

    class Model(nn.Module):
        tied: bool

        @nn.compact
        def __call__(self, ids):
            embed = nn.Embed(100, 8)
            h = nn.gelu(nn.Dense(8)(embed(ids).mean(axis=1)))
            return embed.attend(h) if self.tied else nn.Dense(5)(h)

    ids = jnp.zeros((4, 3), jnp.int32)
    for tied in (False, True):
        model = Model(tied)
        params = model.init(jax.random.key(0), ids)["params"]

        def step(params, ids, model=model):
            grads = jax.grad(lambda p: model.apply({"params": p}, ids).sum())(params)
            return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

        closed = jax.make_jaxpr(step)(params, ids)
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
        found = {paths[i] for i in tables.looked_up(closed.jaxpr, len(paths))}
        assert found == (set() if tied else {"['Embed_0']['embedding']"}), (tied, found)


def _held_out(n=100):
    """``n`` held-out click logs (batches of 32 leave the last one padded)."""
    return ClickLogs(n, CFG.cardinalities, offset=4096)


def _placed_eval(eval_fn):
    """The state after ten steps, placed as the sharded update's step stores it (the dense kernels
    in 1/8 chunks, the tables and their Adagrad accumulators split by rows), and ``eval_fn``
    evaluated where it lives."""
    task, tx = _task(), OPTIMIZERS["adagrad"]()
    state = _single("adagrad")[1][0]
    dp = data_parallel(make_train_step(task, tx), make_mesh(), weight_update="sharded", min_shard_size=64)
    stored = dp.place_state(state, _batches(1)[0])
    assert sum(leaf.table for leaf in dp.layout.leaves) == 6 and any(
        leaf.sharded or leaf.chunked for leaf in dp.layout.leaves
    )
    return state, dp, stored, distributed_eval(eval_fn, dp)


def test_eval_with_tables_split_by_rows_equals_one_device():
    """The held-out loss and accuracy of the state as stored (tables split by rows, looked up where
    their rows live by the step's partitioner) equal one device's on the whole set."""
    task = _task()
    state, dp, stored, evaluate = _placed_eval(make_eval_fn(task))
    held = _held_out()
    got = evaluate(stored, padded_eval_batches(held, dp, 32))
    per = jax.jit(make_eval_fn(task))(state, held.get(np.arange(len(held))))
    assert set(got) == set(per)
    assert got["accuracy"] == np.sum(np.asarray(per["accuracy"])) / len(held)  # counts of 0/1: exact
    np.testing.assert_allclose(got["loss"], np.mean(np.asarray(per["loss"], np.float64)), rtol=1e-6)


def test_eval_with_tables_split_by_rows_predicts_each_example_and_scores_the_auc_of_one_device():
    """The trainer's whole-set metric: each replica predicts its own rows' logits, the host drops
    the last batch's padding and scores the AUC, which equals ``dlrm.evaluate`` on one device."""
    task = _task()
    state, dp, stored, evaluate = _placed_eval(task.predict_outputs)
    held = _held_out()
    logits = evaluate.predict(stored, padded_eval_batches(held, dp, 32))
    want = jax.jit(task.predict_outputs)(state, held.get(np.arange(len(held))))
    assert logits.shape == (len(held),)
    np.testing.assert_allclose(logits, want, rtol=1e-6, atol=1e-6)  # a replica's rows: the batch's size only
    auc = dlrm.score(task.model, logits, held)["auc"]
    one = dlrm.evaluate(task.model, {"params": state.params}, held)["auc"]
    assert 0.5 < one < 1 and abs(auc - one) <= 1e-6, (auc, one)


def test_eval_program_keeps_the_tables_split_and_needs_less_than_a_tables_memory():
    """The small DLRM with 10x its tables' rows (64 KB of tables, as in the full DLRM the tables
    outweigh the dense layers and the batch's lookups), compiled: no all-gather or all-reduce
    moves a table (the batch's ids are all-gathered, its looked-up rows reduce-scattered), and
    each device's arguments and temporaries take less than the whole tables. Gathering the tables
    whole for the eval (before this placement) took 76.6 KB per device; this takes 14.6 KB."""
    from podscale.compiled import hlo

    cfg = dataclasses.replace(CFG, cardinalities=(1000, 370, 5, 640))
    task = Task(dlrm.make_model(cfg, FLOAT32), "dlrm", None, None, workload=dlrm.WORKLOAD, config=cfg)
    tx = OPTIMIZERS["adagrad"]()
    batch = task.batch_shapes(32)
    state = jax.eval_shape(lambda b: task.init_state(jax.random.key(0), tx, b), batch)
    dp = data_parallel(make_train_step(task, tx), make_mesh())
    dp.prepare(state, batch)
    tables = [leaf for leaf in dp.layout.leaves if leaf.table and leaf.path.startswith(".params")]
    assert len(tables) == 3
    masked = {**batch, "mask": jax.ShapeDtypeStruct((32,), np.float32)}
    compiled = distributed_eval(make_eval_fn(task), dp).lower(dp.layout.stored_shapes(), masked).compile()

    module = hlo.read(compiled, dp.mesh)
    smallest = min(leaf.stored.rows * cfg.embed_dim * 4 for leaf in tables)  # a table's block of rows
    for c in module.collectives:
        whole = c.buffer_bytes * c.group_size if c.kind == "all-gather" else c.buffer_bytes
        assert c.kind != "all-gather" or whole < smallest, c
        assert c.kind != "all-reduce" or whole < smallest, c
    assert sum(c.kind == "reduce-scatter" for c in module.collectives) == 3  # each table's looked-up rows
    memory = hlo.memory_of(compiled)
    whole_tables = sum(leaf.bytes for leaf in dp.layout.leaves if leaf.path.startswith(".params['table"))
    # an eighth of the tables as stored, the dense layers and the batch's lookups: under half the tables
    assert memory["arguments"] + memory["temporaries"] < whole_tables / 2, (memory, whole_tables)


def test_a_checkpoint_of_split_tables_restores_bit_for_bit_onto_other_replica_counts(tmp_path):
    """Tables split by rows are saved as stored, each in its padded blocks (100 rows: 8 x 13 on 8
    replicas, 37 rows: 8 x 5), and restore onto 4 replicas (4 x 25, 4 x 10) and then 2 (2 x 50,
    2 x 19), with Adagrad's accumulators of their shapes: the values restored are the values saved,
    bit for bit, and each placement holds its own blocks."""
    from test_checkpoint_anywhere import _assert_bits

    from podscale.train.checkpoint import Checkpointer
    from podscale.train.saving import CheckpointForm

    task, tx = _task(), OPTIMIZERS["adagrad"]()
    state = task.init_state(jax.random.key(0), tx)
    batch = _batches(1)[0]
    ckpt = Checkpointer(str(tmp_path), every=1)
    for step, (replicas, update) in enumerate([(8, "sharded"), (4, "replicated"), (2, "sharded")], start=1):
        mesh = make_mesh((replicas,), devices=jax.devices()[:replicas])
        dp = data_parallel(make_train_step(task, tx), mesh, weight_update=update, min_shard_size=64)
        form = CheckpointForm(dp.prepare(state, batch).state)
        if step == 1:
            stored, _ = dp(dp.place_state(state, batch), batch)  # the accumulators hold values
        else:
            restored_step, stored = ckpt.restore(form)
            assert restored_step == step - 1
            _assert_bits(dp.gather_state(stored), state)
        rows = -(-100 // replicas)
        assert {s.data.shape for s in stored.params["table_0"].addressable_shards} == {(rows, 8)}
        state = dp.gather_state(stored)
        assert ckpt.maybe_save(step, stored, form.save_form)
        ckpt.close()
        ckpt = Checkpointer(str(tmp_path), every=1)


def _rowwise_adagrad(lr=0.1):
    """Adagrad with one accumulator per table row (DLRM's row-wise Adagrad), written by hand:
    state of shape ``(rows,)``, derived from the table's rows but not of the table's shape."""

    def init(params):
        return {"acc": jax.tree.map(lambda p: jax.numpy.zeros(p.shape[:1]), params)}

    def update(g, state, params=None):
        acc = jax.tree.map(lambda a, g: a + (jax.numpy.mean(g**2, axis=1) if g.ndim > 1 else g**2), state["acc"], g)
        scale = jax.tree.map(lambda g, a: jax.lax.rsqrt((a[:, None] if g.ndim > 1 else a) + 1e-8), g, acc)
        return jax.tree.map(lambda g, s: -lr * g * s, g, scale), {"acc": acc}

    return optax.GradientTransformation(init, update)


def _uneven_table_run(step, state, rows: int, count: int, weight_update: str = "replicated"):
    """``count`` batches of 32 ids into a table of ``rows`` rows and targets; the step run on them
    on one device and on 8 replicas: ``(batches, (state, metrics) of one device, of 8, the step)``."""
    batches = [
        {
            "ids": jax.random.randint(jax.random.key(10 + i), (32,), 0, rows),
            "y": jax.random.normal(jax.random.key(i), (32,)),
        }
        for i in range(count)
    ]
    dp = data_parallel(step, make_mesh(), weight_update=weight_update)
    return batches, run_single(step, state, batches), run_parallel(dp, state, batches), dp


@pytest.mark.parametrize(
    "optimizer, weight_update",
    [(lambda: optax.adafactor(0.01), "replicated"), (_rowwise_adagrad, "sharded")],
    ids=["adafactor's factored row statistics", "a row-wise accumulator"],
)
def test_state_derived_from_the_rows_of_a_table_the_replicas_do_not_divide_equals_one_device(optimizer, weight_update):
    """1001 rows on 8 replicas: the table is held in blocks of 126 rows, 7 of them padding. A value
    computed from its rows (a per-row statistic, a max over every row of a table of negative
    entries, an all over them) is the whole table's: the padding is dropped where the value is
    made whole and is the identity of a reduction over the rows. A whole value of the table's row
    count (the accumulator) meets the blocks in their geometry (``ceil(1001 / 8)`` rows each), by
    no lookup of the table's shape, so no op runs on whole rows."""
    import jax.numpy as jnp

    tx = optimizer()
    params = {"table": jax.random.normal(jax.random.key(0), (1001, 16)) * 0.1 - 1.0, "w": jnp.full((16, 1), 0.1)}

    def step(state, batch):
        params, opt = state

        def loss_fn(p):
            e = jnp.take(p["table"], batch["ids"], axis=0)
            return jnp.mean(((e @ p["w"])[:, 0] - batch["y"]) ** 2) + 1e-3 * jnp.max(p["table"])

        loss, g = jax.value_and_grad(loss_fn)(params)
        u, opt = tx.update(g, opt, params)
        metrics = {"loss": loss, "max": jnp.max(params["table"]), "negative": jnp.all(params["table"] < 0)}
        return (optax.apply_updates(params, u), opt), metrics

    state = (params, tx.init(params))
    batches, (want, want_metrics), (got, metrics), dp = _uneven_table_run(step, state, 1001, 3, weight_update)
    assert [leaf.stored.rows for leaf in dp.layout.leaves if leaf.path == "[0]['table']"] == [126]
    assert dp.plan(state, batches[0]).whole_ops == []
    assert relative_error(got, want) <= 1e-5  # summation order only (the dense layer's gradient sums)
    assert float(metrics["max"]) == float(want_metrics["max"]) < 0 and bool(metrics["negative"])


def test_a_table_split_by_rows_is_not_reported_left_whole_on_the_model_axis():
    """With a model axis whose rules name no table: a table split by rows over the data axes is
    not a large weight "left whole"; a large dense weight the rules miss still is."""
    import warnings

    import jax.numpy as jnp

    from podscale.parallel.tensor import Rules, RuleWarning

    params = {"table": jnp.zeros((512, 8)), "w": jnp.zeros((8, 64)), "v": jnp.zeros((64, 1))}

    def step(p, batch):
        def loss_fn(p):
            e = jnp.take(p["table"], batch["ids"], axis=0)
            return jnp.mean(((e @ p["w"]) @ p["v"])[:, 0] - batch["y"])

        return jax.tree.map(lambda a, g: a - 0.1 * g, p, jax.grad(loss_fn)(p)), {}

    batch = {"ids": np.arange(16) % 512, "y": np.zeros(16, np.float32)}
    dp = data_parallel(step, make_mesh((4, 2)), model_parallel=2, rules=Rules(((r"^v$", None),)))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        dp.place_state(params, batch)
    notes = " ".join(str(w.message) for w in seen if issubclass(w.category, RuleWarning))
    assert [leaf.stored.rows for leaf in dp.layout.leaves if leaf.path == "['table']"] == [128]
    assert "table" not in notes and "w [8, 64]: a large weight" in notes, notes


def test_an_embedding_looked_up_by_more_ids_than_it_has_rows_is_no_table():
    """Each table's threshold is the ids a step looks up in it (at least the global batch's
    rows): in one step, a table of 64 rows looked up once per example (32 ids) is split by rows,
    and one of 64 rows looked up at every position of a sequence (512 ids: a language model's
    token embedding) is stored as any weight; the plan says each one's threshold."""
    import flax.linen as nn
    import jax.numpy as jnp

    class Model(nn.Module):
        @nn.compact
        def __call__(self, ids, tokens):
            h = nn.Embed(64, 8, name="per_example")(ids)[:, 0] + nn.Embed(64, 8, name="per_token")(tokens).mean(1)
            return nn.Dense(5)(h)

    batch = {"ids": jnp.zeros((32, 1), jnp.int32), "tokens": jnp.zeros((32, 16), jnp.int32)}
    params = Model().init(jax.random.key(0), batch["ids"], batch["tokens"])["params"]

    def step(params, batch):
        grads = jax.grad(lambda p: Model().apply({"params": p}, batch["ids"], batch["tokens"]).sum())(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), {}

    dp = data_parallel(step, make_mesh(), weight_update="replicated")
    dp.prepare(params, batch)
    split = {leaf.path for leaf in dp.layout.leaves if leaf.table}
    assert split == {"['per_example']['embedding']"}, split
    rows = {t["path"]: t["min_rows"] for t in dp.plan(params, batch).tables["tables"]}
    assert rows == {"['per_example']['embedding']": 32, "['per_token']['embedding']": 512}, rows


def test_a_weight_of_a_tables_shape_that_is_no_table_keeps_its_own_gradient():
    """Two embeddings of one shape, [256, 8]: the rules split ``split`` over the model axis, so
    only ``table`` is split by rows over the data axes. A table's gradient is known by its kin
    (the table and optimizer state it is updated with), not its shape: only ``table``'s lookup
    gradient goes to the replicas holding the rows (keyed by shape, ``split``'s went that way too,
    to be gathered whole again); 2 steps equal one device's."""
    import jax.numpy as jnp

    from podscale.parallel.tensor import Rules

    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"table": jax.random.normal(k1, (256, 8)), "split": jax.random.normal(k2, (256, 8))}

    def step(p, batch):
        def loss_fn(p):
            a = jnp.take(p["table"], batch["ids"], axis=0)
            b = jnp.take(p["split"], batch["other"], axis=0)
            return jnp.mean((a * b).sum(-1) - batch["y"]) ** 2

        loss, g = jax.value_and_grad(loss_fn)(p)
        return jax.tree.map(lambda a, g: a - 0.1 * g, p, g), {"loss": loss}

    rng = np.random.default_rng(0)
    batches = [
        {
            "ids": rng.integers(0, 256, 16),
            "other": rng.integers(0, 256, 16),
            "y": rng.normal(size=16).astype(np.float32),
        }
        for _ in range(2)
    ]
    dp = data_parallel(step, make_mesh((4, 2)), model_parallel=2, rules=Rules(((r"split$", 1),)))
    got, _ = run_parallel(dp, params, batches)
    assert [leaf.path for leaf in dp.layout.leaves if leaf.table] == ["['table']"]
    to_rows = [c for c in dp.trace.collectives if c.why.startswith("cotangents of looked-up rows")]
    assert len(to_rows) == 1, [c.why for c in dp.trace.collectives]
    want, _ = run_single(step, params, batches)
    assert relative_error(got, want, floor=1e-12) <= 1e-6


def test_a_tables_gradient_under_jax_checkpoint_stays_split_by_rows():
    """The lookup inside ``jax.checkpoint``: its gradient's ``scatter-add`` sits in the remat's
    body, which the kin's walk does not enter; there the table is still known by its shape, so
    the gradient stays split by rows (no all-reduce of the table's size) and equals one device's."""
    import jax.numpy as jnp

    table = jax.random.normal(jax.random.key(0), (256, 8))

    def step(p, batch):
        @jax.checkpoint
        def loss_fn(p):
            return jnp.mean((jnp.take(p["table"], batch["ids"], axis=0).sum(-1) - batch["y"]) ** 2)

        loss, g = jax.value_and_grad(loss_fn)(p)
        return jax.tree.map(lambda a, g: a - 0.1 * g, p, g), {"loss": loss}

    rng = np.random.default_rng(1)
    batches = [{"ids": rng.integers(0, 256, 16), "y": rng.normal(size=16).astype(np.float32)} for _ in range(2)]
    dp = data_parallel(step, make_mesh(), weight_update="replicated")
    got, _ = run_parallel(dp, {"table": table}, batches)
    assert [leaf.stored.rows for leaf in dp.layout.leaves] == [32]
    whys = [c.why for c in dp.trace.collectives]
    assert any(w.startswith("cotangents of looked-up rows") for w in whys), whys
    assert not [c for c in dp.trace.collectives if c.bytes_per_device >= 256 * 8 * 4], whys
    want, _ = run_single(step, {"table": table}, batches)
    assert relative_error(got, want, floor=1e-12) <= 1e-6


def test_a_reshape_of_a_table_the_replicas_do_not_divide_keeps_or_gathers_its_blocks():
    """37 rows on 8 replicas: blocks of 5 rows, the last 3 of padding. A reshape that keeps the
    rows (``[37, 2, 4]``) runs on the blocks; one that merges them with another dimension
    (``reshape(-1)``: 296 elements, which 8 divides) reads the table whole. The merge used to be
    split as if the blocks were even, and failed to trace."""
    import jax.numpy as jnp

    tx = optax.sgd(0.1)
    params = {"table": jax.random.normal(jax.random.key(0), (37, 8)), "w": jnp.full((8, 1), 0.1)}

    def step(state, batch):
        params, opt = state

        def loss_fn(p):
            e = jnp.take(p["table"], batch["ids"], axis=0)
            kept = jnp.sum(p["table"].reshape(37, 2, 4)[:, 0] ** 2)
            merged = jnp.sum(jnp.tanh(p["table"].reshape(-1)) * jnp.arange(296.0))
            return jnp.mean(((e @ p["w"])[:, 0] - batch["y"]) ** 2) + 1e-3 * kept + 1e-4 * merged

        loss, g = jax.value_and_grad(loss_fn)(params)
        u, opt = tx.update(g, opt, params)
        return (optax.apply_updates(params, u), opt), {"loss": loss}

    _, (want, _), (got, _), dp = _uneven_table_run(step, (params, tx.init(params)), 37, 2)
    assert [leaf.stored.rows for leaf in dp.layout.leaves if leaf.path == "[0]['table']"] == [5]
    assert relative_error(got, want) <= 1e-5  # summation order only (the dense layer's gradient sums)


@pytest.mark.parametrize("loop", ["scan", "while_loop"])
def test_a_table_s_gradient_accumulated_in_a_loop_stays_split_by_rows(loop):
    """Gradient accumulation over 2 microbatches in a loop's body: the table is looked up there
    (a candidate for splitting by rows, its ids a step counted over a scan's 2 trips), and
    its gradient is scattered into a zero table there, added to the carry and used outside by the
    update. The gradient is known as the table's by kin through the loop (the carry, the next
    iteration's), not by its shape, so it stays split by rows: no op on whole values (each
    microbatch's rows stay split too), no collective of the table's size, and the step equals
    one device."""
    import jax.numpy as jnp

    rows = 101
    params = {"table": jax.random.normal(jax.random.key(0), (rows, 16)) * 0.1, "w": jnp.full((16, 1), 0.1)}

    def loss_fn(p, mb):
        e = jnp.take(p["table"], mb["ids"], axis=0)
        return jnp.mean(((e @ p["w"])[:, 0] - mb["y"]) ** 2)

    def step(params, batch):
        micro = jax.tree.map(lambda v: v.reshape(2, v.shape[0] // 2, *v.shape[1:]), batch)
        zero = jax.tree.map(jnp.zeros_like, params)

        def accumulate(acc, mb):
            return jax.tree.map(jnp.add, acc, jax.grad(loss_fn)(params, mb))

        if loop == "scan":
            grads, _ = jax.lax.scan(lambda acc, mb: (accumulate(acc, mb), None), zero, micro)
        else:
            grads = jax.lax.while_loop(
                lambda c: c[0] < 2,
                lambda c: (c[0] + 1, accumulate(c[1], jax.tree.map(lambda v: v[c[0]], micro))),
                (0, zero),
            )[1]
        return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads), {}

    batches, (want, _), (got, _), dp = _uneven_table_run(step, params, rows, 3)
    assert [leaf.path for leaf in dp.layout.leaves if leaf.table] == ["['table']"]
    assert dp.plan(params, batches[0]).whole_ops == []
    table_bytes = rows * 16 * 4
    assert all(c.bytes_per_device < table_bytes for c in dp.trace.collectives), [
        (c.kind, c.bytes_per_device, c.why) for c in dp.trace.collectives
    ]
    assert relative_error(got, want) <= 1e-5


def test_a_table_s_optimizer_state_is_known_by_what_it_updates_not_by_its_shape():
    """Adagrad's accumulator of the table is split by rows with it: it is computed elementwise
    with the table (its kin). An average of a dense weight kept beside it, of the table's very
    shape but computed with that weight only, stays as the strategy stores any leaf."""
    import jax.numpy as jnp

    rows = 64
    tx = optax.adagrad(0.1)
    params = {
        "table": jax.random.normal(jax.random.key(0), (rows, 16)) * 0.1,
        "dense": jax.random.normal(jax.random.key(1), (rows, 16)) * 0.1,  # the table's shape, no lookup
    }

    def step(state, batch):
        params, opt, average = state

        def loss_fn(p):
            e = jnp.take(p["table"], batch["ids"], axis=0)
            return jnp.mean((jnp.sum(e @ p["dense"].T, axis=1) - batch["y"]) ** 2)

        g = jax.grad(loss_fn)(params)
        u, opt = tx.update(g, opt, params)
        params = optax.apply_updates(params, u)
        return (params, opt, 0.9 * average + 0.1 * params["dense"]), {}

    state = (params, tx.init(params), jnp.zeros((rows, 16)))
    batches, (want, _), (got, _), dp = _uneven_table_run(step, state, rows, 3)
    tables = sorted(leaf.path for leaf in dp.layout.leaves if leaf.table)
    assert tables == ["[0]['table']", "[1][0].sum_of_squares['table']"], tables
    assert relative_error(got, want) <= 1e-5
