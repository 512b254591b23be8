"""The runtime's host work per step does not grow with the world: function calls counted.

A Python loop over ranks per parameter per step costs nothing at 2 ranks and
most of the step at 1024 (the gradient copy-in had one: docs/scaling.md).
Timing would not say so reliably on a busy CI machine; the number of function
calls (Python and built-in, as cProfile counts them) in one training step
does, exactly: the calls of the runtime's functions and the calls they make.
Under torch's fake process group (tests/library/comm/test_any_world.py) one
process is rank 0 of any world. On the CPU with no cast the copy-in is one
``_chunk_cat`` at every size, so the count is the same at every world; on a GPU
(or with a cast) up to ``reduce.PIECES_UP_TO`` ranks it copies each rank's piece
apart (per-tensor calls, the same at 2 and 8 ranks), above each tensor whole.
"""

from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

ROWS = 1024  # every parameter's dim 0: even over every world size below


def calls_per_step(world: int) -> int:
    """The runtime's function calls in one training step (the third) of two sharded
    blocks and the root."""
    import cProfile
    import pstats

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import shardwise

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, ROWS), nn.ReLU(), nn.Linear(ROWS, ROWS))
        shardwise.fully_shard(model[0])
        shardwise.fully_shard(model[2])
        shardwise.fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randn(2, 8)

        def step() -> None:
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()

        for _ in range(2):  # orders recorded, caches filled
            step()
        profile = cProfile.Profile()
        profile.runcall(step)
        # The runtime's calls: of its own functions, and the ones they make
        # (Tensor.split in a loop over ranks, say). Not torch's own work below
        # those (DTensor's dispatch cache compares specs more often at some
        # world sizes: its hash collisions, not ours).
        here = str(Path(shardwise.__file__).parent)
        stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
        return sum(
            n
            for (file, _, _), (_, _, _, _, callers) in stats.items()
            for (caller, _, _), (_, n, _, _) in callers.items()
            if file.startswith(here) or caller.startswith(here)
        )
    finally:
        dist.destroy_process_group()


def test_calls_per_step_do_not_grow_with_the_world() -> None:
    from shardwise.comm.reduce import PIECES_UP_TO

    worlds = [2, PIECES_UP_TO, 2 * PIECES_UP_TO, 1024]
    ctx = mp.get_context("spawn")
    calls = {}
    for world in worlds:  # one process group per process
        with ProcessPoolExecutor(1, mp_context=ctx) as pool:
            calls[world] = pool.submit(calls_per_step, world).result(timeout=240)
    assert calls[2] == calls[PIECES_UP_TO], calls
    assert calls[2 * PIECES_UP_TO] == calls[1024], calls
    assert calls[1024] <= calls[2], calls
    assert len(set(calls.values())) == 1, calls  # the CPU's copy-in: one call at every size
