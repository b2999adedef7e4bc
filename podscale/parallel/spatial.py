"""Spatial partitioning: each image's height split over a space axis, by XLA's SPMD partitioner.

With ``Strategy(space_axis="space")`` (or ``spatial=k``: the mesh's last axis, of size k) that axis is the space axis. podscale's own
partitioner stays manual over the data axes (the batch's rows, partial sums, the sharded update);
the space axis is left to XLA (``shard_map(..., axis_names=data axes)``): the images enter
sharded along their height, and XLA's convolution and windowed-reduction handlers keep that
sharding, exchanging the halo rows each window needs with the neighbouring partitions
(collective-permutes), so no device holds a whole activation. Up to 4 partitions podscale also
constrains each image convolution's input and result to that split
(``partition.core.Partitioner.bind``): XLA's propagation alone ran layers whose height the axis
does not divide (SSD300's 38 rows over 4) on half the partitions. A layer whose height the space
axis does not divide stays exact (XLA pads or regroups it); the plan lists those layers. Weights stay replicated over the
space axis; their gradients are summed over it by XLA, and over the data axes by podscale.
Batch norm's mean over height and width is a sum over the partitions too, so it equals batch
norm on the whole image (up to summation order).

This module reads the traced step: which batch leaves are images (their height and width are
those of a convolution's input), and which convolution and pooling layers have a height the
space axis does not divide, naming each.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np

from podscale._jax import source_info_util
from podscale.parallel.interpret import sub_jaxprs

WINDOWED = ("conv_general_dilated", "reduce_window_max", "reduce_window_min", "reduce_window_sum", "reduce_window")


@dataclasses.dataclass(frozen=True)
class Window:
    """A convolution or pooling window of the traced step, with the heights it reads and writes."""

    op: str
    where: str
    """The layer (flax module path) or the source line that made it."""
    height_in: int
    width_in: int | None
    height_out: int


def _where(eqn) -> str:
    stack = str(eqn.source_info.name_stack)
    names = [s for s in stack.split("/") if s and not s.startswith(("jvp(", "transpose(", "jit(", "pjit"))]
    if names:
        return "/".join(names)
    # A function such as flax's max_pool: the first frame of the user's own code.
    tb = eqn.source_info.traceback
    for frame in tb.frames if tb is not None else ():
        path = frame.file_name.replace("\\", "/")
        if not any(f"/{lib}/" in path for lib in ("jax", "jaxlib", "flax", "optax")):
            return f"{eqn.primitive.name} in {frame.function_name} ({path.rsplit('/', 1)[-1]}:{frame.line_num})"
    return source_info_util.summarize(eqn.source_info)


def windows(jaxpr) -> Iterator[Window]:
    """Every convolution and windowed reduction of the forward pass of ``jaxpr``, at any depth.
    The backward pass's (under ``transpose`` in the name stack) mirror them: the input gradient's
    has the layer's heights, and the kernel gradient's "output" is the kernel's own window."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if "transpose(" in str(eqn.source_info.name_stack):
            continue
        if name == "conv_general_dilated":
            lhs, out = eqn.params["dimension_numbers"].lhs_spec, eqn.params["dimension_numbers"].out_spec
            shape, out_shape = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
            if len(lhs) >= 3:
                yield Window(
                    name,
                    _where(eqn),
                    shape[lhs[2]],
                    shape[lhs[3]] if len(lhs) > 3 else None,
                    out_shape[out[2]],
                )
        elif name in WINDOWED:
            shape, out_shape = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
            dims, strides = eqn.params["window_dimensions"], eqn.params["window_strides"]
            if len(shape) >= 3 and (dims[1] > 1 or strides[1] > 1):  # NHWC: a window over the height
                yield Window(name, _where(eqn), shape[1], shape[2] if len(shape) > 3 else None, out_shape[1])
        for sub in sub_jaxprs(eqn):
            yield from windows(sub)


def is_image(shape: tuple[int, ...], found: list[Window]) -> bool:
    """Whether a batch leaf is an image: rank 3 or more, with the height (and width) of the input
    of one of the step's windows (``[N, H, W]`` or ``[N, H, W, C]``). The others (labels, boxes,
    masks of another size) are split by rows only."""
    sizes = {(w.height_in, w.width_in) for w in found}
    return len(shape) >= 3 and ((shape[1], shape[2]) in sizes or (shape[1], None) in sizes)


def image_leaves(batch_shapes: list[tuple[int, ...]], found: list[Window]) -> list[bool]:
    """:func:`is_image` for each leaf."""
    return [is_image(s, found) for s in batch_shapes]


def check(found: list[Window], k: int, space: str, images: list[tuple[int, ...]], strict: bool) -> list[str]:
    """Refuses, before running, a step the space axis cannot split (no image, or an image height
    ``k`` does not divide), and returns the layers whose height ``k`` does not divide: XLA keeps
    those exact by padding the height to a multiple of ``k`` (the last partitions hold the
    padding, masked out of every window) or by regrouping the activation, at the cost of extra
    communication; ``strict`` refuses them too."""
    if not found or not images:
        raise ValueError(
            f"spatial={k}: the step has no convolution or pooling over an image-shaped batch leaf "
            "([N, H, W] or [N, H, W, C]), so there is no height to split; leave spatial out for a model "
            "without spatial dimensions"
        )
    for shape in images:
        if shape[1] % k:
            raise ValueError(
                f"spatial={k}: the images have height {shape[1]} (batch leaf shape {list(shape)}), which the {k} "
                f"partitions of mesh axis {space!r} do not divide; use a height that is a multiple of {k}"
            )
    heights: dict[str, list[int]] = {}
    for w in found:  # the backward pass repeats the forward layers: one note per layer
        bad = heights.setdefault(w.where, [])
        for h in (w.height_in, w.height_out):
            if h % k and h not in bad:
                bad.append(h)
    uneven = [
        f"layer {where}: height {', '.join(map(str, bad))} is not a multiple of {k}; XLA pads it to "
        f"{', '.join(str(-(-h // k) * k) for h in bad)} rows over the {k} partitions (or regroups the "
        "activation), exactly, at extra communication"
        for where, bad in heights.items()
        if bad
    ]
    if strict and uneven:
        raise ValueError(
            f"strict=True: refused before running; spatial={k} does not divide every layer's height: "
            f"{uneven[0]} (and {len(uneven) - 1} more). Choose a spatial size that divides them all "
            f"(here: {_divisors(found)}), or drop strict"
        )
    return uneven


def _divisors(found: list[Window]) -> list[int]:
    heights = [h for w in found for h in (w.height_in, w.height_out)]
    g = int(np.gcd.reduce(heights)) if heights else 1
    return [d for d in range(1, g + 1) if g % d == 0]


def summary(found: list[Window]) -> list[dict[str, Any]]:
    """The forward windows, once each, for the plan."""
    seen, out = set(), []
    for w in found:
        key = (w.where, w.op, w.height_in, w.height_out)
        if key not in seen:
            seen.add(key)
            out.append(dataclasses.asdict(w))
    return out
