"""The run folder: which checkpoint to resume, who may write, and when files change.

Three rules keep what a user has safe:

- One writer. An exclusive lock on ``<run>/.lock`` is taken before anything
  is written; a second ``shardwise train`` on the same folder is refused,
  naming the pid that holds it.
- Verify before use. A checkpoint is checked (``checkpoint.verify``) before
  it is chosen; a damaged latest one is skipped for the previous complete one,
  and the skip is said out loud. One that would run code when loaded
  (``UnsafeCheckpoint``: someone crafted it) is refused, never passed over:
  the folder it is in is not the run it claims to be.
- Read without running code. ``verify`` reads every file of the checkpoint as
  ``checkpoint.load`` will (``shardwise/safe_load.py``), and the run's
  ``config.json`` is JSON, which builds no objects.
- Change nothing until the resume has loaded. ``config.json`` and
  ``metrics.jsonl`` are rewritten by rank 0 only once every rank holds the
  checkpoint's state (``commit``), so a failed or interrupted start leaves
  the folder as it was.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import IO

from .common import UsageError
from .report import read_jsonl
from .run_config import RunConfig

LOCK = ".lock"
CORPUS = "corpus"  # the tokenized --data (cli/corpus.py): derived, made again at will
_STEP = re.compile(r"step_\d+")


# ---- checkpoints ----------------------------------------------------------------------------


def is_checkpoint(path: Path) -> bool:
    """A complete DCP checkpoint folder (DCP writes ``.metadata`` last)."""
    return (path / ".metadata").is_file()


def find_checkpoint(path: str, flag: str) -> tuple[Path, RunConfig]:
    """A run folder (its latest undamaged checkpoint) or a checkpoint folder, and the run's config.

    Run folders hold ``config.json`` and ``checkpoints/step_NNNNNN``. A
    damaged checkpoint given by name is refused; in a run folder, each
    damaged one newer than the one chosen is named on stderr. A checkpoint
    that would run code when loaded is refused in both, before anything loads.
    """
    from shardwise.checkpoint import DamagedCheckpoint, UnsafeCheckpoint, verify

    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UsageError(f"{flag} {path}: is a file; give a run folder or a checkpoint folder")
    if not p.is_dir():
        raise UsageError(f"{flag} {path}: no such folder")
    if is_checkpoint(p):
        try:
            verify(p)
        except DamagedCheckpoint as e:
            raise UsageError(f"{flag} {path}: the checkpoint is damaged: {e}") from None
        except UnsafeCheckpoint as e:
            raise UsageError(f"{flag} {path}: {e}") from None
        ckpt, run = p, p.parent.parent
    else:
        steps = sorted(
            (c for c in (p / "checkpoints").glob("step_*") if _STEP.fullmatch(c.name)),
            key=lambda c: c.name,
            reverse=True,
        )
        complete = [c for c in steps if is_checkpoint(c)]
        if not complete:
            raise UsageError(
                f"{flag} {path}: not a checkpoint (no .metadata) nor a run folder "
                "with a complete checkpoints/step_* inside"
            )
        damaged: list[str] = []
        for c in complete:
            try:
                verify(c)
                break
            except DamagedCheckpoint as e:
                damaged.append(str(e))
            except UnsafeCheckpoint as e:
                raise UsageError(f"{flag} {path}: {e}") from None
        else:
            raise UsageError(
                f"{flag} {path}: every checkpoint is damaged; the latest: {damaged[0]}"
            )
        ckpt, run = c, p
        for d in damaged:
            print(f"warning: {d}; using {ckpt.name} instead", file=sys.stderr)
    try:
        config = RunConfig.read(run / "config.json")
    except (OSError, ValueError, TypeError):
        raise UsageError(
            f"{flag} {path}: cannot read the run's config.json (looked in "
            f"{run}); a checkpoint must stay inside its run folder"
        ) from None
    return ckpt, config


# ---- one writer -----------------------------------------------------------------------------


def holds_only_the_lock(folder: Path) -> bool:
    """Empty, or left with nothing but a lock file (and the tokenized corpus, which is made
    again at will) by a start that was stopped."""
    return all(p.name in (LOCK, CORPUS) for p in folder.iterdir())


class RunLock:
    """An exclusive ``flock`` on ``<run>/.lock``, held while this process lives.

    ``flock`` locks go away with their process (kill -9 included), so a lock is
    never stale. The file records the holder's pid for the message a second
    writer gets. The lock file itself stays: removing it would let two
    processes lock two different files of that name.
    """

    def __init__(self, folder: Path, flag: str) -> None:
        import fcntl

        self.path = folder / LOCK
        self.file: IO[str] = open(self.path, "a+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            self.file.seek(0)
            holder = self.file.read().strip() or "unknown"
            self.file.close()
            raise UsageError(
                f"{flag} {folder}: another shardwise train (pid {holder}) is writing to this "
                "run folder; wait for it to finish or stop it first"
            ) from None
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"{os.getpid()}\n")
        self.file.flush()


def create_and_lock(out: Path, flag: str, new_run: bool) -> tuple[RunLock, bool]:
    """Create the run folder if needed and lock it; return the lock and whether we created it.

    A new run also re-checks, under the lock, that nobody filled the folder
    since the flags were checked (two runs started at once into one ``--out``).
    """
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = RunLock(out, flag)
    except OSError as e:
        raise UsageError(f"{flag} {out}: cannot write there ({e.strerror})") from None
    if new_run and not holds_only_the_lock(out):
        raise UsageError(f"{flag} {out}: the folder already holds files; choose a new one")
    return lock, created


def remove_unfinished_saves(run: Path) -> list[str]:
    """Delete ``checkpoints/*.partial`` folders: saves that never finished.

    A save killed or out of space leaves one; it can never be completed, and
    on a full disk it holds the space the next save needs. Only called under
    the run's lock, so no running save can be hit.
    """
    removed = []
    for partial in sorted((run / "checkpoints").glob("step_*.partial")):
        shutil.rmtree(partial, ignore_errors=True)
        removed.append(partial.name)
    return removed


def remove_if_unused(out: Path, created: bool) -> None:
    """Remove a run folder this launch created when it ended with nothing in it."""
    if created and out.is_dir() and holds_only_the_lock(out):
        with contextlib.suppress(OSError):
            shutil.rmtree(out / CORPUS, ignore_errors=True)
            (out / LOCK).unlink(missing_ok=True)
            out.rmdir()


# ---- the run's first writes, once the resume has loaded -------------------------------------


def commit(config: RunConfig) -> None:
    """Rank 0, once every rank loaded: write config.json and the metrics this run continues.

    Rows past the checkpoint belong to a future this run replaces. Each file
    is written whole to a temporary name and renamed over the old one, so a
    crash or a full disk leaves the old file, not half of a new one.
    """
    out = Path(config.out)
    rows = []
    if config.resumed_metrics:
        rows = [
            r for r in read_jsonl(Path(config.resumed_metrics)) if r["step"] <= config.resume_step
        ]
    _replace(out / "config.json", json.dumps(config.to_json(), indent=2) + "\n")
    _replace(out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    if config.resumed_metrics:
        _set_aside_checkpoints_after(out / "checkpoints", config.resume_step)


def _set_aside_checkpoints_after(folder: Path, step: int) -> None:
    """Checkpoints past the resumed step are that replaced future's too: renamed
    ``step_N.replaced`` (kept, never deleted), so that the next ``--resume``
    of this run, ``sample`` and ``export`` find this run's latest, not theirs."""
    if not folder.is_dir():
        return
    for c in sorted(folder.glob("step_*")):
        if _STEP.fullmatch(c.name) and int(c.name[len("step_") :]) > step:
            target, n = c.with_name(f"{c.name}.replaced"), 1
            while target.exists():
                n += 1
                target = c.with_name(f"{c.name}.replaced{n}")
            os.replace(c, target)
            print(
                f"note: {c.name} is from the run this one replaces (resumed at step {step}); "
                f"kept as {target.name}",
                file=sys.stderr,
            )


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
