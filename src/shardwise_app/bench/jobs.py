"""One benchmark job: a (configuration, model, settings, round) in fresh processes.

Why a fresh process group per job: peak memory (CUDA max allocated, CPU peak
RSS) is only clean when nothing else lives in the process, and alternating
rounds (A B C A B C ...) spreads machine drift over every configuration
equally. Each job builds the same model from the same seed, trains
``warmup + steps`` timed steps on the same data, reports the median step, then
runs one more, untimed step whose memory is broken down (``memory.py``).
The ranks are ``python -m shardwise_app.bench.rank`` (rank.py), started and
watched by the one local launcher the application and the planner use too
(shardwise_plan/ranks.py).
"""

from __future__ import annotations

import functools
import os
import pickle
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..cli.common import LAUNCH_ID_ENV
from ..models.gpt import compile_blocks
from . import memory
from .models import ModelSpec, build, logits


@dataclass
class Job:
    config: str
    model: str  # the spec's name: a size or "hf:PATH"
    nproc: int
    ac: str
    mp: str
    batch_size: int
    seq_len: int
    steps: int
    warmup: int
    device: str
    compile: bool = False
    spec: ModelSpec | None = None  # resolved by the parent; None: a GPT size
    offload: bool = False  # CPU offload (FSDP2's and shardwise's CPUOffloadPolicy)
    float8: bool = False  # torchao float8 training of the blocks' linears, fp8 all-gather
    optimizer_in_backward: bool = False  # shardwise steps each module inside backward


def _spec(job: Job) -> ModelSpec:
    if job.spec is not None:
        return job.spec
    from .models import resolve

    return resolve(job.model, job.seq_len, job.device == "cuda")


def build_job(job: Job) -> tuple[torch.nn.Module, Any]:
    """The model under one configuration, and its AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchOffload
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from shardwise import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    device = torch.device(job.device)
    model, blocks = build(_spec(job), device, job.ac)
    if job.mp == "bf16-pure":  # no fp32 master weights anywhere: the floor for bf16
        model.to(torch.bfloat16)
    if job.float8:
        _to_float8(blocks, sharded=job.config != "bare")
    bf16 = job.mp == "bf16"
    # Explicit: on a GPU machine a CPU benchmark must not land on the default CUDA mesh.
    mesh = init_device_mesh(job.device, (job.nproc,))
    if job.config == "fsdp2":
        kw: dict[str, Any] = {"mesh": mesh}
        if bf16:
            kw["mp_policy"] = TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if job.offload:
            kw["offload_policy"] = TorchOffload()
        for block in blocks:
            torch_fully_shard(block, **kw)
        torch_fully_shard(model, **kw)
    elif job.config == "shardwise":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        kw = {"mesh": mesh, "mp_policy": policy if bf16 else None}
        if job.offload:
            kw["offload_policy"] = CPUOffloadPolicy()
        for block in blocks:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
    if job.compile:
        compile_blocks(blocks, device.type)
    # The fused AdamW on CUDA for every configuration: the fastest each can use
    # (offloaded, it steps on CPU, where torch has a fused AdamW too).
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda" or None)
    if job.optimizer_in_backward:
        from shardwise import optimizer_in_backward

        optimizer_in_backward(model, opt)
    return model, opt


def _to_float8(blocks: list[torch.nn.Module], sharded: bool) -> None:
    """torchao's float8 training for the blocks' linears (the head stays as it is, as
    torchtitan does), with weights that gather themselves in fp8 when sharded."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise RuntimeError("--float8 needs torchao (pip install torchao)") from e
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=sharded)

    def fits(m: torch.nn.Module, fqn: str) -> bool:  # fp8 matmuls want multiples of 16
        return not isinstance(m, torch.nn.Linear) or (
            m.in_features % 16 == 0 and m.out_features % 16 == 0
        )

    for block in blocks:
        convert_to_float8_training(block, config=config, module_filter_fn=fits)


def _traced_step(job: Job, step: Callable[[], None], opt: Any) -> dict[str, Any] | None:
    """shardwise's own timeline of one step (after the timed ones): how long compute
    waited for communication, and whether prefetches arrived in time."""
    if job.config != "shardwise":
        return None
    from shardwise import trace

    if job.device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with trace() as t:
        step()
        if job.device == "cuda":
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    opt.zero_grad(set_to_none=True)
    s = t.summary()
    return {
        "exposed_comm_s": s["exposed_comm_s"],
        "exposed_by_s": dict(list(s["exposed_by"].items())[:8]),  # the largest waits
        "traced_step_s": wall,
        "prefetch_hit_rate": s["prefetch_hit_rate"],
    }


