"""The planner's step time where work shares a core or runs beside compute, and
the memory gloo holds of its own.

On a CPU a rank's operators, the Python between them and gloo's collectives
share its core. The plan charges a module's gather one latency per tensor
(gloo runs each as its own collective), measures the rank's whole step
under the fake process group to spread the Python over the operators, and
times an offloaded optimizer's operators on the host they run on. On one
GPU, offload's copies run on streams of their own, beside compute. gloo's
reduce-scatter all-reduces a copy of its input, which the plan counts until
the wait that frees it.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(300)


def test_gloo_pays_a_latency_per_tensor_nccl_one_per_gather() -> None:
    from shardwise_plan import CPU, H200
    from shardwise_plan.timeline import comm_seconds
    from shardwise_plan.tracker import Event

    def gather(parts: int) -> Event:
        return Event("issue", 0, "forward", "b", coll="all_gather", nbytes=0, group=2, parts=parts)

    cpu = replace(CPU, latency=1e-3)
    assert comm_seconds(gather(5), cpu, 2, False) == pytest.approx(5e-3)
    assert comm_seconds(gather(1), cpu, 2, False) == pytest.approx(1e-3)
    gpu = replace(H200, latency=1e-3)
    assert comm_seconds(gather(5), gpu, 2, False) == pytest.approx(1e-3)


def _plans() -> dict[str, Any]:
    import torch

    from shardwise_app.models.gpt import GPT, GPTConfig
    from shardwise_plan import CPU, Policy, plan

    torch.set_num_threads(1)
    cfg = GPTConfig(seq_len=32, n_layer=2, n_head=2, d_model=64)
    kw: dict[str, Any] = dict(batch_size=2, seq_len=32, compute="measured")
    p = plan(lambda: GPT(cfg), 2, hardware=CPU, **kw)

    def slow() -> Any:  # 10 ms of Python before each block: no operator at all
        model = GPT(cfg)
        for b in model.blocks:
            b.register_forward_pre_hook(lambda *_: time.sleep(0.01))
        return model

    hooked = plan(slow, 2, hardware=CPU, **kw)
    gathers = [e for e in _events(lambda: GPT(cfg)) if e.kind == "issue" and e.coll == "all_gather"]
    per_block = sum(1 for _ in GPT(cfg).blocks[0].parameters())
    off = Policy(offload=True)
    slow = replace(CPU, host_adamw_bw=CPU.host_adamw_bw / 100)
    o1 = plan(lambda: GPT(cfg), 1, policy=off, hardware=CPU, **kw)
    o2 = plan(lambda: GPT(cfg), 1, policy=off, hardware=slow, **kw)
    return {
        "compute": p.compute,
        "compute_ms": p.time.compute_s * 1e3,
        "hooked_compute_ms": hooked.time.compute_s * 1e3,
        "hooked_operators_ms": hooked.compute["operators_ms"],
        "parts": sorted({e.parts for e in gathers}),
        "per_block": per_block,
        "host_calls": o1.compute["host_distinct_calls"],
        "optimizer_ms": (o1.time.by_phase["optimizer"], o2.time.by_phase["optimizer"]),
    }


def _events(build: Any) -> list[Any]:
    from shardwise_plan import CPU, Policy
    from shardwise_plan.simulate import simulate

    return simulate(build, 2, Policy(), CPU, 2, 32).events


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(_has_gpu(), reason="measured compute for a CPU target needs no GPU here")
def test_measured_cpu_plan_counts_tensors_the_rank_step_and_host_operators() -> None:
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        out = pool.submit(_plans).result(timeout=280)
    # Every block's gather carries its parameters' count (the root has fewer).
    assert out["per_block"] in out["parts"] and max(out["parts"]) == out["per_block"], out
    # The operators' times are scaled up to the rank's whole step measured here:
    # together they are that step (never less than the operators alone).
    # The operators' times are scaled to the rank's whole step measured here: host
    # time that is no operator (a hook's 10 ms before each of the 2 blocks, once a
    # step) is in the prediction, though the operators' own sum barely moves.
    c = out["compute"]
    assert out["compute_ms"] == pytest.approx(c["local_step_ms"], rel=1e-6)
    added = out["hooked_compute_ms"] - out["compute_ms"]
    assert 15 < added < 30, out
    assert abs(out["hooked_operators_ms"] - c["operators_ms"]) < 10, out
    # The host's AdamW operators are timed here, so the rate no longer decides them:
    # a hundredth of it (a hundred times the time, by the rate) changes nothing but
    # the noise of two measurements.
    assert out["host_calls"] > 0
    fast, slow = out["optimizer_ms"]
    assert slow < 2 * fast, out


def test_one_gpu_copies_run_beside_compute_a_cpu_copies_on_its_core() -> None:
    """Offload at one rank: on a GPU the uploads and downloads have streams of their own
    (offload.py), so a step is its compute or its copies, whichever is longer, and the
    optimizer waits for both; on a CPU the rank's core does everything in turn."""
    from shardwise_plan import CPU, H200
    from shardwise_plan.timeline import replay
    from shardwise_plan.tracker import Event

    def op(phase: str, up: int = 0, down: int = 0) -> Event:
        return Event("op", 0, phase, "b", nbytes=1, transfer=up or down, to_host=bool(down))

    events = [op("forward", up=1000), op("backward", up=1000), op("backward", down=1000)]
    events += [op("optimizer")]
    for hw in (H200, CPU):
        hw = replace(hw, h2d_bw=1000.0, op_overhead=0.0, mem_bw=1e12, view_overhead=0.0)
        t = replay(events, hw, world=1)
        if hw.device == "cuda":
            # Two uploads one after the other (2 s), the download beside them (1 s).
            assert t.step_s == pytest.approx(2.0) and t.exposed_comm_s == pytest.approx(2.0)
        else:
            assert t.step_s == pytest.approx(3.0) and t.exposed_comm_s == 0.0


