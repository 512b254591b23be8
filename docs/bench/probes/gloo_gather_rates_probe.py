"""gloo's gather as the runtime issues it, against the loops calibrate used to time.

Why: the CPU rows' step time is compute plus gloo's latency per gathered
tensor and bytes over its bus. This times, on WORLD real gloo ranks of one
thread: the latency a tensor of a module's 8-tensor gather costs back to back
(the bare loop), and beside compute (rounds of the gather issued, a chunk of
2 to 20 ms of products, the wait; less the chunk alone, per tensor); the bus
of the runtime's per-tensor gathers (16 MiB of output in 8 tensors) and of
one flat gather of the same bytes (each less the bare latency); and the
reduce-scatter's latency and bus (one flat tensor, as the runtime reduces a
module). Medians of 9 (5 for the bytes), rank 0 prints.

Run: PYTHONPATH=src python docs/bench/probes/gloo_gather_rates_probe.py WORLD
"""

import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PARTS = 8
ROUNDS = 20


def work(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from shardwise import collectives

    g = dist.group.WORLD

    def med(fn: Callable[[], object], rep: int = 9) -> float:
        fn()
        ts = []
        for _ in range(rep):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    a, b = torch.randn(128, 128), torch.randn(128, 128)

    def mm(n: int) -> None:
        for _ in range(n):
            torch.mm(a, b)

    per = med(lambda: mm(200)) / 200
    res = []
    inps = [torch.ones(8) for _ in range(PARTS)]
    outs = [torch.empty(8 * world) for _ in range(PARTS)]

    def each() -> collectives.Pending:
        return collectives.all_gather_each(outs, inps, g, "probe")

    bare = med(lambda: [each().wait() for _ in range(ROUNDS)]) / ROUNDS / PARTS
    res.append(f"bare latency {bare * 1e6:.0f} us")
    for ms in (2, 5, 10, 20):
        n = int(ms * 1e-3 / per)
        chunk = med(lambda n=n: [mm(n) for _ in range(ROUNDS)])

        def beside(n: int = n) -> None:
            for _ in range(ROUNDS):
                h = each()
                mm(n)
                h.wait()

        t = med(beside)
        res.append(f"chunk {ms}ms: loaded latency {(t - chunk) / ROUNDS / PARTS * 1e6:.0f} us")
    numel = 1 << 22
    moved = numel * 4 * (world - 1) / world
    big_in = [torch.ones(numel // world // PARTS) for _ in range(PARTS)]
    big_out = [torch.empty(numel // PARTS) for _ in range(PARTS)]
    t = med(lambda: collectives.all_gather_each(big_out, big_in, g, "probe").wait(), 5)
    res.append(
        f"AG each bw {moved / max(t - PARTS * bare, 1e-9) / 1e9:.2f} GB/s (t {t * 1e3:.1f} ms)"
    )
    flat_in, flat_out = torch.ones(numel // world), torch.empty(numel)
    t = med(lambda: collectives.all_gather(flat_out, flat_in, g, "probe").wait(), 5)
    res.append(f"AG flat bw {moved / max(t - bare, 1e-9) / 1e9:.2f} GB/s (t {t * 1e3:.1f} ms)")
    small_in, small_out = torch.ones(8 * world), torch.empty(8)

    def rs_small() -> None:
        for _ in range(ROUNDS):
            collectives.reduce_scatter(small_out, small_in, g, "probe", divide_by=world).wait()

    rsl = med(rs_small) / ROUNDS
    rs_in, rs_out = torch.ones(numel), torch.empty(numel // world)
    t = med(
        lambda: collectives.reduce_scatter(rs_out, rs_in, g, "probe", divide_by=world).wait(), 5
    )
    res.append(
        f"RS latency {rsl * 1e6:.0f} us, bw {moved / max(t - rsl, 1e-9) / 1e9:.2f} GB/s (t {t * 1e3:.1f} ms)"
    )
    if rank == 0:
        print(f"world {world}: " + "; ".join(res), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    w = int(sys.argv[1])
    mp.spawn(work, (w, 29651 + w), nprocs=w)
