"""TensorBoard event files of a run with ``--workdir`` (``WORKDIR/tensorboard``, tensorboardX's
writer, process 0 only): each step's metrics (``train/loss``, ``train/accuracy``, ...), the learning
rate (``train/learning_rate``, where it is constant: the flag's or the default; an MLPerf recipe's
schedule logs its peak once as ``train/peak_learning_rate``), ``train/examples_per_s``, each
evaluation's metrics (``eval/...``), and at the end the run's goodput (``goodput/fraction``,
``goodput/<part>_s``, ``goodput/mfu`` where the device's peak is known)."""

from __future__ import annotations

import glob
import os
import struct
from typing import Any

SKIP = ("step", "examples", "time_s")


class Board:
    """Writes a run's scalars; every method does nothing without a directory."""

    def __init__(self, directory: str | None, learning_rate: float | None = None, constant: bool = True):
        self.writer = None
        if directory is None:
            return
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(logdir=directory, flush_secs=10)
        self.learning_rate = learning_rate
        if learning_rate is not None and not constant:
            self.writer.add_scalar("train/peak_learning_rate", learning_rate, 0)
            self.learning_rate = None

    @staticmethod
    def at(workdir: str | None) -> str | None:
        return os.path.join(workdir, "tensorboard") if workdir else None

    def scalar(self, tag: str, value: float | None, step: int) -> None:
        if self.writer is not None and value is not None:
            self.writer.add_scalar(tag, float(value), step)

    def record(self, entry: dict[str, Any]) -> None:
        """A line of ``metrics.jsonl``: a step's metrics or an evaluation's."""
        if self.writer is None:
            return
        step = entry["step"]
        if "eval" in entry:
            for k, v in entry["eval"].items():
                if isinstance(v, int | float):
                    self.scalar(f"eval/{k}", v, step)
            return
        for k, v in entry.items():
            if k not in SKIP and isinstance(v, int | float):
                self.scalar(f"train/{k}", v, step)
        self.scalar("train/learning_rate", self.learning_rate, step)

    def goodput(self, record: dict[str, Any], step: int) -> None:
        self.scalar("goodput/fraction", record["goodput"], step)
        for part, seconds in record["seconds"].items():
            self.scalar(f"goodput/{part}_s", seconds, step)
        self.scalar("goodput/mfu", record["mfu"], step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def read(directory: str) -> dict[str, list[tuple[int, float]]]:
    """The scalars of every event file in ``directory``, by tag: ``[(step, value), ...]`` in file
    order (TFRecord framing: length, its CRC, the ``Event`` proto, its CRC; CRCs not checked)."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*"))):
        with open(path, "rb") as f:
            data = f.read()
        at = 0
        while at + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out
