"""Which state leaves are embedding tables split by rows over the data axes.

A *table* is a float weight of rank 2 or more that the step looks up by rows (the operand of a
``gather`` on its first dimension: ``table[ids]``, ``jnp.take(table, ids, axis=0)``), that no
matrix product reads (a tied embedding is the output layer's weight too, and stays one), and that
has at least as many rows as the step's global batch. The placement stores it split by rows over the data axes
(each replica holds ``ceil(rows / N)`` consecutive rows, the last block padded with zero rows),
and so the optimizer-state leaves computed with it (Adagrad's accumulator, momentum: its kin, not
any leaf of its shape): the lookup and
the gradient run where the rows live (:mod:`podscale.parallel.partition.tables`) and the update
touches only a replica's own rows. The plan lists each table with where it went and why.

**The threshold: the ids a step looks up.** A replicated table's gradient is all-reduced
densely every step: about ``2 R d`` values per device for ``R`` rows of width ``d`` (a ring
all-reduce). A table split by rows moves the looked-up rows instead: its ``B`` ids all-gathered, its
``B`` looked-up rows reduce-scattered back to their examples, and the ``B`` rows of cotangents
all-gathered for the gradient, about ``2 B d`` values per device (ids aside), where ``B`` is the
ids the step's largest gather on it looks up over the global batch: the global batch's rows for a
DLRM table (one id per example), every token of every sequence for a language model's embedding
(Llama 3.1 8B at 256 chips of 4 x 8192 tokens: 8.4M ids against 128,256 rows, so the embedding is
no table and is stored as the strategy stores any weight). Splitting costs less wire once
``R >= B`` (and saves ``(N - 1) / N`` of the table's memory and of its optimizer state at any
size); below that, the dense all-reduce of a small table is the cheaper, and fused with the other
gradients. The threshold is never below the global batch's rows. For Google's v0.7 DLRM (batch 55,296) that splits the 8 tables above 400k rows
(99.9% of the parameters) and keeps the 18 others (the largest 39,043 rows) replicated; that
submission kept its 13 smallest replicated (the largest 7,420 rows) and the 13 others on the TPU's
embedding engine. ``Strategy(min_table_rows=...)`` sets another threshold.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
from jax.extend import core

from podscale.parallel import interpret


def looked_up(jaxpr, n_state: int) -> set[int]:
    """Flat indices of the state leaves (the first ``n_state`` inputs of the step's ``jaxpr``)
    that a ``gather`` indexes by their first dimension, in the step or a sub-program it calls,
    and that no matrix product or convolution reads, directly or through other ops than a gather
    (a tied embedding, transposed into the output layer's weights, is no table)."""
    return set(lookups(jaxpr, n_state))


def lookups(jaxpr, n_state: int) -> dict[int, int]:
    """:func:`looked_up`'s leaves, each with the most ids one of its gathers looks up in a step
    (a DLRM table: one per example; a language model's token embedding: one per token)."""
    found: dict[int, int] = {}
    contracted: set[int] = set()

    def visit(jaxpr, sources: dict, runs: int = 1):
        def read(v):
            return frozenset() if isinstance(v, core.Literal) else sources.get(v, frozenset())

        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name == "gather":
                dn = eqn.params["dimension_numbers"]
                if tuple(dn.start_index_map) == (0,) and 0 in dn.collapsed_slice_dims:
                    ids = math.prod(eqn.invars[1].aval.shape[:-1]) * runs  # the last dim is each id's vector
                    for leaf in read(eqn.invars[0]):
                        found[leaf] = max(found.get(leaf, 0), ids)
                continue  # the looked-up rows are activations, not the table
            ins = frozenset().union(*(read(v) for v in eqn.invars))
            if name in ("dot_general", "conv_general_dilated"):
                contracted.update(ins)
            if name in interpret.LOOPS:  # its bodies read as they run: a gradient accumulation's lookups
                trips = eqn.params["length"] if name == "scan" else 1  # a while loop's count is not known
                outs = _through_bodies(eqn, read, lambda sub, inner: visit(sub, inner, runs * trips))
                for o, derived in zip(eqn.outvars, outs, strict=True):
                    if derived:
                        sources[o] = derived
                continue
            outs = None  # what each output is derived from, where a call says it exactly
            for sub in interpret.sub_jaxprs(eqn):
                if len(sub.invars) == len(eqn.invars):  # a call: its inputs are the equation's
                    inner = {s: read(o) for s, o in zip(sub.invars, eqn.invars, strict=True) if read(o)}
                    visit(sub, inner, runs)
                    if len(sub.outvars) == len(eqn.outvars):  # a lookup's rows (jnp.take's call) are no table
                        got = [
                            frozenset() if isinstance(v, core.Literal) else inner.get(v, frozenset())
                            for v in sub.outvars
                        ]
                        outs = got if outs is None else [a | b for a, b in zip(outs, got, strict=True)]
                elif ins and _has_product(sub):  # a loop or branch: what it reads may reach a product
                    contracted.update(ins)
            for i, o in enumerate(eqn.outvars):
                derived = ins if outs is None else outs[i]
                if derived:
                    sources[o] = derived

    visit(jaxpr, {v: frozenset([i]) for i, v in enumerate(jaxpr.invars[:n_state])})
    return {leaf: ids for leaf, ids in found.items() if leaf not in contracted}


def _through_bodies(eqn, read, visit) -> list[frozenset]:
    """What each result of a loop or a branch (``eqn``) is derived from, its bodies visited with
    their inputs derived as the equation's operands are (:func:`interpret.body_pairs`), and a
    loop's carries as the previous iteration left them, until that settles."""
    outs = [frozenset()] * len(eqn.outvars)
    position = {v: i for i, v in enumerate(eqn.outvars)}
    operands = set(v for v in eqn.invars if isinstance(v, core.Var))
    for sub, across, around in interpret.body_pairs(eqn):
        inner = {b: read(a) for a, b in across if isinstance(a, core.Var) and a in operands and read(a)}
        for _ in range(len(around) + 1):  # each pass carries one more iteration's derivation
            visit(sub, inner)
            grew = False
            for out, into in around:
                more = inner.get(out, frozenset()) if isinstance(out, core.Var) else frozenset()
                if not more <= inner.get(into, frozenset()):
                    inner[into] = inner.get(into, frozenset()) | more
                    grew = True
            if not grew:
                break
        for a, b in across:
            if isinstance(a, core.Var) and a in position and isinstance(b, core.Var):
                outs[position[a]] |= inner.get(b, frozenset())
    return outs


def thresholds(ids: Mapping[int, int], batch_rows: int, given: int | None) -> dict[int, int]:
    """Per looked-up leaf (``ids``: :func:`lookups`), the rows from which it is split by rows:
    ``given`` (``Strategy.min_table_rows``) for all, or each table's own ids per step, at least the
    global batch's rows."""
    return {i: given if given is not None else max(batch_rows, n) for i, n in ids.items()}


def _has_product(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
            return True
        if any(_has_product(sub) for sub in interpret.sub_jaxprs(eqn)):
            return True
    return False


def choose(
    state_leaves,
    candidates: set[int],
    forward: set[int] | None,
    n: int,
    min_rows: Mapping[int, int],
    kin: Mapping[int, frozenset] | None = None,
) -> dict[int, int]:
    """``{leaf index: rows per replica}`` of the tables split by rows over ``n`` replicas: the
    float weights of rank 2 or more looked up by rows with at least ``min_rows[i]`` rows (each
    table its own threshold: :func:`thresholds`), and their optimizer state: each float leaf that
    is no weight and is computed elementwise with one table (``kin``: leaf index to the looked-up
    leaves it is kin to, :func:`state_kin`), of that table's shape. A leaf is not taken for a
    table's state by its shape alone."""
    if n < 2:
        return {}
    tables = set()
    for i in candidates:
        x = state_leaves[i]
        shape = tuple(np.shape(x))
        if len(shape) >= 2 and shape[0] >= min_rows[i] and _float(x) and (forward is None or i in forward):
            tables.add(i)
    out = {}
    for i, x in enumerate(state_leaves):
        shape = tuple(np.shape(x))
        weight = forward is not None and i in forward
        related = {t for t in (kin or {}).get(i, frozenset()) if t in tables}
        # A table, or a float leaf updated with exactly one table, of its shape, that is no weight
        # (its optimizer state); a looked-up weight under its own threshold is no table.
        state = len(related) == 1 and tuple(np.shape(state_leaves[next(iter(related))])) == shape
        if i in tables or (state and _float(x) and not weight and i not in candidates):
            out[i] = math.ceil(shape[0] / n)
    return out


def state_kin(jaxpr, n_state: int, looked: set[int]) -> dict[int, frozenset]:
    """Per state leaf (the first ``n_state`` inputs of the step's ``jaxpr``), the looked-up leaves
    it is computed elementwise with (:func:`interpret.kin`): Adagrad's accumulator and a momentum
    are kin to the table they update."""
    kin_of = interpret.kin(jaxpr, {jaxpr.invars[i]: i for i in looked})
    return {i: kin_of(v) or frozenset() for i, v in enumerate(jaxpr.invars[:n_state])}


def _float(x) -> bool:
    import jax
    import jax.numpy as jnp

    dtype = x.dtype
    return bool(jnp.issubdtype(dtype, jnp.inexact)) and not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
