"""``podscale.verify`` and ``podscale verify``: every strategy the mesh allows against one device,
measured against the noise floor of one device's inputs moved by an ulp; a deliberately broken sum
(the gradient divided by a wrong replica count, through gradsum's test-only hook) is caught and
named, also on steps that depend on their rows' order and randomness; a floor too wide to mean
anything is "cannot judge", never a pass; verify's own arguments are checked before any work."""

import json
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import podscale_main

import podscale
from podscale import Strategy, verification
from podscale.parallel import gradsum


class _MLP(nn.Module):
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x, rng=None):
        h = nn.relu(nn.Dense(16)(x))
        if self.dropout:
            h = nn.Dropout(self.dropout, deterministic=False)(h, rng=rng)
        return nn.Dense(4)(h)


def _problem(kind: str = "plain"):
    """A small MLP's SGD step; ``kind`` makes it depend on its rows' order or randomness: dropout,
    a loss weighted by row position, a scan over the rows, a fixed-key normal of the batch's shape."""
    model, tx = _MLP(0.5 if kind == "dropout" else 0.0), optax.sgd(0.1)
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(32, 8)).astype(np.float32), "y": (np.arange(32) % 4).astype(np.int32)}
    params = model.init(jax.random.key(0), batch["x"])

    def step(state, batch):
        key, drop = jax.random.split(state["key"])

        def loss(p):
            x = batch["x"]
            if kind == "draw":
                x = x + jax.random.normal(jax.random.key(1), x.shape)
            per = optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x, rng=drop), batch["y"])
            n = per.shape[0]
            if kind == "position":
                return jnp.sum(per * jnp.arange(n) / n) / n
            if kind == "scan":
                return jax.lax.scan(lambda c, v: (0.9 * c + v, None), 0.0, per)[0] / n
            return per.mean()

        value, grads = jax.value_and_grad(loss)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        new = {"params": optax.apply_updates(state["params"], updates), "opt": opt, "key": key}
        return new, {"loss": value}

    return step, {"params": params, "opt": tx.init(params), "key": jax.random.key(2)}, batch


@pytest.fixture
def broken_2d_sum(monkeypatch):
    """Every 2-D gradient sum divided by 2 after its collectives: a wrong replica count."""
    monkeypatch.setitem(gradsum._TEST_ONLY_DIVIDE, "2d", 2)


def test_every_strategy_on_a_2d_mesh_is_within_the_floor():
    step, state, batch = _problem()
    result = podscale.verify(step, state, batch, podscale.make_mesh((4, 2)), steps=2)
    ran = {r.name: r for r in result.results if r.applies}
    assert set(ran) == {"replicated", "sharded", "fsdp", "replicated+2d", "sharded+2d", "fsdp+2d", "data-x-fsdp"}
    assert result.passed, "\n".join(result.lines())
    assert all(r.ratio <= podscale.verification.MULTIPLE and r.leaf for r in ran.values())
    assert len(result.floor) == 2 and all(0 < f < 1e-5 for f in result.floor), result.floor  # float32 rounding
    spatial = [r for r in result.results if not r.applies]
    assert spatial and all("no convolution" in r.reason for r in spatial)  # an MLP has no images


def test_a_gradient_divided_by_the_wrong_replica_count_is_caught_and_named(broken_2d_sum):
    step, state, batch = _problem()
    result = podscale.verify(step, state, batch, podscale.make_mesh((4, 2)), steps=2)
    assert not result.passed
    assert result.failed == ["replicated+2d", "sharded+2d", "fsdp+2d"]  # FSDP's small leaves: the 2-D sum
    for name in result.failed:
        (r,) = [r for r in result.results if r.name == name]
        assert r.left_floor["step"] == 1 and r.left_floor["leaf"].startswith("state/params/")
        assert r.ratio > 1e3
    assert "FAILED: replicated+2d, sharded+2d, fsdp+2d" in result.lines()[-1]


