"""``interpret.kin`` and ``interpret.update_only`` on small jaxprs: how a value is known by the
state it is computed with (not its shape), and which sums only an update reads."""

import jax
import jax.numpy as jnp
from jax import lax

from podscale.parallel import interpret


def _mul(a, b):
    return a * b


def test_kin_keeps_the_call_sites_of_one_traced_function_apart():
    """One jitted function called for two same-shaped leaves: each result is kin to its own leaf
    only, though both calls run the same traced jaxpr (its variables are shared)."""
    helper = jax.jit(_mul)

    def step(w1, w2, g1, g2):
        return helper(w1, g1) - 0.1, helper(w2, g2) + w2

    closed = jax.make_jaxpr(step)(*[jnp.ones((4, 4))] * 4)
    jaxpr = closed.jaxpr
    kin = interpret.kin(jaxpr, {jaxpr.invars[0]: "w1", jaxpr.invars[1]: "w2"})
    out1, out2 = jaxpr.outvars
    assert kin(out1) == {"w1"} and kin(out2) == {"w2"}
    assert kin(jaxpr.invars[2]) == {"w1"} and kin(jaxpr.invars[3]) == {"w2"}  # g1 * w1 inside the call


def test_kin_joins_only_same_shaped_values_and_follows_loops_and_branches():
    def step(w, v, xs, u):
        total = jnp.sum(w) * v  # a reduction and a scalar: no kin between w and v
        carry, ys = lax.scan(lambda c, x: (c + x, c * x), v[0], xs)  # the carry starts as v's row
        branch = lax.cond(total[0, 0] > 0, lambda a: a * 2.0, lambda a: a - 1.0, u)
        return total, ys, carry, branch

    closed = jax.make_jaxpr(step)(jnp.ones((2, 3)), jnp.ones((2, 3)), jnp.ones((5, 3)), jnp.ones((2, 3)))
    jaxpr = closed.jaxpr
    kin = interpret.kin(jaxpr, {jaxpr.invars[0]: "w", jaxpr.invars[1]: "v", jaxpr.invars[3]: "u"})
    total, ys, carry, branch = jaxpr.outvars
    assert kin(total) == {"v"} and kin(ys) == frozenset() and kin(carry) == frozenset()
    (scan,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    body = scan.params["jaxpr"].jaxpr
    assert kin(body.outvars[0], (id(scan),)) == kin(body.invars[-2], (id(scan),))  # a carry, one family
    assert kin(body.outvars[0]) is None  # named under the loop's id, as the partitioner runs it
    (cond,) = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
    assert kin(branch) == {"u"}
    assert all(kin(br.jaxpr.outvars[0], (id(cond),)) == {"u"} for br in cond.params["branches"])


def test_a_scanned_carry_is_kin_to_what_it_starts_as_and_what_it_becomes():
    """A carry's value in the body is the value it starts as and the value the loop returns:
    the gradient accumulated in a loop is kin to the weight its total updates."""

    def step(w, xs):
        def body(acc, x):
            return acc + x * 2.0, None

        g, _ = lax.scan(body, jnp.zeros_like(w), xs)
        return w - 0.1 * g

    closed = jax.make_jaxpr(step)(jnp.ones((4, 3)), jnp.ones((2, 4, 3)))
    jaxpr = closed.jaxpr
    kin = interpret.kin(jaxpr, {jaxpr.invars[0]: "w"})
    (scan,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    body = scan.params["jaxpr"].jaxpr
    assert kin(body.outvars[0], (id(scan),)) == {"w"}
    assert kin(jaxpr.invars[1]) == frozenset()  # the stacked xs: a slice of it is added, not it


def test_update_only_tells_an_update_from_a_statistic_the_rows_read():
    """``g * g`` and the moment it feeds are read only elementwise and by the outputs; a variance
    computed by a jitted helper (``jnp.var``) is broadcast back over the rows."""

    def step(x, g, nu):
        var = jnp.var(x, axis=0)  # a call (jit) in the jaxpr
        y = (x - jnp.mean(x, axis=0)) / jnp.sqrt(var + 1e-5)
        nu2 = 0.9 * nu + 0.1 * (g * g)
        return y, nu2, 0.99 * var

    closed = jax.make_jaxpr(step)(jnp.ones((8, 4)), jnp.ones(4), jnp.ones(4))
    jaxpr = closed.jaxpr
    only = interpret.update_only(jaxpr)
    y, nu2, running = jaxpr.outvars
    assert only(nu2)
    assert not only(running)  # the variance's family: read over the rows by y
    assert not only(jaxpr.invars[0])  # an input is never computed here
