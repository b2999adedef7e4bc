"""What one collective costs on a system: ring formulas per link, and where a group's devices sit.

**Ring formulas** (the alpha-beta cost of the ring algorithms, Thakur, Rabenseifner and Gropp,
"Optimization of Collective Communication Operations in MPICH", 2005, with scaling-book's per-link
bandwidths and hop latency, "Sharded Matrices"). Over a group of ``n`` devices, with ``W`` the
one-way bandwidth of the link each device sends over and ``a`` the latency of one step:

* all-gather of a shard ``S`` (``V = n S``) and reduce-scatter of ``V``: ``(n - 1) / n * V / W``
  on a one-way ring, half that on a bidirectional ring (a torus dimension with wrap-around: two
  counter-rotating rings, each with half the data; scaling-book's ``V / W_ici`` with ``W_ici`` the
  bidirectional bandwidth). Steps: ``n - 1`` one way, ``ceil((n - 1) / 2)`` both ways (each shard
  goes halfway round in each direction: scaling-book's ``T_min |X| / 2``).
* all-reduce: a reduce-scatter then an all-gather (twice the above).
* all-to-all of ``V`` per device: the busiest link carries ``floor(n/2) ceil(n/2) / n * V`` one way
  on a line, half that on a ring (scaling-book: "AllGather / 4 for a bidirectional ring").
* collective-permute (a halo exchange): one hop, ``S / W + a``.

The time is latency plus bandwidth (``steps * a + bytes / W``), not their maximum: a ring step
waits for the step before it.

**Placement.** A TPU torus is numbered with the cores of a chip fastest, then the chips along the
first torus dimension, then the next. A group whose chips lie along one dimension is a ring if it
covers that whole dimension and the dimension wraps around, else a line (scaling-book: no
wrap-around "typically doubles the time"); a group over several dimensions runs dimension by
dimension with the data split between them (``multi_axis="torus"``, the default: scaling-book's
"bytes / (W_ici x num_axes)", a dimension without wrap-around adding half a ring's bandwidth,
latency the sum over the dimensions), or as one ring snaking
through them (``multi_axis="ring"``: paper 1's 1-D summation, which its 2-D summation beat). Groups interleaved along a dimension
(every ``s``-th chip: the data axis when a replica spans ``s`` chips) share its links ``s`` ways,
and a hop spans ``s`` links. A chip's devices in different groups share its links; a chip's devices
in one group first combine on the chip (at HBM bandwidth). On GPUs a group within one node rings
over NVLink (each GPU sends at its NVLink bandwidth through the switch); a group across nodes is
bound by each GPU's own NIC, a ring step over the network costing ``network_latency``.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from podscale.compiled.hlo import ring_bytes
from podscale.compiled.systems import System

KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
MULTI_AXIS = ("torus", "ring")
"""How a group over several torus dimensions is costed: ``torus`` (XLA's collectives on a TPU
slice, scaling-book's multi-axis formula) or ``ring`` (one ring snaking through them, as the 1-D
summation paper 1 compares its 2-D summation with)."""


def ring_time(
    kind: str,
    n: int,
    nbytes: float,
    bandwidth: float,
    latency: float,
    bidirectional: bool,
    steps: int | None = None,
) -> float:
    """Seconds for one ring collective of ``kind`` over ``n`` devices. ``nbytes`` is the buffer
    each device contributes (an all-gather's shard, the others' operand), ``bandwidth`` the one-way
    bytes/s of each device's link, ``latency`` seconds per step; ``steps`` (a reduce-scatter's or
    all-gather's) overrides the ring's own."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; one of {KINDS}")
    if kind == "collective-permute":
        return nbytes / bandwidth + latency
    if n <= 1:
        return 0.0
    ways = 2 if bidirectional else 1
    if steps is None:
        steps = math.ceil((n - 1) / 2) if bidirectional else n - 1
    if kind == "all-to-all":
        return (n // 2) * ((n + 1) // 2) / n * nbytes / (ways * bandwidth) + steps * latency
    passes = 2 if kind == "all-reduce" else 1  # a reduce-scatter, then an all-gather
    return ring_bytes(kind, n, nbytes) / (ways * bandwidth) + passes * steps * latency


@dataclasses.dataclass(frozen=True)
class Path:
    """How a group's collective runs: the ring it forms and what it shares."""

    chips: int
    """Members after combining a chip's own devices (the ring's length)."""
    bandwidth: float
    latency: float
    bidirectional: bool
    on_chip: int = 1
    """Devices of the group per chip (combined at HBM bandwidth first)."""
    where: str = ""
    steps: int | None = None
    """Steps of a reduce-scatter or all-gather when not the ring's own (several torus dimensions)."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def slices_of(system: System, chips: int, slices: int | None = None) -> int:
    """How many slices ``chips`` chips of a TPU ``system`` are: ``slices`` where given, else one up
    to the largest slice (``System.slice_chips``) and past it the fewest of a power-of-two size.
    Several need the system's data-centre network bandwidth (refused, naming it, where none is
    published)."""
    largest = system.slice_chips or system.max_chips
    given = slices is not None
    if not given:
        size = 1 << (largest.bit_length() - 1)  # the largest power-of-two slice
        if chips > largest and chips % size:
            raise ValueError(
                f"--chips {chips}: more than a {system.name} slice holds ({largest}); give a multiple of {size} "
                f"(slices of {size} chips), or --slices"
            )
        slices = 1 if chips <= largest else chips // size
    if isinstance(slices, bool) or not isinstance(slices, int) or slices < 1:
        raise ValueError(f"--slices {slices!r}: a whole number of at least 1")
    if chips % slices:
        raise ValueError(f"--chips {chips} do not divide into {slices} slices; give a multiple of {slices}")
    if chips // slices > largest:
        raise ValueError(
            f"--chips {chips} as {slices} slices: {chips // slices} chips a slice, past {system.name}'s {largest}"
        )
    if slices > 1 and not system.dcn_bandwidth:
        instead = "give --slices 1" if given and chips <= largest else f"project at most {largest} chips"
        raise ValueError(
            f"--chips {chips}{f' as --slices {slices}' if given else ''}: {system.name} slices hold at most {largest} "
            f"chips, and no data-centre network bandwidth is published for joining {system.name} slices "
            f"(podscale project --list-systems); {instead}"
        )
    return slices


def _positions(coords: np.ndarray, length: int) -> tuple[int, int]:
    """(distinct positions, stride) of a group's coordinates along one dimension."""
    values = sorted(set(coords.tolist()))
    stride = min((b - a for a, b in zip(values, values[1:], strict=False)), default=length)
    return len(values), stride


