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

Why a download holds its device tensor until the next one: the reduced shard
it reads must not be reused before the copy has read it. ``record_stream``
would say so to the allocator, which then keeps the memory out of reuse for
as long as the copy lags the compute, unseen by ``memory_allocated`` and
growing with the lag (each new reduction then takes fresh memory). Instead
the device tensor stays referenced here, one per device, until the next
download is issued (or the host has waited for the downloads: the end of
backward, an accumulation); then the stream its memory came from waits on
the copy's event, on the GPU, and the reference goes. The free is ordered
after the copy on the one stream that can reuse the block, and it happens at
a point of the host's program, not of the GPU's progress: the device memory
of the downloads in flight is one reduced shard, counted by the allocator
like any tensor, whatever the copies' speed. The compute stream waits only
for a copy issued one module earlier, so the copies still run beside the
compute; at worst (copies slower than the backward) compute is paced to
them, which the end of backward, waiting for every copy, would be anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch.distributed.device_mesh import DeviceMesh

from . import labels


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


@dataclass(frozen=True)
class Transfer:
    """One host<->device copy offload issued (``upload``, ``download``), or the device
    tensor a download read let go (``release``), as transfer observers see it."""

    kind: Literal["upload", "download", "release"]
    label: str  # the group's label ("" if the caller gave none)
    src: torch.Tensor  # what was read (release: the device tensor let go)
    out: torch.Tensor | None  # the copy made (release: None)
    nbytes: int  # bytes that cross (release: the device tensor's)


TransferObserver = Callable[[Transfer], None]
_transfer_observers: list[TransferObserver] = []


def add_transfer_observer(fn: TransferObserver) -> Callable[[], None]:
    """Call ``fn(transfer)`` after each copy is issued and when a download's device
    tensor is let go; returns a remover. A simulation of a GPU run on the CPU (no
    transfer happens there) counts the device memory the copies hold from these."""
    _transfer_observers.append(fn)
    return lambda: _transfer_observers.remove(fn) if fn in _transfer_observers else None


def _notify(
    kind: Literal["upload", "download", "release"],
    name: str,
    src: torch.Tensor,
    out: torch.Tensor | None,
    nbytes: int,
) -> None:
    t = Transfer(kind, name, src, out, nbytes)
    for fn in list(_transfer_observers):
        fn(t)


_downloads: dict[int, torch.cuda.Stream] = {}


def _download_stream() -> torch.cuda.Stream:
    device = torch.cuda.current_device()
    if device not in _downloads:
        _downloads[device] = torch.cuda.Stream()
    return _downloads[device]


def upload(flat: torch.Tensor, device: torch.device, label: str = "") -> torch.Tensor:
    """A copy of ``flat`` (an offloaded flat shard) on ``device``, copied up
    asynchronously (its own dtype: a copy that also cast would cast on the CPU first).

    Always a tensor with its own storage, also on a CPU run, where ``device`` is
    where ``flat`` already lives: a CPU run of an offloaded model then holds what a
    GPU run holds (the uploaded copy, until the gather's cast has read it)."""
    with labels.label("offload"):
        out = flat.to(device, non_blocking=True, copy=True)
    if _transfer_observers:
        _notify("upload", label, flat, out, flat.numel() * flat.element_size())
    return out


@dataclass
class _Read:
    """A device tensor a download reads, kept until the stream its memory came from
    (``owner``) is told to wait for the copy (``done``; both None on a CPU run)."""

    tensor: torch.Tensor
    done: torch.cuda.Event | None
    owner: torch.cuda.Stream | None
    label: str


_reading: dict[int, _Read] = {}
_CPU = -1  # ``_reading``'s key for a CPU run


def download(
    t: torch.Tensor,
    dtype: torch.dtype,
    pin: bool,
    owner: torch.cuda.Stream | None = None,
    label: str = "",
) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Copy ``t`` to a new CPU tensor of ``dtype``, asynchronously.

    Returns the CPU tensor and the event to synchronize before reading it
    (None: already there). ``owner``: the stream ``t``'s memory was allocated
    on (default: the current one); ``t`` is held until the next download or
    ``release_downloaded`` (the module docstring says why), then freed in
    ``owner``'s order after the copy. On a CPU run too the copy has its own
    storage and ``t`` is held as long: the run holds what a GPU run holds.
    """
    if t.device.type != "cuda":
        host = t.to(dtype, copy=True)
        _release(_CPU)
        _reading[_CPU] = _Read(t, None, None, label)
        if _transfer_observers:
            _notify("download", label, t, host, host.numel() * host.element_size())
        return host, None
    device = torch.cuda.current_device()
    stream = _download_stream()
    current = torch.cuda.current_stream()
    stream.wait_stream(current)
    with torch.cuda.stream(stream), labels.label("offload"):
        # A cast's output is allocated, read and freed on this stream: ordered.
        src = t.to(dtype)
        host = torch.empty(t.shape, dtype=dtype, pin_memory=pin)
        host.copy_(src, non_blocking=pin)
    done = stream.record_event()
    _release(device)  # the previous copy was queued before this one
    _reading[device] = _Read(t, done, current if owner is None else owner, label)
    if _transfer_observers:
        _notify("download", label, t, host, host.numel() * host.element_size())
    return host, done


def release_downloaded() -> None:
    """Let go of the device tensors the downloads read: once the host has waited for
    them (the end of backward, an accumulation, a backward that raised), nothing
    later would release them before the next step's first download."""
    for device in list(_reading):
        _release(device)


def _release(device: int) -> None:
    read = _reading.pop(device, None)
    if read is None:
        return
    if read.owner is not None and read.done is not None:
        # Stream-ordered: a block reused on ``owner`` is written only after the copy.
        # (After a host synchronize the event is complete and the wait costs nothing.)
        read.owner.wait_event(read.done)
    if _transfer_observers:
        t = read.tensor
        _notify("release", read.label, t, None, t.numel() * t.element_size())
