"""Building a data-parallel step: its placement, its per-replica program and its jitted program.

Plain functions of what they read (the mesh, the axes' roles, the strategy, the gradient sum, the
placement); :class:`~podscale.parallel.engine.DataParallelStep` keeps what they return, by batch
signature. In order:

- :class:`GlobalTraces`: the user's step traced once at the global shapes (the specification);
- :func:`place`: the step's :class:`~podscale.parallel.placement.Placement`: which state leaves
  the forward pass reads (:func:`forward_inputs`), the embedding tables, the sharding rules'
  splits, the state's layout and the example batch's (:func:`batch_placement`);
- :func:`local_program`: the per-replica program of the global trace, partitioned over the data
  axes by :func:`partitioner`;
- :func:`build`: that program replayed with the weight update's layouts
  (:mod:`podscale.parallel.weight_update`) inside a ``shard_map`` manual over the data axes, and
  jitted: a :class:`Program`, whose :class:`~podscale.parallel.weight_update.Trace` is filled when
  it is traced.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from podscale.parallel import checks, spatial, state_layout, tables, tensor
from podscale.parallel.gradsum import GradSum
from podscale.parallel.partition import REPLICATED, Partitioner, Setup, Split
from podscale.parallel.placement import BatchPlacement, Placement, Roles
from podscale.parallel.program import (
    GlobalTrace,
    KeptApart,
    Step,
    as_whole,
    check_kept_shapes,
    path_str,
    shape_structs,
    trace_global,
)
from podscale.parallel.state_layout import StateLayout
from podscale.parallel.stored import Whole
from podscale.parallel.strategy import Strategy
from podscale.parallel.weight_update import Layout, Rewriter, Sharded, Trace, forward_used, gather


@dataclasses.dataclass
class Program:
    """One batch signature's jitted program and what tracing it recorded."""

    jitted: Any = None
    """The ``jax.jit`` of the step's ``shard_map``, or a :class:`~podscale.parallel.program.KeptApart`
    of it (weights passed apart, not donated): ``jitted(stored_state, batch)``, ``jitted.lower(...)``."""
    trace: Trace | None = None
    """What the traced program does (collectives, gathered ops), for the plan; set when ``jitted``
    is traced (its first call or lowering)."""


class GlobalTraces:
    """The user's step traced at the global shapes (:func:`~podscale.parallel.program.trace_global`),
    the last (state, batch) shapes asked for kept: placing a batch and building its program read
    the same trace."""

    def __init__(self, step: Step, roles: Roles):
        self.step, self.group = step, roles.group
        self._last: tuple | None = None

    def __call__(self, abstract_state, batch) -> GlobalTrace:
        key = (
            jax.tree.structure(abstract_state),
            tuple(jax.tree.leaves(abstract_state)),
            jax.tree.structure(batch),
            tuple(jax.tree.leaves(shape_structs(batch))),
        )
        if self._last is None or self._last[0] != key:
            self._last = (key, trace_global(self.step, abstract_state, shape_structs(batch), self.group))
        return self._last[1]


def layout_shapes(layout: StateLayout):
    """The user-layout state as ``ShapeDtypeStruct`` leaves (what the step is traced with)."""
    return jax.tree.unflatten(
        layout.treedef,
        [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, weak_type=leaf.weak_type) for leaf in layout.leaves],
    )


