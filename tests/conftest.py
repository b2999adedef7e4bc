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
# on the program itself, so one session compiles each program once (about 15% of the suite's
# time). A fresh directory per session, removed at its end; subprocesses do not share it.
_CACHE = tempfile.mkdtemp(prefix="podscale-test-xla-cache-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
