"""DTensor parameters x FSDP: how a parameter's own split composes with ours.

Two ways in. Parameters that torch's ``parallelize_module`` made DTensors on
a 1-D ``tp`` mesh (``compose_tp``), and, with ``dp_mesh_dims``, parameters
that are DTensors on the full SPMD mesh, replicated on its data-parallel
dimensions (``spmd_mesh``, ``compose_spmd``). Either way the parameter enters
a ``ParamGroup`` as its DTensor-local piece (param_group.py shards that over
dp like any parameter), and a ``TPLayout`` says how the sharded DTensor is
placed and how to wrap a gathered local piece back into the DTensor the
model computes with. docs/design.md has the placement table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement, _StridedShard


@dataclass(frozen=True)
class TPLayout:
    """How a DTensor parameter was split before this group shards its local piece.

    Built by ``compose_tp`` or ``compose_spmd`` (which validate); the group then
    treats the local piece as the parameter and uses this only to make DTensors.
    """

    mesh: DeviceMesh  # the mesh the parameter came on: 1-D tp, or the full SPMD mesh
    placements: tuple[Placement, ...]  # its placements there, e.g. (Shard(d),)
    shape: torch.Size  # the full parameter
    stride: tuple[int, ...]
    sharded_mesh: DeviceMesh  # (dp, tp), or (replicate, shard, tp): the sharded parameter's
    sharded_placements: tuple[Placement, ...]
    dp_dims: frozenset[int] = frozenset()  # SPMD: the data-parallel dims of ``mesh``

    def wrap(self, local: torch.Tensor) -> torch.Tensor:
        """The gathered local piece as the DTensor the model computes with.

        Differentiable: autograd reaches ``_Unsharded`` through it. Its backward
        hands back the local gradient in this placement (a TP ``Partial``
        gradient is all-reduced over tp there, as in plain TP), except on the
        data-parallel dims of an SPMD mesh, where whatever each rank holds is
        what our reduce-scatter reduces (``_KeepDataParallel``).
        """
        if self.dp_dims:
            return _KeepDataParallel.apply(local, self)
        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )

    def spec(self, dtype: torch.dtype) -> DTensorSpec:
        """The unsharded DTensor's spec, for a local piece of ``dtype``."""
        return DTensorSpec(self.mesh, self.placements, TensorMeta(self.shape, self.stride, dtype))

    def constant(self, local: torch.Tensor) -> torch.Tensor:
        """The same DTensor without autograd (no-grad forwards): made once, reused."""
        return DTensor(local, self.spec(local.dtype), requires_grad=False)  # type: ignore[call-arg]


class _KeepDataParallel(torch.autograd.Function):
    """Local piece -> DTensor on the SPMD mesh; its gradient back, left as it is on dp.

    A gradient that DTensor marks ``Partial`` on a data-parallel dim holds this
    rank's contribution; ``from_local``'s backward would all-reduce it over dp,
    and the reduce-scatter that follows would count every rank's share again.
    So, as FSDP2 does: other dims are redistributed to the parameter's
    placements, and on dp dims each rank's local gradient (its contribution,
    or a replicated value) goes to the reduce-scatter, which averages it.
    """

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, layout: TPLayout) -> torch.Tensor:  # type: ignore[override]
        ctx.layout = layout
        spec = layout.spec(local.dtype)
        return DTensor(local.view_as(local), spec, requires_grad=local.requires_grad)  # type: ignore[call-arg]

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        layout: TPLayout = ctx.layout
        if not isinstance(grad, DTensor):  # already local (a plain-tensor use)
            return grad, None
        target = tuple(
            _dp_kept(got) if i in layout.dp_dims else want
            for i, (got, want) in enumerate(zip(grad.placements, layout.placements))
        )
        if target != tuple(grad.placements):
            grad = grad.redistribute(grad.device_mesh, target)
        return grad._local_tensor, None  # type: ignore[attr-defined]


def _dp_kept(pl: Placement) -> Placement:
    """What a gradient may stay as on a dp dim: a pending sum, or replicated."""
    if isinstance(pl, Partial) and pl.reduce_op == "sum":
        return pl
    return Replicate()


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
    root, dp_root = _root_mesh(tp_mesh), _root_mesh(mesh)
    if root is not dp_root and tp_name in (dp_root.mesh_dim_names or ()):
        # DTensor caches specs by equality, so a parameter may carry an equal tp
        # mesh sliced from another root (one built earlier in the process): the
        # same ranks in the same groups compose just as well.
        if dp_root[tp_name] == tp_mesh:
            root = dp_root
    if tp_name is None or not dp_names or root is tp_mesh or dp_root is not root:
        raise ValueError(
            f"parameter {fqn!r} is a DTensor on mesh {tp_mesh}, and the FSDP mesh {mesh} is not "
            "a data-parallel sub-mesh of the same root mesh (was the model parallelized on "
            f"another mesh?); {how}"
        )
    order = list(root.mesh_dim_names or ())
    if set(dp_names) <= set(order) and tp_name in order:
        if max(order.index(n) for n in dp_names) > order.index(tp_name):
            raise ValueError(
                f"parameter {fqn!r}: the tp dimension {tp_name!r} comes before the data-parallel "
                f"dimensions {dp_names} in the mesh {tuple(order)}; put tp last (innermost)"
            )
        sharded_mesh = root[(*dp_names, tp_name)]
    else:
        # Meshes that are not named dims of their root (torchtitan unflattens one
        # world mesh into its axes): the two joined as FSDP2 joins them.
        joined = _joined(mesh, tp_mesh)
        if joined is None:
            raise ValueError(
                f"parameter {fqn!r}: the FSDP mesh's dimensions {dp_names} are not dimensions "
                f"of the root mesh {tuple(order)} (a flattened mesh?); pass a sub-mesh sliced "
                "by name"
            )
        sharded_mesh = joined
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
        sharded_mesh,
        (*replicate, dp_placement, pl),
    )


