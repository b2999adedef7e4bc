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

JAX is imported by the functions that start it: ``launch`` and ``ClusterSpec`` serve the
launcher and each process's supervisor, which never load JAX.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import math
import os
import pkgutil
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from podscale.train import supervise

ENV_COORDINATOR = "PODSCALE_COORDINATOR"
ENV_NUM_PROCESSES = "PODSCALE_NUM_PROCESSES"
ENV_PROCESS_ID = "PODSCALE_PROCESS_ID"
ENV_REFUSALS = "PODSCALE_LAUNCH_REFUSALS"
"""Set by ``podscale launch``: a folder where each process it starts writes the refusal it ends
with (``podscale: error:``), which only process 0 prints; launch prints another process's where it
differs, so a bad flag read by every process is said once."""
DEFAULT_CPU_REPLICAS = 8


def _jax():
    """JAX, imported when a function first needs it (a test may have put a stand-in here)."""
    if "jax" not in globals():
        import jax

        globals()["jax"] = jax
    return globals()["jax"]


def __getattr__(name: str):
    if name == "jax":
        return _jax()
    if name == "MAX_CPU_DEVICES":
        from podscale.parallel.mesh import MAX_CPU_DEVICES

        return MAX_CPU_DEVICES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
            num_processes=_env_int(ENV_NUM_PROCESSES),
            process_id=_env_int(ENV_PROCESS_ID),
        )
        return dataclasses.replace(spec, **{k: v for k, v in overrides.items() if v is not None})

    def __post_init__(self):
        if self.heartbeat_timeout_s is not None and not self.heartbeat_timeout_s > 0:
            raise ValueError(
                f"--heartbeat-timeout must be a positive number of seconds, got {self.heartbeat_timeout_s}"
            )
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"--num-processes must be at least 1, got {self.num_processes}")
        if self.process_id is not None and self.process_id < 0:
            raise ValueError(f"--process-id must be 0 or more, got {self.process_id}")
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


def _env_int(name: str) -> int | None:
    """An environment variable podscale launch sets, as a whole number (``None`` when unset)."""
    if name not in os.environ:
        return None
    try:
        return int(os.environ[name])
    except ValueError:
        raise ValueError(
            f"{name}={os.environ[name]!r} (in the environment): a whole number, as podscale launch sets it; unset it "
            "or give the --coordinator-address, --num-processes and --process-id flags"
        ) from None


def setup(replicas: int | None, spec: ClusterSpec) -> None:
    """Configures CPU devices and joins the cluster. Call once, before any JAX computation.

    On the CPU backend, the replicas are simulated devices split evenly over the processes, at
    most :data:`podscale.parallel.mesh.MAX_CPU_DEVICES` per process; without ``replicas``, :data:`DEFAULT_CPU_REPLICAS`
    of them, which the process count must divide (a count that does not is refused, naming
    ``--replicas``, never replaced by another). A GPU or TPU backend uses its own devices."""
    jax = _jax()
    local, cpu_only_problem = local_devices(replicas, spec)
    if cpu_only_problem and _cpu_only():
        raise ValueError(cpu_only_problem)
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
        try:
            jax.distributed.initialize(**kwargs)
        except ValueError as e:
            if spec.explicit or "should be defined" not in str(e) and "must be defined" not in str(e):
                raise
            raise ValueError(
                "--distributed-auto: JAX found no cluster to join here (no SLURM job, TPU pod or other "
                f"environment it detects; it says: {e}). Run under SLURM or on a TPU pod, or give "
                "--coordinator-address HOST:PORT --num-processes N --process-id I on every host, or start "
                "local processes with podscale launch --processes N -- podscale train ..."
            ) from None
    if cpu_only_problem and jax.default_backend() == "cpu":
        raise ValueError(cpu_only_problem)
    if replicas is not None and jax.device_count() != replicas:
        raise ValueError(
            f"--replicas {replicas} asked for, but the {jax.default_backend()} backend has "
            f"{jax.device_count()} devices over {jax.process_count()} process(es); leave --replicas "
            "out to use all devices"
        )


