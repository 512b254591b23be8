"""Collectives that know the node boundary: node groups, the quantized all-gather, the
hierarchical reduce-scatter, and a counter of the bytes each link carries.

Why a file of its own, above collectives.py: these are compositions of
collectives.py's calls (each stage is a collective there, so every observer
sees every byte) with quantize.py's block quantization; collectives.py stays
the one file that calls torch.distributed, and stays short.

A shard group of ``W`` ranks is ``N`` nodes of ``L`` consecutive ranks
(``L = node_size``): member ``i`` is local rank ``l = i % L`` of node
``k = i // L``. ``node_groups`` makes, once per (group, node size), this rank's
node group (the ``L`` ranks of node ``k``) and its cross group (the ``N``
ranks of local rank ``l``, one per node). The node group has the ranks of
``reshard_after_forward=node_size``'s group; both come from
``collectives.subgroup``, so they are one process group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import ProcessGroup

from . import collectives
from .quantize import pack, row_bytes, unpack, unpack_into


@dataclass(frozen=True)
class NodeGroups:
    """One rank's view of its shard group split into nodes (module docstring)."""

    nodes: int  # N
    node_size: int  # L
    node_index: int  # k: this rank's node
    local_rank: int  # l: this rank's place in its node
    node: ProcessGroup | None  # the L ranks of this node (None: L == 1)
    cross: ProcessGroup | None  # the N ranks of local rank l (None: N == 1)


_node_groups: dict[tuple[Any, int], NodeGroups] = {}


def node_groups(group: ProcessGroup, node_size: int) -> NodeGroups:
    """This rank's node and cross groups of ``group``, made once per (group, node size).
    Collective over ``group``'s members the first time: ``fully_shard`` calls it, so
    that a failure (a timeout, a backend) comes before anything changed."""
    key = (group, node_size)
    found = _node_groups.get(key)
    if found is not None:
        return found
    ranks = collectives.group_ranks(group)
    if len(ranks) % node_size:
        raise ValueError(f"node size {node_size} does not divide the group of {len(ranks)} ranks")
    i = ranks.index(collectives.rank())
    k, lr = divmod(i, node_size)
    nodes = len(ranks) // node_size
    # Every member makes its node group, then its cross group: in one order everywhere.
    node = collectives.subgroup(ranks[k * node_size : (k + 1) * node_size])
    cross = collectives.subgroup(ranks[lr::node_size])
    made = NodeGroups(
        nodes,
        node_size,
        k,
        lr,
        node if node_size > 1 else None,
        cross if nodes > 1 else None,
    )
    _node_groups[key] = made
    return made


# ---- the quantized all-gather ----------------------------------------------------------------


