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

A metric that is not a mean over examples (COCO mAP, AUC) comes in two parts: ``predict``, each
example's outputs, which the trainer runs where the state lives (each replica its own rows, an
embedding table split by rows looked up there), and ``score``, the metric of the whole set's
outputs on the host. The state is never gathered to evaluate it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax

from podscale.parallel import regions
from podscale.workloads.precision import Policy

Batch = dict[str, Any]
PerExample = dict[str, jax.Array]  # every value of shape [batch]


@dataclasses.dataclass(frozen=True)
class Reference:
    """The published parameter count of the full config, and where it is published."""

    params: int
    source: str


def recipe_bn_group_size(config: Any, replicas: int) -> int:
    """Replicas per batch-norm group in ``config``'s recipe at ``replicas`` replicas (1: batch norm
    over the whole batch): its ``bn_group_size`` from ``bn_group_min_replicas`` replicas up, for
    the configs that have one (SSD's, ResNet-50's TPU pod runs)."""
    size = getattr(config, "bn_group_size", 1)
    return size if replicas >= getattr(config, "bn_group_min_replicas", 1) else 1


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
    predict: Callable[[nn.Module, dict, Batch], Any] | None = None
    """``(model, variables, batch) -> outputs``: inference mode, a pytree of arrays whose leading
    dimension is the batch's examples (DLRM's logits; SSD's class logits and box offsets; Mask
    R-CNN's detections), for a metric that is not a mean over examples (COCO mAP, AUC). The
    trainer runs it where the state lives, each replica on its own rows
    (:meth:`~podscale.train.evaluate.DistributedEval.predict`), and gathers every example's outputs
    on the host for ``score``. Set with ``score``; ``eval_metric`` is then one of its keys, and
    ``eval_metrics`` gives the per-example ones (loss) beside it."""
    score: Callable[[nn.Module, Any, Any], dict[str, float]] | None = None
    """``(model, predictions, eval_data) -> metrics`` on the host: ``predict``'s outputs for the
    whole held-out set, in order, as numpy arrays (pycocotools' mAP, scikit-learn's AUC).
    :func:`evaluate_whole_set` is the same metric on one device."""
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
    tokens_per_example: Callable[[Any], int] | None = None
    """``(config) -> tokens`` one training example predicts, for language models: throughput is
    then also given in tokens per second (``podscale project``'s rows)."""
    project_strategies: tuple[str, ...] | None = None
    """The strategies ``podscale project`` compares for it when ``--strategies`` is not given (its
    recipe's, e.g. FSDP for an LLM whose state fits a chip only sharded between uses); ``None``:
    the projection's defaults (replicated, sharded, sharded-2d)."""

    def __post_init__(self):
        if (self.predict is None) != (self.score is None):
            raise ValueError(f"workload {self.name!r}: predict and score go together (a whole-set metric)")
        if not self.mlperf_name:
            object.__setattr__(self, "mlperf_name", self.name)

    def config(self, name: str):
        if name not in self.configs:
            raise ValueError(f"model {self.name!r} has no config {name!r}; choose one of: {', '.join(self.configs)}")
        return self.configs[name]

    def param_count(self, config_name: str = "full", policy: Policy | None = None) -> int:
        """Parameters of a config, from shapes only (nothing is allocated); traced once per config."""
        from podscale.workloads.precision import BF16

        config = self.config(config_name)
        return _param_count(self, config, policy or BF16)


_COUNTS: dict[tuple[int, int, Policy], tuple[Workload, Any, int]] = {}


def _param_count(workload: Workload, config, policy: Policy) -> int:
    key = (id(workload), id(config), policy)
    if key not in _COUNTS:  # the objects are kept with the count, so their ids stay theirs
        _COUNTS[key] = (workload, config, _count(workload, config, policy))
    return _COUNTS[key][2]


def _count(workload: Workload, config, policy: Policy) -> int:
    model = workload.make_model(config, policy, None)
    shapes = workload.batch_shapes(config, 1)
    batch = {k: jax.ShapeDtypeStruct((1, *v.shape[1:]), v.dtype) for k, v in shapes.items()}
    with regions.shapes_only():  # only the parameters' shapes are read
        variables = jax.eval_shape(lambda b: workload.init(model, jax.random.key(0), b), batch)
    return sum(int(x.size) for x in jax.tree.leaves(variables["params"]))


@functools.cache
def _jitted(predict: Callable, model: nn.Module) -> Callable:
    """``predict`` of a model, jitted once per model (every evaluation reuses it)."""
    return jax.jit(functools.partial(predict, model))


def predict_whole_set(predict: Callable, model: nn.Module, variables: dict, data, chunk: int):
    """``predict`` over ``data`` on one device, in batches of ``chunk`` examples: every example's
    outputs as host numpy arrays, in order."""
    forward = _jitted(predict, model)
    parts = []
    for start in range(0, len(data), chunk):
        batch = data.get(np.arange(start, min(start + chunk, len(data))))
        parts.append(jax.device_get(forward(variables, batch)))
    return jax.tree.map(lambda *xs: np.concatenate(xs), *parts)


def evaluate_whole_set(
    predict: Callable, score: Callable, model: nn.Module, variables: dict, data, chunk: int
) -> dict[str, float]:
    """A whole-set metric on one device: :func:`predict_whole_set`, then ``score`` on the host (the
    trainer runs ``predict`` distributed instead)."""
    return score(model, predict_whole_set(predict, model, variables, data, chunk), data)
