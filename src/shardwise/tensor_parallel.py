"""Tensor parallel x FSDP: how a TP parameter's split composes with ours.

Parameters that torch's ``parallelize_module`` made DTensors on a 1-D ``tp``
mesh enter a ``ParamGroup`` as their TP-local pieces (param_group.py shards
those over dp like any parameter). ``compose_tp`` validates such a parameter
against the FSDP mesh and returns a ``TPLayout``: the placements of the
sharded DTensor on the (dp, tp) mesh, and how to wrap a gathered TP-local
piece back into the tp-mesh DTensor the TP module expects. docs/design.md
has the placement table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement, _StridedShard


@dataclass(frozen=True)
class TPLayout:
    """How tensor parallelism split a parameter before this group shards its TP-local piece.

    Built by ``compose_tp`` (which validates); the group then treats the
    TP-local piece as the parameter and uses this only to make DTensors.
    """

    mesh: DeviceMesh  # the 1-D tp mesh the parameter came on
    placements: tuple[Placement, ...]  # its placement there: (Shard(d),) or (Replicate(),)
    shape: torch.Size  # the full parameter
    stride: tuple[int, ...]
    sharded_mesh: DeviceMesh  # (dp, tp), or (replicate, shard, tp): the sharded parameter's
    sharded_placements: tuple[Placement, ...]

    def wrap(self, local: torch.Tensor) -> torch.Tensor:
        """The gathered TP-local piece as the tp-mesh DTensor TP modules expect.

        ``from_local`` is differentiable: autograd reaches ``_Unsharded`` through
        it, and its backward hands back the local gradient in this placement
        (a TP ``Partial`` gradient is all-reduced over tp there, as in plain TP).
        """
        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )

    def constant(self, local: torch.Tensor) -> torch.Tensor:
        """The same DTensor without autograd (no-grad forwards): made once, reused."""
        spec = DTensorSpec(
            self.mesh, self.placements, TensorMeta(self.shape, self.stride, local.dtype)
        )
        return DTensor(local, spec, requires_grad=False)  # type: ignore[call-arg]


def _root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    get = getattr(mesh, "_get_root_mesh", None)  # torch >= 2.9
    if get is not None:
        return get()
    from torch.distributed.device_mesh import _mesh_resources  # torch 2.6 - 2.8

    return _mesh_resources.get_root_mesh(mesh)


def compose_tp(fqn: str, p: DTensor, mesh: DeviceMesh) -> TPLayout:
    """Validate a tensor parallel parameter against the FSDP ``mesh``; say how they compose.

    ``mesh`` (dp, or (replicate, shard) for HSDP) and the parameter's 1-D tp
    mesh must be sub-meshes of one root mesh, with the tp dimension after the
    data-parallel ones. Rows of the TP-local piece are chunked over dp (like
    any parameter). When tp also splits dim 0, that is "tp first, then dp",
    which DTensor's left-to-right placements spell ``_StridedShard(0, tp)`` on
    dp; then dim 0 must split evenly over tp x dp. Raises ``ValueError``
    naming the parameter otherwise.
    """
    tp_mesh, placements = p.device_mesh, tuple(p.placements)
    how = (
        "build one mesh, e.g. mesh = init_device_mesh(device, (dp, tp), "
        "mesh_dim_names=('dp', 'tp')), parallelize with mesh['tp'] and pass "
        "fully_shard(..., mesh=mesh['dp'])"
    )
    if tp_mesh.ndim != 1 or not all(type(pl) is Shard or pl.is_replicate() for pl in placements):
        raise ValueError(
            f"parameter {fqn!r} is a DTensor with placements {placements} on a "
            f"{tp_mesh.ndim}-D mesh; fully_shard composes with 1-D tensor parallelism only "
            "(Shard or Replicate on one tp mesh dimension)"
        )
    tp_name = (tp_mesh.mesh_dim_names or (None,))[0]
    dp_names = tuple(mesh.mesh_dim_names or ())
    if tp_name is not None and tp_name in dp_names:
        raise ValueError(
            f"parameter {fqn!r} is tensor parallel over mesh dimension {tp_name!r}, which is "
            f"also given as the FSDP mesh (dimensions {dp_names}); FSDP must shard over the "
            f"other, data-parallel dimension: {how}"
        )
    root = _root_mesh(tp_mesh)
    if tp_name is None or not dp_names or root is tp_mesh or _root_mesh(mesh) is not root:
        raise ValueError(
            f"parameter {fqn!r} is a DTensor on mesh {tp_mesh}, and the FSDP mesh {mesh} is not "
            "a data-parallel sub-mesh of the same root mesh (was the model parallelized on "
            f"another mesh?); {how}"
        )
    order = list(root.mesh_dim_names or ())
    if not set(dp_names) <= set(order):
        raise ValueError(
            f"parameter {fqn!r}: the FSDP mesh's dimensions {dp_names} are not dimensions of "
            f"the root mesh {tuple(order)} (a flattened mesh?); pass a sub-mesh sliced by name"
        )
    if max(order.index(n) for n in dp_names) > order.index(tp_name):
        raise ValueError(
            f"parameter {fqn!r}: the tp dimension {tp_name!r} comes before the data-parallel "
            f"dimensions {dp_names} in the mesh {tuple(order)}; put tp last (innermost)"
        )
    pl = placements[0]
    if isinstance(pl, Shard) and pl.dim < 0:
        pl = Shard(pl.dim + p.ndim)
    tp_size, dp_size = tp_mesh.size(), mesh.size(mesh.ndim - 1)
    dp_placement: Placement = Shard(0)
    if isinstance(pl, Shard) and pl.dim == 0 and tp_size > 1:
        # DTensor's _StridedShard needs even pieces (torch 2.6 checks it; later
        # releases accept some uneven splits, but not all of them line up).
        if p.shape[0] % (tp_size * dp_size):
            raise ValueError(
                f"parameter {fqn!r} has {p.shape[0]} rows, split over tp={tp_size} and then "
                f"over dp={dp_size}; DTensor describes that two-level split of dim 0 only when "
                f"it is even (else full_tensor and checkpoints would be wrong): make dim 0 a "
                f"multiple of {tp_size * dp_size}"
            )
        dp_placement = _StridedShard(0, split_factor=tp_size)
    replicate: tuple[Placement, ...] = (Replicate(),) if mesh.ndim == 2 else ()
    return TPLayout(
        tp_mesh,
        (pl,),
        p.shape,
        contiguous_stride(p.shape),
        root[(*dp_names, tp_name)],
        (*replicate, dp_placement, pl),
    )


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))
