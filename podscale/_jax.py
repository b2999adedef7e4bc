"""podscale's one home for JAX's private names (``jax._src``).

Each has no public equivalent in the pinned JAX (0.10.2); a JAX upgrade that moves one breaks
here, in one file (tests/test_layers.py checks that no other module imports ``jax._src``).
Every module named here is loaded by ``import jax`` itself, so importing this costs nothing.
The private attributes of these modules that podscale reads are read here too, under public names,
so that no other module reads an underscore name of a module it imports (tests/test_layers.py).
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

platform_lowerings = mlir._platform_specific_lowerings
"""The lowering registry's rules per platform (``{platform: {primitive: rule}}``)."""

threefry2x32_lowering_rule = threefry2x32._threefry2x32_lowering_rule
"""threefry2x32's lowering as on accelerators, its rounds unrolled (CPU's own is a rolled loop)."""


def backends_started() -> bool:
    """Whether JAX has started a backend (after which ``jax_platforms`` no longer changes anything).
    Reads the registry without its lock, as ``xla_bridge.backends_are_initialized`` would take it."""
    return bool(xla_bridge._backends)


__all__ = [
    "all_gather_invariant",
    "backends_started",
    "jax_config",
    "jax_distributed",
    "mlir",
    "pe",
    "platform_lowerings",
    "prng",
    "source_info_util",
    "threefry2x32",
    "threefry2x32_lowering_rule",
    "xla_bridge",
]
