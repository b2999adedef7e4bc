"""Data parallelism of an unmodified single-device training step.

The user writes ``step(state, batch) -> (new_state, metrics)`` for one device: ``jax.grad`` of a
loss that is a *mean over its batch*, an optax update, no collectives. ``data_parallel`` runs it
under ``shard_map`` with the state replicated and the batch split over every mesh axis.

How the gradient becomes the global-batch gradient. With ``check_vma=True``, a replicated value
(a parameter) that meets per-replica data is implicitly cast to "varying", and the transpose of
that cast, i.e. the gradient with respect to the replicated value, is a ``psum_invariant`` over
the mesh axes: the *sum* of the replicas' local gradients. For a mean loss the single-device
gradient on the whole batch is the *mean* of those local gradients, so podscale traces the step
and rewrites every ``psum_invariant`` into a sum divided by the number of replicas it spans
(``_interpret.evaluate``). That is the only change; the optimizer then runs on identical values
on every replica, and the new state is replicated by construction.

Two kinds of values come out of a replica different from its peers, and both are averaged:
  * state leaves computed from the local batch without a gradient, such as batch-norm running
    statistics: each replica normalises with its *own* batch statistics (as data-parallel
    training does in practice), and the running averages are then averaged over replicas;
  * metrics, which are means over the local batch; their replica average is the global mean.
An integer that differs across replicas cannot be averaged and is an error naming its path.

``weight_update="sharded"`` replays the same trace with :mod:`podscale.weight_update`: the
gradient sums become a fused reduce-scatter, the update runs on 1/N shards, the optimizer state
stays sharded between steps (:mod:`podscale.state_layout`), and the new weights are all-gathered.
``weight_update="replicated"`` (the default) runs the same machinery with nothing sharded: the
gradient sums become one fused all-reduce.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from podscale.parallel import _interpret
from podscale.parallel import state_layout
from podscale.parallel.gradsum import make_grad_sum
from podscale.parallel.mesh import replica_count
from podscale.parallel.weight_update import DEFAULT_BUCKET_BYTES, DEFAULT_MIN_SHARD_SIZE, Layout, Rewriter, Sharded, Trace, forward_used, gather

Step = Callable[[Any, Any], tuple[Any, Any]]

GRAD_SUM = _interpret.GRAD_SUM
WEIGHT_UPDATES = ("replicated", "sharded")


def _path(path) -> str:
    return jax.tree_util.keystr(path)


def _mean_rule(mesh: Mesh):
    def rule(eqn, invals):
        outs = eqn.primitive.bind(*invals, **eqn.params)
        outs = outs if eqn.primitive.multiple_results else [outs]
        if not _interpret.is_grad_sum(eqn, mesh.axis_names):
            return outs
        n = math.prod(mesh.shape[a] for a in eqn.params["axes"])
        return [o / jnp.asarray(n, o.dtype) if jnp.issubdtype(o.dtype, jnp.inexact) else o for o in outs]

    return rule


def _shapes(tree):
    """``jax.ShapeDtypeStruct`` leaves for a tree of arrays or shape structs."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def _replica_mean(kind: str, axes: tuple[str, ...], path, x):
    varying = tuple(a for a in axes if a in _interpret.varying_axes(jax.typeof(x)))
    if not varying:
        return x
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        raise ValueError(
            f"{kind}{_path(path)} ({x.dtype}{list(x.shape)}) differs across replicas and is not a "
            "float, so podscale cannot average it. Compute it without the batch, or return it "
            "as a float mean."
        )
    return jax.lax.pmean(x, varying)


