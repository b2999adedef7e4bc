"""The one record of a collective podscale adds to a step, for the plan: the gradient sum's
phases (:mod:`~podscale.parallel.gradsum`), the replay's fused sums and gathers
(:mod:`~podscale.parallel.weight_update`) and the partitioner's own (rows made whole, a batch-norm
group's sum). The compiled module's collectives are read by :mod:`podscale.compiled.hlo`."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Collective:
    kind: str  # reduce-scatter | all-reduce | all-gather
    axes: tuple[str, ...]
    bytes_per_device: int
    """The buffer each device contributes (an all-reduce's operand, a reduce-scatter's input, an
    all-gather's shard)."""
    tensors: int = 1
    """The tensors fused into the buffer."""
    why: str = ""
    chunks: int = 1
    """Pipelined chunks the buffer is sent in (2-D gradient summation)."""
    runs: int = 1
    """Times it runs per step: a loop body's collective runs once per iteration (FSDP's per-layer
    gathers and reduce-scatters inside a scan over the layers)."""
    update: bool = False
    """Part of the data-parallel update (gradient sums, the sharded update's norms, the gather
    of updated weights), as opposed to what the model itself needs (batch statistics, values
    made whole for an op)."""
