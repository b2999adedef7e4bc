"""podscale: run an unmodified single-device JAX training step across a pod of accelerators."""

from podscale.parallel.checks import PodscaleWarning
from podscale.parallel.engine import DataParallelStep, data_parallel
from podscale.parallel.mesh import make_mesh
from podscale.parallel.strategy import Strategy
from podscale.train.evaluate import distributed_eval

__all__ = ["DataParallelStep", "PodscaleWarning", "Strategy", "data_parallel", "distributed_eval", "make_mesh"]
__version__ = "0.1.0"
