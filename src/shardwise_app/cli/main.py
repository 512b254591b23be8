"""``shardwise``: the console entry, and what its subcommands share.

Each subcommand module has ``main(argv) -> int``. Shared here: the bad-input
error (one line on stderr, exit code 2), where workers run (``Launch``; the
launcher that starts and watches them is ``launcher.py``), and joining the
process group inside a worker.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..extras import CLI, CLI_INSTALL, first_missing

COMMANDS = {
    "train": (
        "shardwise_app.cli.train",
        "train a small GPT, or fine-tune a transformers model (--hf), fully sharded",
    ),
    "sample": ("shardwise_app.cli.sample", "print a continuation from a trained checkpoint"),
    "export": (
        "shardwise_app.cli.export",
        "write a fine-tuned run (--hf) as a folder transformers loads",
    ),
    "bench": ("shardwise_app.bench.command", "measure throughput and memory"),
    "plan": (
        "shardwise_app.cli.plan",
        "predict per-rank memory and step time at any world size (--measure: and check it)",
    ),
}
EXIT_USAGE = 2
CPU_OVERSUBSCRIPTION = 4  # gloo ranks per CPU core we still accept
LAUNCH_ID_ENV = "SHARDWISE_LAUNCH_ID"


class UsageError(Exception):
    """Bad input: reported as one line on stderr, exit code 2, before anything is written."""


def main(argv: list[str] | None = None) -> int:
    # Ctrl-C while Python imports torch (the first seconds) raises
    # KeyboardInterrupt inside that import: one line, not its traceback.
    # Nothing is written before the run folder's lock is taken, and a folder
    # holding only the lock is reused as new.
    if not in_worker() and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _interrupt)
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("shardwise: interrupted", file=sys.stderr)
        return 130


_interrupted: list[int] = []


def _interrupt(signum: int, frame: Any) -> None:
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


def _main(argv: list[str] | None) -> int:
    if argv is None:  # the console script: a process of its own
        from .worker import keep_going_without_stdout

        keep_going_without_stdout()
    missing = first_missing(CLI)
    if missing is not None:
        print(
            f"shardwise: the command line needs {' and '.join(CLI)} ({missing} is not "
            f"installed): {CLI_INSTALL}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else EXIT_USAGE
    if argv[0] == "--version":
        from shardwise import __version__

        print(f"shardwise {__version__}")
        return 0
    command = argv[0]
    if command not in COMMANDS:
        print(
            f"shardwise: error: unknown command {command!r}; choose from {', '.join(COMMANDS)}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        module = importlib.import_module(COMMANDS[command][0])
        return int(module.main(argv[1:]) or 0)
    except UsageError as e:
        print(f"shardwise {command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        # Ctrl-C before workers start, or in a one-process command.
        print(f"shardwise {command}: interrupted", file=sys.stderr)
        return 130


def _usage() -> str:
    lines = [f"usage: shardwise {{{','.join(COMMANDS)}}} ...", "", "commands:"]
    lines += [f"  {name:<8}{help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'shardwise COMMAND --help' for a command's flags."]
    return "\n".join(lines)


# ---- launching ------------------------------------------------------------------------------


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


def launch(
    command: str, worker_args: dict[str, Any], where: Launch, on_signal: Callable[[str, int], int]
) -> int:
    """Start this node's workers and watch them to the end (``launcher.launch``)."""
    from .launcher import launch as start_and_watch

    return start_and_watch(command, worker_args, where, on_signal)


# ---- inside a worker ------------------------------------------------------------------------


@dataclass(frozen=True)
class Worker:
    rank: int
    world: int
    local_rank: int
    device: Any  # torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_worker(timeout_s: float | None = None) -> Worker:
    """Join the process group: NCCL with one GPU per rank if there are GPUs, else gloo.

    ``timeout_s``: how long a collective waits for a peer before it fails
    (default: the backend's).
    """
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from .signals import joined

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    torch.set_num_threads(max(1, usable_cpus() // local_world))
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    joined()
    return Worker(rank, world, local_rank, device)


def from_rank0(fn: Callable[[], Any], command: str) -> Any:
    """Run ``fn`` on rank 0 only and give every rank its result. A ``UsageError``
    ends every rank with exit code 2, rank 0 having said it in one line, as
    ``main`` says it (a ``SystemExit``: the workers' failure handlers let it pass)."""
    import torch.distributed as dist

    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except UsageError as e:
            box[0] = ("usage", str(e))
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "usage":
        if dist.get_rank() == 0:
            print(f"shardwise {command}: error: {value}", file=sys.stderr, flush=True)
        dist.destroy_process_group()
        raise SystemExit(EXIT_USAGE)
    return value


def run_as_module() -> None:
    """``python -m shardwise``: the console script, or one rank under torchrun
    (``torchrun ... -m shardwise train``), which ends as the workers our own
    launcher starts do (worker.py's ``end``)."""
    from .worker import keep_going_without_stdout, run_to_end

    keep_going_without_stdout()
    if not in_worker():
        sys.exit(main())
    run_to_end(main)


if __name__ == "__main__":
    sys.exit(main())
