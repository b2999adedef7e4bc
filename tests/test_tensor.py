"""Tensor partitioning by sharding rules: unmodified Transformers on data x model meshes equal one
device (float32, summation order only); split leaves live 1/k per device; rule errors are
reported before running and refused by strict."""

import math
import re
import shutil

import jax
import numpy as np
import optax
import pytest
from helpers import leaf_relative_error, max_relative_diff, run_parallel, run_single

from podscale import Strategy, data_parallel, make_mesh
from podscale.compiled import hlo
from podscale.parallel.checks import PodscaleWarning
from podscale.parallel.tensor import RULES, Rules, RuleWarning, assign, path_name
from podscale.train.tasks import make_task, make_train_step
from podscale.workloads.precision import FLOAT32

STEPS = 10


def _task(name):
    if name == "transformer":  # clipping by the global norm, which reduces over split leaves
        task = make_task(name)
        return task, optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.5, momentum=0.9))
    task = make_task(name, config="tiny", policy=FLOAT32)
    return task, task.workload.make_optimizer(task.config, STEPS)


_REFERENCE = {}


def _reference(name):
    if name not in _REFERENCE:
        task, tx = _task(name)
        batches = [task.train_data.get(np.arange(i * 16, (i + 1) * 16) % len(task.train_data)) for i in range(STEPS)]
        state = task.init_state(jax.random.key(0), tx)
        ref, _ = run_single(make_train_step(task, tx), state, batches)
        assert max_relative_diff(ref.params, state.params) > 1e-2, "the parameters did not move"
        _REFERENCE[name] = (task, tx, batches, state, ref)
    return _REFERENCE[name]


