"""The planner's communication policies (``shardwise plan --comm-policy``, comm.py).

The byte model is checked against counts worked out by hand for a two-layer
chain at 16 ranks in nodes of 8 (which collectives run comes from the
runtime's own step; what each moves, over which link, from the formulas
below); the policy's time and memory show where they should; ``--budget``
picks a policy where memory allows and refuses where nothing fits; bad input
is one line, exit 2, nothing written. Plans run in a process of their own
(the planner's fake process group needs one where none is initialized).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from cli_helpers import shardwise
from shardwise_app.cli.common import UsageError

pytestmark = pytest.mark.timeout(300)

HERE = Path(__file__).resolve().parent
D, WORLD, NODE, BLOCK = 256, 16, 8, 100
N = D * D  # one block's parameters
SMALL = ["--model", "plan_models:comm_bound", "--seq-len", "16", "--batch-size", "1"]


def _in_a_process(fn: Any, *args: Any) -> Any:
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result(timeout=280)


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(D, D, bias=False) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _chain_input(model: nn.Module, batch: int, seq: int) -> tuple[Any, ...]:
    return (torch.randn(batch, D),)


def _chain_loss(model: Any, data: tuple[Any, ...]) -> torch.Tensor:
    return model(data[0]).sum()


def _chain_plans() -> dict[str, Any]:
    from shardwise_plan import H200, Policy, parse_comm, plan
    from shardwise_plan.timeline import replay

    out: dict[str, Any] = {}
    for name in ("none", "qwz", "qwz-always", "hpz", "qgz", "zeropp"):
        policy = Policy(mp="bf16", comm=parse_comm(name, block_size=BLOCK))
        p = plan(
            Chain, WORLD, batch_size=2, seq_len=1, policy=policy, hardware=H200,
            input_fn=_chain_input, loss_fn=_chain_loss,
        )  # fmt: skip
        issues = [e for e in p.events if e.kind == "issue"]
        out[name] = {
            "collectives": p.collectives,
            "issues": [(e.coll, e.phase, e.group, e.full_numel, e.itemsize) for e in issues],
            "step_s": p.time.step_s,
            "quantize_s": p.time.by_phase.get("quantize", 0.0),
            "peak": p.peak_bytes,
            "comm_buffers": p.peak_by_kind.get("comm_buffers", 0),
            "unpoliced_step_s": replay(
                p.events, p.hardware, WORLD, **{**p.replay_kw, "comm": None}
            ).step_s,
            "mem_bw": H200.mem_bw,
            "op_overhead": H200.op_overhead,
            "json": p.as_dict(),
        }
    return out


@pytest.fixture(scope="module")
def chain() -> dict[str, Any]:
    return _in_a_process(_chain_plans)  # type: ignore[no-any-return]


def _q(n: int) -> int:
    """n elements as int8 blocks of BLOCK with an fp32 scale each, by hand."""
    return n + 4 * math.ceil(n / BLOCK)


def test_plain_bytes_are_the_rings_split_by_node(chain: dict[str, Any]) -> None:
    plain = chain["none"]
    gathers = [i for i in plain["issues"] if i[0] == "all_gather"]
    reduces = [i for i in plain["issues"] if i[0] == "reduce_scatter"]
    assert gathers and reduces
    assert {(g, n, b) for _, _, g, n, b in gathers} == {(WORLD, N, 2)}  # bf16 parameters
    assert {(g, n, b) for _, _, g, n, b in reduces} == {(WORLD, N, 4)}  # fp32 reduction
    ag, rs = len(gathers), len(reduces)
    # each rank receives 15/16 of every gather and reduction, 8/16 from the other node
    c = plain["collectives"]
    assert c["bytes_per_rank"] == {
        "all_gather": ag * N * 2 * 15 // 16,
        "reduce_scatter": rs * N * 4 * 15 // 16,
    }
    assert c["bytes_per_link"] == {
        "inter": ag * N * 2 * 8 // 16 + rs * N * 4 * 8 // 16,
        "intra": ag * N * 2 * 7 // 16 + rs * N * 4 * 7 // 16,
    }
    # the policy "none" is the runtime's step as it was: same time with no policy at all
    assert plain["step_s"] == plain["unpoliced_step_s"]
    assert plain["quantize_s"] == 0.0 and plain["json"]["policy"]["comm"]["name"] == "none"


def test_qwz_gathers_int8_blocks_and_a_scale_each(chain: dict[str, Any]) -> None:
    plain, qwz = chain["none"], chain["qwz-always"]
    ag = sum(i[0] == "all_gather" for i in plain["issues"])
    rs = sum(i[0] == "reduce_scatter" for i in plain["issues"])
    s = N // WORLD  # 4096 elements a shard: 41 blocks of 100, the last one short
    assert _q(s) == 4096 + 4 * 41
    c = qwz["collectives"]
    assert c["bytes_per_rank"]["all_gather"] == ag * 15 * _q(s)
    assert c["bytes_per_link_by_kind"]["all_gather"] == {
        "inter": ag * 8 * _q(s),
        "intra": ag * 7 * _q(s),
    }
    assert c["bytes_per_rank"]["reduce_scatter"] == rs * N * 4 * 15 // 16  # untouched
    # two kernels a gather: quantize this rank's bf16 shard, dequantize all 16 into bf16
    bw, op = qwz["mem_bw"], qwz["op_overhead"]
    per_gather = (s * 2 + _q(s)) / bw + (16 * _q(s) + N * 2) / bw + 2 * op
    assert qwz["quantize_s"] == pytest.approx(ag * per_gather, rel=1e-9)
    # the int8 buffers, sent and received, are live at the peak's gathers
    assert qwz["peak"] > plain["peak"]
    # qwz quantizes the forward's gathers only (nothing is recomputed here)
    fwd = sum(i[0] == "all_gather" and i[1] == "forward" for i in plain["issues"])
    bwd = ag - fwd
    assert fwd and bwd
    assert chain["qwz"]["collectives"]["bytes_per_rank"]["all_gather"] == (
        fwd * 15 * _q(s) + bwd * N * 2 * 15 // 16
    )


def test_hpz_keeps_backwards_gathers_inside_the_node(chain: dict[str, Any]) -> None:
    plain, hpz = chain["none"], chain["hpz"]
    fwd = [i for i in hpz["issues"] if i[0] == "all_gather" and i[1] == "forward"]
    bwd = [i for i in hpz["issues"] if i[0] == "all_gather" and i[1] == "backward"]
    assert bwd and {i[2] for i in bwd} == {NODE} and {i[2] for i in fwd} == {WORLD}
    assert len(bwd) == sum(i[0] == "all_gather" and i[1] == "backward" for i in plain["issues"])
    ag = hpz["collectives"]["bytes_per_link_by_kind"]["all_gather"]
    assert ag == {
        "inter": len(fwd) * N * 2 * 8 // 16,
        "intra": len(fwd) * N * 2 * 7 // 16 + len(bwd) * N * 2 * 7 // 8,
    }
    # each block's node copy (N / 8 bf16 elements) lives from its forward to its backward
    assert hpz["peak"] >= plain["peak"] + N * 2 // NODE


def test_qgz_reduces_in_the_node_then_int8_across(chain: dict[str, Any]) -> None:
    rs = sum(i[0] == "reduce_scatter" for i in chain["none"]["issues"])
    c = chain["qgz"]["collectives"]
    s = N // WORLD
    # inside the node: 7 of 8 slices of N / 8 fp32 elements; across: the other node's
    # N / 16 slice as int8 blocks
    assert c["bytes_per_link_by_kind"]["reduce_scatter"] == {
        "inter": 0,
        "intra": rs * 7 * (N // 8) * 4,
    }
    assert c["bytes_per_link_by_kind"]["all_to_all"] == {"inter": rs * _q(s), "intra": 0}
    assert (
        c["bytes_per_link_by_kind"]["all_gather"]
        == chain["none"]["collectives"]["bytes_per_link_by_kind"]["all_gather"]
    )


def test_zeropp_cuts_inter_node_bytes_most(chain: dict[str, Any]) -> None:
    inter = {k: v["collectives"]["bytes_per_link"]["inter"] for k, v in chain.items()}
    assert inter["zeropp"] < min(inter["qwz-always"], inter["hpz"], inter["qgz"]) < inter["none"]
    assert chain["zeropp"]["json"]["policy"]["comm"] == {
        "name": "zeropp", "quantize_gather": "forward", "node_local_backward": True,
        "quantize_reduce": True, "node_size": None, "block_size": BLOCK, "quant_dtype": "int8",
    }  # fmt: skip


def test_policy_names() -> None:
    from shardwise_plan import CommPolicy, parse_comm

    assert parse_comm("zeropp") == parse_comm("qgz+hpz+qwz") == CommPolicy("forward", True, True)
    # shardwise train's names: qwz quantizes forward's gathers, qwz-always backward's too
    assert parse_comm("qwz") == CommPolicy("forward")
    assert parse_comm("qwz-always").name() == "qwz-always"
    assert parse_comm("none").active is False and parse_comm("qwz+qgz").name() == "qwz+qgz"
    assert parse_comm("qwz-always+hpz+qgz").name() == "qwz-always+hpz+qgz"
    with pytest.raises(ValueError, match="not both"):
        parse_comm("qwz+qwz-always")
    for bad in ("bogus", "qwz+", ""):
        with pytest.raises(ValueError, match="unknown communication policy"):
            parse_comm(bad)
    with pytest.raises(ValueError, match="block_size"):
        CommPolicy(block_size=0).check()


def test_a_recomputation_gathers_quantized_unless_hpzs_node_copy_serves_it() -> None:
    from shardwise_plan.comm import CommModel, CommPolicy
    from shardwise_plan.tracker import Event

    recompute = Event(kind="issue", live=0, phase="backward", module="b", coll="all_gather")
    zeropp = CommPolicy("forward", True, True)
    assert not CommModel(zeropp, NODE, WORLD, recompute=True).quantizes_gather(recompute)
    # one node: hpZ keeps no copy, the recomputation gathers what the forward gathered
    assert CommModel(zeropp, NODE, NODE, recompute=True).quantizes_gather(recompute)
    assert CommModel(CommPolicy("forward"), NODE, WORLD, recompute=True).quantizes_gather(recompute)
    assert not CommModel(CommPolicy("forward"), NODE, WORLD).quantizes_gather(recompute)


def test_a_recomputation_under_qwz_forward_is_followed_by_a_full_precision_gather() -> None:
    """As the runtime runs it (module.py's post-forward): the recomputation gathers the
    forward's quantized values, then the backward gathers at full precision; under
    "always", or with hpZ's node copy, one gather."""
    from shardwise_plan.comm import CommModel, CommPolicy
    from shardwise_plan.tracker import Event

    gather = Event(
        kind="issue", live=0, phase="backward", module="b", coll="all_gather",
        numel=1024, full_numel=1024 * WORLD, itemsize=2, group=WORLD, nbytes=1024 * 2 * (WORLD - 1),
    )  # fmt: skip
    legs = CommModel(CommPolicy("forward"), NODE, WORLD, recompute=True).legs(gather)
    assert len(legs) == 2 and legs[0].nbytes < legs[1].nbytes == gather.nbytes
    assert len(CommModel(CommPolicy("forward"), NODE, WORLD).legs(gather)) == 1
    assert len(CommModel(CommPolicy("always"), NODE, WORLD, recompute=True).legs(gather)) == 1
    zeropp = CommPolicy("forward", True, True)
    assert len(CommModel(zeropp, NODE, WORLD, recompute=True).legs(gather)) == 1


def _budget() -> dict[str, Any]:
    from plan_models import comm_bound
    from shardwise_plan import GIB, H200, NothingFits, Policy, fastest_within, parse_comm

    none, zeropp = Policy(mp="bf16"), Policy(mp="bf16", comm=parse_comm("zeropp"))
    kw: dict[str, Any] = dict(batch_size=1, seq_len=16, hardware=H200, policies=[none, zeropp])
    best, tried = fastest_within(comm_bound, WORLD, 100 * GIB, **kw)
    peaks = {t.policy.comm.name(): t.peak_bytes for t in tried}
    steps = {t.policy.comm.name(): t.step_ms for t in tried}
    narrow, _ = fastest_within(comm_bound, WORLD, (peaks["none"] + peaks["zeropp"]) // 2, **kw)
    try:
        fastest_within(comm_bound, WORLD, peaks["none"] // 2, **kw)
        refused = ""
    except NothingFits as e:
        refused = str(e)
    return {
        "best": best.policy.comm.name(),
        "narrow": narrow.policy.comm.name(),
        "peaks": peaks,
        "steps": steps,
        "refused": refused,
    }


def test_budget_picks_a_policy_where_memory_allows() -> None:
    out = _in_a_process(_budget)
    # the premise: zeropp is faster (communication bound) and holds more (hpZ's copies)
    assert out["steps"]["zeropp"] < out["steps"]["none"], out
    assert out["peaks"]["zeropp"] > out["peaks"]["none"], out
    assert out["best"] == "zeropp", out
    assert out["narrow"] == "none", out  # zeropp does not fit: the plain one does
    assert "no policy fits" in out["refused"], out


@pytest.fixture
def on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command imports plan_models from this folder."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))


def test_the_command_line_budget_searches_the_policies_where_the_world_spans_nodes() -> None:
    """Which communication policies ``--budget`` tries (the search itself is
    ``fastest_within``'s, above): each of them over a flat mesh of several nodes, with
    hpZ left out where nothing is resharded after forward; else the one named."""
    from shardwise_app.cli import plan as plan_cli
    from shardwise_plan import H200, CommPolicy, Policy, candidate_policies

    def comms(*argv: str) -> list[str]:
        args = plan_cli.parser().parse_args([*argv, "--budget", "10"])
        return [c.name() for c in plan_cli.budget_comms(args, H200)]

    assert comms("--world-size", "16") == ["none", "qwz", "hpz", "qgz", "zeropp"]
    assert comms("--world-size", "8") == []  # one node: nothing to split
    assert comms("--world-size", "16", "--node-size", "16") == []
    assert comms("--world-size", "16", "--hsdp", "2") == []
    assert comms("--world-size", "16", "--comm-policy", "qgz") == []  # the base's, fixed
    tried = candidate_policies(Policy(), [CommPolicy(), *plan_cli_comms()])
    assert len(tried) == plan_cli.BUDGET_COMM_POLICIES == 64 and len(set(tried)) == 64
    assert not any(p.comm.node_local_backward and p.reshard_after_forward is False for p in tried)


def plan_cli_comms() -> list[Any]:
    from shardwise_plan import parse_comm

    return [parse_comm(n) for n in ("qwz", "hpz", "qgz", "zeropp")]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--comm-policy", "bogus"], "--comm-policy: unknown communication policy 'bogus'"),
        (["--comm-policy", "zeropp", "--node-size", "3"], "node size 3 does not divide the world size 16"),
        (["--node-size", "5"], "--node-size: node size 5 does not divide the world size 16"),
        (["--node-size", "0"], "--node-size must be at least 1"),
        (["--comm-policy", "qgz", "--hsdp", "2"], "HSDP (replicate degree 2)"),
        (["--comm-policy", "hpz", "--reshard-after-forward", "false"], "give reshard_after_forward=True"),
        (["--comm-policy", "qwz", "--measure"], "leave out --measure or --comm-policy"),
        (["--comm-policy", "zeropp", "--budget", "0.00001"], "no policy fits"),
        (["--budget", "0.00001"], "no policy fits"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, on_path: None, args: list[str], message: str
) -> None:
    out = shardwise("plan", *SMALL, "--world-size", "16", *args, "--json", "p.json", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr
    assert list(tmp_path.iterdir()) == []


def _table_row() -> dict[str, Any]:
    import comm_policy_table as t

    tiny = ["--model", "tiny", "--batch-size", "1", "--seq-len", "32"]
    return t.plan_row(t.row_argv(tiny, 16, "zeropp"))


def test_the_table_command_plans_a_row_on_both_presets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(HERE.parent.parent / "benchmarks"))  # the child inherits it
    r = _in_a_process(_table_row)
    assert "--comm-policy zeropp" in r["argv"] and "--hardware h200" in r["argv"]
    h100, h200 = r["time"]["h100"], r["time"]["h200"]
    # the same simulated step on two presets' rates: H100's memory is slower
    assert h200["quantize_ms"] > 0 and h100["quantize_ms"] > h200["quantize_ms"]
    assert r["inter_bytes"] == r["collectives"]["bytes_per_link"]["inter"] > 0


def test_the_tables_verdict_is_the_best_policy_within_hsdps_peak(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(HERE.parent.parent / "benchmarks"))
    import comm_policy_table as t

    def row(policy: str, peak: int, exposed: float) -> dict[str, Any]:
        times = {"exposed_comm_ms": exposed, "step_ms": exposed + 100}
        return {
            "model": "m", "world": 64, "policy": policy, "peak_bytes": peak, "inter_bytes": 0,
            "intra_bytes": 0, "time": {"h100": times, "h200": times},
        }  # fmt: skip

    rows = [
        row("none", 1, 900.0),
        row("hsdp", 10, 5.0),
        row("qwz", 2, 600.0),
        row("zeropp", 11, 50.0),  # faster still, but over HSDP's peak
        row("qgz", 3, 301.0),
    ]
    v = t.verdicts({r["policy"]: r for r in rows})["h200"]
    assert v["best"] == "qgz" and v["share_of_full_shard"] == pytest.approx(301 / 900)
    md = t.markdown(rows)
    assert "best within HSDP's peak is qgz, 301 ms exposed, 0.33 of full" in md
    assert "(target 1/3: not met)" in md  # 301 / 900 is over a third
    assert md.count("| m | 64 |") == 5 and "HSDP 8 x 8" in md
    with pytest.raises(UsageError, match="--worlds '12'"):
        t.parse_worlds("12")
