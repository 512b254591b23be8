"""gloo's latency per gathered tensor, back to back and with compute between rounds.

Why: the planner calibrates gloo's latency as a tight loop of gathers
(``calibrate._collective_rates``: rounds of ``PARTS`` small tensors), while a
step issues its gathers between modules' compute. On 2026-12-04 the tiny GPT's
2-rank rows came out 5 to 11% under their measured steps with that latency, and
the small GPT's within 5% either side. This asks whether a gather costs more
when the ranks computed before it.

Per setting: the same ``ROUNDS`` of compute (``k`` 256x256 products on one
thread) timed alone and with ``PARTS`` 8-element gathers in flight after each;
the difference per tensor is the latency, median of 9.

Run: python docs/bench/probes/gloo_idle_latency_probe.py [WORLD] (rank 0 prints).
"""

import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PARTS, ROUNDS = 8, 20


def work(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    inps = [torch.ones(8) for _ in range(PARTS)]
    outs = [torch.empty(8 * world) for _ in range(PARTS)]
    a = torch.randn(256, 256)

    def gather() -> None:
        ws = [dist.all_gather_into_tensor(o, i, async_op=True) for o, i in zip(outs, inps)]
        for w in ws:
            w.wait()

    def compute(k: int) -> None:
        for _ in range(k):
            a @ a

    def median_time(body: Callable[[], None], repeats: int) -> float:
        t = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(ROUNDS):
                body()
            t.append(time.perf_counter() - t0)
        return statistics.median(t)

    res = {}
    for k in (0, 1, 4, 16):
        alone = median_time(lambda k=k: compute(k), 5)
        both = median_time(lambda k=k: (compute(k), gather()), 9)
        res[k] = ((both - alone) / ROUNDS / PARTS * 1e6, alone / ROUNDS * 1e3)
    if rank == 0:
        for lat, c in res.values():
            print(f"compute {c:.2f} ms between rounds: latency {lat:.0f} us/tensor", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    mp.spawn(work, (world, 29511), nprocs=world)
