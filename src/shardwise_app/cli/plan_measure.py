"""``shardwise plan --measure``: the predicted configuration run for real, side by side.

Why measured this way: a check of the planner must not share its mechanism.
The planner counts storages under fake tensors; here the same model and
policy (``shardwise_plan.setup``, so the build is identical) train on real
tensors in worker processes our launcher starts (gloo ranks on a CPU, one
process per GPU on CUDA), and the peak comes from the allocator: on CUDA
``torch.cuda.max_memory_allocated``, on the CPU the allocation and free
events ``torch.profiler`` records with ``profile_memory=True``, summed in
time order from before the model is built and paired by address (a free made
on gloo's own thread goes unrecorded: ``live_peak``). The peak is taken over
the second step (the first makes the optimizer state). On the CPU the step
time comes from launches that never profile (a
profiled start left later steps up to 40% slower, 2026-12-02: the
allocator's state it leaves): in each, ``WARM_STEPS`` untimed, then the
median of ``TIMED_STEPS`` (on a CPU, of as many more as ``CPU_TIMED_S``
takes), every rank starting each together, the slowest rank's median; the
figure is the median over ``TIMING_LAUNCHES`` launches.
On a GPU, which nothing profiles, the same steps follow the peak's in one
launch. ``--launches N`` sets how many launches the step time is the median
of (on a GPU the first is the peak's).
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .main import Launch, UsageError, check_nproc, in_worker, init_worker, launch

WARM_STEPS = 2
TIMED_STEPS = 7
# On a CPU, at least this long of timed steps. One gloo step is one draw of how
# its threads got the cores: the tiny GPT's steps at 2 ranks spread 14 ms about
# a 140 ms median, within a launch, and the medians of 7 moved from launch to
# launch by about what that sampling gives (6.7 ms, 5.2 from the sampling alone,
# 16 launches on the 2-core machine, pinning each rank to a core or not alike:
# docs/bench/gloo_step_sampling_20261204.txt). Short steps are the ones whose
# medians move most; 3 s times about 20 of them and leaves steps of 0.4 s or
# more at 7.
CPU_TIMED_S = 3.0
# Launches differ (on the 2-core machine a launch's median sat up
# to 20% from the next one's, 2026-12-02): the median of three launches' figures.
TIMING_LAUNCHES = 3


def measure_and_compare(args: Any, predicted: Any, seq: int, batch: int) -> dict[str, Any]:
    """Launch the workers, print predicted vs measured, return the measured figures."""
    nproc = args.nproc or args.world_size
    if nproc != args.world_size:
        raise UsageError(f"--measure runs --world-size ranks here: --nproc {nproc} differs")
    check_nproc(nproc)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "measured.json"
        measured: dict[str, Any] = {}
        launches: list[float] = []
        per_rank: list[list[float]] = []  # each launch's ranks' medians
        # On a GPU nothing is profiled: one launch measures both. The workers run
        # where init_worker puts them (a GPU if there is one), whatever the target.
        import torch

        cuda = torch.cuda.is_available()
        n = args.launches or (1 if cuda else TIMING_LAUNCHES)
        for timing in ["both", *["time"] * (n - 1)] if cuda else ["peak", *["time"] * n]:
            worker_args = _worker_args(args, predicted, seq, batch, out)
            worker_args["measure_time"] = timing
            code = launch("plan", worker_args, Launch(nproc), lambda _id, sig: 128 + sig)
            if code or not out.is_file():
                raise SystemExit(code or 1)
            measured.update(json.loads(out.read_text()))
            out.unlink()
            if timing != "peak":
                launches.append(measured["step_ms"])
                per_rank.append(measured["step_ms_per_rank"])
        # every launch's, not the last one's (its steps_ms stay the last launch's)
        measured.update(launch_figures(launches, per_rank))
    print_comparison(predicted, measured)
    return measured


def launch_figures(launches: list[float], per_rank: list[list[float]]) -> dict[str, Any]:
    """The step time over several launches: the median of each launch's step (``launches``),
    and each rank's median of its launches' (``per_rank``: one list of ranks per launch)."""
    return {
        "step_ms_per_launch": launches,
        "step_ms": statistics.median(launches),
        "step_ms_per_rank_per_launch": per_rank,
        "step_ms_per_rank": [statistics.median(r) for r in zip(*per_rank)],
    }


def _worker_args(args: Any, p: Any, seq: int, batch: int, out: Path) -> dict[str, Any]:
    pol = p.policy
    return {
        "model": args.model,
        "world_size": args.world_size,
        "hsdp": args.hsdp,
        "mp": pol.mp,
        "ac": pol.ac,
        "reshard_after_forward": str(pol.reshard_after_forward).lower(),
        "offload": pol.offload,
        "prefetch": pol.prefetch,
        "batch_size": batch,
        "seq_len": seq,
        "measure_out": str(out),
    }


def error_pct(pred: float, meas: float) -> float:
    return 100.0 * (pred - meas) / meas if meas else float("nan")


def print_comparison(p: Any, m: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"predicted vs measured ({m['device']}, {m['world_size']} ranks)")
    for c in ("", "predicted", "measured", "error"):
        t.add_column(c, justify="right")
    peak = m["peak_bytes"][0]
    t.add_row(
        "peak MiB (rank 0)",
        f"{p.peak_bytes / 2**20:.2f}",
        f"{peak / 2**20:.2f}",
        f"{error_pct(p.peak_bytes, peak):+.1f}%",
    )
    if p.peak_is_a_range:  # gloo: the ranks' timing, between
        for label, end in (("in step", p.peak_bytes_in_step), ("drifting", p.peak_bytes_drifting)):
            t.add_row(
                f"peak MiB, ranks {label}",
                f"{end / 2**20:.2f}",
                f"{peak / 2**20:.2f}",
                f"{error_pct(end, peak):+.1f}%",
            )
    t.add_row(
        "step ms",
        f"{p.step_ms:.1f}",
        f"{m['step_ms']:.1f}",
        f"{error_pct(p.step_ms, m['step_ms']):+.1f}%",
    )
    Console().print(t)


# ---- inside a worker ------------------------------------------------------------------------


def run_worker(args: Any, build: Any) -> int:
    """One rank: build, shard, train two steps and measure the second's peak; or, in the
    timing launch, train ``WARM_STEPS`` and time ``TIMED_STEPS``."""
    import torch
    import torch.distributed as dist

    from shardwise import hsdp_mesh
    from shardwise_plan import Policy
    from shardwise_plan.setup import apply_policy, lm_loss, make_optimizer, token_batch

    w = init_worker()
    cuda = w.device.type == "cuda"
    policy = Policy(args.mp, args.ac, args.reshard_after_forward, args.offload, args.prefetch)
    mesh = hsdp_mesh(args.hsdp) if args.hsdp > 1 else None

    def step(model: Any, opt: Any, data: Any) -> None:
        lm_loss(model, data).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    timing = getattr(args, "measure_time", None) or "both"
    prof = None if cuda or timing == "time" else _cpu_profiler()
    if prof is not None:
        _free_handles_here()
        prof.start()
    torch.manual_seed(0)
    with w.device:
        model = build()
    if mesh is None:
        from shardwise.api import default_mesh

        mesh = default_mesh()
    apply_policy(model, policy, mesh)
    opt = make_optimizer(model, w.device.type, policy.offload)
    with w.device:
        data = token_batch(model, args.batch_size, args.seq_len)
    step(model, opt, data)  # the optimizer state, the recorded orders
    out: dict[str, Any] = {}
    if timing != "time":
        peaks = _peak_of_step(step, model, opt, data, prof)
        out["peak_bytes"] = [p for p, _ in peaks]
        out["frees_unrecorded"] = [n for _, n in peaks]  # CPU: seen by address (live_peak)
    if timing != "peak":
        out.update(_time_steps(step, model, opt, data, cuda))
    if w.is_main:
        out.update(
            device=torch.cuda.get_device_name() if cuda else "cpu",
            world_size=w.world,
            threads_per_rank=torch.get_num_threads(),
        )
        Path(args.measure_out).write_text(json.dumps(out))
    dist.destroy_process_group()
    return 0


def _peak_of_step(step: Any, model: Any, opt: Any, data: Any, prof: Any) -> list[Any]:
    """Every rank's peak over one step (the second: the optimizer state exists), with
    the frees the CPU profiler did not see (``live_peak``; 0 on a GPU). (The highest
    of 4 CPU steps was tried, 2026-12-03: at 4 gloo ranks it caught a step 3.5% over
    the prediction's bound, most likely such unseen frees, counted then.)"""
    import torch

    from shardwise import collectives

    unrecorded = 0
    if prof is None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with torch.profiler.record_function("shardwise_measured_step"):
        step(model, opt, data)
    if prof is None:
        torch.cuda.synchronize()
        peak = int(torch.cuda.max_memory_allocated())
    else:
        prof.stop()
        peak, unrecorded = _cpu_peak(prof, "shardwise_measured_step")
    return collectives.all_gather_objects((peak, unrecorded))


def _time_steps(step: Any, model: Any, opt: Any, data: Any, cuda: bool) -> dict[str, Any]:
    """The slowest rank's median step, every rank's, and each step as timed."""
    import torch
    import torch.distributed as dist

    from shardwise import collectives

    def timed() -> float:
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(model, opt, data)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(WARM_STEPS - 1):  # a first step was taken
        timed()
    times = [timed()]
    count, first = TIMED_STEPS, None
    if not cuda:  # every rank must take as many: the count from the slowest's first
        first = max(collectives.all_gather_objects(times[0]))
        count = max(TIMED_STEPS, math.ceil(CPU_TIMED_S / max(first, 1e-6)))
    times += [timed() for _ in range(count - 1)]
    medians = collectives.all_gather_objects(statistics.median(times))
    return {
        **({"first_step_ms_slowest": 1e3 * first} if first is not None else {}),
        "step_ms": 1e3 * max(medians),
        "step_ms_per_rank": [1e3 * m for m in medians],
        "steps_ms": [1e3 * t for t in times],
    }


# How long the profiled launch keeps a waited collective's handle (gloo's worker
# thread lets go of its own reference microseconds after the wait returns).
HANDLE_HOLD_S = 0.01


def _free_handles_here() -> Callable[[], None]:
    """Have this thread, not gloo's, free what a collective's handle holds.

    The profiler records a free only on a thread it profiles. A gloo work keeps
    buffers of its own (the reduce-scatter's clone of its whole input), and
    gloo's worker thread drops its reference just after marking the work done:
    when the runtime's wait let go first, the buffer was freed there, unseen,
    and counted as live to the end (the small GPT at 4 ranks measured 93.2 MiB
    for 86.5 in 2 of 6 invocations, 2026-12-03). So the profiled launch keeps
    each handle past the wait for ``HANDLE_HOLD_S`` and then drops it here;
    nothing is allocated meanwhile, so the peak is the run's. Timing launches
    do not do this. Returns the remover of the observer it installs."""
    from shardwise import collectives

    def observe(_rec: Any, p: Any) -> None:
        held = [p.work]

        def release(_p: Any) -> None:
            time.sleep(HANDLE_HOLD_S)
            held.clear()

        p.on_done.append(release)

    return collectives.add_observer(observe)


def _cpu_profiler() -> Any:
    import torch

    return torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    )


