"""Inside a worker: joining the process group, and what rank 0 decides for every rank."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .common import EXIT_USAGE, UsageError, usable_cpus
from .signals import joined


@dataclass(frozen=True)
class Worker:
    rank: int
    world: int
    local_rank: int
    device: Any  # torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_worker(timeout_s: float | None = None) -> Worker:
    """Join the process group: NCCL with one GPU per rank if there are GPUs, else gloo.

    ``timeout_s``: how long a collective waits for a peer before it fails
    (default: the backend's).
    """
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    torch.set_num_threads(max(1, usable_cpus() // local_world))
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    joined()
    return Worker(rank, world, local_rank, device)


def from_rank0(fn: Callable[[], Any], command: str) -> Any:
    """Run ``fn`` on rank 0 only and give every rank its result. A ``UsageError``
    ends every rank with exit code 2, rank 0 having said it in one line, as
    ``main`` says it (a ``SystemExit``: the workers' failure handlers let it pass)."""
    import torch.distributed as dist

    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except UsageError as e:
            box[0] = ("usage", str(e))
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "usage":
        if dist.get_rank() == 0:
            print(f"shardwise {command}: error: {value}", file=sys.stderr, flush=True)
        dist.destroy_process_group()
        raise SystemExit(EXIT_USAGE)
    return value