class DataParallelStep:
    """A compiled data-parallel step and the layouts of its inputs.

    Call it as ``new_state, metrics = dp(state, batch)`` with ``state`` from :meth:`place_state`
    (the *stored* layout: with the sharded weight update, optimizer-state leaves are flat 1/N
    chunks) and a *global* ``batch`` whose leading dimension the replica count divides. The state
    argument is donated. :meth:`gather_state` returns the plain pytree.
    """

    def __init__(self, step: Step, mesh: Mesh, *, weight_update: str = "replicated",
                 min_shard_size: int = DEFAULT_MIN_SHARD_SIZE, strict: bool = False, donate_state: bool = True,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, grad_sum: str = "1d", grad_sum_chunks: int | None = None,
                 grad_sum_dtype=None, axis_costs=None):  # fmt: skip
        if weight_update not in WEIGHT_UPDATES:
            raise ValueError(f"weight_update={weight_update!r}: choose one of {', '.join(WEIGHT_UPDATES)}")
        if min_shard_size < 1:
            raise ValueError(f"min_shard_size must be at least 1, got {min_shard_size}")
        self.step, self.mesh, self.weight_update = step, mesh, weight_update
        self.min_shard_size, self.strict, self.donate_state = min_shard_size, strict, donate_state
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be at least 1, got {bucket_bytes}")
        self.bucket_bytes = bucket_bytes
        self.grad_sum = make_grad_sum(mesh, grad_sum, grad_sum_chunks, grad_sum_dtype, axis_costs, nbytes=bucket_bytes)
        self.layout: state_layout.StateLayout | None = None
        self.trace: Trace | None = None
        self._jitted = None

    @property
    def sharded(self) -> bool:
        return self.weight_update == "sharded"

    @property
    def replicas(self) -> int:
        return replica_count(self.mesh)

    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(self.mesh.axis_names)

    @property
    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(self.axes))

    @property
    def state_sharding(self):
        """The stored state's shardings (a pytree once prepared; replicated before)."""
        return self.layout.shardings() if self.layout is not None else NamedSharding(self.mesh, P())

    # -- preparing the layout ---------------------------------------------------------------
    def prepare(self, state, batch=None) -> state_layout.StateLayout:
        """Decides each state leaf's layout from the traced step. Needs a (global) batch example
        (arrays or ``jax.ShapeDtypeStruct``) for the sharded update; idempotent."""
        abstract = _shapes(state)
        if self.layout is not None:
            self.layout.check(abstract)
            return self.layout
        forward = None
        if batch is not None:
            self.check_batch(batch)
            forward = self._forward_inputs(abstract, batch)
        elif self.sharded:
            raise ValueError(
                "weight_update='sharded' needs an example global batch to decide which state "
                "leaves the forward pass reads: call place_state(state, batch) or prepare(state, batch)"
            )
        self.layout = state_layout.decide(abstract, self.mesh, forward, self.min_shard_size, shard=self.sharded,
                                          order=self.grad_sum.order)  # fmt: skip
        return self.layout

    def plan(self, state=None, batch=None):
        """What the step does, before running it: see :class:`podscale.plan.Plan`.

        ``state`` (user layout) and ``batch`` may be arrays or ``ShapeDtypeStruct``; they can be
        left out once the step has been prepared and traced.
        """
        from podscale.parallel.plan import make_plan

        if state is not None:
            self.prepare(state, batch)
        if self.trace is None:
            if batch is None:
                raise ValueError("plan() needs an example global batch the first time")
            self.lower(self.layout.stored_shapes(), _shapes(batch))
        return make_plan(self)

    def _forward_inputs(self, abstract_state, batch) -> set[int]:
        found: list[set[int]] = []
        n_state = len(jax.tree.leaves(abstract_state))

        def probe(state, batch):
            closed, _ = _interpret.trace(self.step, state, batch)
            used = forward_used(closed.jaxpr)
            found.append({i for i, v in enumerate(closed.jaxpr.invars[:n_state]) if v in used})
            return jnp.zeros(())

        mapped = jax.shard_map(probe, mesh=self.mesh, in_specs=(P(), P(self.axes)), out_specs=P())
        jax.eval_shape(mapped, abstract_state, _shapes(batch))
        return found[0]

    # -- the step ---------------------------------------------------------------------------
    def _build(self):
        layout = self.layout
        axes = self.axes
        chunks = Layout(self.grad_sum, self.min_shard_size, scatter=self.sharded, bucket_bytes=self.bucket_bytes)
        abstract_state = jax.tree.unflatten(
            layout.treedef, [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in layout.leaves]
        )

        def body(stored, batch):
            trace = Trace()
            rewriter = Rewriter(chunks, trace, _mean_rule(self.mesh))
            closed, out_tree = _interpret.trace(self.step, abstract_state, batch)
            args = [Sharded(x, leaf.shape) if leaf.sharded else x for x, leaf in zip(jax.tree.leaves(stored), layout.leaves, strict=True)]
            outs = rewriter.run(closed, [*args, *jax.tree.leaves(batch)])
            outs = [rewriter.resolve(o) for o in outs]
            try:
                new_state, metrics = jax.tree.unflatten(out_tree, outs)
            except (TypeError, ValueError):
                raise TypeError("the step must return a pair (new_state, metrics)") from None
            layout.check(new_state, "the step's new_state")
            new_state = self._finish_state(chunks, trace, new_state)
            pairs = jax.tree_util.tree_leaves_with_path(metrics, is_leaf=lambda x: isinstance(x, Sharded))
            metrics = jax.tree.unflatten(
                jax.tree.structure(metrics, is_leaf=lambda x: isinstance(x, Sharded)),
                self._finish_full(chunks, trace, pairs, "metrics", "metrics"),
            )
            self.trace = trace
            return new_state, metrics

        specs = layout.specs()
        mapped = jax.shard_map(body, mesh=self.mesh, in_specs=(specs, P(axes)), out_specs=(specs, P()))
        return jax.jit(
            mapped,
            in_shardings=(layout.shardings(), self.batch_sharding),
            out_shardings=(layout.shardings(), NamedSharding(self.mesh, P())),
            donate_argnums=(0,) if self.donate_state else (),
        )

    def _finish_full(self, chunks, trace, pairs, kind, why) -> list:
        """Values that must come out whole, as ``(path, value)`` pairs: sharded ones are
        all-gathered (fused), per-replica ones averaged."""
        leaves = [v for _, v in pairs]
        shards = [i for i, v in enumerate(leaves) if isinstance(v, Sharded)]
        for i, g in zip(shards, gather(chunks, [leaves[i] for i in shards], trace, why) if shards else [], strict=True):
            leaves[i] = g
        return [_replica_mean(kind, self.axes, path, v) for (path, _), v in zip(pairs, leaves, strict=True)]

    def _finish_state(self, chunks, trace, new_state):
        layout = self.layout
        paths_leaves = jax.tree_util.tree_leaves_with_path(new_state, is_leaf=lambda x: isinstance(x, Sharded))
        whole = [(p, v) for (p, v), leaf in zip(paths_leaves, layout.leaves, strict=True) if not leaf.sharded]
        whole_done = iter(self._finish_full(chunks, trace, whole, "new_state", "updated weights"))
        out = []
        for (path, v), leaf in zip(paths_leaves, layout.leaves, strict=True):
            if not leaf.sharded:
                out.append(next(whole_done))
                continue
            if isinstance(v, Sharded) and v.shape == leaf.shape:
                out.append(v.shard.astype(leaf.dtype))
                continue
            if isinstance(v, Sharded):
                v = gather(chunks, [v], trace, f"new_state{_path(path)} changed shape")[0]
            v = _replica_mean("new_state", self.axes, path, v)
            trace.gathered_ops.append(f"new_state{_path(path)} computed whole, then sliced")
            out.append(chunks.slice(jnp.asarray(v, leaf.dtype)).shard)
        return jax.tree.unflatten(layout.treedef, out)

    def _compiled(self, state, batch):
        if self.layout is None:
            self.prepare(state, batch)
        if self._jitted is None:
            self._jitted = self._build()
        return self._jitted

    def check_batch(self, batch) -> None:
        """Raises a ``ValueError`` naming the leaf when the replicas cannot split ``batch``."""
        n = self.replicas
        for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
            shape = np.shape(leaf)
            if not shape:
                raise ValueError(f"batch{_path(path)} is a scalar; every batch leaf needs a leading batch dimension")
            if shape[0] % n:
                raise ValueError(
                    f"batch{_path(path)} has global batch size {shape[0]} (shape {list(shape)}), which the "
                    f"{n} replicas of mesh {dict(self.mesh.shape)} do not divide. Use a global batch "
                    f"that is a multiple of {n}, e.g. {max(n, shape[0] // n * n)}."
                )

    def __call__(self, state, batch):
        self.check_batch(batch)
        if self.layout is None:
            raise ValueError("place the state with dp.place_state(state, batch) before calling the step")
        new_state, metrics = self._compiled(state, batch)(state, batch)
        if self.strict and self.trace and self.trace.gathered_ops:
            raise ValueError(f"strict=True: these ops could not run on shards: {self.trace.gathered_ops}")
        return new_state, metrics

    def lower(self, state, batch):
        """Lowers the step for a stored ``state`` and ``batch`` (arrays or ``ShapeDtypeStruct``)."""
        self.check_batch(batch)
        return self._compiled(state, batch).lower(state, batch)

    # -- moving state in and out --------------------------------------------------------------
    def place_state(self, state, batch=None):
        """Puts a host or single-device state pytree on the mesh in the stored layout.

        In a multi-process run every process must pass the same values (as after the same
        seeded init). The sharded weight update needs an example global ``batch`` (see
        :meth:`prepare`).
        """
        return self.prepare(state, batch).place(state)

    def gather_state(self, state):
        """Returns the state in the user layout as host numpy arrays, on every process."""
        if self.layout is None:
            return state_layout.decide(state, self.mesh, None, 1).fetch(state)
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
        sharding = self.batch_sharding

        def put(x):
            x = np.asarray(x)
            return jax.make_array_from_process_local_data(sharding, x, (global_batch, *x.shape[1:]))

        return jax.tree.map(put, local_batch)


