"""How a step is spread over a mesh: one value, written once.

``Strategy`` is what :func:`podscale.data_parallel` takes, what the trainer's ``TrainConfig``
holds, what ``podscale train``, ``plan`` and ``bench`` build their flags from (one flag per field,
its help the field's), and what the plan reports. Its fields check themselves when the value is
made, and their errors name the parameter; the CLI maps parameter names to flags in one place
(:func:`flag_name`).

The mesh axes get their roles here once, by name: the data axes (``data_axes``) split the batch;
the space axis (``space_axis``) splits every image's height; the model axis (``model_axis``) splits
the weights the sharding rules name. The command line's counts, ``spatial=k`` and
``model_parallel=k``, name no axis: they take the mesh's last axis, which must have k devices.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from podscale.compiled.gradsum_cost import AxisCost, parse_axis_costs
from podscale.parallel import checks
from podscale.parallel.gradsum import MODES, PHASES, check_phases
from podscale.parallel.mesh import BN_GROUP, mesh_advice
from podscale.parallel.tensor import RULES, Rules
from podscale.parallel.weight_update import DEFAULT_BUCKET_BYTES, DEFAULT_MIN_SHARD_SIZE

WEIGHT_UPDATES = ("replicated", "sharded", "fsdp")
RNGS = ("single-device", "independent")
SUM_DTYPES = ("float32", "bfloat16")


def _field(default, help: str, check, **flag):
    """A field with its help (the flag's), its ``check(name, value) -> value`` (run once, by
    ``__post_init__``, for every field) and the flag's options (``choices``, ``cli=False``)."""
    return dataclasses.field(default=default, metadata={"help": help, "check": check, **flag})


def _choice(choices):
    return lambda name, value: checks.one_of(name, value, choices)


def _count(optional: bool = False, what: str = ""):
    return lambda name, value: checks.whole(name, value, optional=optional, what=what)


def _data_axes(name, value):
    if value is None:
        return None
    axes = checks.names(name, value, "mesh axis names", f"({value!r},)" if isinstance(value, str) else "('x', 'y')")
    if not axes:
        raise ValueError(f"{name}=(): give at least one mesh axis, or None for every axis but a space or model axis")
    return axes


def _fsdp_axes(name, value):
    """A tuple of axis names, or one string of comma-separated names (the command line's form:
    ``"y"``, ``"x,y"``)."""
    if isinstance(value, str):
        value = tuple(a.strip() for a in value.split(","))
    if isinstance(value, tuple | list) and not value:
        raise ValueError(f"{name}=(): give at least one data axis to chunk over, or None for every data axis")
    return _data_axes(name, value)


def _axis_name(name, value):
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise TypeError(f"{name}={value!r} is {checks.described(value)}; give a mesh axis name (str), or None")
    return value


def _sum_dtype(name, value):
    if value is None:
        return None
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        raise TypeError(
            f"{name}={value!r} is {checks.described(value)}, not a dtype; give None, a float dtype such as jnp.bfloat16, "
            f"or its name ({', '.join(SUM_DTYPES)})"
        ) from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{name} must be a float type such as bfloat16, got {dtype.name}")
    return value


def _axis_costs(name, value):
    if value is None or value == "calibrate":
        return value
    if isinstance(value, str):
        return parse_axis_costs(value)
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{name}={value!r} is {checks.described(value)}; give None, 'calibrate', a text such as 'x=1e11:1e-6,y=4.5e10:1e-6' "
            "or a dict of mesh axis name -> podscale.compiled.gradsum_cost.AxisCost"
        )
    for axis, cost in value.items():
        if not isinstance(axis, str) or not isinstance(cost, AxisCost):
            raise TypeError(
                f"{name}[{axis!r}]={cost!r}: give a mesh axis name (str) -> "
                f"podscale.compiled.gradsum_cost.AxisCost(bandwidth, latency) for every entry of {name}"
            )
    return value


