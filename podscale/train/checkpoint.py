"""Checkpoints of the training state with orbax.

Each process writes only the shards it holds (orbax's sharded ``jax.Array`` support: OCDBT over
tensorstore) of the state as it is stored (:class:`~podscale.train.saving.CheckpointForm`: a
sharded update's flat chunks, a rule's split leaves), so nothing is gathered or reshaped to save;
a restore reads each step in the layout its metadata says it was saved in onto the run's own
placement, and converts it there. Saves are asynchronous: the training loop waits for the copy of
the shards to the host, and orbax writes and commits them in the background; the next save,
:meth:`Checkpointer.close` (the final save's and a preemption save's path) and
:meth:`Checkpointer.latest_step` wait for it. A save is atomic: orbax writes a step into a
temporary directory and renames it when complete, so a crash or a ``kill -9`` mid-save leaves the
previous good checkpoint untouched and never a half-written step that looks finished.

Every step carries a fingerprint of each array (:func:`checksums`: two 32-bit position-weighted
sums of its bits, computed on the devices where its shards lie), keyed by the leaf's pytree path
(``.params['Dense_0']['kernel']``). They go into the step's own metadata (orbax's
``custom_metadata``, in ``STEP/_CHECKPOINT_METADATA``), written inside the temporary directory
with the arrays, so a step that looks complete has them. A restore, onto any mesh, verifies every
leaf against them: a step changed on disk after it was saved (a flipped bit, a bad copy) is
refused with :class:`CheckpointError` naming the step and the leaves, never restored silently.
``restore(fallback=True)`` (``--resume-fallback``) instead sets each damaged newer step aside as
``STEP.damaged`` (orbax ignores it), says so, and restores the newest intact step. A step whose
checksums are missing or unreadable cannot be verified, and is refused as damaged too.

A restore that finds no checkpoint, or one that orbax cannot read, also raises
:class:`CheckpointError` naming the directory and what to do.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import math
import os
import re
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from podscale.train.saving import LAYOUT, CheckpointForm

CHECKSUMS = "podscale_checksums"
"""The key of the per-leaf checksums in a step's orbax ``custom_metadata``."""
RUN_METADATA = "podscale_run"
"""The key of what the run saves beside the state (``maybe_save(metadata=...)``: its data
position) in a step's orbax ``custom_metadata``."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, partial, unreadable or damaged."""


class _Damaged(Exception):
    """One step cannot be restored: ``reason`` (short, for a warning) and ``message`` (the error)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason, self.message = reason, message


_MIX = (0x9E3779B1, 0x7F4A7C15, 0x85EBCA6B, 0xC2B2AE35)


def _words(x):
    """``x``'s bits as a flat vector of ``uint32`` words (one per element of 1, 2 or 4 bytes, two per
    8-byte element; a PRNG key by its key data)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    size = np.dtype(x.dtype).itemsize
    if size >= 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
    word = {1: jnp.uint8, 2: jnp.uint16}[size]
    return jax.lax.bitcast_convert_type(x, word).astype(jnp.uint32).reshape(-1)


def _fmix(h):
    """MurmurHash3's 32-bit finaliser: every input bit moves about half of the output bits."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _mix(u, pos, keep=None):
    """Two sums, over the words ``u`` at global word positions ``pos`` (uint32) that ``keep`` holds
    (all by default), of a non-linear hash of each word with its position (two seeds): changes
    to words cancel in a sum only by chance, about 2**-32 for each of the two."""
    a = _fmix(u ^ _fmix(pos + jnp.uint32(_MIX[0])))
    b = _fmix((u + jnp.uint32(_MIX[1])) ^ _fmix(pos ^ jnp.uint32(_MIX[2])))
    if keep is not None:
        a, b = jnp.where(keep, a, jnp.uint32(0)), jnp.where(keep, b, jnp.uint32(0))
    return jnp.stack([jnp.sum(a, dtype=jnp.uint32), jnp.sum(b, dtype=jnp.uint32)])


def _fingerprint(x, size: int | None = None) -> jax.Array:
    """Two 32-bit sums of the words of ``x``'s first ``size`` elements (all by default; a flat,
    padded chunked leaf's own elements), each word hashed with its position (:func:`_mix`): a
    changed or moved word changes them, but for about 2**-64 of changes. Integer sums are exact in any order, so a leaf's fingerprint is its whole value's however
    it is sharded (:func:`_fingerprints_on_mesh` computes it where the shards lie), and the same
    flat or in its own shape."""
    u = _words(x)
    i = jnp.arange(u.size, dtype=jnp.uint32)
    keep = i < size * (u.size // max(x.size, 1)) if size is not None and size < x.size else None
    return _mix(u, i, keep)


def _linear(axes, mesh) -> tuple[jax.Array, int]:
    """This device's index over mesh ``axes`` taken together (major first), and their size."""
    index, count = jnp.uint32(0), 1
    for a in axes:
        index = index * jnp.uint32(mesh.shape[a]) + jax.lax.axis_index(a).astype(jnp.uint32)
        count *= mesh.shape[a]
    return index, count


