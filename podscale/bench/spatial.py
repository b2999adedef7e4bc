"""``podscale bench spatial``: one replica's images split over k = 1, 2, 4, 8 devices, side by side.

MLPerf's SSD and Mask R-CNN could not grow their batch past a few images per core, so more
chips only helped once each image was split over several (spatial partitioning). This bench
holds the global batch fixed (one replica, so the batch cannot be spread further by data
parallelism) and splits each image's height k ways over a mesh ``(1, k)`` of the first k CPU
devices, with :class:`podscale.train.models.StemNet` (a ResNet stem and block) on random 64x64
images. Figures per k, read from the compiled step (``podscale.compiled.hlo``): temporaries per
device (activations, their gradients and workspace: should fall about 1/k), halo bytes per
device per step (the collective-permutes that bring each window its neighbours' rows) against
those temporaries, and the median step time.

What a CPU cannot show: the 8 "devices" are threads of one process sharing memory, so a halo
exchange is a memory copy, not a hop over a torus link, and the step time shows the extra work
of partitioned convolutions rather than what faster neighbour links would give. On a TPU torus
the space axis maps to neighbouring chips, and each halo crosses one link.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from podscale.compiled import hlo
from podscale.parallel import checks
from podscale.parallel.engine import data_parallel
from podscale.train.models import StemNet


def classifier_step(model, tx):
    """The plain single-device step of an image classifier with batch norm: state
    ``(params, batch_stats, opt_state)``, batch ``{"image", "label"}``, mean cross-entropy."""

    def step(state, batch):
        params, stats, opt = state

        def loss_fn(p):
            logits, new = model.apply({"params": p, "batch_stats": stats}, batch["image"], mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean(), new

        (loss, new), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), new["batch_stats"], opt), {"loss": loss}

    return step


def interleave(runs, batches) -> None:
    """Runs every run's step on each batch in turn, so that the machine's noise hits them alike;
    each run (a dict with ``dp``, ``state`` and a ``times`` list) gets its step times, the first
    call untimed, and its last ``loss``."""
    for i, b in enumerate(batches):
        for r in runs:
            start = time.perf_counter()
            r["state"], metrics = r["dp"](r["state"], b)
            jax.block_until_ready(r["state"])
            if i:  # the first call runs the compiled program once more: not timed
                r["times"].append(time.perf_counter() - start)
            r["loss"] = float(metrics["loss"])


def bench_spatial(
    ks=(1, 2, 4, 8), batch: int = 8, image: int = 64, features: int = 16, steps: int = 4
) -> dict[str, Any]:
    """Runs the benchmark (see the module docstring); steps of every k are interleaved. Every
    argument is checked first."""
    for name, value in (("batch", batch), ("image", image), ("features", features)):
        checks.whole(name, value)
    steps = checks.whole("steps", steps, what=" (timed steps)")
    if isinstance(ks, str) or not isinstance(ks, tuple | list) or not ks:
        raise TypeError(f"ks={ks!r}: give a non-empty tuple of partition counts, e.g. (1, 2, 4, 8)")
    ks = tuple(checks.whole("ks", k, what=" (devices per image)") for k in ks)
    devices = jax.devices()
    for k in ks:
        if k > len(devices):
            raise ValueError(
                f"podscale bench spatial splits an image over up to {max(ks)} devices, there are {len(devices)}; "
                f"pass --replicas {max(ks)}"
            )
    model, tx = StemNet(features=features), optax.sgd(0.05, momentum=0.9)
    rng = np.random.default_rng(0)
    data = [
        {
            "image": rng.normal(size=(batch, image, image, 3)).astype(np.float32),
            "label": rng.integers(0, 10, batch).astype(np.int32),
        }
        for _ in range(steps + 1)
    ]
    variables = model.init(jax.random.key(0), data[0]["image"])
    state = (variables["params"], variables["batch_stats"], tx.init(variables["params"]))
    runs = {}
    for k in ks:
        mesh = Mesh(np.array(devices[:k]).reshape(1, k), ("data", "space"))
        dp = data_parallel(classifier_step(model, tx), mesh, spatial=k)
        placed = dp.place_state(state, data[0])
        compiled = dp.lower(placed, data[0]).compile()
        runs[k] = {"dp": dp, "state": placed, "module": hlo.read(compiled, mesh), "times": [], "final": None}
    interleave(runs.values(), data)
    out: dict[str, Any] = {"config": {"batch": batch, "image": image, "features": features, "steps": steps}}
    base = runs[ks[0]]["module"].memory.get("temporaries")
    for k, r in runs.items():
        module = r["module"]
        temps = module.memory.get("temporaries")
        halos = [c for c in module.collectives if c.kind == "collective-permute"]
        halo = sum(c.buffer_bytes * c.count for c in halos)
        out[str(k)] = {
            "temporaries_bytes_per_device": temps,
            "temporaries_vs_k1": temps / base if base else None,
            "halo_bytes_per_device": halo,
            "halo_exchanges": sum(c.count for c in halos),
            "halo_vs_temporaries": halo / temps if temps else None,
            "uneven_layers": len(r["dp"].placement.batch.uneven),
            "step_s": statistics.median(r["times"]),
            "final_loss": r["loss"],
        }
    return out
