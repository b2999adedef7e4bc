"""XLA:TPU without a TPU: libtpu's compile-only topologies, for ``podscale project`` and ``plan``.

``pip install 'podscale[tpu]'`` installs libtpu (``jax[tpu]``). Its compile-only client gives the
devices of any TPU slice (``jax.experimental.topologies.get_topology_desc``), and
``jax.jit(f).lower(...).compile()`` over a ``Mesh`` of them runs XLA:TPU here, on a machine with no
TPU: the module, its fusions, its collectives and ``memory_analysis()`` are the ones the slice
would run. Nothing is executed.

Without a TPU on the host, libtpu prints initialisation errors when it loads (it looks for the TPU
VM's metadata) and JAX would try it as a backend before falling back to the CPU.
:func:`quiet_platforms` (called when podscale is imported) keeps JAX on the platforms that are
present, and :func:`devices` sets the few variables libtpu reads so that it loads silently, and
alongside other processes that use it (``ALLOW_MULTIPLE_LIBTPU_LOAD``). A host with a TPU is left
alone.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import signal
import sys
import threading

from podscale.compiled.systems import System

MISSING = (
    "libtpu is not installed: costing XLA:CPU's module instead of XLA:TPU's "
    "(pip install 'podscale[tpu]' for the TPU compiler's)"
)
"""``compiler="auto"``'s one line where libtpu is missing: it goes on with XLA:CPU's module."""
NEEDED = (
    "XLA:TPU needs libtpu, which is not installed; install the tpu extra: pip install 'podscale[tpu]' "
    "(in a checkout: .venv/bin/pip install -e '.[tpu]')"
)
"""The refusal where XLA:TPU was asked for by name (``--compiler tpu``) and libtpu is missing."""
LABEL = "XLA:TPU"
"""The compiler's name in a row (``XLA:TPU v3:4x4``) and in progress lines."""
CHECKS_MEMORY = True
"""XLA:TPU refuses a program whose buffers do not fit the chip's memory (its own limit, 31.25 GiB of
v6e's 32 GB): a program it compiled fits, whatever the datasheet's figure says."""

# The compile-only topology of each TPU system: libtpu's name and its options. TPU v4 chips join
# their two TensorCores into one megacore device (as JAX shows a v4 slice); libtpu's compile-only
# v4 topology lists the cores unless asked for megacore.
_TOPOLOGY = {
    "tpu-v3": ("v3", {}),
    "tpu-v4": ("v4", {"chip_config_name": "megacore"}),
    "tpu-v5p": ("v5p", {}),
    "tpu-v5e": ("v5e", {}),
    "tpu-v6e": ("v6e", {}),
}


def available() -> bool:
    """Whether libtpu is installed (XLA:TPU can compile here)."""
    return importlib.util.find_spec("libtpu") is not None


def has_tpu() -> bool:
    """Whether this host has TPU chips: JAX's own check (``jax._src.hardware_utils``, a scan of the
    PCI devices in the standard library alone), read from its file without importing JAX, so that
    a process that never runs JAX (``podscale launch``, a run's supervisors) never loads it."""
    try:
        return _hardware_utils().num_available_tpu_chips_and_device_id()[0] > 0
    except Exception:  # the private module moved: assume a TPU may be there, change nothing
        return True


def _has_nvidia_gpu() -> bool:
    """Whether this host shows an NVIDIA GPU (JAX's check, read as :func:`has_tpu` reads it)."""
    try:
        return bool(_hardware_utils().has_visible_nvidia_gpu())
    except Exception:  # the private module moved: assume a GPU may be there, change nothing
        return True


