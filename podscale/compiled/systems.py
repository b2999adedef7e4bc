"""The systems ``podscale project`` projects to: each figure with where it comes from.

A *chip* is what the system counts (a TPU chip, a GPU); a *device* is what JAX counts. They differ
on TPU v3 only, where each of a chip's two TensorCores is its own JAX device (TPU v4 and v5p join
their two cores into one "megacore" device; v5e has one core). Per-chip figures are divided evenly
between a chip's devices.

Sources, cited per figure below:

* [SB-TPU] jax-ml/scaling-book, "How to Think About TPUs" (tpus.md, section "TPU Specs"): HBM,
  HBM bandwidth and bf16 FLOP/s per chip, ICI bandwidth per link (one-way), pod topologies, and
  the wrap-around rules ("TPU Networking": v4/v5p cubes of 4x4x4 get optical wrap-around links,
  smaller slices none; v5e/v6e wrap along any axis of 16).
* [SB-SHARD] jax-ml/scaling-book, "Sharded Matrices" (sharding.md): "Each hop over an ICI link has
  some intrinsic overhead regardless of the data volume. This is typically around 1us."
* [SB-GPU] jax-ml/scaling-book, "How to Think About GPUs" (gpus.md): HBM, bandwidth and bf16
  FLOP/s per GPU; NVLink per GPU one way (A100 300 GB/s, H100/H200 450 GB/s); 8 GPUs per node;
  one 400 Gb/s NIC per H100 GPU (50 GB/s).
* [BG] ../shared/background.md, "Public hardware figures": TPU v3 123 TFLOP/s bf16 per chip (the
  scaling-book table gives 1.4e14; Google's Cloud TPU documentation gives 123), the 4096-chip
  v3 multipod as a 128x32 mesh with wrap-around only along the 32-long dimension.
* [NV-A100], [NV-H100]: NVIDIA's A100 and H100 datasheets (dense bf16 312 / 989 TFLOP/s; TF32
  156 / 494.5 TFLOP/s dense, which XLA uses for float32 matrix products on these GPUs by default).
  [NV-DGXA100]: DGX A100 user guide: eight 200 Gb/s HDR InfiniBand NICs, one per GPU (25 GB/s).
* Latencies that no public source states for these links are marked *assumed* where they are set.
"""

from __future__ import annotations

import dataclasses
import math

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class System:
    name: str
    description: str
    kind: str
    """``tpu`` (chips on a torus), ``gpu`` (NVLink nodes on a network) or ``measured`` (this machine)."""
    peak_flops: float
    """Dense bf16 matrix FLOP/s per chip."""
    peak_flops_f32: float
    """Matrix FLOP/s per chip for float32 operands (TPU: the bf16 rate, as XLA's default precision
    runs float32 products in one bf16 pass; GPU: TF32)."""
    hbm_bytes: float
    hbm_bandwidth: float
    """HBM bytes/s per chip."""
    max_chips: int
    devices_per_chip: int = 1
    link_bandwidth: float = 0.0
    """TPU: one-way bytes/s of one ICI link (a chip has two links per torus dimension)."""
    hop_latency: float = 1e-6
    """Seconds per hop (TPU ICI, GPU NVLink step)."""
    torus_dims: int = 2
    node_size: int = 8
    """GPU: GPUs per NVLink domain (node)."""
    nvlink_bandwidth: float = 0.0
    """GPU: one-way NVLink bytes/s per GPU."""
    network_bandwidth: float = 0.0
    """GPU: one-way network bytes/s per GPU (its own NIC)."""
    network_latency: float = 5e-6
    """GPU: seconds per step of a ring over the network (assumed)."""
    overlaps: bool = True
    """Whether a collective can run while compute continues (async collectives)."""
    sources: tuple[str, ...] = ()

    @property
    def devices_max(self) -> int:
        return self.max_chips * self.devices_per_chip

    def device_peak(self, dtype: str) -> float:
        per_chip = self.peak_flops_f32 if dtype in ("f32", "f64") else self.peak_flops
        return per_chip / self.devices_per_chip

    @property
    def device_hbm_bandwidth(self) -> float:
        return self.hbm_bandwidth / self.devices_per_chip

    @property
    def device_hbm_bytes(self) -> float:
        return self.hbm_bytes / self.devices_per_chip

    def torus(self, chips: int) -> tuple[tuple[int, ...], tuple[bool, ...]]:
        """The slice shape for ``chips`` (chips along each torus dimension) and which dimensions
        wrap around. Raises for a count the system cannot hold or has no slice for."""
        if self.kind != "tpu":
            raise ValueError(f"system {self.name!r} is not a torus")
        if chips > self.max_chips:
            raise ValueError(
                f"--chips {chips}: system {self.name!r} holds at most {self.max_chips} chips; "
                "choose fewer chips or another system (podscale project --list-systems)"
            )
        if chips < 1 or chips & (chips - 1):
            raise ValueError(f"--chips {chips}: {self.name!r} slices are powers of two; choose 16, 32, 64, ...")
        try:
            return _SLICES[self.name](chips)
        except ValueError as e:
            raise ValueError(f"--chips {chips}: system {self.name!r} has no such slice ({e})") from None


