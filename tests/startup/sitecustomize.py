"""Run at the start of every Python process of the test session (conftest.py puts this folder
first on ``PYTHONPATH``, so the xdist workers and the CLI runs the tests start load it too).

The session's processes share one JAX persistent compilation cache, with eviction on so that
reads and writes hold its file lock (conftest.py). JAX's LRU cache then scans the whole cache
directory on every write to find what to evict: a ``stat`` and a read of an access-time file per
entry, under the lock the other processes wait on. The session writes thousands of entries, so the
writes cost O(entries) each and the session O(entries^2); measured on three test files with two
workers, 13% of the CPU time. The session never reaches its limit (64 GiB), so the scan is
skipped: the lock stays, eviction never happens.

The patch is applied when ``jax._src.lru_cache`` is first imported, so a process that never
imports JAX (the MLPerf compliance checker) pays nothing for it.
"""

import importlib.abc
import importlib.util
import sys

_MODULE = "jax._src.lru_cache"


def _no_eviction_scan(self, *, additional_size: int = 0) -> None:
    del self, additional_size


def patch(module) -> None:
    module.LRUCache._evict_if_needed = _no_eviction_scan


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


if _MODULE in sys.modules:
    patch(sys.modules[_MODULE])
else:
    sys.meta_path.insert(0, _PatchOnImport())
