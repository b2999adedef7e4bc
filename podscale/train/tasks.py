"""Tasks: a model, its data, its loss, and the plain single-device train step built from them.

``make_train_step`` returns exactly the kind of step a user writes for one device (``jax.grad`` of
a batch-mean loss, an optax update, no collectives); podscale then runs it with
``data_parallel``. The names accepted on the command line are the keys of ``MODELS``,
``DATASETS`` and ``OPTIMIZERS``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from podscale import workloads
from podscale.parallel import regions
from podscale.parallel.mesh import BN_GROUP
from podscale.train import models
from podscale.workloads import Workload, datasets
from podscale.workloads.precision import BF16, Policy


@flax.struct.dataclass
class TrainState:
    """Everything a step reads and writes. ``batch_stats`` is empty for models without batch norm."""

    step: jax.Array
    params: Any
    batch_stats: Any
    opt_state: Any


@dataclasses.dataclass(frozen=True)
class Task:
    """A model on a data set. ``kind`` is ``"classify"`` (image -> label), ``"lm"`` (next token), or
    the kind of an MLPerf workload (``workload`` set: its functions define loss and metric)."""

    model: nn.Module
    kind: str
    train_data: Any
    eval_data: Any
    workload: Workload | None = None
    config: Any = None
    """The workload's config (``workload`` set only)."""

    @property
    def eval_metric(self) -> str:
        return self.workload.eval_metric if self.workload else "accuracy"

    @property
    def input_key(self) -> str:
        return "image" if self.kind == "classify" else "tokens"

    def example_batch(self, batch: int = 1) -> dict[str, np.ndarray]:
        return self.train_data.get(np.arange(batch) % len(self.train_data))

    def batch_shapes(self, global_batch: int) -> dict[str, jax.ShapeDtypeStruct]:
        """The shapes of a global training batch, without loading one."""
        if self.workload:
            return self.workload.batch_shapes(self.config, global_batch)
        example = self.train_data.get(np.arange(1))
        return {k: jax.ShapeDtypeStruct((global_batch, *v.shape[1:]), v.dtype) for k, v in example.items()}

    def init_state(self, rng: jax.Array, optimizer: optax.GradientTransformation, batch=None) -> TrainState:
        """``batch`` (arrays or shapes) defaults to one training example. A workload's state is
        made by one compiled program (its many initializers, run op by op, would each compile)."""
        batch = self.example_batch() if batch is None else batch

        def init(rng, batch):
            if self.workload:
                variables = self.workload.init(self.model, rng, batch)
            else:
                variables = self.model.init(rng, jnp.asarray(batch[self.input_key]), train=False)
            params = variables["params"]
            return TrainState(
                step=jnp.zeros((), jnp.int32),
                params=params,
                batch_stats=variables.get("batch_stats", {}),
                opt_state=optimizer.init(params),
            )

        return jax.jit(init)(rng, batch) if self.workload else init(rng, batch)

    def state_shapes(self, optimizer: optax.GradientTransformation, batch=None, rng=None) -> TrainState:
        """The shapes and types of :meth:`init_state`'s state (``jax.eval_shape``), traced for its
        shapes alone: the contracts of the model's regions are checked where a state is computed,
        not here (:func:`~podscale.parallel.regions.shapes_only`: a full config's check compiles
        the region's function on whole feature maps, seconds a call)."""
        rng = jax.random.key(0) if rng is None else rng
        with regions.shapes_only():
            if batch is None:
                return jax.eval_shape(lambda: self.init_state(rng, optimizer))
            return jax.eval_shape(lambda b: self.init_state(rng, optimizer, b), batch)

    def _variables(self, state: TrainState, params) -> dict:
        return {"params": params, **({"batch_stats": state.batch_stats} if state.batch_stats else {})}

    @property
    def dropout(self) -> float:
        """The recipe's dropout rate (0 for the small models, which have none)."""
        return getattr(self.config, "dropout", 0.0) if self.workload else 0.0

    def train_outputs(self, state: TrainState, params, batch, rng: jax.Array | None = None):
        """Per-example ``loss`` and ``accuracy`` in training mode, and the new batch statistics;
        ``rng`` is the dropout key of a workload with dropout."""
        if self.workload:
            return self.workload.train_loss(self.model, self._variables(state, params), batch, rng)
        logits, batch_stats = self.apply(state, params, batch[self.input_key], train=True)
        return self.per_example(logits, batch), batch_stats

    def eval_outputs(self, state: TrainState, batch):
        """Per-example metrics in inference mode, ``eval_metric`` among them."""
        if self.workload:
            return self.workload.eval_metrics(self.model, self._variables(state, state.params), batch)
        logits, _ = self.apply(state, state.params, batch[self.input_key], train=False)
        return self.per_example(logits, batch)

    def predict_outputs(self, state: TrainState, batch):
        """Each example's outputs for a whole-set metric (``workload.predict``), in inference mode."""
        return self.workload.predict(self.model, self._variables(state, state.params), batch)

    def apply(self, state: TrainState, params, x, train: bool):
        variables = self._variables(state, params)
        if state.batch_stats and train:
            logits, updates = self.model.apply(variables, x, train=True, mutable=["batch_stats"])
            return logits, updates["batch_stats"]
        return self.model.apply(variables, x, train=train), state.batch_stats

    def per_example(self, logits, batch) -> dict[str, jax.Array]:
        """Per-example loss and accuracy, each of shape [batch]."""
        labels = batch["label"] if self.kind == "classify" else batch["targets"]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
        correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
        if self.kind == "lm":
            loss, correct = loss.mean(-1), correct.mean(-1)
        return {"loss": loss, "accuracy": correct}


