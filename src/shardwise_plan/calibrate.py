"""The rates of this machine's device, measured once: what ``Hardware`` is filled with.

Why micro-benchmarks and not a fitted step: the planner's error is judged
against measured steps, so the rates must come from somewhere else. Each
figure is the best of a few repeats of one kind of work: a linear layer's
forward and backward (FLOP/s, in fp32 and bf16), a large element-wise add
(bytes/s), a tiny add (the fixed cost of one operator), a view, torch's
AdamW stepping host fp32 parameters (an offloaded optimizer, on the host's
threads whatever the device), on a GPU the bytes cuBLAS keeps per thread
that multiplies and the host's pinned copies, and, with several GPUs in the
process group, an all-gather over them (latency and bus bandwidth inside
one node). Across nodes is left to the caller (it depends on the links).

On a CPU only compute is measured: gloo's latency and bus on a shared
machine move with its load from one minute to the next, and a CPU plan is
for its memory; its step time is indicative (hardware.CPU's collective
figures are kept).

Why a linear layer and not one square product: a training step's matrix
products come in threes (forward, input gradient, weight gradient) with
their operands in three different layouts, and a device without native bf16
(a CPU without AVX-512 BF16 or AMX) runs them at rates far apart by layout.
The three together are what a block pays.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager

from .hardware import BLAS_THREADS, CPU, H200, Hardware
from .timeline import ADAMW_BYTES_PER_PARAM


def _best(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _median(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    """The middle of ``repeats`` timings: for a cost a step pays again and again (a
    collective's latency), where the best is a round seldom repeated."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def host_adamw_bw(numel: int = 1 << 22, tensors: int = 8, repeats: int = 3) -> float:
    """Bytes/s (``ADAMW_BYTES_PER_PARAM`` a parameter) of the for-loop AdamW on host
    fp32 parameters, as an offloaded optimizer steps them."""
    params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn(numel)
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=False)
    seconds = _best(opt.step, repeats, lambda: None)
    return ADAMW_BYTES_PER_PARAM * numel * tensors / seconds


def linear_flops(
    dtype: torch.dtype, device: torch.device, shape: tuple[int, int, int], repeats: int = 5
) -> float:
    """FLOP/s of one linear layer's forward and backward, ``shape`` = (tokens, in, out)."""
    tokens, d_in, d_out = shape
    x = torch.randn(tokens, d_in, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(d_out, d_in, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(tokens, d_out, device=device, dtype=dtype)

    def fwd_bwd() -> object:
        # autograd.grad, not backward: no accumulation into .grad (an add the step
        # would not pay per product)
        return torch.autograd.grad(torch.nn.functional.linear(x, w), (x, w), dy)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return 3 * 2 * tokens * d_in * d_out / _best(fwd_bwd, repeats, sync)


def blas_workspace(device: torch.device) -> int | None:
    """Bytes cuBLAS keeps per thread that multiplies: what a first product's forward
    (this thread) and backward (autograd's thread) leave allocated, over
    ``BLAS_THREADS``. None if this process has multiplied before (its allocated bytes
    do not grow then); the calibration keeps the default's figure."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    a = torch.randn(64, 64, device=device, requires_grad=True)
    (a @ a).sum().backward()
    del a
    torch.cuda.synchronize(device)
    grown = torch.cuda.memory_allocated(device) - before
    return grown // BLAS_THREADS if grown > 0 else None


PARTS = 8  # a block's parameters, about: what one gather of a module holds
ROUNDS = 20

# (tokens, in, out): a transformer MLP's up projection at sizes each device trains.
CPU_LINEAR = (512, 512, 2048)
CUDA_LINEAR = (8192, 2048, 8192)


def calibrate(device: str = "cpu", repeats: int = 5) -> Hardware:
    """This device's rates, as a ``Hardware`` based on the matching preset (H200 on a
    GPU, CPU on a CPU); the collectives' too where a process group of several GPUs is
    initialized."""
    dev = torch.device(device)
    cuda = dev.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    rates: dict[str, Any] = {}
    if cuda:  # first: a product made before would hide it
        workspace = blas_workspace(dev)
        if workspace is not None:
            rates["blas_workspace"] = workspace
    shape = CUDA_LINEAR if cuda else CPU_LINEAR
    fp32 = linear_flops(torch.float32, dev, shape, repeats)
    bf16 = linear_flops(torch.bfloat16, dev, shape, repeats)
    big = torch.randn(1 << 24, device=dev)
    mem = 3 * big.numel() * 4 / _best(lambda: big + big, repeats, sync)
    tiny = torch.randn(8, device=dev)
    n = 2000
    op = _best(lambda: [tiny + tiny for _ in range(n)], repeats, sync) / n
    view = _best(lambda: [tiny.view(2, 4) for _ in range(n)], repeats, sync) / n
    base = H200 if cuda else CPU
    if cuda:
        host = torch.randn(1 << 24)
        rates["host_mem_bw"] = 3 * host.numel() * 4 / _best(lambda: host + host, repeats, sync)
        pinned = host.pin_memory()
        copy = _best(lambda: pinned.to(dev, non_blocking=True), repeats, sync)
        rates["h2d_bw"] = pinned.numel() * 4 / copy
        if dist.is_initialized() and dist.get_world_size() > 1:
            rates.update(_collective_rates(dev, repeats, sync))
    else:
        rates["host_mem_bw"] = mem
    what = "compute and collectives" if "latency" in rates else "compute"
    return replace(
        base,
        name=f"calibrated {dev.type}",
        matmul_flops=bf16,
        matmul_flops_fp32=fp32,
        mem_bw=mem,
        op_overhead=op,
        view_overhead=view,
        host_adamw_bw=host_adamw_bw(),
        source=f"shardwise calibrate on this machine ({what}; the rest {base.name}'s), "
        f"{torch.get_num_threads()} threads",
        **rates,
    )


def _collective_rates(
    dev: torch.device, repeats: int, sync: Callable[[], None]
) -> dict[str, float]:
    """The world's all-gather of a module's parameters (``PARTS`` tensors, one NCCL
    launch as the runtime groups them): ``latency`` (a few bytes each, sustained
    over ``ROUNDS``) and bus bandwidth, as the timeline charges them,
    ``latency + bytes per rank / bw``, bytes per rank (n-1)/n of the output. The
    world is one node here: ``intra_bw``. The bus is the difference of two sizes
    (256 MiB and 1 GiB of output), so that no latency is in it."""
    n = dist.get_world_size()

    def gather(shard: int) -> Callable[[], None]:
        inps = [torch.ones(shard, device=dev) for _ in range(PARTS)]
        outs = [torch.empty(shard * n, device=dev) for _ in range(PARTS)]

        def run() -> None:
            with _coalescing_manager(None, async_ops=True) as work:
                for o, i in zip(outs, inps):
                    dist.all_gather_into_tensor(o, i)
            work.wait()

        return run

    small = gather(8)

    def several() -> None:  # sustained, as a step issues them: not one lucky round
        for _ in range(ROUNDS):
            small()

    latency = _median(several, max(repeats, 9), sync) / ROUNDS
    sizes = (1 << 26, 1 << 28)
    shards = [size // PARTS // n for size in sizes]
    moved = [PARTS * shard * n * 4 * (n - 1) / n for shard in shards]
    lo, hi = (gather(shard) for shard in shards)
    seconds = _best(hi, repeats, sync) - _best(lo, repeats, sync)
    bw = (moved[1] - moved[0]) / max(seconds, 1e-9)
    return {"latency": latency, "intra_bw": bw}
