"""What every subcommand shares, and imports from nowhere else in the cli.

The bad-input error (one line on stderr, exit code 2) and the check of a
folder a command will write in, the Ctrl-C that an import swallowed, and
where workers run (``Launch``, and the flags that say it). The entry (``main.py``), the launcher that starts and watches the
workers (``launcher.py``), the process group a worker joins
(``process_group.py``) and each command import these from here, so that none
of them needs another's module for a constant or a type.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EXIT_USAGE = 2
CPU_OVERSUBSCRIPTION = 4  # gloo ranks per CPU core we still accept
# Set by the launcher for one start of the workers: a run folder's files
# written by that launch say so, which tells a stop that saved from one
# that never started.
LAUNCH_ID_ENV = "SHARDWISE_LAUNCH_ID"


class UsageError(Exception):
    """Bad input: reported as one line on stderr, exit code 2, before anything is written."""


class OneLineParser(argparse.ArgumentParser):
    """Every subcommand's parser: a bad flag is one line and exit code 2 (a ``UsageError``,
    which ``main`` prints as ``shardwise CMD: error: ...``), as every other bad input,
    not argparse's whole usage block. An invalid choice names the choices (argparse's
    message does); an unknown flag is named and points at ``--help``."""

    def error(self, message: str) -> Any:
        if message.startswith("unrecognized arguments:"):
            message += f" ('{self.prog} --help' lists the flags)"
        raise UsageError(message)


def check_writable(folder: Path, said: str) -> None:
    """A folder a command will make or write in, checked before any work: the nearest
    one that exists is a folder, and this process can write in it (the missing ones
    below it are made, as ``mkdir -p`` would).

    Tried, not read off the permission bits: root passes those where the kernel
    still refuses (``/sys``), and a read-only mount passes them too.
    """
    folder = folder.resolve()
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise UsageError(f"{said}: {existing} is a file, not a folder")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".shardwise-", dir=existing))
    except OSError as e:
        raise UsageError(f"{said}: cannot write in {existing} ({e.strerror})") from None


def cannot_create(path: Path) -> str | None:
    """Why ``path`` (a file a command writes at its end) cannot be written, tried now:
    opened for appending, and removed again if it was new, so that nothing is left
    behind before the work starts. None: it can."""
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        return e.strerror or str(e)
    if not existed:
        path.unlink()
    return None


# ---- Ctrl-C while importing -----------------------------------------------------------------

_interrupted: list[int] = []


def interrupt(signum: int, frame: Any) -> None:
    """The console's SIGINT handler: remember it (``raise_if_interrupted``), then raise."""
    _interrupted.append(signum)
    raise KeyboardInterrupt


def raise_if_interrupted() -> None:
    """Raise the ``KeyboardInterrupt`` of a Ctrl-C that some import swallowed.

    Part of torch's import catches it (a Ctrl-C about half a second into
    ``import torch`` is lost, the import goes on): so the launcher asks
    again before it starts any worker.
    """
    if _interrupted:
        raise KeyboardInterrupt


# ---- where workers run ----------------------------------------------------------------------


def in_worker() -> bool:
    """True when a launcher (ours, torchrun, or another) started this process as one rank."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_nproc() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def check_nproc(nproc: int) -> None:
    """NCCL needs a GPU per rank; gloo ranks may share cores, within reason."""
    import torch

    if nproc < 1:
        raise UsageError(f"--nproc must be at least 1, got {nproc}")
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        if nproc > gpus:
            raise UsageError(
                f"--nproc {nproc} is more than the {gpus} GPU(s) on this machine "
                "(NCCL needs one GPU per process)"
            )
    elif nproc > CPU_OVERSUBSCRIPTION * usable_cpus():
        raise UsageError(
            f"--nproc {nproc} is more than {CPU_OVERSUBSCRIPTION} processes per CPU "
            f"core ({usable_cpus()} cores here); use fewer processes"
        )


@dataclass(frozen=True)
class Launch:
    """Where workers run: processes per node and, for several nodes, how they meet."""

    nproc: int
    nnodes: int = 1
    node_rank: int | None = None
    rdzv_endpoint: str | None = None

    def check(self) -> None:
        check_nproc(self.nproc)
        if self.nnodes < 1:
            raise UsageError(f"--nnodes must be at least 1, got {self.nnodes}")
        if self.nnodes > 1 and (self.node_rank is None or self.rdzv_endpoint is None):
            raise UsageError("--nnodes > 1 needs --node-rank and --rdzv-endpoint HOST:PORT")
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise UsageError(f"--node-rank {self.node_rank} is not in [0, {self.nnodes})")

    @property
    def world(self) -> int:
        return self.nproc * self.nnodes


def add_launch_arguments(
    p: Any, nproc_default: str = "the number of GPUs, else 2 CPU processes"
) -> None:
    g = p.add_argument_group("launching (ignored when started by torchrun)")
    g.add_argument(
        "--nproc", type=int, default=None, help=f"processes on this node (default: {nproc_default})"
    )
    g.add_argument("--nnodes", type=int, default=1, help="number of nodes (default: 1)")
    g.add_argument("--node-rank", type=int, default=None, help="this node's rank (multi-node)")
    g.add_argument(
        "--rdzv-endpoint",
        default=None,
        help="HOST:PORT where the nodes meet: node 0's address (multi-node)",
    )


def launch_from_args(args: Any) -> Launch:
    nproc = default_nproc() if args.nproc is None else args.nproc
    launch = Launch(nproc, args.nnodes, args.node_rank, args.rdzv_endpoint)
    launch.check()
    return launch
