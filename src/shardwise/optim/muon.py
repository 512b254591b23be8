"""``Muon``: torch's Muon, with each sharded matrix orthogonalized once across the job.

Why: Muon's update is the Newton-Schulz orthogonalization of each weight matrix's
momentum, which needs the whole matrix. On DTensor shards, ``torch.optim.Muon``
runs it through DTensor on every rank (each rank gathers and orthogonalizes every
matrix: the job does the work ``world`` times). Here each matrix has one owner in
its shard group, and the owners are spread so that the Newton-Schulz work per rank
is balanced (greedy, largest first, by its exact matmul count).

One step, per shard group (the dp mesh dimension; under HSDP each replica does the
same work, the replicas' shards being equal):

1. momentum, locally on each rank's shard (it is elementwise): the buffer moves
   toward the gradient, the update is the buffer or the Nesterov blend, in bf16 (the
   dtype torch's Newton-Schulz starts with, so sending it is exact and half the bytes);
2. one all-to-all per bucket sends each rank's pieces of a matrix to its owner only
   (a non-owner receives no whole matrix), all buckets issued at once;
3. as each bucket arrives, its owners assemble their matrices (pieces in rank order
   along the split dimension, padded like ``torch.chunk``: flat_shard.py) and run
   torch's own Newton-Schulz on them; the bucket's update goes back by a second
   all-to-all while the next bucket is orthogonalized;
4. each rank applies the weight decay (while the updates travel) and its piece of
   the update, with the learning rate adjusted by the global shape.

The arithmetic on each element is torch's, in torch's order, and the
orthogonalization runs on the same whole matrix: the result equals one process's
``torch.optim.Muon`` given the same gradients. Plain tensors (one process, a
parameter not sharded) and one-rank shard groups step exactly as torch's Muon does.
The state is torch's (``momentum_buffer``, a DTensor sharded like the parameter),
so ``state_dict``, ``load_state_dict`` and DCP's ``get_optimizer_state_dict`` see
no difference.

Refused at construction, one ``ValueError`` naming the parameter: a parameter that
is not 2-D (they belong in an AdamW group), a DTensor that shardwise did not shard,
and a shardwise parameter that tensor parallelism split first (the matrix to
orthogonalize is the global one, spread over two mesh dimensions; not done yet).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim._muon import (  # torch's own, so the arithmetic is torch's
    DEFAULT_A,
    DEFAULT_B,
    DEFAULT_C,
    DEFAULT_NS_STEPS,
    EPS,
    _adjust_lr,
    _zeropower_via_newtonschulz,
)
from torch.optim.optimizer import ParamsT, _to_scalar

from .. import api
from ..comm import collectives
from ..layout.flat_shard import local_of
from ..layout.sharded_param import ShardedParam

__all__ = ["Muon", "newton_schulz_flops", "owners"]

# Elements (bf16) per all-to-all: small enough that a bucket's orthogonalization
# overlaps the next bucket's gather and the previous one's scatter, large enough that
# each collective moves megabytes. A model under it is one gather and one scatter.
BUCKET_NUMEL = 1 << 25


def newton_schulz_flops(
    shape: tuple[int, ...] | torch.Size, ns_steps: int = DEFAULT_NS_STEPS
) -> int:
    """Floating-point operations of torch's Newton-Schulz on a matrix of ``shape``
    (as ``torch.utils.flop_counter`` counts them): per iteration, with a = min(m, n),
    b = max(m, n), the Gram matrix (2a²b), its square (2a³) and the product with
    the matrix (2a²b)."""
    a, b = sorted(shape[:2])
    return ns_steps * (4 * a * a * b + 2 * a * a * a)


def owners(costs: list[int], world: int) -> list[int]:
    """The owner rank of each matrix: largest cost first to the least loaded rank
    (ties: the lower index, the lower rank), deterministic on every rank."""
    loads = [(0, r) for r in range(world)]
    out = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, r = heapq.heappop(loads)
        out[i] = r
        heapq.heappush(loads, (load + costs[i], r))
    return out


@dataclass
class _Matrix:
    """One sharded matrix in a step: its update piece on the way out, its result back."""

    param: DTensor
    update: torch.Tensor  # this rank's piece of the update, bf16, contiguous
    lr: float
    weight_decay: float
    ns: tuple[Any, int, float]  # coefficients, steps, eps
    adjust_lr_fn: str | None
    dim: int  # the split dimension
    world: int
    owner: int = 0
    result: torch.Tensor | None = field(default=None)  # this rank's piece of the orthogonalized

    def sizes(self) -> list[int]:
        """Each rank's piece along ``dim`` (torch.chunk's split, flat_shard.py's layout)."""
        n = self.param.shape[self.dim]
        chunk = -(-n // self.world)
        return [max(0, min(chunk, n - r * chunk)) for r in range(self.world)]

    def numels(self) -> list[int]:
        other = self.param.numel() // max(1, self.param.shape[self.dim])
        return [s * other for s in self.sizes()]

    def piece_shape(self, size: int) -> list[int]:
        shape = list(self.param.shape)
        shape[self.dim] = size
        return shape


class Muon(torch.optim.Muon):
    """``torch.optim.Muon`` (same arguments, defaults, state and results) whose sharded
    matrices are each orthogonalized by one rank of their shard group (this file's
    docstring says how). Non-2-D parameters, embeddings and the head belong in an
    AdamW group, as with torch's: ``docs/optimizers.md``."""

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
        eps: float = EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
    ) -> None:
        super().__init__(
            params,
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=ns_coefficients,
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, after checking every parameter of the group (before it is added)."""
        params = param_group["params"]
        if isinstance(params, torch.Tensor):
            params = [params]
        elif not isinstance(params, set):  # torch's refuses a set, by its own error
            params = list(params)
        param_group["params"] = params
        sharded = _shardwise_params()
        for i, p in enumerate(params):
            _check(p, f"parameter {i} of param group {len(self.param_groups)}", sharded)
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One step: torch's Muon on every parameter, each sharded matrix orthogonalized
        by its owner only."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        by_group: dict[Any, list[_Matrix]] = {}  # shard process group -> its matrices, in order
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            bufs: list[torch.Tensor] = []
            self._init_group(group, params, grads, bufs)
            lr = _to_scalar(group["lr"])
            momentum, nesterov = group["momentum"], group["nesterov"]
            ns = (group["ns_coefficients"], group["ns_steps"], group["eps"])
            for p, g, buf in zip(params, grads, bufs):
                if g.ndim != 2:
                    raise ValueError("Param gradient must be a 2D matrix")
                if not isinstance(p, DTensor):
                    _step_plain(p, g, buf, lr, group, momentum, nesterov, ns)
                    continue
                # Momentum on the local shards: elementwise, so torch's result piece by piece.
                lb, lg = local_of(buf), local_of(g)
                lb.lerp_(lg, 1 - momentum)
                update = lg.lerp(lb, momentum) if nesterov else lb
                mesh = p.device_mesh
                dim = _split_dim(p)
                m = _Matrix(
                    p,
                    update.bfloat16().contiguous(),
                    lr,
                    group["weight_decay"],
                    ns,
                    group["adjust_lr_fn"],
                    dim,
                    mesh.size(mesh.ndim - 1),
                )
                by_group.setdefault(mesh.get_group(mesh.ndim - 1), []).append(m)
        for pg, matrices in by_group.items():
            _orthogonalize(matrices, pg)
        return loss


def _step_plain(
    p: torch.Tensor,
    g: torch.Tensor,
    buf: torch.Tensor,
    lr: float,
    group: dict[str, Any],
    momentum: float,
    nesterov: bool,
    ns: tuple[Any, int, float],
) -> None:
    """torch's ``_single_tensor_muon`` for one parameter, line for line."""
    buf.lerp_(g, 1 - momentum)
    update = g.lerp(buf, momentum) if nesterov else buf
    update = _zeropower_via_newtonschulz(update, ns[0], ns[1], ns[2])
    p.mul_(1 - lr * group["weight_decay"])
    p.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))


