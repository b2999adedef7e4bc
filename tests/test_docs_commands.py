"""Every ``podscale`` command that README.md and docs/ show runs here, or passes its own checks.

A command is read from the fenced code blocks of the Markdown files (continuation lines joined,
``# comments`` dropped), so a new example is checked as soon as it is written. Each one runs with
``--dry-run``: the flags, the output paths and the mesh and batch arithmetic are checked as a real
run checks them before any work, with nothing compiled or trained. The quick ones also run for
real below.
"""

from __future__ import annotations

import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from podscale import cli

ROOT = pathlib.Path(__file__).resolve().parent.parent
PODSCALE = [sys.executable, "-m", "podscale.cli"]


def doc_commands() -> list[tuple[str, str]]:
    """``(file:line, command)`` for every line of a fenced block that starts with ``podscale``."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        fenced, pending = False, ""
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip().startswith("```"):
                fenced, pending = not fenced, ""
                continue
            if not fenced:
                continue
            text = pending + line.strip()
            if text.endswith("\\"):
                pending = text[:-1] + " "
                continue
            pending = ""
            text = re.sub(r"\s#\s.*$", "", text).strip()
            if text.startswith("podscale "):
                found.append((f"{path.relative_to(ROOT)}:{number}", text))
    return found


COMMANDS = doc_commands()


def test_the_docs_show_commands_of_every_subcommand():
    shown = {shlex.split(c)[1] for _, c in COMMANDS}
    assert shown >= {"train", "plan", "bench", "project", "models", "launch"}, shown
    assert not [c for _, c in COMMANDS if "..." in c], "a documented command must be complete, not elided"


def _argv(command: str) -> list[str]:
    argv = shlex.split(command)[1:]
    if argv[0] == "launch":
        return ["launch", "--dry-run", *argv[1:]]
    if argv[0] == "models":
        return argv
    return [*argv, "--dry-run"]


def _in_process(argv: list[str]) -> bool:
    """The test session has 8 CPU devices and stdout of its own: a command that asks for another
    device count, starts processes or points stdout at stderr (``train --json``) runs as a child."""
    if argv[0] == "launch" or (argv[0] == "train" and "--json" in argv):
        return False
    if "--replicas" in argv:
        return argv[argv.index("--replicas") + 1] == "8"
    return True


@pytest.mark.parametrize(("where", "command"), COMMANDS, ids=[w for w, _ in COMMANDS])
def test_every_documented_command_passes_its_checks(where, command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # output paths such as runs/a or scaling.png land here
    (tmp_path / "docs").mkdir()  # as in the repository, where the commands run
    if "--resume" in command:  # it continues the run the command before it starts
        first = subprocess.run(
            [*PODSCALE, *shlex.split(command.replace("--resume", ""))[1:], "--checkpoint-every", "5", "--steps", "5"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert first.returncode == 0, first.stderr
    argv = _argv(command)
    if _in_process(argv):
        code = cli.main(argv)
        out = capsys.readouterr()
        assert code == 0, f"{where}: {command}\n{out.err}"
        return
    proc = subprocess.run([*PODSCALE, *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{where}: {command}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_the_readme_s_checkpoint_and_resume_commands_run(tmp_path):
    """README's pair: a run that saves every 50 steps, then its continuation from step 100 to 200."""
    first, then = [c for _, c in COMMANDS if "--workdir runs/a" in c][:2]
    for command in (first, then):
        proc = subprocess.run(
            [*PODSCALE, *shlex.split(command)[1:], "--no-progress"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, f"{command}\n{proc.stderr}"
    assert (tmp_path / "runs/a/checkpoints/200").is_dir()


def test_a_dry_run_refuses_what_the_run_would_refuse(capsys):
    """--dry-run is the run's own checks: a bad value fails it with the run's message and code."""
    assert cli.main(["train", "--model", "mlp", "--batch-size", "12", "--dry-run"]) == 2
    assert "--batch-size 12 is not divisible by the 8 replicas" in capsys.readouterr().err
    assert cli.main(["plan", "--model", "transformer", "--mesh", "4x2", "--spatial", "2", "--dry-run"]) == 2
    assert "spatial" in capsys.readouterr().err
