"""One line per failure: what a worker says when it fails, and what the launcher says.

A failing run involves several processes, and each would print its own
traceback: the rank that hit the problem, the ranks that then lost their
connection to it, and the launcher. Instead exactly one of them speaks:

- an error every rank sees alike (a full disk during a collective save, a
  loss that is no longer finite) is told by rank 0;
- an error of one rank only is told by that rank;
- a rank that merely lost a peer stays quiet (``EXIT_PEER_LOST``): the
  peer's story is the one to tell;
- the launcher speaks only when no worker could: a worker killed by a
  signal (the OOM killer), one that stopped responding, or workers that
  all lost each other; and it says what to do next.

``CheckpointException`` (DCP) derives from ``BaseException``, not
``Exception``: handlers here catch ``BaseException`` and let only
``KeyboardInterrupt`` and ``SystemExit`` through.
"""

from __future__ import annotations

import errno
import shutil
import signal
import sys
from pathlib import Path

from .signals import EXIT_STOP_OVERDUE, STOP_SIGNALS

EXIT_REPORTED = 3  # a worker printed the one line that explains the failure
EXIT_PEER_LOST = 4  # a worker lost a peer and said nothing
EXIT_PEER_TIMEOUT = 5  # a worker waited --timeout for a peer that did not answer, and said nothing
EXIT_NO_RETRY = 6  # a worker said why the run cannot go on; a restart would end alike
# EXIT_STOP_OVERDUE = 7 (signals.py): asked to stop, a worker found no step
# boundary within --stop-grace and ended without saving

_PEER_LOST = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "socket timeout",
    "connection refused",
)
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class RunFailure(Exception):
    """A failure the run detected itself, on every rank alike; its message is the line to print."""


def no_space(e: BaseException) -> bool:
    """Whether a full disk (or quota) caused ``e``, however deep DCP or torch wrapped it.

    DCP collects each rank's exception into one ``CheckpointException`` whose
    text holds every rank's traceback; torch.save's zip writer reports a
    short write only as "unexpected pos". So the chain and the text are both
    searched.
    """
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _NO_SPACE:
            return True
        seen = seen.__cause__ or seen.__context__
    text = str(e)
    return "No space left on device" in text or "Disk quota exceeded" in text


def passes_through(e: BaseException) -> bool:
    """Exceptions a failure handler must not swallow."""
    return isinstance(e, (KeyboardInterrupt, SystemExit))


