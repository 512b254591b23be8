"""A planned configuration run for real on this machine: its peak and step time, measured.

Why measured this way: a check of the planner must not share its mechanism.
The planner counts storages under fake tensors; here the same model, policy
and optimizer (setup.py, so the build is identical) train on real tensors in
rank processes of their own (ranks.py: gloo ranks on a CPU, one process per
GPU on CUDA), and the peak comes from the allocator: on CUDA
``torch.cuda.max_memory_allocated``, on the CPU the allocation and free
events ``torch.profiler`` records with ``profile_memory=True``, summed in time
order from before the model is built and paired by address (a free made on
gloo's own thread goes unrecorded: ``live_peak``). The peak is taken over the
second step (the first makes the optimizer state).

On a CPU the step time comes from launches that never profile (a profiled
start leaves the allocator slower for the steps after it): in each,
``WARM_STEPS`` untimed, then the median of at least ``TIMED_STEPS`` (of as
many as ``CPU_TIMED_S`` takes: one gloo step is one draw of how its threads
got the cores), every rank starting each together, the slowest rank's
median; the figure is the median over the launches. On a GPU, which nothing
profiles, the same steps follow the peak's in one launch.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .comm import CommPolicy
from .optimizers import DEFAULT
from .policy import Policy
from .ranks import run_ranks

WARM_STEPS = 2
TIMED_STEPS = 7
CPU_TIMED_S = 3.0  # at least this long of timed steps on a CPU
CPU_LAUNCHES = 3  # launches a CPU's step time is the median of (their medians move)
# How long the profiled launch keeps a waited collective's handle (gloo's worker
# thread lets go of its own reference microseconds after the wait returns).
HANDLE_HOLD_S = 0.01


@dataclass(frozen=True)
class Run:
    """A configuration to run: ``build`` is "module:function", called with ``build_args``
    on every rank to make the model (on the rank's device)."""

    build: str
    build_args: tuple[Any, ...]
    world_size: int
    batch_size: int
    seq_len: int
    policy: Policy = Policy()
    hsdp: int = 1
    optimizer: str = DEFAULT

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "build_args": list(self.build_args)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Run:
        fields = dict(d["policy"])
        comm = fields.get("comm")
        if isinstance(comm, dict):  # asdict made the communication policy a dict too
            names = {f.name for f in dataclasses.fields(CommPolicy)}
            fields["comm"] = CommPolicy(**{k: v for k, v in comm.items() if k in names})
        policy = Policy(**fields)
        return cls(**{**d, "policy": policy, "build_args": tuple(d["build_args"])})


class RunFailed(RuntimeError):
    """A rank of the measured run failed (its own message is on stderr)."""


def measure(run: Run, launches: int | None = None) -> dict[str, Any]:
    """Run ``run`` here at its world size, each launch in processes of its own; the
    measured figures (``peak_bytes`` per rank, ``step_ms`` and how it was taken).
    ``launches``: how many the step time is the median of (default 3 on a CPU, 1 on
    a GPU, where the first launch also takes the peak)."""
    import torch

    cuda = torch.cuda.is_available()
    n = launches or (1 if cuda else CPU_LAUNCHES)
    measured: dict[str, Any] = {}
    steps: list[float] = []
    per_rank: list[list[float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "run.json", Path(tmp) / "measured.json"
        spec.write_text(json.dumps(run.as_dict()))
        for timing in ["both", *["time"] * (n - 1)] if cuda else ["peak", *["time"] * n]:
            code = run_ranks(["measure", str(spec), timing, str(out)], run.world_size)
            if code or not out.is_file():
                raise RunFailed(f"a rank of the measured run failed (exit code {code or 1})")
            measured.update(json.loads(out.read_text()))
            out.unlink()
            if timing != "peak":
                steps.append(measured["step_ms"])
                per_rank.append(measured["step_ms_per_rank"])
    # every launch's, not the last one's (its steps_ms stay the last launch's)
    measured.update(launch_figures(steps, per_rank))
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


def builder(run: Run) -> Callable[[], Any]:
    module, _, name = run.build.partition(":")
    fn = getattr(importlib.import_module(module), name)
    return lambda: fn(*run.build_args)


# ---- inside a rank ---------------------------------------------------------------------------


def run_rank(run: Run, timing: str, out: Path, device: Any) -> None:
    """One rank: build, shard, train two steps and measure the second's peak (``timing``
    "peak" or "both"); then, unless "peak", time ``TIMED_STEPS`` more. Rank 0 writes."""
    import torch
    import torch.distributed as dist

    from shardwise import hsdp_mesh

    from .setup import apply_policy, lm_loss, make_optimizer, token_batch

    cuda = device.type == "cuda"
    build = builder(run)

    def step(model: Any, opt: Any, data: Any) -> None:
        lm_loss(model, data).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    prof = None if cuda or timing == "time" else _cpu_profiler()
    if prof is not None:
        free_handles_here()
        prof.start()
    torch.manual_seed(0)
    with device:
        model = build()
    mesh = hsdp_mesh(run.hsdp) if run.hsdp > 1 else None  # None: fully_shard's default
    apply_policy(model, run.policy, mesh)
    opt = make_optimizer(model, device.type, run.policy.offload, run.optimizer)
    with device:
        data = token_batch(model, run.batch_size, run.seq_len)
    step(model, opt, data)  # the optimizer state, the recorded orders
    result: dict[str, Any] = {}
    if timing != "time":
        peaks = _peak_of_step(step, model, opt, data, prof)
        result["peak_bytes"] = [p for p, _ in peaks]
        result["frees_unrecorded"] = [n for _, n in peaks]  # CPU: seen by address
    if timing != "peak":
        result.update(_time_steps(step, model, opt, data, cuda))
    if dist.get_rank() == 0:
        result.update(
            device=torch.cuda.get_device_name() if cuda else "cpu",
            world_size=dist.get_world_size(),
            threads_per_rank=torch.get_num_threads(),
            optimizer=run.optimizer,
        )
        out.write_text(json.dumps(result))


def _gathered(obj: Any) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _peak_of_step(step: Any, model: Any, opt: Any, data: Any, prof: Any) -> list[Any]:
    """Every rank's peak over one step (the optimizer state exists), with the frees the
    CPU profiler did not see (``live_peak``; 0 on a GPU)."""
    import torch

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
    return _gathered((peak, unrecorded))


def _time_steps(step: Any, model: Any, opt: Any, data: Any, cuda: bool) -> dict[str, Any]:
    """The slowest rank's median step, every rank's, and each step as timed."""
    import torch
    import torch.distributed as dist

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
        first = max(_gathered(times[0]))
        count = max(TIMED_STEPS, math.ceil(CPU_TIMED_S / max(first, 1e-6)))
    times += [timed() for _ in range(count - 1)]
    medians = _gathered(statistics.median(times))
    return {
        **({"first_step_ms_slowest": 1e3 * first} if first is not None else {}),
        "step_ms": 1e3 * max(medians),
        "step_ms_per_rank": [1e3 * m for m in medians],
        "steps_ms": [1e3 * t for t in times],
    }


def free_handles_here() -> Callable[[], None]:
    """Have this thread, not gloo's, free what a collective's handle holds.

    The profiler records a free only on a thread it profiles. A gloo work keeps
    buffers of its own (the reduce-scatter's clone of its whole input), and
    gloo's worker thread drops its reference just after marking the work done:
    when the runtime's wait let go first, the buffer was freed there, unseen,
    and counted as live to the end. So the profiled launch keeps each handle
    past the wait for ``HANDLE_HOLD_S`` and then drops it here; nothing is
    allocated meanwhile, so the peak is the run's. Timing launches do not do
    this. Returns the remover of the observers it installs."""
    from shardwise import observe

    held: dict[int, Any] = {}

    def issued(_rec: Any, pending: Any) -> None:
        held[id(pending)] = pending.work

    def waited(pending: Any, done: bool) -> None:
        if done and id(pending) in held:
            time.sleep(HANDLE_HOLD_S)
            del held[id(pending)]

    removers = [observe.add_collective_observer(issued), observe.add_wait_observer(waited)]

    def remove() -> None:
        for r in removers:
            r()
        held.clear()

    return remove


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
    peak grows step by step, by one block's clone at a time. An address handed
    out again was freed before: its block is taken off there. Between the unseen
    free and that reuse it still counts, so the figure is an upper bound."""
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