# -- the placement ------------------------------------------------------------------------------
def place(
    mesh: Mesh, roles: Roles, strategy: Strategy, grad_sum: GradSum, traced: GlobalTraces, abstract, batch
) -> Placement:
    """The placement of a state of shapes ``abstract`` (``ShapeDtypeStruct`` leaves) on ``mesh``:
    the step is traced at the global shapes of ``batch`` (a checked global batch, or ``None``,
    refused where the decision needs it) and each state and batch leaf's layout decided."""
    forward = None
    if batch is not None:
        forward = forward_inputs(mesh, roles, strategy, traced(abstract, batch), abstract, batch)
    elif roles.space:
        raise ValueError(
            f"the space axis {roles.space!r} needs an example global batch to find the images and check "
            "their heights: call place_state(state, batch) or prepare(state, batch)"
        )
    elif strategy.sharded:
        raise ValueError(
            "weight_update='sharded' needs an example global batch to decide which state "
            "leaves the forward pass reads: call place_state(state, batch) or prepare(state, batch)"
        )
    replicas = roles.replicas(mesh)
    found, looked_up, min_rows, gt, kin = {}, set(), {}, None, None
    if batch is not None:
        batch_rows = jax.tree.leaves(batch)[0].shape[0]
        gt = traced(abstract, batch)
        ids = tables.lookups(gt.closed.jaxpr, gt.n_state)
        looked_up = set(ids)
        kin = tables.state_kin(gt.closed.jaxpr, gt.n_state, looked_up) if looked_up else None
        min_rows = tables.thresholds(ids, batch_rows, strategy.min_table_rows)
        if strategy.min_table_rows is not None and not looked_up:
            checks.warn(
                f"min_table_rows={strategy.min_table_rows}: the step looks up no weight by rows (it has no "
                "embedding table), so there is nothing to split by rows and it changes nothing; drop it",
                checks.PodscaleWarning,
            )
    model_dims, notes = None, ()
    if roles.model:
        # The tables split by rows over the data axes where no rule splits them: not "left whole"
        split_by_rows = set(tables.choose(jax.tree.leaves(abstract), looked_up, forward, replicas, min_rows, kin))
        assignment = tensor.assign(
            strategy.rules,
            abstract,
            mesh.shape[roles.model],
            roles.model,
            weights=forward,
            strict=strategy.strict,
            split_by_rows=split_by_rows,
        )
        model_dims, notes = assignment.dims, tuple(assignment.notes)
    if batch is not None:
        ruled = {i for i, d in enumerate(model_dims or ()) if d is not None}  # a rule's split wins
        found = tables.choose(jax.tree.leaves(abstract), looked_up - ruled, forward, replicas, min_rows, kin)
        found = {i: rows for i, rows in found.items() if i not in ruled}
    layout = state_layout.decide(
        abstract,
        mesh,
        forward,
        strategy.min_shard_size,
        shard=strategy.sharded,
        order=grad_sum.order,
        parts=roles.partitions,
        model=roles.model,
        model_dims=model_dims,
        tables=found,
        fsdp=strategy.fsdp,
        dims=grad_sum.one_collective,
        partition_dims=state_layout.partition_dims(gt.closed.jaxpr, model_dims)
        if model_dims and gt is not None
        else None,
        chunk_axes=roles.chunks,
    )
    example = batch_placement(mesh, roles, strategy, traced, abstract, batch) if batch is not None else BatchPlacement()
    looked = tuple(sorted(looked_up))
    return Placement(mesh, roles, layout, example, model_dims, notes, looked, tuple(min_rows[i] for i in looked))


def batch_placement(mesh: Mesh, roles: Roles, strategy: Strategy, traced: GlobalTraces, abstract, batch):
    """The placement of ``batch``'s signature: with a space axis its image leaves, windows and the
    layers whose height the axis does not divide (refused with ``strict``)."""
    if not roles.space:
        return BatchPlacement(tuple(False for _ in jax.tree.leaves(batch)))
    found = tuple(spatial.windows(traced(abstract, batch).closed.jaxpr))
    shapes = [tuple(np.shape(x)) for x in jax.tree.leaves(batch)]
    images = spatial.image_leaves(shapes, list(found))
    split = [s for s, im in zip(shapes, images, strict=True) if im]
    uneven = spatial.check(list(found), mesh.shape[roles.space], roles.space, split, strategy.strict)
    return BatchPlacement(tuple(images), found, tuple(uneven))


def forward_inputs(mesh: Mesh, roles: Roles, strategy: Strategy, gt: GlobalTrace, abstract, batch) -> set[int]:
    """The state leaves (by index) the forward pass reads: the per-replica program's data flow
    from its batch (one replica: see ``forward_used``)."""
    found: list[set[int]] = []
    state_leaves = jax.tree.leaves(abstract)
    replicas = roles.replicas(mesh)

    def probe(batch):
        closed, _ = local_program(mesh, roles, strategy, gt, state_leaves, jax.tree.leaves(batch))
        seeds = closed.jaxpr.invars[gt.n_state :] if replicas == 1 else None  # one replica: see forward_used
        used = forward_used(closed.jaxpr, seeds)
        found.append({i for i, v in enumerate(closed.jaxpr.invars[: gt.n_state]) if v in used})
        return jnp.zeros(())

    mapped = jax.shard_map(
        probe,
        mesh=mesh,
        in_specs=(P(roles.data),),
        out_specs=P(),
        axis_names=set(roles.data),
        check_vma=replicas > 1,
    )
    jax.eval_shape(mapped, shape_structs(batch))
    return found[0]


