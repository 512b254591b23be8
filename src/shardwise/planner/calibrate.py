"""The rates of this machine's device, measured once: what ``Hardware`` is filled with.

Why micro-benchmarks and not a fitted step: the planner's error is judged
against measured steps, so the rates must come from somewhere else. Each
figure is the best of a few repeats of one kind of work: a large matrix
product (FLOP/s, in fp32 and bf16), a large element-wise add (bytes/s), a
tiny add (the fixed cost of one operator), a view, and an add on a DTensor
(its Python dispatch; needs a process group, skipped without one), and torch's
AdamW stepping host fp32 parameters (an offloaded optimizer, on the host's
threads whatever the device).
Communication bandwidth is left to the caller (it depends on the links).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import torch

from .policy import H200, THIS_CPU, Hardware
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


def host_adamw_bw(numel: int = 1 << 22, tensors: int = 8, repeats: int = 3) -> float:
    """Bytes/s (``ADAMW_BYTES_PER_PARAM`` a parameter) of the for-loop AdamW on host
    fp32 parameters, as an offloaded optimizer steps them."""
    params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn(numel)
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=False)
    seconds = _best(opt.step, repeats, lambda: None)
    return ADAMW_BYTES_PER_PARAM * numel * tensors / seconds


def calibrate(device: str = "cpu", size: int = 1024, repeats: int = 5) -> Hardware:
    """This device's rates, as a ``Hardware`` based on the matching default."""
    dev = torch.device(device)
    cuda = dev.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    a = torch.randn(size, size, device=dev)
    b = torch.randn(size, size, device=dev)
    fp32 = 2 * size**3 / _best(lambda: a @ b, repeats, sync)
    ah, bh = a.bfloat16(), b.bfloat16()
    bf16 = 2 * size**3 / _best(lambda: ah @ bh, repeats, sync)
    big = torch.randn(1 << 24, device=dev)
    mem = 3 * big.numel() * 4 / _best(lambda: big + big, repeats, sync)
    tiny = torch.randn(8, device=dev)
    n = 2000
    op = _best(lambda: [tiny + tiny for _ in range(n)], repeats, sync) / n
    view = _best(lambda: [tiny.view(2, 4) for _ in range(n)], repeats, sync) / n
    base = H200 if cuda else THIS_CPU
    dt = base.dtensor_overhead
    from .. import collectives

    if collectives.initialized() and not cuda:
        from torch.distributed.tensor import DTensor, Replicate

        mesh = collectives.device_mesh(dev.type, (collectives.world_size(),))
        d = DTensor.from_local(tiny, mesh, [Replicate()])
        dt = max(0.0, _best(lambda: [d.add_(1.0) for _ in range(200)], repeats, sync) / 200 - op)
    return replace(
        base,
        matmul_flops=bf16 if cuda else fp32,
        matmul_flops_fp32=fp32,
        mem_bw=mem,
        op_overhead=op,
        view_overhead=view,
        dtensor_overhead=dt,
        host_adamw_bw=host_adamw_bw(),
        source=f"calibrate({device!r}) on this machine, {torch.get_num_threads()} threads",
    )