def _shard_sums(block, shape: tuple, size: int | None, spec: tuple, mesh):
    """This device's part of :func:`_fingerprint` of an array of ``shape`` whose block under
    ``spec`` it holds: its share of its own block (the devices holding the same block split it
    between them), at the block's global positions. The parts summed over the mesh are the
    fingerprint."""
    gstrides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    used = [a for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry)]
    u = _words(block)
    k = u.size // max(block.size, 1)  # words per element
    r, replicas = _linear([a for a in mesh.axis_names if a not in used], mesh)
    n = u.size
    if replicas > 1 and n % replicas == 0 and n:
        share = n // replicas
        u = jax.lax.dynamic_slice(u.reshape(replicas, share), (r, jnp.uint32(0)), (1, share))[0]
        j = r * jnp.uint32(share) + jnp.arange(share, dtype=jnp.uint32)
    else:  # one device of the block's holders takes it all
        j = jnp.arange(n, dtype=jnp.uint32)
    word, e = j % jnp.uint32(max(k, 1)), j // jnp.uint32(max(k, 1))
    flat = jnp.uint32(0)
    for d in reversed(range(block.ndim)):
        entry = spec[d]
        offset = jnp.uint32(0)
        if entry:
            index, _ = _linear((entry,) if isinstance(entry, str) else entry, mesh)
            offset = index * jnp.uint32(block.shape[d])
        flat = flat + (offset + e % jnp.uint32(block.shape[d])) * jnp.uint32(gstrides[d])
        e = e // jnp.uint32(block.shape[d])
    pos = flat * jnp.uint32(max(k, 1)) + word
    keep = None
    if size is not None and size < math.prod(shape):
        keep = pos < jnp.uint32(size * max(k, 1))
    if replicas > 1 and not (n % replicas == 0 and n):
        keep = (r == 0) if keep is None else keep & (r == 0)
    return _mix(u, pos, keep)


def _fingerprints_on_mesh(leaves: list, sizes: list, shardings: list) -> jax.Array:
    """:func:`_fingerprint` of each of ``leaves`` (``NamedSharding`` arrays on one mesh), computed
    on their shards (:func:`_shard_sums`) in one ``shard_map``, with one sum over the mesh of all
    of them (``[len(leaves), 2]``). One pass over the state in all, each device's temporaries a
    piece of its blocks."""
    mesh = shardings[0].mesh
    specs = [tuple(s.spec) + (None,) * (x.ndim - len(s.spec)) for x, s in zip(leaves, shardings, strict=True)]
    shapes = [x.shape for x in leaves]

    def local(*blocks):
        parts = [_shard_sums(*a, mesh) for a in zip(blocks, shapes, sizes, specs, strict=True)]
        return jax.lax.psum(jnp.stack(parts), tuple(mesh.axis_names))

    in_specs = tuple(P(*spec) for spec in specs)
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P(), check_vma=False)(*leaves)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _fingerprints(state, sizes: tuple, shardings: tuple):
    leaves = jax.tree.leaves(state)
    prints = [None if sharding else _fingerprint(x, n) for x, n, sharding in zip(leaves, sizes, shardings, strict=True)]
    meshes: dict = {}
    for i, sharding in enumerate(shardings):
        if sharding is not None:
            meshes.setdefault(sharding.mesh, []).append(i)
    for group in meshes.values():
        on_mesh = _fingerprints_on_mesh(
            [leaves[i] for i in group], [sizes[i] for i in group], [shardings[i] for i in group]
        )
        for row, i in enumerate(group):
            prints[i] = on_mesh[row]
    return prints


