"""A module's gradient reduction in flight: the copy-in, the reduce-scatter, HSDP's all-reduce.

Why a job object: a module's post-backward starts its reduction and returns at
once, so the next module's backward computes while it runs; the job holds
every buffer the collectives read or write until ``finish`` has waited for
them. By default one job is in flight at a time (root.py's ``finish_reduces``),
bounding the memory held for communication to one module; with HSDP, the
previous module's all-reduce as well, which holds only its reduced shard.

How a part of a group reduce-scatters is a strategy chosen once, as its
gather is (gather.py): ``choose`` picks ``CastOnly`` (one rank: the copy-in
is all there is), ``FlatScatter`` (one reduce-scatter) or ``NodeScatter``
(qgZ's two steps across nodes) from the layout and ``ReduceComm``, when the
layout is built and when a setting that decides it changes. Each backward
then makes a ``ReduceJob`` (which issues nothing when made), ``issue``s it,
and later ``finish``es it.

A job is given what it needs and knows no group: the group's layout
(``FlatShard``: its parameters, dtypes, device), a snapshot of its settings
(``ReduceSettings``: a setter called while the job is in flight does not
change it), the strategy, the replicas' process group, where HSDP sums held
back are kept (``HeldBack``) and where a download in flight is listed.
``finish`` returns the reduced shards; the group puts them on ``.grad``
(``ParamGroup.assign_grads``), and the layer that finished the job tells
optimizer_in_backward (root.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter, eq
from typing import Any

import torch
from torch.distributed import ProcessGroup

from ..layout import offload
from ..layout.flat_shard import FlatShard
from ..layout.labels import label
from ..layout.offload import CPUOffloadPolicy
from ..layout.sharded_param import ShardedParam
from . import collectives, node_collectives
from .comm_policy import CommPolicy


@dataclass(frozen=True)
class ReduceSettings:
    """The settings a reduction reads, as they were when it started (settings.py
    makes one whenever a setting changes): FSDP2's names."""

    divide_factor: float | None = None  # None: the mean over every data-parallel rank
    all_reduce_hook: Callable[[Any], None] | None = None  # on the reduced shard
    force_sum: bool = False  # SUM only, never the backend's AVG
    requires_all_reduce: bool = True  # HSDP: False holds the reduce-scattered sums back
    reduce_scatter_unused: bool = False  # every trainable parameter gets a gradient
    offload_policy: CPUOffloadPolicy | None = None  # reduced shards go to host memory


@dataclass(frozen=True)
class ReduceComm:
    """What one reduction's reduce-scatter runs over, as ``GatherComm`` is for a gather:
    the process group, a user's reduce-scatter (None: torch's), the allocator of its
    buffers (None: the caching one) and the communication policy (qgZ). Made by the
    group's part for each reduction (mesh_part.py): the group-wide settings apply to
    the part on the ``fully_shard`` call's mesh, another part reduces over its own
    mesh plainly."""

    group: ProcessGroup
    custom: Any = None
    alloc: collectives.Allocator | None = None
    policy: CommPolicy | None = None


class HeldBack:
    """HSDP sums held back from the all-reduce by ``set_requires_all_reduce(False)``:
    the members' indices and the summed shard, handed to the next all-reduce. One
    per group, given to each of its reductions, which take and put the sums when
    they all-reduce (taken when a job is made instead, two jobs of one group in
    flight would both miss what the first then holds back)."""

    __slots__ = ("sums",)

    def __init__(self) -> None:
        self.sums: tuple[list[int], torch.Tensor] | None = None

    def take(self) -> tuple[list[int], torch.Tensor] | None:
        held, self.sums = self.sums, None
        return held

    def hold(self, members: list[int], summed: torch.Tensor) -> None:
        self.sums = (members, summed)


class CastOnly:
    """One rank: the copy-in (a cast, a layout) into the output is all there is."""

    def issue(self, job: ReduceJob, filled: list[torch.Tensor], slots: list[int]) -> Any:
        g = job.layout
        with collectives.side_stream("reduce", g.device):
            _copy_in(filled, slots, job.out.view(1, -1))
            if g.device.type == "cuda":
                _record_stream(filled, g.device)
            work = collectives.StreamWork(g.device)
        return collectives.Pending(work, label=g.label, kind="cast")