def _rules(name, value):
    if value is None or isinstance(value, Rules):
        return value
    if not isinstance(value, str):
        raise TypeError(
            f"{name}={value!r} is {checks.described(value)}; give a built-in's name ({', '.join(RULES)}) or a "
            "podscale.parallel.tensor.Rules(((regex, dimension), ...))"
        )
    if value not in RULES:
        raise ValueError(f"{name}={value!r}: no built-in sharding rules of that name; choose one of {', '.join(RULES)}")
    return RULES[value]


@dataclasses.dataclass(frozen=True)
class Strategy:
    """The parallel strategy of a step; ``Strategy()`` is plain data parallelism.

    Every field is checked when the value is made, by the ``check`` of its declaration: a value of
    the wrong type raises ``TypeError``, one out of range ``ValueError``, each naming the field."""

    data_axes: tuple[str, ...] | None = _field(
        None, "mesh axes the batch is split over (default: every mesh axis)", _data_axes, cli=False
    )
    weight_update: str = _field(
        "replicated",
        "sharded: each replica updates 1/N of the weights and keeps 1/N of the optimizer state; fsdp: weights, "
        "gradients and optimizer state are all stored 1/N per replica (N: the fsdp_axes' replicas), each weight "
        "gathered where it is used "
        "(in a scan over layers, one layer at a time) and its gradient reduce-scattered",
        _choice(WEIGHT_UPDATES),
        choices=WEIGHT_UPDATES,
    )
    fsdp_axes: tuple[str, ...] | None = _field(
        None,
        "with fsdp, the data axes, by name, the weights, gradients and optimizer state are chunked over (default: "
        "every data axis); the other data axes hold whole copies of the chunks and sum the gradients across them "
        "(data x FSDP: FSDP within a slice or node, data parallelism across), e.g. --mesh 2x4 --fsdp-axes y",
        _fsdp_axes,
    )
    min_shard_size: int = _field(
        DEFAULT_MIN_SHARD_SIZE,
        "with the sharded update or fsdp, tensors with fewer elements stay replicated",
        _count(what=" (elements)"),
    )
    min_table_rows: int | None = _field(
        None,
        "embedding tables (weights looked up by rows) with at least this many rows are split by rows over the "
        "data axes (default: the ids a step looks up from a table, at least the global batch's rows, from where "
        "splitting moves fewer bytes than all-reducing the table's gradient; see podscale/parallel/tables.py)",
        _count(optional=True, what=" (rows)"),
    )
    bucket_bytes: int = _field(
        DEFAULT_BUCKET_BYTES, "size of the fused gradient buffers in bytes (16 MiB)", _count(what=" (bytes)")
    )
    grad_sum: str = _field(
        "1d",
        "2d: on a 2-D mesh, reduce-scatter along one axis, all-reduce along the other, all-gather back",
        _choice(MODES),
        choices=MODES,
    )
    grad_sum_chunks: int | None = _field(
        None,
        "pipelined chunks per fused buffer with grad_sum 2d (default 4; 1 on a TPU, whose compiler combines them)",
        _count(optional=True),
    )
    grad_sum_phases: str | None = _field(
        None,
        "how grad_sum 2d is sent: xla (one collective over both axes, which XLA:TPU runs over each torus "
        "dimension's links at once) or explicit (podscale's phases, in chunks); default xla on a TPU unless "
        "grad_sum_chunks or axis_costs is given, explicit elsewhere",
        lambda name, value: None if value is None else checks.one_of(name, value, PHASES),
        choices=PHASES,
    )
    grad_sum_dtype: Any = _field(
        None, "sum gradients in this dtype (opt-in; default theirs)", _sum_dtype, choices=SUM_DTYPES
    )
    axis_costs: Any = _field(
        None,
        "which axis the 2-D sum goes along first: calibrate, or AXIS=BYTES_PER_S:LATENCY_S,... (default mesh order)",
        _axis_costs,
    )
    strict: bool = _field(
        False, "refuse, before running, a step with ops that would run on gathered values", checks.boolean
    )
    rng: str = _field(
        "single-device",
        "independent (opt-in): each replica draws its rows of a batch-shaped random draw from its own "
        "stream (fold_in of the replica index), which no longer equals one device's draw",
        _choice(RNGS),
        choices=RNGS,
    )

    spatial: int | None = _field(
        None,
        "split each image's height over the mesh's last axis, of this size (spatial partitioning: "
        "convolutions exchange halos with their neighbours), e.g. --mesh 2x4 --spatial 4",
        _count(optional=True, what=" (devices per image)"),
    )

    model_parallel: int | None = _field(
        None,
        "split the weights the sharding rules name over the mesh's last axis, of this size (tensor "
        "partitioning: attention heads, the MLP hidden dimension, the vocabulary), e.g. --mesh 4x2 --model-parallel 2",
        _count(optional=True, what=" (devices per replica)"),
    )
    space_axis: str | None = _field(
        None,
        "the mesh axis, by name, each image's height is split over (spatial partitioning; its size is the "
        "partitions per image): a role, not a position",
        _axis_name,
        cli=False,
    )
    model_axis: str | None = _field(
        None,
        "the mesh axis, by name, the sharding rules split weights over (tensor partitioning): a role, not a position",
        _axis_name,
        cli=False,
    )
    rules: Any = _field(
        None,
        "the sharding rules of model_parallel: a podscale.parallel.tensor.Rules, or a built-in's name "
        "(default: the model's own)",
        _rules,
        choices=tuple(RULES),
    )

    def __post_init__(self):
        given_rules = self.rules
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, f.metadata["check"](f.name, getattr(self, f.name)))
        if self.rules is not None and self.model_parallel is None and self.model_axis is None:
            name = given_rules if isinstance(given_rules, str) else self.rules.name
            raise ValueError(
                f"rules={name!r} is given without model_parallel: sharding rules say how tensor partitioning "
                "splits the weights over the model axis; give model_parallel=k (k > 1) with them, or no rules"
            )
        if self.model_parallel == 1 and self.model_axis is None:  # one partition of the weights: data parallelism
            object.__setattr__(self, "model_parallel", None)
            object.__setattr__(self, "rules", None)
        if self.space_axis is not None and self.space_axis == self.model_axis:
            raise ValueError(f"space_axis and model_axis are both {self.space_axis!r}: one axis has one role")
        if self.spatial not in (None, 1) and self.model_parallel is not None:
            raise ValueError(
                f"spatial={self.spatial} and model_parallel={self.model_parallel} would both take the mesh's "
                "last axis: to split images and weights in one step (data x space x model), name the axes, "
                "e.g. jax.make_mesh((2, 2, 2), ('data', 'space', 'model')) with space_axis='space', "
                "model_axis='model', rules=...; or choose one"
            )
        if self.spatial == 1 and self.space_axis is None:
            object.__setattr__(self, "spatial", None)  # one partition per image: plain data parallelism
        check_phases(self.grad_sum_phases, self.grad_sum, self.grad_sum_chunks, self.axis_costs)
        if self.axis_costs is not None and self.grad_sum != "2d":
            raise ValueError(
                "axis_costs choose which axis the 2-D gradient sum goes along first, and grad_sum is "
                f"{self.grad_sum!r}: they would be ignored; add grad_sum='2d', or leave axis_costs out"
            )
        if self.fsdp_axes is not None and self.weight_update != "fsdp":
            raise ValueError(
                f"fsdp_axes={self.fsdp_axes} name the axes FSDP chunks over, and weight_update is "
                f"{self.weight_update!r}: add weight_update='fsdp', or leave fsdp_axes out"
            )
        if self.fsdp_axes is not None and len(set(self.fsdp_axes)) != len(self.fsdp_axes):
            raise ValueError(f"fsdp_axes={self.fsdp_axes}: name each axis once")
        if self.data_axes is not None and len(set(self.data_axes)) != len(self.data_axes):
            twice = sorted({a for a in self.data_axes if self.data_axes.count(a) > 1})
            raise ValueError(f"data_axes={self.data_axes}: {', '.join(map(repr, twice))} named twice; name each once")

    @property
    def grad_sum_options(self) -> dict[str, Any]:
        """The keyword arguments of :func:`~podscale.parallel.gradsum.make_grad_sum` these fields give."""
        return {
            "mode": self.grad_sum,
            "chunks": self.grad_sum_chunks,
            "dtype": self.grad_sum_dtype,
            "axis_costs": self.axis_costs,
            "nbytes": self.bucket_bytes,
            "phases": self.grad_sum_phases,
        }

    @property
    def sharded(self) -> bool:
        return self.weight_update == "sharded"

    @property
    def fsdp(self) -> bool:
        return self.weight_update == "fsdp"

    def state_scales(self, axis: str) -> bool:
        """Whether the state per device shrinks as the data axis ``axis`` grows (the sharded update,
        FSDP): a projection compiled with ``axis`` smaller than its target's scales the state and
        the update to it. Not data x FSDP's where ``axis`` holds the chunks' copies."""
        return self.weight_update in ("sharded", "fsdp") and self.chunked_over(axis)

    def chunked_over(self, axis: str) -> bool:
        """Whether a chunked leaf's chunks span the data axis ``axis``: every data axis, but with
        ``fsdp_axes`` (data x FSDP) those only, the others holding the chunks' copies."""
        return self.fsdp_axes is None or axis in self.fsdp_axes

    def space_of(self, mesh) -> str | None:
        """The mesh axis each image's height is split over (``space_axis``, or with ``spatial=k``
        the mesh's last axis), or ``None``."""
        if self.space_axis is not None:
            return self._named_axis(mesh, "space_axis", self.space_axis, "spatial", self.spatial, "space")
        if self.spatial is None:
            return None
        names = tuple(mesh.axis_names)
        if names[-1] == BN_GROUP:
            raise ValueError(
                f"spatial={self.spatial}: the mesh's last axis is the batch-norm group axis; build the mesh with "
                f"make_mesh(shape, bn_group_size=..., spatial={self.spatial}), which keeps the space axis last, "
                "or name the space axis with space_axis='NAME'"
            )
        return self._last_axis(mesh, "spatial", self.spatial, "space")

    def model_of(self, mesh) -> str | None:
        """The mesh axis the sharding rules split weights over (``model_axis``, or with
        ``model_parallel=k`` the mesh's last axis), or ``None``."""
        if self.model_axis is not None:
            return self._named_axis(mesh, "model_axis", self.model_axis, "model_parallel", self.model_parallel, "model")
        if self.model_parallel is None:
            return None
        if mesh.axis_names[-1] == BN_GROUP:
            raise ValueError(
                f"model_parallel={self.model_parallel}: the mesh's last axis is the batch-norm group axis; "
                "tensor partitioning takes a mesh without one"
            )
        return self._last_axis(mesh, "model_parallel", self.model_parallel, "model")

    def _named_axis(self, mesh, field: str, name: str, count_field: str, k: int | None, role: str) -> str:
        """The axis ``name`` of ``mesh``, checked to be one with more than one device, beside at
        least one data axis, agreeing with ``count_field=k`` where that is given too."""
        shape = dict(mesh.shape)
        if name not in shape:
            raise ValueError(
                f"{field}={name!r} is not an axis of the mesh {shape}; name one of its axes "
                f"({', '.join(map(repr, shape))}), e.g. make_mesh({{'data': 2, {name!r}: 4}})"
            )
        if name == BN_GROUP:
            raise ValueError(f"{field}={name!r} is the batch-norm group axis; the {role} axis is another")
        if shape[name] == 1:
            raise ValueError(f"{field}={name!r} has 1 device: there is nothing to split; leave {field} out")
        if k is not None and shape[name] != k:
            raise ValueError(
                f"{count_field}={k} and {field}={name!r}, which has {shape[name]} devices: give one of them"
            )
        if len(shape) < 2:
            raise ValueError(
                f"{field}={name!r}: the mesh {shape} has no data axis beside the {role} axis; add one, of size 1 "
                f"for one replica: make_mesh({{'data': 1, {name!r}: {shape[name]}}})"
            )
        if self.data_axes is not None and name in self.data_axes:
            raise ValueError(f"data_axes {self.data_axes} include {name!r}, the {role} axis ({field})")
        return name

    def _last_axis(self, mesh, field: str, k: int, role: str) -> str:
        """The mesh's last axis, checked to have ``k`` devices after at least one data axis."""
        names, shape = tuple(mesh.axis_names), dict(mesh.shape)
        if len(names) < 2 or shape[names[-1]] != k:
            raise ValueError(
                f"{field}={k} needs a mesh whose last axis has {k} devices (the {role} axis) after at least one "
                f"data axis, got mesh {shape}; " + mesh_advice(mesh.size, k, field)
            )
        if self.data_axes is not None and names[-1] in self.data_axes:
            raise ValueError(f"data_axes {self.data_axes} include {names[-1]!r}, the {role} axis of {field}={k}")
        return names[-1]

    def partitions_of(self, mesh) -> tuple[str, ...]:
        """The mesh axes left to XLA's partitioner: the space axis, the model axis, both or none."""
        space, model = self.space_of(mesh), self.model_of(mesh)
        if space is not None and space == model:
            raise ValueError(
                f"the space axis and the model axis are both {space!r}: one axis has one role; name the "
                "other with space_axis='NAME' or model_axis='NAME'"
            )
        parts = tuple(a for a in (space, model) if a is not None)
        if len(parts) == 2 and len(mesh.axis_names) < 3:
            raise ValueError(
                f"the mesh {dict(mesh.shape)} has no data axis beside the space axis {space!r} and the model "
                f"axis {model!r}; add one, of size 1 for one replica"
            )
        return parts

    def axes(self, mesh) -> tuple[str, ...]:
        """The data axes on ``mesh``: every axis but the space and model axes."""
        parts = self.partitions_of(mesh)
        if self.data_axes is None:
            return tuple(a for a in mesh.axis_names if a not in parts)
        unknown = [a for a in self.data_axes if a not in mesh.axis_names]
        if unknown:
            raise ValueError(f"data_axes {unknown} are not axes of the mesh {dict(mesh.shape)}")
        rest = [a for a in mesh.axis_names if a not in self.data_axes and a not in parts]
        if rest:
            raise ValueError(
                f"mesh axes {rest} are not data axes (data_axes={self.data_axes}), nor the space or model axis: "
                "leave data_axes out, or make the mesh of data axes only"
            )
        return tuple(a for a in mesh.axis_names if a in self.data_axes)  # mesh order: the batch's split order

    def chunk_axes(self, mesh) -> tuple[str, ...]:
        """The data axes a leaf stored in chunks along one of its dimensions is chunked over, in
        mesh order: with ``fsdp_axes``, those (each a data axis of the mesh); else every data axis."""
        data = self.axes(mesh)
        if self.fsdp_axes is None:
            return data
        shape = dict(mesh.shape)
        for name in self.fsdp_axes:
            if name not in shape:
                raise ValueError(
                    f"fsdp_axes: {name!r} is not an axis of the mesh {shape}; name data axes of it ({', '.join(map(repr, data))})"
                )
            if name not in data:
                raise ValueError(
                    f"fsdp_axes: {name!r} is not a data axis of the mesh {shape} (the data axes: "
                    f"{', '.join(map(repr, data))}); FSDP chunks over data axes only"
                )
            if name == BN_GROUP:
                raise ValueError(f"fsdp_axes: {name!r} is the batch-norm group axis; chunk over the other data axes")
        return tuple(a for a in data if a in self.fsdp_axes)


def flag_name(field: str) -> str:
    """The command-line flag of a parameter, the one place the CLI and the library meet."""
    return "--" + field.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser, defaults: Strategy | None = None) -> None:
    """One flag per ``Strategy`` field, with the field's help, choices and default."""
    defaults = defaults or Strategy()
    group = parser.add_argument_group("parallel strategy")
    for f in dataclasses.fields(Strategy):
        meta = f.metadata
        if not meta.get("cli", True):
            continue
        default = getattr(defaults, f.name)
        if f.type in ("bool", bool):
            group.add_argument(flag_name(f.name), action="store_true", default=default, help=meta["help"])
            continue
        kind = int if f.type in ("int", "int | None") else str
        group.add_argument(
            flag_name(f.name), type=kind, default=default, choices=meta.get("choices"), help=meta["help"]
        )


def from_flags(args: argparse.Namespace) -> Strategy:
    """The ``Strategy`` the flags of :func:`add_flags` describe."""
    return Strategy(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Strategy) if hasattr(args, f.name)})
