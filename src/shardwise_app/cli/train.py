"""``shardwise train``: train a small GPT, or fine-tune a transformers model, fully sharded.

Started by a person, this checks the flags, prepares the run folder and starts
the workers (``launcher.py``, which restarts them with ``--max-restarts``);
started as a worker (by us or by ``torchrun`` directly) it trains
(``train_loop.py``). The run's settings are a ``RunConfig``
(``run_config.py``); the flags and their checks are ``train_config.py``'s;
what is particular to ``--hf PATH`` (a model from disk, LoRA, the export)
lives in ``finetune.py``.

Every run folder holds ``config.json``, ``metrics.jsonl`` (one row per step),
``loss.png``, ``throughput.png``, ``summary.json`` and ``checkpoints/step_N``;
a finished ``--hf`` run also ``export/``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from .common import LAUNCH_ID_ENV, in_worker, launch_from_args
from .corpus import prepare as prepare_corpus
from .failures import (
    kept,
    overdue_message,
    passes_through,
    peer_lost,
    peer_timeout,
    report_worker_failure,
)
from .launcher import check_fault_arguments, launch
from .process_group import init_worker
from .report import read_json, read_jsonl, stopped_before_the_first_step
from .run_config import CONFIG_ENV, RunConfig
from .run_folder import create_and_lock, remove_if_unused, remove_unfinished_saves
from .signals import StopRequest, stop_when_orphaned
from .train_config import build_parser, for_restart, is_new_run, newest_saved, resolve


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if in_worker():
        return train(args)
    where = launch_from_args(args)
    check_fault_arguments(args)
    config = resolve(args, world=where.world, local=where.nproc)
    out = Path(config.out)
    if where.node_rank:
        # Another node's launcher: node 0's holds the run folder and its lock,
        # and its config is the run's (the workers take rank 0's). This one
        # only checked the flags, and writes nothing.
        _hand_to_workers(config)
        return launch(
            "train",
            {"out": out, "timeout": args.timeout, "stop_grace": args.stop_grace},
            where,
            on_signal=lambda _, signum: 128 + signum,
            stop_grace_s=args.stop_grace,
        )
    _lock, created = create_and_lock(out, "--out", new_run=is_new_run(config))
    try:
        for name in remove_unfinished_saves(out):
            print(f"removed checkpoints/{name}: a save that never finished", file=sys.stderr)
        config.corpus = prepare_corpus(config, out)  # once, for every rank to map
        # Workers get the config from us and write it to the run folder
        # themselves, once the checkpoint has loaded: nothing changes before.
        _hand_to_workers(config)

        def on_signal(launch_id: str, signum: int) -> int:
            if read_json(out / "summary.json").get("launch_id") == launch_id:
                return 0  # stopped at a step boundary and saved
            if read_json(out / "config.json").get("launch_id") != launch_id:
                # The workers never got to write: one line for all of them.
                # (Otherwise the stop's save failed, and a worker said why.)
                print(stopped_before_the_first_step(signum, config), file=sys.stderr)
            return 128 + signum

        def on_restart(what: str) -> str:
            remove_unfinished_saves(out)  # the failed launch's save, if it was saving
            rows = read_jsonl(out / "metrics.jsonl")
            started = read_json(out / "config.json").get("launch_id") == os.environ[LAUNCH_ID_ENV]
            at = f"at step {rows[-1]['step'] + 1 if rows else 1}" if started else "while starting"
            restart, ckpt = for_restart(config, out)
            _hand_to_workers(restart)
            start = ckpt.relative_to(out) if ckpt else "the start (nothing was saved yet)"
            return f"shardwise train: {what} {at}; restarting every worker from {start}"

        return launch(
            "train",
            {"out": out, "timeout": args.timeout, "stop_grace": args.stop_grace},
            where,
            on_signal=on_signal,
            then=lambda: kept(newest_saved(out)),
            max_restarts=args.max_restarts,
            on_restart=on_restart,
            stop_grace_s=args.stop_grace,
        )
    finally:
        remove_if_unused(out, created)


def _hand_to_workers(config: RunConfig) -> None:
    """The workers this launcher starts read the run's config from their environment."""
    os.environ[CONFIG_ENV] = json.dumps(config.to_json())


def train(args: argparse.Namespace) -> int:
    """A worker: join the process group, then train (train_loop.py); one line if it fails."""
    from .train_loop import run_worker

    check_fault_arguments(args)
    # Signals only raise a flag from here on, and start the --stop-grace
    # deadline (signals.py); until the process group is joined, the entry
    # module still ends the worker at once (cli/worker.py).
    stop = StopRequest(args.stop_grace, _say_overdue(args))
    stop_when_orphaned()
    w = init_worker(timeout_s=args.timeout)
    try:
        return run_worker(args, w, stop)
    except BaseException as e:  # one line, said by the one rank that should
        if passes_through(e):
            raise
        if stop.signum is not None and (peer_lost(e) or peer_timeout(e)):
            stop.overdue()  # a peer ended at its deadline: the same story, told once
        return report_worker_failure("train", e, w.rank)


def _say_overdue(args: argparse.Namespace) -> Any:
    """The line of a stop that ran out of time, for a worker to say where no launcher of
    ours will (under torchrun, or once ours is gone): rank 0's alone."""

    def say(signum: int, orphaned: bool) -> str | None:
        if os.environ.get("RANK") != "0" or (CONFIG_ENV in os.environ and not orphaned):
            return None
        run = Path(args.out or args.resume or "")
        if (run / ".metadata").is_file():  # --resume named a checkpoint folder
            run = run.parent.parent
        then = (
            kept(newest_saved(run))
            if run.name
            else "the newest complete checkpoint in the run folder is kept (--resume picks it)"
        )
        name = signal.Signals(signum).name
        cause = "the launcher is gone" if orphaned else f"stopped by {name}"
        return overdue_message("train", cause, args.stop_grace, then)

    return say