@pytest.mark.parametrize(
    ("name", "shape", "weight_update"),
    # All four mesh x update pairs, each model at least once (bert-large's LAMB, whose trust
    # ratios reduce over split weights, on both meshes).
    [
        ("transformer", (2, 4), "replicated"),
        ("transformer-big", (4, 2), "sharded"),
        ("bert-large", (4, 2), "replicated"),
        ("bert-large", (2, 4), "sharded"),
    ],
)
def test_tensor_partitioned_step_equals_one_device(name, shape, weight_update):
    """The small transformer (SGD with momentum after clipping by the global norm, whose norm
    reduces over leaves split over the model axis: the gradient's norm is well above 0.05, so the
    clipping acts), transformer-big tiny (its Adam recipe, dropout 0.1) and bert-large tiny (LAMB:
    per-layer trust ratios over split weights, dropout 0.1). Every leaf within 1e-6 relative
    error after 10 steps; the split leaves of the stored state hold 1/k of their bytes on each
    device; the model axis carries all-reduces.

    SGD for the small transformer so that nothing else is tested: with Adam or LAMB the first step
    is about lr x sign(gradient), which turns the roundoff of a near-zero gradient element into a
    visible difference (1.8e-6 for plain data parallelism on this model); LAMB's trust ratios over
    split weights are bert-large's case."""
    task, tx, batches, state, ref = _reference(name)
    if name == "transformer":
        grad_fn = jax.jit(jax.grad(lambda p, b: task.train_outputs(state, p, b)[0]["loss"].mean()))
        grads = grad_fn(state.params, batches[0])
        assert float(optax.global_norm(grads)) > 0.5  # so the clipping at 0.05 acts
    k = shape[1]
    dp = data_parallel(
        make_train_step(task, tx), make_mesh(shape), model_parallel=k, rules=name, weight_update=weight_update
    )
    out, _ = run_parallel(dp, state, batches)
    assert leaf_relative_error(out.params, ref.params) <= 1e-6
    assert leaf_relative_error(out.opt_state, ref.opt_state) <= 1e-6

    stored = dp.place_state(state, batches[0])
    split = [
        (leaf, x)
        for leaf, x in zip(dp.layout.leaves, jax.tree.leaves(stored), strict=True)
        if leaf.model_dim is not None
    ]
    assert any(leaf.path.startswith(".params") for leaf, _ in split)
    for leaf, x in split:
        assert leaf.bytes_per_device() * k == leaf.bytes
        assert x.addressable_shards[0].data.nbytes * k == leaf.bytes, leaf.path
    # The optimizer state of a split weight: split the same way (replicated update), or sharded
    # over every device, data x model (the sharded update: 1/(replicas x k) each, padding aside).
    moments = [(leaf, x) for leaf, x in zip(dp.layout.leaves, jax.tree.leaves(stored), strict=True)]
    split_weights = tuple(leaf.path.removeprefix(".params") for leaf, _ in split if leaf.path.startswith(".params"))
    moments = [(leaf, x) for leaf, x in moments if ".opt_state" in leaf.path and leaf.path.endswith(split_weights)]
    assert moments
    for leaf, x in moments:
        if weight_update == "replicated" or math.prod(leaf.shape) < dp.strategy.min_shard_size:
            assert leaf.model_dim is not None and x.addressable_shards[0].data.nbytes * k == leaf.bytes
        else:
            assert leaf.sharded and leaf.stored.split == k
            assert x.addressable_shards[0].data.nbytes == leaf.bytes_per_device() <= -(-leaf.bytes // (8 * 4)) * 4
    module = hlo.read(dp.lower(stored, batches[0]).compile(), dp.mesh)
    model_axis = dp.mesh.axis_names[-1]
    assert any(c.kind == "all-reduce" and model_axis in c.axes for c in module.collectives)


def test_rules_follow_the_mlperf_transformer_on_every_builtin_model():
    """Query/key/value on heads, attention output on its heads, first MLP layer on its output,
    second on its input, embedding on the vocabulary; nothing large left whole."""
    want = {
        "transformer-big": {
            "params/encoder/self_attention/query/kernel": 2,  # [layers, hidden, heads, head_dim]
            "params/decoder/cross_attention/out/kernel": 1,  # [layers, heads, head_dim, hidden]
            "params/encoder/ffn/wi/kernel": 2,
            "params/encoder/ffn/wi/bias": 1,
            "params/decoder/ffn/wo/kernel": 1,
            "params/embedding": 0,
            "params/decoder/ln_self/scale": None,
        },
        "bert-large": {
            "params/layers/attention/value/kernel": 2,
            "params/layers/attention/key/bias": 1,
            "params/layers/attention/output/kernel": 1,
            "params/layers/intermediate/kernel": 2,
            "params/layers/ffn_output/kernel": 1,
            "params/word_embeddings/embedding": 0,
            "params/mlm_bias": 0,
        },
        "transformer": {
            "params/DecoderBlock_0/MultiHeadDotProductAttention_0/query/kernel": 1,
            "params/DecoderBlock_1/MultiHeadDotProductAttention_0/out/kernel": 0,
            "params/DecoderBlock_0/Dense_0/kernel": 1,
            "params/DecoderBlock_0/Dense_1/kernel": 0,
            "params/Embed_0/embedding": 0,
        },
    }
    for name, dims in want.items():
        task, tx = _task(name)
        state = jax.eval_shape(lambda t=task, o=tx: t.init_state(jax.random.key(0), o))
        found = assign(RULES[name], state, 2, "model")
        names = [path_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)]
        got = dict(zip(names, found.dims, strict=True))
        assert {n: got[n] for n in dims} == dims, name
        assert not found.notes, (name, found.notes)


def _small():
    task, tx = _task("transformer")
    return task, tx, jax.eval_shape(lambda: task.init_state(jax.random.key(0), tx))


