"""What a reference workload provides: model configs, the training recipe, data, loss and metric.

A workload module (``resnet50``, ``transformer_big``, ``bert_large``, ``gnmt``) defines one
``WORKLOAD = Workload(...)``. Everything is a plain function of a frozen config dataclass, so the
trainer, ``podscale models`` and the tests treat all workloads alike:

- ``configs["full"]`` is the MLPerf-size model with the published hyperparameters for a stated
  global batch; it is only traced and compiled here (its data sets do not ship with podscale).
- ``configs["tiny"]`` is the same architecture, small enough to train to a target on CPU, with a
  synthetic or bundled data set.

Every config dataclass has at least these fields:

- ``global_batch``: the global batch the recipe's hyperparameters are for;
- ``per_core_batch``: the MLPerf per-core batch, used to compile one replica's step;
- ``train_steps``: the length of the schedule (``--steps`` overrides it for a run);
- ``source``: where the hyperparameters come from (a citation, printed by ``podscale models``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import optax

from podscale.workloads.precision import Policy

Batch = dict[str, Any]
PerExample = dict[str, jax.Array]  # every value of shape [batch]


@dataclasses.dataclass(frozen=True)
class Reference:
    """The published parameter count of the full config, and where it is published."""

    params: int
    source: str


@dataclasses.dataclass(frozen=True)
class Workload:
    """One MLPerf reference workload. See the module docstring for the config fields."""

    name: str
    """The ``--model`` name, e.g. ``resnet50``."""
    description: str
    configs: Mapping[str, Any]
    """``{"full": ..., "tiny": ...}``: frozen dataclasses."""
    reference: Reference
    make_model: Callable[[Any, Policy, str | None], nn.Module]
    """``(config, policy, bn_axis)``: ``bn_axis`` is the mesh axis batch-norm statistics are averaged
    over (``None``: this replica's batch only); models without batch norm ignore it."""
    batch_shapes: Callable[[Any, int], dict[str, jax.ShapeDtypeStruct]]
    """``(config, global_batch)``: the shapes and dtypes of one training batch."""
    make_data: Callable[[Any, int], tuple[Any, Any]]
    """``(config, seed) -> (train, eval)`` data sources (``len`` and ``get(indices)``, see
    ``podscale.data``). Raises ValueError for a config whose data does not ship with podscale."""
    make_optimizer: Callable[[Any, int], optax.GradientTransformation]
    """``(config, total_steps)``: the recipe, built from optax."""
    init: Callable[[nn.Module, jax.Array, Batch], dict]
    """``(model, rng, batch) -> variables`` (``{"params": ..., "batch_stats": ...}``)."""
    train_loss: Callable[..., tuple[PerExample, Any]]
    """``(model, variables, batch, rng=None) -> (per_example, new_batch_stats)``: training mode;
    ``rng`` is the key the recipe's dropout draws from (``None``: no dropout). ``per_example`` has
    ``"loss"`` (float32, label smoothing as the recipe says) and ``"accuracy"``;
    ``new_batch_stats`` is ``{}`` for models without batch norm."""
    eval_metrics: Callable[[nn.Module, dict, Batch], PerExample]
    """``(model, variables, batch) -> per_example``: inference mode; includes ``eval_metric``."""
    eval_metric: str
    """The key of ``eval_metrics`` that ``--target`` refers to, e.g. ``exact_match``."""
    mlperf_name: str = ""
    """The MLPerf benchmark name (``submission_benchmark``: ``resnet``, ``transformer``, ...);
    default: ``name``."""
    hparams: Callable[[Any, int], dict[str, Any]] | None = None
    """``(config, total_steps)``: the recipe's hyperparameters under mllog's standard keys
    (``mlperf_logging.mllog.constants``: ``opt_name``, ``opt_base_learning_rate``, warmup, ...)."""
    evaluate: Callable[[nn.Module, dict, Any], dict[str, float]] | None = None
    """``(model, variables, eval_data) -> metrics`` over the whole held-out set, on the host, for a
    metric that is not a mean over examples (COCO mAP); ``eval_metric`` is then one of its keys,
    and ``eval_metrics`` gives the per-example ones (loss) beside it."""
    mlperf_accuracy: Callable[[dict[str, float]], Any] | None = None
    """``(results) -> value`` logged as MLPerf's ``eval_accuracy`` (default: the ``eval_metric``'s
    value); Mask R-CNN's is ``{"BBOX": box AP, "SEGM": mask AP}``, as its reference logs it."""
    quality: Callable[[Any], dict[str, float]] | None = None
    """``(config) -> {metric: target}``: metrics a run must reach besides ``--target``'s
    ``eval_metric`` (Mask R-CNN's box AP beside its mask AP)."""
    samples: bool = False
    """Whether the training loss draws random samples (Mask R-CNN's anchors and regions): it is
    then given the step's key, as dropout is (``fold_in(key(seed), step)``)."""
    unigram_baseline: Callable[[Any], float] | None = None
    """For masked-LM workloads: the accuracy of always guessing the most frequent token."""

    def __post_init__(self):
        if not self.mlperf_name:
            object.__setattr__(self, "mlperf_name", self.name)

    def config(self, name: str):
        if name not in self.configs:
            raise ValueError(f"model {self.name!r} has no config {name!r}; choose one of: {', '.join(self.configs)}")
        return self.configs[name]

    def param_count(self, config_name: str = "full", policy: Policy | None = None) -> int:
        """Parameters of a config, from shapes only (nothing is allocated)."""
        from podscale.workloads.precision import BF16

        config = self.config(config_name)
        model = self.make_model(config, policy or BF16, None)
        batch = {k: jax.ShapeDtypeStruct((1, *v.shape[1:]), v.dtype) for k, v in self.batch_shapes(config, 1).items()}
        variables = jax.eval_shape(lambda b: self.init(model, jax.random.key(0), b), batch)
        return sum(int(x.size) for x in jax.tree.leaves(variables["params"]))
