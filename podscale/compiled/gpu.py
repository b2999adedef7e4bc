"""XLA:GPU without a GPU: JAX's CUDA plugin's compile-only devices, for ``podscale project``.

``pip install 'podscale[gpu-compile]'`` installs JAX's CUDA PJRT plugin (``jax-cuda12-pjrt`` and
``jax-cuda12-plugin``, pinned to podscale's jax; about 480 MB, no CUDA libraries and no driver).
With it, ``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...,
topology="1x2x8")`` gives the compile-only devices of a GPU cluster (slices x hosts x GPUs per
host; the plugin accepts any shape: one node of 8, many nodes) on a machine with no GPU, and
``jax.jit(f).lower(...).compile()`` over a ``Mesh`` of them runs XLA:GPU here: the module, with its
fusions, its cuBLAS and cuDNN calls, its NCCL collectives and its schedule, is XLA:GPU's for
those devices. Nothing is executed.

What differs from a compile on a real GPU (JAX's ``tests/aot_test.py::test_deviceless_aot_compile``
is the same flow, with the config read from a device):

- The device is described by a hand-written target config (:func:`target_config`, from the
  figures in :data:`SPECS`), not read from the driver. XLA:GPU reads from it the SM count, clock,
  shared memory, registers, L2, memory size and bandwidth (fusion, tiling and scheduling
  decisions and its cost model) and the compute capability (which kernels and which cuDNN and
  cuBLAS paths exist).
- Nothing is autotuned: there is no device to time candidates on. XLA picks its default gemm and
  convolution algorithms, where a GPU's compile times the candidates (Triton against cuBLAS, tile
  sizes) and keeps the fastest.
- Triton gemm fusions are off (:data:`COMPILER_OPTIONS`, passed to each compile here only): without
  autotuning, XLA:GPU's Triton gemm emitter has no tiling to take and refuses some programs
  outright (transformer-big: ``Couldn't find output tile sizes that satisfy hlo``); with it off,
  every matrix product is a cuBLAS call (``__cublas$lt$matmul``), as XLA falls back to on a GPU
  when Triton loses the autotuning. openxla/xla#25919's deviceless example sets the same flag.

Without a GPU on the host, the plugin checks the CUDA libraries when JAX starts and fails (it
then registers nothing); :func:`podscale.compiled.tpu.quiet_platforms` (when podscale is imported)
keeps JAX on the CPU there, which skips that check and still registers the plugin's compiler.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

from podscale.compiled.systems import System

MISSING = (
    "JAX's CUDA plugin is not installed: costing XLA:CPU's module instead of XLA:GPU's "
    "(pip install 'podscale[gpu-compile]' for the GPU compiler's)"
)
"""``compiler="auto"``'s one line where the plugin is missing: it goes on with XLA:CPU's module."""
NEEDED = (
    "XLA:GPU needs JAX's CUDA plugin, which is not installed; install the gpu-compile extra: "
    "pip install 'podscale[gpu-compile]' (in a checkout: .venv/bin/pip install -e '.[gpu-compile]')"
)
"""The refusal where XLA:GPU was asked for by name (``--compiler gpu``) and the plugin is missing."""
LABEL = "XLA:GPU"
"""The compiler's name in a row (``XLA:GPU h100:2x8``) and in progress lines."""
CHECKS_MEMORY = False
"""XLA:GPU compiles for a GPU without checking its memory: the row compares its peak with the datasheet's."""

COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False}
"""XLA options of each compile for a compile-only GPU (passed to ``Lowered.compile``, so that they
apply to these compiles alone): Triton gemm off, as there is no device to autotune its tiling on
(see the module's docstring)."""


@dataclasses.dataclass(frozen=True)
class Spec:
    """One GPU's figures for XLA:GPU's target config (``stream_executor.GpuTargetConfigProto``)."""

    name: str  # the driver's name of the device
    sms: int
    fp32_per_sm: int  # FP32 CUDA cores per SM
    clock_ghz: float  # boost clock
    memory_bytes: int  # as the driver reports it (the datasheet's "80 GB" less what it reserves)
    bandwidth: float  # HBM bytes/s
    l2_bytes: int
    shared_per_sm: int  # shared memory per SM, bytes
    shared_per_block_optin: int  # a block's shared memory when it opts in, bytes
    capability: tuple[int, int]  # CUDA compute capability
    sources: tuple[str, ...]


