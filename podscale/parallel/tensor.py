"""Tensor (model) partitioning of unmodified models by sharding rules on the parameter paths.

With ``Strategy(model_axis="model")`` (or ``model_parallel=k``: the mesh's last axis, of size k) that axis is the *model axis*.
:class:`Rules` is an ordered table of ``(regex, dim)``: each state leaf whose path (its keys joined
by ``/``, e.g. ``params/encoder/self_attention/query/kernel``) the regex matches (``re.search``)
is split along ``dim`` (negative counts from the end, so a stack of scanned layers keeps its
rules) over the model axis, or kept whole with ``dim=None``. The first matching rule applies,
as in the MLPerf v0.7 JAX Transformer's ``partitions.py``. The optimizer state of a split
parameter ends with the parameter's path (optax states mirror the parameters), so the same rule
splits it alike.

podscale stays manual over the data axes; the model axis is left to XLA's SPMD partitioner,
which propagates the weights' splits through the step and inserts the model-axis collectives
(all-reduces after the attention output and the second MLP layer, Megatron-style). The step is
the user's, unmodified; every result equals one device's up to float summation order.

Before running, :func:`assign` reports a rule that matches nothing, a leaf two rules match
(naming both: the first applies), a split dimension the axis size does not divide (path, shape,
axis: the leaf stays whole) and every large weight left whole; ``strict`` refuses them.

Built-in rules (:data:`RULES`) follow the MLPerf v0.7 JAX Transformer (mlcommons/
training_results_v0.7 Google/benchmarks/transformer/implementations/transformer-research-JAX-
tpu-v3-8192/partitions.py and models.py): query, key and value kernels split on their heads,
the attention output on its heads (input) dimension, the first MLP layer on its output (with its
bias), the second on its input, the embedding on the vocabulary; layer norms and the biases of
layers split on their input stay whole.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re

import jax
import numpy as np

from podscale.parallel.checks import PodscaleWarning, described, warn

LARGE_SHARE = 0.01
"""A weight holding at least this share of all weight elements is *large*: left whole, it is
reported (and refused by ``strict``)."""


@dataclasses.dataclass(frozen=True)
class Rules:
    """An ordered table of ``(regex on the leaf path, dimension or None)``; see the module."""

    rules: tuple[tuple[str, int | None], ...]
    name: str = "custom"

    def __post_init__(self):
        example = "Rules(((r'kernel$', -1), (r'bias$', None)))"
        if isinstance(self.rules, str) or not isinstance(self.rules, tuple | list):
            raise TypeError(
                f"Rules: rules={self.rules!r} is {described(self.rules)}; give a tuple of (regex, dimension) pairs, e.g. {example}"
            )
        if not isinstance(self.name, str):
            raise TypeError(f"Rules: name={self.name!r} is {described(self.name)}; give a str")
        rules = []
        for i, entry in enumerate(self.rules):
            if not isinstance(entry, tuple | list) or len(entry) != 2:
                one = " (one rule is a pair inside the tuple: Rules(((regex, dimension),)))" if i == 0 else ""
                raise TypeError(
                    f"Rules: rules[{i}]={entry!r} is {described(entry)}, not a (regex, dimension) pair{one}; e.g. {example}"
                )
            pattern, dim = entry
            if not isinstance(pattern, str):
                raise TypeError(
                    f"Rules: rules[{i}] has regex {pattern!r}, {described(pattern)}; give a str matched against leaf paths "
                    "such as 'params/encoder/query/kernel'"
                )
            if isinstance(dim, bool | np.bool_) or not (dim is None or isinstance(dim, numbers.Integral)):
                raise TypeError(
                    f"sharding rule {pattern!r}: the dimension must be an int or None, got {dim!r} ({described(dim)}); an int "
                    "is the dimension split over the model axis (negative counts from the end), None keeps the leaf whole"
                )
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"sharding rule {pattern!r} is not a regular expression: {e}") from None
            rules.append((pattern, None if dim is None else int(dim)))
        object.__setattr__(self, "rules", tuple(rules))


class RuleWarning(PodscaleWarning):
    """Sharding rules that leave something undone: a rule matching nothing, a leaf two rules
    match, a dimension a leaf does not have or the model axis does not divide, a large weight
    left whole. ``strict=True`` refuses them instead."""


def with_model_rules(strategy, model: str):
    """``strategy`` with the built-in rules of ``model`` when it asks for ``model_parallel``
    without rules of its own; refuses a model without built-in rules."""
    if not (strategy.model_parallel or strategy.model_axis) or strategy.rules is not None:
        return strategy
    if model not in RULES:
        given = (
            f"model_parallel={strategy.model_parallel}"
            if strategy.model_parallel
            else f"model_axis={strategy.model_axis!r}"
        )
        raise ValueError(
            f"{given}: model {model!r} has no built-in sharding rules (built-in "
            f"rules: {', '.join(RULES)}); give rules=NAME of a built-in whose layer names fit the model, or drop "
            "model_parallel"
        )
    return dataclasses.replace(strategy, rules=RULES[model])


def path_name(path) -> str:
    """A pytree key path as ``a/b/0/c``: dict keys, attribute names and indices joined by ``/``."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


