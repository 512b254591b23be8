"""A step or a save that never ends, for tests/app/test_cli_stop.py: test-only, never shipped.

A test that wants a stall puts this folder on ``PYTHONPATH``; Python's ``site``
imports ``sitecustomize`` at every start, so each process of the job (the
launcher, torchrun's agent, every rank) runs this first. Only the rank named
in ``SHARDWISE_TEST_STALL`` does anything: once ``shardwise_app.cli.train_loop``
is imported (not before: the worker's entry must still take its signals over
before torch loads), its ``train_step`` or its save is wrapped.

``SHARDWISE_TEST_STALL``: "step N RANK" or "save N RANK": rank RANK's step N (or
its save of step N, once its shards are written, before the checkpoint is
complete) never ends. ``SHARDWISE_TEST_STALL_MARK``: a file made when it begins.

The stall is what a long C++ call does: the main thread neither returns nor
runs Python's signal handlers (its stop signals blocked), so only what does
not need the main thread (cli/signals.py's threads) can stop the worker.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

STALL_ENV = "SHARDWISE_TEST_STALL"
STALL_MARK_ENV = "SHARDWISE_TEST_STALL_MARK"
TARGET = "shardwise_app.cli.train_loop"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _stall() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    Path(os.environ.get(STALL_MARK_ENV, os.devnull)).touch()
    time.sleep(3600)


def _patch(train_loop: Any, where: str, at: int) -> None:
    if where == "step":
        step = train_loop.train_step

        def train_step(run: Any, n: int) -> Any:
            if n == at:
                _stall()
            return step(run, n)

        train_loop.train_step = train_step
        return
    import torch.distributed.checkpoint as dcp

    saving: list[int] = []
    save, dcp_save = train_loop.save, dcp.save

    def save_step(run: Any, n: int) -> Any:
        saving[:] = [n]
        return save(run, n)

    def write(*a: Any, **k: Any) -> Any:
        result = dcp_save(*a, **k)
        if saving == [at]:
            _stall()
        return result

    train_loop.save = save_step
    dcp.save = write


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of ``TARGET`` to patch it once run."""

    def __init__(self, where: str, at: int) -> None:
        self.where, self.at = where, at

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # once, and not asked again for the real spec
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _patch(module, self.where, self.at)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _install() -> None:
    spec = os.environ.get(STALL_ENV)
    if not spec:
        return
    where, at, rank = spec.split()
    if os.environ.get("RANK") != rank or where not in ("step", "save"):
        return
    sys.meta_path.insert(0, _AfterImport(where, int(at)))


_install()
