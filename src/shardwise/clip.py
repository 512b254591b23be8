"""Gradient clipping over sharded gradients, on any mix of meshes.

Why this exists next to ``torch.nn.utils.clip_grad_norm_``: torch's version
computes one norm per parameter and stacks them; DTensor norms on different
meshes (modules sharded over different meshes, TP x FSDP layouts beside plain
FSDP ones, ignored replicated parameters beside sharded ones) cannot be
stacked, and each DTensor norm is its own reduction. Here every rank sums
``|g|^p`` over its local shards in one fused pass, weighting each shard by how
many ranks hold a copy of it, and one all-reduce over the world gives the
total. Same result as a single process; one collective per call.

Assumption: every mesh is the default process group's world or a sub-mesh
of it whose complement holds copies (true for FSDP, HSDP and TP x FSDP on one
root mesh). Plain-tensor gradients are taken as replicated on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor, Replicate

from .comm import collectives
from .layout.flat_shard import local_of
from .runtime.step_in_backward import refuse_stepped_in_backward


def _copies(g: torch.Tensor, world: int) -> int:
    """How many ranks hold this exact local shard.

    ``Shard`` and ``_StridedShard`` (TP x FSDP) pieces are disjoint; copies come
    from ``Replicate`` mesh dimensions (HSDP's replicas, TP-replicated norms and
    biases) and from the ranks outside a sub-mesh (a parameter TP left plain is
    sharded over dp only, so every tp rank holds the same piece).
    """
    if not isinstance(g, DTensor):
        return world
    n = world // g.device_mesh.size()
    for dim, placement in enumerate(g.placements):
        if isinstance(placement, Replicate):
            n *= g.device_mesh.size(dim)
    return n


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip gradients in place to total norm ``max_norm``; return the total norm (plain tensor)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    refuse_stepped_in_backward(params)
    grads = [p.grad for p in params if p.grad is not None]
    world = collectives.world_size()
    locals_ = [local_of(g) for g in grads]
    device = locals_[0].device if locals_ else torch.device("cpu")
    norm_type = float(norm_type)
    if norm_type == float("inf"):
        total = torch.zeros((), device=device)
        for t in locals_:
            if t.numel():
                total = torch.maximum(total, t.abs().max().float())
        if world > 1:
            collectives.all_reduce(total, None, "clip_grad_norm_", op="max").wait()
    else:
        # Group by copy count so each group is one fused foreach norm.
        by_copies: dict[int, list[torch.Tensor]] = {}
        for g, t in zip(grads, locals_):
            if t.numel():
                by_copies.setdefault(_copies(g, world), []).append(t)
        total = torch.zeros((), device=device, dtype=torch.float32)
        for copies, ts in by_copies.items():
            norms = torch._foreach_norm(ts, norm_type)
            total += torch.stack([n.float() for n in norms]).pow(norm_type).sum() / copies
        if world > 1:
            collectives.all_reduce(total, None, "clip_grad_norm_").wait()
        total = total.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}); "
            "pass error_if_nonfinite=False to clip anyway"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if locals_:
        torch._foreach_mul_([t for t in locals_ if t.numel()] or locals_, coef.to(locals_[0].dtype))
    return total