def test_each_rule_error_is_reported_and_strict_refuses_it():
    task, tx, state = _small()
    batch = task.train_data.get(np.arange(16))
    step = make_train_step(task, tx)
    mesh = make_mesh((2, 4))
    cases = {
        "matches nothing": (
            Rules((*RULES["transformer"].rules, (r"no/such/layer$", 0))),
            "rule 'no/such/layer$' matches no leaf of the state",
        ),
        "two rules": (
            Rules(((r"Dense_0/kernel$", -1), (r"DecoderBlock_0/Dense_0/kernel$", 0), *RULES["transformer"].rules)),
            "params/DecoderBlock_0/Dense_0/kernel [64, 256]: matched by rule 'Dense_0/kernel$' and rule "
            "'DecoderBlock_0/Dense_0/kernel$'; the first applies",
        ),
        "large left whole": (
            Rules(tuple(r for r in RULES["transformer"].rules if "Dense_0/kernel" not in r[0])),
            "params/DecoderBlock_0/Dense_0/kernel [64, 256]: a large weight",
        ),
    }
    for what, (rules, message) in cases.items():
        dp = data_parallel(step, mesh, Strategy(model_parallel=4, rules=rules))
        with pytest.warns(RuleWarning, match=re.escape(message)):
            dp.prepare(state, batch)
        assert any(note.startswith(message) for note in dp.placement.rule_notes), (what, dp.placement.rule_notes)
        strict = data_parallel(step, mesh, Strategy(model_parallel=4, rules=rules, strict=True))
        with pytest.raises(ValueError, match="strict=True: refused before running"):
            strict.prepare(state, batch)
    # A dimension the axis does not divide (a vocabulary of 18 split 4 ways) stays whole.
    shapes = {"params": {"embed": jax.ShapeDtypeStruct((18, 64), np.float32)}}
    with pytest.warns(RuleWarning, match="is not divisible by mesh axis 'model'"):
        found = assign(Rules(((r"embed$", -2),)), shapes, 4, "model")
    assert found.dims == (None,)
    assert found.notes == (
        "params/embed [18, 64]: dimension -2 (18) is not divisible by mesh axis 'model' of 4 devices; kept whole "
        "(use a model axis that divides 18)",
    )
    with pytest.raises(ValueError, match=r"strict=True.*params/embed \[18, 64\]: dimension -2"):
        assign(Rules(((r"embed$", -2),)), shapes, 4, "model", strict=True)


def test_strategy_errors_name_the_mesh_axis_or_the_rule():
    task, tx, state = _small()
    step = make_train_step(task, tx)
    with pytest.raises(ValueError, match=r"needs a mesh whose last axis has 2 devices .* make_mesh\(\(4, 2\)\)"):
        data_parallel(step, make_mesh((2, 4)), model_parallel=2, rules="transformer")
    with pytest.raises(ValueError, match="needs sharding rules"):
        data_parallel(step, make_mesh((4, 2)), model_parallel=2)
    with pytest.raises(ValueError, match="spatial=2 and model_parallel=2 would both take the mesh.s last axis"):
        Strategy(model_parallel=2, spatial=2)
    with pytest.raises(ValueError, match="no built-in sharding rules of that name"):
        Strategy(model_parallel=2, rules="resnet")
    with pytest.raises(ValueError, match="not a regular expression"):
        Rules(((r"(unclosed", 0),))
    with pytest.raises(TypeError, match="dimension must be an int or None"):
        Rules(((r"kernel$", "heads"),))


@pytest.mark.parametrize("weight_update", ["replicated", "sharded"])
def test_one_replica_on_a_1x8_mesh_equals_one_device(weight_update):
    """Tensor partitioning alone: the model axis holds every device, the data axis one. No
    collective runs over the data axis (XLA's partitioner refuses one over a manual axis of one
    device); the model axis carries the model's all-reduces."""
    task, tx, batches, state, ref = _reference("transformer")
    dp = data_parallel(
        make_train_step(task, tx), make_mesh((1, 8)), model_parallel=8, rules="transformer", weight_update=weight_update
    )
    out, _ = run_parallel(dp, state, batches)
    assert leaf_relative_error(out.params, ref.params) <= 1e-6
    assert leaf_relative_error(out.opt_state, ref.opt_state) <= 1e-6
    module = hlo.read(dp.lower(dp.place_state(state, batches[0]), batches[0]).compile(), dp.mesh)
    # Every collective is the model axis's (some over groups inside it, where 4 heads meet 8
    # devices); none runs over the data axis, whose groups would hold one device.
    assert module.collectives and all(c.group_size > 1 and c.axes != ("x",) for c in module.collectives)