def _split_dim(p: DTensor) -> int:
    placement = p.placements[-1]
    assert isinstance(placement, Shard)  # _check made sure
    return placement.dim


def _buckets(matrices: list[_Matrix]) -> Iterator[list[_Matrix]]:
    bucket: list[_Matrix] = []
    n = 0
    for m in matrices:
        bucket.append(m)
        n += m.param.numel()
        if n >= BUCKET_NUMEL:
            yield bucket
            bucket, n = [], 0
    if bucket:
        yield bucket


def _orthogonalize(matrices: list[_Matrix], pg: Any) -> None:
    """Orthogonalize ``matrices`` (every rank of shard group ``pg`` lists the same ones,
    in the same order) at their owners and apply each rank's piece of the result."""
    world = matrices[0].world
    rank = matrices[0].param.device_mesh.get_local_rank(matrices[0].param.device_mesh.ndim - 1)
    shapes = [m.param.shape for m in matrices]
    for m, o in zip(matrices, owners([newton_schulz_flops(s) for s in shapes], world)):
        m.owner = o
    buckets = list(_buckets(matrices))
    if world == 1:
        for m in matrices:
            m.result = _newton_schulz(m, m.update)
    else:
        gathers = [_gather(b, rank, pg) for b in buckets]
        scatters = []
        for bucket, (pending, received) in zip(buckets, gathers):
            pending.wait()
            scatters.append(_scatter(bucket, rank, pg, received))
        for m in matrices:  # the weight decay while the updates travel
            _decay(m)
        for pending, finish in scatters:
            pending.wait()
            finish()
    for m in matrices:
        if world == 1:
            _decay(m)
        lp = local_of(m.param)
        if lp.numel():
            assert m.result is not None
            lp.add_(m.result, alpha=-_adjust_lr(m.lr, m.adjust_lr_fn, m.param.shape))
        m.result = None


