"""Data parallelism of an unmodified single-device training step, exact by construction.

The user writes ``step(state, batch) -> (new_state, metrics)`` for one device, as if the whole
global batch were there: ``jax.grad`` of any loss (a mean, a sum, a mean over the non-padding
tokens), any optax optimizer, dropout, scans, no collectives. That program *is* the specification.
podscale traces it once at the global batch shape (``jax.make_jaxpr``, loops kept as loops) and
partitions the traced program over the data axes (:mod:`podscale.parallel.partition`): inside a
``shard_map`` that is manual over those axes, every value carries a layout (replicated, split
along a dimension, or a partial sum), a reduction over the split batch leaves a partial sum, and a
partial sum is resolved by one ``psum`` as late as possible. Nothing is rescaled, so the new state
is what one device computes on the whole batch, up to float summation order.

The per-replica program that comes out is then replayed by :mod:`podscale.parallel.weight_update`:
its sums are deferred and fused into buckets, summed 1-D or 2-D (:mod:`podscale.parallel.gradsum`),
and with ``weight_update="sharded"`` reduce-scattered so that the update runs on 1/N chunks, the
optimizer state stays sharded between steps (:mod:`podscale.parallel.state_layout`), and the new
weights are all-gathered.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from podscale.parallel import checks, spatial, state_layout, tables, tensor
from podscale.parallel.gradsum import make_grad_sum
from podscale.parallel.mesh import auto_axes
from podscale.parallel.partition import REPLICATED, Partitioner, Split
from podscale.parallel.placement import BatchPlacement, Placement, Roles, batch_sharding, batch_shardings
from podscale.parallel.program import (
    GlobalTrace,
    Step,
    as_arrays,
    as_whole,
    check_batch,
    check_kept_shapes,
    check_not_donated,
    path_str,
    shape_structs,
    signature,
    trace_global,
)
from podscale.parallel.strategy import Strategy
from podscale.parallel.weight_update import (
    Layout,
    Rewriter,
    Sharded,
    Trace,
    forward_used,
    gather,
)


class DataParallelStep:
    """A compiled data-parallel step and the layouts of its inputs.

    Call it as ``new_state, metrics = dp(state, batch)`` with ``state`` from :meth:`place_state`
    (the *stored* layout: with the sharded weight update, optimizer-state leaves are flat 1/N
    chunks) and a *global* ``batch`` whose leading dimension the replica count divides. The state
    argument is donated. :meth:`gather_state` returns the plain pytree.
    """

    def __init__(self, step: Step, mesh: Mesh, strategy: Strategy | None = None, *, donate_state: bool = True):
        self.step, self.mesh = step, auto_axes(mesh)  # a jax.make_mesh mesh's Explicit axes are taken as Auto
        self.strategy = strategy or Strategy()
        self.donate_state = checks.boolean("donate_state", donate_state)
        self.roles = Roles.of(self.strategy, mesh)
        """Each mesh axis's role, by name (:class:`~podscale.parallel.placement.Roles`)."""
        if self.model and self.strategy.rules is None:
            raise ValueError(
                f"the model axis {self.model!r} needs sharding rules: pass rules=Rules(...) or a "
                f"built-in's name ({', '.join(tensor.RULES)})"
            )
        st = self.strategy
        self.grad_sum = make_grad_sum(
            mesh,
            st.grad_sum,
            st.grad_sum_chunks,
            st.grad_sum_dtype,
            st.axis_costs,
            nbytes=st.bucket_bytes,
            axes=self.axes,
        )
        # Caches, by signature; none of them changes what a call computes.
        self._placement: Placement | None = None
        """The placement: made once, by the first :meth:`prepare` (or placed state), never changed."""
        self._batches: dict[tuple, BatchPlacement] = {}
        """Each batch signature's placement (its images and windows), as the step traced it."""
        self._global: tuple | None = None
        self._jitted: dict[tuple, Any] = {}
        """One jitted program per batch signature (tree, shapes, dtypes), as ``jax.jit`` retraces."""
        self._traces: dict[tuple, Trace] = {}
        """What each signature's traced program does (collectives, gathered ops), for the plan."""
        self._last: tuple | None = None

    # The strategy's fields and the roles, as the rest of the step reads them.
    weight_update = property(lambda self: self.strategy.weight_update)
    min_shard_size = property(lambda self: self.strategy.min_shard_size)
    bucket_bytes = property(lambda self: self.strategy.bucket_bytes)
    strict = property(lambda self: self.strategy.strict)
    sharded = property(lambda self: self.strategy.sharded)
    axes = property(lambda self: self.roles.data, doc="The data axes (the batch's rows), mesh order.")
    space = property(lambda self: self.roles.space, doc="The space axis (each image's height), or None.")
    model = property(lambda self: self.roles.model, doc="The model axis (the rules' split weights), or None.")
    partitions = property(lambda self: self.roles.partitions, doc="The axes left to XLA (space, model).")
    group_axis = property(lambda self: self.roles.group, doc="The batch-norm group axis, or None.")

    @property
    def replicas(self) -> int:
        """Data-parallel replicas: the devices of the data axes (a space axis splits images)."""
        return self.roles.replicas(self.mesh)

    @property
    def split(self) -> int:
        """Devices each replica is split over: the space and model axes' (1 for neither)."""
        return self.roles.split(self.mesh)

    # The placement's parts, read-only (``None`` or empty before :meth:`prepare`).
    @property
    def placement(self) -> Placement:
        """The step's :class:`~podscale.parallel.placement.Placement` (after :meth:`prepare` or
        :meth:`place_state`)."""
        if self._placement is None:
            raise ValueError(
                "the step has no placement yet: call dp.place_state(state, batch) or dp.prepare(state, batch)"
            )
        return self._placement

    layout = property(lambda self: self._placement and self._placement.state, doc="The state's layout, or None.")
    model_dims = property(lambda self: self._placement and self._placement.model_dims)
    rule_notes = property(lambda self: list(self._placement.rule_notes) if self._placement else [])

    @property
    def images(self) -> list[bool] | None:
        """With a space axis: which leaves of the last batch signature called are images."""
        found = self._batch_placement()
        return None if found is None or not self.space else list(found.images)

    @property
    def windows(self) -> list:
        """With a space axis: the step's convolutions and pooling windows, over every signature."""
        seen: list = []
        for b in self._batches.values():
            seen += [w for w in b.windows if w not in seen]
        return seen

    @property
    def uneven(self) -> list[str]:
        """With a space axis: the layers whose height it does not divide (last signature called)."""
        found = self._batch_placement()
        return [] if found is None else list(found.uneven)

    @property
    def trace(self) -> Trace | None:
        """What the last signature compiled or called does (collectives, gathered ops), for the plan."""
        return self._traces.get(self._last)

    @property
    def batch_sharding(self) -> NamedSharding:
        """How the batch's rows are split (over the data axes)."""
        return batch_sharding(self.mesh, self.roles)

    def batch_shardings(self, batch):
        """Each batch leaf's sharding: rows over the data axes and, with ``spatial``, the height of
        every image (a rank-4 NHWC leaf) over the space axis, which XLA's SPMD partitioner then
        keeps through convolutions and pooling, exchanging halos between neighbours."""
        if self.space is not None and self._placement is None:
            raise ValueError("place the state with dp.place_state(state, batch) before placing batches")
        return batch_shardings(self.mesh, self.roles, batch, tuple(self.windows))

    # -- the placement ----------------------------------------------------------------------
    def prepare(self, state, batch=None) -> Placement:
        """The step's placement: traces the step at the global shapes and decides each state and
        batch leaf's layout. Needs a (global) batch example (arrays or ``jax.ShapeDtypeStruct``)
        for the sharded update and a space axis. The first placement made is the step's, and it
        never changes: a later call returns it, after checking ``state`` has its shapes."""
        abstract = shape_structs(state)
        if self._placement is not None:
            self._placement.state.check_user(abstract)
            if batch is not None:
                self.check_batch(batch)
                self._batch_placement(batch, abstract)
            return self._placement
        forward = None
        if batch is not None:
            self.check_batch(batch)
            forward = self._forward_inputs(abstract, batch)
        elif self.space:
            raise ValueError(
                f"the space axis {self.space!r} needs an example global batch to find the images and check "
                "their heights: call place_state(state, batch) or prepare(state, batch)"
            )
        elif self.sharded:
            raise ValueError(
                "weight_update='sharded' needs an example global batch to decide which state "
                "leaves the forward pass reads: call place_state(state, batch) or prepare(state, batch)"
            )
        found, looked_up, min_rows = {}, set(), 0
        if batch is not None:
            batch_rows = jax.tree.leaves(batch)[0].shape[0]
            gt = self.global_trace(abstract, batch)
            min_rows = batch_rows if self.strategy.min_table_rows is None else self.strategy.min_table_rows
            looked_up = tables.looked_up(gt.closed.jaxpr, gt.n_state)
            if self.strategy.min_table_rows is not None and not looked_up:
                checks.warn(
                    f"min_table_rows={self.strategy.min_table_rows}: the step looks up no weight by rows (it has no "
                    "embedding table), so there is nothing to split by rows and it changes nothing; drop it",
                    checks.PodscaleWarning,
                )
        model_dims, notes = None, ()
        if self.model:
            # The tables split by rows over the data axes where no rule splits them: not "left whole"
            split_by_rows = set(tables.choose(jax.tree.leaves(abstract), looked_up, forward, self.replicas, min_rows))
            assignment = tensor.assign(
                self.strategy.rules,
                abstract,
                self.mesh.shape[self.model],
                self.model,
                weights=forward,
                strict=self.strict,
                split_by_rows=split_by_rows,
            )
            model_dims, notes = assignment.dims, tuple(assignment.notes)
        if batch is not None:
            ruled = {i for i, d in enumerate(model_dims or ()) if d is not None}  # a rule's split wins
            found = tables.choose(jax.tree.leaves(abstract), looked_up - ruled, forward, self.replicas, min_rows)
            found = {i: rows for i, rows in found.items() if i not in ruled}
        layout = state_layout.decide(
            abstract,
            self.mesh,
            forward,
            self.min_shard_size,
            shard=self.sharded,
            order=self.grad_sum.order,
            parts=self.partitions,
            model=self.model,
            model_dims=model_dims,
            tables=found,
            fsdp=self.strategy.fsdp,
            dims=self.grad_sum.mode == "1d",
        )
        example = self._batch_placement(batch, abstract) if batch is not None else BatchPlacement()
        self._placement = Placement(
            self.mesh, self.roles, layout, example, model_dims, notes, tuple(sorted(looked_up)), min_rows
        )
        return self._placement

    def plan(self, state=None, batch=None, *, compile: bool = False):
        """What the step does, before running it: see :class:`podscale.parallel.plan.Plan`.

        ``state`` (user layout) and ``batch`` may be arrays or ``ShapeDtypeStruct``; they can be
        left out once the step has been prepared and traced. ``compile=True`` also compiles the
        step (for ``batch``) and reads the collectives and memory per device from the compiled
        module, so that the plan states what runs.
        """
        from podscale.compiled import hlo
        from podscale.parallel.plan import make_plan

        if state is not None:
            self.prepare(state, batch)
        if self.trace is None or compile:
            if batch is None:
                raise ValueError("plan() needs an example global batch the first time, and to compile")
            lowered = self.lower(self.placement.stored_shapes(), shape_structs(batch))
        module = hlo.read(lowered.compile(), self.mesh) if compile else None
        return make_plan(self.placement, self.trace, self.grad_sum, self.strategy, module, self._batch_placement())

    def _batch_placement(self, batch=None, abstract_state=None) -> BatchPlacement | None:
        """The placement of ``batch``'s signature (the last one called without ``batch``): with a
        space axis its image leaves, windows and the layers whose height the axis does not divide
        (refused with ``strict``). Made once per signature."""
        if batch is None:
            return self._batches.get(self._last) or (self._placement and self._placement.batch)
        key = signature(batch)
        if key not in self._batches:
            if not self.space:
                self._batches[key] = BatchPlacement(tuple(False for _ in jax.tree.leaves(batch)))
            else:
                abstract_state = abstract_state if abstract_state is not None else self.layout_shapes()
                found = tuple(spatial.windows(self.global_trace(abstract_state, batch).closed.jaxpr))
                shapes = [tuple(np.shape(x)) for x in jax.tree.leaves(batch)]
                images = spatial.image_leaves(shapes, list(found))
                split = [s for s, im in zip(shapes, images, strict=True) if im]
                uneven = spatial.check(list(found), self.mesh.shape[self.space], self.space, split, self.strict)
                self._batches[key] = BatchPlacement(tuple(images), found, tuple(uneven))
        return self._batches[key]

    def global_trace(self, abstract_state, batch) -> GlobalTrace:
        key = (
            jax.tree.structure(abstract_state),
            tuple(jax.tree.leaves(abstract_state)),
            jax.tree.structure(batch),
            tuple(jax.tree.leaves(shape_structs(batch))),
        )
        if self._global is None or self._global[0] != key:
            self._global = (key, trace_global(self.step, abstract_state, shape_structs(batch), self.group_axis))
        return self._global[1]

    def _local(self, gt: GlobalTrace, state_leaves, batch_leaves, leaves=None) -> tuple[Any, Partitioner]:
        """The per-replica program of the global trace: a closed jaxpr, made inside the
        ``shard_map`` (its inputs typed per replica), with every output whole but the state leaves
        stored split (``leaves``, the state's :class:`~podscale.parallel.state_layout.LeafLayout`:
        a table's rows, an FSDP chunk; their ``state_leaves`` this replica's piece), which come
        back in their stored layout."""
        stored = [leaf.partition_layout for leaf in leaves] if leaves else [REPLICATED] * len(state_leaves)
        rows = np.shape(batch_leaves[0])[0] * self.replicas if batch_leaves else None
        part = partitioner(
            self.mesh,
            self.roles,
            rows,
            {leaf.shape: leaf.table_rows for leaf in leaves or () if leaf.table},
            independent_rng=self.strategy.rng == "independent",
            fsdp=self.strategy.fsdp and leaves is not None,  # the forward pass's probe: the plain program
            min_chunk=self.strategy.min_shard_size,
            chunk_partials=leaves is not None and any(leaf.chunked for leaf in leaves),
        )

        def local(state_leaves, batch_leaves):
            ins = list(zip(state_leaves, stored, strict=True))
            outs = part.run(gt.closed.jaxpr, gt.closed.consts, ins + [(x, Split(0)) for x in batch_leaves])
            part.leaving = True
            try:
                return [
                    part.convert(v, lay, stored[i]) if i < gt.n_state else part.whole(v, lay)
                    for i, (v, lay) in enumerate(outs)
                ]
            finally:
                part.leaving = False

        return jax.make_jaxpr(local)(state_leaves, batch_leaves), part

    def _forward_inputs(self, abstract_state, batch) -> set[int]:
        found: list[set[int]] = []
        gt = self.global_trace(abstract_state, batch)
        state_leaves = jax.tree.leaves(abstract_state)

        def probe(batch):
            closed, _ = self._local(gt, state_leaves, jax.tree.leaves(batch))
            seeds = closed.jaxpr.invars[gt.n_state :] if self.replicas == 1 else None  # one replica: see forward_used
            used = forward_used(closed.jaxpr, seeds)
            found.append({i for i, v in enumerate(closed.jaxpr.invars[: gt.n_state]) if v in used})
            return jnp.zeros(())

        mapped = jax.shard_map(
            probe,
            mesh=self.mesh,
            in_specs=(P(self.axes),),
            out_specs=P(),
            axis_names=set(self.axes),
            check_vma=self.replicas > 1,
        )
        jax.eval_shape(mapped, shape_structs(batch))
        return found[0]

    # -- the step ---------------------------------------------------------------------------
    def _build(self, batch, key: tuple):
        layout = self.layout
        axes = self.axes
        split = frozenset(leaf.shape for leaf in layout.leaves if leaf.model_dim is not None and leaf.weight)
        chunks = Layout(
            self.grad_sum,
            self.min_shard_size,
            scatter=self.sharded,
            bucket_bytes=self.bucket_bytes,
            split_shapes=split,
            split=self.split,  # as layout.leaves' chunks
            by_partition=dict(layout.chunk_dims),  # a split weight's shape: chunked per model partition
            model_split=self.mesh.shape[self.model] if self.model else 1,
            model_axis=self.model if self.partitions == (self.model,) else None,
        )
        abstract_state = self.layout_shapes()
        gt = self.global_trace(abstract_state, batch)

        def body(stored, batch):
            trace = Trace()
            state_in = [
                x if leaf.table or leaf.chunked else shape
                for x, shape, leaf in zip(jax.tree.leaves(stored), jax.tree.leaves(abstract_state), layout.leaves)
            ]
            closed, part = self._local(gt, state_in, jax.tree.leaves(batch), layout.leaves)
            rewriter = Rewriter(chunks, trace)
            args = [
                Sharded(x, leaf.shape, leaf.by) if leaf.sharded else x
                for x, leaf in zip(jax.tree.leaves(stored), layout.leaves, strict=True)
            ]
            outs = rewriter.run(closed, [*args, *jax.tree.leaves(batch)])
            outs = [rewriter.resolve(o) for o in outs]
            try:
                new_state, metrics = jax.tree.unflatten(gt.out_tree, outs)
            except (TypeError, ValueError):
                raise TypeError("the step must return a pair (new_state, metrics)") from None
            layout.check(new_state, "the step's new_state")
            check_kept_shapes(new_state, layout)
            trace.whole_ops = list(part.whole_ops)
            trace.regions = list(part.regions)
            trace.summed_apart_bytes = part.summed_apart_bytes
            trace.collectives[:0] = part.collectives
            new_state = self._finish_state(chunks, trace, new_state)
            pairs = jax.tree_util.tree_leaves_with_path(metrics, is_leaf=lambda x: isinstance(x, Sharded))
            metrics = jax.tree.unflatten(
                jax.tree.structure(metrics, is_leaf=lambda x: isinstance(x, Sharded)),
                self._finish_full(chunks, trace, pairs, "metrics"),
            )
            self._traces[key] = trace
            if self.strict and (trace.gathered_ops or trace.whole_ops):
                raise ValueError(
                    "strict=True: refused before running; these ops would run on whole (gathered) values, "
                    f"not on shards: {[*trace.whole_ops, *trace.gathered_ops]}. Drop strict=True to run them so."
                )
            return new_state, metrics

        specs = layout.specs()
        # Manual over the data axes (podscale's partitioner); a space or model axis is left to XLA.
        # With one replica (a 1xk mesh) no collective runs over the data axes (see
        # ``Partitioner.one``), so values are not typed per replica there.
        mapped = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(specs, P(axes)),
            out_specs=(specs, P()),
            axis_names=set(axes),
            check_vma=self.replicas > 1,
        )
        return jax.jit(
            mapped,
            in_shardings=(layout.shardings(), self.batch_shardings(batch)),  # as place_batch places a batch
            out_shardings=(layout.shardings(), NamedSharding(self.mesh, P())),
            donate_argnums=(0,) if self.donate_state else (),
        )

    def _finish_full(self, chunks, trace, pairs, kind) -> list:
        """Values that must come out whole, as ``(path, value)`` pairs: sharded ones are
        all-gathered (fused)."""
        leaves = [v for _, v in pairs]
        shards = [i for i, v in enumerate(leaves) if isinstance(v, Sharded)]
        why = "updated weights" if kind == "new_state" else kind
        gathered = gather(chunks, [leaves[i] for i in shards], trace, why, update=kind == "new_state") if shards else []
        for i, g in zip(shards, gathered, strict=True):
            leaves[i] = g
        return [as_whole(kind, path, v) for (path, _), v in zip(pairs, leaves, strict=True)]

    def _finish_state(self, chunks, trace, new_state):
        layout = self.layout
        paths_leaves = jax.tree_util.tree_leaves_with_path(new_state, is_leaf=lambda x: isinstance(x, Sharded))
        whole = [
            (p, v)
            for (p, v), leaf in zip(paths_leaves, layout.leaves, strict=True)
            if not leaf.sharded and not leaf.table and not leaf.chunked
        ]
        whole_done = iter(self._finish_full(chunks, trace, whole, "new_state"))
        out = []
        for (path, v), leaf in zip(paths_leaves, layout.leaves, strict=True):
            if leaf.table or leaf.chunked:  # this replica's rows or chunk, as stored
                out.append(v)
                continue
            if not leaf.sharded:
                out.append(next(whole_done))
                continue
            if isinstance(v, Sharded) and v.shape == leaf.shape and v.by == leaf.by:
                out.append(v.shard.astype(leaf.dtype))
                continue
            if isinstance(v, Sharded):
                v = gather(chunks, [v], trace, f"new_state{path_str(path)} changed shape")[0]
            v = as_whole("new_state", path, v)
            trace.gathered_ops.append(f"new_state{path_str(path)} computed whole, then sliced")
            out.append(chunks.slice(jnp.asarray(v, leaf.dtype), leaf.by).shard)
        return jax.tree.unflatten(layout.treedef, out)

    def _compiled(self, state, batch):
        """The jitted program for ``batch``'s signature: a batch of another size (or structure,
        or dtypes) is traced and partitioned anew, as ``jax.jit`` retraces, and checked first."""
        if self._placement is None:
            self.prepare(state, batch)
        key = signature(batch)
        self._batch_placement(batch)
        self._last = key  # what dp.trace, images and uneven read
        if key not in self._jitted:
            self._jitted[key] = self._build(batch, key)
        return self._jitted[key]

    def programs(self) -> list:
        """The jitted programs made so far, one per batch signature called or lowered."""
        return list(self._jitted.values())

    def layout_shapes(self):
        """The user-layout state as ``ShapeDtypeStruct`` leaves (what the step is traced with)."""
        layout = self.layout
        return jax.tree.unflatten(
            layout.treedef,
            [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, weak_type=leaf.weak_type) for leaf in layout.leaves],
        )

    def check_batch(self, batch) -> None:
        """Raises a ``ValueError`` naming the leaf when the replicas cannot split ``batch``."""
        check_batch(batch, self.replicas, self.mesh)

    def __call__(self, state, batch):
        self.check_batch(batch)
        if self.layout is None:
            state_layout.refuse_stored(state, "state", "step")  # placed by another step object
            raise ValueError("place the state with dp.place_state(state, batch) before calling the step")
        check_not_donated(state, "state")
        self.layout.check_stored(state)  # shapes and dtypes only: no device sync
        return self._compiled(state, batch)(state, batch)

    def lower(self, state, batch):
        """Lowers the step for a stored ``state`` and ``batch`` (arrays or ``ShapeDtypeStruct``;
        ``layout.stored_shapes()`` carry the stored shardings, so jit reuses the trace of a call or
        of an earlier lowering with the same signature instead of partitioning the step again)."""
        self.check_batch(batch)
        return self._compiled(state, batch).lower(state, batch)

    # -- moving state in and out --------------------------------------------------------------
    def place_state(self, state, batch=None):
        """Puts a host or single-device state pytree on the mesh in the stored layout.

        In a multi-process run every process must pass the same values (as after the same
        seeded init). The sharded weight update needs an example global ``batch`` (see
        :meth:`prepare`).
        """
        state = as_arrays(state)
        if self.layout is None:
            state_layout.refuse_stored(state, "state", "place")
        return self.prepare(state, batch).state.place(state)

    def gather_state(self, state):
        """Returns the state in the user layout as host numpy arrays, on every process. Refuses a
        state this step object did not place (:meth:`StateLayout.check_stored`: a leaf's shape is
        not the one this step stores it in), and, before this step has placed anything, a leaf
        stored flat by a sharded update, which it cannot read back without that step's layout."""
        check_not_donated(state, "state")
        if self.layout is None:  # nothing placed through this step: user-layout leaves are read as they are
            state_layout.refuse_stored(state, "state", "gather")
            return state_layout.decide(state, self.mesh, None, 1).fetch(state)
        self.layout.check_stored(state)
        return self.layout.fetch(state)

    def local_rows(self, global_batch: int) -> slice:
        """The rows of a global batch that this process feeds (contiguous by mesh construction)."""
        if global_batch % self.replicas:
            raise ValueError(
                f"global batch size {global_batch} is not divisible by the {self.replicas} replicas; "
                f"use a multiple of {self.replicas}"
            )
        index_map = self.batch_sharding.addressable_devices_indices_map((global_batch,))
        starts = sorted({idx[0].start or 0 for idx in index_map.values()})
        stops = sorted({idx[0].stop if idx[0].stop is not None else global_batch for idx in index_map.values()})
        rows = slice(starts[0], stops[-1])
        per_device = global_batch // self.replicas
        if (rows.stop - rows.start) != per_device * len(starts):
            raise ValueError(
                "this process's devices do not hold a contiguous block of the batch; build the mesh "
                "with podscale.make_mesh, which orders devices by process"
            )
        return rows

    def place_batch(self, local_batch, global_batch: int):
        """Builds the global batch from this process's rows (see :meth:`local_rows`)."""

        def put(x, sharding):
            x = np.asarray(x)
            return jax.make_array_from_process_local_data(sharding, x, (global_batch, *x.shape[1:]))

        return jax.tree.map(put, local_batch, self.batch_shardings(local_batch))


def partitioner(
    mesh: Mesh,
    roles: Roles,
    batch_rows: int | None,
    tables: dict,
    *,
    independent_rng: bool = False,
    fsdp: bool = False,
    min_chunk: int = 1,
    chunk_partials: bool | None = None,
) -> Partitioner:
    """The :class:`Partitioner` of a program placed by ``roles`` on ``mesh``: over the data axes,
    its batch of ``batch_rows`` global rows, ``tables`` (``{global shape: rows per replica}``) split
    by rows, the space and model axes' regions and convolutions as the step partitions them. The
    step's and the evaluation's replay (:mod:`podscale.train.evaluate`) are made here, alike."""
    group, space, model, partitions = roles.group, roles.space, roles.model, roles.partitions
    return Partitioner(
        roles.data,
        roles.replicas(mesh),
        group,
        mesh.shape[group] if group else 1,
        batch_rows,
        independent_rng=independent_rng,
        platform=mesh.devices.flat[0].platform,
        conv_axes=partitions if len(partitions) > 1 else ((space,) if space else ()),
        conv_size=mesh.shape[space] if space else 1,
        region_axes={
            role: (axis, mesh.shape[axis]) for role, axis in (("space", space), ("model", model)) if axis is not None
        },
        tables=tables,
        fsdp=fsdp,
        min_chunk=min_chunk,
        chunk_partials=chunk_partials,
    )


