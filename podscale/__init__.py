"""podscale: run an unmodified single-device JAX training step across a pod of accelerators."""

from podscale.perf.tpu import quiet_platforms

quiet_platforms()  # libtpu installed on a host without a TPU: JAX on the CPU, without libtpu's start-up errors

from podscale.parallel.checks import PodscaleWarning  # noqa: E402
from podscale.parallel.engine import DataParallelStep, data_parallel  # noqa: E402
from podscale.parallel.mesh import make_mesh  # noqa: E402
from podscale.parallel.strategy import Strategy  # noqa: E402
from podscale.train.evaluate import distributed_eval  # noqa: E402

__all__ = ["DataParallelStep", "PodscaleWarning", "Strategy", "data_parallel", "distributed_eval", "make_mesh"]
__version__ = "0.1.0"
