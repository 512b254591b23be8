"""The only place that calls torch.distributed: gathers, reductions, and who saw them.

Why one file: every collective a module issues passes through here, so tests
and the timeline can observe them (kind, dtype, bytes, group size) without
patching torch, and version differences between torch releases (the
``*_single`` names of newer releases versus ``*_into_tensor``/``*_tensor``)
are handled once.

Asynchrony: each call may return a ``Pending`` whose ``wait()`` finishes it.
On CUDA the process group runs the collective on its own stream and ``wait()``
makes the current (compute) stream wait for it with an event, so work issued
early (a prefetch) overlaps the compute that follows. On CPU, gloo runs it on
its own thread and ``wait()`` blocks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.distributed_c10d import _coalescing_manager

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class CollectiveRecord:
    """What one collective moved, as seen by observers (tests, the timeline)."""

    kind: str  # "all_gather" | "reduce_scatter" | "all_reduce" | "broadcast"
    dtype: torch.dtype
    numel: int  # elements of the full (unsharded) side
    nbytes: int
    group_size: int
    label: str  # the module's name, for humans
    op: str = ""  # reductions: "sum" (then divided, if at all), "avg" (inside it), "max" (clipping)
    parts: int = 1  # tensors in it: gloo runs each as a collective of its own
    # The group's world ranks, in its order: which links the bytes cross
    # (node_collectives.LinkBytes). Empty where a record is made by hand.
    ranks: tuple[int, ...] = ()


Observer = Callable[[CollectiveRecord, "Pending"], None]
_observers: list[Observer] = []


def add_observer(fn: Observer) -> Callable[[], None]:
    """Call ``fn(record, pending)`` for every collective issued; returns a remover."""
    return _register(_observers, fn)


WaitObserver = Callable[["Pending", bool], None]
_wait_observers: list[WaitObserver] = []


def add_wait_observer(fn: WaitObserver) -> Callable[[], None]:
    """Call ``fn(pending, False)`` just before a ``Pending`` (a collective, a cast or an
    upload in flight) is waited for and ``fn(pending, True)`` right after; returns a
    remover. The timeline's exposed-communication spans are these.

    Why a registration: this file is the bottom of the runtime and imports no
    layer above it; whoever wants to see the waits (trace.py, a tool) registers."""
    return _register(_wait_observers, fn)


def _register(observers: list[Any], fn: Any) -> Callable[[], None]:
    observers.append(fn)
    return lambda: observers.remove(fn) if fn in observers else None


class Pending:
    """An issued collective. ``wait()`` is idempotent; ``then`` runs after it."""

    __slots__ = ("_work", "_then", "label", "kind", "done", "on_done")

    def __init__(
        self,
        work: Any,
        then: Callable[[], object] | None = None,
        label: str = "",
        kind: str = "",
    ) -> None:
        self._work = work
        self._then = then
        self.label = label
        self.kind = kind  # "all_gather", "reduce_scatter", ...: which wait was exposed
        self.done = False
        self.on_done: list[Callable[[Pending], None]] = []

    @property
    def work(self) -> Any:
        """The backend's handle until waited for (then None): an observer may keep it."""
        return self._work

    def wait(self) -> None:
        if self.done:
            return
        watching = list(_wait_observers) if _wait_observers else None
        if watching is not None:
            for observe in watching:
                observe(self, False)
        if self._work is not None:
            self._work.wait()
            # Released at once: a backend's handle may hold buffers of its own
            # (gloo's reduce-scatter holds a clone of the whole input).
            self._work = None
        if watching is not None:
            for observe in watching:
                observe(self, True)
        if self._then is not None:
            self._then()
        self.done = True
        for fn in self.on_done:
            fn(self)

    def settle(self) -> None:
        """``wait`` without telling the wait observers: for a collective that is one
        stage of another (node_collectives.py), whose own ``wait`` is the one compute
        waits in (a nested wait would count the same time twice)."""
        if self.done:
            return
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._then is not None:
            self._then()
        self.done = True
        for fn in self.on_done:
            fn(self)