class Topology:
    """The devices of ``chips`` chips of ``system``, placed as described in the module docstring."""

    def __init__(self, system: System, chips: int, multi_axis: str = "torus", slices: int | None = None):
        if multi_axis not in MULTI_AXIS:
            raise ValueError(f"multi_axis {multi_axis!r}: one of {MULTI_AXIS}")
        self.system, self.chips, self.multi_axis = system, chips, multi_axis
        self.devices = chips * system.devices_per_chip
        self.slices = 1
        if system.kind != "tpu" and slices not in (None, 1):
            raise ValueError(f"--slices {slices}: {system.name!r} is no TPU; several slices are TPU pods joined by DCN")
        if system.kind == "tpu":
            self.slices = slices_of(system, chips, slices)
            self.shape, self.wraps = system.torus(chips // self.slices)
        elif system.kind == "gpu":
            if chips > system.max_chips:
                raise ValueError(f"--chips {chips}: system {system.name!r} is modelled up to {system.max_chips} GPUs")
            if chips > system.node_size and chips % system.node_size:
                raise ValueError(
                    f"--chips {chips}: {system.name!r} nodes hold {system.node_size} GPUs; choose a multiple of it"
                )
            self.shape, self.wraps = (min(chips, system.node_size), max(1, chips // system.node_size)), (True, False)
        else:
            raise ValueError(f"system {system.name!r} has no modelled topology (kind {system.kind!r})")
        self.slice_devices = self.devices // self.slices

    def describe(self) -> str:
        s = self.system
        if s.kind == "tpu":
            dims = "x".join(map(str, self.shape))
            wraps = ", ".join(f"{d}{' (wraps)' if w else ''}" for d, w in zip(self.shape, self.wraps, strict=True))
            if self.slices > 1:
                return (
                    f"{self.chips} chips as {self.slices} slices of a {dims} torus ({wraps}) joined by the data-centre "
                    f"network, {s.devices_per_chip} devices per chip"
                )
            return f"{self.chips} chips as a {dims} torus slice ({wraps}), {s.devices_per_chip} devices per chip"
        return f"{self.shape[1]} node(s) of {self.shape[0]} GPUs"

    def path(self, group: list[int], share: int) -> Path:
        """The ring of ``group`` (device ids); ``share``: groups of the same collective with a
        device on one chip (they share its links)."""
        s = self.system
        if s.kind == "gpu":
            nodes = {d // s.node_size for d in group}
            if len(nodes) == 1:
                return Path(len(group), s.nvlink_bandwidth, s.hop_latency, False, where="NVLink")
            return Path(len(group), s.network_bandwidth, s.network_latency, False, where="network")
        dpc = s.devices_per_chip
        chips = np.asarray(group) // dpc
        distinct = sorted(set(chips.tolist()))
        on_chip = len(group) // len(distinct)
        if len(distinct) == 1:
            return Path(1, s.device_hbm_bandwidth, 0.0, True, on_chip, "on chip")
        coords = np.array(np.unravel_index(np.asarray(distinct), self.shape, order="F")).T
        spans = []
        for d, length in enumerate(self.shape):
            n, stride = _positions(coords[:, d], length)
            if n > 1:
                spans.append((d, n, stride))
        bandwidth = min(s.link_bandwidth / (stride * share) for _, _, stride in spans)
        latency = s.hop_latency * max(stride for _, _, stride in spans)
        if len(spans) == 1:
            d, n, stride = spans[0]
            ring = n * stride == self.shape[d] and self.wraps[d]
            where = (
                f"torus dim {d} ({'ring' if ring else 'line'} of {n}{f', every {stride}th chip' if stride > 1 else ''})"
            )
            return Path(n, bandwidth, latency, ring, on_chip, where)
        dims = [d for d, _, _ in spans]
        if self.multi_axis == "ring":
            return Path(len(distinct), bandwidth, latency, True, on_chip, f"one ring through torus dims {dims}")
        # Dimension by dimension, each carrying its share of the data at once (scaling-book:
        # bytes / (W_bidirectional x axes)); a dimension without wrap-around is a line, half a
        # ring's bandwidth. Latency: the longest path, half of each ring, all of each line.
        per_dim = [s.link_bandwidth / (st * share) * (1.0 if self._wraps(d, n, st) else 0.5) for d, n, st in spans]
        steps = sum(math.ceil((n - 1) / 2) if self._wraps(d, n, st) else n - 1 for d, n, st in spans)
        return Path(len(distinct), sum(per_dim), latency, True, on_chip, f"torus dims {dims}", steps)

    def _wraps(self, d: int, n: int, stride: int) -> bool:
        return n * stride == self.shape[d] and self.wraps[d]

    def time(self, kind: str, groups: list[list[int]], nbytes: float) -> tuple[float, Path]:
        """Seconds for one run of a collective whose groups are ``groups`` (all its groups: they
        run at once), each device contributing ``nbytes``. A group over several slices runs in two
        levels: within each slice over ICI, and across the slices over the data-centre network,
        each of its ``k`` devices in a slice carrying ``1/k`` of the data there (an all-reduce: a
        slice's all-reduce, then one of ``nbytes / k`` across the slices; an all-gather: across
        the slices, then within each of ``nbytes`` times the slices; a reduce-scatter: within,
        then across of ``nbytes / k``)."""
        per = self.slice_devices
        spanned = sorted({d // per for d in groups[0]}) if kind != "collective-permute" else [0]
        if len(spanned) > 1:
            return self._across_slices(kind, groups, nbytes, len(spanned))
        return self._in_slice(kind, [[d % per for d in g] for g in groups], nbytes)

    def _across_slices(self, kind: str, groups: list[list[int]], nbytes: float, slices: int) -> tuple[float, Path]:
        per, s = self.slice_devices, self.system
        local = [[d % per for d in g if d // per == g[0] // per] for g in groups]
        k = len(local[0])
        bandwidth = s.dcn_bandwidth / s.devices_per_chip  # each device's share of its chip's network
        within, across = {
            "all-reduce": (nbytes, nbytes / k),
            "all-gather": (nbytes * slices, nbytes),
            "reduce-scatter": (nbytes, nbytes / k),
        }.get(kind, (nbytes, nbytes))
        t = ring_time(kind, slices, across, bandwidth, s.dcn_latency, False)
        where = f"DCN ({slices} slices)"
        if k > 1:
            t += self._in_slice(kind, local, within)[0]
            where += f" and within each, {k} devices"
        return t, Path(slices, bandwidth, s.dcn_latency, False, where=where)

    def _in_slice(self, kind: str, groups: list[list[int]], nbytes: float) -> tuple[float, Path]:
        group = groups[0]
        if kind == "collective-permute":  # a halo exchange between neighbours of ``group``
            s = self.system
            if s.kind == "gpu":
                one_node = len({d // s.node_size for d in group}) == 1
                bw, lat = (s.nvlink_bandwidth, s.hop_latency) if one_node else (s.network_bandwidth, s.network_latency)
            else:
                bw, lat = s.link_bandwidth / max(1, s.devices_per_chip), s.hop_latency
            return ring_time(kind, 2, nbytes, bw, lat, False), Path(2, bw, lat, False, where="neighbour")
        dpc = self.system.devices_per_chip
        chip_of = group[0] // dpc
        share = sum(1 for g in groups if any(d // dpc == chip_of for d in g)) if dpc > 1 else 1
        path = self.path(group, share)
        t = 0.0
        if path.on_chip > 1:  # the chip's own devices combine first, at HBM speed
            t += ring_time(kind, path.on_chip, nbytes, self.system.device_hbm_bandwidth, 0.0, False)
            if kind == "all-gather":
                nbytes *= path.on_chip
        if path.chips > 1:
            t += ring_time(kind, path.chips, nbytes, path.bandwidth, path.latency, path.bidirectional, path.steps)
        return t, path
