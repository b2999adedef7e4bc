"""Synthetic click logs from a planted model: the tiny DLRM's data, with a known best AUC.

Each example is a pure function of (seed, index), as every tiny source is
(:mod:`podscale.workloads.datasets`):

- ``dense``: 13 float32 features, ``log(1 + count)`` of a geometric count (as the Criteo
  reference's preprocessing takes the log of its integer features);
- ``sparse``: 26 int32 categorical ids, table ``t``'s id drawn from ``cardinalities[t]`` values
  with Zipf frequencies (rank ``k`` with probability proportional to ``k ** -zipf``), ranks mapped
  to ids by a fixed permutation per table, so frequent ids fall anywhere in a table (and on any
  device that holds a block of its rows);
- ``label``: float32 click (1) or not (0), drawn with probability ``sigmoid(teacher logit)``.

The teacher is a small DLRM of its own, fixed by ``seed``: ``logit = bias + w . dense + sum_t
a_t[id_t] + sum_{(s, t) in pairs} <u_s[id_s], u_t[id_t]>``, a first-order effect per id and dot
interactions of ``teacher_dim``-wide id vectors over a fixed set of table pairs. Labels are drawn
from its probabilities, so no model can rank held-out examples better than the teacher itself:
:meth:`ClickLogs.teacher_auc` is the best reachable AUC of a held-out set (scikit-learn's
``roc_auc_score`` of the teacher's probabilities against the drawn labels).
"""

from __future__ import annotations

import functools

import numpy as np

from podscale.workloads.datasets import hash_uniform

NUM_DENSE = 13


@functools.cache
def _teacher(cardinalities: tuple[int, ...], teacher_dim: int, zipf: float, seed: int):
    """The planted model's tables and each table's Zipf CDF and rank -> id permutation."""
    rng = np.random.default_rng([seed, 20200729])
    cdfs, perms, first, vectors = [], [], [], []
    for n in cardinalities:
        weights = np.arange(1, n + 1, dtype=np.float64) ** -zipf
        cdfs.append(np.cumsum(weights) / weights.sum())
        perms.append(rng.permutation(n))
        first.append(rng.normal(0.0, 0.3, n))
        vectors.append(rng.normal(0.0, 0.4, (n, teacher_dim)))
    k = len(cardinalities)
    pairs = [(s, t) for s in range(k) for t in range(s + 1, k)]
    pairs = [pairs[i] for i in sorted(rng.choice(len(pairs), size=min(len(pairs), k), replace=False))]
    dense_w = rng.normal(0.0, 0.35, NUM_DENSE)
    dense_scale = rng.uniform(0.5, 8.0, NUM_DENSE)  # mean counts of the geometric draws
    return cdfs, perms, first, vectors, pairs, dense_w, dense_scale


class ClickLogs:
    """``size`` click-log examples (see the module docstring); ``offset`` starts the example
    indices there (the held-out split is ``offset=train_size``: no example is in both)."""

    def __init__(
        self,
        size: int,
        cardinalities: tuple[int, ...],
        *,
        offset: int = 0,
        zipf: float = 1.4,
        teacher_dim: int = 4,
        seed: int = 0,
        cache: bool = False,
    ):
        if size < 1:
            raise ValueError(f"ClickLogs: size must be at least 1, got {size}")
        if not cardinalities or min(cardinalities) < 1:
            raise ValueError(f"ClickLogs: every table needs at least one id, got cardinalities {cardinalities}")
        self.size, self.offset, self.seed = size, offset, seed
        self.cardinalities = tuple(int(n) for n in cardinalities)
        self._teacher = _teacher(self.cardinalities, teacher_dim, zipf, seed)
        self._all = self._make(np.arange(size)) if cache else None
        """``cache=True`` (a held-out split, read whole at every evaluation): every example made once."""

    def __len__(self) -> int:
        return self.size

    def _features(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        cdfs, perms, first, vectors, pairs, dense_w, dense_scale = self._teacher
        index = np.asarray(indices, np.uint64) + np.uint64(self.offset)
        k = len(self.cardinalities)
        flat = index[:, None] * np.uint64(NUM_DENSE + k + 1) + np.arange(NUM_DENSE + k + 1, dtype=np.uint64)
        u = hash_uniform(self.seed, flat, stream=29)
        counts = np.floor(-np.log1p(-u[:, :NUM_DENSE]) * dense_scale)  # geometric, mean about dense_scale
        dense = np.log1p(counts)
        ids = np.stack(
            [perms[t][np.minimum(np.searchsorted(cdfs[t], u[:, NUM_DENSE + t]), len(cdfs[t]) - 1)] for t in range(k)],
            axis=1,
        )
        logit = (dense - np.log1p(dense_scale)) @ dense_w - 1.0
        logit += sum(first[t][ids[:, t]] for t in range(k))
        logit += sum(np.einsum("bd,bd->b", vectors[s][ids[:, s]], vectors[t][ids[:, t]]) for s, t in pairs)
        return dense, ids, logit, u[:, -1]

    def teacher_probability(self, indices: np.ndarray) -> np.ndarray:
        """The planted model's click probability of each example (float64)."""
        return 1.0 / (1.0 + np.exp(-self._features(indices)[2]))

    def get(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        if self._all is not None:
            return {k: v[indices] for k, v in self._all.items()}
        return self._make(indices)

    def _make(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        dense, ids, logit, draw = self._features(indices)
        label = draw < 1.0 / (1.0 + np.exp(-logit))
        return {"dense": dense.astype(np.float32), "sparse": ids.astype(np.int32), "label": label.astype(np.float32)}

    def teacher_auc(self) -> float:
        """The teacher's own AUC on this set: the best any model can reach on it."""
        from sklearn.metrics import roc_auc_score

        indices = np.arange(self.size)
        return float(roc_auc_score(self.get(indices)["label"], self.teacher_probability(indices)))