# -- the per-replica program --------------------------------------------------------------------
def partitioner(
    mesh: Mesh,
    roles: Roles,
    batch_rows: int | None,
    leaves: Sequence[state_layout.LeafLayout] = (),
    *,
    independent_rng: bool = False,
    fsdp: bool = False,
    min_chunk: int = 1,
    chunk_partials: bool | None = None,
) -> Partitioner:
    """The :class:`Partitioner` of a program placed by ``roles`` on ``mesh``: over the data axes,
    its batch of ``batch_rows`` global rows, the state ``leaves`` it is given as the placement
    stores them (the tables among them split by rows; none for the evaluation's replay, whose
    jaxpr's inputs are the ones it reads), the space and model axes' regions and convolutions as
    the step partitions them. The step's and the evaluation's replay
    (:mod:`podscale.train.evaluate`) are made here, alike."""
    group, space, model, partitions = roles.group, roles.space, roles.model, roles.partitions
    setup = Setup(
        axes=roles.data,
        n=roles.replicas(mesh),
        chunk_axes=roles.chunk_axes,
        chunk_size=math.prod(mesh.shape[a] for a in roles.chunk_axes),
        group_axis=group,
        group_size=mesh.shape[group] if group else 1,
        batch_rows=batch_rows,
        platform=mesh.devices.flat[0].platform,
        conv_axes=partitions if len(partitions) > 1 else ((space,) if space else ()),
        conv_size=mesh.shape[space] if space else 1,
        region_axes={
            role: (axis, mesh.shape[axis]) for role, axis in (("space", space), ("model", model)) if axis is not None
        },
        table_leaves={i: leaf.stored.rows for i, leaf in enumerate(leaves) if leaf.table},
        fsdp=fsdp,
        min_chunk=min_chunk,
        chunk_partials=chunk_partials,
        independent_rng=independent_rng,
    )
    return Partitioner(setup)


