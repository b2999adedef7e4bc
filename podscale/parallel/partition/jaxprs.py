"""Small readers of a jaxpr's variables and equations (and of a value's varying axes), shared by
the partitioner, its rules and its control flow."""

from __future__ import annotations

import jax
import numpy as np
from jax.extend import core

from podscale._jax import source_info_util
from podscale.parallel.interpret import varying_axes


def vma(x) -> frozenset:
    """The mesh axes ``x`` varies over (none where its type records none)."""
    try:
        return varying_axes(jax.typeof(x))
    except TypeError:
        return frozenset()


def is_zero(var) -> bool:
    """Whether ``var`` is a literal zero."""
    return isinstance(var, core.Literal) and np.all(np.asarray(var.val) == 0)


def source_at(eqn) -> str:
    """`` at file.py:line``, the user's line that traced ``eqn``, for messages (``""`` where unknown)."""
    try:
        frame = source_info_util.user_frame(eqn.source_info.traceback)
        return f" at {frame.file_name.rsplit('/', 1)[-1]}:{frame.start_line}" if frame else ""
    except Exception:  # source info is a courtesy; never fail the plan over it
        return ""


def var_dtype(var):
    """The program's type of ``var`` (``None`` for a token or a key)."""
    dtype = getattr(getattr(var, "aval", None), "dtype", None)
    return dtype if isinstance(dtype, np.dtype) else None


def global_shape(var) -> tuple[int, ...]:
    """The whole (unsplit) shape of ``var``, as the program has it."""
    return tuple(var.aval.shape)
