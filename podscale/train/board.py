"""TensorBoard event files of a run with ``--workdir`` (``WORKDIR/tensorboard``, tensorboardX's
writer, process 0 only): each step's metrics (``train/loss``, ``train/accuracy``, ...), the learning
rate (``train/learning_rate``, where it is constant: the flag's or the default; an MLPerf recipe's
schedule logs its peak once as ``train/peak_learning_rate``), ``train/examples_per_s``, each
evaluation's metrics (``eval/...``), and at the end the run's goodput (``goodput/fraction``,
``goodput/<part>_s``, ``goodput/mfu`` where the device's peak is known)."""

from __future__ import annotations

import contextlib
import glob
import os
import struct
import time
from typing import Any

from podscale.train.config import write_error

SKIP = ("step", "examples", "time_s")
EVENT_FILES = "events.out.tfevents.*"
"""The names of TensorBoard's event files."""


class Board:
    """Writes a run's scalars; every method does nothing without a directory."""

    def __init__(self, directory: str | None, learning_rate: float | None = None, constant: bool = True):
        self.writer = None
        self.directory = directory
        if directory is None:
            return
        # tensorboardX's own event writer, written in this thread (its SummaryWriter queues events
        # for a thread of its own, which its flush does not wait for): a flush is on disk when it
        # returns, and a write the disk refuses fails here, where it can be reported.
        from tensorboardX.event_file_writer import EventsWriter

        with self._writing():
            os.makedirs(directory, exist_ok=True)
            self.writer = EventsWriter(os.path.join(directory, "events"))
        self.learning_rate = learning_rate
        if learning_rate is not None and not constant:
            self.scalar("train/peak_learning_rate", learning_rate, 0)
            self.learning_rate = None

    @staticmethod
    def at(workdir: str | None) -> str | None:
        return os.path.join(workdir, "tensorboard") if workdir else None

    @contextlib.contextmanager
    def _writing(self):
        """A write that the system refuses (a full disk) is a :class:`~podscale.train.config.WriteError`
        naming the folder; the writer is dropped, so closing it does not fail again."""
        try:
            yield
        except OSError as e:
            self.writer = None
            raise write_error(f"the TensorBoard events in {self.directory}", e) from None

    def scalar(self, tag: str, value: float | None, step: int) -> None:
        if self.writer is not None and value is not None:
            from tensorboardX.proto.event_pb2 import Event
            from tensorboardX.summary import scalar

            event = Event(wall_time=time.time(), step=int(step), summary=scalar(tag, float(value)))
            with self._writing():
                self.writer.write_event(event)

    def flush(self) -> None:
        """Writes what the writer holds to the event file: at each checkpoint and evaluation, so a
        run killed after it (``kill -9``) keeps its points up to there, as ``metrics.jsonl`` does."""
        if self.writer is not None:
            with self._writing():
                self.writer.flush()

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
            writer, self.writer = self.writer, None
            with self._writing():
                writer.close()


def read(directory: str) -> dict[str, list[tuple[int, float]]]:
    """The scalars of every event file (``events.out.tfevents.*``) in ``directory``, by tag:
    ``[(step, value), ...]`` in file order (TFRecord framing: length, its CRC, the ``Event`` proto,
    its CRC; CRCs not checked). Other files are not event files and are left alone. A torn last
    record (a run killed or a disk that filled mid-write) is skipped, as TensorBoard skips it; a
    damaged record before the end, or a folder that does not exist, is a ``ValueError`` naming it."""
    from google.protobuf.message import DecodeError
    from tensorboardX.proto.event_pb2 import Event

    if not os.path.isdir(directory):
        raise ValueError(
            f"{directory}: no such folder of TensorBoard event files (a run writes them to WORKDIR/tensorboard)"
        )
    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(glob.glob(os.path.join(glob.escape(directory), EVENT_FILES))):
        if not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            data = f.read()
        at = 0
        while at < len(data):
            end = at + 12 + (struct.unpack("<Q", data[at : at + 8])[0] if at + 8 <= len(data) else 0)
            if at + 12 > len(data) or end + 4 > len(data):
                break  # the last record, torn: written in part
            try:
                event = Event.FromString(data[at + 12 : end])
            except DecodeError as e:
                raise ValueError(
                    f"{path}: the record at byte {at} is damaged ({e}); it is not the last, torn one TensorBoard "
                    "skips, so the file is not an event file podscale can read"
                ) from None
            at = end + 4
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out
