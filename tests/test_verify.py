"""``podscale.verify`` and ``podscale verify``: every strategy the mesh allows against one device,
measured against the noise floor of the batch's rows permuted; a deliberately broken sum (the
gradient divided by a wrong replica count, through gradsum's test-only hook) is caught and named."""

import json

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from helpers import podscale_main

import podscale
from podscale.parallel import gradsum


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.relu(nn.Dense(16)(x)))


def _problem():
    model, tx = _MLP(), optax.sgd(0.1)
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(32, 8)).astype(np.float32), "y": (np.arange(32) % 4).astype(np.int32)}
    params = model.init(jax.random.key(0), batch["x"])

    def step(state, batch):
        def loss(p):
            logits = model.apply(p, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        value, grads = jax.value_and_grad(loss)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": value}

    return step, {"params": params, "opt": tx.init(params)}, batch


@pytest.fixture
def broken_2d_sum(monkeypatch):
    """Every 2-D gradient sum divided by 2 after its collectives: a wrong replica count."""
    monkeypatch.setitem(gradsum._TEST_ONLY_DIVIDE, "2d", 2)


def test_every_strategy_on_a_2d_mesh_is_within_the_floor():
    step, state, batch = _problem()
    result = podscale.verify(step, state, batch, podscale.make_mesh((4, 2)), steps=2)
    ran = {r.name: r for r in result.results if r.applies}
    assert set(ran) == {"replicated", "sharded", "replicated+2d", "sharded+2d"}
    assert result.passed, "\n".join(result.lines())
    assert all(r.ratio <= podscale.verification.MULTIPLE and r.leaf for r in ran.values())
    assert len(result.floor) == 2 and all(f >= 0 for f in result.floor)
    spatial = [r for r in result.results if not r.applies]
    assert spatial and all("no convolution" in r.reason for r in spatial)  # an MLP has no images


def test_a_gradient_divided_by_the_wrong_replica_count_is_caught_and_named(broken_2d_sum):
    step, state, batch = _problem()
    result = podscale.verify(step, state, batch, podscale.make_mesh((4, 2)), steps=2)
    assert not result.passed
    assert result.failed == ["replicated+2d", "sharded+2d"]
    for name in result.failed:
        (r,) = [r for r in result.results if r.name == name]
        assert r.left_floor["step"] == 1 and r.left_floor["leaf"].startswith("state/params/")
        assert r.ratio > 1e3
    assert "FAILED: replicated+2d, sharded+2d" in result.lines()[-1]


def test_the_command_exits_1_naming_the_broken_strategy(broken_2d_sum, capsys):
    argv = ["verify", "--model", "mlp", "--mesh", "4x2", "--steps", "1", "--optimizer", "sgd"]
    assert podscale_main([*argv, "--strategies", "replicated,replicated+2d", "--json"]) == 1
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["failed"] == ["replicated+2d"]
    verdicts = {r["name"]: r["passed"] for r in out["results"]}
    assert verdicts == {"replicated": True, "replicated+2d": False}
    gradsum._TEST_ONLY_DIVIDE.clear()
    assert podscale_main([*argv, "--strategies", "replicated+2d"]) == 0
    assert "every strategy within the floor" in capsys.readouterr().out
