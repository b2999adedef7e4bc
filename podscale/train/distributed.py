"""Several processes with JAX's own runtime: ``jax.distributed`` and, on CPU, gloo collectives.

``setup`` runs before JAX starts its backends. It decides how many CPU devices this process gets
and, for a multi-process run, calls ``jax.distributed.initialize`` with explicit arguments (from
flags or the ``PODSCALE_*`` variables that ``launch`` sets) or with JAX's own cluster detection
(SLURM, TPU pods, ...). ``launch`` starts N local processes on 127.0.0.1 and stops the others
when one fails.

A dead peer: JAX's coordination service notices missing heartbeats within
``heartbeat_timeout_s`` and stops the surviving processes; a collective waiting on the dead peer
fails as soon as gloo sees the connection drop, and then waits for that verdict. Processes that
do not all join within ``join_timeout_s`` stop too. :mod:`podscale.train.supervise` turns each of
these into one line naming the lost process or the coordinator.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time

import jax

ENV_COORDINATOR = "PODSCALE_COORDINATOR"
ENV_NUM_PROCESSES = "PODSCALE_NUM_PROCESSES"
ENV_PROCESS_ID = "PODSCALE_PROCESS_ID"
DEFAULT_CPU_REPLICAS = 8


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """How this process joins a run. All ``None`` and ``auto=False``: a single process."""

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False
    """Let ``jax.distributed.initialize()`` detect the cluster (SLURM, TPU pods, ...)."""
    heartbeat_timeout_s: int = 30
    join_timeout_s: int | None = None
    """How long processes wait for all of them to reach the coordinator (``None``: 60 s with an
    explicit address, JAX's own 300 s with cluster detection, where hosts may start staggered)."""

    @classmethod
    def from_env(cls, **overrides) -> ClusterSpec:
        env = os.environ
        spec = cls(
            coordinator_address=env.get(ENV_COORDINATOR),
            num_processes=int(env[ENV_NUM_PROCESSES]) if ENV_NUM_PROCESSES in env else None,
            process_id=int(env[ENV_PROCESS_ID]) if ENV_PROCESS_ID in env else None,
        )
        return dataclasses.replace(spec, **{k: v for k, v in overrides.items() if v is not None})

    def __post_init__(self):
        if self.heartbeat_timeout_s is not None and not self.heartbeat_timeout_s > 0:
            raise ValueError(
                f"--heartbeat-timeout must be a positive number of seconds, got {self.heartbeat_timeout_s}"
            )
        if self.join_timeout_s is not None and not self.join_timeout_s > 0:
            raise ValueError(f"--join-timeout must be a positive number of seconds, got {self.join_timeout_s}")
        address = self.coordinator_address
        if address is not None:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(
                    f"--coordinator-address {address!r}: write it as HOST:PORT (e.g. 10.0.0.1:1234), the "
                    "address of process 0's coordination service"
                )

    @property
    def explicit(self) -> bool:
        given = [self.coordinator_address, self.num_processes, self.process_id]
        if any(v is not None for v in given) and not all(v is not None for v in given):
            raise ValueError(
                "a multi-process run needs all of --coordinator-address, --num-processes and "
                "--process-id (or none of them, with --distributed-auto)"
            )
        return all(v is not None for v in given)


def setup(replicas: int | None, spec: ClusterSpec) -> None:
    """Configures CPU devices and joins the cluster. Call once, before any JAX computation."""
    processes = spec.num_processes if spec.explicit else 1
    if spec.explicit and not 0 <= spec.process_id < processes:
        raise ValueError(f"--process-id {spec.process_id} must be in [0, {processes})")
    if replicas is None:  # CPU only; a GPU or TPU backend uses all of its devices
        local = DEFAULT_CPU_REPLICAS // processes if DEFAULT_CPU_REPLICAS % processes == 0 else 1
    else:
        if replicas < 1:
            raise ValueError(f"--replicas must be at least 1, got {replicas}")
        if replicas % processes:
            raise ValueError(f"--replicas {replicas} is not divisible by the {processes} processes")
        local = replicas // processes
    # This setting only concerns the CPU backend; a GPU or TPU backend ignores it.
    jax.config.update("jax_num_cpu_devices", local)
    if spec.explicit or spec.auto:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        kwargs = {"heartbeat_timeout_seconds": spec.heartbeat_timeout_s}
        join = spec.join_timeout_s if spec.join_timeout_s is not None else (60 if spec.explicit else None)
        if join is not None:
            kwargs["initialization_timeout"] = join
        if spec.explicit:
            kwargs.update(
                coordinator_address=spec.coordinator_address,
                num_processes=spec.num_processes,
                process_id=spec.process_id,
            )
        jax.distributed.initialize(**kwargs)
    if replicas is not None and jax.device_count() != replicas:
        raise ValueError(
            f"--replicas {replicas} asked for, but the {jax.default_backend()} backend has "
            f"{jax.device_count()} devices over {jax.process_count()} process(es); leave --replicas "
            "out to use all devices"
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(processes: int, command: list[str], grace_s: float = 60.0) -> int:
    """Runs ``command`` as ``processes`` local processes of one JAX run; returns an exit code.

    Each child gets ``PODSCALE_COORDINATOR=127.0.0.1:PORT``, ``PODSCALE_NUM_PROCESSES`` and
    ``PODSCALE_PROCESS_ID``. A command starting with ``podscale`` runs this interpreter's podscale
    (``python -m podscale.cli``), so a venv need not be on PATH. When one child fails, the others get ``grace_s`` seconds to stop with
    their own error, then are killed. The exit code is the first failing child's, else 0.
    """
    if processes < 1:
        raise ValueError(f"--processes must be at least 1, got {processes}")
    if not command:
        raise ValueError(
            "podscale launch: give the command after --, e.g. podscale launch --processes 2 -- podscale train"
        )
    if os.path.basename(command[0]) == "podscale":
        # This interpreter's podscale, whatever (if anything) ``podscale`` is on PATH.
        command = [sys.executable, "-m", "podscale.cli", *command[1:]]
    address = f"127.0.0.1:{_free_port()}"
    children = []
    for pid in range(processes):
        env = dict(
            os.environ, **{ENV_COORDINATOR: address, ENV_NUM_PROCESSES: str(processes), ENV_PROCESS_ID: str(pid)}
        )
        children.append(subprocess.Popen(command, env=env))
    failed_code, failed_at = 0, None
    try:
        while any(c.poll() is None for c in children):
            for pid, child in enumerate(children):
                code = child.poll()
                if code not in (None, 0) and failed_at is None:
                    failed_code, failed_at = code, time.monotonic()
                    print(
                        f"podscale launch: process {pid} exited with code {code}; stopping the others", file=sys.stderr
                    )
            if failed_at is not None and time.monotonic() - failed_at > grace_s:
                for child in children:
                    if child.poll() is None:
                        child.kill()
            time.sleep(0.1)
    except KeyboardInterrupt:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in children:
            child.wait()
        return 130
    if failed_at is None:
        failed_code = next((c.returncode for c in children if c.returncode != 0), 0)
    return failed_code
