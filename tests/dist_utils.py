"""Run a function on W real processes (gloo, CPU) with a hard timeout.

A failing or hanging rank fails the test; it never hangs CI. Functions must be
importable (module level), since workers are spawned.

Many small multi-rank checks share one set of processes (spawning ranks costs seconds):
``run_tasks`` is the one harness that runs named tasks in one launch and gives each
task's outcome (every failing rank's traceback, every rank's value), whatever happened
to the launch. On it: a module keeps checks in a dict and ``named_check_test`` makes
the test that reports each one; ``check_results`` runs them where tests read results by
hand; fixtures call ``run_tasks`` where tasks take arguments or return values.
"""

from __future__ import annotations

import datetime
import importlib
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A free TCP port on this machine, found by the repository's one helper (the local
    launcher's). Imported here, not at the top: the planner takes a second to import,
    and every spawned rank imports this module but never calls this."""
    from shardwise_plan.ranks import free_port as launcher_free_port

    return launcher_free_port()


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


Task = tuple[str, Callable[..., Any], tuple[Any, ...]]  # name, fn(rank, world, *args), args


class Outcome(NamedTuple):
    """One task of a launch: each failing rank's traceback (None where every rank passed)
    and every rank's return value, by rank (empty where the launch died or hung)."""

    error: str | None
    values: list[Any]

    @property
    def value(self) -> Any:
        """Rank 0's value."""
        return self.values[0] if self.values else None


def _tasks_on_rank(
    rank: int,
    world: int,
    tasks: Sequence[Task],
    setup: tuple[Callable[..., Any], tuple[Any, ...]] | None,
    stop_after_failure: bool,
    agree: bool,
    quiet: tuple[type[Warning], ...],
) -> dict[str, tuple[str | None, Any]]:
    """On one rank: each task in order, its traceback or its value by name."""
    out: dict[str, tuple[str | None, Any]] = {}
    if setup is not None:
        try:
            with warnings.catch_warnings():
                for kind in quiet:
                    warnings.simplefilter("ignore", kind)
                setup[0](rank, world, *setup[1])
        except Exception:  # noqa: BLE001 - every task reports it
            why = f"setup failed:\n{traceback.format_exc()}"
            return {name: (why, None) for name, _, _ in tasks}
    failed = None
    for name, fn, args in tasks:
        if failed is not None and stop_after_failure:
            out[name] = (f"not run: {failed!r} failed first", None)
            continue
        try:
            with warnings.catch_warnings():
                for kind in quiet:
                    warnings.simplefilter("ignore", kind)
                out[name] = (None, fn(rank, world, *args))
        except KeyboardInterrupt:
            raise
        except BaseException:  # noqa: BLE001 - DCP raises CheckpointException, a BaseException
            out[name] = (traceback.format_exc(), None)
        ok = out[name][0] is None
        if agree:
            # A rank that failed half-way must not leave the others in a collective of
            # the next task: all agree on the outcome before going on.
            flags: list[Any] = [None] * world
            dist.all_gather_object(flags, ok)
            ok = all(flags)
        if not ok and failed is None:
            failed = name
    return out


def run_tasks(
    tasks: Sequence[Task],
    world: int,
    *,
    timeout: float = 250,
    backend: str = "gloo",
    setup: tuple[Callable[..., Any], tuple[Any, ...]] | None = None,
    stop_after_failure: bool = False,
    agree: bool = False,
    quiet: tuple[type[Warning], ...] = (),
) -> dict[str, Outcome]:
    """Run ``fn(rank, world, *args)`` for each named task, in order, on ``world`` ranks in
    one set of processes; each task's ``Outcome`` by name. Never raises for a task: a
    launch that died or hung gives every task its error.

    ``setup``: ``fn(rank, world, *args)`` first on each rank (its failure fails every
    task). ``stop_after_failure``: after a task fails (on any rank, with ``agree``), the
    rest are not run. ``agree``: the ranks agree on each task's outcome before the next.
    ``quiet``: warning categories ignored inside the tasks (spawned ranks print them).
    Functions and arguments must pickle (module level).
    """
    names = [name for name, _, _ in tasks]
    if len(set(names)) != len(names):
        raise ValueError(f"task names must be unique: {names}")
    args = (list(tasks), setup, stop_after_failure, agree, quiet)
    try:
        per_rank = run_distributed(_tasks_on_rank, world, *args, timeout=timeout, backend=backend)
    except AssertionError as e:  # the processes died or hung: every task says why
        return {name: Outcome(str(e), []) for name in names}
    out = {}
    for name in names:
        errors = [f"rank {r}:\n{res[name][0]}" for r, res in enumerate(per_rank) if res[name][0]]
        out[name] = Outcome("\n".join(errors) or None, [res[name][1] for res in per_rank])
    return out


Checks = Mapping[str, Callable[[int, int], None]]


class _Check:
    """A check found by name in a module-level dict on each rank (a check may then be a
    closure or a lambda, which do not pickle)."""

    def __init__(self, module: str, attr: str, name: str) -> None:
        self.module, self.attr, self.name = module, attr, name

    def __call__(self, rank: int, world: int) -> None:
        getattr(importlib.import_module(self.module), self.attr)[self.name](rank, world)


def check_results(
    module: str,
    checks: Checks,
    world: int,
    names: Iterable[str] | None = None,
    *,
    timeout: float = 250,
) -> dict[str, str | None]:
    """Run the named checks (all of ``checks`` by default) on ``world`` ranks in one set of
    processes: per name, the failing ranks' tracebacks, or None where every rank passed.

    ``checks`` is a module-level dict of the module named ``module`` (pass ``__name__``):
    each rank imports that module and finds the dict there.
    """
    attr = next((k for k, v in vars(sys.modules[module]).items() if v is checks), None)
    if attr is None:
        raise ValueError(f"the checks must be a module-level dict of {module}")
    names = list(checks if names is None else names)
    tasks = [(n, _Check(module, attr, n), ()) for n in names]
    outcomes = run_tasks(tasks, world, timeout=timeout, quiet=(UserWarning, FutureWarning))
    return {n: outcomes[n].error for n in names}


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
    found: dict[int, dict[str, str | None]] = {}

    @pytest.mark.parametrize(
        ("name", "world"), cases, ids=[f"{n}-w{w}" if several else n for n, w in cases]
    )
    def test(name: str, world: int) -> None:
        if world not in found:  # a launch that died fails every check of its world
            found[world] = check_results(module, checks, world, plan[world], timeout=timeout)
        results = found[world]
        where = f"{name} at world {world}" if several else name
        assert results[name] is None, f"{where}:\n{results[name]}"

    return test
