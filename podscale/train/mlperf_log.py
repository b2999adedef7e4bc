"""MLPerf-format run logs through mlperf-logging's ``mllog``, and time to target read from them.

Each run gets its own ``MLLogger`` writing ``:::MLLOG {...}`` lines with the standard keys
(``mllog.constants``) to a file of its own (a resumed run's segment too: ``mllog.1.txt``, ...,
:func:`podscale.train.config.mllog_path`), and keeps the same lines in memory: the time to target that
``podscale train`` prints is computed from the log by :func:`time_to_target`, the way MLPerf
results are scored (``run_start`` to the first ``eval_accuracy`` at or above the target).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterable
from typing import Any

from mlperf_logging.mllog import constants
from mlperf_logging.mllog.mllog import MLLogger

PREFIX = ":::MLLOG "
_counter = iter(range(1 << 62))
_counter_lock = threading.Lock()


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage().lstrip("\n"))


class RunLog:
    """An MLPerf log for one run: ``start``/``end``/``event`` as ``mllog``'s, kept in ``lines`` and
    written to ``path`` when ``write`` (one process of a run writes the file: the trainer's process 0).
    The file is written afresh: ``mode`` ``"w"`` replaces one already there, ``"x"`` (a resumed
    segment's, never an earlier segment's file) refuses it."""

    def __init__(self, path: str | None = None, write: bool = True, mode: str = "w"):
        if mode not in ("w", "x"):
            raise ValueError(f"an MLPerf log is written afresh (mode 'w' or 'x'), got mode {mode!r}")
        self._mode = mode
        with _counter_lock:
            name = f"podscale.mllog.{next(_counter)}"
        self._logger = logging.getLogger(name)
        self._logger.propagate = False
        self._logger.setLevel(logging.INFO)
        self._memory = _Lines()
        self._handlers: list[logging.Handler] = [self._memory]
        self._logger.addHandler(self._memory)
        self.path = path if write else None
        self.running = False  # between run_start and run_stop
        self._ml = MLLogger(logger=self._logger, default_stack_offset=2)

    @property
    def lines(self) -> list[str]:
        return self._memory.lines

    def start(self, key: str, value: Any = None, metadata: dict | None = None) -> None:
        if key == constants.RUN_START:
            self._open_file()
            self.running = True
        self._ml.start(key=key, value=value, metadata=metadata)

    def end(self, key: str, value: Any = None, metadata: dict | None = None) -> None:
        self._ml.end(key=key, value=value, metadata=metadata)
        if key == constants.RUN_STOP:
            self.running = False

    def _open_file(self) -> None:
        """The file gets the run's lines from ``run_start`` on, with the configuration logged
        before it: a run that fails during init (say, on a bad flag) leaves no file behind."""
        if not self.path or len(self._handlers) > 1:
            return
        if os.path.dirname(self.path):
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
        handler = logging.FileHandler(self.path, mode=self._mode)
        handler.stream.write("".join(line + "\n" for line in self.lines))
        handler.flush()
        self._handlers.append(handler)
        self._logger.addHandler(handler)

    def event(self, key: str, value: Any = None, metadata: dict | None = None) -> None:
        self._ml.event(key=key, value=value, metadata=metadata)

    def close(self) -> None:
        for handler in self._handlers:
            self._logger.removeHandler(handler)
            handler.close()


def parse(lines: Iterable[str]) -> list[dict]:
    """The events of an MLPerf log (lines without the ``:::MLLOG`` prefix are skipped)."""
    events = []
    for line in lines:
        at = line.find(PREFIX)
        if at >= 0:
            events.append(json.loads(line[at + len(PREFIX) :]))
    return events


def read(path: str) -> list[dict]:
    with open(path) as f:
        return parse(f)


def _at_least(value, target) -> bool:
    if isinstance(target, dict):  # e.g. Mask R-CNN's {"BBOX": ..., "SEGM": ...}: every key
        return isinstance(value, dict) and all(k in value and value[k] >= t for k, t in target.items())
    return value >= target


def time_to_target(events: list[dict], target) -> dict | None:
    """Seconds from the last ``run_start`` to the first ``eval_accuracy`` >= ``target`` after it
    (a dict target: each of its keys in the logged dict), with that evaluation's value and
    metadata; ``None`` when the target was not reached."""
    starts = [i for i, e in enumerate(events) if e["key"] == constants.RUN_START]
    if not starts:
        raise ValueError("the MLPerf log has no run_start event")
    start = events[starts[-1]]
    for event in events[starts[-1] :]:
        if event["key"] == constants.EVAL_ACCURACY and event["value"] is not None and _at_least(event["value"], target):
            return {
                "seconds": (event["time_ms"] - start["time_ms"]) / 1000.0,
                "value": event["value"],
                "step": event["metadata"].get("step_num"),
                "epoch": event["metadata"].get("epoch_num"),
            }
    return None