def _decay(m: _Matrix) -> None:
    lp = local_of(m.param)
    if lp.numel():
        lp.mul_(1 - m.lr * m.weight_decay)


def _newton_schulz(m: _Matrix, full: torch.Tensor) -> torch.Tensor:
    coefficients, steps, eps = m.ns
    return _zeropower_via_newtonschulz(full, coefficients, steps, eps)


def _gather(bucket: list[_Matrix], rank: int, pg: Any) -> tuple[collectives.Pending, torch.Tensor]:
    """Issue the all-to-all that brings each matrix's pieces to its owner: what this rank
    sends member j is its pieces of the matrices j owns, in bucket order."""
    world = bucket[0].world
    send = [[m.update.view(-1) for m in bucket if m.owner == j] for j in range(world)]
    in_splits = [sum(t.numel() for t in parts) for parts in send]
    mine = [m for m in bucket if m.owner == rank]
    out_splits = [sum(m.numels()[j] for m in mine) for j in range(world)]
    flat = [t for parts in send for t in parts]
    device = bucket[0].update.device
    inp = torch.cat(flat) if flat else torch.empty(0, dtype=torch.bfloat16, device=device)
    out = torch.empty(sum(out_splits), dtype=torch.bfloat16, device=device)
    return collectives.all_to_all_uneven(out, inp, out_splits, in_splits, pg, "muon gather"), out


