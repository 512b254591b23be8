"""Initialise a sharded model built on the meta device, identically to a single process.

Why: after ``model.to_empty(device)`` a sharded model's parameters hold
garbage, and calling its init functions directly on DTensor shards draws each
rank's shard from the start of that rank's random stream (on CPU torch has no
offset-based generator), which is neither what a single process would have
made nor, for most shards, sensible. ``materialize`` instead runs the init on
one submodule at a time with full, plain parameters (every rank draws the same
numbers, as a single process would) and keeps each rank's rows. Peak memory is
one submodule's full parameters; the whole model is never unsharded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from .layout.flat_shard import local_of
from .layout.sharded_param import rows_per_rank


def _apply_order(module: nn.Module) -> Iterator[nn.Module]:
    """The order ``module.apply(fn)`` visits modules in: children first."""
    for child in module.children():
        yield from _apply_order(child)
    yield module


def _check_supported(model: nn.Module) -> None:
    """Refuse, before touching anything, what we cannot cut rows for (tensor parallel)."""
    for name, p in model.named_parameters():
        if isinstance(p, DTensor) and tuple(p.placements) not in _SUPPORTED:
            raise NotImplementedError(
                f"materialize supports FSDP and HSDP parameters; {name!r} is placed "
                f"{tuple(p.placements)} (tensor parallel?). Initialise the model on CPU and "
                "load it with shardwise.checkpoint.load_full_state_dict instead"
            )


_SUPPORTED = ((Shard(0),), (Replicate(), Shard(0)))


def _rows_of(full: torch.Tensor, dt: DTensor) -> torch.Tensor:
    mesh = dt.device_mesh
    world, rank = mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1)
    chunk = rows_per_rank(full.shape[0], world)
    return full[rank * chunk : rank * chunk + local_of(dt).shape[0]]


@torch.no_grad()
def materialize(
    model: nn.Module,
    device: torch.device | str | None = None,
    init_fn: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """``to_empty(device)``, then per submodule ``reset_parameters()`` and ``init_fn``.

    Submodules are visited in ``model.apply`` order; each gets its own
    ``reset_parameters()`` (if any) and then ``init_fn(submodule)``. The
    result equals the same call on the unsharded model on one process with the
    same seed. Every rank must call it.
    """
    _check_supported(model)
    if device is not None:
        model.to_empty(device=device)
    for sub in _apply_order(model):
        sharded: list[tuple[str, Any]] = [
            (n, p) for n, p in sub._parameters.items() if isinstance(p, DTensor)
        ]
        fulls = {
            n: nn.Parameter(p.full_tensor(), requires_grad=p.requires_grad) for n, p in sharded
        }
        for n, full in fulls.items():
            sub._parameters[n] = full
        try:
            reset = getattr(sub, "reset_parameters", None)
            if callable(reset):
                reset()
            if init_fn is not None:
                init_fn(sub)
        finally:
            for n, p in sharded:
                local_of(p).copy_(_rows_of(fulls[n].detach(), p))
                sub._parameters[n] = p  # type: ignore[assignment]
    return model
