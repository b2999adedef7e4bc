"""podscale.parallel.partition's rules, each on a small program of its own: the layout it gives
the result (the replica's rows, a partial sum, a whole value) and the whole value, against the
program run on one device. The engine's own tests run whole steps; these say which rule does what."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from podscale import make_mesh
from podscale.parallel.partition import PARTIAL, REPLICATED, Partitioner, Setup, Split

N = 8


def _partitioned(f, args, layouts):
    """``f(*args)`` traced at the global shapes and evaluated by a Partitioner over ``N``
    replicas: each output's layout, and its whole value."""
    closed = jax.make_jaxpr(f)(*args)
    found = {}

    def body(*local):
        p = Partitioner(Setup(("data",), N))
        outs = p.run(closed.jaxpr, closed.consts, list(zip(local, layouts, strict=True)))
        found["layouts"] = [lay for _, lay in outs]
        found["whole_ops"] = list(p.whole_ops)
        return tuple(p.whole(v, lay) for v, lay in outs)

    def spec(layout, x):
        if isinstance(layout, Split):
            return P(*([None] * layout.dim), "data")
        return P()

    mapped = jax.shard_map(
        body,
        mesh=make_mesh((N,)),
        in_specs=tuple(spec(lay, x) for lay, x in zip(layouts, args, strict=True)),
        out_specs=P(),
    )
    outs = jax.jit(mapped)(*args)
    return found["layouts"], found["whole_ops"], outs


RNG = np.random.default_rng(0)
X = RNG.normal(size=(16, 6)).astype(np.float32)  # 16 rows: 2 per replica
W = RNG.normal(size=(6, 4)).astype(np.float32)
ROWS, WHOLE = Split(0), REPLICATED

CASES = [
    # (name, function, layouts of the arguments, layouts of the results)
    ("elementwise keeps rows", lambda x, w: jnp.tanh(x) * 2.0, (ROWS, WHOLE), [ROWS]),
    ("a matmul by a weight keeps rows", lambda x, w: x @ w, (ROWS, WHOLE), [ROWS]),
    ("contracting the rows is a partial sum", lambda x, w: x.T @ x, (ROWS, WHOLE), [PARTIAL]),
    ("a sum over the rows is a partial sum", lambda x, w: x.sum(axis=0), (ROWS, WHOLE), [PARTIAL]),
    ("a sum over features keeps rows", lambda x, w: x.sum(axis=1), (ROWS, WHOLE), [ROWS]),
    ("a transpose moves the split", lambda x, w: x.T, (ROWS, WHOLE), [Split(1)]),
    ("a reshape of whole rows keeps them", lambda x, w: x.reshape(16, 3, 2), (ROWS, WHOLE), [ROWS]),
    ("weights alone stay whole", lambda x, w: w * 3.0, (ROWS, WHOLE), [WHOLE]),
    ("a sum of partial sums stays partial", lambda x, w: x.sum(axis=0) + (x * x).sum(axis=0), (ROWS, WHOLE), [PARTIAL]),
    ("a reshape of a partial sum stays partial", lambda x, w: x.sum(axis=0).reshape(2, 3), (ROWS, WHOLE), [PARTIAL]),
    ("a scaled partial sum is summed, then scaled", lambda x, w: x.sum(axis=0) / 16.0, (ROWS, WHOLE), [WHOLE]),
    ("a nonlinearity of a partial sum reads it whole", lambda x, w: jnp.exp(x.mean(axis=0)), (ROWS, WHOLE), [WHOLE]),
    ("a max over the rows is whole", lambda x, w: x.max(axis=0), (ROWS, WHOLE), [WHOLE]),
    (
        "a gradient of a weight is a partial sum",
        lambda x, w: jax.grad(lambda w: (x @ w).sum())(w),
        (ROWS, WHOLE),
        [PARTIAL],
    ),
]


@pytest.mark.parametrize(("name", "f", "layouts", "want"), CASES, ids=[c[0] for c in CASES])
def test_a_rule_gives_its_layout_and_one_devices_value(name, f, layouts, want):
    got, _, outs = _partitioned(f, (X, W), layouts)
    assert got == want
    expected = f(X, W)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for out, ref in zip(outs, expected, strict=True):
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-6, atol=2e-6)


def test_an_op_without_a_rule_runs_on_whole_values_and_is_listed():
    """Sorting along the rows: no rule splits it, so its operand is gathered first (always
    correct), and the plan lists it."""
    got, whole_ops, (out,) = _partitioned(lambda x, w: jnp.sort(x, axis=0), (X, W), (ROWS, WHOLE))
    assert got == [WHOLE] and any("sort" in op for op in whole_ops), whole_ops
    np.testing.assert_array_equal(np.asarray(out), np.sort(X, axis=0))


def test_a_scans_consts_and_carry_are_counted_under_jax_0_10_and_0_11():
    """JAX 0.10's scan equations say ``num_consts`` and ``num_carry``; JAX 0.11's give the trees
    ``ft_in`` (consts, carry, xs) instead (checked against jax 0.11.2: a scan step on 8 replicas
    within 1.2e-7 of one device, where the rule raised KeyError before)."""
    from types import SimpleNamespace

    from podscale.parallel.interpret import scan_counts

    assert scan_counts({"num_consts": 2, "num_carry": 3, "jaxpr": None}) == (2, 3)
    tree = SimpleNamespace(unpack=lambda: (("w", "b"), ("h",), ("x", "y", "z")))
    assert scan_counts({"ft_in": tree, "jaxpr": None}) == (2, 1)


def test_a_whole_mask_broadcast_against_the_rows_is_made_at_the_rows_size():
    """A causal mask ``[T, T]`` and a ``-inf`` filler broadcast against attention logits
    ``[B, T, T]`` (``jnp.where``): each replica broadcasts them to its own rows, never to the whole
    batch's shape (at pod scale, a mask the size of the global batch's logits on every device)."""
    logits = RNG.normal(size=(16, 6, 6)).astype(np.float32)

    def f(x):
        causal = jnp.tril(jnp.ones((6, 6), bool))
        return jnp.where(causal, x, -jnp.inf)

    layouts, whole_ops, (out,) = _partitioned(f, (logits,), (ROWS,))
    assert layouts == [ROWS] and whole_ops == []
    np.testing.assert_array_equal(out, f(logits))
    closed = jax.make_jaxpr(f)(logits)

    def body(x):
        p = Partitioner(Setup(("data",), N))
        return p.run(closed.jaxpr, closed.consts, [(x, ROWS)])[0][0]

    text = (
        jax.jit(jax.shard_map(body, mesh=make_mesh((N,)), in_specs=P("data"), out_specs=P("data")))
        .lower(logits)
        .as_text()
    )
    assert "16x6x6xi1" not in text and "16x6x6xf32" in text  # the whole-shaped buffers are the argument and result only
    assert "2x6x6xi1" in text
