"""Each process of a multi-process run trains under a small supervisor, so that a lost peer ends
the run with a podscale message instead of a C++ abort.

JAX's coordination service ends a process from a C++ thread when it learns that the run cannot
go on: a peer that stopped sending heartbeats (noticed within ``--heartbeat-timeout``), a
coordinator that went away (noticed at once), or processes that did not all join within
``--join-timeout``. jaxlib 0.10 gives Python no way to take that over (its
``missed_heartbeat_callback`` cannot be called from Python), so ``podscale train`` runs the
training in a child process and reads what the child wrote to stderr when it dies: the
survivor exits with :data:`EXIT_PEER_LOST` and one line naming the lost process or the
coordinator's address. The supervisor forwards SIGTERM and SIGINT to the child (which stops at
a step boundary with every other process, see :mod:`podscale.train.interrupt`), and the child
ends itself when its supervisor is killed, so killing either one kills this process of the run.

Standard library only: the supervisor never loads JAX.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

ENV_SUPERVISED = "PODSCALE_SUPERVISED"
"""Set in the child: it trains, and watches that its supervisor is alive."""
ENV_LAUNCHER = "PODSCALE_LAUNCHER"
"""Set by ``podscale launch`` in each process it starts: its own process id. A supervisor whose
launcher is gone stops its process of the run as a SIGTERM would (:func:`run`)."""
ENV_STDERR_TTY = "PODSCALE_STDERR_TTY"
"""Set in the child when the supervisor's stderr is a terminal: the progress bar draws as usual."""
EXIT_PEER_LOST = 3
"""Exit code of a process whose run lost a peer, lost its coordinator, or never assembled."""

_FATAL = b"Terminating process because the JAX distributed service"
_KEEP = 1 << 16  # bytes of the child's stderr kept to read the reason from


def users_env(**extra: str) -> dict[str, str]:
    """This process's environment plus ``extra``, for a process podscale starts: without the
    ``JAX_PLATFORMS`` that podscale itself set (:data:`podscale.compiled.tpu.ENV_SET_PLATFORMS` marks
    it), so the child has the user's and, if it imports podscale, decides again."""
    env = dict(os.environ, **extra)
    if env.pop("PODSCALE_SET_JAX_PLATFORMS", None):
        env.pop("JAX_PLATFORMS", None)
    return env


def run(
    argv: list[str],
    *,
    process_id: int | None,
    num_processes: int | None,
    coordinator: str | None,
    heartbeat_s: int,
    join_s: int,
    json_out: bool,
) -> int:
    """Runs ``podscale <argv>`` as a child and returns its exit code, or :data:`EXIT_PEER_LOST`
    with one line on stderr when JAX's distributed service ended it."""
    env = users_env(**{ENV_SUPERVISED: str(os.getpid())})
    if sys.stderr.isatty():
        env[ENV_STDERR_TTY] = "1"
    child = None
    received = []

    def forward(signum, frame):
        # The first signal asks the run to stop at a step boundary; JAX's own SIGTERM handler
        # swallows any further SIGTERM, so a second one ends this process of the run at once.
        received.append(signum)
        if child is not None and child.poll() is None:
            if len(received) == 1:
                child.send_signal(signum)
            else:
                child.kill()

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    _watch_launcher(received)
    try:
        # A session of its own: a terminal's Ctrl-C reaches the supervisor only, which passes it
        # on once.
        child = subprocess.Popen(
            [sys.executable, "-m", "podscale.cli", *argv], env=env, stderr=subprocess.PIPE, start_new_session=True
        )
        if received:  # a signal that came before the child existed
            child.send_signal(received[0])
        tail, fatal = _relay(child.stderr)
        code = child.wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if len(received) > 1 and not fatal:
        name = signal.Signals(received[-1]).name
        print(
            f"podscale: stopped by a second {name}, without saving; continue from the last checkpoint", file=sys.stderr
        )
        return 128 + received[-1]
    if not fatal:
        return 128 - code if code < 0 else code  # killed by a signal: as a shell reports it
    me = f"process {process_id} of {num_processes}" if process_id is not None else "this process"
    text = tail.decode(errors="replace")
    text = text[text.find(_FATAL.decode()) :]  # JAX's last words, not the run's earlier output
    message = f"{me}: {reason(text, coordinator, heartbeat_s, join_s)}"
    print(f"podscale: error: {message}", file=sys.stderr, flush=True)
    if json_out:
        print(json.dumps({"error": message, "exit_code": EXIT_PEER_LOST}), flush=True)
    return EXIT_PEER_LOST


def _watch_launcher(received: list) -> None:
    """Under ``podscale launch``: when the launcher dies (even by SIGKILL), this process of the run
    stops as on a SIGTERM (the run's coordinated save), also where the kernel does not say so
    (Linux's ``PR_SET_PDEATHSIG``, which launch sets, sends the SIGTERM itself)."""
    launcher = os.environ.get(ENV_LAUNCHER, "")
    if not launcher.isdigit() or os.getppid() != int(launcher):
        return

    def watch():
        while os.getppid() == int(launcher):
            time.sleep(0.5)
        if not received:  # not told already (Linux's PR_SET_PDEATHSIG): one SIGTERM, a stop, not a kill
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="podscale-launcher-watch", daemon=True).start()


