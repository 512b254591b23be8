"""Run a function on W real processes (gloo, CPU) with a hard timeout.

A failing or hanging rank fails the test; it never hangs CI. Functions must be
importable (module level), since workers are spawned.
"""

from __future__ import annotations

import datetime
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    fn: Callable[..., Any], rank: int, world: int, port: int, q: Any, args: tuple, backend: str
) -> None:
    try:
        torch.set_num_threads(1)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        if "nccl" in backend:
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=60),
        )
        out = fn(rank, world, *args)
        q.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120, backend: str = "gloo"
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks; return results by rank.

    ``backend="cpu:gloo,cuda:nccl"`` runs one rank per GPU (the CUDA suite).
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, port, q, args, backend))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    import queue as _queue
    import time

    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < world:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            rank, status, payload = q.get(timeout=min(left, 1.0))
        except _queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs) and q.empty():
                # a rank died without reporting (segfault, kill)
                time.sleep(0.5)
                if q.empty():
                    break
            continue
        if status == "ok":
            results[rank] = payload
        else:
            errors.append(f"rank {rank}:\n{payload}")
    for p in procs:
        p.join(timeout=5 if not errors else 1)
        if p.is_alive():
            p.kill()
            p.join()
    if errors:
        raise AssertionError("distributed test failed\n" + "\n".join(errors))
    if len(results) < world:
        codes = [p.exitcode for p in procs]
        raise AssertionError(
            f"distributed test timed out or crashed after {timeout}s (exit codes {codes})"
        )
    return [results[r] for r in range(world)]


def run_named_checks(
    checks: dict[str, Callable[[int, int], None]], rank: int, world: int, names: list[str]
) -> dict[str, str | None]:
    """Run ``checks[name]`` for each name on this rank: None where it passed, else its
    traceback, so one set of processes serves many tests (each reads its own entry)."""
    import warnings

    out: dict[str, str | None] = {}
    for name in names:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                warnings.simplefilter("ignore", FutureWarning)
                checks[name](rank, world)
            out[name] = None
        except Exception:  # noqa: BLE001 - reported by the check's own test
            out[name] = traceback.format_exc()
    return out


def first_failures(per_rank: list[dict[str, str | None]], names: Any) -> dict[str, str | None]:
    """``run_named_checks``' results of every rank merged: per name, the first
    rank's traceback where one failed, else None."""
    return {n: next((r[n] for r in per_rank if r[n]), None) for n in names}
