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
* [SB-TPU-C] jax-ml/scaling-book, tpus.md, "Appendix B: How does a systolic array work?" and
  "Appendix C: TPU internals": the MXU is a 128x128 systolic array (256x256 on v6e) fed
  ``bf16[8,128]`` LHS tiles ("weight matrices need to be padded to at least size 128 (256 on TPU
  v6) in all dimensions"); 2 MXUs per TensorCore on v3, 4 on v4/v5; the VPU is an (8, 128) array
  of lanes with 2 ALUs per lane on v4 ("2048 floating point adders") and 4 on v5 ("add 4 pairs of
  f32 values ... each cycle"), one elementwise op per ALU per cycle; VPU work is done in f32.
  The clock is not in that table: it follows from the chip's bf16 peak, its MXUs and their size
  (``peak / (cores x MXUs x side^2 x 2)``: v3 0.94 GHz, v4 1.05 GHz, v5e 1.5 GHz, as the page
  states for v5e, v5p and v6e 1.75 GHz).
* [GC-V5P], [GC-V5E]: Google Cloud TPU documentation, "TPU v5p" and "TPU v5e" (cloud.google.com/
  tpu/docs/v5p, /v5e): v5p's data-centre network (DCN) bandwidth per chip, 50 Gbps, and its largest
  slice, 6144 chips; v5e's DCN bandwidth per 256-chip pod, 6.4 Tbps (2 x 100 Gbps NICs per host of 8
  chips). The v6e page gives no DCN figure: v6e is projected to one slice (256 chips) only. The
  Gbps are taken one way.
* [NV-MM] NVIDIA, "Matrix Multiplication Background User's Guide" (docs.nvidia.com/deeplearning/
  performance): Tensor Cores are used most efficiently when M, N and K are multiples of 8 for
  16-bit operands (tile quantization below that).
* [NV-CUDA] NVIDIA CUDA C++ Programming Guide, "Arithmetic Instructions" throughput table: 16
  results per clock per SM for 32-bit reciprocal, rsqrt, log2, exp2, sine, cosine (compute
  capability 8.0 and 9.0); 64 (8.0) and 128 (9.0) FP32 add/multiply per clock per SM. With the
  datasheets' SM counts and boost clocks (A100: 108 SMs, 1.41 GHz; H100/H200 SXM: 132 SMs,
  1.98 GHz).

Latencies that no public source states for these links are marked *assumed* where they are set. So
are three figures of each chip that no vendor publishes: the fraction of the HBM's peak a kernel
streams at (and the size at which it reaches half of that), the fixed cost of starting one fused
kernel, and (TPU) the transcendental unit's rate. Each of them has a range
(:attr:`System.assumed`), and ``podscale project`` gives each row's step time at both ends of the
ranges beside its figure at the nominal values: the uncertainty they leave is shown, not tuned away.
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
    slice_chips: int = 0
    """TPU: the most chips one slice holds (ICI); more are several slices joined by the
    data-centre network (multislice). 0: ``max_chips``."""
    dcn_bandwidth: float = 0.0
    """TPU: one-way bytes/s per chip over the data-centre network between slices; 0: no public
    figure (several slices are not projected)."""
    dcn_latency: float = 10e-6
    """TPU: seconds per step of a ring over the data-centre network (assumed)."""
    overlaps: bool = True
    """Whether a collective can run while compute continues (async collectives)."""
    sources: tuple[str, ...] = ()
    matmul_tile: tuple[int, int, int] = (1, 1, 1)
    """The granularity (m, n, k) a matrix unit works in: a product ``[m, k] @ [k, n]`` is charged
    for its dimensions rounded up to these (TPU: the LHS's 8 rows, the systolic array's side for
    the contracted and output dimensions; GPU: the Tensor Cores' multiples of 8)."""
    vector_rate: float = 0.0
    """Elementwise operations per second per chip on the vector units (TPU VPU, GPU CUDA cores;
    0: elementwise work is bound by its bytes only)."""
    transcendental_rate: float = 0.0
    """Transcendental results (exp, log, tanh, logistic, rsqrt, sqrt, power, divide) per second
    per chip (TPU: the EUP, assumed; GPU: the SFUs); 0: at ``vector_rate``."""
    hbm_efficiency: float = 1.0
    """The fraction of ``hbm_bandwidth`` a large streaming kernel reaches (assumed)."""
    half_bandwidth_bytes: float = 0.0
    """Bytes at which a kernel's stream reaches half of the achievable bandwidth (assumed): an op
    of ``b`` bytes streams at ``hbm_efficiency * hbm_bandwidth * b / (b + half_bandwidth_bytes)``."""
    kernel_overhead: float = 0.0
    """Seconds of fixed cost per fused kernel: its launch and pipeline fill (assumed)."""
    scalar_op_cycles: float = 0.0
    """TPU: clock cycles of an op of the core's scalar unit (a result XLA:TPU keeps in the scalar
    memory: loop counters, replica indices, random keys), in place of a kernel's start and
    bytes; 0: such ops are charged as kernels."""
    clock: float = 0.0
    """Hz of the chip's cores (TPU: from the bf16 peak, see [SB-TPU-C]); 0: not used."""
    cited: tuple[tuple[str, str], ...] = ()
    """(field, source) for each figure of the chip: where it comes from."""
    assumed: tuple[tuple[str, float, float], ...] = ()
    """(field, low, high): the range of each figure no public source states; the field's own
    value is the nominal one."""

    @property
    def devices_max(self) -> int:
        return self.max_chips * self.devices_per_chip

    def device_peak(self, dtype: str) -> float:
        per_chip = self.peak_flops_f32 if dtype in ("f32", "f64") else self.peak_flops
        return per_chip / self.devices_per_chip

    @property
    def device_hbm_bandwidth(self) -> float:
        return self.hbm_bandwidth / self.devices_per_chip

    def device_rate(self, field: str) -> float:
        """A per-chip rate (``vector_rate``, ``transcendental_rate``) per device."""
        return getattr(self, field) / self.devices_per_chip

    def at(self, end: str) -> System:
        """This system with every assumed figure at one end of its range: ``fast`` (the end that
        makes a step quicker) or ``slow``."""
        if end not in ("fast", "slow"):
            raise ValueError(f"end {end!r}: choose fast or slow")
        slower_when_larger = {
            "kernel_overhead",
            "scalar_op_cycles",
            "half_bandwidth_bytes",
            "hop_latency",
            "network_latency",
            "dcn_latency",
        }
        values = {}
        for field, low, high in self.assumed:
            values[field] = (
                (high if end == "slow" else low) if field in slower_when_larger else (low if end == "slow" else high)
            )
        return dataclasses.replace(self, **values)

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