def _cpu_peak(prof: Any, window: str) -> tuple[int, int]:
    """Live CPU bytes at their highest inside ``window``, and how many frees the profiler
    did not see (``live_peak``), from its allocation events with their addresses."""
    from torch._C._profiler import _EventType

    spans = [e for e in prof.profiler.kineto_results.events() if e.name() == window]
    if not spans:
        raise RuntimeError(f"the profiler recorded no {window!r} span")
    start = spans[0].start_ns()
    end = start + spans[0].duration_ns()
    allocs = []
    todo = list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        e = todo.pop()
        todo.extend(e.children)
        if e.typed[0] == _EventType.Allocation and e.typed[1].device.type == "cpu":
            f = e.typed[1]
            allocs.append((e.start_time_ns, f.id, f.ptr, f.alloc_size))
    allocs.sort()
    return live_peak([(ts, ptr, n) for ts, _, ptr, n in allocs], start, end)


def live_peak(events: list[tuple[int, int, int]], start: int, end: int) -> tuple[int, int]:
    """The most bytes live at once in ``[start, end]``, from ``(time, address, bytes)``
    allocation events in time order (a free: negative bytes), counted from the first;
    and the number of frees that were never recorded.

    Why by address: the profiler records a free only on a thread it profiles, and
    gloo's worker thread sometimes drops the last reference to a buffer its work
    holds (the reduce-scatter's clone of its input: the work is marked done, the
    runtime's wait returns and lets go, and then the worker thread releases its
    own). Summed blindly, such a block stays live to the end, and the measured
    peak grew step by step, by one block's clone at a time (6.76 MiB at the small
    GPT, 4 gloo ranks; 7 of 21 launches, 2026-12-03). An address handed out again
    was freed before: its block is taken off there. Between the unseen free and
    that reuse it still counts, so the figure is an upper bound, as before."""
    live = peak = unrecorded = 0
    held: dict[int, int] = {}
    for ts, ptr, nbytes in events:
        if ts > end:
            break
        if nbytes > 0 and ptr in held:
            live -= held.pop(ptr)
            unrecorded += 1
        if ts >= start:
            peak = max(peak, live, live + nbytes)  # what was live as the window began, too
        live += nbytes
        if nbytes > 0:
            held[ptr] = nbytes
        else:
            held.pop(ptr, None)
    return peak, unrecorded


def is_measuring_worker(args: Any) -> bool:
    return in_worker() and bool(getattr(args, "measure_out", None))
