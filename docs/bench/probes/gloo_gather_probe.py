"""gloo, 2 ranks: one flat gather + copy-out, grouped gathers, and separate gathers
(sequential, or all in flight), over the shapes of a 1024-wide Llama layer.

Run: python docs/bench/probes/gloo_gather_probe.py (prints ms per gather, rank 0).
"""

import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.distributed_c10d import _coalescing_manager


def run(rank: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = "29541"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    world, d, h = 2, 1024, 2816
    shapes = [(d,), (d, d), (d // 4, d), (d // 4, d), (d, d), (d,), (h, d), (h, d), (d, h)]
    slots = [torch.Size(s).numel() // world for s in shapes]
    n = sum(slots)
    flat, out, unsharded = torch.randn(n), torch.empty(world * n), torch.empty(world * n)
    regions, start = [], 0
    for s in slots:
        regions.append(unsharded[start : start + world * s])
        start += world * s
    copy_out = [r.view(world, -1) for r in regions]
    shards = list(flat.split(slots))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def flat_and_copy_out() -> None:
        gather(out, flat)
        torch.split_with_sizes_copy(out.view(world, n), slots, dim=1, out=copy_out)

    def grouped() -> None:
        with _coalescing_manager(dist.group.WORLD, async_ops=True) as cm:
            for r, s in zip(regions, shards):
                gather(r, s)
        cm.wait()

    def separate() -> None:
        for r, s in zip(regions, shards):
            gather(r, s)

    def separate_in_flight() -> None:
        works = [gather(r, s, async_op=True) for r, s in zip(regions, shards)]
        for w in works:
            w.wait()

    for fn in (flat_and_copy_out, grouped, separate, separate_in_flight) * 2:
        for _ in range(2):
            fn()
        t = time.perf_counter()
        for _ in range(10):
            fn()
        if rank == 0:
            print(f"{fn.__name__}: {(time.perf_counter() - t) / 10 * 1e3:.1f} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, nprocs=2)
