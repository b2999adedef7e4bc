"""Every ``podscale`` command that README.md and docs/ show runs here, or passes its own checks.

A command is read from the fenced code blocks of the Markdown files (continuation lines joined,
``# comments`` dropped), so a new example is checked as soon as it is written. Each one runs with
``--dry-run``: the flags, the output paths and the mesh and batch arithmetic are checked as a real
run checks them before any work, with nothing compiled or trained. The quick ones also run for
real below. A command shown on several pages (README.md's one line per command, again on its docs
page) is checked once.

A command that compiles through XLA:TPU (``plan --system``, ``project --compiler tpu``) needs libtpu,
which ``make demo`` does not install: beside it, its ``# comment`` says ``pip install
'podscale[tpu]'``. Every other command is checked with libtpu hidden, as after ``make demo``, so a
command that needs it without saying so fails here.
"""

from __future__ import annotations

import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from podscale import cli
from podscale.compiled import tpu

ROOT = pathlib.Path(__file__).resolve().parent.parent
PODSCALE = [sys.executable, "-m", "podscale.cli"]


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TPU_EXTRA = "pip install 'podscale[tpu]'"
"""What a command that needs libtpu says in its comment."""


def doc_commands() -> list[tuple[str, str, str]]:
    """``(file:line, command, comment)`` for every line of a fenced block that starts with ``podscale``."""
    found = []
    for path in PAGES:
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
            comment = re.search(r"\s#\s.*$", text)
            text = re.sub(r"\s#\s.*$", "", text).strip()
            if text.startswith("podscale "):
                found.append((f"{path.relative_to(ROOT)}:{number}", text, comment.group().strip() if comment else ""))
    return found


SHOWN = doc_commands()
FIRST_SHOWN: dict[str, str] = {}
for _where, _command, _ in SHOWN:
    FIRST_SHOWN.setdefault(_command, _where)
COMMANDS = [(where, command) for command, where in FIRST_SHOWN.items()]
"""Each distinct command once, where it is first shown."""


def needs_libtpu(command: str) -> bool:
    """XLA:TPU's compile for a slice without a TPU: ``plan --system`` (TPU systems only) or
    ``project --compiler tpu``. ``project`` on a TPU system without it costs XLA:CPU's module."""
    argv = shlex.split(command)[1:]
    if argv[0] == "plan":
        return "--system" in argv
    return argv[0] == "project" and "--compiler" in argv and argv[argv.index("--compiler") + 1] == "tpu"


def test_the_docs_show_commands_of_every_subcommand():
    shown = {shlex.split(c)[1] for _, c in COMMANDS}
    assert shown >= {"train", "plan", "bench", "project", "models", "launch", "verify"}, shown
    readme = {shlex.split(c)[1] for w, c, _ in SHOWN if w.startswith("README.md:")}
    assert readme >= {"train", "plan", "bench", "project", "models", "launch", "verify"}, readme
    assert not [c for _, c in COMMANDS if "..." in c], "a documented command must be complete, not elided"
    pages = {w.split(":")[0] for w, _, _ in SHOWN}
    for page in ("cli", "checkpoints", "workloads", "techniques", "projection", "exactness", "benchmarks"):
        assert f"docs/{page}.md" in pages, f"docs/{page}.md shows no command: is it still read?"


def test_every_command_that_needs_libtpu_says_so_beside_it():
    """After ``make demo`` (no libtpu) such a command is refused: the page says so where it shows it."""
    unmarked = [f"{w}: {c}" for w, c, comment in SHOWN if needs_libtpu(c) and TPU_EXTRA not in comment]
    assert not unmarked, f"say '# needs libtpu: {TPU_EXTRA}' beside:\n" + "\n".join(unmarked)
    marked = [f"{w}: {c}" for w, c, comment in SHOWN if not needs_libtpu(c) and TPU_EXTRA in comment]
    assert not marked, "marked as needing libtpu, but it runs without:\n" + "\n".join(marked)
    assert any(needs_libtpu(c) for _, c, _ in SHOWN)
    readme = (ROOT / "README.md").read_text()
    assert TPU_EXTRA in readme and "make demo` does not install" in readme


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
        if not needs_libtpu(command):  # as after `make demo`: a command that needs libtpu and does not say so fails
            monkeypatch.setattr(tpu, "available", lambda: False)
        code = cli.main(argv)
        out = capsys.readouterr()
        if needs_libtpu(command) and not tpu.available():  # the refusal the page's note answers
            assert code == 2 and TPU_EXTRA in out.err, f"{where}: {command}\n{out.err}"
            return
        assert code == 0, f"{where}: {command}\n{out.err}"
        return
    assert not needs_libtpu(command), f"{where}: a child process cannot hide libtpu: {command}"
    proc = subprocess.run([*PODSCALE, *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{where}: {command}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_the_readme_s_checkpoint_and_resume_commands_run(tmp_path):
    """README's pair: a run that saves every 50 steps, then its continuation from step 100 to 200."""
    first, then = [c for _, c in COMMANDS if "--workdir runs/a --checkpoint-every 50" in c or "runs/a --resume" in c]
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


def _anchors(path: pathlib.Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation but ``-`` and ``_`` dropped."""
    headings = re.findall(r"^#+ (.+)$", path.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_every_link_between_the_pages_resolves():
    """README.md is a page of links into docs/: each names a page that exists, at a heading it has."""
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if "://" in target:
                continue
            file, _, anchor = target.partition("#")
            linked = (page.parent / file).resolve() if file else page
            if not linked.exists() or (anchor and anchor not in _anchors(linked)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken
