"""A multi-process program's first launch, once every process has compiled it.

On CPU, JAX's collectives between processes go over gloo, and XLA sets up the gloo context of a
new group of devices (a mesh axis, or all of them) when the first program that uses it runs. That
set-up waits 30 s for the other processes, a limit XLA gives no option for: a process that
reaches it more than 30 s before another fails with ``Gloo context initialization failed:
DEADLINE_EXCEEDED`` and the run ends. Each process compiles a program on its own before it first
runs it, so two processes reach that set-up apart by the difference of their compile times: seen
in CI (two processes of a two-core machine's test run, a third process compiling beside them),
where process 0 waited in vain for process 1 still compiling the first step. A coordination
service barrier between compiling and the first launch ends that race; it waits as long as the
slowest compile, and a process that dies meanwhile is named by the heartbeats as at any other time.

One process: nothing is added (no barrier, no extra lowering).
"""

from __future__ import annotations

import itertools

import jax

from podscale._jax import jax_distributed

COMPILE_WAIT_S = 1800
"""How long a process that has compiled a program waits for the others to compile it too."""

_barriers = itertools.count()
"""Every process passes the same barriers in the same order (each runs the same programs), so a
barrier's number names the same one on every process."""


def launch_together(launched: set, key, jitted, args: tuple, what: str):
    """``jitted``, after :func:`compiled_together` the first time ``key`` (a program's batch
    signature) is launched; ``launched`` is the caller's record of the keys launched so far."""
    if key not in launched:
        compiled_together(jitted, args, what)
        launched.add(key)
    return jitted


def compiled_together(jitted, args: tuple, what: str) -> None:
    """Compiles ``jitted`` for ``args`` (``jax.jit`` reuses it at the call) and, with several
    processes, returns once every process has compiled its own: its first launch then starts
    on all of them together."""
    if jax.process_count() == 1:
        return
    jitted.lower(*args).compile()
    # This process's programs still in flight (the state's placement, the batch's) end first: no
    # two programs' collectives are in flight at once when the new one sets up its device groups.
    jax.block_until_ready(args)
    wait_for_every_process(f"compiled {what}")


def wait_for_every_process(what: str, timeout_s: int = COMPILE_WAIT_S) -> None:
    """Returns once every process of the run has called this with the same ``what``, in the
    same order; raises a ``RuntimeError`` naming ``what`` after ``timeout_s``."""
    client = jax_distributed.global_state.client
    if client is None:  # several processes without jax.distributed: nothing to wait on
        return
    name = f"podscale/{next(_barriers)}/{what}"
    try:
        client.wait_at_barrier(name, timeout_s * 1000)
    except Exception as e:  # jaxlib's JaxRuntimeError: DEADLINE_EXCEEDED, or a barrier named differently
        raise RuntimeError(
            f"process {jax.process_index()} of {jax.process_count()}: not every process {what} within "
            f"{timeout_s} s ({str(e).splitlines()[0][:200]}); every process must run the same programs "
            "in the same order"
        ) from e
