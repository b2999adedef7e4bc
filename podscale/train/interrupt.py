"""Preemption and Ctrl-C: stop at a step boundary, save, and say how to continue.

Standard library only, so that the command line can name :class:`Interrupted` before JAX loads.
"""

from __future__ import annotations

import signal
import threading


class Interrupted(Exception):  # noqa: N818 (a request, not an error)
    """SIGTERM or SIGINT stopped the run at a step boundary (after saving, with a workdir)."""

    def __init__(self, step: int, signum: int, saved: bool):
        self.step, self.signum, self.saved = step, signum, saved
        name = signal.Signals(signum).name
        then = "continue with --resume" if saved else "nothing was saved (no --workdir)"
        super().__init__(f"interrupted by {name} at step {step}; {then}")


class StopRequest:
    """While training, SIGTERM (preemption) and SIGINT (Ctrl-C) ask the loop to stop at the next
    step boundary; a second one acts as usual. Only in the main thread, where Python runs
    signal handlers, and only in a single-process run (``enabled``): processes stopped at
    different steps could not save one checkpoint together, so a multi-process run keeps the
    signals' usual effect (the last periodic checkpoint is the one to resume from)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.signum: int | None = None
        self._old: dict = {}

    def _handle(self, signum, frame):
        self.signum = signum
        signal.signal(signum, self._old.get(signum, signal.SIG_DFL))  # the next one is not caught

    def __enter__(self):
        if self.enabled and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        return False