def local_program(
    mesh: Mesh, roles: Roles, strategy: Strategy, gt: GlobalTrace, state_leaves, batch_leaves, leaves=None
) -> tuple[Any, Partitioner]:
    """The per-replica program of the global trace: a closed jaxpr, made inside the
    ``shard_map`` (its inputs typed per replica), with every output whole but the state leaves
    stored split (``leaves``, the state's :class:`~podscale.parallel.state_layout.LeafLayout`:
    a table's rows, an FSDP chunk; their ``state_leaves`` this replica's piece), which come
    back in their stored layout."""
    stored = [leaf.partition_layout for leaf in leaves] if leaves else [REPLICATED] * len(state_leaves)
    rows = np.shape(batch_leaves[0])[0] * roles.replicas(mesh) if batch_leaves else None
    part = partitioner(
        mesh,
        roles,
        rows,
        leaves or (),
        independent_rng=strategy.rng == "independent",
        fsdp=strategy.fsdp and leaves is not None,  # the forward pass's probe: the plain program
        min_chunk=strategy.min_shard_size,
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


# -- the jitted program -------------------------------------------------------------------------
def build(
    mesh: Mesh,
    roles: Roles,
    strategy: Strategy,
    grad_sum: GradSum,
    placement: Placement,
    traced: GlobalTraces,
    batch,
    *,
    batch_shardings,
    donate_state: bool = True,
) -> Program:
    """The jitted step for ``batch``'s signature (its leaves placed ``batch_shardings``, as
    ``place_batch`` places a batch), in a :class:`Program` whose ``trace`` tracing it fills."""
    program = Program()
    layout = placement.state
    axes, model, replicas = roles.data, roles.model, roles.replicas(mesh)
    chunks = Layout(
        grad_sum,
        strategy.min_shard_size,
        scatter=strategy.sharded,
        bucket_bytes=strategy.bucket_bytes,
        split=roles.split(mesh),  # as layout.leaves' chunks
        model_split=mesh.shape[model] if model else 1,
        model_axis=model if roles.partitions == (model,) else None,
        platform=mesh.devices.flat[0].platform,
    )
    abstract_state = layout_shapes(layout)
    model_dims = placement.model_dims or (None,) * len(layout.leaves)  # a rule's, sharded leaves' too
    gt = traced(abstract_state, batch)

    def body(stored, batch):
        trace = Trace()
        state_in = [
            x if leaf.table or leaf.chunked else shape
            for x, shape, leaf in zip(jax.tree.leaves(stored), jax.tree.leaves(abstract_state), layout.leaves)
        ]
        closed, part = local_program(mesh, roles, strategy, gt, state_in, jax.tree.leaves(batch), layout.leaves)
        rewriter = Rewriter(chunks, trace, list(zip(model_dims, (leaf.weight for leaf in layout.leaves), strict=True)))
        args = [
            Sharded(x, leaf.shape, leaf.stored.by) if leaf.sharded else x
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
        new_state = _finish_state(layout, chunks, trace, new_state)
        pairs = jax.tree_util.tree_leaves_with_path(metrics, is_leaf=lambda x: isinstance(x, Sharded))
        metrics = jax.tree.unflatten(
            jax.tree.structure(metrics, is_leaf=lambda x: isinstance(x, Sharded)),
            _finish_full(chunks, trace, pairs, "metrics"),
        )
        program.trace = trace
        if strategy.strict and (trace.gathered_ops or trace.whole_ops):
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
        mesh=mesh,
        in_specs=(specs, P(axes)),
        out_specs=(specs, P()),
        axis_names=set(axes),
        check_vma=replicas > 1,
    )
    out_shardings = (layout.shardings(), NamedSharding(mesh, P()))
    gathered = donate_state and replicas > 1  # one replica gathers nothing
    kept = frozenset(i for i, leaf in enumerate(layout.leaves) if gathered and _gathered(strategy, leaf))
    if not kept:
        program.jitted = jax.jit(
            mapped,
            in_shardings=(layout.shardings(), batch_shardings),
            out_shardings=out_shardings,
            donate_argnums=(0,) if donate_state else (),
        )
        return program
    shardings = layout.treedef.flatten_up_to(layout.shardings())

    def body(donated, kept_leaves, batch):  # named as the step's program is (compiled.hlo's op names)
        given, others = iter(donated), iter(kept_leaves)
        leaves = [next(others) if i in kept else next(given) for i in range(len(shardings))]
        return mapped(jax.tree.unflatten(layout.treedef, leaves), batch)

    inner = jax.jit(
        body,
        in_shardings=(
            [s for i, s in enumerate(shardings) if i not in kept],
            [s for i, s in enumerate(shardings) if i in kept],
            batch_shardings,
        ),
        out_shardings=out_shardings,
        donate_argnums=(0,),
    )
    program.jitted = KeptApart(inner, layout.treedef, kept)
    return program


def _gathered(strategy: Strategy, leaf) -> bool:
    """Whether the sharded update makes ``leaf``'s new value by gathering its updated chunks: a
    float weight stored whole, large enough to be updated on chunks. Such a leaf is not donated.
    XLA:TPU cannot gather into a donated buffer: it copies the donated weight at the start and
    the gathered value into it at the end, two copies of every weight a step (transformer-big full
    on v3:2x2, 1.7 GB; the update term 10.9 -> 6.4 ms without them, docs/benchmarks.md)."""
    inexact = jnp.issubdtype(leaf.dtype, jnp.inexact)  # as the update's chunks are chosen (Layout.shards)
    big = math.prod(leaf.shape) >= strategy.min_shard_size
    return strategy.sharded and leaf.weight and isinstance(leaf.stored, Whole) and inexact and big


def _finish_full(chunks: Layout, trace: Trace, pairs, kind) -> list:
    """Values that must come out whole, as ``(path, value)`` pairs: sharded ones are
    all-gathered (fused)."""
    leaves = [v for _, v in pairs]
    shards = [i for i, v in enumerate(leaves) if isinstance(v, Sharded)]
    why = "updated weights" if kind == "new_state" else kind
    gathered = gather(chunks, [leaves[i] for i in shards], trace, why, update=kind == "new_state") if shards else []
    for i, g in zip(shards, gathered, strict=True):
        leaves[i] = g
    return [as_whole(kind, path, v) for (path, _), v in zip(pairs, leaves, strict=True)]


def _finish_state(layout: StateLayout, chunks: Layout, trace: Trace, new_state):
    """The new state in its stored layout: a sharded leaf as this replica's chunk, the rest whole."""
    paths_leaves = jax.tree_util.tree_leaves_with_path(new_state, is_leaf=lambda x: isinstance(x, Sharded))
    whole = [
        (p, v)
        for (p, v), leaf in zip(paths_leaves, layout.leaves, strict=True)
        if not leaf.sharded and not leaf.table and not leaf.chunked
    ]
    whole_done = iter(_finish_full(chunks, trace, whole, "new_state"))
    out = []
    for (path, v), leaf in zip(paths_leaves, layout.leaves, strict=True):
        if leaf.table or leaf.chunked:  # this replica's rows or chunk, as stored
            out.append(v)
            continue
        if not leaf.sharded:
            out.append(next(whole_done))
            continue
        if isinstance(v, Sharded) and v.shape == leaf.shape and v.by == leaf.stored.by:
            out.append(v.shard.astype(leaf.dtype))
            continue
        if isinstance(v, Sharded):
            v = gather(chunks, [v], trace, f"new_state{path_str(path)} changed shape")[0]
        v = as_whole("new_state", path, v)
        trace.gathered_ops.append(f"new_state{path_str(path)} computed whole, then sliced")
        out.append(chunks.slice(jnp.asarray(v, leaf.dtype), leaf.stored.by).shard)
    return jax.tree.unflatten(layout.treedef, out)
