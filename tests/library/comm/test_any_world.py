"""The real runtime at world sizes no machine here has: torch's fake process group.

``dist.init_process_group("fake", store=FakeStore(), ...)`` makes one process
rank 0 of a world of any size: every collective returns at once and moves
nothing, so shardwise's own code (the hooks, the layouts, the copy-ins, the
orders) runs exactly as it would at that size. What it would move is what
the collectives layer reports to its observers; this checks it against the
theory at 2, 8, 64 and 1024 ranks: per step, FSDP gathers every parameter
twice (forward and backward; the root's once: by default it stays gathered
from its forward to its backward, as in FSDP2) and reduce-scatters its
gradient once, each rank moving (N-1)/N of those bytes; HSDP adds one all-reduce of the reduced
shard over the replicas, 2(R-1)/R of it per rank.

Each world size runs in a process of its own (one process group per process).
"""

from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(300)

ROWS = 1024  # every parameter's dim 0: it splits evenly over every world size below


def step_bytes(world: int, replicate: int) -> dict[str, Any]:
    """One training step of two sharded blocks (and the root) at ``world`` ranks
    (``replicate`` > 1: an HSDP mesh); bytes each collective kind moves, whole side."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import shardwise
    from shardwise.comm import collectives

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(ROWS, ROWS), nn.Linear(ROWS, ROWS), nn.LayerNorm(ROWS))
        mesh = shardwise.hsdp_mesh(replicate) if replicate > 1 else None
        for block in model[:2]:
            shardwise.fully_shard(block, mesh=mesh)
        shardwise.fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(2, ROWS)
        seen: dict[str, list[int]] = {}
        remove = collectives.add_observer(
            lambda rec, _: seen.setdefault(rec.kind, []).append(rec.nbytes)
        )
        try:
            for _ in range(2):  # the second step: orders recorded, as in training
                seen.clear()
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
        finally:
            remove()
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        root = sum(p.numel() * p.element_size() for p in model[2].parameters())
        return {"params": params, "root": root, "bytes": {k: sum(v) for k, v in seen.items()}}
    finally:
        dist.destroy_process_group()


def run_alone(world: int, replicate: int = 1) -> dict[str, Any]:
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(step_bytes, world, replicate).result(timeout=240)


@pytest.mark.parametrize("world", [2, 8, 64, 1024])
def test_fsdp_bytes_per_step_equal_theory(world: int) -> None:
    out = run_alone(world)
    params, root, moved = out["params"], out["root"], out["bytes"]
    # Whole side of each collective: the parameters gathered twice (the root's
    # once), the gradients reduce-scattered once; nothing else moves.
    assert moved == {"all_gather": 2 * params - root, "reduce_scatter": params}, moved


@pytest.mark.parametrize("world, replicate", [(8, 2), (1024, 8)])
def test_hsdp_adds_one_all_reduce_of_the_shard(world: int, replicate: int) -> None:
    out = run_alone(world, replicate)
    params, root, moved = out["params"], out["root"], out["bytes"]
    shard = world // replicate
    assert moved["all_gather"] == 2 * params - root, moved
    assert moved["reduce_scatter"] == params, moved
    # The reduced shard (1/shard of the gradients), all-reduced over the replicas.
    assert moved["all_reduce"] == params // shard, moved