def quantized_buffers(
    numel: int,
    world: int,
    block: int,
    device: torch.device,
    alloc: collectives.Allocator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The send row and the receive buffer of ``quantized_all_gather`` for ``numel``
    elements a rank over ``world`` ranks (allocated by the caller before it enters
    ``collectives.side_stream``, as every gather's buffers are)."""
    rb = row_bytes(numel, block)
    send = torch.empty(1, rb, dtype=torch.uint8, device=device)
    recv = collectives.comm_buffer(alloc, world * rb, torch.uint8, device)
    return send, recv


def quantized_all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    send: torch.Tensor,
    recv: torch.Tensor,
    group: ProcessGroup,
    label: str,
    block: int,
    qdtype: torch.dtype,
) -> collectives.Pending:
    """Gather every rank's ``input`` (1-D, ``n`` elements, any float dtype) into
    ``output`` (``[W, n]``, rank-major, the compute dtype) through ``qdtype`` blocks:
    each rank packs its blocks and their scales into one byte row (``send``), one
    all-gather moves the rows (into ``recv``), and the wait dequantizes them into
    ``output``. ``send``/``recv``: ``quantized_buffers``, held until waited for.

    Error: per block of ``block`` elements of a rank's ``input``, within
    ``quantize.error_bound`` (int8: the block's absmax / 254), plus the rounding
    to ``output``'s dtype.

    Alternatives considered. Two gathers (values, then scales): one more
    collective's latency per module for 1.6% of the bytes. Dequantizing on the
    gather side stream: the wait is then an event, but the dequantized buffer
    is written while a prefetch is in flight, which costs nothing on the CPU and
    is left for the GPU measurements to decide.
    """
    n = input.numel()
    world = output.shape[0]
    rb = send.shape[-1]
    pack(input.view(1, n), block, qdtype, send.view(1, rb))

    def dequantize() -> None:
        unpack_into(output, recv.view(world, rb), n, block, qdtype)

    return collectives.all_gather(recv, send.view(-1), group, label, then=dequantize)


# ---- the hierarchical reduce-scatter ---------------------------------------------------------


class _Stages:
    """A work handle made of collectives issued one after another: waiting settles
    the first stages, issues the rest (``then``), and settles those. Each stage is
    a ``Pending`` of its own (observers saw it issued); only the outer ``Pending``
    tells the wait observers, so the time compute waits is counted once."""

    def __init__(
        self,
        issued: list[collectives.Pending],
        then: Callable[[], list[collectives.Pending]] | None,
        last: Any = None,
    ) -> None:
        self.issued = issued
        self.then = then
        self.last = last  # a StreamWork after the stream-ordered stages, or None

    def wait(self) -> None:
        for p in self.issued:
            p.settle()
        if self.then is not None:
            then, self.then = self.then, None
            for p in then():
                p.settle()
        if self.last is not None:
            self.last.wait()


def node_major(world_major: torch.Tensor, groups: NodeGroups) -> torch.Tensor:
    """The ``[N, L, numel]`` view of a node-major buffer (``[L, N, numel]`` in memory):
    row ``(k, l)`` is the piece for member ``k * L + l``, as in a rank-major buffer,
    so a copy-in writes rank by rank and the intra-node reduce-scatter reads
    local rank by local rank."""
    L, N = groups.node_size, groups.nodes
    return world_major.view(L, N, -1).transpose(0, 1)


def hierarchical_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    groups: NodeGroups,
    label: str,
    divide_by: float | None,
    block: int,
    qdtype: torch.dtype,
    quantize: bool = True,
) -> collectives.Pending:
    """Sum ``input`` over the shard group, this rank keeping its piece in ``output``,
    divided by ``divide_by``: what ``collectives.reduce_scatter`` gives, in two steps.

    ``input`` is ``W * numel`` elements laid out node-major (``node_major``): the
    piece for member ``k * L + l`` at ``[l, k]``. (1) Inside the node, a
    reduce-scatter at ``input``'s dtype: local rank ``l`` gets, summed over its
    node, the ``N`` pieces of the members of local rank ``l``, one per node.
    (2) Across nodes, over the cross group: row ``k'`` goes to node ``k'`` by one
    all-to-all, as ``qdtype`` blocks (``quantize``; else at ``input``'s dtype);
    the received rows are dequantized and summed in fp32 with this rank's own
    row, which never leaves it and is not quantized.

    Inter-node bytes, per rank: ``(N - 1) / N * numel`` elements of one byte (plus
    a scale per block) where a flat reduce-scatter sends ``(W - L) / W * W * numel``
    elements of the reduce dtype to other nodes (node_collectives.LinkBytes).

    On the CPU (gloo) the second step is issued when the first is waited for;
    on a GPU (inside ``collectives.side_stream``) both are issued at once, in
    stream order.
    """
    numel = output.numel()
    N, L = groups.nodes, groups.node_size
    if L > 1:
        assert groups.node is not None
        intra = torch.empty(N * numel, dtype=input.dtype, device=input.device)
        first = [collectives.reduce_scatter(intra, input, groups.node, label, sum_only=True)]
    else:
        intra, first = input, []
    acc: list[torch.Tensor] = []
    held: list[torch.Tensor] = []  # buffers of the all-to-all, until it is waited for

    def across() -> list[collectives.Pending]:
        rows = intra.view(N, numel)
        if N == 1:
            acc.append(rows[0].float())
            return []
        assert groups.cross is not None
        k = groups.node_index
        if not quantize:
            recv = torch.empty_like(rows)
            held.extend((rows, recv))
            return [
                collectives.all_to_all(
                    recv, rows, groups.cross, label, then=lambda: acc.append(recv.float().sum(0))
                )
            ]
        rb = row_bytes(numel, block)
        send = torch.empty(N, rb, dtype=torch.uint8, device=input.device)
        pack(rows, block, qdtype, send)
        recv = torch.empty_like(send)
        held.extend((send, recv))

        def summed() -> None:
            values = unpack(recv, numel, block, qdtype, torch.float32)
            values[k] = rows[k]  # this rank's own row, as it was
            acc.append(values.sum(0))

        return [collectives.all_to_all(recv, send, groups.cross, label, then=summed)]

    def finish() -> None:
        total = acc.pop()
        if divide_by is not None:
            total.div_(divide_by)
        output.copy_(total)
        held.clear()

    if collectives.on_side_stream():  # stream order: everything now
        second = across()
        finish()
        work: Any = _Stages(first + second, None, collectives.StreamWork())
        return collectives.Pending(work, label=label, kind="reduce_scatter")
    return collectives.Pending(
        _Stages(first, across), then=finish, label=label, kind="reduce_scatter"
    )


