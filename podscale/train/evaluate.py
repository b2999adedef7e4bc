"""Evaluation placed as the train step is, metrics combined with collectives.

``eval_fn(state, batch)`` returns per-example metrics (shape ``[batch]``). Each replica sums its
examples' metrics weighted by the ``mask`` leaf (0 for padding), the sums and the example count
are ``psum``-ed over the data axes, and running totals stay on the devices; the host only divides
at the end. No example is dropped or counted twice.

``distributed_eval(eval_fn, dp)`` takes the train step's placement (a ``DataParallelStep`` once
placed, or its :class:`~podscale.parallel.placement.Placement`) and evaluates the state as the
step stores it, placed as the step places it: a ``shard_map`` manual over the data axes only, the
batch's rows split over them (and each image's height over a space axis, as the step's), the
space and model axes left to XLA's partitioner. A weight the sharding rules split stays split over
the model axis, and XLA partitions ``eval_fn`` over it as it does the step; an optimizer-state
leaf the sharded update keeps in flat 1/N chunks is passed as stored, since ``eval_fn`` does not
read it. A chunked leaf that ``eval_fn`` does read (batch norm's running statistics, which the
training forward pass does not read, so the sharded update may chunk them) is gathered whole for
it. An embedding table split by rows over the data axes (:mod:`podscale.parallel.tables`) stays
split: where ``eval_fn`` reads one, ``eval_fn`` is traced at the global shapes and each replica
replays it with the step's partitioner (:func:`podscale.parallel.engine.partitioner`), the table as
its stored block of rows, looked up where the rows live as in the step (the batch's ids
all-gathered, the looked-up rows reduce-scattered back to their examples); without a table read,
``eval_fn`` runs as written on each replica's rows. So evaluation needs no more memory per device
than the state takes as stored.

:meth:`DistributedEval.predict` returns each example's outputs instead of their means: each
replica computes its own rows, and every process gets them all on the host, in order, the padding
dropped (the predictions of a whole-set metric, :attr:`podscale.workloads.Workload.predict`).

``distributed_eval(eval_fn, mesh)`` is the same for a state replicated on every device, every
mesh axis a data axis.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from podscale._jax import pe
from podscale.parallel import regions
from podscale.parallel.engine import partitioner
from podscale.parallel.mesh import auto_axes
from podscale.parallel.partition import Split
from podscale.parallel.placement import Placement
from podscale.parallel.program import shape_structs, signature
from podscale.parallel.together import launch_together


class DistributedEval:
    """``run(state, batches) -> {metric: mean over real examples}``, and :meth:`predict`, each
    example's outputs; see the module docstring.

    :meth:`lower` lowers the program of one batch (a global batch with its ``mask`` leaf; arrays
    or ``ShapeDtypeStruct``) for a stored state, to compile it or read its memory per device."""

    def __init__(self, eval_fn: Callable, where):
        self.eval_fn = eval_fn
        if isinstance(where, Mesh):
            self.placement: Placement | None = None
            self.mesh = auto_axes(where)  # a jax.make_mesh mesh's Explicit axes are taken as Auto
            self.axes: tuple[str, ...] = tuple(self.mesh.axis_names)
        else:
            placement = where if isinstance(where, Placement) else getattr(where, "placement", None)
            if not isinstance(placement, Placement):
                raise TypeError(
                    "distributed_eval(eval_fn, where): where is the train step (a DataParallelStep), its "
                    f"placement (dp.placement) or, for a replicated state, a jax.sharding.Mesh; got {type(where).__name__}"
                )
            self.placement = placement
            self.mesh = placement.mesh
            self.axes = placement.roles.data
        self._jitted: dict[tuple, Any] = {}
        self._launched: set[tuple] = set()

    @property
    def replicas(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.axes)

    def _trace(self, batch):
        """``eval_fn`` traced at the global shapes (the user-layout state, ``batch`` without its
        mask): the closed jaxpr and its output tree."""
        layout = self.placement.state
        user = jax.tree.unflatten(
            layout.treedef,
            [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, weak_type=leaf.weak_type) for leaf in layout.leaves],
        )
        closed, out = jax.make_jaxpr(self.eval_fn, return_shape=True)(user, batch)
        return closed, jax.tree.structure(out)

    def _replay(self, jaxpr, consts, used: list[bool], out_tree, batch_rows: int) -> Callable:
        """Each replica's part of ``eval_fn`` on the stored state: its global trace (``jaxpr``, the
        inputs it reads ``used``) replayed by the step's partitioner, the tables as their blocks of
        rows (``Split(0)``, padding included), FSDP chunks gathered where used, the other leaves whole,
        the batch split by rows; each
        output comes back as this replica's rows."""
        layout, placement = self.placement.state, self.placement

        def per_example(state, batch):
            part = partitioner(placement.mesh, placement.roles, batch_rows)
            state_in = [
                (x, leaf.partition_layout) for x, leaf in zip(jax.tree.leaves(state), layout.leaves, strict=True)
            ]
            ins = [*state_in, *((x, Split(0)) for x in jax.tree.leaves(batch))]
            outs = part.run(jaxpr, consts, [x for x, u in zip(ins, used, strict=True) if u])
            return jax.tree.unflatten(out_tree, [part.convert(v, lay, Split(0)) for v, lay in outs])

        return per_example

    def _build(self, batch, rows: bool):
        """The jitted program of ``batch``'s signature: the masked sums of ``eval_fn``'s outputs
        and the example count (``rows=False``), or each replica's rows of them (``rows=True``)."""
        axes, layout = self.axes, self.placement and self.placement.state
        eval_fn = self.eval_fn
        unmasked = {k: v for k, v in shape_structs(batch).items() if k != "mask"}

        roles = self.placement.roles if self.placement is not None else None
        hand = {
            role: (axis, self.mesh.shape[axis])
            for role, axis in (("space", roles and roles.space), ("model", roles and roles.model))
            if axis is not None
        }

        def direct(state, batch):
            with regions.by_hand(hand):  # a region of the model: by hand over its axis, as in the step
                return eval_fn(state, batch)

        gather, per_example = set(), direct
        if layout is not None and (layout.any_sharded or any(leaf.table or leaf.chunked for leaf in layout.leaves)):
            closed, out_tree = self._trace(unmasked)
            jaxpr, used = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
            read = {i for i, u in enumerate(used[: len(layout.leaves)]) if u}
            gather = {i for i, leaf in enumerate(layout.leaves) if leaf.sharded and i in read}
            if any(layout.leaves[i].table or layout.leaves[i].chunked for i in read):
                # A table looked up where its rows live, an FSDP chunk gathered where it is used: as in the step.
                rows_in = jax.tree.leaves(unmasked)[0].shape[0]
                per_example = self._replay(jaxpr, closed.consts, used, out_tree, rows_in)

        def body(state, batch):
            per = per_example(state, {k: v for k, v in batch.items() if k != "mask"})
            if rows:
                return per
            mask = batch["mask"]
            sums = {k: jax.lax.psum(jnp.sum(v.astype(jnp.float32) * mask), axes) for k, v in per.items()}
            return sums, jax.lax.psum(jnp.sum(mask), axes)

        replicated = NamedSharding(self.mesh, P())
        out_specs, out_shardings = (
            (P(axes), NamedSharding(self.mesh, P(axes))) if rows else ((P(), P()), (replicated, replicated))
        )
        if layout is None:  # a replicated state, every mesh axis a data axis
            mapped = jax.shard_map(body, mesh=self.mesh, in_specs=(P(), P(axes)), out_specs=out_specs)
            return jax.jit(mapped, out_shardings=out_shardings)

        specs = jax.tree.leaves(layout.specs())
        specs = jax.tree.unflatten(layout.treedef, [P() if i in gather else s for i, s in enumerate(specs)])

        # Manual over the data axes, as the step's partitioner; a space or model axis is left to
        # XLA. With one replica the values are not typed per replica, as in the step.
        mapped = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(specs, P(axes)),
            out_specs=out_specs,
            axis_names=set(axes),
            check_vma=self.replicas > 1,
        )

        def program(stored, batch):
            leaves = jax.tree.leaves(stored)
            for i in gather:  # a chunked leaf eval_fn reads: whole for it
                leaves[i] = layout.unstore_leaf(leaves[i], layout.leaves[i])
            return mapped(jax.tree.unflatten(layout.treedef, leaves), batch)

        return jax.jit(
            program,
            in_shardings=(layout.shardings(), self.placement.batch_shardings(shape_structs(batch))),
            out_shardings=out_shardings,
        )

    def _compiled(self, batch, rows: bool = False):
        key = (rows, signature(batch))
        if key not in self._jitted:
            self._jitted[key] = self._build(batch, rows)
        return self._jitted[key]

    def _launch(self, state, batch, rows: bool = False):
        """The program for ``batch``; the first time, once every process has compiled it
        (:func:`~podscale.parallel.together.launch_together`)."""
        what = "the predictions" if rows else "the evaluation"
        return launch_together(
            self._launched, (rows, signature(batch)), self._compiled(batch, rows), (state, batch), what
        )

    def lower(self, state, batch, *, rows: bool = False):
        """Lowers the evaluation of one global ``batch`` (with its ``mask``) for the stored ``state``:
        its metrics' sums, or with ``rows=True`` :meth:`predict`'s program."""
        return self._compiled(batch, rows).lower(state, batch)

    def __call__(self, state, batches: Iterable) -> dict[str, float]:
        if self.placement is not None:
            self.placement.state.check_stored(state)  # shapes and dtypes only: no device sync
        totals, count = None, None
        one_at_a_time = _one_program_at_a_time(self.mesh)
        for batch in batches:
            sums, n = self._launch(state, batch)(state, batch)
            if one_at_a_time:
                jax.block_until_ready((sums, n))
            totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
            count = n if count is None else count + n
        if totals is None:
            raise ValueError("evaluation got no batches: the held-out data set is empty")
        count = float(count)
        return {k: float(v) / count for k, v in totals.items()}

    def predict(self, state, batches: Iterable):
        """``eval_fn``'s outputs for every real example of ``batches``, in order: host numpy arrays
        (each output's leading dimension the examples), on every process. Each replica computes its
        own rows; the padding rows (``mask`` 0) are dropped on the host. One program runs at a time
        (a batch's, then the gathering of its rows across processes): two batches' programs do not
        depend on each other, and with several processes (gloo on CPU) their collectives in flight
        at once can interleave differently on each process and never complete (seen: the small
        DLRM's eval, its lookups' all-gathers, hung 2 runs of 3 on 2 processes)."""
        if self.placement is not None:
            self.placement.state.check_stored(state)
        parts, masks = [], []
        for batch in batches:
            masks.append(_host(batch["mask"]))
            out = jax.block_until_ready(self._launch(state, batch, rows=True)(state, batch))
            parts.append(jax.tree.map(_host, out))
        if not parts:
            raise ValueError("evaluation got no batches: the held-out data set is empty")
        real = np.concatenate(masks) > 0
        return jax.tree.map(lambda *xs: np.concatenate(xs)[real], *parts)