class FlatScatter:
    """The copy-in lays the pieces out rank-major; one reduce-scatter over the group."""

    def issue(self, job: ReduceJob, filled: list[torch.Tensor], slots: list[int]) -> Any:
        g, comm, numel = job.layout, job.comm, job.out.numel()
        rs_in = job.scatter_input()
        with collectives.side_stream("reduce", g.device):
            _copy_in(filled, slots, rs_in.view(g.world, numel))
            if g.device.type == "cuda":
                _record_stream(filled, g.device)
            return collectives.reduce_scatter(
                job.out,
                rs_in,
                comm.group,
                g.label,
                divide_by=job.divide_by,
                comm=comm.custom,
                sum_only=job.settings.force_sum,
            )


class NodeScatter:
    """``CommPolicy.quantize_reduce`` (qgZ): the copy-in lays the pieces out node-major
    (``node_collectives.node_major``), then the two-step reduce-scatter, which leaves
    in the output what the flat one would, divided the same way."""

    def __init__(self, nodes: node_collectives.NodeGroups, policy: CommPolicy) -> None:
        self.nodes = nodes
        self.policy = policy

    def issue(self, job: ReduceJob, filled: list[torch.Tensor], slots: list[int]) -> Any:
        g = job.layout
        rs_in = job.scatter_input()
        with collectives.side_stream("reduce", g.device):
            _copy_in_nodes(filled, slots, node_collectives.node_major(rs_in, self.nodes), rs_in)
            if g.device.type == "cuda":
                _record_stream(filled, g.device)
            return node_collectives.hierarchical_reduce_scatter(
                job.out,
                rs_in,
                self.nodes,
                g.label,
                divide_by=job.divide_by,
                block=self.policy.block_size,
                qdtype=self.policy.quant_dtype,
            )


Scatter = CastOnly | FlatScatter | NodeScatter


def choose(layout: FlatShard, comm: ReduceComm) -> Scatter:
    """How a part with ``layout`` reduce-scatters over ``comm``: chosen when the layout
    is built and whenever a setting that decides it changes, as ``gather.choose``."""
    if layout.world == 1:
        return CastOnly()
    nodes = _node_split(layout, comm)
    if nodes is not None:
        assert comm.policy is not None
        return NodeScatter(nodes, comm.policy)
    return FlatScatter()


