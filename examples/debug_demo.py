"""Make the pictures and messages of docs/debugging.md (2 CPU ranks, gloo).

python examples/debug_demo.py docs/images
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import shardwise
from shardwise import LifecycleError, Phase, fully_shard


class Net(nn.Module):
    def __init__(self, n: int = 4, d: int = 256) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(n)
        )
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, b in enumerate(self.blocks):
            x = checkpoint(b, x, use_reentrant=False) if i % 2 else b(x)
        return self.head(x)


def worker(rank: int, world: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29577")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = Net()
    for b in model.blocks:
        fully_shard(b, check=True)
    fully_shard(model, check=True)
    x = torch.randn(64, 256, requires_grad=True)
    model(x).sum().backward()  # the first step records the execution order
    with shardwise.trace() as t:
        model(x).sum().backward()
    if rank == 0:
        t.save_chrome_trace(os.path.join(out, "timeline.json"))
        t.plot(os.path.join(out, "timeline.png"))
        print("summary:", {k: v for k, v in t.summary().items() if k != "wall_s"})

    # The recompute-prefetch failure, by hand: gather blocks.3 again once its backward is over.
    def regather(module, args):
        if model.fsdp_context.phase is Phase.BACKWARD:
            model.blocks[3].unshard()

    model.blocks[1].register_forward_pre_hook(regather)
    try:
        model(x).sum().backward()
    except LifecycleError as e:
        if rank == 0:
            print(f"LifecycleError: {e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "."
    mp.spawn(worker, args=(2, out), nprocs=2)