def _hardware_utils():
    """``jax._src.hardware_utils`` (standard library only), loaded from its file: no ``import jax``
    (tests/test_tpu_project.py checks that the file is where this reads it)."""
    jax_dir = importlib.util.find_spec("jax").submodule_search_locations[0]
    spec = importlib.util.spec_from_file_location(
        "podscale_jax_hardware_utils", os.path.join(jax_dir, "_src", "hardware_utils.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ENV_SET_PLATFORMS = "PODSCALE_SET_JAX_PLATFORMS"
"""Set beside ``JAX_PLATFORMS`` when :func:`quiet_platforms` set that: the processes podscale
starts (``launch``'s, a supervisor's child) get the environment without either, as the user had
it (a child that imports podscale decides again)."""


def quiet_platforms() -> None:
    """With libtpu installed on a host without a TPU, or JAX's CUDA plugin on a host without an
    NVIDIA GPU, and no platform chosen (``JAX_PLATFORMS``), keeps JAX to the CPU unless an
    accelerator that is present has its plugin, so that libtpu's initialisation errors (or the
    CUDA plugin's failed check of its libraries, after which it registers nothing, not even its
    compiler: :mod:`podscale.compiled.gpu`) do not come at every start. Before JAX is imported this
    sets ``JAX_PLATFORMS=cpu``, which JAX reads when it is (a process that never runs JAX never
    loads it for this); after, JAX's setting, unless its backends are already up."""
    if os.environ.get("JAX_PLATFORMS"):
        return
    import importlib.metadata

    plugins = {e.name for e in importlib.metadata.entry_points(group="jax_plugins")} - {"tpu"}
    cuda = {name for name in plugins if name.startswith("xla_cuda")}
    tpu_here = has_tpu() if available() else None  # None: no libtpu
    gpu_here = _has_nvidia_gpu() if cuda else None  # None: no CUDA plugin
    if tpu_here is not False and gpu_here is not False:
        return  # no plugin without its accelerator
    if tpu_here or gpu_here or plugins - cuda:
        return  # an accelerator with its plugin, or another plugin: JAX chooses among the platforms itself
    if "jax" not in sys.modules:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ[ENV_SET_PLATFORMS] = "1"  # launch and the supervisors drop both for their children
        return
    import jax

    from podscale._jax import backends_started

    if jax.config.jax_platforms or backends_started():
        return
    jax.config.update("jax_platforms", "cpu")


def _quiet_libtpu() -> None:
    """The variables libtpu reads at load, set (where unset) so that it loads without a TPU
    silently: no metadata query, one local worker, and several processes may load it."""
    if has_tpu():
        return
    for name, value in (
        ("TPU_SKIP_MDS_QUERY", "1"),
        ("TPU_WORKER_HOSTNAMES", "localhost"),
        ("TPU_ACCELERATOR_TYPE", "v4-8"),  # any valid type: the compile-only topology is named per call
        ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"),
    ):
        os.environ.setdefault(name, value)


OPTIONS_ENV = "LIBTPU_INIT_ARGS"
"""Where a TPU run takes XLA:TPU's options (MaxText's ``LIBTPU_INIT_ARGS``): libtpu reads it when it
loads, and a compile here passes the same options per compile (:func:`compile_options`)."""


def compile_options(text: str | None = None, source: str = OPTIONS_ENV) -> dict[str, str]:
    """XLA:TPU's options in ``LIBTPU_INIT_ARGS``'s form (``text``, default the variable's value):
    ``--name=value`` each, ``--name`` alone meaning ``true``; ``{}`` where there are none. A
    compile on the compile-only devices with them is the module a run with them gets (checked on
    ``v3:4x4``: the same asynchronous collective fusions either way)."""
    text = os.environ.get(OPTIONS_ENV, "") if text is None else text
    options = {}
    for token in text.split():
        name, _, value = token.removeprefix("--").partition("=")
        if not token.startswith("--") or not name:
            raise ValueError(
                f"{source}={text!r}: {token!r} is not an option; write each as --name=value, e.g. "
                "--xla_tpu_enable_async_collective_fusion=true"
            )
        options[name] = value or "true"
    return options


def options_for(devices) -> dict[str, str] | None:
    """The options a compile for ``devices`` (a mesh's, or a sequence) passes: :func:`compile_options`
    for compile-only TPUs (a process may set ``LIBTPU_INIT_ARGS`` after libtpu loaded: ``podscale
    project --libtpu-args``); none elsewhere, and none on a TPU host, whose libtpu applied them."""
    flat = list(devices.devices.flat) if hasattr(devices, "devices") else list(devices)
    if not flat or flat[0].platform != "tpu" or has_tpu():
        return None
    return compile_options() or None


@contextlib.contextmanager
def libtpu_args(text: str | None, source: str = "--libtpu-args"):
    """``LIBTPU_INIT_ARGS`` set to ``text`` (checked: :func:`compile_options`) for the block and
    restored after (``None``: left as it is); yields the options in effect, as text."""
    before = os.environ.get(OPTIONS_ENV)
    if text is not None:
        compile_options(text, source)  # refused before any work
        os.environ[OPTIONS_ENV] = text
    try:
        yield os.environ.get(OPTIONS_ENV, "")
    finally:
        if text is not None:
            if before is None:
                os.environ.pop(OPTIONS_ENV, None)
            else:
                os.environ[OPTIONS_ENV] = before


def topology_name(system: System, chips: int) -> str:
    """libtpu's name of the slice of ``chips`` chips of ``system``: ``v3:4x4``, ``v4:2x2x2``."""
    if system.name not in _TOPOLOGY:
        raise ValueError(f"system {system.name!r}: no TPU topology (TPU systems: {', '.join(_TOPOLOGY)})")
    shape, _ = system.torus(chips)
    return f"{_TOPOLOGY[system.name][0]}:{'x'.join(map(str, shape))}"


@functools.cache
def devices(system_name: str, name: str, slices: int = 1) -> tuple:
    """The compile-only devices of the slice ``name`` (``topology_name``), in id order: a chip's
    cores fastest, then the first torus dimension (the order :mod:`podscale.compiled.network`
    places a mesh in); with ``slices``, of that many such slices joined by the data-centre network
    (libtpu's multislice devices, slice by slice)."""
    if not available():
        raise ValueError(NEEDED)
    _quiet_libtpu()
    from jax.experimental import topologies

    options = dict(_TOPOLOGY[system_name][1])
    shape = [int(d) for d in name.split(":")[1].split("x")] + [1, 1]
    if shape[0] < 2 or shape[1] < 2:  # smaller than a host (2x2x1 chips): the slice is the host
        options["chips_per_host_bounds"] = tuple(min(d, h) for d, h in zip(shape[:3], (2, 2, 1), strict=True))
    with _own_sigterm():
        if slices > 1:
            options["num_slices"] = slices
        found = topologies.get_topology_desc(topology_name=name, platform="tpu", **options).devices
    return tuple(sorted(found, key=lambda d: d.id))


@contextlib.contextmanager
def _own_sigterm():
    """Loading libtpu installs absl's failure handler for SIGTERM, which prints a C++ stack trace
    when a compile is stopped: the process's own disposition is put back (Python's default ends
    it at once, as the shell reports: ``Terminated``, exit code 143)."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