class ReduceJob:
    """A module's gradient reduction in flight: reduce-scatter, then (HSDP) all-reduce.

    The default averages over every data-parallel rank: the reduce-scatter
    divides by the shard group's size, the all-reduce by the replicas'. A
    custom divide factor sums throughout and divides once at the end (what
    FSDP2 does with ``PREMUL_SUM``, which gloo lacks). Made, then ``issue``d:
    making one communicates nothing.
    """

    def __init__(
        self,
        layout: FlatShard,
        settings: ReduceSettings,
        comm: ReduceComm,
        scatter: Scatter,
        replicate_group: ProcessGroup | None,
        held_back: HeldBack,
        grads: list[torch.Tensor | None],
        used: list[bool],
        last_backward: bool,
        downloads: list[Any] | None,
    ):
        """``settings``: the group's as this reduction starts; ``comm``: what the
        reduce-scatter runs over, ``scatter`` how (``choose``); ``replicate_group``:
        HSDP's replicas (None: FSDP). ``last_backward``: this backward ends the
        microbatches (only then does optimizer_in_backward step; decided now, since
        an earlier microbatch's job may finish in the next one). ``downloads``: where
        an offloaded copy to the host that nothing waits for yet is listed (the
        context waits at the end of backward)."""
        g = self.layout = layout
        self.settings = settings
        self.comm = comm
        self.scatter = scatter
        self.replicate_group = replicate_group
        self.held_back = held_back
        self.last_backward = last_backward
        self._downloads = downloads
        self._grads = grads
        self._pending: collectives.Pending | None = None
        self._rs_in: torch.Tensor | None = None  # the reduce-scatter's input, until it is done
        # HSDP: the all-reduce over the replicas, issued once the reduce-scatter
        # is done (``scattered``); None while not issued, or when held back.
        self._all_reducing: collectives.Pending | None = None
        self._scattered = False
        self._held = False  # set_requires_all_reduce(False): no gradient this time
        # The flat layout restricted to the parameters that can have gradients:
        # the trainable ones (the same on every rank; unused ones send zeros)
        # and any that got one. A LoRA layer reduces its adapters, not zeros
        # the size of its frozen base.
        # Every parameter got a gradient (the usual step): all of them, the layout's own
        # list (never changed in place). Not ``all(used)``: HSDP sums held back mark a
        # parameter used that has no gradient in this microbatch (ParamGroup.reduce_grads).
        self._all_grads = all(t is not None for t in grads)
        self.members = (
            g.params
            if self._all_grads
            else [sp for sp, t in zip(g.params, grads) if t is not None or sp.sharded.requires_grad]
        )
        if settings.reduce_scatter_unused and not self._all_grads:
            # Every rank assigns every member: a parameter used on some ranks
            # only gets the mean (zeros from the others) everywhere.
            member = {sp.index for sp in self.members}
            used = [u or sp.index in member for sp, u in zip(g.params, used)]
        self.used = used
        self.downloaded: Any = None  # offload: the event of the copy to the host (None: none)
        self._owner: torch.cuda.Stream | None = None  # offload: where ``out`` was allocated
        self.shards: list[Any] = []

    def scatter_input(self) -> torch.Tensor:
        """The reduce-scatter's input (world times the output), from the job's allocator
        and held by the job until the reduce-scatter is done."""
        g = self.layout
        numel = g.world * self.out.numel()
        self._rs_in = collectives.comm_buffer(self.comm.alloc, numel, g.reduce_dtype, g.device)
        return self._rs_in

    @property
    def divide_by(self) -> int | None:
        """What the reduce-scatter divides by: the shard group's size for the mean, None
        where a custom divide factor divides once at the end (``finish``)."""
        return None if self.settings.divide_factor is not None else self.layout.world

    def issue(self) -> None:
        """The copy-in and the reduce-scatter, issued without waiting (on one rank with
        nothing to average: the shards are the gradients, nothing is issued)."""
        g, settings, grads = self.layout, self.settings, self._grads
        self._grads = []
        hsdp = self.replicate_group is not None
        plain = settings.divide_factor is None and settings.all_reduce_hook is None
        device = g.device
        # One rank, nothing else to do: nothing to average, the gradients are
        # the shards, cast to the parameters' dtype (on a GPU beside compute,
        # below; else on assignment).
        alone = g.world == 1 and not hsdp and plain and settings.offload_policy is None
        cast = device.type == "cuda" and any(
            t is not None and t.dtype != g.orig_dtype for t in grads
        )
        if alone and settings.reduce_scatter_unused:
            grads = _zeros_for(g, grads, self.members)
        if alone and not cast:
            self.shards = [None if t is None else t.contiguous() for t in grads]
            return
        if alone:  # only the parameters with gradients: nothing to send for the others
            self.members = [sp for sp, t in zip(g.params, grads) if t is not None]
        # Labelled: what a memory record finds allocated here is reduction buffers.
        with label("reduce"):
            whole = self.members is g.params  # every parameter, each with a gradient
            filled: list[torch.Tensor]
            if whole and g.split_dim0:
                filled = grads  # type: ignore[assignment]  # all there, laid out already
            else:
                padded = grads if whole else _zeros_for(g, grads, self.members)
                filled = [
                    sp.for_reduce(t) for sp in self.members if (t := padded[sp.index]) is not None
                ]
            if len(set(map(_dtype, filled))) > 1:  # accumulated (reduce dtype) and fresh ones
                filled = [t.to(g.reduce_dtype) for t in filled]
            numel = g.shard_numel if whole else sum(sp.slot for sp in self.members)
            dtype = g.orig_dtype if alone else g.reduce_dtype
            self.out = collectives.comm_buffer(self.comm.alloc, numel, dtype, device)
            if settings.offload_policy is not None and device.type == "cuda":
                # The stream whose pool ``out`` came from: its free is ordered there,
                # after the download (offload.download).
                self._owner = torch.cuda.current_stream(device)
            # The copy-in overlaps the backward compute queued next. The gradients
            # it reads may be freed as soon as it has run, not when the reduction
            # is waited for: record_stream tells the allocator so.
            slots = g.slots if whole else [sp.slot for sp in self.members]
            self._pending = self.scatter.issue(self, filled, slots)

    @property
    def overlaps(self) -> bool:
        """Whether ``scattered`` would issue an all-reduce that ``finish`` then waits for."""
        return not self._scattered and not self.shards and self.replicate_group is not None

    def scattered(self) -> None:
        """Wait for the reduce-scatter; HSDP: issue the all-reduce over the replicas
        without waiting for it, so that a later module's backward hides it (the
        context finishes this job at the next module's post-backward)."""
        if self._scattered:
            return
        if self._pending is not None:
            self._pending.wait()
            self._pending = self._rs_in = None
        if not self.shards and self.replicate_group is not None:
            self._all_reducing = self._all_reduce(self.out)
            self._held = self._all_reducing is None
        self._scattered = True  # only now: an all-reduce that raised is not skipped

    def discard(self) -> None:
        """A backward that raised: wait for what was issued (the buffers must outlive
        the collectives), issue nothing more, put nothing on ``.grad``."""
        for pending in (self._pending, self._all_reducing):
            if pending is not None:
                pending.wait()
        self._pending = self._all_reducing = self._rs_in = None

    def finish(self) -> list[Any] | None:
        """Wait for the reduction; the reduced shards, one per parameter of the group
        (None where ``used`` is False), to go on ``.grad``. None when held back
        (``set_requires_all_reduce(False)``): no gradient yet."""
        g, settings = self.layout, self.settings
        self.scattered()
        if self._held:
            return None
        if self._all_reducing is not None:
            self._all_reducing.wait()
            self._all_reducing = None
        if not self.shards:
            out = self.out
            if settings.divide_factor is not None:
                out.div_(settings.divide_factor)
            if settings.all_reduce_hook is not None:
                settings.all_reduce_hook(out)
            if settings.offload_policy is not None:
                out = self._download(out)
            if self.members is g.params and g.whole_pieces:
                # Every slot is its piece (no padding here): one split, a view each.
                # (torch.split_with_sizes, not Tensor.split: that one is Python.)
                self.shards = list(
                    map(torch.Tensor.view, torch.split_with_sizes(out, g.slots), g.local_shapes)
                )
            else:
                self.shards = [None] * len(g.params)
                offset = 0
                for sp in self.members:
                    piece = out[offset : offset + sp.local_numel]
                    self.shards[sp.index] = piece.view(sp.local_shape)
                    offset += sp.slot
        return self.shards

    def _download(self, out: torch.Tensor) -> torch.Tensor:
        """The reduced shards, copied to host memory (offload): the CPU gradients."""
        g = self.layout
        assert self.settings.offload_policy is not None and self._downloads is not None
        pin = self.settings.offload_policy.pin_memory
        host, done = offload.download(out, g.orig_dtype, pin, self._owner, g.label)
        if any(sp.sharded.grad is not None for sp in self.members):
            if done is not None:
                done.synchronize()  # added to CPU gradients now: they must have arrived
            offload.release_downloaded()  # arrived: its device copy can go at once
        elif done is not None:
            self._downloads.append(done)  # waited for at the end of backward
            self.downloaded = done
        return host

    def _all_reduce(self, out: torch.Tensor) -> collectives.Pending | None:
        """HSDP: average ``out`` over the replicas, with sums held back before, issued;
        None when held back instead."""
        g, settings = self.layout, self.settings
        assert self.replicate_group is not None
        members = [sp.index for sp in self.members]
        taken = self.held_back.take()
        if taken is not None:
            held, partial = taken
            if held != members:
                raise RuntimeError(
                    f"module {g.label!r}: the trainable parameters changed while reductions "
                    "were held back by set_requires_all_reduce(False); change requires_grad "
                    "only after a backward that all-reduces"
                )
            out.add_(partial)
        if not settings.requires_all_reduce:
            self.held_back.hold(members, out)
            return None
        replicas = self.replicate_group.size()
        divide = None if settings.divide_factor is not None else replicas
        return collectives.all_reduce(out, self.replicate_group, g.label, divide_by=divide)


