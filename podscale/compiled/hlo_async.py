"""The asynchronous collectives of a compiled module, in the two forms XLA writes them.

- ``async-start`` / ``async-done`` around a computation holding the collective (XLA:TPU runs a
  reduce-scatter or an all-to-all so), beside the ``all-reduce-start`` / ``-done`` pairs that
  :mod:`podscale.compiled.hlo` reads by their opcodes.
- XLA:TPU's asynchronous collective fusion (libtpu's ``xla_tpu_enable_async_collective_fusion``
  and related options, which MaxText passes in ``LIBTPU_INIT_ARGS``): two ``kCustom`` fusions, one
  whose computation's root is the custom call ``AsyncCollectiveStart`` over the collective, and one
  whose root is ``AsyncCollectiveDone``, reading the start's results through
  ``get-tuple-element``. Each fusion's computation holds a copy of the collective: it is one
  collective, counted at its start. What runs between the two can hide it.
"""

from __future__ import annotations

import re

KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
START, DONE = "AsyncCollectiveStart", "AsyncCollectiveDone"
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')


def _called(comps, attrs: str) -> list:
    m = _CALLS.search(attrs)
    return comps.get(m.group(1), []) if m else []


def _custom_root(comps, attrs: str) -> str | None:
    """The target of the custom call that a ``kCustom`` fusion's computation returns, or ``None``."""
    if "kind=kCustom" not in attrs:
        return None
    body = _called(comps, attrs)
    if not body or body[-1][2] != "custom-call":  # a computation's root is its last (hlo.read_text)
        return None
    m = _TARGET.search(body[-1][5])
    return m.group(1) if m else None


def wrapped_collective(comps, opcode: str, attrs: str) -> tuple[str, str, str] | None:
    """(kind, result type, attributes) of the collective an asynchronous start runs: an
    ``async-start`` wrapping one, or an ``AsyncCollectiveStart`` fusion; ``None`` for any other
    instruction (an ``async-start`` of something else, an ordinary fusion)."""
    if opcode == "fusion" and _custom_root(comps, attrs) != START:
        return None
    if opcode not in ("fusion", "async-start"):
        return None
    for _, t, opc, _, _, rest in _called(comps, attrs):
        if opc in KINDS:
            return opc, t, rest
    return None


def is_done(comps, opcode: str, attrs: str) -> bool:
    """Whether the instruction is an ``AsyncCollectiveDone`` fusion (the end of a collective whose
    start :func:`wrapped_collective` read)."""
    return opcode == "fusion" and _custom_root(comps, attrs) == DONE


_THROUGH = ("get-tuple-element", "bitcast", "tuple", "copy")


def start_of(by_name: dict, operands, starts) -> str | None:
    """The start (one of ``starts``) that an ``AsyncCollectiveDone`` fusion ends: the one its
    operands read, directly or through ``get-tuple-element``, ``bitcast``, ``tuple`` or ``copy``
    (its first operand is a ``get-tuple-element`` of the start's results); ``None`` where none
    is found (the reader then waits for the start at the end of its computation)."""
    seen, frontier = set(), list(operands)
    for _ in range(8):
        found = [o for o in frontier if o in starts]
        if found:
            return found[0]
        nxt = []
        for o in frontier:
            ins = by_name.get(o)
            if o not in seen and ins is not None and ins[2] in _THROUGH:
                seen.add(o)
                nxt += ins[3]
        frontier = nxt
    return None
