"""gloo's latency per gathered tensor against the compute a rank runs while the gathers
are in flight (the window between a gather's issue and its wait).

Why: the calibration times a module's gather beside ``calibrate.BUSY_S`` (3 ms) of
matrix products; a step's windows are its modules' compute, 6 to 9 ms a block on
the tiny GPT at 2 ranks and 17 to 35 ms on the small one (2026-12-04). If the
latency a step pays falls with the window, one figure over-charges long windows.

Each setting is ``calibrate._busy_latency`` itself (pairs of rounds: the products
alone, then beside a gather of ``PARTS`` 8-element tensors) with ``BUSY_S`` set;
the settings run in turn, ``SWEEPS`` times, so that the machine's drift falls on all.

Run: PYTHONPATH=src .venv/bin/python docs/bench/probes/gloo_latency_window_probe.py [WORLD] [SWEEPS]
"""

import sys

import torch
import torch.distributed as dist
from probe_util import gloo_ranks

from shardwise import collectives
from shardwise.planner import calibrate

WINDOWS_MS = (1, 3, 6, 12, 24)


def work(rank: int, world: int, sweeps: int) -> None:
    group = dist.group.WORLD
    inps = [torch.ones(8) for _ in range(calibrate.PARTS)]
    outs = [torch.empty(8 * world) for _ in range(calibrate.PARTS)]

    def each():
        return collectives.all_gather_each(outs, inps, group, "probe")

    seen: dict[int, list[float]] = {w: [] for w in WINDOWS_MS}
    for _ in range(sweeps):
        for w in WINDOWS_MS:
            calibrate.BUSY_S = w / 1e3
            dist.barrier()
            # fewer pairs for long windows: each pair is 2 x 20 rounds of the window
            pairs = max(9, calibrate.BUSY_PAIRS * 3 // max(3, w))
            seen[w].append(calibrate._busy_latency(each, pairs) * 1e6)
    if rank == 0:
        for w, lat in seen.items():
            print(f"window {w:2d} ms: {' '.join(f'{x:4.0f}' for x in lat)} us a tensor", flush=True)


if __name__ == "__main__":
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    sweeps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    gloo_ranks(work, world, 29533, sweeps)
