"""Eight CPU devices for the whole test session, set before JAX starts its backends."""

import os

os.environ.setdefault("XLA_FLAGS", "")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
