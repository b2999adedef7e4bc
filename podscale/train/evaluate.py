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
it. So evaluation needs no more memory per device than the state takes as stored, except for an
embedding table split by rows over the data axes (:mod:`podscale.parallel.tables`): ``eval_fn``
runs unpartitioned, so such a table is gathered whole for it (a table's size per device while
evaluating; the lookup by rows is the train step's only).

``distributed_eval(eval_fn, mesh)`` is the same for a state replicated on every device, every
mesh axis a data axis.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from podscale._jax import pe
from podscale.parallel import regions
from podscale.parallel.mesh import auto_axes
from podscale.parallel.placement import Placement
from podscale.parallel.program import shape_structs, signature


class DistributedEval:
    """``run(state, batches) -> {metric: mean over real examples}``; see the module docstring.

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

    @property
    def replicas(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.axes)

    def _read(self, batch) -> set[int]:
        """The state leaves (flat indices) ``eval_fn`` reads on ``batch`` (global shapes, no mask),
        traced on the user layout."""
        layout = self.placement.state
        user = jax.tree.unflatten(
            layout.treedef,
            [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, weak_type=leaf.weak_type) for leaf in layout.leaves],
        )
        closed = jax.make_jaxpr(self.eval_fn)(user, shape_structs(batch))
        _, used = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
        return {i for i, u in enumerate(used[: len(layout.leaves)]) if u}

    def _build(self, batch):
        axes, layout = self.axes, self.placement and self.placement.state
        eval_fn = self.eval_fn

        roles = self.placement.roles if self.placement is not None else None
        hand = {
            role: (axis, self.mesh.shape[axis])
            for role, axis in (("space", roles and roles.space), ("model", roles and roles.model))
            if axis is not None
        }

        def body(state, batch):
            mask = batch["mask"]
            with regions.by_hand(hand):  # a region of the model: by hand over its axis, as in the step
                per = eval_fn(state, {k: v for k, v in batch.items() if k != "mask"})
            sums = {k: jax.lax.psum(jnp.sum(v.astype(jnp.float32) * mask), axes) for k, v in per.items()}
            return sums, jax.lax.psum(jnp.sum(mask), axes)

        replicated = NamedSharding(self.mesh, P())
        if layout is None:  # a replicated state, every mesh axis a data axis
            mapped = jax.shard_map(body, mesh=self.mesh, in_specs=(P(), P(axes)), out_specs=(P(), P()))
            return jax.jit(mapped, out_shardings=(replicated, replicated))

        gather = set()
        if layout.any_sharded or any(leaf.table for leaf in layout.leaves):
            read = self._read({k: v for k, v in shape_structs(batch).items() if k != "mask"})
            gather = {i for i, leaf in enumerate(layout.leaves) if (leaf.sharded or leaf.table) and i in read}
        specs = jax.tree.leaves(layout.specs())
        specs = jax.tree.unflatten(layout.treedef, [P() if i in gather else s for i, s in enumerate(specs)])

        # Manual over the data axes, as the step's partitioner; a space or model axis is left to
        # XLA. With one replica the values are not typed per replica, as in the step.
        mapped = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(specs, P(axes)),
            out_specs=(P(), P()),
            axis_names=set(axes),
            check_vma=self.replicas > 1,
        )

        def program(stored, batch):
            leaves = jax.tree.leaves(stored)
            for i in gather:  # a chunked leaf or table eval_fn reads: whole (its padding dropped) for it
                leaf = layout.leaves[i]
                leaves[i] = leaves[i][: leaf.shape[0]] if leaf.table else layout.whole(leaves[i], leaf)
            return mapped(jax.tree.unflatten(layout.treedef, leaves), batch)

        return jax.jit(
            program,
            in_shardings=(layout.shardings(), self.placement.batch_shardings(shape_structs(batch))),
            out_shardings=(replicated, replicated),
        )

    def _compiled(self, batch):
        key = signature(batch)
        if key not in self._jitted:
            self._jitted[key] = self._build(batch)
        return self._jitted[key]

    def lower(self, state, batch):
        """Lowers the evaluation of one global ``batch`` (with its ``mask``) for the stored ``state``."""
        return self._compiled(batch).lower(state, batch)

    def __call__(self, state, batches: Iterable) -> dict[str, float]:
        if self.placement is not None:
            self.placement.state.check_stored(state)  # shapes and dtypes only: no device sync
        totals, count = None, None
        for batch in batches:
            sums, n = self._compiled(batch)(state, batch)
            totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
            count = n if count is None else count + n
        if totals is None:
            raise ValueError("evaluation got no batches: the held-out data set is empty")
        count = float(count)
        return {k: float(v) / count for k, v in totals.items()}


def distributed_eval(eval_fn: Callable, where) -> DistributedEval:
    """Returns ``run(state, batches) -> {metric: mean over real examples}``.

    ``where`` is the train step (a ``DataParallelStep`` after ``place_state`` or ``prepare``) or
    its ``placement``: the stored state is evaluated where it lives (see the module docstring). A
    ``jax.sharding.Mesh`` evaluates a replicated state, the batch split over every device."""
    return DistributedEval(eval_fn, where)