def test_the_trainer_refuses_model_parallelism_for_a_model_without_rules(tmp_path):
    from podscale.train.trainer import TrainConfig, train

    log = tmp_path / "mllog.txt"
    with pytest.raises(ValueError, match=r"model_parallel=2: model 'mlp' has no built-in sharding rules"):
        train(TrainConfig(model="mlp", steps=2, mesh=(4, 2), strategy=Strategy(model_parallel=2), mllog=str(log)))
    assert not log.exists()  # refused before the run began


@pytest.mark.parametrize("weight_update", ["replicated", "sharded"])
def test_the_2d_gradient_sum_over_two_data_axes_with_a_model_axis_equals_one_device(weight_update):
    task, tx, batches, state, ref = _reference("transformer")
    dp = data_parallel(
        make_train_step(task, tx),
        make_mesh((2, 2, 2)),
        model_parallel=2,
        rules="transformer",
        grad_sum="2d",
        weight_update=weight_update,
    )
    out, _ = run_parallel(dp, state, batches)
    assert leaf_relative_error(out.params, ref.params) <= 1e-6
    module = hlo.read(dp.lower(dp.place_state(state, batches[0]), batches[0]).compile(), dp.mesh)
    kinds = {(c.kind, c.axes) for c in module.collectives}
    assert ("reduce-scatter", ("x",)) in kinds and any(
        c.kind == "all-reduce" and c.axes == ("z",) for c in module.collectives
    )


def test_the_2d_sum_needs_two_data_axes_besides_the_model_axis():
    task, tx, _ = _small()
    with pytest.raises(ValueError, match=r"has 1 besides its last .*make_mesh\(\(2, 2, 2\)\)"):
        data_parallel(
            make_train_step(task, tx), make_mesh((4, 2)), model_parallel=2, rules="transformer", grad_sum="2d"
        )


def test_a_tensor_partitioned_run_resumes_bit_identically(tmp_path, weight_update="sharded"):
    """Checkpoints hold whole tensors: a run resumed from its step-3 checkpoint to step 6 ends
    where the uninterrupted 6-step run ends, on the same 4x2 mesh with 2-way model parallelism.
    The uninterrupted run writes the checkpoints (steps 3 and 6); its step 6 is removed, so the
    resumed run starts from step 3. With the sharded update the state holds both kinds of leaf:
    split over the model axis, and split over both axes in 1/N chunks (the optimizer state of
    split weights)."""
    from podscale.train.trainer import TrainConfig, train

    strategy = Strategy(model_parallel=2, weight_update=weight_update)
    common = dict(model="transformer", mesh=(4, 2), progress=False, checkpoint_every=3, steps=6, strategy=strategy)
    run = tmp_path / "run"
    train(TrainConfig(**common, workdir=str(run), export=str(tmp_path / "whole.npz")))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["3", "6"]
    shutil.rmtree(run / "checkpoints" / "6")
    resumed = train(TrainConfig(**common, workdir=str(run), resume=True, export=str(tmp_path / "resumed.npz")))
    assert resumed["resumed_from"] == 3
    assert resumed["configuration"]["strategy"]["rules"]["name"] == "transformer"
    with np.load(tmp_path / "whole.npz") as a, np.load(tmp_path / "resumed.npz") as b:
        assert sorted(a.files) == sorted(b.files)
        for key in a.files:
            np.testing.assert_array_equal(a[key], b[key])


# -- Rules entries check their types; what the rules leave undone is a warning (issue 23) -------