# Ranks up to which the copy-in copies each rank's piece apart (``_copy_in``).
PIECES_UP_TO = 8


def _copy_in(filled: list[torch.Tensor], slots: list[int], out: torch.Tensor) -> None:
    """Lay ``filled`` out rank-major in ``out`` (``[world, sum(slots)]``), cast on the way.

    On a GPU, where every tensor splits evenly into contiguous pieces, one per
    rank (its rows), one ``_foreach_copy_``: up to ``PIECES_UP_TO`` ranks of the
    pieces, above it of each tensor into its strided ``[world, slot]`` column of
    ``out`` (at one rank, of the tensors themselves, contiguous or not).
    ``_chunk_cat``, which also pads uneven splits, runs slower there with a cast
    (most at one rank), and so do the strided columns at a few ranks
    (docs/benchmarks.md). The pieces are world views per tensor, host time
    that grows with the world (at 1024 ranks most of the step: docs/scaling.md),
    so they stop at one node's ranks. The Python calls here are per tensor, never per
    rank: this runs once per module per backward, and on a small model the
    host's time is the step's.

    On the CPU, without a cast, one ``_chunk_cat`` at every world: there the copies
    are the host's own time, and one kernel beat the pieces and the columns at
    every size timed (2026-12-07, one thread; a module of 4 parameters, 34,816
    gradient elements, world 8: 6.5 us against 81 and 16; 4096 x 1024 layers at
    world 8: 2.7 ms against 3.3 and 3.0). With a cast the pieces stay (a bf16 layer
    at 2 ranks: 2.0 ms against 4.2).
    """
    world = out.shape[0]
    if not out.is_cuda and all(map(eq, map(_dtype, filled), repeat(out.dtype))):
        # (An empty parameter, slot 0, holds no column; _chunk_cat refuses it.)
        tensors = [t for t in filled if t.numel()]
        if tensors:
            torch._chunk_cat(tensors, dim=0, num_chunks=world, out=out)
    elif world == 1 and all(t.numel() == s for t, s in zip(filled, slots)):
        dsts = [d.view(t.shape) for d, t in zip(out.view(-1).split(slots), filled)]
        torch._foreach_copy_(dsts, filled)
    elif all(t.is_contiguous() and t.numel() == world * s for t, s in zip(filled, slots)):
        srcs = [t.view(world, s) for t, s in zip(filled, slots)]
        dsts = list(out.split(slots, dim=1))
        if world <= PIECES_UP_TO:
            srcs = [piece for t in srcs for piece in t.unbind(0)]
            dsts = [piece for d in dsts for piece in d.unbind(0)]
        torch._foreach_copy_(dsts, srcs)
    else:  # an empty parameter (slot 0) holds no column; _chunk_cat refuses it
        torch._chunk_cat([t for t in filled if t.numel()], dim=0, num_chunks=world, out=out)