def _where(x) -> NamedSharding | None:
    """``x``'s sharding where its fingerprint is computed on its shards (a mesh array), else None."""
    sharding = getattr(x, "sharding", None)
    keyed = jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    return sharding if isinstance(sharding, NamedSharding) and np.ndim(x) and np.size(x) and not keyed else None


def _legacy_checksums(state) -> dict[str, dict]:
    """SHA-256 of each leaf's bytes on the host, as podscale wrote them before per-shard
    checkpoints (each leaf whole, in its own shape): such a step is still verified on restore."""
    import hashlib

    from jax.experimental import multihost_utils

    sums = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            value = np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
        else:
            value = np.asarray(leaf)
        value = np.require(value, requirements="C")
        sums[jax.tree_util.keystr(path)] = {
            "sha256": hashlib.sha256(value.reshape(-1).view(np.uint8)).hexdigest(),
            "shape": list(value.shape),
            "dtype": str(value.dtype),
        }
    return sums


def checksums(state, sizes=None) -> dict[str, dict]:
    """Each leaf's fingerprint (:func:`_fingerprint`, 16 hex digits; of its first ``sizes[i]``
    elements where given) and dtype, keyed by its pytree path. Computed on the devices where the
    leaves lie (a sharded leaf is never gathered); only the fingerprints come to the host."""
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)]
    leaves = jax.tree.leaves(state)
    sizes = tuple(None for _ in leaves) if sizes is None else tuple(int(n) for n in sizes)
    prints = jax.device_get(_fingerprints(state, sizes, tuple(_where(x) for x in leaves)))
    sums = {}
    for path, leaf, fp in zip(paths, jax.tree.leaves(state), prints, strict=True):
        key = jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
        dtype = jax.random.key_data(leaf).dtype if key else leaf.dtype
        sums[path] = {"fingerprint": f"{int(fp[0]):08x}{int(fp[1]):08x}", "dtype": str(dtype)}
    return sums


def _stored_names(tree) -> dict[str, str]:
    """Each leaf's name in orbax's files (its keys joined by dots: ``opt_state.0.mu.Dense_1.kernel``,
    as orbax's read errors name it) -> its pytree path (``.opt_state[0].mu['Dense_1']['kernel']``)."""
    names = {}
    for path, _ in jax.tree_util.tree_leaves_with_path(tree):
        parts = []
        for key in path:
            for attr in ("key", "idx", "name"):
                if hasattr(key, attr):
                    parts.append(str(getattr(key, attr)))
                    break
        names[".".join(parts)] = jax.tree_util.keystr(path)
    return names


def _quoted(name: str) -> str:
    """A pattern for ``name`` as a whole, as an error message quotes a file path within the step."""
    return rf"(?<![\w.]){re.escape(name)}(?=[/'\"])"


def _orbax():
    """orbax.checkpoint, imported when first used (0.7 s: tensorstore and its handlers), its
    barriers through JAX's coordination service (:func:`.distributed.orbax_barriers`)."""
    import orbax.checkpoint

    from podscale.train.distributed import orbax_barriers

    orbax_barriers()
    return orbax.checkpoint


def _is_late_read(kind, value, tb, through_orbax: bool = True) -> bool:
    """An exception of one of orbax's reads of a step whose restore already failed: the reads
    still running then finish later, in orbax's threads and coroutines. A failed one raises
    through orbax's code (``through_orbax``); one that succeeds hands its result to the event loop
    orbax closed (``call_soon_threadsafe``: "Event loop is closed")."""
    if value is None or not isinstance(value, Exception):  # a KeyboardInterrupt is never hidden
        return False
    files, names = [], []
    while tb is not None:
        files.append(tb.tb_frame.f_code.co_filename)
        names.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    if through_orbax and any(f"{os.sep}orbax{os.sep}" in f for f in files):
        return True
    if through_orbax and any(where in str(value) for where in _failed_steps):
        return True  # a read's error set on its future by tensorstore, no orbax frame: it names the step
    return kind is RuntimeError and str(value) == "Event loop is closed" and "call_soon_threadsafe" in names


class _LateReads(logging.Filter):
    """asyncio's "Task exception was never retrieved" and concurrent.futures' "exception calling
    callback" records of such reads."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and _is_late_read(*record.exc_info))


_LATE_READS = _LateReads()
_late_reads_pending = False
"""A restore failed in this process: its step's late reads may still come."""
_failed_steps: set[str] = set()
"""The folders of the steps whose restore failed in this process (their reads' errors name them)."""


