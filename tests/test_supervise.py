"""The supervisor's reading of JAX's fatal messages, and its relay of the child's stderr (fast:
canned messages as jaxlib 0.10.2 prints them; the multi-process runs are in test_cli.py)."""

import io
import os

from podscale.train import supervise

FATAL = (
    "F1201 14:49:42.597537   22238 client.h:80] Terminating process because the JAX distributed service "
    "detected fatal errors. This most likely indicates that another task died; "
)
PEER = FATAL + (
    "absl::Status: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):\n1\n"
    "The tasks have crashed.\n"
)
LEADER = FATAL + (
    "absl::Status: UNAVAILABLE: Failed to send RPC to coordination service. Either the leader task was "
    "preempted/died/restarted unexpectedly or this task is experiencing network issues.\n"
)
LEADER_SILENT = (
    FATAL
    + "absl::Status: DEADLINE_EXCEEDED: Deadline Exceeded\n\nRPC: /xla.coordination.CoordinationService/PollForError\n"
)
JOIN = (
    FATAL
    + "absl::Status: DEADLINE_EXCEEDED: Deadline Exceeded\n\nRPC: /xla.coordination.CoordinationService/RegisterTask\n"
)


def test_reason_names_the_lost_process_the_coordinator_or_the_join():
    assert supervise.reason(PEER, "h:1", 10, 60).startswith(
        "process 1 stopped sending heartbeats for --heartbeat-timeout 10 s"
    )
    assert supervise.reason(LEADER, "h:1", 10, 60).startswith("lost the coordinator at h:1 (process 0)")
    # A coordinator gone silent (no connection reset): a deadline on an RPC, not a failed join.
    assert supervise.reason(LEADER_SILENT, "h:1", 10, 60).startswith("lost the coordinator at h:1")
    assert supervise.reason(JOIN, "h:1", 10, 60).startswith("the run did not assemble within --join-timeout 60 s")
    assert "JAX's initialization timeout" in supervise.reason(JOIN, None, 10, None)


def test_the_relay_passes_the_run_through_and_keeps_the_fatal_message_and_stack_back(monkeypatch, capsysbinary):
    read, write = os.pipe()
    os.write(
        write, b"step 1\rstep 2\n[Gloo] Rank 0\n" + PEER.encode() + b"*** Check failure stack trace: ***\n    @ 0x1\n"
    )
    os.close(write)
    tail, fatal = supervise._relay(io.FileIO(read))
    out = capsysbinary.readouterr().err
    assert fatal and out == b"step 1\rstep 2\n[Gloo] Rank 0\n"
    assert b"stopped sending heartbeats" in tail and b"Check failure" in tail


def test_a_failed_collective_with_no_process_named_ends_with_one_line_saying_why(monkeypatch, capsys):
    """gloo's set-up of a device group that timed out (processes 30 s apart at its first
    collective, seen in CI) is told apart from any other failed collective."""
    monkeypatch.setattr(supervise.time, "sleep", lambda s: None)
    exits = []
    monkeypatch.setattr(supervise.os, "_exit", exits.append)
    setup = RuntimeError(
        "UNKNOWN: Gloo context initialization failed: DEADLINE_EXCEEDED: GetKeyValue() timed out with key: "
        "cpu:gloo/0,1,2,3,2048,2049,2050,2051/4 and duration: 29.99s"
    )
    supervise.wait_for_verdict(setup, 10)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert exits == [supervise.EXIT_PEER_LOST]
    assert last.startswith("podscale: error: a collective failed and no process was reported lost: UNKNOWN: Gloo")
    assert "gloo waits 30 s for every process at the first collective" in last and last.endswith("--resume")
    other = supervise.verdict_missing("Gloo all-reduce failed: Connection closed by peer")
    assert "30 s" not in other and other.endswith("restart every process with --resume")
