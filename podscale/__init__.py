"""podscale: run an unmodified single-device JAX training step across a pod of accelerators."""

from podscale.checkpoint import CheckpointError, Checkpointer
from podscale.data_parallel import DataParallelStep, data_parallel
from podscale.evaluate import distributed_eval
from podscale.mesh import make_mesh

__all__ = ["CheckpointError", "Checkpointer", "DataParallelStep", "data_parallel", "distributed_eval", "make_mesh"]
__version__ = "0.1.0"
