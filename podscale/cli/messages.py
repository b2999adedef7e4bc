"""What the command line says besides a command's result: a refusal as one ``podscale: error:``
line in flags (exit code 2; under ``--json`` one JSON object too), a podscale warning as one line,
and a dry run's report."""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings

from podscale.parallel.checks import PodscaleWarning

JSON_OUT = [None]
"""Where ``--json`` output goes once ``train`` has pointed file descriptor 1 at stderr."""


def dry_run_result(args, what: dict) -> int:
    """What ``--dry-run`` prints once every check has passed: nothing was run."""
    if getattr(args, "json", False):
        print(json.dumps({"dry_run": True, **what}), file=JSON_OUT[0] or sys.stdout, flush=True)
    else:
        shown = ", ".join(
            f"{k} {v}" for k, v in what.items() if v is not None and k != "dry_run" and not isinstance(v, list)
        )
        print(f"podscale {args.command}: dry run: the flags check out ({shown}); nothing was run")
        for v in what.values():
            if isinstance(v, list):
                print("\n".join(f"  {item}" for item in v))
    return 0


def show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """On the command line a podscale warning is one line in flags, like its errors."""
    if issubclass(category, PodscaleWarning):
        print(f"podscale: warning: {as_flags(str(message))}", file=sys.stderr)
    else:
        warnings._showwarning_orig(message, category, filename, lineno, file, line)


def refusals() -> tuple[type[Exception], ...]:
    """What a command refuses with one ``podscale: error:`` line and exit code 2: a ValueError, or a
    CheckpointError where checkpoints were read (evaluated as an exception reaches it: the
    checkpoint module loads JAX, and a command that never loaded it raises none)."""
    checkpoint = sys.modules.get("podscale.train.checkpoint")
    return (ValueError,) if checkpoint is None else (ValueError, checkpoint.CheckpointError)


def as_flags(message: str) -> str:
    """Library errors name parameters (``grad_sum='2d'``, ``strict=True``, ``min_shard_size must``,
    ``drop model_parallel``, ``make_mesh((4, 2))``); on the command line they are flags
    (``--grad-sum 2d``, ``--strict``, ``--min-shard-size must``, ``drop --model-parallel``,
    ``--mesh 4x2``). The one place the two meet. Python-only advice (``rules=Rules(...)``) is left
    as it is."""
    import re

    from podscale.parallel.strategy import Strategy, flag_name

    for f in sorted(dataclasses.fields(Strategy), key=lambda f: -len(f.name)):  # grad_sum_chunks before grad_sum
        if not f.metadata.get("cli", True):
            continue  # no flag (data_axes)
        flag = flag_name(f.name)
        if f.type in ("bool", bool):  # a switch: strict=True is --strict
            message = re.sub(rf"\b{f.name}=True\b", flag, message)
            message = re.sub(rf"\b{f.name}=False\b", f"no {flag}", message)
        message = re.sub(rf"\b{f.name}=(['\"]?)([^'\"\s,;()]*)\1(?![\w(])", rf"{flag} \2", message)
        message = re.sub(rf"\b{f.name} must\b", f"{flag} must", message)
        if "_" in f.name:  # a bare parameter name of two words cannot be plain English: the flag
            message = re.sub(rf"(?<![\w.-]){f.name}\b(?![=(])", flag, message)
    message = re.sub(r"\bbn_group_size=(\d+)", r"--bn-group-size \1", message)  # make_mesh's, a train flag
    message = re.sub(r"make_mesh\(\((\d+(?:, \d+)*),?\)\)", lambda m: "--mesh " + "x".join(m[1].split(", ")), message)
    return message