def data_parallel(
    step: Step, mesh: Mesh, strategy: Strategy | None = None, *, donate_state: bool = True, **options
) -> DataParallelStep:
    """Runs an unmodified single-device ``step(state, batch)`` data-parallel over ``mesh``.

    One call on a global batch gives the new state and metrics that ``step`` gives on that whole
    batch on one device, up to float summation order, whatever the loss (a mean, a sum, a mean over
    the non-padding rows), optimizer, dropout or batch norm; see the module docstring. Batch norm
    over groups of replicas is opt-in (``make_mesh(bn_group_size=k)``).

    ``strategy`` (:class:`podscale.Strategy`) says how: the weight update (``"replicated"`` or
    ``"sharded"``), how gradients are summed (1-D or 2-D, chunks, dtype, bucket size), ``strict``.
    Its fields may also be given as keywords, alone or to change a given strategy:
    ``data_parallel(step, mesh, weight_update="sharded")``. ``donate_state=False`` keeps the
    input state usable after a call.
    """
    if not callable(step):
        raise TypeError(f"data_parallel(step, mesh): step must be callable, got {type(step).__name__}")
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"data_parallel(step, mesh): mesh must be a jax.sharding.Mesh (see podscale.make_mesh), got {type(mesh).__name__}"
        )
    if strategy is not None and not isinstance(strategy, Strategy):
        raise TypeError(f"data_parallel(step, mesh, strategy): strategy must be a podscale.Strategy, got {strategy!r}")
    known = {f.name for f in dataclasses.fields(Strategy)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"data_parallel: unknown options {unknown}; a Strategy has {sorted(known)}")
    strategy = dataclasses.replace(strategy or Strategy(), **options)
    return DataParallelStep(step, mesh, strategy, donate_state=donate_state)
