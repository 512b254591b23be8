"""CPU offload: the sharded state lives in host memory (``offload_policy=CPUOffloadPolicy()``).

What moves: each group's flat shard (and so every sharded parameter, and the
optimizer state made from them) stays in CPU memory, pinned by default. A
gather first uploads the shard to the GPU; a reduction downloads the reduced
shard, which becomes the CPU ``.grad``; the optimizer steps on CPU.

Why side streams: a copy on the compute stream would stall the kernels queued
behind it for its whole duration. Uploads run on the gather copy-in stream
(``collectives.side_stream``), ordered after the compute issued so far (so the
memory they write is free) and before the all-gather that reads them (issued
on the same stream, so NCCL waits for the copy, not for compute); a prefetch
then uploads and gathers while the previous module computes. Downloads run
on another stream and are waited for once, by the CPU, at the end of
backward: the optimizer must not read a gradient still in flight, but
nothing before it needs to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from .trace import label


class OffloadPolicy:
    """No offloading: the default, as FSDP2's base class."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, their gradients and the optimizer state in CPU memory.

    ``pin_memory``: page-locked host buffers, so the copies to and from the GPU
    run asynchronously, beside compute. Turn it off when host memory is short.
    """

    pin_memory: bool = True


def check_offload_policy(policy: object, mesh: DeviceMesh) -> CPUOffloadPolicy | None:
    """The policy if it offloads, None if not; TypeError for anything else.

    torch's own ``OffloadPolicy``/``CPUOffloadPolicy`` are accepted too (same fields).
    """
    if policy is None or type(policy).__name__ == "OffloadPolicy":
        return None
    if isinstance(policy, CPUOffloadPolicy):
        return policy
    if type(policy).__name__ == "CPUOffloadPolicy" and hasattr(policy, "pin_memory"):
        return CPUOffloadPolicy(pin_memory=bool(policy.pin_memory))
    raise TypeError(
        "offload_policy must be shardwise.OffloadPolicy() or CPUOffloadPolicy(pin_memory=...), "
        f"got {type(policy).__name__}"
    )


def host_buffer(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """Zeroed CPU memory, page-locked when asked and a GPU exists to copy to."""
    pin = pin and torch.cuda.is_available()
    return torch.zeros(numel, dtype=dtype, pin_memory=pin)


_downloads: dict[int, torch.cuda.Stream] = {}


def _download_stream() -> torch.cuda.Stream:
    device = torch.cuda.current_device()
    if device not in _downloads:
        _downloads[device] = torch.cuda.Stream()
    return _downloads[device]


def upload(flat: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``flat`` on ``device``, copied up asynchronously if it is in host memory (its
    own dtype: a copy that also cast would cast on the CPU first)."""
    if flat.device == device:
        return flat
    with label("offload"):
        return flat.to(device, non_blocking=True)


def download(
    t: torch.Tensor, dtype: torch.dtype, pin: bool
) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Copy ``t`` to a new CPU tensor of ``dtype``, asynchronously.

    Returns the CPU tensor and the event to synchronize before reading it
    (None: already there).
    """
    if t.device.type != "cuda":
        return t.to(dtype), None
    stream = _download_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), label("offload"):
        src = t.to(dtype)
        host = torch.empty(t.shape, dtype=dtype, pin_memory=pin)
        host.copy_(src, non_blocking=pin)
    t.record_stream(stream)  # freed by its owner, still read here
    return host, stream.record_event()
