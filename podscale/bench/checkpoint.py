"""``podscale bench checkpoint``: what a save of a sharded state costs, asynchronous against
synchronous, for one workload's state on this host's devices.

The state is the workload's (``--model``, ``--config``, its recipe's optimizer), made on the
devices in the stored layout of ``--replicas`` replicas with the sharded weight update, as a run
holds it; nothing is trained. It is saved ``--steps`` times each way (:class:`~podscale.train.
checkpoint.Checkpointer`, each save a new step):

* ``async``: the training loop's stall per save is the time :meth:`Checkpointer.maybe_save` takes
  to return (the saved form made on the devices, its fingerprints, the copy to the host); the
  write and the commit run in the background, waited for before the next save is timed;
* ``sync``: the time until the step is committed on disk.

Memory: a save writes the stored state as it is (``CheckpointForm``: each device's chunks and
split leaves; the weights, which every replica holds whole to train, from one replica each).
``device_state_bytes`` is the most state one device holds (against ``state_bytes``, the whole
state); ``largest_saved_buffer_bytes`` the largest single buffer written; ``save_host_peak_bytes``
the most this process's resident memory grew during a save, sampled every 5 ms, against
``process_shard_bytes``, the bytes of the shards this process writes (one copy of each).
``restored_fingerprints_equal``: the state restored from the last async save has the fingerprints the
saved one had (each leaf's 64-bit fingerprint of its bits, as a restore verifies them).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import threading
import time

import jax

from podscale.parallel.engine import data_parallel
from podscale.parallel.mesh import make_mesh
from podscale.train.checkpoint import Checkpointer, checksums
from podscale.train.saving import CheckpointForm
from podscale.train.tasks import make_task, make_task_optimizer, make_train_step


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeakRSS:
    """The most resident memory grew above its level at the start, sampled every 5 ms."""

    def __enter__(self):
        self.base, self.peak, self._stop = _rss(), 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss() - self.base)
            time.sleep(0.005)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss() - self.base)


def bench_checkpoint(model: str = "transformer-big", config: str = "full", replicas: int | None = None, steps: int = 3):
    from podscale import workloads
    from podscale.parallel import checks

    steps = checks.whole("steps", steps)
    if model not in workloads.NAMES:
        raise ValueError(f"model={model!r}: bench checkpoint takes an MLPerf workload: {', '.join(workloads.NAMES)}")
    if config not in ("full", "tiny"):
        raise ValueError(f"config={config!r}: choose full or tiny")
    n = replicas or jax.device_count()
    if not 1 <= n <= jax.device_count():
        raise ValueError(f"replicas={n}: give 1 to {jax.device_count()}, the devices of this process")
    task = make_task(model, config=config, with_data=False)
    tx = make_task_optimizer(task, None, None, 1000)
    mesh = make_mesh((n,), devices=jax.devices()[:n])
    dp = data_parallel(make_train_step(task, tx), mesh, weight_update="sharded")
    batch = task.batch_shapes(n)
    shapes = task.state_shapes(tx, batch)
    layout = dp.prepare(shapes, batch).state
    # Made on one device and placed (an init replicated over the mesh would run on every device).
    state = jax.jit(lambda: task.init_state(jax.random.key(0), tx, batch))()
    stored = jax.block_until_ready(layout.place(state))
    del state
    form = CheckpointForm(layout)

    shards = [s for x in jax.tree.leaves(stored) for s in x.addressable_shards]
    largest_saved = max(s.data.nbytes for s in shards if s.replica_id == 0)
    process_shards = sum(s.data.nbytes for s in shards if s.replica_id == 0)
    per_device: dict = {}
    for s in shards:
        per_device[s.device] = per_device.get(s.device, 0) + s.data.nbytes
    del shards
    result = {
        "model": model,
        "config": config,
        "replicas": n,
        "state_bytes": int(sum(leaf.bytes for leaf in layout.leaves)),
        "largest_leaf_bytes": int(max(leaf.bytes for leaf in layout.leaves)),
        "largest_saved_buffer_bytes": int(largest_saved),
        "process_shard_bytes": int(process_shards),
        "device_state_bytes": int(max(per_device.values())),
        "saves": steps,
    }
    root = tempfile.mkdtemp(prefix="podscale-bench-checkpoint-")
    try:
        for mode in ("async", "sync"):
            ckpt = Checkpointer(os.path.join(root, mode), every=1, max_to_keep=2, async_save=mode == "async")
            times, peaks = [], []
            for step in range(1, steps + 1):
                with _PeakRSS() as peak:
                    start = time.perf_counter()
                    ckpt.maybe_save(step, stored, form.save_form)
                    times.append(time.perf_counter() - start)
                    ckpt.wait()
                peaks.append(peak.peak)
            ckpt.close()
            result[f"{mode}_stall_s"] = statistics.median(times)
            result[f"{mode}_host_peak_bytes"] = int(max(peaks))
        result["save_host_peak_bytes"] = max(result["async_host_peak_bytes"], result["sync_host_peak_bytes"])
        before = checksums(stored, form.sizes())
        del stored  # the restore makes a second state; two of a full config need not fit this host
        restored = Checkpointer(os.path.join(root, "async"), every=1)
        _, back = restored.restore(form)
        restored.close()
        same = checksums(back, form.sizes()) == before
        del back
        result["restored_fingerprints_equal"] = bool(same)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return result