def _tpu_chip(cores: int, mxus: int, side: int, alus: int, peak: float, mxu_source: str, alu_source: str) -> dict:
    """The per-op figures of a TPU chip (see [SB-TPU-C]): the clock from the bf16 peak, the VPU's
    ``(8, 128)`` lanes times ``alus`` per lane per core, the transcendental unit assumed at one
    result per lane per cycle (1/8 to 2), the assumed HBM efficiency and fixed costs, and an op of
    the scalar unit assumed at 1 to 20 cycles (its VLIW bundles issue scalar ops every cycle, as
    Norrie et al., IEEE Micro 2021, describe TPU v2/v3's core)."""
    clock = peak / (cores * mxus * side * side * 2)
    lanes = cores * 8 * 128 * clock
    return dict(
        matmul_tile=(8, side, side),
        clock=clock,
        vector_rate=lanes * alus,
        transcendental_rate=lanes,
        hbm_efficiency=0.85,
        half_bandwidth_bytes=128 * 2**10,
        kernel_overhead=1e-6,
        scalar_op_cycles=1.0,
        cited=(
            ("matmul_tile", f"{mxu_source}: LHS tiles of 8 rows, a {side}x{side} systolic array"),
            ("vector_rate", f"{alu_source}: {cores} core(s) x 8x128 lanes x {alus} ALUs x {clock / 1e9:.3g} GHz"),
            ("clock", f"{clock / 1e9:.3g} GHz = peak / ({cores} cores x {mxus} MXUs x {side}^2 x 2)"),
        ),
        assumed=(
            ("transcendental_rate", lanes / 8, lanes * 2),
            ("hbm_efficiency", 0.7, 0.95),
            ("half_bandwidth_bytes", 32 * 2**10, 512 * 2**10),
            ("kernel_overhead", 0.3e-6, 3e-6),
            ("scalar_op_cycles", 1.0, 20.0),
            ("hop_latency", 0.5e-6, 2e-6),
        ),
    )


def _dcn(chip: dict, source: str) -> dict:
    """A TPU chip's figures with its data-centre network's: the bandwidth cited, the latency of a
    step over it assumed (5 to 50 us; no public figure)."""
    return {
        **chip,
        "cited": (*chip["cited"], ("dcn_bandwidth", source)),
        "assumed": (*chip["assumed"], ("dcn_latency", 5e-6, 50e-6)),
    }


