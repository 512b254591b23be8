"""How much does the calibration's gloo bus bandwidth move from one estimate to the next,
and does timing the two sizes in pairs (each difference of two timings a moment apart,
the median of them) move less than the best of a few of each size?

Why: the CPU suite's calibrated bus at 4 ranks on the 2-core machine ranged from 0.65
to 2.13 GB/s over eight invocations of 2026-12-04 (the median of three calibrations
each), and the small GPT at 4 ranks moves about 100 MB a rank a step: 0.84 against
1.65 GB/s is 56 ms of a 1 s step.

Each estimate: ``PARTS`` tensors gathered as the runtime does (all_gather_each) at
two sizes of fp32 output in all (4 and 16 MiB, the calibration's at first; 4 and
32, its now; 16 and 64); "best": the best of 5 at each size, then the difference
(the calibration's way before the pairs, and a GPU's); "paired":
``calibrate._paired_difference``, the median of 15 pairs' differences (the small
size, then the large, the ranks brought together by a tiny gather before each).

Run: PYTHONPATH=src .venv/bin/python docs/bench/probes/gloo_bus_estimate_probe.py [WORLD] [ESTIMATES]
"""

import statistics
import sys
import time

import torch
import torch.distributed as dist
from probe_util import gloo_ranks

from shardwise import collectives
from shardwise.planner import calibrate

PAIRS = (15,)
# fp32 elements of output in all: 4/16, 4/32 and 16/64 MiB
SIZES = ((1 << 20, 1 << 22), (1 << 20, 1 << 23), (1 << 22, 1 << 24))


def work(rank: int, world: int, estimates: int) -> None:
    group = dist.group.WORLD
    n, parts = world, calibrate.PARTS

    def gather(shard: int):
        inps = [torch.ones(shard) for _ in range(parts)]
        outs = [torch.empty(shard * n) for _ in range(parts)]
        return lambda: collectives.all_gather_each(outs, inps, group, "probe").wait()

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    tiny = gather(8)  # the ranks together before each pair, as the calibration brings them
    results: dict[str, list[float]] = {}
    for sizes in SIZES:
        shards = [size // parts // n for size in sizes]
        moved = [parts * s * n * 4 * (n - 1) / n for s in shards]
        small, large = gather(shards[0]), gather(shards[1])
        mib = "/".join(str(size * 4 >> 20) for size in sizes)
        for _ in range(estimates):
            # the calibration's way: the best of 5 of each size (after one untimed)
            dist.barrier()
            small(), large()
            best = [min(timed(g) for _ in range(5)) for g in (small, large)]
            results.setdefault(f"{mib} MiB, best of 5", []).append(
                (moved[1] - moved[0]) / max(best[1] - best[0], 1e-9)
            )
            for pairs in PAIRS:  # the calibration's own way
                seconds = calibrate._paired_difference(small, large, tiny, pairs)
                results.setdefault(f"{mib} MiB, paired, median of {pairs}", []).append(
                    (moved[1] - moved[0]) / max(seconds, 1e-9)
                )
    if rank == 0:
        for name, v in results.items():
            g = [x / 1e9 for x in v]
            print(
                f"{world} ranks, {name}: {' '.join(f'{x:.2f}' for x in g)} GB/s; "
                f"median {statistics.median(g):.2f}, range {min(g):.2f}-{max(g):.2f}",
                flush=True,
            )


if __name__ == "__main__":
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    estimates = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    gloo_ranks(work, world, 29541, estimates)