def _one_program_at_a_time(mesh) -> bool:
    """Whether evaluation waits for each batch's program before it launches the next. With several
    processes, two programs' collectives in flight at once can interleave differently on each
    process and never complete (see :meth:`DistributedEval.predict`). On one process of XLA:CPU,
    batches launched ahead of each other (each a program with collectives, then the adds of its
    sums) can stall it: the small DLRM's held-out loss (its lookups' all-gathers), three runs at a
    time on two cores, stopped in 22 of 84 runs with 5 to 7 of the 8 devices waiting in an
    all-gather's rendezvous and the others' launches blocked on the device's in-flight semaphore
    (``Semaphore::Acquire``, read with gdb), until XLA aborts the process after 40 s; none of 84
    stopped once each batch is waited for. Accelerators keep their batches in flight."""
    return jax.process_count() > 1 or mesh.devices.flat[0].platform == "cpu"


def _host(x) -> np.ndarray:
    """A global array's whole value as host numpy, on every process."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def distributed_eval(eval_fn: Callable, where) -> DistributedEval:
    """Returns ``run(state, batches) -> {metric: mean over real examples}``; ``run.predict(state,
    batches)`` gives each real example's outputs instead, on the host.

    ``where`` is the train step (a ``DataParallelStep`` after ``place_state`` or ``prepare``) or
    its ``placement``: the stored state is evaluated where it lives (see the module docstring). A
    ``jax.sharding.Mesh`` evaluates a replicated state, the batch split over every device."""
    return DistributedEval(eval_fn, where)
