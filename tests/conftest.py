"""Eight CPU devices for the whole test session, set before JAX starts its backends.

XLA:CPU contracts ``a * b + c`` into a fused multiply-add wherever the two ops land in one fused
loop, and which ops land together differs between two programs that compute the same thing (the
replicated and the sharded update, say). That changes the last bit of some results. The suite
therefore compiles for a CPU without FMA instructions (``--xla_cpu_max_isa=AVX``), so equality
tests can ask for bit-identity; ``PODSCALE_TEST_FMA=1`` keeps the default ISA instead, and the
tests that need bit-identity then fall back to a bound of a few ulps (see ``FMA_OFF``).
"""

import atexit
import os
import shutil
import tempfile

FMA_OFF = os.environ.get("PODSCALE_TEST_FMA") != "1"
if FMA_OFF and "xla_cpu_max_isa" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_max_isa=AVX").strip()
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# Many tests compile the same program (a workload's single-device step, say) from a new function
# object, which jit's in-memory cache does not recognise. JAX's persistent compilation cache keys
# on the program itself, so one session compiles each program once. One directory serves the whole
# session: both xdist workers (the controller makes it before it starts them, and they inherit the
# variable) and the CLI runs the tests start as subprocesses (through JAX's own variables; a
# killed-and-resumed run compiles its step once). Reads and writes hold the cache's file lock
# (eviction on, with a limit no session reaches), so one process never reads an entry another is
# still writing. (Compiling without LLVM's optimizations would take a third off the in-process
# tests, but it changes float results: the tiny Mask R-CNN's steps left their 1e-5 bounds.)
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