def _excepthook(kind, value, tb):
    """Drops only a reader thread's bare "Event loop is closed": an uncaught exception through
    orbax's code in the main thread is still printed."""
    if not _is_late_read(kind, value, tb, through_orbax=False):
        _excepthook.wraps(kind, value, tb)


def _unraisablehook(unraisable):
    if not _is_late_read(unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback):
        _unraisablehook.wraps(unraisable)


def _quiet_late_reads(on: bool) -> None:
    """While a restore runs and, once it has failed, for the rest of the process, the late reads
    of its step print nothing: each would print a traceback (a bare one from a reader thread, an
    unraisable coroutine's when collected, at exit at the latest, or asyncio's and
    concurrent.futures' log records). The damage is reported once, by :class:`CheckpointError`.
    ``on=False`` (after a restore that succeeded: every read has finished) puts the hooks back."""
    for name, quiet in (("excepthook", _excepthook), ("unraisablehook", _unraisablehook)):
        current = getattr(sys, name)
        if on and current is not quiet:
            quiet.wraps = current
            setattr(sys, name, quiet)
        elif not on and current is quiet:
            setattr(sys, name, quiet.wraps)
    for logger in ("asyncio", "concurrent.futures", "absl"):
        (logging.getLogger(logger).addFilter if on else logging.getLogger(logger).removeFilter)(_LATE_READS)


def _warn(message: str) -> None:
    if jax.process_index() == 0:
        print(f"podscale: warning: {message}", file=sys.stderr, flush=True)


