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
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from podscale import _interpret
from podscale.mesh import replica_count

Step = Callable[[Any, Any], tuple[Any, Any]]

GRAD_SUM = "psum_invariant"  # the primitive a replicated value's gradient is summed with


def _path(path) -> str:
    return jax.tree_util.keystr(path)


def _mean_rule(mesh: Mesh):
    def rule(eqn, invals):
        outs = eqn.primitive.bind(*invals, **eqn.params)
        outs = outs if eqn.primitive.multiple_results else [outs]
        n = math.prod(mesh.shape[a] for a in eqn.params["axes"])
        return [o / jnp.asarray(n, o.dtype) if jnp.issubdtype(o.dtype, jnp.inexact) else o for o in outs]

    return rule


def _is_key(x) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _varying_axes(x) -> frozenset:
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)  # JAX 0.10 names it so; older: ``aval.vma``
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def _replica_mean(kind: str, axes: tuple[str, ...]):
    def fix(path, x):
        varying = tuple(a for a in axes if a in _varying_axes(x))
        if not varying:
            return x
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            raise ValueError(
                f"{kind}{_path(path)} ({x.dtype}{list(x.shape)}) differs across replicas and is not a "
                "float, so podscale cannot average it. Compute it without the batch, or return it "
                "as a float mean."
            )
        return jax.lax.pmean(x, varying)

    return fix


@dataclasses.dataclass(frozen=True)
class DataParallelStep:
    """A compiled data-parallel step and the shardings of its inputs.

    Call it as ``new_state, metrics = dp(state, batch)`` with ``state`` from :meth:`place_state`
    and a *global* ``batch`` whose leading dimension the replica count divides. The state argument
    is donated.

    Attributes:
      step: the user's single-device step, unchanged.
      mesh: the device mesh; every device is one replica and the batch is split over all axes.
      state_sharding: replicated over the mesh.
      batch_sharding: leading dimension split over all mesh axes.
    """

    step: Step
    mesh: Mesh
    donate_state: bool = True

    @property
    def replicas(self) -> int:
        return replica_count(self.mesh)

    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(self.mesh.axis_names)

    @property
    def state_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    @property
    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(self.axes))

    @functools.cached_property
    def _compiled(self):
        axes = self.axes

        def body(state, batch):
            closed, out_tree = _interpret.trace(self.step, state, batch)
            leaves = jax.tree.leaves((state, batch))
            outs = _interpret.evaluate(closed.jaxpr, closed.consts, leaves, {GRAD_SUM: _mean_rule(self.mesh)})
            try:
                new_state, metrics = jax.tree.unflatten(out_tree, outs)
            except (TypeError, ValueError):
                raise TypeError("the step must return a pair (new_state, metrics)") from None
            new_state = jax.tree_util.tree_map_with_path(_replica_mean("new_state", axes), new_state)
            metrics = jax.tree_util.tree_map_with_path(_replica_mean("metrics", axes), metrics)
            return new_state, metrics

        mapped = jax.shard_map(body, mesh=self.mesh, in_specs=(P(), P(axes)), out_specs=(P(), P()))
        return jax.jit(
            mapped,
            in_shardings=(self.state_sharding, self.batch_sharding),
            out_shardings=(self.state_sharding, self.state_sharding),
            donate_argnums=(0,) if self.donate_state else (),
        )

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
        return self._compiled(state, batch)

    def lower(self, state, batch):
        """Lowers the step for ``state`` and ``batch`` (arrays or ``jax.ShapeDtypeStruct``)."""
        self.check_batch(batch)
        return self._compiled.lower(state, batch)

    def place_state(self, state):
        """Puts a host or single-device state pytree on the mesh, replicated.

        In a multi-process run every process must pass the same values (as after the same
        seeded init). Arrays already carrying ``state_sharding`` are kept as they are.
        """
        sharding = self.state_sharding

        def put(x):
            if isinstance(x, jax.Array) and x.sharding == sharding:
                return x
            if _is_key(x):  # typed PRNG keys travel as their raw key data
                return jax.random.wrap_key_data(put(jax.random.key_data(x)), impl=jax.random.key_impl(x))
            x = np.asarray(x)
            return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

        return jax.tree.map(put, state)

    def gather_state(self, state):
        """Returns the state as a pytree of host numpy arrays (typed PRNG keys stay keys), on every process."""

        def get(x):
            if not isinstance(x, jax.Array):
                return np.asarray(x)
            if _is_key(x):
                return jax.random.wrap_key_data(get(jax.random.key_data(x)), impl=jax.random.key_impl(x))
            if x.is_fully_replicated:
                return np.asarray(x.addressable_data(0))
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))

        return jax.tree.map(get, state)

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


def data_parallel(step: Step, mesh: Mesh, *, donate_state: bool = True) -> DataParallelStep:
    """Runs an unmodified single-device ``step(state, batch)`` data-parallel over ``mesh``.

    One call on a global batch gives the new state that ``step`` gives on that whole batch on one
    device, provided the step's loss is a mean over its batch (the usual convention), up to float
    summation order. Batch-norm-like layers use each replica's own batch statistics; see the
    module docstring.
    """
    if not callable(step):
        raise TypeError(f"data_parallel(step, mesh): step must be callable, got {type(step).__name__}")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"data_parallel(step, mesh): mesh must be a jax.sharding.Mesh (see podscale.make_mesh), got {type(mesh).__name__}")
    return DataParallelStep(step=step, mesh=mesh, donate_state=donate_state)