def _memory_and_marks(prof: Any) -> tuple[list[tuple[int, int]], dict[str, int]]:
    """A CPU profile's allocations and frees (time, bytes) in time order, and when
    each ``record_function`` mark ended."""
    events = list(prof.profiler.kineto_results.events())
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    return memory, {e.name(): e.end_ns() for e in events if e.name() != "[memory]"}


def _gloo_reduce_scatter_memory(rank: int, world: int) -> dict[str, int]:
    """Bytes the CPU allocator holds beyond the tensors we made: while one
    reduce-scatter is in flight, and once it is waited for (its Pending still held).
    gloo's thread lets go of the work a moment after the wait returns, so the
    second figure is what is left when the profile ends, after a barrier."""
    import torch
    import torch.distributed as dist

    from shardwise.comm import collectives
    from shardwise_plan.measure import free_handles_here

    free_handles_here()  # else gloo's thread may free the clone where no profiler sees
    numel = 1 << 16
    inp = torch.ones(world * numel)
    out = torch.empty(numel)
    marks: dict[str, int] = {}
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        with torch.profiler.record_function("in_flight"):
            pending = collectives.reduce_scatter(out, inp, dist.group.WORLD, divide_by=None)
        pending.wait()
        dist.barrier()
    memory, ends = _memory_and_marks(prof)
    marks["in_flight"] = sum(n for t, n in memory if t <= ends["in_flight"])
    marks["waited"] = sum(n for _, n in memory)
    assert pending is not None  # held to the end: its wait alone must free gloo's buffer
    assert torch.equal(out, torch.full((numel,), float(world)))
    return {**marks, "input": inp.numel() * inp.element_size()}


def test_gloo_reduce_scatter_holds_a_clone_of_its_input_until_the_wait() -> None:
    """What the planner counts for a CPU target's reduce-scatter (staging_live): gloo
    all-reduces a clone of the whole input, held from the issue until the runtime's
    wait releases the work handle, whoever still holds the Pending."""
    from dist_utils import run_distributed

    for m in run_distributed(_gloo_reduce_scatter_memory, 2, timeout=120):
        assert m["in_flight"] == m["input"], m
        assert m["waited"] == 0, m


def _gloo_gather_memory(rank: int, world: int, numels: list[int]) -> dict[str, int]:
    """Bytes the CPU allocator holds beyond our tensors while a module's gather
    (one gloo collective a tensor) waits for a late peer, at most over the whole
    gather, and once it is waited for; rank 1 issues a second late (rank 0 looks
    0.3 s after its issue: the margin is for a loaded machine)."""
    import torch
    import torch.distributed as dist

    from shardwise.comm import collectives

    inps = [torch.ones(n) for n in numels]
    outs = [torch.empty(world * n) for n in numels]
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        dist.barrier()  # the ranks' profilers started, whichever took longer
        if rank == 1:
            time.sleep(1.0)
        with torch.profiler.record_function("issue"):
            pending = collectives.all_gather_each(outs, inps, dist.group.WORLD, "probe")
        with torch.profiler.record_function("in_flight"):
            time.sleep(0.3 if rank == 0 else 0.0)  # rank 0: its gathers wait for rank 1
        pending.wait()
        time.sleep(0.05)  # gloo's threads let go of their buffers
        dist.barrier()
    memory, ends = _memory_and_marks(prof)
    issued, end = ends["issue"], ends["in_flight"]
    live, most, after, in_flight = 0, 0, 0, 0
    for t, n in memory:
        live += n
        most = max(most, live)
        if t > issued:
            after = max(after, live)
        if t <= end:
            in_flight = live
    assert all(torch.equal(o, torch.ones_like(o)) for o in outs)
    return {"in_flight": in_flight, "most": most, "after_issue": after, "left": live}