def _gpu_chip(sms: int, fp32_per_sm: int, clock: float, source: str) -> dict:
    """The per-op figures of an NVIDIA GPU: Tensor Core granularity [NV-MM], CUDA cores and SFUs
    per SM [NV-CUDA] at the boost clock, and the assumed HBM efficiency and fixed costs."""
    return dict(
        matmul_tile=(8, 8, 8),
        vector_rate=sms * fp32_per_sm * clock,
        transcendental_rate=sms * 16 * clock,
        hbm_efficiency=0.85,
        half_bandwidth_bytes=2**20,
        kernel_overhead=3e-6,
        cited=(
            ("matmul_tile", "[NV-MM] M, N, K in multiples of 8 for 16-bit Tensor Core products"),
            (
                "vector_rate",
                f"[NV-CUDA] {sms} SMs x {fp32_per_sm} FP32 results per clock x {clock / 1e9:.3g} GHz ({source})",
            ),
            (
                "transcendental_rate",
                f"[NV-CUDA] {sms} SMs x 16 SFU results per clock x {clock / 1e9:.3g} GHz ({source})",
            ),
        ),
        assumed=(
            ("hbm_efficiency", 0.7, 0.95),
            ("half_bandwidth_bytes", 256 * 2**10, 4 * 2**20),
            ("kernel_overhead", 1e-6, 6e-6),
            ("hop_latency", 0.5e-6, 2e-6),
            ("network_latency", 2e-6, 10e-6),
        ),
    )


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
            **_tpu_chip(
                2,
                2,
                128,
                2,
                123e12,
                "[SB-TPU-C]",
                "[SB-TPU-C] (v4's 2 ALUs per lane, as Hot Chips 2020 gives TPU v2/v3's 2048 vector ALUs per core)",
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
            **_tpu_chip(2, 4, 128, 2, 275e12, "[SB-TPU-C]", "[SB-TPU-C] v4: 2 ALUs per lane"),
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
            slice_chips=6144,
            dcn_bandwidth=50e9 / 8,
            sources=("[SB-TPU] 4.59e14 FLOP/s, 96 GB at 2.8e12 B/s, ICI 9e10 B/s one way", "[SB-SHARD] 1 us per hop"),
            **_dcn(
                _tpu_chip(2, 4, 128, 4, 459e12, "[SB-TPU-C]", "[SB-TPU-C] v5: 4 ALUs per lane"),
                "[GC-V5P] 50 Gbps of DCN bandwidth per chip; the largest slice 6144 chips (96 cubes)",
            ),
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
            slice_chips=256,
            dcn_bandwidth=6.4e12 / 8 / 256,
            sources=("[SB-TPU] 1.97e14 FLOP/s, 16 GB at 8.1e11 B/s, ICI 4.5e10 B/s one way", "[SB-SHARD] 1 us per hop"),
            **_dcn(
                _tpu_chip(1, 4, 128, 4, 197e12, "[SB-TPU-C]", "[SB-TPU-C] v5: 4 ALUs per lane"),
                "[GC-V5E] 6.4 Tbps of DCN bandwidth per 256-chip pod (2 x 100 Gbps NICs per 8-chip host): 25 Gbps per chip",
            ),
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
            **_tpu_chip(
                1,
                4,
                256,
                4,
                918e12,
                "[SB-TPU-C] v6e: 256x256 (4 MXUs assumed as v5e)",
                "[SB-TPU-C] v5's 4 ALUs per lane, assumed on v6e",
            ),
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
            **_gpu_chip(108, 64, 1.41e9, "A100 SXM datasheet"),
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
            **_gpu_chip(132, 128, 1.98e9, "H100 SXM datasheet"),
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
            **_gpu_chip(132, 128, 1.98e9, "H200 SXM: the H100's Hopper SMs"),
        ),
    )
}


_PER_OP = (
    "matmul_tile",
    "vector_rate",
    "transcendental_rate",
    "hbm_efficiency",
    "half_bandwidth_bytes",
    "kernel_overhead",
    "scalar_op_cycles",
    "hop_latency",
    "network_latency",
    "dcn_bandwidth",
    "dcn_latency",
)


def figures(system: System) -> list[tuple[str, str, str]]:
    """(field, value, source) of each per-op and latency figure of ``system``: its citation, or
    ``assumed, range LOW to HIGH`` (the chip's peak, memory and links are cited in
    ``system.sources``)."""
    cited, assumed = dict(system.cited), {f: (lo, hi) for f, lo, hi in system.assumed}
    out = []
    for field in _PER_OP:
        if field == "network_latency" and system.kind != "gpu":
            continue
        if field.startswith("dcn_") and not system.dcn_bandwidth:
            continue
        if field == "scalar_op_cycles" and not system.scalar_op_cycles:
            continue
        value = getattr(system, field)
        if field in assumed:
            lo, hi = assumed[field]
            source = f"assumed, range {lo:.3g} to {hi:.3g}"
        else:
            source = cited.get(field) or next((s for s in system.sources if "latenc" in s or "hop" in s), "-")
        out.append((field, value if isinstance(value, tuple) else f"{value:.4g}", source))
    if "clock" in cited:
        out.append(("clock", "-", cited["clock"]))
    return out


def get(name: str) -> System:
    try:
        return SYSTEMS[name]
    except KeyError:
        raise ValueError(f"--system {name!r}: unknown system; choose one of {', '.join(SYSTEMS)}") from None
