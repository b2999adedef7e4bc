"""Tables for people, on a terminal of any width or piped to a file: numbers are never cut.

rich fits a table to the console (80 columns when piped) by wrapping and then cutting cells
with an ellipsis, which turns ``25,557,032`` into ``25,55…``. Here numbers and names never wrap,
long text folds, and a table that still does not fit is printed at the width it needs (a narrow
terminal wraps its lines, but every figure is whole).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable

from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text


def table(*columns: str, title: str | None = None, numbers: tuple[str, ...] = (), text: tuple[str, ...] = ()) -> Table:
    """A table whose ``numbers`` columns are right-aligned and whole, ``text`` columns fold, and
    the others (names) stay whole."""
    t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False)
    for name in columns:
        if name in text:
            t.add_column(name, overflow="fold", ratio=1)
        else:
            t.add_column(name, no_wrap=True, justify="right" if name in numbers else "left")
    return t


def show(renderable: Table, console: Console | None = None) -> None:
    """Prints ``renderable`` no narrower than its narrowest whole rendering."""
    console = console or Console()
    folding = [c for c in renderable.columns if not c.no_wrap]
    for column in renderable.columns:
        if column.no_wrap:  # as wide as its widest cell: rich would cut it otherwise
            cells = [column.header, *column._cells]
            column.min_width = max(Text.from_markup(c).cell_len if isinstance(c, str) else 1 for c in cells)
    saved = [c.max_width for c in folding]
    for c in folding:  # folding text can be narrow: measure it at 10 columns
        c.max_width = 10
    need = Measurement.get(console, console.options.update_width(10_000), renderable).minimum
    for c, m in zip(folding, saved, strict=True):
        c.max_width = m
    width = console.width
    if need <= width:
        console.print(renderable)
        return
    console.width = need
    try:
        console.print(renderable)
    finally:
        console.width = width


def size(n: float) -> str:
    """Bytes with a binary unit, never more than 9 characters (``1.50 MiB``)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def elapsed(since: float) -> str:
    s = time.perf_counter() - since
    return f"{s:.1f} s" if s < 600 else f"{s / 60:.1f} min"


@contextlib.contextmanager
def heartbeat(progress: Callable[[str], None] | None, message: str, every: float):
    """Calls ``progress`` with ``message`` and the time so far every ``every`` seconds until the
    block ends (a compile for thousands of devices runs for minutes without a word)."""
    if progress is None or not every or every <= 0:
        yield
        return
    done = threading.Event()
    start = time.perf_counter()

    def beat():
        while not done.wait(every):
            progress(f"{message} ({elapsed(start)})")

    thread = threading.Thread(target=beat, name="podscale-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


class Ticker:
    """Progress for a stream that is not a terminal (a pipe, a CI log), where rich draws no live
    bar: a plain line, ``PREFIX: message (elapsed)``, at most every ``every_s`` seconds (or at once
    with ``force``), so that a long command never looks hung. On a terminal it prints nothing."""

    def __init__(self, prefix: str, every_s: float = 10.0, enabled: bool = True, stream=None):
        self.stream = stream or sys.stderr
        self.enabled = enabled and not _is_terminal(self.stream)
        self.prefix, self.every_s = prefix, every_s
        self.start, self.last = time.perf_counter(), -float("inf")

    def __call__(self, message: str, force: bool = False) -> None:
        now = time.perf_counter()
        if self.enabled and (force or now - self.last >= self.every_s):
            print(f"{self.prefix}: {message} ({elapsed(self.start)})", file=self.stream, flush=True)
            self.last = now


def _is_terminal(stream) -> bool:
    return bool(getattr(stream, "isatty", lambda: False)())