def _notify(
    kind: str,
    t: torch.Tensor,
    group: dist.ProcessGroup | None,
    label: str,
    p: Pending,
    op: str = "",
    numel: int | None = None,  # several tensors of t's dtype: their total
    parts: int = 1,
) -> None:
    if _observers:
        n = t.numel() if numel is None else numel
        size = n * t.element_size()
        ranks = tuple(group_ranks(group) if group is not None else range(dist.get_world_size()))
        rec = CollectiveRecord(kind, t.dtype, n, size, len(ranks), label, op, parts, ranks)
        for fn in list(_observers):
            fn(rec, p)


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    label: str = "",
    comm: Any = None,
    then: Callable[[], object] | None = None,
) -> Pending:
    """Gather every rank's ``input`` into ``output`` (rank-major), asynchronously.

    ``comm``: a user's all-gather (``FSDPModule.set_custom_all_gather``),
    called as FSDP2 calls it: ``comm(output_tensor=..., input_tensor=...,
    group=..., async_op=True)``, returning a work handle or None.
    ``then``: run once it is waited for (a dequantization).
    """
    if comm is None and _on_side_stream():
        _all_gather(output, input, group=group, async_op=False)
        work: Any = StreamWork()
    elif comm is None:
        work = _all_gather(output, input, group=group, async_op=True)
    else:
        work = comm(output_tensor=output, input_tensor=input, group=group, async_op=True)
    p = Pending(work, then=then, label=label, kind="all_gather")
    _notify("all_gather", output, group, label, p)
    return p


def all_gather_each(
    outputs: list[torch.Tensor], inputs: list[torch.Tensor], group: dist.ProcessGroup, label: str
) -> Pending:
    """Gather every rank's ``inputs[i]`` into ``outputs[i]``, all as one collective.

    Why: a group's parameters are gathered straight into their own storage
    (each output is one parameter, rank-major = param-major along dim 0), so
    no copy-out follows on the compute stream. NCCL runs the grouped
    gathers as one launch, about as fast as one gather of them all end to end
    (docs/benchmarks.md). gloo is the other way round: its grouped gathers
    flatten into temporary buffers and copy out, while its separate gathers,
    all in flight at once, run on its several threads and were faster than one
    flat gather, so on the CPU each parameter gets its own. Observers see one
    gather.
    """
    if not outputs:  # a group of empty parameters
        return Pending(None, label=label, kind="all_gather")
    if len(outputs) == 1:
        return all_gather(outputs[0], inputs[0], group, label)
    side = _on_side_stream()
    work: Any
    if outputs[0].is_cuda:
        with _coalescing_manager(group, async_ops=not side) as work:
            for out, inp in zip(outputs, inputs):
                _all_gather(out, inp, group=group)
    else:
        work = _AllOf(
            [_all_gather(o, i, group=group, async_op=True) for o, i in zip(outputs, inputs)]
        )
    p = Pending(StreamWork() if side else work, label=label, kind="all_gather")
    numel = sum(t.numel() for t in outputs) if _observers else 0
    _notify(
        "all_gather",
        outputs[0],
        group,
        label,
        p,
        numel=numel,
        parts=len(outputs),
    )
    return p


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    label: str = "",
    divide_by: float | None = None,
    comm: Any = None,
    sum_only: bool = False,
) -> Pending:
    """Sum ``input`` over the group, this rank keeping its slice in ``output``,
    divided by ``divide_by`` (the group size: the mean).

    The mean inside the collective (ReduceOp.AVG) where the backend has it
    (NCCL) for an fp32 or bf16 sum, as FSDP2 does: no pass over the output
    afterwards on the compute stream. Elsewhere (gloo has no AVG), with a
    custom factor, or ``sum_only`` (``set_force_sum_reduction_for_comms``):
    SUM, then a division of the (small) output when waited for.
    ``comm``: a user's reduce-scatter (``set_custom_reduce_scatter``), called
    as ``comm(output_tensor=..., input_tensor=..., group=..., op=SUM, async_op=True)``.
    """
    n = group.size()  # (a member's: dist.get_world_size's Python checks cost more than it)
    op = dist.ReduceOp.SUM
    if comm is None and not sum_only and divide_by == n and _averages(group, input):
        op, divide_by = dist.ReduceOp.AVG, None
    if comm is None and _on_side_stream():
        _reduce_scatter(output, input, op=op, group=group, async_op=False)
        work: Any = StreamWork()
    elif comm is None:
        work = _reduce_scatter(output, input, op=op, group=group, async_op=True)
    else:
        work = comm(
            output_tensor=output,
            input_tensor=input,
            group=group,
            op=dist.ReduceOp.SUM,
            async_op=True,
        )
    then = None if divide_by is None else (lambda: output.div_(divide_by))
    p = Pending(work, then=then, label=label, kind="reduce_scatter")
    _notify("reduce_scatter", input, group, label, p, "avg" if op == dist.ReduceOp.AVG else "sum")
    return p


