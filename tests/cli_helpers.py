"""What the CLI tests share: running ``shardwise`` as a person does, and reading a run folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from shardwise_app.cli.signals import READY_DIR_ENV

# Small and quick, but still a real run: 2 ranks, validation, a checkpoint.
FAST = ["--steps", "24", "--batch-size", "8", "--seq-len", "64", "--eval-every", "8"]
# A run long enough to be stopped from outside while it trains.
LONG = ["--steps", "500", "--batch-size", "4", "--seq-len", "32", "--nproc", "2"]


def env() -> dict[str, str]:
    e = dict(os.environ)
    # Never let an outer launcher's variables make the CLI think it is a worker.
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SHARDWISE_LAUNCH_ID"):
        e.pop(k, None)
    e.pop("SHARDWISE_RUN_CONFIG", None)
    e.pop(READY_DIR_ENV, None)
    return e


def shardwise(*args: str, cwd: Path, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardwise", *args],
        cwd=cwd,
        env=env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start(
    *args: str, cwd: Path, log: Path | None = None, ready: Path | None = None
) -> subprocess.Popen[str]:
    """``shardwise ARGS`` in the background, in its own session as a terminal job would be.

    With ``log``, stdout and stderr go to that file: workers that outlive
    their launcher keep a pipe open, a file they do not. With ``ready`` (a
    folder, made here), the workers announce their phases there (``announced``).
    """
    out = open(log, "w") if log else subprocess.PIPE  # noqa: SIM115 - the child holds it
    e = env()
    if ready is not None:
        ready.mkdir(parents=True, exist_ok=True)
        e[READY_DIR_ENV] = str(ready)
    return subprocess.Popen(
        [sys.executable, "-m", "shardwise", *args],
        cwd=cwd,
        env=e,
        stdout=out,
        stderr=subprocess.STDOUT if log else subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def wait_for(what: str, cond: Callable[[], bool], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def announced(ready: Path, phase: str) -> dict[int, int]:
    """rank -> pid of each worker that announced ``phase`` ("armed": its entry took the stop
    signals over; "joined": it joined the process group) in the folder ``ready``
    (cli/signals.py's ``announce``); a restarted worker's announcement replaces the last."""
    found = {}
    for f in ready.glob(f"rank*.{phase}"):
        try:
            found[int(f.name[len("rank") : -len(phase) - 1])] = int(f.read_text())
        except (OSError, ValueError):  # replaced between the listing and the read
            continue
    return found


def wait_announced(
    ready: Path, phase: str, ranks: int, proc: subprocess.Popen[str] | None = None
) -> dict[int, int]:
    """Wait until ``ranks`` workers announced ``phase``; rank -> pid. Fails at once with the
    job's exit code if ``proc`` (the launcher) ends first."""

    def done() -> bool:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"ended ({proc.returncode}) before every rank was {phase}")
        return len(announced(ready, phase)) >= ranks

    wait_for(f"{ranks} workers {phase}", done, timeout=150)
    return announced(ready, phase)


def rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def checkpoints(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def children(pid: int) -> list[int]:
    """The worker processes a launcher started (Linux /proc)."""
    found = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:  # the launcher itself has ended
        return found
    for task in tasks:
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # a thread that ended between the listing and the read
            continue
    return found


def alive(pid: int) -> bool:
    """Running: not gone and not a zombie nobody reaps (an orphan's fate in a container)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def rank_of(pid: int) -> int:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(v for v in environ if v.startswith(b"RANK=")).split(b"=")[1])


def one_line(text: str) -> str:
    """The one line a failure prints; fails on tracebacks or more lines."""
    lines = [line for line in text.splitlines() if line.strip()]
    assert "Traceback" not in text and len(lines) == 1, text
    return lines[0]