def test_gloo_runs_a_modules_gather_two_tensors_at_a_time_each_in_a_buffer_of_its_own() -> None:
    """What the planner counts for gloo's gathers (staging_live): a module's gather
    is one gloo collective per tensor, and the group's ``GLOO_THREADS`` threads
    run them in issue order, each tensor gathered into a flat buffer of the
    output's size and freed when it is done. Waiting for a late peer, the early
    rank holds the first two tensors' buffers, not all of them; once issued, never
    more than the two largest (the drifting bound); while issuing, a transient of
    each tensor's size on this thread besides, never more than all of them (the
    in-step figure at the issue)."""
    from dist_utils import run_distributed
    from shardwise_plan.timeline import GLOO_THREADS

    world, numels = 2, [1 << 14, 1 << 12, 1 << 15, 1 << 13, 1 << 11]
    flat = [world * n * 4 for n in numels]
    for rank, m in enumerate(run_distributed(_gloo_gather_memory, world, numels, timeout=120)):
        if rank == 0:
            assert m["in_flight"] == sum(flat[:GLOO_THREADS]), (m, flat)
        assert m["after_issue"] <= sum(sorted(flat)[-GLOO_THREADS:]) < sum(flat), (m, flat)
        assert m["most"] <= sum(flat), (m, flat)
        assert m["left"] == 0, m