def local_devices(replicas: int | None, spec: ClusterSpec) -> tuple[int, str | None]:
    """The CPU devices this process simulates for ``replicas`` over the spec's processes, checked
    without starting JAX; and a refusal that holds only where JAX runs on its CPU backend (or
    ``None``). :func:`setup` and ``--dry-run`` share it."""
    from podscale.parallel.mesh import MAX_CPU_DEVICES

    processes = spec.num_processes if spec.explicit else 1
    if spec.explicit and not 0 <= spec.process_id < processes:
        raise ValueError(f"--process-id {spec.process_id} must be in [0, {processes})")
    cpu_only_problem = None  # a refusal that holds only where JAX runs on its CPU backend
    if replicas is None:
        local = DEFAULT_CPU_REPLICAS // processes
        if DEFAULT_CPU_REPLICAS % processes:
            local = 1
            cpu_only_problem = (
                f"the {DEFAULT_CPU_REPLICAS} CPU devices simulated by default do not divide over the {processes} "
                f"processes; pass --replicas {_multiples(processes)} (a multiple of {processes}: every process "
                "simulates the same number of devices)"
            )
    else:
        if replicas < 1:
            raise ValueError(f"--replicas must be at least 1, got {replicas}")
        if replicas % processes:
            raise ValueError(
                f"--replicas {replicas} is not divisible by the {processes} processes; pass a multiple of "
                f"{processes}, such as {_multiples(processes, near=replicas)}"
            )
        local = replicas // processes
        if local > MAX_CPU_DEVICES:
            per = f" ({local} per process)" if processes > 1 else ""
            cpu_only_problem = (
                f"--replicas {replicas}: too many CPU devices to simulate{per}; JAX's CPU client runs a program "
                f"over at most {MAX_CPU_DEVICES} devices per process. Pass --replicas {MAX_CPU_DEVICES * processes} "
                f"or fewer{' (over these processes)' if processes > 1 else ''}, or run on a GPU or TPU backend"
            )
            local = 1  # never ask the CPU client for them, even where another backend runs
    return local, cpu_only_problem


def check_devices(replicas: int | None, spec: ClusterSpec) -> int:
    """:func:`local_devices`, its CPU-only refusal raised where JAX can only run on the CPU."""
    local, problem = local_devices(replicas, spec)
    if problem and _cpu_only():
        raise ValueError(problem)
    return local