def _joined(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh | None:
    """One mesh of ``dp_mesh``'s dims then ``tp_mesh``'s (DeviceMesh's own join, torch
    >= 2.10), or None where this torch has none or the two do not join (overlapping,
    or from different roots)."""
    join = getattr(DeviceMesh, "_concatenate", None)
    if join is None:
        return None
    try:
        return join([dp_mesh, tp_mesh])
    except RuntimeError:
        return None


@dataclass(frozen=True)
class SpmdMesh:
    """A full SPMD mesh and which of its dims are data parallel (``dp_mesh_dims``)."""

    mesh: DeviceMesh
    shard: tuple[int, ...]  # dims FSDP shards over (several: flattened, in mesh order)
    replicate: tuple[int, ...]  # HSDP's replicate dims
    dp_mesh: DeviceMesh  # what the group runs on: (shard,) or (replicate, shard), 1 dim each
    # The sharded DTensors' mesh: the SPMD mesh, or, when shard dims are flattened,
    # the SPMD mesh with dp_mesh in their place (as FSDP2 lays it out).
    sharded_mesh: DeviceMesh

    def fold(self, placements: list[Placement]) -> tuple[Placement, ...]:
        """Per-dim placements of ``mesh`` as placements on ``sharded_mesh``."""
        if len(self.shard) == 1:
            return tuple(placements)
        out: list[Placement] = []
        for i, pl in enumerate(placements):
            if i == self.shard[0]:
                out.extend([Replicate(), pl] if self.replicate else [pl])
            elif i not in self.shard and i not in self.replicate:
                out.append(pl)
        return tuple(out)


def spmd_mesh(mesh: Any, dims: Any) -> SpmdMesh:
    """Validate ``fully_shard(mesh=..., dp_mesh_dims=...)`` and build the data-parallel mesh.

    ``dims`` is torch's ``DataParallelMeshDims`` (or anything with its
    ``shard``/``replicate`` fields: a name or a tuple of names each). Several
    names are flattened into one dim; they must be adjacent and in mesh order,
    so that the flattened rank order is the order DTensor lays pieces out in.
    Raises ``ValueError`` naming what is wrong; creates process groups only
    after every check passed (flattening does).
    """
    if not hasattr(dims, "shard") or not hasattr(dims, "replicate"):
        raise TypeError(
            "dp_mesh_dims must be a torch.distributed.fsdp.DataParallelMeshDims (fields shard "
            f"and replicate), got {type(dims).__name__}"
        )
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if not isinstance(mesh, DeviceMesh) or not names:
        raise ValueError(
            "dp_mesh_dims needs mesh= the full SPMD DeviceMesh with mesh_dim_names, e.g. "
            "init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp'))"
        )

    def dims_of(field: str) -> tuple[int, ...]:
        v = getattr(dims, field)
        got = () if v is None else (v,) if isinstance(v, str) else tuple(v)
        for n in got:
            if n not in names:
                raise ValueError(
                    f"dp_mesh_dims.{field} names {n!r}, which is not a dimension of the mesh "
                    f"{names}"
                )
        idx = tuple(names.index(n) for n in got)
        if len(set(idx)) < len(idx) or (
            idx and list(idx) != list(range(idx[0], idx[0] + len(idx)))
        ):
            raise ValueError(
                f"dp_mesh_dims.{field}={v!r}: several dimensions are flattened into one, so "
                f"they must be distinct, adjacent and in the mesh's order {names}"
            )
        return idx

    shard, replicate = dims_of("shard"), dims_of("replicate")
    if not shard:
        raise ValueError(
            "dp_mesh_dims without shard (replicate only: plain data parallelism, no sharding) "
            "is not supported by shardwise; name the dimension to shard over, e.g. "
            "DataParallelMeshDims(shard='dp'), or use torch's replicate() for DDP"
        )
    if set(shard) & set(replicate):
        raise ValueError(f"dp_mesh_dims names {names[shard[0]]!r} as both shard and replicate")
    if replicate and replicate[-1] > shard[0]:
        raise ValueError(
            f"dp_mesh_dims: the replicate dims {tuple(names[i] for i in replicate)} must come "
            f"before the shard dims {tuple(names[i] for i in shard)} in the mesh {names} (HSDP's "
            "(replicate, shard) order)"
        )

    def one_dim(idx: tuple[int, ...]) -> DeviceMesh:
        sub = mesh[tuple(names[i] for i in idx)]
        return sub if len(idx) == 1 else sub._flatten("_".join(names[i] for i in idx))

    if not replicate:
        dp_mesh = one_dim(shard)
    elif len(shard) == 1 and len(replicate) == 1:
        dp_mesh = mesh[(names[replicate[0]], names[shard[0]])]
    else:
        dp_mesh = DeviceMesh._concatenate([one_dim(replicate), one_dim(shard)])  # type: ignore[attr-defined]
    sharded_mesh = mesh
    if len(shard) > 1:
        parts = [
            dp_mesh if i == shard[0] else mesh[names[i]]
            for i in range(mesh.ndim)
            if i == shard[0] or (i not in shard and i not in replicate)
        ]
        sharded_mesh = parts[0] if len(parts) == 1 else DeviceMesh._concatenate(parts)  # type: ignore[attr-defined]
    return SpmdMesh(mesh, shard, replicate, dp_mesh, sharded_mesh)


def compose_spmd(fqn: str, p: Any, spmd: SpmdMesh, dim: int) -> TPLayout:
    """Validate a parameter for ``dp_mesh_dims``; say how our split of dim ``dim`` composes.

    The parameter must be a DTensor on the SPMD mesh, ``Replicate`` on its
    data-parallel dims and ``Shard``/``Replicate`` elsewhere. We split its
    local piece over the (flattened) shard dims: in DTensor's left-to-right
    reading that is ``Shard(dim)`` there, or ``_StridedShard`` when a later
    dim of the mesh splits ``dim`` too (its split happened first); that
    two-level split must be even, as in ``compose_tp``.
    """
    mesh, names = spmd.mesh, tuple(spmd.mesh.mesh_dim_names or ())
    if not isinstance(p, DTensor):
        raise ValueError(
            f"parameter {fqn!r} is a plain tensor; with dp_mesh_dims every parameter must be "
            f"a DTensor on the mesh {names}, replicated on its data-parallel dims (e.g. "
            "distribute_tensor(p, mesh, [Replicate(), ...]) or distribute_module)"
        )
    if p.device_mesh != mesh:
        raise ValueError(
            f"parameter {fqn!r} is a DTensor on the mesh {p.device_mesh}, not on the mesh "
            f"passed to fully_shard {mesh}; with dp_mesh_dims both must be the full SPMD mesh"
        )
    placements = tuple(p.placements)
    dp = set(spmd.shard) | set(spmd.replicate)
    for i, pl in enumerate(placements):
        if i in dp and not pl.is_replicate():
            raise ValueError(
                f"parameter {fqn!r} has {pl} on the data-parallel dim {names[i]!r}; it must be "
                "Replicate() there (fully_shard does the sharding)"
            )
        if i not in dp and not (type(pl) is Shard or pl.is_replicate()):
            raise ValueError(
                f"parameter {fqn!r} has {pl} on mesh dim {names[i]!r}; fully_shard composes with "
                "Shard(d) or Replicate() placements only"
            )
    norm = tuple(
        Shard(pl.dim + p.ndim) if type(pl) is Shard and pl.dim < 0 else pl for pl in placements
    )
    others = [
        i for i, pl in enumerate(norm) if i not in dp and isinstance(pl, Shard) and pl.dim == dim
    ]
    split = [(names[i], pl.dim) for i, pl in enumerate(norm) if i not in dp and type(pl) is Shard]
    if dim != 0 and split:
        raise ValueError(
            f"shard_placement_fn returned Shard({dim}) for {fqn!r}, which mesh dim "
            f"{split[0][0]!r} already splits along dim {split[0][1]}; shardwise splits such "
            "parameters along dim 0 only (return None or Shard(0) for it)"
        )
    if others:
        ways = math.prod(mesh.size(i) for i in (*others, *spmd.shard))
        if p.shape[dim] % ways:
            raise ValueError(
                f"parameter {fqn!r} has {p.shape[dim]} along dim {dim}, split over mesh dims "
                f"{tuple(names[i] for i in sorted((*others, *spmd.shard)))}; shardwise needs "
                f"that two-level split to be even (older DTensor releases describe no other): "
                f"make it a multiple of {ways}"
            )
    sharded = list(norm)
    for i in spmd.shard:
        later = math.prod(mesh.size(j) for j in others if j > i)
        sharded[i] = _StridedShard(dim, split_factor=later) if later > 1 else Shard(dim)
    return TPLayout(
        mesh,
        norm,
        p.shape,
        contiguous_stride(p.shape),
        spmd.sharded_mesh,
        spmd.fold(sharded),
        frozenset(dp),
    )


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))