def _node_split(g: FlatShard, comm: ReduceComm) -> node_collectives.NodeGroups | None:
    """The node groups a ``quantize_reduce`` policy reduces through; None where the flat
    reduce-scatter runs: no such policy, a user's reduce-scatter (called as FSDP2 calls
    it), or a group that is one node or that the node size does not split."""
    policy = comm.policy
    if policy is None or not policy.quantize_reduce or comm.custom is not None:
        return None
    node = policy.node_size
    if node is None or node >= g.world or g.world % node:
        return None
    return node_collectives.node_groups(comm.group, node)


def _copy_in_nodes(
    filled: list[torch.Tensor], slots: list[int], nodes: torch.Tensor, flat: torch.Tensor
) -> None:
    """``_copy_in`` into the node-major buffer ``flat``, seen through ``nodes`` (its
    ``[N, L, sum(slots)]`` view, rank ``k * L + l`` at ``[k, l]``): each tensor that
    splits evenly into one piece per rank is copied as ``[N, L, slot]`` into its
    strided column, all in one ``_foreach_copy_``; otherwise (uneven, padded pieces)
    rank-major into a buffer first, then permuted in one copy."""
    N, L, numel = nodes.shape
    if all(t.is_contiguous() and t.numel() == N * L * s for t, s in zip(filled, slots)):
        srcs = [t.view(N, L, s) for t, s in zip(filled, slots)]
        torch._foreach_copy_(list(nodes.split(slots, dim=2)), srcs)
        return
    rank_major = torch.empty(N * L, numel, dtype=flat.dtype, device=flat.device)
    _copy_in(filled, slots, rank_major)
    nodes.copy_(rank_major.view(N, L, numel))


_dtype = attrgetter("dtype")


def _record_stream(tensors: list[torch.Tensor], device: torch.device) -> None:
    """Tell the allocator that the current (side) stream reads ``tensors``."""
    if device.type == "cuda":
        stream = torch.cuda.current_stream(device)
        for t in tensors:
            t.record_stream(stream)


def _zeros_for(
    g: FlatShard, grads: list[torch.Tensor | None], members: list[ShardedParam]
) -> list[torch.Tensor | None]:
    """``grads`` with zeros for members that got none (unused on this rank)."""
    out = list(grads)
    for sp in members:
        if out[sp.index] is None:
            out[sp.index] = torch.zeros(sp.shape, dtype=g.compute_dtype, device=g.device)
    return out