def test_the_command_exits_1_naming_the_broken_strategy(broken_2d_sum, capsys, monkeypatch):
    argv = ["verify", "--model", "mlp", "--mesh", "4x2", "--steps", "1", "--optimizer", "sgd"]
    assert podscale_main([*argv, "--strategies", "replicated,replicated+2d", "--json"]) == 1
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["failed"] == ["replicated+2d"]
    verdicts = {r["name"]: r["passed"] for r in out["results"]}
    assert verdicts == {"replicated": True, "replicated+2d": False}
    monkeypatch.setattr(verification, "MAX_FLOOR", -1.0)  # no leaf has a floor
    assert podscale_main([*argv, "--strategies", "replicated+2d"]) == verification.EXIT_CANNOT_JUDGE == 4
    assert "verify: CANNOT JUDGE: replicated+2d" in capsys.readouterr().out
    monkeypatch.undo()
    gradsum._TEST_ONLY_DIVIDE.clear()
    assert podscale_main([*argv, "--strategies", "replicated+2d"]) == 0
    assert "every strategy within the floor" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("kind", "wrong"),
    [
        ("dropout", "independent"),  # each replica its own mask: 0.78 relative off one device
        ("draw", "independent"),  # each replica its own normal of the batch's shape
        ("position", "2d"),  # the broken 2-D sum on a loss weighted by row position
        ("scan", "2d"),  # ... on a loss that scans over the rows
    ],
)
def test_a_wrong_strategy_fails_on_steps_that_depend_on_their_rows(kind, wrong, broken_2d_sum):
    """The floor moves no row relative to its randomness or position: it stays at float32
    rounding on these steps (permuting the rows made it 0.6 to 1.8, and every strategy passed)."""
    step, state, batch = _problem(kind)
    strategies = {
        "replicated": Strategy(),
        "wrong": Strategy(**{"independent": {"rng": "independent"}, "2d": {"grad_sum": "2d"}}[wrong]),
    }
    result = podscale.verify(step, state, batch, podscale.make_mesh((4, 2)), strategies, steps=1)
    assert result.floor[0] < 1e-5 and not result.no_floor, result.lines()
    assert result.outcome == "failed" and result.failed == ["wrong"], "\n".join(result.lines())
    (_, wrong_result) = result.results
    assert wrong_result.ratio > 1e3 and wrong_result.left_floor["step"] == 1
    assert result.results[0].outcome == "pass" and result.results[0].ratio < 1


def test_a_step_that_rounding_decides_cannot_be_judged():
    """A metric one ulp of the inputs moves by O(1) (a sine of a sum scaled by 1e6) has no honest
    floor: a strategy whose sum differs in its last bits is not judged there, and not passed."""
    step, state, batch = _problem()

    def chaotic(state, batch):
        new, metrics = step(state, batch)
        return new, {
            **metrics,
            "phase": jnp.sin(1e6 * jnp.sum(batch["x"] @ state["params"]["params"]["Dense_0"]["kernel"])),
        }

    result = podscale.verify(chaotic, state, batch, podscale.make_mesh(8), {"replicated": Strategy()}, steps=1)
    assert result.no_floor == ["metrics/phase"], result.lines()
    assert result.outcome == "cannot judge" and not result.passed and result.not_judged == ["replicated"]
    (r,) = result.results
    assert r.left_floor is None and [u["leaf"] for u in r.unjudged] == ["metrics/phase"]
    assert result.lines()[-1].startswith("verify: CANNOT JUDGE: replicated")
    assert result.to_dict()["outcome"] == "cannot judge"