def data_parallel(step: Step, mesh: Mesh, *, weight_update: str = "replicated",
                  min_shard_size: int = DEFAULT_MIN_SHARD_SIZE, strict: bool = False,
                  donate_state: bool = True, bucket_bytes: int = DEFAULT_BUCKET_BYTES, grad_sum: str = "1d",
                  grad_sum_chunks: int | None = None, grad_sum_dtype=None, axis_costs=None) -> DataParallelStep:  # fmt: skip
    """Runs an unmodified single-device ``step(state, batch)`` data-parallel over ``mesh``.

    One call on a global batch gives the new state that ``step`` gives on that whole batch on one
    device, provided the step's loss is a mean over its batch (the usual convention), up to float
    summation order. Batch-norm-like layers use each replica's own batch statistics; see the
    module docstring.

    Args:
      weight_update: ``"replicated"`` (every replica runs the whole update) or ``"sharded"``
        (each replica updates 1/N of the weights and keeps 1/N of the optimizer state).
      min_shard_size: tensors with fewer elements stay replicated (sharded update only).
      strict: make it an error when an op of the update cannot run on shards.
      bucket_bytes: size of the fused gradient buffers (and, divided by the replica count, of
        the fused weight all-gathers); results do not depend on it.
      grad_sum: ``"1d"`` (one collective over all mesh axes) or ``"2d"`` on a 2-D mesh: gradients
        are reduce-scattered along one axis, all-reduced (or, with the sharded update,
        reduce-scattered) along the other, then all-gathered (see ``podscale.gradsum``).
      grad_sum_chunks: pipelined chunks per fused buffer for ``"2d"`` (default 4).
      grad_sum_dtype: sum gradients in this dtype (e.g. ``jnp.bfloat16``); opt-in.
      axis_costs: ``{axis: gradsum.AxisCost}`` from a topology, or ``"calibrate"``: decides which
        axis the 2-D sum goes along first. Without it, mesh order.
    """
    if not callable(step):
        raise TypeError(f"data_parallel(step, mesh): step must be callable, got {type(step).__name__}")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"data_parallel(step, mesh): mesh must be a jax.sharding.Mesh (see podscale.make_mesh), got {type(mesh).__name__}")
    return DataParallelStep(step, mesh, weight_update=weight_update, min_shard_size=min_shard_size,
                            strict=strict, donate_state=donate_state, bucket_bytes=bucket_bytes, grad_sum=grad_sum,
                            grad_sum_chunks=grad_sum_chunks, grad_sum_dtype=grad_sum_dtype, axis_costs=axis_costs)  # fmt: skip
