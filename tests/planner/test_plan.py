"""The planner: ``shardwise plan`` at world size 64 on a tiny model, its bad input, and
its peak against the allocator's measured peak on two gloo ranks.

The simulation runs the real runtime under a fake process group, so the bytes it
reports per collective are the runtime's own (test_any_world.py checks those
against the theory at 2 to 1024 ranks); here they are checked as the plan says
them, with the peak's breakdown adding up to the peak.
"""

from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing as mp
import statistics
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from cli_helpers import shardwise
from shardwise_plan.measure import CPU_TIMED_S, TIMED_STEPS

pytestmark = pytest.mark.timeout(240)

TINY = ["--model", "tiny", "--batch-size", "1", "--seq-len", "32"]


def test_plan_runs_at_world_64_and_writes_json_and_plot(tmp_path: Path) -> None:
    out = shardwise(
        "plan", *TINY, "--world-size", "64", "--json", "p.json", "--plot", "p.png", cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    d = json.loads((tmp_path / "p.json").read_text())
    assert d["world_size"] == 64 and d["peak_bytes"] > 0 and d["step_ms"] > 0
    assert sum(d["peak_by_kind"].values()) == d["peak_bytes"]
    assert d["peak_where"]["phase"] in ("forward", "backward", "optimizer")
    # The tiny GPT in fp32: every block gathered twice, the root (embeddings, final
    # norm) once; all gradients reduce-scattered once (padded to 64 equal shards);
    # each rank moves 63/64 of each.
    whole = d["collectives"]["whole_bytes"]
    params = d["n_params"] * 4
    assert params <= whole["reduce_scatter"] < 1.3 * params
    assert whole["reduce_scatter"] < whole["all_gather"] < 2 * whole["reduce_scatter"]
    moved = d["collectives"]["bytes_per_rank"]
    for kind in ("all_gather", "reduce_scatter"):
        assert abs(moved[kind] - whole[kind] * 63 / 64) < 64 * 100, (kind, moved, whole)
    assert (tmp_path / "p.png").stat().st_size > 0
    assert "peak" in out.stdout and "step ms" in out.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--world-size", "64", "--hsdp", "3"], "--hsdp 3 does not divide --world-size 64"),
        (["--world-size", "8", "--reshard-after-forward", "3"], "must divide the shard group"),
        (["--world-size", "8", "--budget", "0.00001"], "no policy fits"),
        (["--world-size", "8", "--launches", "2"], "counts --measure's runs"),
        (["--world-size", "8", "--mp", "fp8"], "argument --mp: invalid choice: 'fp8'"),
        (["--world-size", "8", "--optimizer", "lion"], "argument --optimizer: invalid choice"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    out = shardwise("plan", *TINY, *args, "--json", "p.json", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--json", "/no/such/dir/p.json"], "--json /no/such/dir/p.json: there is no folder"),
        (["--plot", "/no/such/dir/x.png"], "--plot /no/such/dir/x.png: there is no folder"),
        (["--json", "."], "--json .: is a folder"),
        (["--plot", "x.unknown"], "--plot x.unknown: matplotlib writes"),
    ],
)
def test_an_output_that_cannot_be_written_is_refused_before_any_work(
    tmp_path: Path, args: list[str], message: str
) -> None:
    """Planning comes first and takes minutes on a large model: an output path it could
    not write at the end is one line and exit 2 before it starts (nothing planned, so
    nothing printed), and nothing is left behind."""
    out = shardwise(
        "plan", "--model", "large", "--world-size", "512", *args, cwd=tmp_path, timeout=60
    )
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and message in out.stderr, out.stderr
    assert out.stdout == "" and list(tmp_path.iterdir()) == []


def test_calibrate_refuses_an_output_it_cannot_write_before_measuring(tmp_path: Path) -> None:
    out = shardwise("calibrate", "--out", "/no/such/dir/r.json", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "shardwise calibrate: error: --out /no/such/dir/r.json: there is no folder '/no/such/dir'"
    ]
    assert out.stdout == ""


def test_help_fits_a_screen_and_shows_defaults(tmp_path: Path) -> None:
    """A few flags, each with its default; the hidden worker modes and the calibration are
    gone from it (``shardwise calibrate``, ``python -m shardwise_plan.worker``); the
    budget says what it costs."""
    out = shardwise("plan", "--help", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    flags = {w.strip("[],") for w in out.stdout.split() if w.startswith(("--", "[--"))}
    assert len(flags) <= 22, sorted(flags)  # 20 and the communication policy, node size
    for hidden in ("--calibrate", "--measure-out", "--suite", "--compute", "--nproc"):
        assert hidden not in flags
    text = " ".join(out.stdout.split())
    for default in ("(default: tiny)", "(default: 8)", "(default: 4)", "(default: adamw)"):
        assert default in text, default
    assert "it takes up to 16 plans' time" in text


def test_unknown_model_is_one_line(tmp_path: Path) -> None:
    out = shardwise("plan", "--model", "huge", "--world-size", "8", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "shardwise plan: error: unknown --model 'huge'; choose from tiny, small, base, medium, "
        "large, hf:PATH or module:function"
    ]


def _search() -> dict[str, Any]:
    from shardwise_app.models.gpt import GPT, SIZES
    from shardwise_plan import GIB, Policy, fastest_within

    frugal, keep = Policy(ac="non-reentrant"), Policy(reshard_after_forward=False)
    kw: dict[str, Any] = dict(batch_size=2, seq_len=64, policies=[frugal, keep])
    best, tried = fastest_within(lambda: GPT(SIZES["tiny"]), 8, GIB, **kw)
    peaks = {t.policy.ac: t.peak_bytes for t in tried}
    between = (peaks["none"] + peaks["non-reentrant"]) // 2
    narrow, _ = fastest_within(lambda: GPT(SIZES["tiny"]), 8, between, **kw)
    return {
        "best": best.policy.ac,
        "fastest": min(tried, key=lambda t: t.step_ms).policy.ac,
        "narrow": narrow.policy.ac,
        "peaks": peaks,
    }


def test_budget_picks_the_fastest_policy_that_fits() -> None:
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        out = pool.submit(_search).result(timeout=200)
    # Checkpointing saves memory and costs a recomputation.
    assert out["peaks"]["non-reentrant"] < out["peaks"]["none"], out
    assert out["best"] == out["fastest"] == "none", out
    # A budget only the checkpointed run fits picks it, although it is slower.
    assert out["narrow"] == "non-reentrant", out


def _cpu_budget() -> dict[str, Any]:
    from shardwise_app.models.gpt import GPT, SIZES
    from shardwise_plan import CPU, NothingFits, Policy, fastest_within

    def build() -> Any:
        return GPT(SIZES["tiny"])

    kw: dict[str, Any] = dict(batch_size=8, seq_len=128, policies=[Policy()], hardware=CPU)
    p, _ = fastest_within(build, 2, 1 << 40, **kw)
    over_middle = (p.peak_bytes + p.peak_bytes_drifting) // 2
    try:
        fastest_within(build, 2, over_middle, **kw)
        rejected = ""
    except NothingFits as e:
        rejected = str(e)
    at_most, _ = fastest_within(build, 2, p.peak_bytes_drifting, **kw)
    return {
        "middle": p.peak_bytes,
        "drifting": p.peak_bytes_drifting,
        "rejected": rejected,
        "fits_at_most": at_most.peak_bytes_drifting,
    }


def test_a_cpu_budget_is_judged_by_the_most_a_gloo_launch_may_reach() -> None:
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        out = pool.submit(_cpu_budget).result(timeout=200)
    # On gloo the plan's peak is the middle of two ends; a budget over the middle but
    # under the drifting end is one a launch may pass, so nothing fits it.
    assert out["middle"] < out["drifting"], out
    assert "no policy fits" in out["rejected"], out
    assert out["fits_at_most"] == out["drifting"], out


# (Not checkpointed: with checkpointing a launch whose ranks drift apart holds
# gloo's gather buffers longer (Plan.peak_bytes_drifting) and its peak has come
# too near 3% to assert; docs/scaling.md has every configuration.)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,ac,launches", [(2, "none", 3), (4, "none", 2)])
def test_predicted_peak_within_3_percent_of_gloo_ranks(
    tmp_path: Path, world: int, ac: str, launches: int
) -> None:
    flag = ["--launches", str(launches)] if launches != 3 else []  # 3: the default
    out = shardwise(
        "plan", "--model", "tiny", "--world-size", str(world), "--batch-size", "8",
        "--seq-len", "128", "--ac", ac, "--measure", *flag, "--json", "m.json", cwd=tmp_path,
        timeout=280,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    d = json.loads((tmp_path / "m.json").read_text())
    measured = d["measured"]["peak_bytes"][0]
    assert abs(d["peak_bytes"] - measured) <= 0.03 * measured, (d["peak_bytes"], measured)
    assert "predicted vs measured" in out.stdout
    # The step is the median of the timing launches, each its slowest rank's median;
    # per rank, the median over the launches.
    m = d["measured"]
    runs = m["step_ms_per_rank_per_launch"]
    assert len(runs) == len(m["step_ms_per_launch"]) == launches and len(runs[0]) == world
    assert m["step_ms_per_launch"] == [max(r) for r in runs]
    assert m["step_ms"] == statistics.median(m["step_ms_per_launch"])
    assert m["step_ms_per_rank"] == [statistics.median(r) for r in zip(*runs)]
    # A launch times at least TIMED_STEPS, and on a CPU as many as CPU_TIMED_S takes at
    # the slowest rank's first step's pace (the last launch's steps are kept).
    wanted = math.ceil(CPU_TIMED_S * 1e3 / m["first_step_ms_slowest"])
    assert len(m["steps_ms"]) == max(TIMED_STEPS, wanted), (len(m["steps_ms"]), wanted)


STATES = ("sharded_params", "grads", "optimizer_state")


def _offload_plans() -> dict[str, Any]:
    from shardwise_app.models.gpt import GPT, SIZES
    from shardwise_plan import H200, Policy, plan

    def run(world: int, ac: str, offload: bool, hw: Any = H200) -> Any:
        p = plan(
            lambda: GPT(SIZES["tiny"]),
            world,
            batch_size=2,
            seq_len=64,
            policy=Policy(ac=ac, offload=offload),
            hardware=hw,
        )
        return {
            "peak": p.peak_bytes,
            "kinds": p.peak_by_kind,
            "host": p.host_bytes,
            "host_peak": p.host_peak_bytes,
            "n_params": p.n_params,
            "optimizer_s": p.time.by_phase["optimizer"],
        }

    fast = H200.with_overrides(host_adamw_bw=2 * H200.host_adamw_bw)
    return {
        "w4_on": run(4, "none", False),
        "w4_off": run(4, "none", True),
        "w1_off": run(1, "non-reentrant", True),
        "w1_off_fast": run(1, "non-reentrant", True, fast),
        "rate": H200.host_adamw_bw,
    }


def test_offload_counts_the_states_as_host_memory_for_a_cuda_target() -> None:
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        out = pool.submit(_offload_plans).result(timeout=200)
    on, off = out["w4_on"], out["w4_off"]
    # Same step, same peak moment: the device peak drops by exactly the states' bytes,
    # which are now the host's.
    states = sum(on["kinds"].get(k, 0) for k in STATES)
    assert states > 0 and off["peak"] == on["peak"] - states, (on, off)
    assert not set(STATES) & set(off["kinds"]), off["kinds"]
    assert off["host"] == {k: on["kinds"][k] for k in off["host"]}, (on, off)
    # One GPU, checkpointed (the H200 rows): the gradients downloaded during backward
    # are host memory too; the host holds parameters, gradients and both moments at once.
    one = out["w1_off"]
    assert not set(STATES) & set(one["kinds"]), one["kinds"]
    host = one["host"]
    assert one["host_peak"] >= 2 * host["sharded_params"] + host["optimizer_state"], one
    # The host's AdamW: 32 bytes a parameter at host_adamw_bw; twice the rate saves half.
    saved = one["optimizer_s"] - out["w1_off_fast"]["optimizer_s"]
    expect = one["n_params"] * 32 / (2 * out["rate"])
    assert abs(saved - expect) < 1e-6 * expect, (saved, expect)


def _workspace_plans() -> dict[str, Any]:
    from dataclasses import replace

    from shardwise_app.models.gpt import GPT, SIZES
    from shardwise_plan import CPU, H200, plan

    def run(hw: Any) -> Any:
        p = plan(lambda: GPT(SIZES["tiny"]), 2, batch_size=2, seq_len=64, hardware=hw)
        return {"peak": p.peak_bytes, "kinds": p.peak_by_kind, "curve": p.memory_curve}

    return {
        "h200": run(H200),
        "none": run(replace(H200, blas_workspace=0)),
        "cpu": run(replace(CPU, blas_workspace=32 << 20)),
    }


def test_a_cuda_target_counts_cublas_workspaces_through_the_step() -> None:
    """cuBLAS keeps a workspace per thread that multiplies (forward's and autograd's),
    from the first step on: a CUDA target's peak and whole memory curve carry both;
    a CPU target has none, whatever the figure says."""
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        out = pool.submit(_workspace_plans).result(timeout=200)
    with_ws, without = out["h200"], out["none"]
    assert with_ws["kinds"]["blas_workspaces"] == 2 * (32 << 20), with_ws["kinds"]
    assert with_ws["peak"] == without["peak"] + 2 * (32 << 20)
    assert sum(with_ws["kinds"].values()) == with_ws["peak"]
    assert [b - a for (_, a, _), (_, b, _) in zip(without["curve"], with_ws["curve"])] == [
        2 * (32 << 20)
    ] * len(without["curve"])
    assert "blas_workspaces" not in out["cpu"]["kinds"]


def test_offload_copies_count_what_a_gpu_run_holds() -> None:
    """A download holds the device tensor it reads until the next download (or the end
    of backward: offload.py), and an upload makes a device copy of the shard before
    its cast; on a CPU run every storage is the host's, so the tracker says which
    side each copy is on, from the runtime's transfer observer (one transfer event
    per copy)."""
    import torch

    from shardwise.layout import offload
    from shardwise_plan.tracker import Tracker

    tracker = Tracker()
    with tracker, tracker.offload_copies():
        tracker.events = []
        shard = torch.zeros(256)  # 1 KiB, in host memory
        tracker.mark_host([shard.untyped_storage()])
        device = tracker.total
        up = offload.upload(shard, shard.device)
        assert up is not shard and tracker.total == device + 1024
        del up  # cast into the gathered parameters, then dropped
        assert tracker.total == device
        a, b = torch.ones(128), torch.ones(128)  # two reduced shards on the device, 512 B each
        device = tracker.total
        host_a, _ = offload.download(a, torch.float32, False)
        assert host_a.untyped_storage() is not a.untyped_storage()
        del a
        assert tracker.total == device  # still read by its copy to the host
        host_b, _ = offload.download(b, torch.float32, False)
        del b
        assert tracker.total == device - 512  # released once the next copy was issued
        offload.release_downloaded()  # the end of backward
        assert tracker.total == device - 1024
        assert tracker.host_total == 1024 + 2 * 512  # the shard and both CPU gradients
        transfers = [e.transfer for e in tracker.events if e.transfer]
    assert transfers == [1024, 512, 512]
    events = list(tracker.events)
    offload.upload(shard, shard.device)
    assert tracker.events == events  # the observers are gone with the context


def _offload_copies_plan() -> dict[str, Any]:
    from shardwise_app.models.gpt import GPT, GPTConfig
    from shardwise_plan import H200, Policy, plan

    cfg = GPTConfig(seq_len=512, n_layer=4, n_head=8, d_model=1024)
    p = plan(
        lambda: GPT(cfg),
        1,
        batch_size=2,
        seq_len=cfg.seq_len,
        policy=Policy(mp="bf16", ac="non-reentrant", offload=True),
        hardware=H200,
    )
    block = sum(q.numel() for q in GPT(cfg).blocks[0].parameters()) * 4
    return {"kinds": p.peak_by_kind, "phase": p.peak_phase, "block": -(-block // 512) * 512}


def test_offloaded_peak_counts_the_held_gradient_and_the_upload_copy() -> None:
    """One GPU, checkpointed blocks whose fp32 shards dominate: the peak is a prefetch's
    upload in backward, with the previous block's reduced shard still held by its
    download (one more is in flight, a plain buffer at one rank): two fp32 shards
    of a block counted as communication buffers, one of each."""
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        out = pool.submit(_offload_copies_plan).result(timeout=200)
    assert out["phase"] == "backward", out
    assert out["kinds"].get("comm_buffers") == 2 * out["block"], out


def test_one_gpu_replay_holds_a_modules_compute_until_its_own_upload() -> None:
    """At one GPU an offloaded gather is its upload, on a stream of its own: the
    compute after the gather's wait starts when that upload ends, not before
    (without the wait, the upload would overlap all of the compute)."""
    from shardwise_plan import H200
    from shardwise_plan.timeline import op_seconds, replay
    from shardwise_plan.tracker import Event

    upload = Event(kind="op", live=0, phase="forward", module="a", transfer=1 << 30, key=-1)
    work = Event(kind="op", live=0, phase="forward", module="a", flops=2e11, matmul=True)
    wait = Event(kind="wait", live=0, phase="forward", module="b", key=-1)
    t_up = (1 << 30) / H200.h2d_bw
    t_work = op_seconds(work, H200)
    assert t_up > 2 * t_work  # the upload outlasts the compute it hides behind
    held = replay([upload, work, wait, work], H200, 1)
    start = op_seconds(upload, H200, copies=False)
    assert held.step_s == pytest.approx(t_up + t_work)
    assert held.exposed_comm_s == pytest.approx(t_up - start - t_work)
    unheld = replay([upload, work, work], H200, 1)  # nothing waits: only the step's end
    assert unheld.step_s == pytest.approx(t_up) and unheld.step_s < held.step_s


def _offloaded_one_gpu_events() -> dict[str, Any]:
    from shardwise_app.models.gpt import GPT, GPTConfig
    from shardwise_plan import H200, Policy
    from shardwise_plan.simulate import simulate
    from shardwise_plan.timeline import replay

    cfg = GPTConfig(seq_len=256, n_layer=3, n_head=4, d_model=512)
    policy = Policy(mp="bf16", offload=True)
    sim = simulate(lambda: GPT(cfg), 1, policy, H200, batch=1, seq=cfg.seq_len)
    ev = sim.events
    uploads = [i for i, e in enumerate(ev) if e.transfer and not e.to_host]
    waits = {e.key: i for i, e in enumerate(ev) if e.kind == "wait"}
    unwaited = [dataclasses.replace(e, key=0) for e in ev if e.kind != "wait"]
    return {
        "uploads": uploads,
        "keys": [ev[i].key for i in uploads],
        "waits": waits,
        "held_s": replay(ev, H200, 1, offload=True).step_s,
        "unheld_s": replay(unwaited, H200, 1, offload=True).step_s,
    }


def test_one_gpu_offload_records_where_each_upload_is_waited_for() -> None:
    """The simulated runtime's own waits: every gather's upload (root and three blocks,
    forward and the blocks again in backward) is waited for once, after it was
    issued; the replay with those waits is longer than without (the small blocks'
    compute cannot hide their uploads)."""
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        out = pool.submit(_offloaded_one_gpu_events).result(timeout=200)
    uploads, keys, waits = out["uploads"], out["keys"], out["waits"]
    assert len(uploads) == 1 + 3 + 3, uploads
    assert keys == [-1 - i for i in uploads]  # each keyed by its own index
    assert sorted(waits, reverse=True) == keys, (waits, keys)
    assert all(waits[-1 - i] > i for i in uploads), (waits, uploads)
    assert out["held_s"] > out["unheld_s"], out


def test_measured_cpu_peak_takes_off_a_block_freed_where_the_profiler_could_not_see() -> None:
    """gloo's thread sometimes frees a reduce-scatter's clone unrecorded: an address handed
    out again ends the block it held, so the peak does not grow by it step after step."""
    from shardwise_plan.measure import live_peak

    mib = 2**20
    events = [
        (0, 0x1000, 50 * mib),  # the model and its state
        (1, 0x2000, 7 * mib),  # a clone, freed on gloo's thread: no record
        (2, 0x3000, 3 * mib),
        (3, 0x3000, -3 * mib),
        (10, 0x2000, 7 * mib),  # the window: the clone's address again
        (11, 0x4000, 4 * mib),
        (12, 0x4000, -4 * mib),
        (13, 0x2000, -7 * mib),
    ]
    assert live_peak(events, start=10, end=20) == ((50 + 7 + 4) * mib, 1)
    # Without the reuse the unseen free stays counted: the figure is an upper bound.
    assert live_peak(events[:4] + events[5:7], start=10, end=20) == ((50 + 7 + 4) * mib, 0)
    # Recorded frees alone: nothing is taken off twice.
    assert live_peak([(0, 1, 5), (1, 1, -5), (2, 1, 6)], 0, 9) == (6, 0)
