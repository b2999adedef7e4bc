"""How many times a ``while`` loop of a compiled module runs: XLA's ``known_trip_count`` (XLA:CPU
records it), else read from the loop itself (XLA:TPU records none): a counter from a constant
start, a constant step, below a constant bound, as ``jax.lax.scan`` and ``fori_loop`` lower.
:mod:`podscale.compiled.hlo` counts the ops and collectives of a loop's body with these."""

from __future__ import annotations

import re

from podscale.compiled.hlo_cost import type_dims

_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CONSTANT = re.compile(r"^(-?\d+)\)")


def trip_count(comps, comp: str, operands: list[str], attrs: str, rest: str) -> int | None:
    """A ``while`` loop's trip count: XLA's ``known_trip_count`` (XLA:CPU records it), else read
    from the loop (XLA:TPU does not record it): a condition ``i < N`` on a tuple element whose
    initial value is a constant (through copies), as ``jax.lax.scan`` and ``fori_loop`` lower."""
    t = _TRIP.search(rest)
    if t:
        return int(t.group(1))
    m = re.search(r"condition=%?([\w.\-]+)", attrs)
    cond = comps.get(m.group(1), []) if m else []
    if not cond or not operands:
        return None
    by_name = {ins[0]: ins for ins in cond}
    root = cond[-1]
    direction = re.search(r"direction=(\w+)", root[4])
    if root[2] != "compare" or not direction or direction.group(1) not in ("LT", "GT") or len(root[3]) != 2:
        return None
    counter, bound = root[3] if direction.group(1) == "LT" else root[3][::-1]
    limit = _constant_of(by_name, bound)
    element = by_name.get(counter)
    while element is not None and element[2] in ("copy", "bitcast", "convert") and element[3]:
        element = by_name.get(element[3][0])
    if limit is None or element is None or element[2] != "get-tuple-element":
        return None
    index = re.search(r"index=(\d+)", element[4])
    caller = {ins[0]: ins for ins in comps.get(comp, [])}
    init = caller.get(operands[0])
    if not index or init is None or init[2] != "tuple" or int(index.group(1)) >= len(init[3]):
        return None
    start = _constant_of(caller, init[3][int(index.group(1))])
    step = _loop_step(comps, attrs, int(index.group(1)))
    if start is None or step is None or limit < start:
        return None
    return -(-(limit - start) // step)


def _loop_step(comps, attrs: str, index: int) -> int | None:
    """What a loop's body adds to its counter (tuple element ``index``) each trip: the body's
    result element must be ``counter + constant``; ``None`` otherwise."""
    m = re.search(r"body=%?([\w.\-]+)", attrs)
    body = comps.get(m.group(1), []) if m else []
    if not body or body[-1][2] != "tuple" or index >= len(body[-1][3]):
        return None
    by_name = {ins[0]: ins for ins in body}
    add = by_name.get(body[-1][3][index])
    while add is not None and add[2] in ("copy", "bitcast") and add[3]:
        add = by_name.get(add[3][0])
    if add is None or add[2] != "add" or len(add[3]) != 2:
        return None
    for counter, constant in (add[3], add[3][::-1]):
        element = by_name.get(counter)
        while element is not None and element[2] in ("copy", "bitcast", "convert") and element[3]:
            element = by_name.get(element[3][0])  # XLA:TPU may copy the counter before adding to it
        step = _constant_of(by_name, constant)
        if element is not None and element[2] == "get-tuple-element" and step is not None and step > 0:
            if re.search(rf"index={index}\b", element[4]):
                return step
    return None


def _constant_of(by_name: dict, name: str, depth: int = 0) -> int | None:
    """The integer value of ``name``: a scalar ``constant``, through copies and bitcasts."""
    ins = by_name.get(name)
    if ins is None or depth > 8:
        return None
    if ins[2] == "constant":
        m = _CONSTANT.match(ins[5])
        return int(m.group(1)) if m and not type_dims(ins[1]) else None
    if ins[2] in ("copy", "bitcast", "convert") and ins[3]:
        return _constant_of(by_name, ins[3][0], depth + 1)
    return None
