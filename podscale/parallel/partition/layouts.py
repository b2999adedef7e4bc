"""The layouts a value can have on the replicas (see the package docstring): a block of rows
(:class:`Split`), the whole value (``REPLICATED``), a share of a sum (``PARTIAL``) or a batch-norm
group's value (``GROUP``), and the layout two values of one place can share (:func:`join`)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Split:
    """This replica's contiguous block of dimension ``dim``."""

    dim: int

    def __repr__(self) -> str:
        return f"split({self.dim})"


class _Named:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


REPLICATED = _Named("replicated")
PARTIAL = _Named("partial")
GROUP = _Named("group")
"""Batch norm over groups of replicas (opt-in): a whole value that is the same within a group
and differs between groups (the group's statistics). It computes like a replicated value."""

Layout = Any  # REPLICATED | PARTIAL | Split


def join(a: Layout, b: Layout) -> Layout:
    """The layout two values of one place (a loop carry, the branches of a cond) can share."""
    if a == b:
        return a
    if a is REPLICATED:
        return b
    if b is REPLICATED:
        return a
    return REPLICATED