# ---- bytes per link --------------------------------------------------------------------------

MODELS = ("direct", "ring")


class LinkBytes:
    """A collective observer that sums the bytes this rank sends to ranks of its own
    node (``intra``) and of other nodes (``inter``); world rank ``r`` is on node
    ``r // node_size``. Use it as ``observe.add_collective_observer(LinkBytes(2))``
    on every rank and add the ranks' counts for a step's total.

    The model of what each collective kind sends (``B``: the record's bytes, the
    whole of the unsharded side; ``n``: the group's ranks; a piece is ``B / n``):

    - ``"direct"`` (default): every rank sends each other member what that member
      needs straight to it. all-gather: its piece to each; reduce-scatter: the
      member's piece to each; all-reduce: twice that (a reduce-scatter, then an
      all-gather); all-to-all: the member's row to each; broadcast: the root
      sends ``B`` to each. This is the least any algorithm moves for one flat
      collective, and how a node-aware NCCL (tree/NVLS, PAT) behaves to first order.
    - ``"ring"``: the group's ranks in a ring in their order; each rank sends
      ``(n - 1)`` pieces (all-reduce: twice) to the next one, which crosses a
      node boundary where the next rank is on another node. all-to-all and
      broadcast as in ``"direct"``.

    ``by_kind[(kind, "intra" | "inter")]`` splits the sums by collective kind.
    Records with no ranks (made by hand) are skipped.
    """

    def __init__(self, node_size: int, model: str = "direct", rank: int | None = None) -> None:
        if node_size < 1:
            raise ValueError(f"LinkBytes: node_size={node_size} must be at least 1")
        if model not in MODELS:
            raise ValueError(f"LinkBytes: model={model!r}: use one of {MODELS}")
        self.node_size = node_size
        self.model = model
        self.rank = collectives.rank() if rank is None else rank
        self.intra = 0
        self.inter = 0
        self.by_kind: dict[tuple[str, str], int] = {}

    def _add(self, kind: str, dst: int, nbytes: float) -> None:
        link = "intra" if dst // self.node_size == self.rank // self.node_size else "inter"
        b = round(nbytes)
        if link == "intra":
            self.intra += b
        else:
            self.inter += b
        self.by_kind[(kind, link)] = self.by_kind.get((kind, link), 0) + b

    def __call__(self, rec: collectives.CollectiveRecord, pending: Any = None) -> None:
        ranks = rec.ranks
        if not ranks or self.rank not in ranks:
            return
        n = len(ranks)
        if n == 1:
            return
        me = ranks.index(self.rank)
        piece = rec.nbytes / n
        kind = rec.kind
        if kind == "broadcast":
            if me == 0:
                for r in ranks[1:]:
                    self._add(kind, r, rec.nbytes)
            return
        times = 2 if kind == "all_reduce" else 1
        if self.model == "ring" and kind != "all_to_all":
            self._add(kind, ranks[(me + 1) % n], times * (n - 1) * piece)
            return
        for r in ranks:
            if r != self.rank:
                self._add(kind, r, times * piece)