class Checkpointer:
    """Saves every ``every`` steps under ``directory`` and restores the latest intact step."""

    def __init__(
        self,
        directory: str,
        every: int,
        max_to_keep: int = 3,
        warn: Callable[[str], None] = _warn,
        async_save: bool = True,
    ):
        if every < 1:
            raise ValueError(f"--checkpoint-every must be at least 1, got {every}")
        self.directory = os.path.abspath(directory)
        self.every = every
        self._failed: CheckpointError | None = None  # a save that failed: every later wait says so
        self._saving_step: int | None = None
        self.warn = warn
        # The one item's handler named up front: without it, reading a step's metadata finds the
        # item ("default") with no handler to read it by, and orbax warns twice on every resume.
        self._manager = _orbax().CheckpointManager(
            self.directory,
            item_handlers=_orbax().StandardCheckpointHandler(),
            options=_orbax().CheckpointManagerOptions(
                max_to_keep=max_to_keep, create=True, enable_async_checkpointing=async_save
            ),
        )

    def latest_step(self) -> int | None:
        """The newest step on disk, once the saves begun are committed."""
        with self._saving():
            self._manager.wait_until_finished()
        self._manager.reload()
        return self._manager.latest_step()

    @contextlib.contextmanager
    def _saving(self, step: int | None = None):
        """Where a save in flight (``step``, or the last begun) can fail: its failure (a full disk,
        a file-size limit) is a :class:`CheckpointError` naming the step, the cause and the intact
        steps; reported once (the writes of that save still running then print nothing)."""
        global _late_reads_pending
        if self._failed is not None:
            raise self._failed
        try:
            yield
        except Exception as e:
            step = self._saving_step if step is None else step
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if m := re.search(r"Failed to write [^:]*: ([^\[]*)", text):
                text = m.group(1).strip()
            elif isinstance(e, OSError) and e.strerror:
                text = e.strerror
            kept = sorted(s for s in self._manager.all_steps() if s != step)
            intact = f"the steps saved before it are intact (latest {kept[-1]})" if kept else "no earlier step is kept"
            self._failed = CheckpointError(
                f"checkpoint step {step} could not be written in {self.directory}: {text[:300]}; {intact}. Free space "
                "on its disk, then continue with --resume"
            )
            _late_reads_pending = True
            _quiet_late_reads(True)
            raise self._failed from None

    def maybe_save(self, step: int, state, transform=None, force: bool = False, metadata: dict | None = None) -> bool:
        """Saves ``transform(state)`` at multiples of ``every`` (or when ``force``), with the
        checksum of each leaf and ``metadata`` (a JSON-able dict; :meth:`metadata` reads it back)."""
        if not force and step % self.every:
            return False
        if step in self._manager.all_steps():
            return False  # the step we resumed from: already saved, never overwritten
        form = getattr(transform, "__self__", None)  # a CheckpointForm's save_form: its saved layout too
        form = form if isinstance(form, CheckpointForm) else None
        state = transform(state) if transform else state
        metadata_all = {CHECKSUMS: checksums(state, form.sizes() if form is not None else None)}
        if form is not None:
            metadata_all[LAYOUT] = form.saved_layout()
        if metadata:
            metadata_all[RUN_METADATA] = metadata
        with self._saving():  # the save before this one, if it failed, fails here
            self._manager.wait_until_finished()
        self._saving_step = step
        # Should the save fail (a full disk), its failure is reported once, by the next wait: its
        # writes still in flight then end in orbax's threads, quietly (_quiet_late_reads).
        global _late_reads_pending
        _late_reads_pending = True
        _quiet_late_reads(True)
        with self._saving(step):
            self._manager.save(step, args=_orbax().args.StandardSave(state), force=True, custom_metadata=metadata_all)
        return True

    def wait(self) -> None:
        """Returns once every save begun is committed on disk."""
        with self._saving():
            self._manager.wait_until_finished()

    def metadata(self, step: int) -> dict:
        """The ``metadata`` saved with ``step`` (``{}`` for a step saved without, by an older podscale)."""
        saved = (self._manager.metadata(step).custom_metadata or {}).get(RUN_METADATA)
        return saved if isinstance(saved, dict) else {}

    def saved_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def restore(self, like, fallback: bool = False, dry_run: bool = False):
        """Restores the latest step into the structure, shapes and shardings of ``like``, after
        checking every leaf against its checksum; returns ``(step, state)``.

        A damaged or unreadable latest step raises :class:`CheckpointError` naming it (and the
        damaged leaves); with ``fallback``, each such step is set aside as ``STEP.damaged``, with
        a warning naming it, and the newest intact earlier step is restored. ``dry_run`` (``train
        --resume --dry-run``) reads and verifies the same steps, changes nothing on disk, and warns
        of what the run would set aside."""
        self._manager.reload()
        steps = sorted(self._manager.all_steps(), reverse=True)
        if not steps:
            raise CheckpointError(
                f"--resume: no complete checkpoint in {self.directory}. Start without --resume, or "
                "point --workdir at the directory of the run to continue."
            )
        if isinstance(like, CheckpointForm):  # a CheckpointForm: each step read as it was saved, then converted
            abstract = like
        else:
            abstract = jax.tree.map(
                lambda x: x if isinstance(x, jax.ShapeDtypeStruct) else _orbax().utils.to_shape_dtype_struct(x), like
            )
        damaged: dict[int, str] = {}  # step: what is wrong with it
        for i, step in enumerate(steps):
            earlier = steps[i + 1] if i + 1 < len(steps) else None
            try:
                state = self._restore_verified(step, abstract, earlier)
            except _Damaged as e:
                if not fallback:
                    raise CheckpointError(e.message) from e.__cause__
                damaged[step] = e.reason
                continue
            if dry_run:
                for s in damaged:
                    self.warn(f"--resume-fallback: the run would skip checkpoint step {s}: {damaged[s]}")
                if damaged:
                    self.warn(f"--resume-fallback: the run would resume from step {step}, the newest intact checkpoint")
                return step, state
            for s, target in self._set_aside(list(damaged)).items():
                self.warn(f"--resume-fallback: skipped checkpoint step {s}: {damaged[s]}; moved it to {target}")
            if damaged:
                self.warn(f"--resume-fallback: resuming from step {step}, the newest intact checkpoint")
            return step, state
        reasons = "; ".join(f"step {s}: {r}" for s, r in damaged.items())
        raise CheckpointError(
            f"--resume-fallback: no intact checkpoint in {self.directory} ({reasons}). Start a new run with "
            "another --workdir."
        )

    def _restore_verified(self, step: int, abstract, earlier: int | None):
        """Restores ``step`` and checks it against its checksums; raises :class:`_Damaged`.
        ``abstract``: the shapes and shardings to read, or a ``CheckpointForm``, which reads the
        step in the layout it was saved in (its metadata says) and converts it into its own."""
        form, sizes = None, None
        if isinstance(abstract, CheckpointForm):
            form = abstract
            try:
                layout = (self._manager.metadata(step).custom_metadata or {}).get(LAYOUT)
            except Exception:
                layout = None  # the checksums' read below names what is wrong
            if not isinstance(layout, dict):  # saved before per-shard checkpoints: every leaf in its own shape
                layout = form.own_layout()
            try:
                abstract = form.abstract(layout)
            except ValueError as e:
                raise _Damaged(
                    f"not of this model/optimizer ({e})",
                    f"checkpoint step {step} in {self.directory} is not of this model/optimizer: {e}",
                ) from e
            sizes = form.sizes(layout)
        global _late_reads_pending
        where = f"checkpoint step {step} in {self.directory}"
        todo = (
            f"Pass --resume-fallback to set it aside and resume from the newest intact earlier step (the next kept "
            f"is step {earlier}), or start a new run with another --workdir"
            if earlier is not None
            else f"No earlier step is kept to fall back to: start a new run with another --workdir (or delete "
            f"{self.step_dir(step)} and start over)"
        )
        unreadable = None
        try:
            _quiet_late_reads(True)
            state = self._manager.restore(step, args=_orbax().args.StandardRestore(abstract))
            if not _late_reads_pending:  # kept after a failure: its other reads may finish (and print) later
                _quiet_late_reads(False)
        except Exception as e:  # orbax raises many kinds; all mean this step cannot be read
            chain = [e]
            while (nxt := chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 10:
                chain.append(nxt)
            text = "\n".join(str(x) for x in chain)
            detail = f"{type(chain[-1]).__name__}: {str(chain[-1]).strip()[:300]}"
            leaves = [path for name, path in _stored_names(abstract).items() if re.search(_quoted(name), text)]
            if leaves:
                which = f"leaf {leaves[0]} cannot" if len(leaves) == 1 else f"leaves {', '.join(leaves)} cannot"
                reason = f"damaged: {which} be read ({detail})"
            else:
                reason = f"corrupt or not of this model/optimizer ({detail})"
            unreadable = _Damaged(reason, f"{where} is {reason}. {todo}.")
            _late_reads_pending = True
            _failed_steps.add(self.step_dir(step) + os.sep)
            del chain, e
        if unreadable:  # raised outside the except clause, which no longer holds orbax's failed reads
            gc.collect()  # what the failed restore left, quietly (_quiet_late_reads)
            raise unreadable
        try:
            saved = (self._manager.metadata(step).custom_metadata or {}).get(CHECKSUMS)
        except Exception as e:
            reason = f"damaged: its metadata, which holds the checksums, cannot be read ({type(e).__name__})"
            raise _Damaged(reason, f"{where} is {reason}. {todo}.") from e
        if not isinstance(saved, dict):  # every save writes them, atomically with the step
            reason = "damaged: the checksums saved with it are missing or unreadable (its _CHECKPOINT_METADATA)"
            raise _Damaged(reason, f"{where} is {reason}, so it cannot be verified. {todo}.")
        legacy = isinstance(saved, dict) and any(isinstance(v, dict) and "sha256" in v for v in saved.values())
        got = _legacy_checksums(state) if legacy else checksums(state, sizes)
        bad = [path for path in got if not isinstance(saved, dict) or saved.get(path) != got[path]]
        if bad:
            shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            which = (
                f"leaf {shown} does not match the checksum saved with it"
                if len(bad) == 1
                else f"leaves {shown} do not match the checksums saved with them"
            )
            reason = f"damaged: {which} (its files changed after the save: a disk, copy or storage error)"
            raise _Damaged(reason, f"{where} is {reason}. {todo}.")
        return form.load(state, layout) if form is not None else state

    def _set_aside(self, steps: list[int]) -> dict[int, str]:
        """Renames damaged steps to ``STEP.damaged`` (process 0; every process waits for it), so
        that the resumed run saves those steps anew; orbax ignores the renamed directories."""
        if not steps:
            return {}
        moved = {}
        for step in steps:
            target, n = self.step_dir(step) + ".damaged", 1
            while os.path.lexists(target):
                n += 1
                target = f"{self.step_dir(step)}.damaged{n}"
            moved[step] = target
        if jax.process_index() == 0:
            for step, target in moved.items():
                os.replace(self.step_dir(step), target)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("podscale: damaged checkpoints set aside")
        self._manager.reload()
        return moved

    def close(self) -> None:
        """Waits for the save in flight and closes; a second call does nothing."""
        if not getattr(self, "_closed", False):
            self._closed = True
            with self._saving():
                self._manager.close()