BAD_RULES = [
    (lambda: Rules(("w", 0)), r"rules\[0\]='w' is a str, not a \(regex, dimension\) pair"),
    (lambda: Rules("w$"), r"rules='w\$' is a str; give a tuple of \(regex, dimension\) pairs"),
    (lambda: Rules(3), r"rules=3 is an int"),
    (lambda: Rules({"w": 0}), r"is a dict"),
    (lambda: Rules((("w", 0, 1),)), r"rules\[0\]=\('w', 0, 1\) is a tuple, not a \(regex, dimension\) pair"),
    (lambda: Rules(((b"w", 0),)), r"rules\[0\] has regex b'w', a bytes"),
    (lambda: Rules(((re_compile("w"), 0),)), r"rules\[0\] has regex re.compile"),
    (lambda: Rules((("w", True),)), r"'w': the dimension must be an int or None, got True \(a bool\)"),
    (lambda: Rules((("w", False),)), r"got False \(a bool\)"),
    (lambda: Rules((("w", 1.0),)), r"got 1.0 \(a float\)"),
    (lambda: Rules((("w", "1"),)), r"got '1' \(a str\)"),
    (lambda: Rules((("w", 0),), name=3), r"name=3 is an int"),
]


def re_compile(pattern):
    return re.compile(pattern)


@pytest.mark.parametrize(("make", "message"), BAD_RULES, ids=[m for _, m in BAD_RULES])
def test_a_rule_entry_of_the_wrong_type_is_a_type_error_saying_what_to_give(make, message):
    with pytest.raises(TypeError, match=message):
        make()


def test_rule_entries_of_the_right_types_are_kept():
    assert Rules([["w$", np.int64(-1)], ("b$", None)]).rules == (("w$", -1), ("b$", None))
    assert type(Rules((("w$", np.int32(0)),)).rules[0][1]) is int


_SHAPES = {
    "params": {
        "embed": jax.ShapeDtypeStruct((18, 64), np.float32),
        "kernel": jax.ShapeDtypeStruct((64, 64), np.float32),
        "bias": jax.ShapeDtypeStruct((64,), np.float32),
    }
}
UNDONE = {
    "a rule matching nothing": (
        ((r"kernel$", -1), (r"embed$", None), (r"bias$", None), (r"nothing$", 0)),
        "matches no leaf",
    ),
    "two rules on a leaf": (((r"kernel$", -1), (r"ker", 0), (r"embed$", None), (r"bias$", None)), "matched by rule"),
    "a dimension the leaf lacks": (
        ((r"kernel$", -1), (r"embed$", None), (r"bias$", 1)),
        "which a rank-1 leaf does not",
    ),
    "an axis that does not divide": (((r"kernel$", -1), (r"embed$", 0), (r"bias$", None)), "is not divisible by"),
    "a large weight left whole": (((r"bias$", None),), "a large weight"),
}


@pytest.mark.parametrize("case", list(UNDONE))
def test_what_the_rules_leave_undone_is_a_rule_warning_and_strict_refuses_it(case):
    rules, message = UNDONE[case]
    with pytest.warns(RuleWarning, match=message) as record:
        found = assign(Rules(rules), _SHAPES, 4, "model")
    assert any(message in note for note in found.notes)
    assert issubclass(record[0].category, PodscaleWarning) and issubclass(RuleWarning, UserWarning)
    with pytest.raises(ValueError, match=rf"strict=True: refused before running.*{message}"):
        assign(Rules(rules), _SHAPES, 4, "model", strict=True)


def test_rules_that_leave_nothing_undone_warn_nothing():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = assign(Rules(((r"kernel$", -1), (r"embed$", None), (r"bias$", None))), _SHAPES, 4, "model")
    assert found.notes == () and found.dims == (None, None, 1)


def test_the_model_axis_is_named_by_its_role_in_any_position():
    """``model_axis`` names the axis: here the first of a ``jax.make_mesh`` mesh (Explicit axes),
    the data axis after it; the same step as one device's, with the sharded update."""
    task, tx, batches, state, ref = _reference("transformer")
    mesh = jax.make_mesh((2, 4), ("model", "data"))
    dp = data_parallel(
        make_train_step(task, tx), mesh, model_axis="model", rules="transformer", weight_update="sharded"
    )
    assert (dp.roles.model, dp.roles.data, dp.replicas) == ("model", ("data",), 4)
    out, _ = run_parallel(dp, state, batches)
    assert leaf_relative_error(out.params, ref.params) <= 1e-6
    assert leaf_relative_error(out.opt_state, ref.opt_state) <= 1e-6
    assert dp.plan().tensor["partitions"] == 2
