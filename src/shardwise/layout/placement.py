"""Where each parameter of one ``fully_shard`` call is sharded: a dim, and a mesh.

``shard_placement_fn(param)`` answers per parameter, as in FSDP2:

- ``None``: ``Shard(0)`` over the call's ``mesh``;
- ``Shard(dim)``: split along ``dim`` (evenly, unless dim 0) over the call's mesh;
- ``ShardPlacementResult(placement, mesh)`` (shardwise's, below) or torch's
  ``ShardPlacementResult(placement, mesh_info)`` (whose ``mesh_info.mesh`` is
  the mesh): that split over a mesh of its own.

Why per-parameter meshes: a mixture-of-experts block under expert parallelism
(torchtitan's EP > 1) shards its routed experts over the expert-data-parallel
mesh (the ranks that hold the same experts) and everything else over the
data-parallel mesh, in one ``fully_shard`` call, so that the block is still
gathered, computed and reduced as one module. The group keeps one part per
mesh (param_group.py); each part gathers and reduces over its own process
group.

Alternatives considered: one ``fully_shard`` call per mesh on the same module
(what a user without this would try) gives a module two lifecycles whose
hooks would both gather before it runs and both reduce after it, in an order
neither controls; sharding the experts as a child module (``fully_shard(
block.moe.experts, mesh=edp)``) works and is what shardwise did before, but
torchtitan's code, which many people run unchanged, asks for the placement
function.

Everything here is checked before ``fully_shard`` changes anything; each
refusal names the parameter and the module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard


@dataclass(frozen=True)
class ShardPlacementResult:
    """What ``shard_placement_fn`` may return for one parameter: split it along
    ``placement`` (``Shard(dim)``; None: ``Shard(0)``) over ``mesh`` (None: the
    ``fully_shard`` call's mesh). torch's class of the same name, whose
    ``mesh_info.mesh`` is the mesh, is accepted too."""

    placement: Shard | None = None
    mesh: DeviceMesh | None = None


PlacementFn = Callable[[nn.Parameter], Any]


def _mesh_of(result: Any) -> DeviceMesh | None:
    """The mesh a result names: ours (``mesh``) or torch's (``mesh_info.mesh``)."""
    if isinstance(result, ShardPlacementResult):
        return result.mesh
    info = getattr(result, "mesh_info", None)
    return getattr(info, "mesh", None) if info is not None else None


def is_placement_result(result: Any) -> bool:
    """Ours, or torch's ``ShardPlacementResult`` (a placement and a mesh info)."""
    return isinstance(result, ShardPlacementResult) or (
        hasattr(result, "placement") and hasattr(result, "mesh_info")
    )


def resolve(
    named: Sequence[tuple[str, nn.Parameter, Any]],
    mesh: DeviceMesh,
    fn: PlacementFn | None,
    module: str,
    tp: Sequence[Any] | None = None,
) -> tuple[list[int] | None, list[DeviceMesh] | None]:
    """Each parameter's split dim and mesh from ``fn``: ``(dims, meshes)``, None for
    either when every parameter has the default (dim 0; the call's ``mesh``).
    ``tp[i]``: whether tensor (or expert) parallelism made ``named[i]`` a DTensor
    (then dim 0 only). ValueError naming ``module`` and the parameter otherwise."""
    if fn is None:
        return None, None
    dims: list[int] = []
    meshes: list[DeviceMesh] = []
    for i, (fqn, p, _) in enumerate(named):
        result = fn(p)
        where = mesh
        placement = result
        if is_placement_result(result):
            placement = result.placement
            own = _mesh_of(result)
            where = own if own is not None else mesh
            _check_mesh(where, mesh, fqn, module)
        if placement is None:
            dim = 0
        elif isinstance(placement, Shard):
            dim = _check_dim(placement, p, fqn, module, where, tp is not None and bool(tp[i]))
        else:
            raise ValueError(
                f"shard_placement_fn returned {result!r} for {fqn!r} of {module}; return "
                "Shard(dim), None (Shard(0)), or ShardPlacementResult(placement, mesh)"
            )
        dims.append(dim)
        meshes.append(where)
    one_mesh = all(m is mesh or m == mesh for m in meshes)
    return dims, None if one_mesh else meshes


def _check_mesh(where: Any, mesh: DeviceMesh, fqn: str, module: str) -> None:
    """A parameter's own mesh: a 1-D or 2-D DeviceMesh on the call's device type,
    containing this rank (a mesh of other ranks could never gather it here)."""
    if not isinstance(where, DeviceMesh) or where.ndim not in (1, 2):
        raise ValueError(
            f"shard_placement_fn returned a mesh for {fqn!r} of {module} that is not a 1-D "
            f"(FSDP) or 2-D (HSDP) DeviceMesh: {where!r}"
        )
    if where.device_type != mesh.device_type:
        raise ValueError(
            f"shard_placement_fn put {fqn!r} of {module} on a {where.device_type} mesh; the "
            f"fully_shard call's mesh is {mesh.device_type}"
        )
    if where.get_coordinate() is None:
        raise ValueError(
            f"shard_placement_fn put {fqn!r} of {module} on a mesh that does not contain "
            f"this rank (ranks {where.mesh.flatten().tolist()}); every rank that runs the "
            "module must hold a shard of each of its parameters"
        )


def _check_dim(
    placement: Shard, p: nn.Parameter, fqn: str, module: str, mesh: DeviceMesh, tp: bool
) -> int:
    dim = placement.dim + p.dim() if placement.dim < 0 else placement.dim
    if not 0 <= dim < p.dim():
        raise ValueError(
            f"shard_placement_fn returned Shard({placement.dim}) for {fqn!r} of {module}, "
            f"which has {p.dim()} dims {tuple(p.shape)}"
        )
    if dim != 0 and tp:
        raise ValueError(
            f"shard_placement_fn returned Shard({dim}) for the tensor parallel parameter "
            f"{fqn!r} of {module}; shardwise splits TP parameters along dim 0 only"
        )
    world = mesh.size(mesh.ndim - 1)
    if dim != 0 and p.shape[dim] % world:
        raise ValueError(
            f"shard_placement_fn: {fqn!r} of {module} has size {p.shape[dim]} along dim {dim}, "
            f"which does not split evenly over {world} ranks; pick a dim it divides (or "
            "Shard(0), which may be uneven)"
        )
    return dim