# Sources:
# [NV-A100-WP] NVIDIA A100 Tensor Core GPU Architecture (whitepaper, 2020): 108 SMs, 64 FP32 cores
#   per SM, 1410 MHz boost, 40 MB L2, up to 164 KB shared memory per SM, compute capability 8.0.
# [NV-A100-DS] NVIDIA A100 Tensor Core GPU datasheet: 80GB HBM2e, 2,039 GB/s (SXM).
# [NV-H100-WP] NVIDIA H100 Tensor Core GPU Architecture (whitepaper, 2022): H100 SXM5 132 SMs,
#   128 FP32 cores per SM, 50 MB L2, up to 228 KB shared memory per SM, compute capability 9.0.
# [NV-H100-DS] NVIDIA H100 Tensor Core GPU datasheet: H100 SXM 80 GB, 3.35 TB/s.
# [NV-H200-DS] NVIDIA H200 Tensor Core GPU datasheet: 141 GB HBM3e, 4.8 TB/s; the H100's Hopper die.
# [CUDA-PG] CUDA C++ Programming Guide, "Technical Specifications per Compute Capability": 1024
#   threads per block, 2048 threads and 64K 32-bit registers per SM, 64K per block, 48 KB static
#   shared memory per block, opt-in 163 KB (8.0) and 227 KB (9.0) per block.
# [XLA-SPECS] openxla/xla xla/backends/gpu/target_config/specs/{a100_sxm_80,h100_sxm,h200}.txtpb
#   (configs read from real devices): the memory sizes the driver reports, the 1.98 GHz clock of
#   the H100 and H200 SXM (the whitepaper leaves it open), and a check of every other figure.
SPECS = {
    "a100": Spec(
        "NVIDIA A100-SXM4-80GB",
        sms=108,
        fp32_per_sm=64,
        clock_ghz=1.41,
        memory_bytes=85_100_068_864,
        bandwidth=2.039e12,
        l2_bytes=40 * 2**20,
        shared_per_sm=164 * 2**10,
        shared_per_block_optin=163 * 2**10,
        capability=(8, 0),
        sources=("[NV-A100-WP]", "[NV-A100-DS]", "[CUDA-PG]", "[XLA-SPECS] a100_sxm_80: memory size"),
    ),
    "h100": Spec(
        "NVIDIA H100 80GB HBM3",
        sms=132,
        fp32_per_sm=128,
        clock_ghz=1.98,
        memory_bytes=84_942_979_072,
        bandwidth=3.35e12,
        l2_bytes=50 * 2**20,
        shared_per_sm=228 * 2**10,
        shared_per_block_optin=227 * 2**10,
        capability=(9, 0),
        sources=("[NV-H100-WP]", "[NV-H100-DS]", "[CUDA-PG]", "[XLA-SPECS] h100_sxm: memory size, clock"),
    ),
    "h200": Spec(
        "NVIDIA H200 141GB HBM3e",
        sms=132,
        fp32_per_sm=128,
        clock_ghz=1.98,
        memory_bytes=151_397_597_184,
        bandwidth=4.8e12,
        l2_bytes=50 * 2**20,
        shared_per_sm=228 * 2**10,
        shared_per_block_optin=227 * 2**10,
        capability=(9, 0),
        sources=("[NV-H200-DS]", "[NV-H100-WP]", "[CUDA-PG]", "[XLA-SPECS] h200: memory size, clock"),
    ),
}

RUNTIME = (12, 8)
"""The CUDA runtime the config names (the plugin's CUDA 12 build; as XLA's H100 spec)."""
CUDNN = (9, 8)
"""The cuDNN the config names: the oldest jax-cuda12-plugin 0.10.2 accepts (``nvidia-cudnn-cu12>=9.8``),
so no cuDNN fusion newer than a real install's is assumed."""


def available() -> bool:
    """Whether JAX's CUDA plugin is installed (XLA:GPU can compile here)."""
    try:
        return (
            importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
            and importlib.util.find_spec("jax_cuda12_plugin") is not None
        )
    except (ImportError, ValueError):
        return False


def target_config(system_name: str) -> str:
    """XLA:GPU's device description of ``system_name``'s GPU, as the text of a
    ``GpuTargetConfigProto`` (the fields jaxlib 0.10.2's proto reads: jax#28376's form, with
    openxla/xla#25919's ``runtime_version``)."""
    if system_name not in SPECS:
        raise ValueError(f"system {system_name!r}: no GPU target config (GPU systems: {', '.join(SPECS)})")
    s = SPECS[system_name]
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {s.shared_per_sm}
  threads_per_core_limit: 2048
  core_count: {s.sms}
  fpus_per_core: {s.fp32_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(s.bandwidth)}
  l2_cache_size: {s.l2_bytes}
  clock_rate_ghz: {s.clock_ghz}
  device_memory_size: {s.memory_bytes}
  shared_memory_per_block_optin: {s.shared_per_block_optin}
  cuda_compute_capability {{
    major: {s.capability[0]}
    minor: {s.capability[1]}
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{
  major: {CUDNN[0]}
  minor: {CUDNN[1]}
}}
runtime_version {{
  major: {RUNTIME[0]}
  minor: {RUNTIME[1]}
}}
device_description_str: "{s.name}"
"""


def topology_name(system: System, chips: int) -> str:
    """The compile-only cluster of ``chips`` GPUs of ``system``: ``h100:1x8`` (one node of 8),
    ``h100:4x8`` (4 nodes of ``system.node_size``), ``h100:1x2`` (2 GPUs of one node)."""
    if system.name not in SPECS:
        raise ValueError(f"system {system.name!r}: no GPU target config (GPU systems: {', '.join(SPECS)})")
    nodes = chips // system.node_size if chips > system.node_size and chips % system.node_size == 0 else 1
    return f"{system.name}:{nodes}x{chips // nodes}"


@functools.cache
def devices(system_name: str, name: str) -> tuple:
    """The compile-only devices of ``name`` (:func:`topology_name`), in id order (a node's GPUs
    fastest, as :mod:`podscale.compiled.network` places a mesh)."""
    if not available():
        raise ValueError(NEEDED)
    from jax.experimental import topologies

    nodes, per_node = (int(d) for d in name.split(":")[1].split("x"))
    try:
        found = topologies.get_topology_desc(
            platform="cuda", target_config=target_config(system_name), topology=f"1x{nodes}x{per_node}"
        ).devices
    except Exception as e:  # the plugin is installed but did not register (JAX started with CUDA and failed)
        raise ValueError(
            f"XLA:GPU: JAX's CUDA plugin gives no compile-only devices ({type(e).__name__}: {e}); on a machine "
            "without a GPU, start with JAX_PLATFORMS=cpu (importing podscale before JAX sets it)"
        ) from e
    return tuple(sorted(found, key=lambda d: d.id))
