"""Watching one simulated step: every storage that lives, every operator that runs.

Why a dispatch mode of our own: under fake tensors nothing is allocated, so
memory is what the step's tensors would hold, summed over live storages.
Every operator's outputs are registered as they appear (a storage is
counted once, however many views share it), a finalizer subtracts it when
the last reference goes, and ``UntypedStorage.resize_`` (how the runtime
fills and frees gathered parameters without a new tensor) is watched while
the mode is active. The same pass records each operator's FLOPs and the
bytes it touches, in order, with the collectives issued and waited for
between them: ``timeline.py`` replays that order against the rates.

Kinds are known for some storages when they appear (a collective's buffers,
gathered parameters, tensors autograd saves); parameters, gradients and
optimizer state are recognised when the caller takes a ``snapshot``.

With offload every storage is a CPU tensor here, host or not, so host memory
is classified: what the caller marks (the shards), what a download returns
(the gradients: the runtime's transfer observer says which) and what an
operator makes from host storages only (the optimizer's moments and
temporaries), an upload's copy excepted. The rest is device memory.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from .op_costs import call_spec

GATHERED, COMM, ACTIVATION, TEMPORARY = "gathered_params", "comm_buffers", "activations", "temps"


@dataclass
class Event:
    """One thing that happened, in program order."""

    kind: str  # "op" | "issue" | "wait"
    live: int  # device bytes live after it
    phase: str
    module: str
    flops: float = 0.0
    nbytes: int = 0  # op: bytes read and written; issue: what one rank sends and receives
    matmul: bool = False
    low_precision: bool = False
    host: bool = False  # an op on offloaded (host) storages only
    coll: str = ""  # issue: collective kind
    group: int = 0  # issue: group size
    # issue/wait: which collective (its issue's index); op: an upload a wait names at
    # one rank, -1 - its index (apart from the collectives' keys, and never 0: none)
    key: int = 0
    numel: int = 0  # issue: elements of one rank's shard (an offloaded upload's size)
    full_numel: int = 0  # issue: elements of the unsharded side
    itemsize: int = 0  # issue: bytes an element, in the collective's dtype
    dtensor: bool = False  # op: on DTensors (the optimizer's step): Python dispatch
    staging: int = 0  # issue: gloo's staging buffers, live while the collective runs
    staging_parts: tuple[int, ...] = ()  # issue: each gathered tensor's (gloo runs each apart)
    parts: int = 1  # issue: tensors gathered (gloo: each a collective of its own)
    transfer: int = 0  # op: bytes crossing between host and device (offload's copies)
    to_host: bool = False  # op: the transfer is a download (else an upload)
    call: Any = field(default=None, repr=False)  # op: op_costs.Call, when calls are recorded
    seconds: float | None = None  # op: measured on this machine's device (op_costs)


def _sdpa_flops(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    """Attention as its kernels compute it: 4 b h tq tk d forward, twice that back,
    half of it when causal (flash kernels skip the masked blocks)."""
    q, k = args[0], args[1]
    if "backward" in func.__name__:
        q, k = args[1], args[2]
    b, h, tq, d = q.shape[-4:] if q.dim() == 4 else (1, *q.shape[-3:])
    tk = k.shape[-2]
    flops = 4.0 * b * h * tq * tk * d * (2.0 if "backward" in func.__name__ else 1.0)
    causal = kwargs.get("is_causal", False) or (len(args) > 4 and args[4] is True)
    return flops / 2 if causal else flops


def op_flops(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> float:
    name = func.__name__
    if "scaled_dot_product" in name or "flash_attention" in name or "efficient_attention" in name:
        return _sdpa_flops(func, args, kwargs)
    fn = flop_registry.get(func._overloadpacket)
    return float(fn(*args, **kwargs, out_val=out)) if fn is not None else 0.0


class Stop(Exception):
    """The step reached the event it was to stop at (``Tracker.stop_at``): what is live
    now is the answer, taken by ``Tracker.at_stop`` before anything unwinds and frees."""


@dataclass
class _Live:
    nbytes: int
    tag: str
    ref: Any = field(repr=False)
    # The event its operator recorded (-1: none), in that step's list: a copy that
    # offload makes is reclassified from there on (Tracker.offload_copies).
    born: int = -1
    events: Any = field(default=None, repr=False)


class Tracker(TorchDispatchMode):
    """Counts live storages and records each operator while active."""

    def __init__(self, round_to: int = 1) -> None:
        super().__init__()
        self.round_to = max(1, round_to)
        self.live: dict[int, _Live] = {}
        self.total = 0
        self.events: list[Event] | None = None  # recording when a list
        self.phase = "setup"
        self.module = ""
        self.host_storages: set[int] = set()  # offloaded: not device memory
        self.peak = 0
        self.host_total = 0  # bytes of the host storages live
        self.host_peak = 0
        # A CPU target: gloo's own staging buffers (not seen as operators' outputs).
        self.gloo_staging = False
        self.unbound: list[int] = []
        self.staging_now = 0  # at a snapshot: staging buffers live then
        self.record_calls = False  # keep each operator's call, to be timed (op_costs.py)
        # offload: each group's last upload (by label) and its event, until its wait
        self.uploads: dict[str, tuple[list[Event], int]] = {}
        # Stop the step once event ``stop_at`` is recorded, ``at_stop()`` first; an
        # offload copy's operator is stopped at once its transfer has said which side
        # the copy is on (``_stop_pending`` until then).
        self.stop_at = -1
        self.at_stop: Callable[[], None] | None = None
        self._stop_pending = False
        self.watching_copies = False  # inside offload_copies

    def take_staging(self) -> tuple[int, ...]:
        """Bytes of gloo staging of the collective just issued, one figure per
        collective gloo runs (a gather of several tensors is one per tensor)."""
        parts = tuple(self.unbound)
        self.unbound.clear()
        return parts

    # ---- storages ---------------------------------------------------------------------------

    def _size(self, n: int) -> int:
        r = self.round_to
        return (n + r - 1) // r * r if n else 0

    def _device_bytes(self, key: int, n: int) -> int:
        """``n`` more bytes of storage ``key``: the device's share (a host storage's go
        to the host's count)."""
        if key in self.host_storages:
            self.host_total += n
            self.host_peak = max(self.host_peak, self.host_total)
            return 0
        return n

    def track(self, t: torch.Tensor, tag: str = "") -> None:
        s = t.untyped_storage()
        key = id(s)
        entry = self.live.get(key)
        if entry is not None:
            if tag and not entry.tag:
                entry.tag = tag
            self._resized(key, s)
            return
        n = self._size(s.nbytes())
        events = self.events
        born = len(events) if events is not None else -1
        self.live[key] = _Live(n, tag, weakref.ref(s), born, events)
        self.total += self._device_bytes(key, n)
        weakref.finalize(s, self._freed, key)

    def _freed(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.total += self._device_bytes(key, -entry.nbytes)
            self.host_storages.discard(key)

    def _resized(self, key: int, s: Any, tag: str = "") -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        n = self._size(s.nbytes())
        self.total += self._device_bytes(key, n - entry.nbytes)
        entry.nbytes = n
        if tag and n:
            entry.tag = tag

    def mark_host(self, storages: list[Any]) -> None:
        for s in storages:
            key = id(s)
            if key in self.live and key not in self.host_storages:
                self.total -= self.live[key].nbytes
                self.host_storages.add(key)
                self._device_bytes(key, self.live[key].nbytes)

    def tag(self, t: torch.Tensor, tag: str) -> None:
        entry = self.live.get(id(t.untyped_storage()))
        if entry is not None and not entry.tag:
            entry.tag = tag

    @contextmanager
    def offload_copies(self) -> Iterator[None]:
        """Offload's copies, as a GPU run holds them, seen through the runtime's
        transfer and wait observers (``shardwise.observe``). Under an offload policy
        the runtime makes each copy in a storage of its own, on a CPU run too, and
        holds a download's device tensor until the next download or the end of
        backward as a GPU run does; what the tracker adds is which side each is on:

        - what a download returns is host memory from the moment it exists (the
          operator that made it counted it as the device's: taken off there);
        - an upload's copy is device memory, though the operator that made it read
          host storages only (so it was taken for the host's: put back).

        Each copy's event carries the bytes that cross (``transfer``) instead of a
        kernel's. At one rank a gather is only its upload, run on a stream of its
        own and waited for where the runtime waits for the gather (a ``Pending`` of
        kind "upload", with the group's label): that upload's event gets a key and
        the wait is recorded with it, so the replay holds the module's compute until
        its own upload is done (timeline.py).
        """
        from shardwise import observe

        def waited(pending: Any, done: bool) -> None:
            if not done or getattr(pending, "kind", "") != "upload":
                return
            events, at = self.uploads.pop(getattr(pending, "label", ""), (None, -1))
            if events is not None and events is self.events:  # the same step's record
                events[at].key = -1 - at
                self.record(kind="wait", key=-1 - at)

        removers = [
            observe.add_transfer_observer(self._transferred),
            observe.add_wait_observer(waited),
        ]
        self.watching_copies = True
        try:
            yield
        finally:
            self.watching_copies = False
            for remove in removers:
                remove()
            self.uploads.clear()

    def _transferred(self, t: Any) -> None:
        """One of offload's copies (``observe.Transfer``): see ``offload_copies``."""
        if t.kind not in ("upload", "download") or t.out is None:
            return  # a release: the runtime lets go of the tensor, its finalizer counts it
        out = t.out
        self.track(out)
        entry = self.live[id(out.untyped_storage())]
        events = self.events
        at = entry.born if events is not None and entry.events is events else -1
        to_host = t.kind == "download"
        self._move(out.untyped_storage(), to_host, at)
        if to_host:
            self.tag(t.src, COMM)  # the reduced shard, held by the runtime until released
        else:
            entry.tag = entry.tag or COMM
        if at < 0:
            self.record(kind="op", transfer=t.nbytes, to_host=to_host)
            at = len(events) - 1 if events is not None else -1
        else:
            # The operator that made the copy is the copy: it crosses, it is no kernel.
            e = events[at]  # type: ignore[index]
            e.nbytes, e.flops, e.matmul, e.host, e.call = 0, 0.0, False, False, None
            e.transfer, e.to_host = t.nbytes, to_host
        if not to_host and events is not None and at >= 0:
            self.uploads[t.label] = (events, at)
        if self._stop_pending:
            self._stop()

    def _move(self, storage: Any, to_host: bool, since: int) -> None:
        """Count ``storage`` as host (or device) memory, and as such in the events
        recorded since ``since`` (its operator's), which counted it on the other side."""
        key = id(storage)
        entry = self.live.get(key)
        if entry is None or (key in self.host_storages) == to_host:
            return
        if to_host:
            self.mark_host([storage])
        else:
            self.host_storages.discard(key)
            self.host_total -= entry.nbytes
            self.total += entry.nbytes
        if since >= 0 and self.events is not None:
            delta = -entry.nbytes if to_host else entry.nbytes
            for e in self.events[since:]:
                e.live += delta
        self._note()

    @contextmanager
    def watching_resize(self) -> Iterator[None]:
        """Gathered parameters come and go by ``resize_`` of their storage."""
        original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(s: Any, n: int) -> Any:
            out = original(s, n)
            tracker._resized(id(s), s, GATHERED)
            tracker._note()
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
        try:
            yield
        finally:
            torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]

    # ---- events -----------------------------------------------------------------------------

    def _note(self) -> None:
        self.peak = max(self.peak, self.total)

    def record(self, copy: bool = False, **kw: Any) -> None:
        """An event, now. ``copy``: an operator that may be one of offload's copies
        (``_transferred`` then reclassifies it), so a stop there waits for that."""
        self._note()
        if self.events is None:
            return
        self.events.append(Event(live=self.total, phase=self.phase, module=self.module, **kw))
        if 0 <= self.stop_at < len(self.events):
            if copy:
                self._stop_pending = True
            else:
                self._stop()

    def _stop(self) -> None:
        self._stop_pending = False
        self.stop_at = -1
        if self.at_stop is not None:
            self.at_stop()
        raise Stop

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self._stop_pending:  # no transfer came after the copy's operator
            self._stop()
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        leaves = tree_flatten((args, kwargs))[0]
        flat_in = _plain(leaves)
        flat_out = _plain(tree_flatten(out)[0])
        if func.namespace == "prim":  # metadata (a device query), no kernel
            return out
        if func.namespace == "c10d":
            for t in flat_in + flat_out:
                self.track(t, COMM)
            # gloo's own buffers, beside the ones we pass it. An all-gather gathers
            # into a flat buffer, then copies out (ProcessGroupGloo's newLikeFlat),
            # sized as the outputs (the first argument); gloo has no reduce-scatter,
            # so it all-reduces a clone of the whole input (the second), which the
            # work handle holds until released (the profiler's allocation events,
            # torch 2.13). The issue event carries the bytes; timeline.py knows how long.
            name = func.__name__
            arg = 0 if "allgather" in name else 1 if "reduce_scatter" in name else None
            if self.gloo_staging and arg is not None:
                held = _plain(tree_flatten(args[arg])[0])
                self.unbound.append(self._size(sum(t.numel() * t.element_size() for t in held)))
            return out
        for t in flat_out:
            self.track(t)
        if self.events is None:
            self._note()
            return out
        if func.is_view or not flat_out and not flat_in:
            nbytes, flops = 0, 0.0
        else:
            nbytes = sum(t.numel() * t.element_size() for t in flat_in + flat_out)
            flops = op_flops(func, args, kwargs, out)
        # An op on host storages only is the host's (its fresh outputs are host memory
        # too); host inputs into a device output are an upload (a CPU run copies there).
        on_host = [id(t.untyped_storage()) in self.host_storages for t in flat_in]
        host = bool(on_host) and all(on_host)
        transfer = 0
        if not host and any(on_host) and flat_out and not func.is_view:
            transfer = sum(t.numel() * t.element_size() for t, h in zip(flat_in, on_host) if h)
        if host:
            self.mark_host(storages_of(flat_out))
        low = any(t.dtype in (torch.bfloat16, torch.float16) for t in flat_in)
        dt = any(hasattr(t, "_local_tensor") for t in leaves)
        call = None
        if self.record_calls and nbytes:
            call = call_spec(func, args, kwargs)
        self.record(
            kind="op",
            flops=flops,
            nbytes=nbytes,
            matmul=flops > 0,
            low_precision=low,
            host=host,
            dtensor=dt,
            transfer=transfer,
            call=call,
            copy=self.watching_copies and func is torch.ops.aten._to_copy.default,
        )
        return out

    # ---- what is live, by kind --------------------------------------------------------------

    def snapshot(self, known: dict[int, str]) -> dict[str, int]:
        """Live device bytes by kind; ``known`` names storages by id (parameters, ...)."""
        by: dict[str, int] = {}
        for key, entry in self.live.items():
            if key in self.host_storages or not entry.nbytes:
                continue
            kind = known.get(key) or entry.tag or TEMPORARY
            by[kind] = by.get(kind, 0) + entry.nbytes
        if self.staging_now:
            by[COMM] = by.get(COMM, 0) + self.staging_now
        return by

    def host_bytes(self, known: dict[int, str]) -> dict[str, int]:
        by: dict[str, int] = {}
        for key in self.host_storages:
            entry = self.live.get(key)
            if entry is not None:
                kind = known.get(key, TEMPORARY)
                by[kind] = by.get(kind, 0) + entry.nbytes
        return by


def saving_as_activations(tracker: Tracker) -> Any:
    """Autograd's saved tensors tagged as activations (a parameter saved stays a parameter)."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        tracker.tag(t, ACTIVATION)
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _plain(items: list[Any]) -> list[torch.Tensor]:
    """The tensors among ``items``, a DTensor as its local tensor (the mode sees DTensor
    ops before DTensor turns them into local ones, and not those)."""
    out = []
    for t in items:
        if isinstance(t, torch.Tensor):
            out.append(t._local_tensor if hasattr(t, "_local_tensor") else t)
    return out


def storages_of(tensors: list[torch.Tensor]) -> list[Any]:
    return [t.untyped_storage() for t in tensors]


Observer = Callable[..., None]
