"""Debugging tools: lifecycle checks, the timeline, prefetch from the recorded order."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import shardwise
from dist_utils import run_distributed
from models import Deep, TwoLinears
from shardwise import LifecycleError, Phase, fully_shard
from test_parity_and_prefetch import assert_between_steps

pytestmark = pytest.mark.timeout(240)


def broken_lifecycle_worker(rank: int, world: int, check: bool) -> str:
    """Reproduce the recompute-prefetch failure sequence by hand and see who notices."""
    os.environ["SHARDWISE_CHECK"] = "1" if check else "0"
    torch.manual_seed(0)
    model = TwoLinears(reentrant=True)
    fully_shard(model.l1)
    fully_shard(model.l2)
    fully_shard(model)
    os.environ.pop("SHARDWISE_CHECK")

    def regather_l2(module, args):
        # l1 is recomputed after l2's backward is over: gather l2 again, as
        # Megatron-FSDP v2's forward-order prefetch did.
        if model.fsdp_context.phase is Phase.BACKWARD:
            model.l2.unshard()

    x = torch.randn(4, 4, requires_grad=True)
    model(x).sum().backward()  # a healthy step first
    model.zero_grad()
    model.l1.register_forward_pre_hook(regather_l2)
    try:
        model(x).sum().backward()
    except LifecycleError as e:
        return str(e)
    assert_between_steps(model)  # without checks the final callback still cleans up
    return ""


@pytest.mark.parametrize("check", [True, False], ids=["SHARDWISE_CHECK=1", "off"])
def test_broken_lifecycle_raises_only_with_checks(check: bool) -> None:
    msg = run_distributed(broken_lifecycle_worker, 2, check)[0]
    if check:
        assert "'l2'" in msg and "after its post-backward" in msg, msg
        assert "parameters: ['weight', 'bias']" in msg
        assert "last lifecycle events" in msg and "l1: recompute forward" in msg
    else:
        assert msg == ""


class ThreeBlocks(Deep):
    """Three blocks of width 6 (its own class: the trace labels the root by its name)."""

    def __init__(self) -> None:
        super().__init__(3, d=6)


def trace_worker(rank: int, world: int, out: str) -> dict:
    torch.manual_seed(0)
    model = ThreeBlocks()
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    x = torch.randn(4, 6)
    model(x).sum().backward()  # step 0 records the orders
    with shardwise.trace() as t:
        model(x).sum().backward()
    if rank == 0:
        t.save_chrome_trace(str(Path(out) / "timeline.json"))
        t.plot(str(Path(out) / "timeline.png"))
    per: Counter[tuple[str, str]] = Counter((ev.name, ev.module) for ev in t.local_events)
    return {
        "per": dict((f"{k[0]}|{k[1]}", v) for k, v in per.items()),
        "summary": t.summary(),
        "ranks": sorted({ev.rank for ev in t.events}),
    }


def test_trace_of_one_step_holds_the_expected_events(tmp_path: Path) -> None:
    res = run_distributed(trace_worker, 2, str(tmp_path))[0]
    per = res["per"]
    for i in range(3):
        b = f"blocks.{i}"
        assert per[f"all_gather|{b}"] == 2, per  # forward, backward
        assert per[f"reduce_scatter|{b}"] == 1, per
        assert per[f"reshard|{b}"] == 2, per  # post-forward, post-backward
        assert per.get(f"prefetch_miss|{b}", 0) == 0, per
    assert per["all_gather|ThreeBlocks"] == 1 and per["reduce_scatter|ThreeBlocks"] == 1
    s = res["summary"]
    assert s["collectives"] == {"all_gather": 7, "reduce_scatter": 4}
    assert s["bytes"]["all_gather"] > 0 and s["exposed_comm_s"] >= 0
    # The exposed time, split by collective and module, adds up to the total.
    assert sum(s["exposed_by"].values()) == pytest.approx(s["exposed_comm_s"])
    kinds = {k.split(" ")[0] for k in s["exposed_by"]}
    assert kinds and kinds <= {"all_gather", "reduce_scatter"}, s["exposed_by"]
    assert s["prefetch_hit_rate"] == 1.0 and s["prefetch_hits"] == 5  # 3 fwd + 2 bwd (+2 first)
    assert res["ranks"] == [0, 1]
    trace = json.loads((tmp_path / "timeline.json").read_text())
    events = trace["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    for e in events:
        assert {"name", "ph", "pid", "tid"} <= e.keys()
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0
    assert any(e.get("cat") == "backward" and e["ph"] == "X" for e in events)
    png = (tmp_path / "timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


class OutOfOrder(nn.Module):
    """Defined c, b, a; called a, b, a, c: the static tree order is wrong, a runs twice."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Linear(5, 5)
        self.b = nn.Linear(5, 5)
        self.a = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.a(x))
        x = torch.tanh(self.b(x))
        x = torch.tanh(self.a(x))
        return self.c(x)


def order_worker(rank: int, world: int, prefetch: int) -> list[dict]:
    torch.manual_seed(0)
    model = OutOfOrder()
    for m in (model.c, model.b, model.a):
        fully_shard(m, prefetch=prefetch)
    fully_shard(model, prefetch=prefetch)
    x = torch.randn(3, 5)
    out = []
    for _ in range(3):
        with shardwise.trace() as t:
            model(x).sum().backward()
        assert_between_steps(model)
        model.zero_grad()
        out.append(t.summary())
    return out


def test_recorded_order_prefetch_hits_everything_with_no_extra_gathers() -> None:
    with_prefetch = run_distributed(order_worker, 2, 1)[0]
    without = run_distributed(order_worker, 2, 0)[0]
    assert with_prefetch[0]["prefetch_hit_rate"] < 1.0  # the static guess is wrong
    for step in (1, 2):
        assert with_prefetch[step]["prefetch_hit_rate"] == 1.0, with_prefetch[step]
        assert with_prefetch[step]["prefetch_misses"] == 0
        assert (
            with_prefetch[step]["collectives"]["all_gather"]
            == without[step]["collectives"]["all_gather"]
        ), (with_prefetch, without)