def _relay(pipe) -> tuple[bytes, bool]:
    """Copies the child's stderr to ours as it comes, whole lines at a time (a progress bar's
    carriage returns count as line ends), up to JAX's fatal message: that and its C++ stack trace
    are kept to read the reason from, not shown."""
    out = sys.stderr.buffer
    tail, pending, fatal = b"", b"", False
    while chunk := os.read(pipe.fileno(), 1 << 14):
        tail = (tail + chunk)[-_KEEP:]
        if fatal:
            continue
        pending += chunk
        cut = max(pending.rfind(b"\n"), pending.rfind(b"\r")) + 1
        lines, pending = pending[:cut], pending[cut:]
        if (at := lines.find(_FATAL)) >= 0:
            fatal = True
            lines = lines[: lines.rfind(b"\n", 0, at) + 1]
        out.write(lines)
        out.flush()
    if not fatal:
        out.write(pending)
        out.flush()
    return tail, fatal


def reason(text: str, coordinator: str | None, heartbeat_s: int, join_s: int | None) -> str:
    """What JAX's fatal message ``text`` (from its "Terminating process" line on) means, in a
    user's terms. A lost peer or coordinator is looked for first: a join that timed out names
    the task registration (``RegisterTask``) that never completed."""
    where = f"the coordinator at {coordinator}" if coordinator else "the coordinator"
    again = "restart every process with --resume to continue from the last checkpoint in --workdir"
    lost = re.findall(r"Task (\d+) heartbeat timeout", text)
    if m := re.search(r"stopped sending heartbeats\):\s*\n([\d,\s]+)", text):
        lost += re.findall(r"\d+", m.group(1))
    if lost:
        who = ", ".join(f"process {p}" for p in sorted(set(lost), key=int))
        return (
            f"{who} stopped sending heartbeats for --heartbeat-timeout {heartbeat_s} s (it died, or its "
            f"host froze or lost the network), and the run cannot go on without it; {again}"
        )
    if "RegisterTask" in text:
        waited = f"--join-timeout {join_s} s" if join_s else "JAX's initialization timeout"
        return (
            f"the run did not assemble within {waited}: not every process reached {where}. Start all "
            "--num-processes processes with the same --coordinator-address (process 0 runs the coordinator), "
            "and check that its host and port are reachable from here"
        )
    service = "coordination service" in text or "CoordinationService" in text
    if "leader task" in text or service and ("UNAVAILABLE" in text or "DEADLINE" in text):
        return f"lost {where} (process 0): it died or cannot be reached, and the run cannot go on; {again}"
    status = re.search(r"absl::Status: ([^\n]*)", text)
    detail = status.group(1)[:300] if status else "no reason given"
    return f"JAX's distributed service stopped the run ({detail}); {again}"


def watch_parent() -> None:
    """In the child: end this process soon after its supervisor dies (even by SIGKILL), so that
    killing a supervised process kills its part of the run; at once if it is gone already."""
    expected = os.environ.get(ENV_SUPERVISED, "")
    parent = int(expected) if expected.isdigit() else os.getppid()
    if os.getppid() != parent:
        os._exit(EXIT_PEER_LOST)

    def watch():
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(EXIT_PEER_LOST)

    threading.Thread(target=watch, name="podscale-supervisor-watch", daemon=True).start()


def wait_for_verdict(error: BaseException, heartbeat_s: int, json_out=None) -> None:
    """In the child, after a collective failed (gloo's connection to a peer dropped): the
    distributed service names the lost process within the heartbeat timeout and ends this one,
    which the supervisor reports. If it does not, end with the collective's own error."""
    first = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
    print(
        f"podscale: a collective failed ({first}); waiting up to {heartbeat_s + 10} s for the distributed "
        "service to say which process was lost",
        file=sys.stderr,
        flush=True,
    )
    time.sleep(heartbeat_s + 10)
    message = verdict_missing(first)
    print(f"podscale: error: {message}", file=sys.stderr, flush=True)
    if json_out is not None:
        print(json.dumps({"error": message, "exit_code": EXIT_PEER_LOST}), file=json_out, flush=True)
    os._exit(EXIT_PEER_LOST)


def verdict_missing(first: str) -> str:
    """The last line when a collective failed (its error's first line ``first``) and the distributed
    service named no lost process."""
    why = ""
    if "Gloo context initialization failed" in first:
        # XLA sets up gloo for a device group at the first program that uses it and waits 30 s
        # there; podscale.parallel.together starts podscale's own programs together.
        why = (
            " (gloo waits 30 s for every process at the first collective of a group of devices: one "
            "process reached it that much before another, still compiling or reading its data)"
        )
    return f"a collective failed and no process was reported lost: {first}{why}; restart every process with --resume"
