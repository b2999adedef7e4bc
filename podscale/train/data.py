"""The per-process input pipeline over a data source (:mod:`podscale.workloads.datasets`).

A *source* is a finite, indexable set of examples: ``len(source)`` and ``source.get(indices)``,
which prepares only the requested rows and returns a dict of numpy arrays. Which examples form the
global batch of step ``s`` is a pure function of ``(seed, s)`` (:func:`batch_indices`), so a run
resumed at step ``s`` sees exactly the batches an uninterrupted run sees.

Each process asks only for its own rows of every global batch (``DataParallelStep.local_rows``),
builds the global array with ``jax.make_array_from_process_local_data``, and a background thread
prepares the next batches while the current step runs (:class:`Loader`).

The *data position* of a run at step ``s`` is the global index, in that stream of examples, of the
next example it feeds: ``s * global_batch`` (:func:`data_position`), whatever the process count
(each process reads its contiguous rows of the same global batch). Checkpoints save it, a resumed
run checks it (:mod:`podscale.train.resume`), and ``metrics.jsonl`` records each step's range.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Iterator

import numpy as np


@functools.lru_cache(maxsize=4)
def _permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def batch_indices(seed: int, step: int, global_batch: int, n: int, rows: slice | None = None) -> np.ndarray:
    """Example indices of rows ``rows`` of the global batch of ``step``: a pure function.

    The stream is epoch after epoch of a fresh permutation of ``range(n)`` seeded by
    ``(seed, epoch)``; step ``s`` takes positions ``s * global_batch ...`` of it.
    """
    rows = rows if rows is not None else slice(0, global_batch)
    positions = step * global_batch + np.arange(rows.start, rows.stop, dtype=np.int64)
    epochs, offsets = np.divmod(positions, n)
    out = np.empty_like(positions)
    for epoch in np.unique(epochs):
        sel = epochs == epoch
        out[sel] = _permutation(seed, int(epoch), n)[offsets[sel]]
    return out


def data_position(step: int, global_batch: int) -> int:
    """The global index of the first example of ``step``'s batch in the example stream (the examples
    fed before it, over all processes)."""
    return step * global_batch


def step_examples(step: int, global_batch: int) -> tuple[int, int]:
    """``[first, last)``: the stream positions of the examples that step ``step`` (0-based) feeds."""
    first = data_position(step, global_batch)
    return first, first + global_batch


class Loader:
    """Yields ``(step, global_batch)`` for ``start_step, start_step + 1, ...``, prefetching.

    Args:
      source: a data source (``len`` and ``get``).
      dp: the ``DataParallelStep`` that says which rows this process feeds and how to place them.
      global_batch: examples per step over all replicas.
      seed: the data-order seed.
      start_step: the first step to load (a resumed run passes its restored step).
      prefetch: how many batches a background thread prepares ahead.
    """

    def __init__(self, source, dp, global_batch: int, seed: int, start_step: int = 0, prefetch: int = 2):
        if global_batch > len(source):
            raise ValueError(f"--batch-size {global_batch} is larger than the data set ({len(source)} examples)")
        self.source, self.dp, self.global_batch, self.seed = source, dp, global_batch, seed
        self.rows = dp.local_rows(global_batch)
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, prefetch))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, args=(start_step,), daemon=True)
        self._thread.start()

    def load(self, step: int):
        idx = batch_indices(self.seed, step, self.global_batch, len(self.source), self.rows)
        return self.dp.place_batch(self.source.get(idx), self.global_batch)

    def _work(self, step: int) -> None:
        try:
            while not self._stop.is_set():
                self._put((step, self.load(step)))
                step += 1
        except BaseException as e:  # surfaced to the consumer, never swallowed
            self._put(e)

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self) -> Iterator:
        while True:
            item = self._queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def padded_eval_batches(source, dp, batch_size: int):
    """The whole of ``source`` in global batches of ``batch_size``, the last one padded.

    Yields global batches with an extra ``mask`` leaf (1 for real examples, 0 for padding), so
    that no example is dropped or counted twice. ``batch_size`` must be a multiple of the
    replica count.
    """
    n = len(source)
    rows = dp.local_rows(batch_size)
    for start in range(0, n, batch_size):
        positions = start + np.arange(rows.start, rows.stop)
        real = positions < n
        local = source.get(np.where(real, positions, 0))
        local["mask"] = real.astype(np.float32)
        yield dp.place_batch(local, batch_size)
