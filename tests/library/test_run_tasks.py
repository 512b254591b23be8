"""The suite's multi-rank harness (tests/dist_utils.py's ``run_tasks``), on which every
launch of many checks runs: each task's outcome names the ranks that failed and keeps
every rank's value; a failure stops the rest only when asked, on every rank; a launch
that dies gives every task its error instead of raising."""

from __future__ import annotations

import os

import torch.distributed as dist

from dist_utils import run_tasks


def _rank_times(rank: int, world: int, k: int) -> int:
    return rank * k


def _fail_on_rank_1(rank: int, world: int) -> None:
    assert rank != 1, "rank 1 says no"


def _sum_of_ranks(rank: int, world: int) -> int:
    out = [0] * world
    dist.all_gather_object(out, rank)  # the ranks are still in step after a failure
    return sum(out)


def _die(rank: int, world: int) -> None:
    os._exit(3)


TASKS = [
    ("times", _rank_times, (10,)),
    ("fails", _fail_on_rank_1, ()),
    ("after", _sum_of_ranks, ()),
]


def test_outcomes_by_task_and_a_failure_stops_the_rest_only_when_asked() -> None:
    go_on = run_tasks(TASKS, 2, timeout=120)
    assert go_on["times"].error is None and go_on["times"].values == [0, 10]
    assert go_on["times"].value == 0
    error = go_on["fails"].error
    assert error is not None and "rank 1:" in error and "rank 1 says no" in error
    assert "rank 0:" not in error
    assert go_on["after"].error is None and go_on["after"].values == [1, 1]

    stop = run_tasks(TASKS, 2, timeout=120, stop_after_failure=True, agree=True)
    assert stop["times"].values == [0, 10]
    after = stop["after"].error
    assert after is not None and after.count("not run: 'fails' failed first") == 2


def test_a_dead_launch_fails_every_task_and_raises_nothing() -> None:
    tasks = [("dies", _die, ()), ("never", _rank_times, (1,))]
    out = run_tasks(tasks, 2, timeout=60)
    for name in ("dies", "never"):
        assert out[name].error is not None and "crashed" in out[name].error, out[name]
        assert out[name].values == [] and out[name].value is None
