"""The frame of a command that reads one checkpoint of a run: ``sample`` and ``export``.

Both take ``--ckpt`` (a run folder, meaning its newest undamaged checkpoint,
or a checkpoint folder), run in this one process by default and, with
``--nproc N`` or under ``torchrun``, in N workers that each load only their
shards. What differs is the work itself, passed in as a function.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .common import OneLineParser, add_launch_arguments, in_worker, launch_from_args
from .launcher import launch
from .run_config import RunConfig
from .run_folder import find_checkpoint
from .signals import end_at_once

# (checkpoint folder, the run's config, distributed) -> exit code
Work = Callable[[Path, RunConfig, bool], int]


def parser(
    prog: str,
    description: str,
    add_own: Callable[[argparse.ArgumentParser], None],
    ckpt_metavar: str = "DIR",
) -> argparse.ArgumentParser:
    """``--ckpt``, then the command's own flags, then the launch flags (one process unless asked)."""
    p = OneLineParser(prog=prog, description=description)
    p.add_argument(
        "--ckpt",
        required=True,
        metavar=ckpt_metavar,
        help="a run folder (its latest checkpoint) or a checkpoint folder",
    )
    add_own(p)
    # One process unless asked: reading a checkpoint needs no more, and loads any world size.
    add_launch_arguments(p, nproc_default="1, this process")
    p.set_defaults(nproc=1)
    return p


def run(
    command: str,
    args: argparse.Namespace,
    worker_args: Iterable[str],
    work: Work,
    check: Callable[[Path, RunConfig], None] | None = None,
) -> int:
    """Find the checkpoint (verified), ``check`` it, then ``work`` here or in the workers.

    ``worker_args``: the names of ``args`` the workers get back.
    """
    if in_worker():
        # No step boundary to stop at: a stop signal ends the worker at once, and so
        # does its launcher's end (under torchrun too).
        end_at_once()
    ckpt, config = find_checkpoint(args.ckpt, "--ckpt")
    if check is not None:
        check(ckpt, config)
    if in_worker():
        return work(ckpt, config, True)
    where = launch_from_args(args)
    if where.world == 1:
        return work(ckpt, config, False)
    passed = {k: getattr(args, k) for k in worker_args}

    def on_signal(_: str, signum: int) -> int:
        print(f"shardwise {command}: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum

    return launch(command, passed, where, on_signal=on_signal)


def say_source(config: RunConfig, extra: dict[str, Any], ckpt: Any) -> None:
    """The one line on stderr that says which model, step and checkpoint the output is of."""
    step = extra.get("step", "?")
    print(f"# {config.model} at step {step}, from {ckpt}", file=sys.stderr)
