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

from podscale import data, models


@flax.struct.dataclass
class TrainState:
    """Everything a step reads and writes. ``batch_stats`` is empty for models without batch norm."""

    step: jax.Array
    params: Any
    batch_stats: Any
    opt_state: Any


@dataclasses.dataclass(frozen=True)
class Task:
    """A model on a data set. ``kind`` is ``"classify"`` (image -> label) or ``"lm"`` (next token)."""

    model: nn.Module
    kind: str
    train_data: Any
    eval_data: Any

    @property
    def input_key(self) -> str:
        return "image" if self.kind == "classify" else "tokens"

    def example_input(self, batch: int = 1) -> jax.Array:
        return jnp.asarray(self.train_data.get(np.arange(batch) % len(self.train_data))[self.input_key])

    def batch_shapes(self, global_batch: int) -> dict[str, jax.ShapeDtypeStruct]:
        """The shapes of a global training batch, without loading one."""
        example = self.train_data.get(np.arange(1))
        return {k: jax.ShapeDtypeStruct((global_batch, *v.shape[1:]), v.dtype) for k, v in example.items()}

    def init_state(self, rng: jax.Array, optimizer: optax.GradientTransformation) -> TrainState:
        variables = self.model.init(rng, self.example_input(), train=False)
        params = variables["params"]
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            batch_stats=variables.get("batch_stats", {}),
            opt_state=optimizer.init(params),
        )

    def apply(self, state: TrainState, params, x, train: bool):
        variables = {"params": params}
        if state.batch_stats:
            variables["batch_stats"] = state.batch_stats
            if train:
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


def make_train_step(task: Task, optimizer: optax.GradientTransformation) -> Callable:
    """The plain single-device step: ``step(state, batch) -> (new_state, metrics)``."""

    def step(state: TrainState, batch):
        def loss_fn(params):
            logits, batch_stats = task.apply(state, params, batch[task.input_key], train=True)
            per = task.per_example(logits, batch)
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

    def eval_fn(state: TrainState, batch):
        logits, _ = task.apply(state, state.params, batch[task.input_key], train=False)
        return task.per_example(logits, batch)

    return eval_fn


MODELS: dict[str, Callable[[], tuple[nn.Module, str]]] = {
    "mlp": lambda: (models.MLP(), "classify"),
    "resnet": lambda: (models.SmallResNet(), "classify"),
    "cnn": lambda: (models.SmallResNet(batch_norm=False), "classify"),
    "transformer": lambda: (models.Transformer(), "lm"),
}

DATASETS: dict[str, dict[str, Callable[[int], tuple[Any, Any]]]] = {
    "classify": {
        "digits": lambda seed: (data.Digits("train"), data.Digits("test")),
        "synthetic": lambda seed: (data.SyntheticImages(4096, seed=seed), data.SyntheticImages(512, seed=seed + 1)),
    },
    "lm": {
        "synthetic": lambda seed: (data.SyntheticTokens(4096, seed=seed), data.SyntheticTokens(512, seed=seed + 1)),
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


def make_task(model: str, dataset: str, seed: int = 0) -> Task:
    """Builds the task for CLI names, with errors that list the valid names."""
    module, kind = _choose("model", model, MODELS)()
    datasets = DATASETS[kind]
    if dataset not in datasets:
        raise ValueError(
            f"data {dataset!r} does not fit model {model!r} ({kind}); choose one of: {', '.join(sorted(datasets))}"
        )
    train_data, eval_data = datasets[dataset](seed)
    return Task(model=module, kind=kind, train_data=train_data, eval_data=eval_data)


def make_optimizer(name: str, learning_rate: float) -> optax.GradientTransformation:
    if not learning_rate > 0:
        raise ValueError(f"--learning-rate must be positive, got {learning_rate}")
    return _choose("optimizer", name, OPTIMIZERS)(learning_rate)
