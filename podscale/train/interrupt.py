"""Preemption and Ctrl-C: stop at a step boundary, save, and say how to continue.

Standard library only, so that the command line can name :class:`Interrupted` before JAX loads.
"""

from __future__ import annotations

import signal
import threading


class Interrupted(Exception):  # noqa: N818 (a request, not an error)
    """SIGTERM or SIGINT stopped the run at a step boundary (after saving, with a workdir)."""

    def __init__(self, step: int, signum: int, saved: bool, processes: int = 1):
        self.step, self.signum, self.saved = step, signum, saved
        name = signal.Signals(signum).name
        if processes > 1:
            name += f" to the run (all {processes} processes stopped at the same step)"
        then = "continue with --resume" if saved else "nothing was saved (no --workdir)"
        super().__init__(f"interrupted by {name} at step {step}; {then}")


class StopRequest:
    """While training, SIGTERM (preemption) and SIGINT (Ctrl-C) ask the loop to stop at the next
    step boundary; in a single-process run a second one acts as usual. Only in the main thread,
    where Python runs signal handlers. (In a multi-process run JAX's handler swallows every
    SIGTERM; podscale's supervisor ends the process on a second signal.)

    In a multi-process run every process must stop at the same step to save one checkpoint
    together: JAX's preemption sync manager (its own SIGTERM handler, installed by
    ``jax.distributed.initialize``) tells the other processes, and
    ``multihost_utils.reached_preemption_sync_point`` agrees on the first step all of them can
    still reach. SIGINT is passed to it as a SIGTERM. Without JAX's preemption service
    (``jax_enable_preemption_service`` off) a multi-process run keeps the signals' usual effect.
    """

    def __init__(self, processes: int = 1, sync: bool = False):
        self.multi = processes > 1
        self.enabled = not self.multi or sync
        self.signum: int | None = None
        self._old: dict = {}

    def _handle(self, signum, frame):
        self.signum = signum
        signal.signal(signum, self._old.get(signum, signal.SIG_DFL))  # the next one is not caught
        if self.multi:
            signal.raise_signal(signal.SIGTERM)  # to JAX's preemption notifier, which tells the others

    def __enter__(self):
        if self.enabled and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT,) if self.multi else (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        return False

    def reached(self, steps_run: int) -> bool:
        """Whether to stop after ``steps_run`` steps of this session (1, 2, ...: every process
        calls this once per step, with the same numbers)."""
        if not self.multi:
            return self.signum is not None
        if not self.enabled:
            return False
        from jax.experimental import multihost_utils

        return multihost_utils.reached_preemption_sync_point(steps_run)

    @property
    def stopped_by(self) -> int:
        """The signal to report: this process's own, else the SIGTERM that reached the run."""
        return self.signum or signal.SIGTERM
