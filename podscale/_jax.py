"""podscale's one home for JAX's private names (``jax._src``).

Each has no public equivalent in the pinned JAX (0.10.2); a JAX upgrade that moves one breaks
here, in one file (tests/test_layers.py checks that no other module imports ``jax._src``).
Every module named here is loaded by ``import jax`` itself, so importing this costs nothing.
"""

from jax._src import config as jax_config  # enable_compilation_cache(False): compile-only TPU clients
from jax._src import distributed as jax_distributed  # global_state: whether preemption sync runs
from jax._src import (
    source_info_util,  # the user's frame and name stack of a traced equation
    xla_bridge,  # whether a backend has started (jax_platforms can still change)
)
from jax._src.interpreters import mlir  # the lowering registry: threefry lowered as on accelerators
from jax._src.interpreters import partial_eval as pe  # convert_constvars_jaxpr
from jax._src.lax.parallel import all_gather_invariant  # public lax has no invariant all-gather
from jax._src.random import prng, threefry2x32  # a replica's rows of a threefry draw

__all__ = [
    "all_gather_invariant",
    "jax_config",
    "jax_distributed",
    "mlir",
    "pe",
    "prng",
    "source_info_util",
    "threefry2x32",
    "xla_bridge",
]
