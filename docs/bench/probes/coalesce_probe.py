"""Flat all-gather + copy-out vs coalesced per-parameter all-gather, GPT block shapes."""
import json, os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
from torch.distributed.distributed_c10d import _coalescing_manager

def shapes(d):
    return [(d,), (d,), (3 * d, d), (d, d), (d,), (d,), (4 * d, d), (d, 4 * d)]

def timeit(fn, iters=30):
    for _ in range(5): fn()
    torch.cuda.synchronize(); s = torch.cuda.Event(True); e = torch.cuda.Event(True)
    s.record()
    for _ in range(iters): fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / iters

def run(rank, out_path):
    os.environ["MASTER_ADDR"] = "127.0.0.1"; os.environ["MASTER_PORT"] = "29533"
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", rank))
    W = 2; res = {}
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    for d in (2048, 4096):
        sh = shapes(d)
        numels = [torch.Size(s).numel() for s in sh]
        slots = [(n + W - 1) // W for n in numels]
        n = sum(slots)
        flat = torch.randn(n, device="cuda")  # fp32 shard
        out = torch.empty(W * n, dtype=torch.bfloat16, device="cuda")
        unsh = torch.empty(W * n, dtype=torch.bfloat16, device="cuda")
        # views
        out2 = out.view(W, n)
        copy_out = []; st = 0
        for s in slots:
            copy_out.append(unsh[st:st + W * s].view(W, s)); st += W * s
        def flat_gather(copy=True):
            out2[rank].copy_(flat)
            ag(out, out2[rank])
            if copy:
                torch.split_with_sizes_copy(out2, slots, dim=1, out=copy_out)
        regions = []; st = 0
        for s in slots:
            regions.append(unsh[st:st + W * s]); st += W * s
        my = [r.view(W, -1)[rank] for r in regions]
        srcs = list(flat.split(slots))
        def coalesced():
            torch._foreach_copy_(my, srcs)
            with _coalescing_manager(dist.group.WORLD, async_ops=False):
                for r, m in zip(regions, my):
                    ag(r, m)
        def copy_only():
            torch.split_with_sizes_copy(out2, slots, dim=1, out=copy_out)
        # correctness
        coalesced(); a = unsh.clone(); flat_gather(); torch.cuda.synchronize()
        ok = torch.equal(a, unsh)
        r = {"ok": ok, "flat_ms": timeit(flat_gather), "flat_nocopy_ms": timeit(lambda: flat_gather(False)),
             "coalesced_ms": timeit(coalesced), "copy_out_ms": timeit(copy_only),
             "numel": W * n}
        res[d] = r
        if rank == 0: print(d, r, flush=True)
    if rank == 0:
        json.dump(res, open(out_path, "w"), indent=1)
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1],), nprocs=2)