def _refused(monkeypatch, error, match, **kwargs):
    """``podscale.verify`` refuses before any step runs, naming the argument."""
    monkeypatch.setattr(verification, "_single", lambda *a, **k: pytest.fail("a step ran before the refusal"))
    step, state, batch = _problem()
    args = {"step": step, "state": state, "batch": batch, "mesh": podscale.make_mesh((4, 2)), **kwargs}
    with pytest.raises(error, match=match):
        podscale.verify(**args)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"strategies": "sharded"}, TypeError, r"strategies='sharded' is a str; give None"),
        (
            {"strategies": {"a": "sharded"}},
            TypeError,
            r"strategies\['a'\]='sharded' is a str; give a podscale.Strategy",
        ),
        ({"strategies": [Strategy(), "sharded"]}, TypeError, r"strategies\[1\]='sharded'"),
        ({"strategies": []}, ValueError, "no strategy given, so nothing would be checked"),
        ({"strategies": {}}, ValueError, "no strategy given"),
        ({"strategies": [Strategy(), Strategy()]}, ValueError, "replicated given twice"),
        ({"strategies": {"s": Strategy(space_axis="y")}}, ValueError, "strategies: s does not apply .* no convolution"),
        (
            {"mesh": (4, 2)},
            TypeError,
            r"mesh=\(4, 2\) is a tuple; give a jax.sharding.Mesh, e.g. podscale.make_mesh\(\(4, 2\)\)",
        ),
        ({"seed": -1}, ValueError, "seed must be at least 0"),
        ({"seed": 1.5}, TypeError, "seed=1.5 is a float"),
        ({"steps": 0}, ValueError, "steps must be at least 1"),
        ({"batch": {"x": np.float32(1.0)}}, ValueError, r"batch\['x'\] is a scalar"),
        ({"batch": {}}, ValueError, "batch={} has no arrays"),
        ({"batch": {"x": np.zeros((0, 8), np.float32)}}, ValueError, r"batch\['x'\] has no rows"),
        ({"step": "step"}, TypeError, "step='step' is a str"),
        ({"step": lambda s, b: (s, {"m": jax.lax.pmean(b["x"].sum(), "data")})}, ValueError, "remove lax.pmean"),
        (
            {"batch": {"x": np.zeros((30, 8), np.float32), "y": np.zeros(30, np.int32)}},
            ValueError,
            "no strategy applies .* do not divide",
        ),
    ],
)
def test_verify_refuses_bad_arguments_before_any_work(monkeypatch, kwargs, error, match):
    _refused(monkeypatch, error, match, **kwargs)


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--strategies", ","], "--strategies ',': an empty name"),
        (["--strategies", "replicated,replicated"], "--strategies: replicated given twice"),
        (["--seed", "-1"], "--seed must be 0 or more"),
        (["--mesh", "4x2", "--strategies", "sharded+spatial"], "--strategies: sharded\\+spatial does not apply"),
        (["--precision", "float32"], "--precision is for the MLPerf and Llama workloads"),
    ],
)
def test_the_command_refuses_what_would_check_nothing_or_twice(flags, match, capsys):
    assert podscale_main(["verify", "--model", "mlp", "--steps", "1", *flags]) == 2
    assert re.search(match, capsys.readouterr().err)


def test_a_token_batch_s_floor_moves_the_state_by_an_ulp_of_the_precision_its_products_take():
    """A batch of token ids has no floats to move, so the floor moves the state; where the step's
    products take bfloat16 (the workloads' policy), a float32 ulp would vanish in the cast, so each
    element moves by a bfloat16 ulp: every product's roundings move, as a strategy's do."""
    from podscale import verification as V

    x = np.asarray([0.3, -1.7, 0.0, 2.5e-3, 65.0], np.float32)
    moved = V._nudge_at({"w": x}, np.random.default_rng(0), np.dtype(jnp.bfloat16))["w"]
    cast = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32)  # noqa: E731
    changed = cast(moved) != cast(x)
    assert changed[x != 0].all() and moved[2] == 0.0
    assert (V._nudge({"w": x}, np.random.default_rng(0))["w"].astype(np.float32) != x)[x != 0].all()
    ids = jnp.zeros((4, 3), jnp.int32)
    table = jnp.ones((8, 4), jnp.float32)

    def step(dtype):
        def f(state, batch):
            h = jnp.take(state, batch, axis=0).astype(dtype)
            return state, {"loss": jnp.sum(h @ jnp.ones((4, 2), dtype))}

        return f

    assert V._compute_dtype(step(jnp.bfloat16), table, ids) == np.dtype(jnp.bfloat16)
    assert V._compute_dtype(step(jnp.float32), table, ids) is None


def test_strategies_can_be_chosen_for_a_workload_with_built_in_rules(capsys):
    """--strategies with a model whose built-in rules make the model axis: the chosen strategies
    carry the rules (they were refused for giving rules twice)."""
    flags = ["--model", "llama3-8b", "--config", "tiny", "--mesh", "4x2", "--strategies", "fsdp,fsdp+model"]
    assert podscale_main(["verify", *flags, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "fsdp+model: would run" in out
    # a workload is verified in float32 unless told: bf16's own floor is beyond judging under Adam
    assert "precision float32" in out or "'precision': 'float32'" in out, out
    assert podscale_main(["verify", *flags, "--precision", "bf16", "--dry-run", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["precision"] == "bf16"