def _square(chips: int, dims: int, largest: int) -> tuple[int, ...]:
    """The most cubic power-of-two shape with ``dims`` dimensions, none longer than ``largest``,
    ascending (the longest dimension last)."""
    shape = [1] * dims
    i = 0
    while math.prod(shape) < chips:
        shape[i % dims] *= 2
        i += 1
    shape.sort()
    if shape[-1] > largest:
        raise ValueError(f"{chips} chips do not fit {dims}-D slices of at most {largest} per dimension")
    return tuple(shape)


def _v3(chips: int):
    if chips > 1024:  # the v0.7 multipod: 128x32 with wrap-around along the 32 only [BG]
        return (chips // 32, 32), (False, True)
    shape = _square(chips, 2, 32)
    return shape, tuple(d == 32 for d in shape)  # assumed as on v5e: only a full pod axis wraps


def _cube(largest: tuple[int, ...]):
    def slices(chips: int):
        shape = _square(chips, 3, max(largest))
        if any(d > m for d, m in zip(shape, sorted(largest), strict=True)):
            raise ValueError(f"{chips} chips do not fit a {largest} torus")
        whole_cubes = all(d % 4 == 0 for d in shape)  # optical wrap-around on multiples of 4x4x4 [SB-TPU]
        return shape, (whole_cubes,) * 3

    return slices


def _v5e(chips: int):
    shape = _square(chips, 2, 16)
    return shape, tuple(d == 16 for d in shape)  # "wraparounds along any axis of size 16" [SB-TPU]


_SLICES = {
    "tpu-v3": _v3,
    "tpu-v4": _cube((16, 16, 16)),
    "tpu-v5p": _cube((16, 20, 28)),
    "tpu-v5e": _v5e,
    "tpu-v6e": _v5e,  # 16x16 pods, wrap-around along any axis of 16, as v5e [SB-TPU]
}

SYSTEMS: dict[str, System] = {
    s.name: s
    for s in (
        System(
            "tpu-v3",
            "TPU v3: 2 cores per chip (2 JAX devices), 2-D torus, 1024-chip pod; the 4096-chip multipod 128x32",
            "tpu",
            peak_flops=123e12,
            peak_flops_f32=123e12,
            hbm_bytes=32 * GiB,
            hbm_bandwidth=900e9,
            max_chips=4096,
            devices_per_chip=2,
            link_bandwidth=1e11,
            hop_latency=1e-6,
            torus_dims=2,
            sources=(
                "[BG] 123 TFLOP/s, 32 GiB at 900 GB/s",
                "[SB-TPU] ICI 1e11 B/s one way",
                "[SB-SHARD] 1 us per hop",
            ),
        ),
        System(
            "tpu-v4",
            "TPU v4: one megacore device per chip, 3-D torus of 4x4x4 cubes, 4096 chips",
            "tpu",
            peak_flops=275e12,
            peak_flops_f32=275e12,
            hbm_bytes=32e9,
            hbm_bandwidth=1.2e12,
            max_chips=4096,
            link_bandwidth=4.5e10,
            torus_dims=3,
            sources=("[SB-TPU] 2.75e14 FLOP/s, 32 GB at 1.2e12 B/s, ICI 4.5e10 B/s one way", "[SB-SHARD] 1 us per hop"),
        ),
        System(
            "tpu-v5p",
            "TPU v5p: one megacore device per chip, 3-D torus of 4x4x4 cubes, up to 16x20x28 chips",
            "tpu",
            peak_flops=459e12,
            peak_flops_f32=459e12,
            hbm_bytes=96e9,
            hbm_bandwidth=2.8e12,
            max_chips=8960,
            link_bandwidth=9e10,
            torus_dims=3,
            sources=("[SB-TPU] 4.59e14 FLOP/s, 96 GB at 2.8e12 B/s, ICI 9e10 B/s one way", "[SB-SHARD] 1 us per hop"),
        ),
        System(
            "tpu-v5e",
            "TPU v5e: one core per chip, 2-D torus, 256-chip pod (16x16)",
            "tpu",
            peak_flops=197e12,
            peak_flops_f32=197e12,
            hbm_bytes=16e9,
            hbm_bandwidth=8.1e11,
            max_chips=256,
            link_bandwidth=4.5e10,
            torus_dims=2,
            sources=("[SB-TPU] 1.97e14 FLOP/s, 16 GB at 8.1e11 B/s, ICI 4.5e10 B/s one way", "[SB-SHARD] 1 us per hop"),
        ),
        System(
            "tpu-v6e",
            "TPU v6e (Trillium): one core per chip, 2-D torus, 256-chip pod (16x16)",
            "tpu",
            peak_flops=918e12,
            peak_flops_f32=918e12,
            hbm_bytes=32e9,
            hbm_bandwidth=1.6e12,
            max_chips=256,
            link_bandwidth=9e10,
            torus_dims=2,
            sources=("[SB-TPU] 9.2e14 FLOP/s, 32 GB at 1.6e12 B/s, ICI 9e10 B/s one way", "[SB-SHARD] 1 us per hop"),
        ),
        System(
            "a100",
            "NVIDIA A100 80GB SXM: 8 per NVLink node, one 200 Gb/s InfiniBand NIC per GPU",
            "gpu",
            peak_flops=312e12,
            peak_flops_f32=156e12,
            hbm_bytes=80e9,
            hbm_bandwidth=2.0e12,
            max_chips=4096,
            nvlink_bandwidth=300e9,
            network_bandwidth=25e9,
            sources=(
                "[NV-A100] 312 TFLOP/s bf16, 156 TF32 (dense)",
                "[SB-GPU] 80 GB at 2.0e12 B/s, NVLink 300 GB/s each way",
                "[NV-DGXA100] 25 GB/s network per GPU",
                "latencies assumed: 1 us per NVLink step, 5 us per network step",
            ),
        ),
        System(
            "h100",
            "NVIDIA H100 80GB SXM: 8 per NVLink node, one 400 Gb/s NIC per GPU",
            "gpu",
            peak_flops=989e12,
            peak_flops_f32=494.5e12,
            hbm_bytes=80e9,
            hbm_bandwidth=3.35e12,
            max_chips=4096,
            nvlink_bandwidth=450e9,
            network_bandwidth=50e9,
            sources=(
                "[NV-H100] 989 TFLOP/s bf16, 494.5 TF32 (dense), 3.35 TB/s",
                "[SB-GPU] 80 GB, NVLink 450 GB/s each way, 50 GB/s network per GPU",
                "latencies assumed: 1 us per NVLink step, 5 us per network step",
            ),
        ),
        System(
            "h200",
            "NVIDIA H200 141GB SXM: 8 per NVLink node, one 400 Gb/s NIC per GPU",
            "gpu",
            peak_flops=989e12,
            peak_flops_f32=494.5e12,
            hbm_bytes=141e9,
            hbm_bandwidth=4.8e12,
            max_chips=4096,
            nvlink_bandwidth=450e9,
            network_bandwidth=50e9,
            sources=(
                "[SB-GPU] 9.9e14 FLOP/s bf16, 141 GB at 4.8e12 B/s, NVLink 450 GB/s each way (Hopper), 50 GB/s network",
                "[NV-H100] TF32 494.5 TFLOP/s (the same Hopper tensor cores)",
                "latencies assumed: 1 us per NVLink step, 5 us per network step",
            ),
        ),
    )
}


def get(name: str) -> System:
    try:
        return SYSTEMS[name]
    except KeyError:
        raise ValueError(f"--system {name!r}: unknown system; choose one of {', '.join(SYSTEMS)}") from None
