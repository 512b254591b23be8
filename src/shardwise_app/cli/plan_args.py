"""What ``shardwise plan`` and ``shardwise calibrate`` share on the command line.

Bad flags are one line and exit code 2, as every other bad input; ``--help``
shows each flag's default; a file written at the end is tried at the start.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .common import OneLineParser as OneLineParser  # plan's, calibrate's and the benchmarks'
from .common import UsageError, cannot_create


def parse_raf(text: str) -> bool | int:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected true, false or an int, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"an int must be at least 1, got {n}")
    return n


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default in ``--help``, where there is one to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        return super()._get_help_string(action) or text


def check_output(path: str, flag: str) -> None:
    """A file ``flag`` will write at the end: tried now (created and removed if new), so
    that a path that cannot be written is one line before minutes of work."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{flag} {path}: is a folder; give a file name")
    parent = p.parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: there is no folder {str(parent)!r}")
    why = cannot_create(p)
    if why is not None:
        raise UsageError(f"{flag} {path}: cannot write it ({why})")