def _gloo_clone_frees(rank: int, world: int, rounds: int) -> tuple[int, int, int]:
    """The measured launch's profile over many reduce-scatters: allocations of the
    clone's size, their recorded frees, and the bytes left live at the end."""
    import torch
    import torch.distributed as dist

    from shardwise.comm import collectives
    from shardwise_plan.measure import free_handles_here

    free_handles_here()
    numel = 1 << 16
    inp = torch.ones(world * numel)
    out = torch.empty(numel)
    size = inp.numel() * inp.element_size()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        for i in range(rounds):
            if (i + rank) % 2:  # the ranks take turns arriving last
                time.sleep(0.001)
            collectives.reduce_scatter(out, inp, dist.group.WORLD, divide_by=None).wait()
        dist.barrier()
    memory = [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    return memory.count(size), memory.count(-size), sum(memory)


def test_a_measured_launch_sees_every_free_of_gloos_clones() -> None:
    """gloo's worker thread lets go of a work just after the wait returns; where it let
    go last, the clone was freed there, unrecorded, and the measured CPU peak grew by
    it. The profiled launch keeps each handle past the wait and drops it on its own
    thread (shardwise_plan.measure.free_handles_here): every clone's free is in the record."""
    from dist_utils import run_distributed

    for allocs, frees, left in run_distributed(_gloo_clone_frees, 2, 40, timeout=120):
        assert allocs == 40 and frees == 40 and left == 0, (allocs, frees, left)


def test_the_held_handle_lives_past_the_wait_and_goes_on_this_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading
    import weakref

    from shardwise import observe
    from shardwise_plan import measure

    added: dict[str, Any] = {}
    real = {k: getattr(observe, f"add_{k}_observer") for k in ("collective", "wait")}
    for kind in real:  # see what free_handles_here registers

        def spy(fn: Any, kind: str = kind) -> Any:
            added[kind] = fn
            return real[kind](fn)

        monkeypatch.setattr(observe, f"add_{kind}_observer", spy)

    class Work:
        def wait(self) -> None:
            pass

    work = Work()
    gone = weakref.ref(work)
    freed_on: list[str] = []
    weakref.finalize(work, lambda: freed_on.append(threading.current_thread().name))
    remove = measure.free_handles_here()
    try:
        pending = observe.Pending(work, kind="reduce_scatter")
        record = observe.CollectiveRecord("reduce_scatter", None, 1, 4, 2, "")  # type: ignore[arg-type]
        added["collective"](record, pending)  # as the runtime calls it at the issue
        del work
        assert gone() is not None  # the Pending holds it until the wait
        t0 = time.perf_counter()
        pending.wait()  # the wait observers run, the registered one among them
        assert time.perf_counter() - t0 >= measure.HANDLE_HOLD_S
        assert gone() is None and freed_on == [threading.current_thread().name]
    finally:
        remove()


def test_a_cpu_targets_reduce_scatter_carries_its_input_as_staging() -> None:
    from shardwise_app.models.gpt import GPT, GPTConfig
    from shardwise_plan import CPU, H200, Policy
    from shardwise_plan.simulate import simulate

    cfg = GPTConfig(seq_len=32, n_layer=2, n_head=2, d_model=64)
    for hw in (CPU, H200):
        events = simulate(lambda: GPT(cfg), 2, Policy(), hw, 2, 32).events
        reduces = [e for e in events if e.kind == "issue" and e.coll == "reduce_scatter"]
        assert reduces
        for e in reduces:
            # The input is the group's whole gradient: group x the shard, in fp32.
            assert e.staging == (e.group * e.numel * 4 if hw.device == "cpu" else 0), e


def test_gloo_ranks_in_step_free_a_gathers_buffer_as_it_runs_and_a_clone_at_its_wait() -> None:
    """The two ends of a CPU target's peak (staging_live): ranks that drift apart hold
    each gloo buffer from the issue to the wait; ranks in step free a gather's flat
    buffer as soon as it has run, while a reduce-scatter's clone stays to the wait
    either way (the work handle holds it)."""
    from shardwise_plan.timeline import staging_live
    from shardwise_plan.tracker import Event

    def ev(kind: str, key: int = 0, coll: str = "", staging: int = 0) -> Event:
        return Event(kind, 0, "forward", "", coll=coll, key=key, staging=staging)

    events = [
        ev("issue", 1, "all_gather", 100),
        ev("op"),
        ev("op"),
        ev("wait", 1),
        ev("issue", 2, "reduce_scatter", 50),
        ev("op"),
        ev("wait", 2),
    ]
    assert staging_live(events) == [100, 100, 100, 0, 50, 50, 0]
    assert staging_live(events, in_step=True) == [100, 0, 0, 0, 50, 50, 0]

    # A module's gather is a gloo collective a tensor, GLOO_THREADS (2) at a time: drifting
    # ranks hold the two largest tensors' buffers of the gathers still in flight (a second
    # gather issued before the first is waited for joins them), and at an issue no less
    # than in step.
    def gather(key: int, parts: tuple[int, ...]) -> Event:
        return Event("issue", 0, "forward", "", coll="all_gather", key=key,
                     staging=sum(parts), staging_parts=parts)  # fmt: skip

    events = [gather(1, (40, 30, 20, 10)), ev("op"), gather(2, (35, 5)), ev("op")]
    events += [ev("wait", 1), ev("op"), ev("wait", 2), ev("op")]
    assert staging_live(events) == [100, 70, 75, 75, 40, 40, 0, 0]
    assert staging_live(events, in_step=True) == [100, 0, 40, 0, 0, 0, 0, 0]


def test_a_cpu_targets_peak_is_the_middle_of_its_ranks_in_step_and_drifting() -> None:
    from shardwise_app.models.gpt import GPT, GPTConfig
    from shardwise_plan import CPU, H200, Policy, plan

    cfg = GPTConfig(seq_len=32, n_layer=3, n_head=2, d_model=64)
    policy = Policy(ac="non-reentrant")  # a gather prefetched before a recomputation
    cpu = plan(lambda: GPT(cfg), 2, batch_size=2, seq_len=32, policy=policy, hardware=CPU)
    low, high = cpu.peak_bytes_in_step, cpu.peak_bytes_drifting
    assert low < cpu.peak_bytes < high and cpu.peak_bytes == low + (high - low) // 2
    # The breakdown is the in-step peak's, the half added to gloo's buffers.
    assert sum(cpu.peak_by_kind.values()) == cpu.peak_bytes
    d = cpu.as_dict()
    assert (d["peak_bytes_in_step"], d["peak_bytes_drifting"]) == (low, high)
    gpu = plan(lambda: GPT(cfg), 2, batch_size=2, seq_len=32, policy=policy, hardware=H200)
    # NCCL: no buffers of its own
    assert gpu.peak_bytes_in_step == gpu.peak_bytes == gpu.peak_bytes_drifting
    assert cpu.peak_is_a_range and not gpu.peak_is_a_range

    # The plot's curve is the ranks-in-step one: on gloo its title names that peak beside
    # the predicted one (the curve never reaches the middle); on NCCL one figure.
    from shardwise_app.cli.plan import plot_title

    assert max(live for _, live, _ in cpu.memory_curve) <= low
    title = plot_title(cpu)  # under a GiB: in MiB, where the two differ
    assert f"peak {cpu.peak_bytes / 2**20:.3f} MiB" in title
    assert f"ranks in step, peak {low / 2**20:.3f} MiB" in title
    assert "ranks in step" not in plot_title(gpu)
