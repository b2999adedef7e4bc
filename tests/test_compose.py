"""Axis roles composed on one mesh: data x space x model, each image's height split over the space
axis and the weights the rules name over the model axis, in one step. Not yet exact, so refused
(the measurement is the test's docstring); the model and rules are the composition's case."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from podscale import Strategy, data_parallel
from podscale.parallel.tensor import Rules


class ConvStemTransformer(nn.Module):
    """A convolutional stem whose feature map becomes tokens, then a transformer's MLP and
    attention (smooth nonlinearities: a ReLU within roundoff of 0 would make the check about the
    summation order's luck)."""

    @nn.compact
    def __call__(self, images):
        x = jnp.tanh(nn.Conv(8, (3, 3), padding="SAME", name="stem")(images))
        x = nn.avg_pool(x, (2, 2), (2, 2))
        b, h, w, c = x.shape
        tokens = x.reshape(b, h * w, c)
        tokens = tokens + nn.SelfAttention(num_heads=2, qkv_features=16, use_bias=False, name="attention")(tokens)
        hidden = nn.gelu(nn.Dense(32, name="up")(tokens))
        tokens = tokens + nn.Dense(c, name="down")(hidden)
        return nn.Dense(10, name="head")(tokens.mean(axis=1))


RULES = Rules(
    (
        (r"attention/(query|key|value)/kernel$", -2),  # heads
        (r"attention/out/kernel$", 0),
        (r"up/kernel$", 1),  # the MLP's hidden dimension
        (r"up/bias$", 0),
        (r"down/kernel$", 0),
    ),
    name="conv-stem transformer",
)


def _setup():
    model, tx = ConvStemTransformer(), optax.adam(1e-2)
    rng = np.random.default_rng(0)
    batches = [
        {"image": rng.normal(size=(8, 8, 8, 3)).astype(np.float32), "label": rng.integers(0, 10, 8)} for _ in range(3)
    ]
    params = model.init(jax.random.key(0), batches[0]["image"])["params"]

    def step(state, batch):
        params, opt = state

        def loss(p):
            logits = model.apply({"params": p}, batch["image"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), {"loss": value}

    return step, (params, tx.init(params)), batches


def test_data_space_and_model_on_one_3d_mesh_are_refused_before_any_work():
    """Both roles on one mesh (the layout splits each replica's state chunks over both axes) are
    not yet exact: measured with this step on 2 x 2 x 2, one device's SGD parameters differ by up
    to 1% after 3 steps, and the stem's gradient (the convolution before the split weights) is
    twice one device's. podscale refuses the composition, whichever update, naming both axes."""
    step, _, _ = _setup()
    mesh = jax.make_mesh((2, 2, 2), ("data", "space", "model"))
    for update in ("replicated", "sharded"):
        strategy = Strategy(space_axis="space", model_axis="model", rules=RULES, weight_update=update)
        with pytest.raises(ValueError, match=r"a space axis \('space'\) and a model axis \('model'\) in one step"):
            data_parallel(step, mesh, strategy)