@dataclasses.dataclass(frozen=True)
class Assignment:
    dims: tuple[int | None, ...]
    """Per state leaf (flattened order): the dimension split over the model axis, or None."""
    notes: tuple[str, ...]
    """What the rules left undone or unclear (reported; ``strict`` refuses them)."""
    rule_of: tuple[str | None, ...]
    """Per leaf: the rule that applied."""


def assign(
    rules: Rules,
    state,
    k: int,
    axis: str,
    weights: set[int] | None = None,
    strict: bool = False,
    split_by_rows: set[int] = frozenset(),
) -> Assignment:
    """Applies ``rules`` to every leaf of ``state`` (arrays or ``ShapeDtypeStruct``) for a model
    axis ``axis`` of ``k`` devices. ``weights``: the flat indices of the leaves the forward pass
    reads (for the large-weight report); default every float leaf of two or more dimensions.
    ``split_by_rows``: the leaves stored split by rows over the data axes where no rule applies
    (embedding tables, :mod:`podscale.parallel.tables`): a large one is not left whole."""
    pairs = jax.tree_util.tree_leaves_with_path(state)
    compiled = [(pattern, dim, re.compile(pattern)) for pattern, dim in rules.rules]
    used = [False] * len(compiled)
    dims, rule_of, notes = [], [], []
    for path, x in pairs:
        name, shape = path_name(path), tuple(np.shape(x))
        hits = [j for j, (_, _, rx) in enumerate(compiled) if rx.search(name)]
        for j in hits:
            used[j] = True
        if len(hits) > 1:
            first, second = compiled[hits[0]][0], compiled[hits[1]][0]
            notes.append(f"{name} {list(shape)}: matched by rule {first!r} and rule {second!r}; the first applies")
        dim = compiled[hits[0]][1] if hits else None
        rule_of.append(compiled[hits[0]][0] if hits else None)
        if dim is not None:
            if not -len(shape) <= dim < len(shape):
                notes.append(
                    f"{name} {list(shape)}: rule {compiled[hits[0]][0]!r} splits dimension {dim}, which a "
                    f"rank-{len(shape)} leaf does not have; kept whole"
                )
                dim = None
            elif shape[dim] % k:
                notes.append(
                    f"{name} {list(shape)}: dimension {dim} ({shape[dim]}) is not divisible by mesh axis {axis!r} "
                    f"of {k} devices; kept whole (use a model axis that divides {shape[dim]})"
                )
                dim = None
            else:
                dim %= len(shape)
        dims.append(dim)
    for (pattern, _, _), hit in zip(compiled, used, strict=True):
        if not hit:
            notes.append(f"rule {pattern!r} matches no leaf of the state")
    if weights is None:
        weights = {i for i, (_, x) in enumerate(pairs) if len(np.shape(x)) >= 2 and _is_float(x)}
    total = sum(math.prod(np.shape(pairs[i][1])) for i in weights)
    for i in sorted(weights):
        path, x = pairs[i]
        size = math.prod(np.shape(x))
        if rule_of[i] is None and i not in split_by_rows and total and size >= LARGE_SHARE * total and size >= k:
            notes.append(
                f"{path_name(path)} {list(np.shape(x))}: a large weight ({size / total:.0%} of the weights) is left "
                f"whole on every device of mesh axis {axis!r}; add a rule for it, or one with dimension None to "
                "keep it whole on purpose"
            )
    if strict and notes:
        raise ValueError(
            f"strict=True: refused before running; the sharding rules {rules.name!r} for mesh axis {axis!r} "
            f"({k} devices) leave these: " + "; ".join(notes)
        )
    if notes:
        warn(
            f"the sharding rules {rules.name!r} for mesh axis {axis!r} ({k} devices) leave {len(notes)} thing(s) as "
            "they are (strict=True refuses them):\n  " + "\n  ".join(notes),
            RuleWarning,
        )
    return Assignment(tuple(dims), tuple(notes), tuple(rule_of))


