"""Run a function on W real processes (gloo, CPU) with a hard timeout.

A failing or hanging rank fails the test; it never hangs CI. Functions must be
importable (module level), since workers are spawned.

Many small multi-rank checks share one set of processes (spawning ranks costs seconds):
a module keeps them in a dict of named checks and ``named_check_test`` makes the test
that reports each one; ``check_results`` runs them where tests read results by hand.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import traceback
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import pytest
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


Checks = Mapping[str, Callable[[int, int], None]]


def _run_checks(rank: int, world: int, module: str, attr: str, names: list[str]) -> dict:
    """On one rank: ``module.attr[name](rank, world)`` for each name, None where it passed,
    else its traceback (looked up by name, so a check may be a closure)."""
    import importlib
    import warnings

    checks = getattr(importlib.import_module(module), attr)
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


def check_results(
    module: str,
    checks: Checks,
    world: int,
    names: Iterable[str] | None = None,
    *,
    timeout: float = 250,
) -> dict[str, str | None]:
    """Run the named checks (all of ``checks`` by default) on ``world`` ranks in one set of
    processes: per name, the first failing rank's traceback, or None where every rank passed.

    ``checks`` is a module-level dict of the module named ``module`` (pass ``__name__``):
    each rank imports that module and finds the dict there.
    """
    attr = next((k for k, v in vars(sys.modules[module]).items() if v is checks), None)
    if attr is None:
        raise ValueError(f"the checks must be a module-level dict of {module}")
    names = list(checks if names is None else names)
    per_rank = run_distributed(_run_checks, world, module, attr, names, timeout=timeout)
    return {n: next((r[n] for r in per_rank if r[n]), None) for n in names}


def named_check_test(
    module: str,
    checks: Checks,
    worlds: int | Mapping[int, Iterable[str]] = 2,
    *,
    timeout: float = 250,
) -> Callable[[str, int], None]:
    """A test parametrized by check: assign it to a ``test_...`` name in ``module``.

    ``worlds`` is a world size (every check at it) or, per world size, the names to run
    there. The first test of a world runs all of that world's checks in one set of
    processes (``check_results``); each test then reports its own check. Test ids are
    the check names, suffixed ``-w<world>`` where there are several world sizes.
    """
    plan = (
        {worlds: list(checks)}
        if isinstance(worlds, int)
        else {w: list(n) for w, n in worlds.items()}
    )
    cases = [(name, world) for world, names in plan.items() for name in names]
    several = len(plan) > 1
    found: dict[int, dict[str, str | None] | BaseException] = {}

    @pytest.mark.parametrize(
        ("name", "world"), cases, ids=[f"{n}-w{w}" if several else n for n, w in cases]
    )
    def test(name: str, world: int) -> None:
        if world not in found:
            try:
                found[world] = check_results(module, checks, world, plan[world], timeout=timeout)
            except BaseException as e:  # every test of this world reports the one failed run
                found[world] = e
        results = found[world]
        if isinstance(results, BaseException):
            raise results
        where = f"{name} at world {world}" if several else name
        assert results[name] is None, f"{where}:\n{results[name]}"

    return test
