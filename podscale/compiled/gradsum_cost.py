"""What the 2-D gradient sum (:mod:`podscale.parallel.gradsum`) costs: per mesh axis link figures
(:class:`AxisCost`), the ring model of the sum in either axis order (:func:`modelled_seconds`), the
order with the lower modelled time (:func:`choose_order`), and the figures as text
(:func:`parse_axis_costs`, the ``axis_costs`` / ``--axis-costs`` option).

Pure arithmetic on the mesh's axis names and sizes: no collective runs here. Measuring the figures
on a live mesh (``axis_costs="calibrate"``) runs collectives, and is
:func:`podscale.parallel.gradsum.calibrate`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

from podscale.compiled import network

if TYPE_CHECKING:
    from jax.sharding import Mesh


@dataclasses.dataclass(frozen=True)
class AxisCost:
    """One mesh axis's links: one-way bandwidth per device (bytes/s) and latency per ring step (s)."""

    bandwidth: float
    latency: float

    def ring(self, kind: str, size: int, nbytes: float) -> float:
        """Seconds for a one-way ring ``reduce-scatter`` or ``all-reduce`` of ``nbytes`` per device
        over ``size`` members (:func:`podscale.compiled.network.ring_time`, the one ring formula)."""
        return network.ring_time(kind, size, nbytes, self.bandwidth, self.latency, bidirectional=False)


def modelled_seconds(
    order: tuple[str, str], sizes: Mapping[str, int], costs: Mapping[str, AxisCost], nbytes: float
) -> float:
    """Ring model of the 2-D sum of ``nbytes`` per device with ``order[0]`` first:
    reduce-scatter along it, all-reduce along the other on 1/|first| pieces, all-gather back."""
    first, second = order
    scatter = costs[first].ring("reduce-scatter", sizes[first], nbytes)  # and the all-gather back: as long
    return 2 * scatter + costs[second].ring("all-reduce", sizes[second], nbytes / sizes[first])


def choose_order(
    mesh: Mesh,
    costs: Mapping[str, AxisCost] | None,
    nbytes: float,
    axes: tuple[str, ...] | None = None,
    sizes: Mapping[str, int] | None = None,
) -> tuple[tuple[str, str], str]:
    """The 2-D order over ``axes`` (default the mesh's) with the lower modelled time for ``nbytes``
    per device, and why. ``sizes``: each of ``axes``' devices, where they are not the mesh's own
    axes (a phase over several of them)."""
    axes = tuple(mesh.axis_names) if axes is None else tuple(axes)
    sizes = dict(mesh.shape) if sizes is None else dict(sizes)
    if costs is None:
        return axes, "no per-axis costs given (pass axis_costs, or calibrate): mesh order"
    missing = [a for a in axes if a not in costs]
    if missing:
        raise ValueError(f"axis_costs has no entry for mesh axis {missing[0]!r}; give one AxisCost per axis of {axes}")
    forward = modelled_seconds(axes, sizes, costs, nbytes)
    backward = modelled_seconds(axes[::-1], sizes, costs, nbytes)
    tied = math.isclose(forward, backward, rel_tol=1e-9)
    order = axes if tied or forward < backward else axes[::-1]
    best, other = sorted((forward, backward))
    described = "; ".join(f"{a}: {costs[a].bandwidth:.3g} B/s, {costs[a].latency:.3g} s" for a in axes)
    tie = " (a tie: mesh order)" if tied else ""
    return order, (
        f"{order[0]} first: a {nbytes / 2**20:.1f} MiB sum is modelled at {best * 1e3:.3g} ms against "
        f"{other * 1e3:.3g} ms with {order[1]} first{tie} ({described})"
    )


def parse_axis_costs(text: str | None):
    """``axis_costs`` as text: ``calibrate``, or ``AXIS=BANDWIDTH:LATENCY,...`` (bytes/s and seconds,
    e.g. ``x=1e11:1e-6,y=4.5e10:1e-6``)."""
    if text is None or text == "calibrate":
        return text
    costs = {}
    for part in text.split(","):
        try:
            axis, figures = part.split("=")
            bandwidth, latency = (float(f) for f in figures.split(":"))
        except ValueError:
            raise ValueError(
                f"axis_costs={text!r}: write calibrate, or AXIS=BANDWIDTH:LATENCY per axis, e.g. x=1e11:1e-6,y=4.5e10:1e-6"
            ) from None
        if not (math.isfinite(bandwidth) and bandwidth > 0 and math.isfinite(latency) and latency >= 0):
            raise ValueError(
                f"axis_costs={part!r}: the bandwidth must be a finite number of bytes/s > 0 and the latency a finite "
                "number of seconds >= 0"
            )
        axis = axis.strip()
        if not axis or axis in costs:
            raise ValueError(
                f"axis_costs={text!r}: " + (f"axis {axis!r} given twice" if axis else "an axis without a name")
            )
        costs[axis] = AxisCost(bandwidth, latency)
    return costs
