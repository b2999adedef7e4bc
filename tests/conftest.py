"""Eight CPU devices for the whole test session, set before JAX starts its backends.

XLA:CPU contracts ``a * b + c`` into a fused multiply-add wherever the two ops land in one fused
loop, and which ops land together differs between two programs that compute the same thing (the
replicated and the sharded update, say). That changes the last bit of some results. The suite
therefore compiles for a CPU without FMA instructions (``--xla_cpu_max_isa=AVX``), so equality
tests can ask for bit-identity; ``PODSCALE_TEST_FMA=1`` keeps the default ISA instead, and the
tests that need bit-identity then fall back to a bound of a few ulps (see ``FMA_OFF``).
"""

import os

FMA_OFF = os.environ.get("PODSCALE_TEST_FMA") != "1"
if FMA_OFF and "xla_cpu_max_isa" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_max_isa=AVX").strip()
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