def _averages(group: dist.ProcessGroup, t: torch.Tensor) -> bool:
    """Whether ``group`` averages ``t`` exactly enough inside the collective: NCCL
    has ReduceOp.AVG, gloo has not; fp16 could overflow before the division."""
    if not t.is_cuda or t.dtype not in (torch.float32, torch.bfloat16):
        return False
    return type(group._get_backend(t.device)).__name__ == "ProcessGroupNCCL"


def all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    label: str = "",
    divide_by: float | None = None,
    op: str = "sum",
) -> Pending:
    """Sum (or ``op="max"``) ``tensor`` in place over the group (HSDP's replicate
    dimension; ``None``: the world, as gradient clipping's norm), then divide."""
    reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
    work = dist.all_reduce(tensor, op=reduce_op, group=group, async_op=True)
    then = None if divide_by is None else (lambda: tensor.div_(divide_by))
    p = Pending(work, then=then, label=label, kind="all_reduce")
    _notify("all_reduce", tensor, group, label, p, op)
    return p


def all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    label: str = "",
    then: Callable[[], object] | None = None,
) -> Pending:
    """Send row j of ``input`` (``[group size, ...]``, equal rows) to member j; row i of
    ``output`` is what member i sent this rank. ``then``: run once waited for."""
    if _on_side_stream():
        dist.all_to_all_single(output, input, group=group, async_op=False)
        work: Any = StreamWork()
    else:
        work = dist.all_to_all_single(output, input, group=group, async_op=True)
    p = Pending(work, then=then, label=label, kind="all_to_all")
    _notify("all_to_all", input, group, label, p)
    return p


def all_to_all_uneven(
    output: torch.Tensor,
    input: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup,
    label: str = "",
) -> Pending:
    """Send the j-th part of 1-D ``input`` (``input_splits[j]`` elements) to member j; the
    i-th part of 1-D ``output`` (``output_splits[i]`` elements) is what member i sent.

    Why uneven parts: a matrix optimizer's owner (shardwise.optim.Muon) receives each
    member's pieces of the matrices it owns and sends them back; the others receive
    only their own pieces, so the parts differ per member."""
    if _on_side_stream():
        dist.all_to_all_single(output, input, output_splits, input_splits, group=group)
        work: Any = StreamWork()
    else:
        work = dist.all_to_all_single(
            output, input, output_splits, input_splits, group=group, async_op=True
        )
    p = Pending(work, label=label, kind="all_to_all")
    _notify("all_to_all", input, group, label, p)
    return p


