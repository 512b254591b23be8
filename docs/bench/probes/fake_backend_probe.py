"""What torch's fake backend costs on the host, apart from any runtime: one module's gathers.

Why: under the fake process group (host_scaling_probe.py's "fake" mode)
shardwise's time inside the collectives grows with the world size, and so does
its host time outside them. This separates the backend's part, on the
parameters of one of that probe's blocks ((1024, 16), (1024,), (1024,),
(1024, 16), fp32, dim 0 split over the ranks), with no runtime at all:

1. The gathers, three ways: one all-gather per parameter (what shardwise issues
   on the CPU, for gloo), the same grouped in ``_coalescing_manager`` (what it
   issues on CUDA, for NCCL), and one gather of a flat buffer of them all (what
   FSDP2 issues). Thread time per module, and the ``aten::copy_`` calls the
   backend makes (torch.profiler): in torch 2.13 it splits each output into one
   chunk per rank and copies into each, in C++, coalesced or not.
2. The work after: a fixed small forward and backward (a Linear of the block),
   timed after 0, 1 or 4 gathers, with and without a read of a 16 MiB buffer
   first (which leaves nothing of the work's data in this machine's caches).
   Interleaved in one process per world size, median of ``--reps``.

Usage: python docs/bench/probes/fake_backend_probe.py [--worlds 2,1024] [--reps 200]
(each world size in a process of its own: one process group per process)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

SHAPES = [(1024, 16), (1024,), (1024,), (1024, 16)]


def one(world: int, reps: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _coalescing_manager
    from torch.profiler import profile
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    outs = [torch.empty(s) for s in SHAPES]
    ins = [torch.randn_like(o.chunk(world)[0]) for o in outs]
    flat_out = torch.empty(sum(o.numel() for o in outs))
    flat_in = torch.randn(flat_out.numel() // world)

    def separate(k: int = len(outs)) -> None:
        works = [dist.all_gather_single(o, i, async_op=True) for o, i in zip(outs[:k], ins[:k])]
        for w in works:
            w.wait()

    def coalesced() -> None:
        with _coalescing_manager(async_ops=True) as cm:
            for o, i in zip(outs, ins):
                dist.all_gather_single(o, i)
        cm.wait()

    def flat() -> None:
        dist.all_gather_single(flat_out, flat_in, async_op=True).wait()

    result: dict = {"world": world, "gather": {}, "after": {}}
    for name, fn in (("separate", separate), ("coalesced", coalesced), ("flat", flat)):
        for _ in range(5):
            fn()
        ts = []
        for _ in range(max(10, reps // 4)):
            start = time.thread_time()
            fn()
            ts.append(time.thread_time() - start)
        with profile() as prof:
            fn()
        copies = sum(e.count for e in prof.key_averages() if e.key == "aten::copy_")
        result["gather"][name] = {"us": statistics.median(ts) * 1e6, "copies": copies}

    big = torch.randn(4 * 1024 * 1024)
    lin = torch.nn.Linear(16, 1024)
    x = torch.randn(4, 16)

    def work() -> None:
        (torch.relu(lin(x)) @ outs[0]).sum().backward()

    for _ in range(20):
        work()
    configs = [(g, f) for g in (0, 1, 4) for f in (False, True)]
    times: dict = {c: [] for c in configs}
    for _ in range(reps):
        for g, f in configs:
            separate(g)
            if f:
                big.sum()
            start = time.thread_time()
            work()
            times[(g, f)].append(time.thread_time() - start)
    for (g, f), ts in times.items():
        result["after"][f"{g} gather{'s' * (g != 1)}{', caches flushed' if f else ''}"] = (
            statistics.median(ts) * 1e6
        )
    dist.destroy_process_group()
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", default="2,1024")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--one", type=int)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.reps)))
        return
    rows = []
    for w in (int(w) for w in args.worlds.split(",")):
        cmd = [sys.executable, __file__, "--one", str(w), "--reps", str(args.reps)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print("One block's 4 parameters gathered (thread time, us per module; aten::copy_ calls):\n")
    print("| world | per parameter (CPU path) | coalesced (CUDA path) | one flat buffer (FSDP2) |")
    print("|---|---|---|---|")
    for r in rows:
        g = r["gather"]
        cells = " | ".join(
            f"{g[k]['us']:.0f} us, {g[k]['copies']} copies"
            for k in ("separate", "coalesced", "flat")
        )
        print(f"| {r['world']} | {cells} |")
    keys = list(rows[0]["after"])
    print("\nThe same work after the gathers (thread time, us, median):\n")
    print("| world | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for r in rows:
        print(f"| {r['world']} | " + " | ".join(f"{r['after'][k]:.0f}" for k in keys) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