def _multiples(processes: int, near: int = DEFAULT_CPU_REPLICAS) -> str:
    """The multiples of ``processes`` nearest ``near``, for a message: ``6 or 9``."""
    low = processes * max(1, near // processes)
    high = processes * (near // processes + 1)
    return str(low) if low == high else f"{low} or {high}"


def _cpu_only() -> bool:
    """Whether JAX can run on its CPU backend only, decided without starting a backend (none may
    start before ``jax.distributed.initialize``): ``JAX_PLATFORMS`` names ``cpu`` first, or no
    accelerator is installed (no PJRT plugin, no libtpu). Where this says no, :func:`setup`
    checks the backend itself once it runs."""
    jax = _jax()
    platforms = jax.config.jax_platforms
    if platforms:
        return platforms.split(",")[0].strip().lower() == "cpu"
    if os.environ.get("PJRT_NAMES_AND_LIBRARY_PATHS") or importlib.util.find_spec("libtpu") is not None:
        return False
    if importlib.metadata.entry_points(group="jax_plugins"):
        return False
    try:
        import jax_plugins
    except ImportError:
        return True
    return not any(pkgutil.iter_modules(jax_plugins.__path__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MAX_PROCESSES_PER_CORE = 4
"""``podscale launch`` starts its processes on this machine: past this many per CPU core they only
time-share the cores (and each holds its own JAX runtime in memory)."""


def check_launch(processes: int, command: list[str], grace_s: float = 60.0) -> list[str]:
    """Refuses launch's flags before any process starts; returns the command each child runs."""
    if not processes >= 1:
        raise ValueError(f"--processes must be at least 1, got {processes}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if processes > MAX_PROCESSES_PER_CORE * cores:
        raise ValueError(
            f"--processes {processes}: podscale launch starts every process on this machine, which has {cores} "
            f"CPU core(s); at most {MAX_PROCESSES_PER_CORE * cores} ({MAX_PROCESSES_PER_CORE} per core). For "
            "more, run podscale train on several hosts with --coordinator-address, --num-processes and --process-id"
        )
    if not (math.isfinite(grace_s) and grace_s >= 0):
        raise ValueError(
            f"--grace must be a finite number of seconds >= 0 (0 kills the other processes as soon as one "
            f"fails), got {grace_s}"
        )
    if not command:
        raise ValueError(
            "podscale launch: give the command after --, e.g. podscale launch --processes 2 -- podscale train"
        )
    if os.path.basename(command[0]) == "podscale":
        # This interpreter's podscale, whatever (if anything) ``podscale`` is on PATH.
        command = [sys.executable, "-m", "podscale.cli", *command[1:]]
    elif shutil.which(command[0]) is None:
        raise ValueError(
            f"podscale launch: command {command[0]!r} is not found or not executable (looked up as a shell would, on "
            "PATH for a bare name); give a program that runs, e.g. podscale launch --processes 2 -- podscale train"
        )
    return command


def launch(processes: int, command: list[str], grace_s: float = 60.0) -> int:
    """Runs ``command`` as ``processes`` local processes of one JAX run; returns an exit code.

    Each child gets ``PODSCALE_COORDINATOR=127.0.0.1:PORT``, ``PODSCALE_NUM_PROCESSES`` and
    ``PODSCALE_PROCESS_ID``. A command starting with ``podscale`` runs this interpreter's podscale
    (``python -m podscale.cli``), so a venv need not be on PATH. When one child fails, the others
    get ``grace_s`` seconds to stop with their own error (0: none, they are killed at once), then
    are killed.

    The exit code is the first one a failing child gave itself (a podscale exit code: 1 target
    not reached, 2 bad input, 3 a peer lost, ...). A child that died by a signal (SIGKILL, the
    out-of-memory killer; also the supervisor's 128 + N for its training child) or that launch
    killed after the grace period did not say why the run failed: its code counts only if no
    other child gave one, and then as a shell reports it, 128 + N. So a process killed with
    SIGKILL makes ``launch`` return the survivors' 3, not 137. 0 if every child exited 0.
    """
    command = check_launch(processes, command, grace_s)
    address = f"127.0.0.1:{_free_port()}"
    refusals = tempfile.mkdtemp(prefix="podscale-launch-")
    try:
        return _launch(processes, command, grace_s, address, refusals)
    finally:
        _print_other_refusals(refusals, processes)
        shutil.rmtree(refusals, ignore_errors=True)


def note_refusal(message: str) -> bool:
    """Under ``podscale launch``, records this process's refusal for launch; whether this process
    should print it itself (process 0 does; launch prints the others' that differ)."""
    folder, pid = os.environ.get(ENV_REFUSALS), os.environ.get(ENV_PROCESS_ID, "0")
    if not folder or not os.path.isdir(folder):
        return True
    try:
        with open(os.path.join(folder, f"{int(pid)}.txt"), "w") as f:
            f.write(message)
    except (OSError, ValueError):
        return True
    return pid == "0"


def _print_other_refusals(folder: str, processes: int) -> None:
    """The refusals of processes other than 0 that differ from process 0's (and from each other)."""
    said = set()
    for pid in range(processes):
        try:
            with open(os.path.join(folder, f"{pid}.txt")) as f:
                message = f.read()
        except OSError:
            continue
        if pid and message not in said:
            print(f"podscale: error (process {pid}): {message}", file=sys.stderr)
        said.add(message)


def _launch(processes: int, command: list[str], grace_s: float, address: str, refusals: str) -> int:
    children = []
    for pid in range(processes):
        env = supervise.users_env(
            **{
                ENV_COORDINATOR: address,
                ENV_NUM_PROCESSES: str(processes),
                ENV_PROCESS_ID: str(pid),
                ENV_REFUSALS: refusals,
                supervise.ENV_LAUNCHER: str(os.getpid()),
            }
        )
        children.append(subprocess.Popen(command, env=env, preexec_fn=_end_with_parent(os.getpid())))
    exits: list[tuple[int, bool]] = []  # (code, killed by launch) of the failing children, as noticed
    noticed: set[int] = set()
    killed: set[int] = set()
    failed_at = None
    stopped: list[int] = []  # the signals that reached launch itself

    def stop(signum, frame):
        # Launch stopped (SIGTERM, a scheduler's preemption): the processes are told, as each would
        # be (the run's coordinated save at one step, then exit); a second signal kills them.
        stopped.append(signum)
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM) if len(stopped) == 1 else child.kill()

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        while len(noticed) < processes:
            for pid, child in enumerate(children):
                code = child.poll()
                if code is None or pid in noticed:
                    continue
                noticed.add(pid)
                if code == 0:
                    continue
                exits.append((code, pid in killed))
                if failed_at is None:
                    failed_at = time.monotonic()
                    print(f"podscale launch: process {pid} {_describe(code)}; stopping the others", file=sys.stderr)
            if failed_at is not None and time.monotonic() - failed_at >= grace_s:
                for pid, child in enumerate(children):
                    if child.poll() is None:
                        killed.add(pid)
                        child.kill()
            time.sleep(0.05)
    except KeyboardInterrupt:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in children:
            child.wait()
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    if stopped:
        name = signal.Signals(stopped[0]).name
        print(
            f"podscale launch: stopped by {name}; its {processes} processes were told and have ended", file=sys.stderr
        )
        code = _exit_code(exits)
        return code if code else 128 + stopped[0]
    return _exit_code(exits)


def _end_with_parent(parent: int):
    """What a process launch starts runs first (``preexec_fn``): on Linux, the kernel sends it
    SIGTERM when launch dies, even by SIGKILL (``prctl(PR_SET_PDEATHSIG)``), which it takes as a
    stop (the run's coordinated save); if launch is gone already, it ends at once. Elsewhere
    nothing (a supervised podscale process also watches its parent, :func:`supervise.run`)."""
    if not sys.platform.startswith("linux"):
        return None

    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # found before the fork; only called after it
    pr_set_pdeathsig = 1

    def arm():
        prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # launch died before the call
            os._exit(128 + int(signal.SIGTERM))

    return arm


def _by_signal(code: int) -> bool:
    """An exit by a signal: Popen's -N, or 128 + N as a shell or podscale's supervisor reports it."""
    return code < 0 or code > 128


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _exit_code(exits: list[tuple[int, bool]]) -> int:
    """``launch``'s exit code from its failing children's (code, killed by launch), in the order
    they were noticed: see :func:`launch`."""
    own = [code for code, killed in exits if not killed and not _by_signal(code)]
    if own:
        return own[0]
    if exits:
        code = exits[0][0]
        return 128 - code if code < 0 else code
    return 0


def orbax_barriers() -> None:
    """With several processes, orbax's barriers through JAX's coordination service (its
    ``experimental_orbax_use_distributed_barrier``), as podscale's own are (``parallel.together``),
    not through a device collective: such a barrier is an all-gather over every device, which sets
    up the processes' gloo group for that program and was seen to hang there, one process inside
    it and the other already past it (the two-process SIGTERM test's stacks). Call after importing
    orbax (which defines the flag)."""
    jax = _jax()
    if jax.process_count() > 1:
        from absl import flags

        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()  # podscale's CLI parses no absl flags: theirs keep their defaults
        flags.FLAGS.experimental_orbax_use_distributed_barrier = True