def make_train_step(task: Task, optimizer: optax.GradientTransformation, seed: int = 0) -> Callable:
    """The plain single-device step: ``step(state, batch) -> (new_state, metrics)``.

    A workload with dropout (or random sampling) draws from ``fold_in(key(seed), state.step)``: a function of
    the seed and the step only, so a resumed run draws the masks the uninterrupted run drew, and
    podscale's partitioned step draws each replica's rows of the very masks one device draws."""

    def step(state: TrainState, batch):
        draws = task.dropout or (task.workload is not None and task.workload.samples)
        rng = jax.random.fold_in(jax.random.key(seed), state.step) if draws else None

        def loss_fn(params):
            per, batch_stats = task.train_outputs(state, params, batch, rng)
            return jnp.mean(per["loss"]), (jnp.mean(per["accuracy"]), batch_stats)

        (loss, (accuracy, batch_stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        new_state = state.replace(
            step=state.step + 1,
            params=optax.apply_updates(state.params, updates),
            batch_stats=batch_stats,
            opt_state=opt_state,
        )
        return new_state, {"loss": loss, "accuracy": accuracy}

    return step


def make_eval_fn(task: Task) -> Callable:
    """``eval_fn(state, batch) -> per-example metrics``, with batch norm in inference mode."""
    return task.eval_outputs


MODELS: dict[str, Callable[[], tuple[nn.Module, str]]] = {
    "mlp": lambda: (models.MLP(), "classify"),
    "resnet": lambda: (models.SmallResNet(), "classify"),
    "cnn": lambda: (models.SmallResNet(batch_norm=False), "classify"),
    "transformer": lambda: (models.Transformer(), "lm"),
}

DATASETS: dict[str, dict[str, Callable[[int], tuple[Any, Any]]]] = {
    "classify": {
        "digits": lambda seed: (datasets.Digits("train"), datasets.Digits("test")),
        "synthetic": lambda seed: (
            datasets.SyntheticImages(4096, seed=seed),
            datasets.SyntheticImages(512, seed=seed + 1),
        ),
    },
    "lm": {
        "synthetic": lambda seed: (
            datasets.SyntheticTokens(4096, seed=seed),
            datasets.SyntheticTokens(512, seed=seed + 1),
        ),
    },
}

OPTIMIZERS: dict[str, Callable[[float], optax.GradientTransformation]] = {
    "sgd": optax.sgd,
    "momentum": lambda lr: optax.sgd(lr, momentum=0.9),
    "adam": optax.adam,
    "adamw": optax.adamw,
    "lamb": optax.lamb,
    "lars": optax.lars,
    "rmsprop": optax.rmsprop,
    "adagrad": optax.adagrad,
    "lion": optax.lion,
    "adafactor": optax.adafactor,
}


def _choose(kind: str, name: str, table: dict) -> Any:
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; choose one of: {', '.join(sorted(table))}")
    return table[name]


def make_task(
    model: str,
    dataset: str | None = None,
    seed: int = 0,
    config: str | None = None,
    policy: Policy = BF16,
    bn_axis: str | None = None,
    with_data: bool = True,
) -> Task:
    """Builds the task for CLI names, with errors that list the valid names.

    ``model`` is one of ``MODELS`` (small models; ``dataset`` picks their data, default synthetic)
    or an MLPerf workload of ``podscale.workloads`` (``config`` is then ``full`` or ``tiny``, the
    data set is the workload's own, ``policy`` sets the compute dtype and ``bn_axis`` the mesh
    axis batch-norm statistics are averaged over). ``with_data=False`` builds an MLPerf workload's
    task without its data (to trace, compile and plan a full config: shapes come from the config).
    """
    for flag, value in (("--model", model), ("--config", config), ("--data", dataset)):
        if value is not None and not str(value).strip():
            raise ValueError(f"{flag} is empty; give a name, or leave the flag out for the default")
    if bn_axis not in (None, BN_GROUP):
        raise ValueError(
            f"bn_axis={bn_axis!r}: batch norm can average over the {BN_GROUP!r} axis of make_mesh(bn_group_size=k) "
            f"only (a model's own sum over every replica axis would be taken for a gradient sum); for all "
            f"replicas use bn_group_size equal to the replica count"
        )
    if model in workloads.NAMES:
        workload = workloads.get(model)
        if config is None:
            raise ValueError(f"model {model!r} needs --config; choose one of: {', '.join(workload.configs)}")
        cfg = workload.config(config)
        if dataset is not None:
            raise ValueError(f"model {model!r} brings its own data; drop --data {dataset}")
        train_data, eval_data = workload.make_data(cfg, seed) if with_data else (None, None)
        module = workload.make_model(cfg, policy, bn_axis)
        return Task(module, model, train_data, eval_data, workload=workload, config=cfg)
    if config is not None:
        raise ValueError(f"--config is for the MLPerf workloads ({', '.join(workloads.NAMES)}), not for {model!r}")
    if bn_axis is not None:
        raise ValueError(
            f"--bn-group-size averages batch norm over groups of replicas in the MLPerf workloads whose batch norm "
            f"takes the group axis ({', '.join(bn_group_workloads())}); model {model!r} is not one: drop the flag"
        )
    names = sorted(MODELS) + list(workloads.NAMES)
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of: {', '.join(names)}")
    module, kind = MODELS[model]()
    dataset = dataset or "synthetic"
    datasets = DATASETS[kind]
    if dataset not in datasets:
        raise ValueError(
            f"data {dataset!r} does not fit model {model!r} ({kind}); choose one of: {', '.join(sorted(datasets))}"
        )
    train_data, eval_data = datasets[dataset](seed)
    return Task(model=module, kind=kind, train_data=train_data, eval_data=eval_data)


def bn_group_workloads() -> list[str]:
    """The MLPerf workloads whose model averages batch norm over ``BN_GROUP`` (``--bn-group-size``):
    those whose model changes when given the axis (the others ignore it)."""
    names = []
    for name in workloads.NAMES:
        w = workloads.get(name)
        cfg = w.config("tiny")
        if w.make_model(cfg, BF16, None) != w.make_model(cfg, BF16, BN_GROUP):
            names.append(name)
    return names


def make_optimizer(name: str, learning_rate: float) -> optax.GradientTransformation:
    if not learning_rate > 0:
        raise ValueError(f"--learning-rate must be positive, got {learning_rate}")
    return _choose("optimizer", name, OPTIMIZERS)(learning_rate)


def recipe_config(task: Task, learning_rate: float | None):
    """A workload's config with ``learning_rate`` (if given) as the recipe's peak."""
    return task.config if learning_rate is None else dataclasses.replace(task.config, learning_rate=learning_rate)


def make_task_optimizer(
    task: Task, name: str | None, learning_rate: float | None, steps: int
) -> optax.GradientTransformation:
    """An optax optimizer by name (default adam at 1e-3) or, for an MLPerf workload without
    ``name``, its recipe over ``steps`` steps (``learning_rate`` then replaces the recipe's peak)."""
    if name is not None and not str(name).strip():
        raise ValueError("--optimizer is empty; give an optax optimizer's name, or leave the flag out for the default")
    if task.workload and name is None:
        return task.workload.make_optimizer(recipe_config(task, learning_rate), steps)
    return make_optimizer(name or "adam", 1e-3 if learning_rate is None else learning_rate)