def _is_float(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and bool(jax.numpy.issubdtype(dtype, jax.numpy.floating))


_KEEP = None  # a dimension of None: kept whole on purpose

RULES = {
    # podscale.train.models.Transformer (flax's MultiHeadDotProductAttention and two Dense layers).
    "transformer": Rules(
        (
            (r"MultiHeadDotProductAttention_\d+/(query|key|value)/kernel$", -2),
            (r"MultiHeadDotProductAttention_\d+/out/kernel$", -3),
            (r"DecoderBlock_\d+/Dense_0/kernel$", -1),
            (r"DecoderBlock_\d+/Dense_0/bias$", -1),
            (r"DecoderBlock_\d+/Dense_1/kernel$", -2),
            (r"Embed_0/embedding$", -2),
            (r"(LayerNorm_\d+/(scale|bias)|Dense_1/bias|(^|/)positions)$", _KEEP),
        ),
        name="transformer",
    ),
    "transformer-big": Rules(
        (
            (r"attention/(query|key|value)/kernel$", -2),
            (r"attention/out/kernel$", -3),
            (r"ffn/wi/kernel$", -1),
            (r"ffn/wi/bias$", -1),
            (r"ffn/wo/kernel$", -2),
            (r"(^|/)embedding$", -2),
            (r"(ln_\w+|\w+_norm)/(scale|bias)$|ffn/wo/bias$", _KEEP),
        ),
        name="transformer-big",
    ),
    "bert-large": Rules(
        (
            (r"attention/(query|key|value)/kernel$", -2),
            (r"attention/(query|key|value)/bias$", -2),
            (r"attention/output/kernel$", -3),
            (r"intermediate/kernel$", -1),
            (r"intermediate/bias$", -1),
            (r"ffn_output/kernel$", -2),
            (r"word_embeddings/embedding$", -2),
            (r"mlm_bias$", -1),
            (
                r"(_norm/(scale|bias)|attention/output/bias|ffn_output/bias|position_embeddings/embedding|"
                r"type_embeddings/embedding|mlm_dense/(kernel|bias))$",
                _KEEP,
            ),
        ),
        name="bert-large",
    ),
}
# Llama 3.1 (podscale.workloads.llama3), as MaxText's logical axis rules split it over ``tensor``:
# query heads, key/value heads (8: a model axis of up to 8 divides them), the attention output on
# its heads, the SwiGLU's gate and up on their output and down on its input, the embedding table
# and the output projection on the vocabulary; RMSNorm scales stay whole.
RULES["llama3-8b"] = RULES["llama3-70b"] = Rules(
    (
        (r"attention/(query|key|value)/kernel$", -2),
        (r"attention/out/kernel$", -3),
        (r"mlp/(gate|up)/kernel$", -1),
        (r"mlp/down/kernel$", -2),
        (r"(^|/)embedding$", -2),
        (r"(^|/)output/kernel$", -1),
        (r"_norm/scale$", _KEEP),
    ),
    name="llama3",
)
"""The built-in rules, by model name (``podscale train --model NAME --model-parallel k``)."""
