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

Building all this (the placement, the per-replica program, the jitted ``shard_map``) is
:mod:`podscale.parallel.compile_step`'s, as plain functions; this module keeps the step a user
holds (:class:`DataParallelStep`: its programs by batch signature, placing state and batches),
:func:`data_parallel`, and ``partitioner`` (re-exported from there for the evaluation).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh

from podscale.parallel import checks, state_layout, tensor
from podscale.parallel.compile_step import (
    GlobalTraces,
    Program,
    batch_placement,
    build,
    layout_shapes,
    partitioner,
    place,
)
from podscale.parallel.gradsum import make_grad_sum
from podscale.parallel.mesh import auto_axes
from podscale.parallel.placement import BatchPlacement, Placement, Roles, batch_shardings, local_rows
from podscale.parallel.program import (
    Step,
    as_arrays,
    check_batch,
    check_not_donated,
    shape_structs,
    signature,
)
from podscale.parallel.strategy import Strategy
from podscale.parallel.together import launch_together
from podscale.parallel.weight_update import Trace

__all__ = ["DataParallelStep", "data_parallel", "partitioner"]


class DataParallelStep:
    """A compiled data-parallel step and the layouts of its inputs.

    Call it as ``new_state, metrics = dp(state, batch)`` with ``state`` from :meth:`place_state`
    (the *stored* layout: with the sharded weight update, optimizer-state leaves are flat 1/N
    chunks) and a *global* ``batch`` whose leading dimension the replica count divides. The state
    argument is donated (``donate_state``), but for the weights the sharded update gathers from
    their updated chunks. :meth:`gather_state` returns the plain pytree. The step is built by
    :mod:`podscale.parallel.compile_step`; what it reads is ``dp.strategy``, ``dp.roles`` (the axes)
    and ``dp.placement`` (the state's and the example batch's layouts).
    """

    def __init__(self, step: Step, mesh: Mesh, strategy: Strategy | None = None, *, donate_state: bool = True):
        self.step, self.mesh = step, auto_axes(mesh)  # a jax.make_mesh mesh's Explicit axes are taken as Auto
        self.strategy = st = strategy or Strategy()
        self.donate_state = checks.boolean("donate_state", donate_state)
        self.roles = Roles.of(st, mesh)
        """Each mesh axis's role, by name (:class:`~podscale.parallel.placement.Roles`)."""
        if self.roles.model and st.rules is None:
            raise ValueError(
                f"the model axis {self.roles.model!r} needs sharding rules: pass rules=Rules(...) or a "
                f"built-in's name ({', '.join(tensor.RULES)})"
            )
        self.grad_sum = make_grad_sum(mesh, axes=self.roles.data, **st.grad_sum_options)
        # Caches, by signature; none of them changes what a call computes.
        self._placement: Placement | None = None
        """The placement: made once, by the first :meth:`prepare` (or placed state), never changed."""
        self._traced = GlobalTraces(step, self.roles)
        self._batches: dict[tuple, BatchPlacement] = {}
        """Each batch signature's placement (its images and windows), as the step traced it."""
        self._programs: dict[tuple, Program] = {}
        """One jitted program (and its trace) per batch signature, as ``jax.jit`` retraces."""
        self._last: tuple | None = None
        self._launched: set[tuple] = set()
        """The signatures called once: launched together (:func:`~podscale.parallel.together.launch_together`)."""

    @property
    def replicas(self) -> int:
        """Data-parallel replicas: the devices of the data axes (a space axis splits images)."""
        return self.roles.replicas(self.mesh)

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

    @property
    def trace(self) -> Trace | None:
        """What the last signature compiled or called does (collectives, gathered ops), for the plan."""
        program = self._programs.get(self._last)
        return program and program.trace

    def batch_shardings(self, batch):
        """Each batch leaf's sharding: rows over the data axes and, with ``spatial``, the height of
        every image (a rank-4 NHWC leaf) over the space axis, which XLA's SPMD partitioner then
        keeps through convolutions and pooling, exchanging halos between neighbours."""
        if self.roles.space is not None and self._placement is None:
            raise ValueError("place the state with dp.place_state(state, batch) before placing batches")
        windows = dict.fromkeys(w for b in self._batches.values() for w in b.windows)  # every signature's
        return batch_shardings(self.mesh, self.roles, batch, tuple(windows))

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
        if self._placement is None:
            self._placement = place(self.mesh, self.roles, self.strategy, self.grad_sum, self._traced, abstract, batch)
            if batch is not None:  # the example batch's signature
                self._batches[signature(batch)] = self._placement.batch
        elif batch is not None:
            self._batch_placement(batch, abstract)
        return self._placement

    def plan(self, state=None, batch=None, *, compile: bool = False):
        """What the step does, before running it: see :class:`podscale.parallel.plan.Plan`.

        ``state`` (user layout) and ``batch`` may be arrays or ``ShapeDtypeStruct``; they can be
        left out once the step has been prepared and traced. ``compile=True`` also compiles the
        step (for ``batch``) and reads the collectives and memory per device from the compiled
        module, so that the plan states what runs.
        """
        from podscale.compiled import hlo, tpu
        from podscale.parallel.plan import make_plan

        if state is not None:
            self.prepare(state, batch)
        if self.trace is None or compile:
            if batch is None:
                raise ValueError("plan() needs an example global batch the first time, and to compile")
            lowered = self.lower(self.placement.stored_shapes(), shape_structs(batch))
        module = hlo.read(lowered.compile(tpu.options_for(self.mesh)), self.mesh) if compile else None
        return make_plan(self.placement, self.trace, self.grad_sum, self.strategy, module, self._batch_placement())

    def _batch_placement(self, batch=None, abstract=None) -> BatchPlacement | None:
        """The placement of ``batch``'s signature (the last one called without ``batch``), made once."""
        if batch is None:
            return self._batches.get(self._last) or (self._placement and self._placement.batch)
        key = signature(batch)
        if key not in self._batches:
            abstract = abstract if abstract is not None else layout_shapes(self.layout)
            self._batches[key] = batch_placement(self.mesh, self.roles, self.strategy, self._traced, abstract, batch)
        return self._batches[key]

    def _compiled(self, state, batch):
        """The jitted program for ``batch``'s signature: a batch of another size (or structure,
        or dtypes) is traced and partitioned anew, as ``jax.jit`` retraces, and checked first."""
        if self._placement is None:
            self.prepare(state, batch)
        key = signature(batch)
        self._batch_placement(batch)
        self._last = key  # what dp.trace reads
        if key not in self._programs:
            self._programs[key] = build(
                *(self.mesh, self.roles, self.strategy, self.grad_sum, self.placement, self._traced, batch),
                batch_shardings=self.batch_shardings(batch),  # as place_batch places a batch
                donate_state=self.donate_state,
            )
        return self._programs[key].jitted

    def programs(self) -> list:
        """The jitted programs made so far, one per batch signature called or lowered."""
        return [program.jitted for program in self._programs.values()]

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
        jitted = self._compiled(state, batch)  # sets self._last, the batch's signature
        return launch_together(self._launched, self._last, jitted, (state, batch), "the train step")(state, batch)

    def lower(self, state, batch):
        """Lowers the step for a stored ``state`` and ``batch`` (arrays or ``ShapeDtypeStruct``;
        ``layout.stored_shapes()`` carry the stored shardings, so jit reuses the trace of a call or
        of an earlier lowering with the same signature instead of partitioning the step again)."""
        self.check_batch(batch)
        return self._compiled(state, batch).lower(state, batch)

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
        return local_rows(self.mesh, self.roles, global_batch)

    def place_batch(self, local_batch, global_batch: int):
        """Builds the global batch from this process's rows (see :meth:`local_rows`)."""

        def put(x, sharding):
            x = np.asarray(x)
            return jax.make_array_from_process_local_data(sharding, x, (global_batch, *x.shape[1:]))

        return jax.tree.map(put, local_batch, self.batch_shardings(local_batch))


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
