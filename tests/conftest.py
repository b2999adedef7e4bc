"""Eight CPU devices for the whole test session, set before JAX starts its backends.

XLA:CPU contracts ``a * b + c`` into a fused multiply-add wherever the two ops land in one fused
loop, and which ops land together differs between two programs that compute the same thing (the
replicated and the sharded update, say). That changes the last bit of some results. The suite
therefore compiles for a CPU without FMA instructions (``--xla_cpu_max_isa=AVX``), so equality
tests can ask for bit-identity; ``PODSCALE_TEST_FMA=1`` keeps the default ISA instead, and the
tests that need bit-identity then fall back to a bound of a few ulps (see ``FMA_OFF``).

The tests' own programs are small, so compiling them takes longer than running them: the suite
compiles with LLVM's optimizations off (``--xla_backend_optimization_level=0``, about 40% off a
compile, steps run 3x slower) and with XLA:CPU's loop emitters in place of its MLIR fusion
emitters (``--xla_cpu_use_fusion_emitters=false``: on the tiny GNMT's and Mask R-CNN's steps,
another 35-45% off each compile at that level; steps ran 1x to 1.6x as long). Every program a test
compares is compiled with these flags; the last bits of a result can differ from the default
level's, which moves a step that is discontinuous at roundoff (the tiny Mask R-CNN's: its
equality tests run in float64). The CLI runs the tests start as subprocesses inherit the flags;
the few that train for hundreds of steps (the time-to-target runs) take XLA's default emitters at
LLVM's level 1 and the machine's whole ISA instead, through ``helpers.long_run_env``."""

import atexit
import gc
import importlib.util
import os
import shutil
import tempfile

import pytest

# XLA's flags for the long CLI runs (helpers.long_run_env), before the suite's own (the user's, with
# the machine's whole ISA: they compare no bits, and run as the documented commands do). Set once,
# by the first process of the session (xdist's workers and the CLI runs inherit the suite's flags).
os.environ.setdefault("PODSCALE_TEST_LONG_RUN_XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
# A test process holds millions of objects (JAX's traces and caches, flax modules); Python's
# default thresholds (700, 10, 10) then spend about 8% of a test file's time in full collections
# (tests/test_workloads.py: 22 s of 256 CPU-seconds, 37 full collections). Collecting the young
# generation every 50,000 allocations: 6 s, 2 full collections, 10% less CPU, 1.28 GB peak memory
# for 1.05.
gc.set_threshold(50_000, 20, 100)
FMA_OFF = os.environ.get("PODSCALE_TEST_FMA") != "1"
if FMA_OFF and "xla_cpu_max_isa" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_max_isa=AVX").strip()
for _flag in ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
# Every process of the session (the xdist workers, the CLI runs) starts through startup/
# sitecustomize.py, which spares JAX's shared compilation cache its eviction scan on every write;
# this process, already started, loads it here (before JAX).
_STARTUP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "startup")
if _STARTUP not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_STARTUP, os.environ.get("PYTHONPATH")) if p)
    _spec = importlib.util.spec_from_file_location("_podscale_test_startup", os.path.join(_STARTUP, "sitecustomize.py"))
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
import jax  # noqa: E402

import podscale  # noqa: E402, F401  (keeps JAX on the CPU where libtpu is installed without a TPU)

# Many tests compile the same program (a workload's single-device step, say) from a new function
# object, which jit's in-memory cache does not recognise. JAX's persistent compilation cache keys
# on the program itself, so one session compiles each program once. One directory serves the whole
# session's test processes: both xdist workers (the controller makes it before it starts them, and
# they inherit the variable) and the CLI runs the tests start (through JAX's own variables), which
# compile with the same flags: the cache's key reads XLA_FLAGS as it is when the key is made. The
# long runs compile with other flags and keep a directory of their own. Reads and writes hold
# the cache's file lock (eviction on, with a limit no session reaches), so one process never reads
# an entry another is still writing; the eviction's scan of the whole directory on each write is
# skipped (startup/sitecustomize.py).
_CACHE = os.environ.get("PODSCALE_TEST_XLA_CACHE")
if not _CACHE or not os.path.isdir(_CACHE):
    _CACHE = os.environ["PODSCALE_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="podscale-test-xla-cache-")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
_SETTINGS = {
    "jax_compilation_cache_dir": _CACHE,
    "jax_persistent_cache_min_compile_time_secs": 0,
    "jax_persistent_cache_min_entry_size_bytes": 0,
    "jax_compilation_cache_max_size": 64 * 2**30,
}
for _name, _value in _SETTINGS.items():
    jax.config.update(_name, _value)
    os.environ[_name.upper()] = str(_value)
jax.config.update("jax_num_cpu_devices", 8)

FULL_CONFIGS = os.environ.get("PODSCALE_TEST_FULL_CONFIGS") == "1"
"""Compiling a workload's full config takes a minute or more on two cores: those tests are the
benchmarks' (docs/benchmarks.md lists them with this command), and the suite holds the same rules
on the tiny configs. ``PODSCALE_TEST_FULL_CONFIGS=1 pytest -m full_config`` runs them."""


def pytest_collection_modifyitems(config, items):
    if FULL_CONFIGS:
        return
    skip = pytest.mark.skip(reason="full-config compile (a benchmark): PODSCALE_TEST_FULL_CONFIGS=1 runs it")
    for item in items:
        if item.get_closest_marker("full_config"):
            item.add_marker(skip)
