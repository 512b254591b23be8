"""The rates of this machine's device, measured once: what ``Hardware`` is filled with.

Why micro-benchmarks and not a fitted step: the planner's error is judged
against measured steps, so the rates must come from somewhere else. Each
figure is the best of a few repeats of one kind of work (a collective's
latency a median, on a CPU of rounds beside compute, below): a linear
layer's forward and backward (FLOP/s, in fp32 and bf16), a large element-wise add (bytes/s), a
tiny add (the fixed cost of one operator), a view, and an add on a DTensor
(its Python dispatch), torch's AdamW stepping host fp32 parameters (an
offloaded optimizer, on the host's threads whatever the device), on a GPU
the bytes cuBLAS keeps per thread that multiplies, and, in a
process group of several ranks, an all-gather over them as the runtime
issues it (latency and bus bandwidth inside one node). Across nodes is left
to the caller (it depends on the links).

Why a linear layer and not one square product: a training step's matrix
products come in threes (forward, input gradient, weight gradient) with
their operands in three different layouts, and a device without native bf16
(a CPU without AVX-512 BF16 or AMX) runs them at rates apart by up to 7x
(2026-12-02, this development machine: 0.7 to 5.6 GFLOP/s in bf16 by layout,
34 in fp32 whatever the layout). The three together are what a block pays.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from .policy import BLAS_THREADS, H200, THIS_CPU, Hardware
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
    """The middle of ``repeats`` timings: for a cost whose spread is the machine's
    (gloo's threads on shared cores), where the best is a round seldom repeated."""
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
# The compute a CPU rank runs between a gather's issue and its wait while calibrating
# the latency: a block's forward on the CPU rows of docs/scaling.md, a few ms. At 2
# and 5 ms the latency came out within 15% of each other; at 10 to 20 ms it fell by
# 30 to 60% (the gathers then finish inside the compute), 2026-12-04.
BUSY_S = 3e-3
# Pairs of rounds timed for it, after a few untimed: one pair's figure ranged from
# 0.3 to 1.3 ms a tensor at 2 ranks, and the median of 9 from 0.43 to 0.82 ms
# between calls; of 36, from 0.58 to 0.77 (2026-12-04).
BUSY_PAIRS = 36
BUSY_WARM = 3

# (tokens, in, out): a transformer MLP's up projection at sizes each device trains.
CPU_LINEAR = (512, 512, 2048)
CUDA_LINEAR = (8192, 2048, 8192)


def calibrate(device: str = "cpu", repeats: int = 5) -> Hardware:
    """This device's rates, as a ``Hardware`` based on the matching default."""
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
    base = H200 if cuda else THIS_CPU
    if cuda:
        host = torch.randn(1 << 24)
        rates["host_mem_bw"] = 3 * host.numel() * 4 / _best(lambda: host + host, repeats, sync)
        pinned = host.pin_memory()
        copy = _best(lambda: pinned.to(dev, non_blocking=True), repeats, sync)
        rates["h2d_bw"] = pinned.numel() * 4 / copy
    else:
        rates["host_mem_bw"] = mem
    from .. import collectives

    if collectives.initialized() and collectives.world_size() > 1:
        mesh = collectives.device_mesh(dev.type, (collectives.world_size(),))
        rates.update(_collective_rates(mesh, dev, repeats, sync))
        if not cuda:
            rates["dtensor_overhead"] = _dtensor_overhead(mesh, tiny, op, repeats, sync)
    return replace(
        base,
        matmul_flops=bf16,
        matmul_flops_fp32=fp32,
        mem_bw=mem,
        op_overhead=op,
        view_overhead=view,
        host_adamw_bw=host_adamw_bw(),
        source=f"calibrate({device!r}) on this machine, {torch.get_num_threads()} threads",
        **rates,
    )


def _collective_rates(
    mesh: Any, dev: torch.device, repeats: int, sync: Callable[[], None]
) -> dict[str, float]:
    """The world's all-gather as the runtime issues it: ``latency`` (a few bytes)
    and bus bandwidth, as the timeline charges them:
    ``latency + bytes per rank / bw``, bytes per rank (n-1)/n of the output. The
    world is one node here: ``intra_bw``.

    Both are taken as a step pays them: a module's parameters gathered together
    (``all_gather_each``), one tensor each. NCCL groups them into one launch, so
    that is one latency; gloo runs each as a collective of its own on its
    threads, all in flight at once, so ``PARTS`` of them cost about ``PARTS``
    latencies (2026-12-02, 2 gloo ranks: 12 small tensors took 7 to 9 ms, one
    took 0.3 to 0.8) and move their bytes faster than one flat gather (1.1 to 1.6
    GB/s against 0.3 to 0.8 at 2 and 4 ranks, 2026-12-04). On a CPU the latency is
    the one a step sees, with the ranks computing while the gathers are in flight
    (``_busy_latency``), not a bare loop's."""
    from .. import collectives

    group = mesh.get_group()
    n = collectives.world_size(group)
    cpu = dev.type == "cpu"

    def gather_each(shard: int) -> Callable[[], Any]:  # PARTS tensors, ``shard`` a rank
        inps = [torch.ones(shard, device=dev) for _ in range(PARTS)]
        outs = [torch.empty(shard * n, device=dev) for _ in range(PARTS)]
        return lambda: collectives.all_gather_each(outs, inps, group, "calibrate")

    each = gather_each(8)
    if cpu:
        latency = _busy_latency(each, BUSY_PAIRS)
    else:

        def several() -> None:  # sustained, as a step issues them: not one lucky round
            for _ in range(ROUNDS):
                each().wait()

        latency = _median(several, max(repeats, 9), sync) / ROUNDS
    # The bus from two sizes' difference, so that no latency is in it (subtracting
    # one from a single size put the 4-rank bus anywhere from 0.6 to 2.8 GB/s,
    # 2026-12-04): on a CPU 4 and 32 MiB of fp32 output in all, from about a
    # block's gather in the CPU rows up (to 16 MiB the difference, a few ms, was
    # no larger than the ranks' scheduling: BUS_PAIRS); on GPUs 256 MiB and 1 GiB,
    # where NVLink moves 16 MiB in tens of microseconds.
    sizes = (1 << 20, 1 << 23) if cpu else (1 << 26, 1 << 28)
    shards = [size // PARTS // n for size in sizes]
    moved = [PARTS * shard * n * 4 * (n - 1) / n for shard in shards]
    small, large = (_waited(gather_each(shard)) for shard in shards)
    if cpu:
        seconds = _paired_difference(small, large, _waited(each), BUS_PAIRS)
    else:
        seconds = _best(large, repeats, sync) - _best(small, repeats, sync)
    bw = (moved[1] - moved[0]) / max(seconds, 1e-9)
    return {"latency": latency, "intra_bw": bw}


def _waited(issue: Callable[[], Any]) -> Callable[[], None]:
    return lambda: issue().wait()


# Pairs of the two sizes a CPU's bus is taken from. The best of 5 of each size, as
# the GPU's is, drew the 4-rank bus from 0.61 to 1.98 GB/s in eight estimates at
# 4 and 16 MiB, and once 9.4e6 (a lucky round of the large size: a difference
# near nothing). The median of 15 pairs' differences is safe from one such round,
# but at 4 and 16 MiB five whole calibrations at 4 ranks still drew 1.12 to 7.25;
# at 4 and 32 MiB the pairs drew 0.82 to 1.05 at 4 ranks and 0.85 to 1.07 at 2
# (2026-12-04, docs/bench/gloo_bus_estimate_20261204.txt).
BUS_PAIRS = 15


def _paired_difference(
    small: Callable[[], None], large: Callable[[], None], together: Callable[[], None], pairs: int
) -> float:
    """The median over ``pairs`` of the large gather's time less the small one's, each
    pair timed a moment apart, the ranks brought ``together`` before each."""
    small()  # gloo's buffers and sockets at both sizes
    large()
    differences = []
    for _ in range(pairs):
        together()
        t0 = time.perf_counter()
        small()
        t1 = time.perf_counter()
        large()
        differences.append((time.perf_counter() - t1) - (t1 - t0))
    return statistics.median(differences)


def _busy_latency(each: Callable[[], Any], repeats: int) -> float:
    """gloo's latency per gathered tensor in a step: rounds of a module's gather
    issued, ``BUSY_S`` of compute, the wait; less the compute alone, per tensor.

    Why not the bare loop's: in a step every core is busy computing when gloo's
    threads need one, and a collective waits for its peers' threads to be
    scheduled. On the 2-core development machine a gathered tensor cost 0.53 to
    0.67 ms at 2 ranks against 0.41 to 0.48 bare, and the tiny GPT's real
    2-rank steps paid 0.6 to 1.0 ms a tensor beyond their compute (by the hour);
    at 4 ranks (two a core) the two were about the same, 2.3 to 2.7 ms
    (2026-12-04, docs/scaling.md)."""
    busy = _products(BUSY_S)

    def alone() -> None:
        for _ in range(ROUNDS):
            busy()

    def beside() -> None:
        for _ in range(ROUNDS):
            pending = each()
            busy()
            pending.wait()

    # In pairs, the compute alone then beside the gathers, so that each difference
    # is of two timings a moment apart; the median of the differences (BUSY_PAIRS).
    for _ in range(BUSY_WARM):  # gloo's threads and sockets, the products' caches
        beside()
    differences = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        alone()
        t1 = time.perf_counter()
        each().wait()  # the ranks together again before they are timed together
        t2 = time.perf_counter()
        beside()
        differences.append((time.perf_counter() - t2) - (t1 - t0))
    return max(statistics.median(differences), 0.0) / ROUNDS / PARTS


def _products(seconds: float) -> Callable[[], None]:
    """About ``seconds`` of small matrix products on this thread: a step's compute,
    which keeps the core busy where a sleep would leave it to gloo's threads."""
    a = torch.randn(128, 128)
    products = 50
    per = _best(lambda: [torch.mm(a, a) for _ in range(products)], 3, lambda: None) / products
    count = max(1, int(seconds / per))

    def busy() -> None:
        for _ in range(count):
            torch.mm(a, a)

    return busy


def _dtensor_overhead(
    mesh: Any, tiny: torch.Tensor, op: float, repeats: int, sync: Callable[[], None]
) -> float:
    """DTensor's Python dispatch on one operator, beyond the operator itself."""
    from torch.distributed.tensor import DTensor, Replicate

    d = DTensor.from_local(tiny, mesh, [Replicate()])
    return max(0.0, _best(lambda: [d.add_(1.0) for _ in range(200)], repeats, sync) / 200 - op)