# ---- the world, process groups, and Python objects ----------------------------------------
# The rest of the library asks these instead of torch.distributed, so that no
# call to it is made anywhere else (tests/library/test_layers.py checks).


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank in the world (0 without a process group)."""
    return dist.get_rank() if initialized() else 0


def world_size(group: dist.ProcessGroup | None = None) -> int:
    """Ranks in ``group`` (the world by default; 1 without a process group)."""
    return dist.get_world_size(group) if initialized() else 1


def group_ranks(group: dist.ProcessGroup) -> list[int]:
    """The world ranks of ``group``, in its order."""
    return dist.get_process_group_ranks(group)


def backend(group: dist.ProcessGroup | None) -> str:
    return str(dist.get_backend(group))


def device_mesh(
    device_type: str, shape: tuple[int, ...], names: tuple[str, ...] | None = None
) -> DeviceMesh:
    """A mesh over the world (its process groups are made here, collectively)."""
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def new_group(ranks: list[int]) -> dist.ProcessGroup:
    """A process group over ``ranks``, made by its members only (a rank of a
    sliced mesh cannot see the other slices' groups, so a world-wide creation
    of every group would not run in the same order everywhere)."""
    group = dist.new_group(ranks, use_local_synchronization=True)
    assert group is not None
    return group


_subgroups: dict[tuple[int, ...], dist.ProcessGroup] = {}
_subgroups_world: list[Any] = [None]  # the default group they were made in


def subgroup(ranks: list[int]) -> dist.ProcessGroup:
    """``new_group(ranks)``, made once per set of ranks and shared (a node's ranks serve
    both ``reshard_after_forward=n`` and the hierarchical reduction; a separate
    reduce-scatter group is one more). Its members call it. Made again in a new world:
    after ``destroy_process_group`` and a new ``init_process_group`` (the planner's
    simulated worlds, a notebook starting over) the old groups are gone."""
    world = dist.group.WORLD
    if _subgroups_world[0] is not world:
        _subgroups.clear()
        _subgroups_world[0] = world
    key = tuple(ranks)
    group = _subgroups.get(key)
    if group is None:
        group = _subgroups[key] = new_group(list(ranks))
    return group


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (the world; pickled, for small things)."""
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` on rank 0, in rank order; an empty list elsewhere."""
    out: list[Any] | None = [None] * world_size() if rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out or []


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def broadcast(tensor: torch.Tensor, label: str = "") -> None:
    """Rank 0's ``tensor`` into every rank's, in place, waited for."""
    work = dist.broadcast(tensor, src=0, async_op=True)
    p = Pending(work, label=label, kind="broadcast")
    _notify("broadcast", tensor, None, label, p)
    p.wait()


# ---- where communication buffers come from ----------------------------------------------

Allocator = Callable[[int, torch.dtype], torch.Tensor]


def comm_buffer(
    alloc: Allocator | None, numel: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A gather output or reduction buffer: from ``alloc`` (the process group's own
    memory, symmetric memory) or, None, from the caching allocator on ``device``."""
    if alloc is not None:
        return alloc(numel, dtype)
    return torch.empty(numel, dtype=dtype, device=device)


def process_group_allocator(group: dist.ProcessGroup, device: torch.device) -> Allocator:
    """Buffers from the backend's own allocator (NCCL: memory it can register for
    zero-copy transfers), as ``FSDPModule.set_allocate_memory_from_process_group_for_comm``.
    ValueError, naming the backend, where the backend has none."""
    backend = group._get_backend(device)
    supports = getattr(backend, "supports_tensor_alloc", None)
    if supports is None or not supports(device):
        raise ValueError(
            f"set_allocate_memory_from_process_group_for_comm(True): the {dist.get_backend(group)} "
            f"backend cannot allocate tensors on {device.type} (NCCL on a GPU can); leave it off"
        )
    _init_communicator(group, device)
    return lambda numel, dtype: backend.allocate_tensor(numel, dtype=dtype, device=device)


def symmetric_allocator(group: dist.ProcessGroup, device: torch.device) -> Allocator:
    """Buffers in symmetric memory (``torch.distributed._symmetric_memory``), registered
    with every rank of ``group``, so NCCL may use its copy-engine or symmetric-kernel
    collectives, as ``FSDPModule.set_symm_mem_for_comm``. Collective: every rank calls it."""
    import torch.distributed._symmetric_memory as symm_mem

    if not hasattr(symm_mem, "get_mem_pool"):
        raise NotImplementedError(
            f"set_symm_mem_for_comm: torch {torch.__version__} has no symmetric-memory pool "
            "(torch.distributed._symmetric_memory.get_mem_pool); a newer torch has"
        )
    symm_mem.set_backend("NCCL")
    _init_communicator(group, device)
    pool = symm_mem.get_mem_pool(device)

    def allocate(numel: int, dtype: torch.dtype) -> torch.Tensor:
        with torch.cuda.use_mem_pool(pool):
            t = torch.empty(numel, dtype=dtype, device=device)
        symm_mem.rendezvous(t, group=group.group_name)
        return t

    allocate.symmetric = True  # type: ignore[attr-defined]
    return allocate


def _init_communicator(group: dist.ProcessGroup, device: torch.device) -> None:
    """NCCL creates its communicator lazily, at the first collective on the device, and
    its memory pools need one (without it: an error, or on torch 2.11 a crash). A
    barrier would not do: on a "cpu:gloo,cuda:nccl" group it runs on gloo."""
    dist.all_reduce(torch.zeros(1, device=device), group=group)


_streams: dict[tuple[str, int], torch.cuda.Stream] = {}
_side_depth = 0  # > 0 while issuing inside side_stream() on a GPU


def _on_side_stream() -> bool:
    return _side_depth > 0


def on_side_stream() -> bool:
    """Whether a collective issued now runs inside ``side_stream`` on a GPU (in stream
    order: what follows it on the stream may read its output at once)."""
    return _side_depth > 0


class _AllOf:
    """Several work handles waited for as one."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


class StreamWork:
    """Work queued in order on a side stream: a copy, or a collective (``async_op=False``
    there: since torch 2.8 NCCL then runs on the current stream and stashes
    nothing). Waiting for it is the waiting stream's wait on an event recorded
    after it. Off the GPU the work ran in order already: nothing to wait for."""

    def __init__(self, device: torch.device | None = None) -> None:
        # ``device``: where the work ran; None for a collective issued inside side_stream().
        on_gpu = device is None or device.type == "cuda"
        self.event = torch.cuda.current_stream().record_event() if on_gpu else None

    def wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


class _Here:
    """``side_stream`` off the GPU: nothing to do, and no generator made for it (it is
    entered for every gather and reduction)."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_HERE = _Here()


def side_stream(kind: str, device: torch.device | None) -> contextlib.AbstractContextManager[None]:
    """Issue a collective's copy-in, and the collective, beside compute.

    On a GPU, what runs inside goes on this device's ``kind`` stream
    ("gather": casts and host uploads before all-gathers; "reduce": the
    gradient copy-in before reduce-scatters), after the compute issued so far:
    the copy then overlaps the compute queued next, and NCCL, issued on the same
    stream, waits for the copy rather than for compute. Buffers are allocated
    by the caller before entering (on the compute stream, so no new memory
    pool) and held until the collective is waited for. Elsewhere (CPU, or
    ``device`` None) it runs where it would anyway.
    """
    if device is None or device.type != "cuda":
        return _HERE
    return _on_side(kind, device)


@contextlib.contextmanager
def _on_side(kind: str, device: torch.device) -> Iterator[None]:
    key = (kind, device.index if device.index is not None else torch.cuda.current_device())
    stream = _streams.get(key)
    if stream is None:
        stream = _streams[key] = torch.cuda.Stream(device)
    global _side_depth
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        _side_depth += 1
        try:
            yield
        finally:
            _side_depth -= 1
