"""A world of any size in this process: torch's fake process group, and the mesh on it.

Why the planner makes its own: the library takes its process group from
torch.distributed like any program does, so a fake one initialized here is,
to the runtime, a world of ``world`` ranks of which this process is rank 0.
Every collective returns at once and moves nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from shardwise import hsdp_mesh


@contextlib.contextmanager
def fake_world(world: int) -> Iterator[None]:
    """This process as rank 0 of ``world`` ranks on torch's fake backend."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "the planner runs its own fake process group: call it where torch.distributed "
            "is not initialized (a process of its own)"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def mesh(world: int, hsdp: int = 1) -> Any:
    """The world's mesh on the CPU: flat, or ``(hsdp, world // hsdp)`` replicate x shard."""
    from torch.distributed.device_mesh import init_device_mesh

    if hsdp > 1:
        return hsdp_mesh(hsdp, "cpu")
    return init_device_mesh("cpu", (world,))