def peer_lost(e: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(e, getattr(dist, "DistNetworkError", ())):
        return True
    return any(s in str(e).lower() for s in _PEER_LOST)


# Gloo's words for a collective that waited the process group's timeout: the
# op that timed out says the first; any other op in flight on the same pair
# (an async gather, a prefetch) is failed with the second, and which of the
# two a worker's wait meets first is a race.
_PEER_TIMEOUT = ("timed out waiting", "application timeout caused pair closure")


def peer_timeout(e: BaseException) -> bool:
    """A collective that waited the process group's timeout for a peer."""
    text = str(e).lower()
    return any(s in text for s in _PEER_TIMEOUT)


def report_worker_failure(command: str, e: BaseException, rank: int) -> int:
    """Print the one line for ``e`` if this rank is the one to tell it; return the exit code."""
    if isinstance(e, RunFailure):
        message, everyone = str(e), True
    elif peer_timeout(e):
        return EXIT_PEER_TIMEOUT
    elif peer_lost(e):
        return EXIT_PEER_LOST
    else:
        # Raised on every rank: DCP's collective errors, and rank 0's file
        # work that it shares the outcome of (checkpoint._on_rank0).
        everyone = type(e).__name__ == "CheckpointException" or "failed on rank 0" in str(e)
        message = first_line(e)
    if rank == 0 or not everyone:
        where = "" if everyone else f"rank {rank}: "
        print(f"shardwise {command}: error: {where}{message}", file=sys.stderr, flush=True)
    return EXIT_NO_RETRY if isinstance(e, RunFailure) else EXIT_REPORTED


def first_line(e: BaseException) -> str:
    """A readable one-line summary of any exception (the first line of its message)."""
    if no_space(e):
        return "no space left on device"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def save_failure(e: BaseException, out: Path, need: int) -> str:
    """Why a save failed, in words; a full disk said as such.

    torch.save's zip writer reports a short write on a full disk only as
    "unexpected pos", without the errno: so the free space left (with the
    failed save's files still there) is compared with a checkpoint's size.
    """
    free = shutil.disk_usage(out).free
    if no_space(e) or free < need:
        return (
            f"no space left on device ({free / 2**20:.1f} MiB free in {out}, a checkpoint "
            f"takes about {need / 2**20:.1f} MiB: free that much there, then resume)"
        )
    return first_line(e)


def kept(last_good: Path | None) -> str:
    if last_good is None:
        return "no checkpoint of this run was saved"
    run = last_good.parent.parent
    return (
        f"the last good checkpoint, {last_good.relative_to(run)}, is kept "
        f"(resume with: shardwise train --resume {run})"
    )


def diverged(what: str, value: float, step: int, last_good: Path | None) -> RunFailure:
    return RunFailure(
        f"the {what} is {value} at step {step}: training diverged (lower --lr, keep "
        f"--grad-clip on); stopped without saving; {kept(last_good)}"
    )


def what_failed(failures: dict[int, int], unresponsive: list[int]) -> str:
    """Which worker ended the run, and how, from ``failures`` (rank -> exit code) and the
    ranks the launcher found still running after the others had ended (and killed)."""
    # Once one worker fails, the others lose it, or are stopped by the
    # launcher: a signal other than ours is the cause.
    # A worker ended at once by a second stop signal sent to it exits 128 + the
    # signal (signals.py): told as one killed by it.
    codes = {r: -(c - 128) if c - 128 in STOP_SIGNALS else c for r, c in failures.items()}
    killed = sorted(
        (c == -signal.SIGTERM, r, c) for r, c in codes.items() if c < 0 and r not in unresponsive
    )
    if killed:
        _, rank, code = killed[0]
        return f"worker rank {rank} was killed by {_signal_name(-code)}"
    if unresponsive:
        return (
            f"worker rank {min(unresponsive)} stopped responding (the others waited --timeout "
            "for it)"
        )
    if failures and all(c in (EXIT_PEER_LOST, EXIT_PEER_TIMEOUT) for c in failures.values()):
        return "the workers lost contact with each other"
    overdue = sorted(r for r, c in failures.items() if c == EXIT_STOP_OVERDUE)
    if overdue:
        return (
            f"worker rank {overdue[0]} was sent a stop signal (to it alone) and did not reach a "
            "step boundary within --stop-grace: it ended without saving"
        )
    rank, code = min((r, c) for r, c in failures.items() if c != 0)
    return f"worker rank {rank} failed with exit code {code}"


def launcher_message(
    command: str, failures: dict[int, int], unresponsive: list[int], then: str | None = None
) -> str | None:
    """The launcher's line for workers that ended with ``failures`` (rank -> exit code).

    ``None`` when a worker already said what happened. ``then`` is what the
    user has and can do next (a train run: the checkpoint to resume from).
    """
    if {EXIT_REPORTED, EXIT_NO_RETRY} & set(failures.values()):
        return None
    what = what_failed(failures, unresponsive)
    then = then or f"run shardwise {command} again"
    if what.endswith("SIGKILL"):
        # The kernel's OOM killer is the usual sender, and says so in its log.
        return (
            f"shardwise {command}: {what} (out of memory? `dmesg` shows the kernel's "
            f"out-of-memory kills; use less memory per process or fewer processes); "
            f"the other workers stopped with it; {then}"
        )
    if "was killed by" in what:
        return f"shardwise {command}: {what}; the other workers stopped with it; {then}"
    if unresponsive:
        return (
            f"shardwise {command}: {what}: it was killed and the job stopped; {then}; if this "
            "repeats, check that machine (a stuck GPU, a dead link), or raise --timeout "
            "if a step or a save really takes that long"
        )
    if "--stop-grace" in what:
        return f"shardwise {command}: {what}, and the job with it; {then}"
    if what.startswith("the workers lost"):
        return f"shardwise {command}: {what} (network?); {then}"
    return f"shardwise {command}: {what}; its error is above"


def overdue_message(command: str, cause: str, grace_s: float, then: str) -> str:
    """The one line of a stop that ran out of time: ``cause`` is "stopped by SIGTERM"
    or "the launcher is gone"; ``then`` what the user has (``kept``)."""
    return (
        f"shardwise {command}: {cause}, but the workers did not reach a step boundary and "
        f"save within --stop-grace {grace_s:g} s (a step, a save or a peer took longer): "
        f"they ended anyway; {then}"
    )


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