def job_rank(job: Job, q: Any) -> None:
    """One rank of ``job`` (``python -m shardwise_app.bench.rank``, started by ``run_job``):
    rank 0 puts ``("ok", result)`` into ``q``, a rank that fails ``("error", why)``."""
    import torch.distributed as dist
    import torch.nn.functional as F

    try:
        rank = int(os.environ["RANK"])
        cuda = job.device == "cuda"
        if cuda:
            torch.cuda.set_device(rank)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // job.nproc))
        backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
        dist.init_process_group(backend)  # torchrun's environment, from the local launcher
        # Resident now, before the model: Python, torch, the process group. Not
        # the high-water mark, which includes what imports held for a moment.
        baseline_rss = memory.rss_bytes() or memory.peak_rss_bytes()
        spec = _spec(job)
        model, opt = build_job(job)
        device = torch.device(job.device, rank) if cuda else torch.device("cpu")
        g = torch.Generator().manual_seed(1 + rank)
        vocab = spec.vocab_size
        autocast = torch.autocast(
            job.device, dtype=torch.bfloat16, enabled=job.config == "bare" and job.mp == "bf16"
        )
        state = {"opt": opt}

        def batch() -> torch.Tensor:
            idx = torch.randint(0, vocab, (job.batch_size, job.seq_len + 1), generator=g)
            return idx.to(job.device)

        def step(
            i: int, idx: torch.Tensor, mark: Callable[[str], None] = lambda phase: None
        ) -> torch.Tensor:
            with autocast:
                out = logits(model, spec, idx[:, :-1])
            loss = F.cross_entropy(out.float().reshape(-1, vocab), idx[:, 1:].reshape(-1))
            mark("forward")
            loss.backward()
            mark("backward")
            try:
                state["opt"].step()
            except RuntimeError:
                if i or not state["opt"].defaults.get("fused"):
                    raise
                # fused AdamW refused these parameters (DTensor on an older torch)
                state["opt"] = torch.optim.AdamW(model.parameters(), lr=1e-4)
                state["opt"].step()
            mark("step")
            return loss.detach()

        # What shardwise's all-gathers move per step (the timeline's bytes).
        from shardwise.observe import add_collective_observer

        gathered_bytes = [0]

        def count(rec: Any, _: Any) -> None:
            if rec.kind == "all_gather":
                gathered_bytes[0] += rec.nbytes

        remove = add_collective_observer(count)
        times = []
        for i in range(job.warmup + job.steps):
            idx = batch()
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = step(i, idx)
            state["opt"].zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            if i >= job.warmup:
                times.append(time.perf_counter() - t0)
            if i == 0:
                step_gather_bytes = gathered_bytes[0]
        remove()
        graphs = 0
        if job.compile:  # one graph for same-shaped blocks; more means recompiles
            from torch._dynamo.utils import counters

            graphs = int(counters["stats"]["unique_graphs"])
        peak = torch.cuda.max_memory_allocated() if cuda else memory.peak_rss_bytes()
        reserved = torch.cuda.max_memory_reserved() if cuda else 0

        def held() -> dict[str, dict[int, int]]:
            return memory.held_tensors(model, state["opt"], device)

        def memory_step(mark: Callable[[str], None]) -> None:
            step(job.warmup + job.steps, batch(), mark)

        if cuda:
            breakdown = memory.cuda_memory_step(memory_step, device, held)
        else:
            breakdown = memory.cpu_memory_step(memory_step, baseline_rss, held)
        state["opt"].zero_grad(set_to_none=True)
        breakdown["rank"] = rank
        timeline = _traced_step(job, lambda: memory_step(lambda phase: None), state["opt"])
        stats = torch.tensor([statistics.median(times), float(peak), reserved], dtype=torch.float64)
        gathered = [torch.zeros_like(stats) for _ in range(job.nproc)]
        dist.all_gather(gathered, stats)  # gloo on CPU tensors: fine for both backends
        breakdowns: list[Any] = [None] * job.nproc
        dist.all_gather_object(breakdowns, breakdown)
        timelines: list[Any] = [None] * job.nproc
        dist.all_gather_object(timelines, timeline)
        n_params = sum(p.numel() for p in model.parameters())
        if rank == 0:
            q.put(
                (
                    "ok",
                    {
                        "fused_adamw": bool(state["opt"].defaults.get("fused")),
                        "step_s": max(float(t[0]) for t in gathered),
                        "peak_bytes": max(float(t[1]) for t in gathered),
                        "peak_reserved_bytes": max(float(t[2]) for t in gathered),
                        "params": n_params,
                        "loss": float(loss),  # the last timed step's, rank 0
                        "dynamo_graphs": graphs,
                        "gather_bytes_per_step": step_gather_bytes,  # 0 unless shardwise
                        # The rank whose breakdown step peaked highest: the one that limits.
                        "memory": max(breakdowns, key=lambda b: b["peak_bytes"]),
                        # shardwise's timeline of one more step: the rank that waited longest.
                        "timeline": max(timelines, key=lambda t: t["exposed_comm_s"])
                        if timeline is not None
                        else None,
                    },
                )
            )
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - the parent prints it
        import traceback

        q.put(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_job(job: Job, timeout: float = 900) -> dict[str, Any]:
    """``job`` in ``job.nproc`` fresh ranks; its result, or a RuntimeError naming why not."""
    status, payload = _launch(("job", job), job.nproc, timeout)
    if status != "ok":
        raise RuntimeError(f"{job.config} failed: {payload}")
    return payload  # type: ignore[no-any-return]


def _launch(task: tuple[Any, ...], nproc: int, timeout: float) -> tuple[str, Any]:
    """``task`` run by ``nproc`` ranks of ``python -m shardwise_app.bench.rank`` through the
    one local launcher (shardwise_plan/ranks.py); the first result a rank delivers.

    A worker killed outright (the kernel's OOM killer) delivers nothing: its exit
    ends the wait at once, so a sweep does not wait out the whole timeout.
    """
    from shardwise_plan.ranks import LocalRanks

    with tempfile.TemporaryDirectory(prefix="shardwise-bench-") as tmp:
        task_file, result = Path(tmp) / "task.pkl", Path(tmp) / "result.pkl"
        task_file.write_bytes(pickle.dumps(task))
        env = {k: v for k, v in os.environ.items() if k != LAUNCH_ID_ENV}
        ranks = LocalRanks(
            "shardwise_app.bench.rank", [str(task_file), str(result)], nproc, env=env
        )
        deadline = time.monotonic() + timeout
        try:
            while not result.exists():
                codes = ranks.poll()
                dead = [c for c in codes.values() if c not in (None, 0)]
                if dead:
                    return "error", f"a worker exited with code {dead[0]} without a result"
                if all(c is not None for c in codes.values()):
                    return "error", "every worker exited without a result"
                if time.monotonic() > deadline:
                    return "error", f"no result after {timeout:.0f} s"
                time.sleep(0.05)
            return pickle.loads(result.read_bytes())  # type: ignore[no-any-return]
        finally:
            # The result delivered, the ranks end on their own within seconds.
            end_by = time.monotonic() + 30
            while ranks.running() and time.monotonic() < end_by:
                time.sleep(0.05)
            ranks.kill(ranks.running())


def overhead_rank(n_modules: int, steps: int, q: Any) -> None:
    """Hook cost per module: many tiny linears, one rank, configurations alternated per step."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from shardwise import fully_shard

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo")  # one rank, from the local launcher
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (1,))
        checked = functools.partial(fully_shard, check=True)
        models = {}
        for name, shard in (
            ("bare", None),
            ("fsdp2", torch_fully_shard),
            ("shardwise", fully_shard),
            ("shardwise_check", checked),  # lifecycle checks on: what "off" saves
        ):
            torch.manual_seed(0)
            m = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(n_modules)))
            if shard is not None:
                for layer in m:
                    shard(layer, mesh=mesh)
                shard(m, mesh=mesh)
            models[name] = m
        x = torch.randn(2, 4, requires_grad=True)
        times: dict[str, list[float]] = {k: [] for k in models}
        for step in range(steps + 5):
            for name, m in models.items():
                t0 = time.perf_counter()
                m(x).sum().backward()
                m.zero_grad(set_to_none=True)
                if step >= 5:
                    times[name].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        q.put(("ok", {k: (med[k] - med["bare"]) / n_modules * 1e6 for k in models if k != "bare"}))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001
        q.put(("error", repr(e)))


def hook_overhead_us(n_modules: int = 64, steps: int = 60) -> dict[str, float]:
    """Microseconds per module per forward+backward added over the bare model (CPU, 1 rank)."""
    status, payload = _launch(("overhead", n_modules, steps), 1, 600)
    if status != "ok":
        raise RuntimeError(payload)
    return payload  # type: ignore[no-any-return]