def _scatter(
    bucket: list[_Matrix], rank: int, pg: Any, received: torch.Tensor
) -> tuple[collectives.Pending, Any]:
    """Orthogonalize the matrices this rank owns (from ``received``, laid out member by
    member as ``_gather`` sent it) and issue the all-to-all that returns each member its
    pieces; the returned function puts each matrix's piece in its ``result``."""
    world = bucket[0].world
    mine = [m for m in bucket if m.owner == rank]
    # received: member j's pieces of my matrices, in bucket order, member after member.
    pieces: list[list[torch.Tensor]] = [[] for _ in mine]
    at = 0
    for j in range(world):
        for k, m in enumerate(mine):
            size = m.sizes()[j]
            n = m.numels()[j]
            pieces[k].append(received[at : at + n].view(m.piece_shape(size)))
            at += n
    send: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for k, m in enumerate(mine):
        full = torch.cat(pieces[k], dim=m.dim)
        ortho = _newton_schulz(m, full)
        start = 0
        for j, size in enumerate(m.sizes()):
            send[j].append(ortho.narrow(m.dim, start, size).reshape(-1))
            start += size
    in_splits = [sum(t.numel() for t in parts) for parts in send]
    out_splits = [sum(m.numels()[rank] for m in bucket if m.owner == j) for j in range(world)]
    device = bucket[0].update.device
    flat = [t for parts in send for t in parts]
    inp = torch.cat(flat) if flat else torch.empty(0, dtype=torch.bfloat16, device=device)
    out = torch.empty(sum(out_splits), dtype=torch.bfloat16, device=device)
    pending = collectives.all_to_all_uneven(out, inp, out_splits, in_splits, pg, "muon scatter")

    def finish() -> None:
        at = 0
        for j in range(world):
            for m in bucket:
                if m.owner != j:
                    continue
                n = m.numels()[rank]
                m.result = out[at : at + n].view(m.piece_shape(m.sizes()[rank]))
                at += n

    return pending, finish


# ---- what construction accepts ------------------------------------------------------------


def _shardwise_params() -> dict[int, ShardedParam]:
    """Every live shardwise parameter, by the id of its sharded DTensor."""
    return {id(sp.sharded): sp for g in api.live_groups() for sp in g.params}


def _check(p: Any, where: str, sharded: dict[int, ShardedParam]) -> None:
    """One clear ValueError for a parameter this optimizer cannot step as torch's Muon."""
    if not isinstance(p, torch.Tensor):
        return  # torch's add_param_group names it
    sp = sharded.get(id(p))
    name = f"{where} ({sp.fqn!r})" if sp is not None else where
    if p.ndim != 2:
        raise ValueError(
            f"shardwise.optim.Muon: {name} has shape {tuple(p.shape)}; Muon orthogonalizes 2-D "
            "matrices only: put biases, norms and other non-2-D parameters in an AdamW group "
            "(docs/optimizers.md)"
        )
    if not isinstance(p, DTensor):
        return
    if sp is None:
        raise ValueError(
            f"shardwise.optim.Muon: {name} is a DTensor with placements {tuple(p.placements)} "
            "that shardwise did not shard; the owner of each matrix gathers it from "
            "shardwise's layout. Shard its module with shardwise.fully_shard (and build the "
            "optimizer after), or use torch.optim.Muon for it"
        )
    if sp.tp is not None or not _plain_layout(p):
        raise ValueError(
            f"shardwise.optim.Muon: {name} is split by tensor parallelism before shardwise "
            f"shards it (placements {tuple(p.placements)}); orthogonalizing its global "
            "matrix across the tp and dp dimensions is not supported yet: use torch.optim.Muon "
            "for these parameters"
        )


def _plain_layout(p: DTensor) -> bool:
    """(Shard(d),) on a 1-D mesh, or (Replicate(), Shard(d)) under HSDP."""
    pl = tuple(p.placements)
    if len(pl) == 1:
        return isinstance(pl[0], Shard) and type(pl[0]) is Shard
    return (
        len(pl) == 2
        and isinstance(pl[0], Replicate)
        and isinstance(pl[1], Shard)
        and type(pl[1]) is Shard
    )
