"""Checks of the values podscale's functions take, with errors that name the parameter.

One function per kind of value, used where each parameter is declared (a ``Strategy`` field's
metadata, ``make_mesh``'s arguments, a ``Rules`` entry, a benchmark's sizes). A value of the
wrong Python type raises ``TypeError`` (as JAX and optax do), naming the parameter, the value and
its type and saying what to give; a value of the right type out of range raises ``ValueError``
(which ``podscale``'s command line reports as a bad flag, exit code 2). Nothing is converted
but what loses nothing: a NumPy integer becomes an ``int``, a NumPy bool a ``bool``.
"""

from __future__ import annotations

import math
import numbers
import os
import sys
import warnings
from collections.abc import Sequence

import numpy as np


class PodscaleWarning(UserWarning):
    """What podscale reports without refusing: an input worth a second look, or work it left
    undone that ``strict=True`` would refuse. Filter it with ``warnings.filterwarnings``."""


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def warn(message: str, category: type[PodscaleWarning]) -> None:
    """``warnings.warn`` attributed to the first caller outside podscale (the user's line that
    placed or planned the step), so that the warning names it and filters by module work."""
    level, frame = 2, sys._getframe(1)  # stacklevel 2: the caller of warn
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE + os.sep):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def described(value) -> str:
    """``a str``, ``an int``: the value's type with its article, for messages."""
    name = type(value).__name__
    return f"{'an' if name[:1] in 'aeiou' else 'a'} {name}"


def whole(name: str, value, *, at_least: int = 1, optional: bool = False, what: str = "") -> int | None:
    """An int (not a bool, a float or a str) of at least ``at_least``; ``None`` if ``optional``."""
    if value is None and optional:
        return None
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
        wanted = f"an int of at least {at_least}{what}"
        raise TypeError(f"{name}={value!r} is {described(value)}; give {'None or ' if optional else ''}{wanted}")
    value = int(value)
    if value < at_least:
        raise ValueError(f"{name} must be at least {at_least}, got {value}")
    return value


def positive_number(name: str, value, what: str = "") -> float:
    """A finite real number (not a bool or a str) above 0."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}={value!r} is {described(value)}; give a finite number above 0{what}")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number above 0{what}, got {value}")
    return value


def boolean(name: str, value) -> bool:
    """``True`` or ``False`` (not 0, 1 or a str)."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name}={value!r} is {described(value)}; give True or False")
    return bool(value)


def one_of(name: str, value, choices: Sequence[str]) -> str:
    """One of the strings ``choices``."""
    if not isinstance(value, str):
        raise TypeError(
            f"{name}={value!r} is {described(value)}; give one of the strings {', '.join(map(repr, choices))}"
        )
    if value not in choices:
        raise ValueError(f"{name}={value!r}: choose one of {', '.join(choices)}")
    return value


def names(name: str, value, what: str, example: str) -> tuple[str, ...]:
    """A tuple or list of non-empty strings, one per ``what``; a single string is refused (it
    would be taken letter by letter)."""
    if isinstance(value, str):
        raise TypeError(
            f"{name}={value!r} is one string, which would be read letter by letter; give a tuple of {what}, "
            f"e.g. {name}={example}"
        )
    if not isinstance(value, tuple | list):
        raise TypeError(f"{name}={value!r} is {described(value)}; give a tuple of {what}, e.g. {name}={example}")
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item:
            raise TypeError(
                f"{name}[{i}]={item!r} is {described(item)}; give a non-empty str for every entry of {name} ({what})"
            )
    return tuple(value)


def some_of(flag: str, items: Sequence[str], choices: Sequence[str], kind: str) -> list[str]:
    """``items`` chosen from ``choices``: at least one, each known, none twice; the errors name
    ``flag`` and list the choices."""
    items = list(items)
    if not items:
        raise ValueError(f"{flag}: no {kind} given; choose from {', '.join(choices)}")
    unknown = [s for s in items if s not in choices]
    if unknown:
        raise ValueError(f"{flag} {unknown}: unknown; choose from {', '.join(choices)}")
    twice = sorted({s for s in items if items.count(s) > 1})
    if twice:
        raise ValueError(f"{flag}: {', '.join(twice)} given twice; give each {kind} once")
    return items
