"""Where one group's parameters live: the flat shard, the unsharded storage, the views.

Why a flat shard: each rank keeps its pieces of all of a module's parameters
in one contiguous buffer, and every sharded parameter's local tensor is a view
into it. The all-gather inputs are then its slots themselves (or one cast of
them to ``param_dtype``): no copy-in. Each parameter is gathered straight into
its own unsharded storage, all of them in one grouped collective: split along
dim 0, the ranks' pieces laid rank after rank are the parameter, so no
copy-out follows. Where one flat rank-major buffer must be gathered instead
(another split dim, a custom all-gather or allocator, a post-forward group),
one ``split_with_sizes_copy`` lays it out. A one-rank mesh in the parameters'
own dtype needs no gather at all (the unsharded parameters alias the shards).

Why resize storage instead of dropping it: autograd saves the unsharded
parameters for backward. Freeing their storage (resize to 0) leaves those
saved tensors as valid objects holding no memory; the next gather refills the
same storage, so backward sees the data again without keeping it alive between
forward and backward. The unsharded parameter tensors are made with ``set_``
so they have their own version counters: refilling the storage through the
flat buffer never trips autograd's in-place checks.

Tensor parallel parameters (DTensors on a ``tp`` mesh, from torch's
``parallelize_module``) are sharded like any other, but what a group shards
is each rank's TP-local piece: the flat layout, the all-gather and the
reduce-scatter only ever see TP-local tensors, over the dp group. ``TPLayout``
(tensor_parallel.py) says how the two splits compose into one DTensor on the
(dp, tp) mesh, and wraps the gathered TP-local piece back into the DTensor the
TP module expects.

Why an object of its own: ``ParamGroup`` (param_group.py) runs a group's life
(gather, attach, reshard, reduce) and holds one ``FlatShard``, which says where
every byte of it lives and builds or rebuilds that layout (construction,
``to_empty``, ``load_state_dict(assign=True)``). The gather strategies and the
reduction (gather.py, reduce.py) are given the layout: they read its views and
fill its storage, and know no group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement

from . import offload
from .extensions import Extension, has_hooks
from .labels import label
from .offload import CPUOffloadPolicy
from .precision import MixedPrecisionPolicy, resolve_dtypes
from .sharded_param import ShardedParam
from .tensor_parallel import TPLayout, contiguous_stride


def local_of(t: Any) -> Any:
    """The local tensor of a DTensor (a plain tensor: itself), without going
    through autograd (``to_local`` would: this runs on the hot path)."""
    return t._local_tensor if isinstance(t, DTensor) else t


class InPlaceOperands(NamedTuple):
    """The in-place gather's operands, one entry per non-empty parameter split along
    dim 0: its gather output, this rank's slot in it, the shard it gathers from,
    and the slot's size. The shards tile the flat shard in order, so the sizes
    split an uploaded copy of it."""

    outputs: list[torch.Tensor]
    slots: list[torch.Tensor]
    shards: list[torch.Tensor]
    sizes: list[int]


class FlatShard:
    """The memory layout of one group's parameters (held by its ``ParamGroup``)."""

    flat: torch.Tensor  # this rank's shards, every parameter's slot end to end
    unsharded_flat: torch.Tensor  # the gathered parameters' storage (or the flat, aliased)
    aliased: bool  # one rank in the parameters' own dtype: nothing to gather
    shard_locals: list[torch.Tensor]  # each sharded parameter's local tensor, as built
    copy_out: list[torch.Tensor]  # per parameter: its rank-major view of the unsharded storage
    in_place: InPlaceOperands

    def __init__(
        self,
        named: Sequence[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]],
        mesh: DeviceMesh,
        device: torch.device,
        mp_policy: MixedPrecisionPolicy,
        offload_policy: CPUOffloadPolicy | None,
        name: str,
        tp: Sequence[TPLayout | None] | None = None,
        dims: Sequence[int] | None = None,
    ) -> None:
        """``device``: where gathered parameters live (the shards too, unless
        offloaded); ``mp_policy``, ``offload_policy``: the group's (fixed by
        ``fully_shard``); ``name``: the group's label; ``tp[i]``: how tensor parallelism
        split ``named[i]`` (None: a plain parameter); ``dims[i]``: the dimension
        it is split along (default 0)."""
        self.mesh = mesh
        self.world = mesh.size(mesh.ndim - 1)
        self.rank = mesh.get_local_rank(mesh.ndim - 1)
        self.device = device
        self.mp_policy = mp_policy
        self.offload_policy = offload_policy
        self.label = name
        self.orig_dtype = named[0][1].dtype
        # Derived from the policy and the shards' dtype (which model.to(dtype) changes).
        self.compute_dtype, self.reduce_dtype = resolve_dtypes(mp_policy, self.orig_dtype)
        layouts = list(tp) if tp is not None else [None] * len(named)
        self.has_tp = any(t is not None for t in layouts)
        self.params: list[ShardedParam] = []
        offset = 0
        for i, ((fqn, p, locs), layout) in enumerate(zip(named, layouts)):
            shape = local_of(p).shape if layout is not None else p.shape
            dim = dims[i] if dims is not None else 0
            sp = ShardedParam(
                fqn, locs, shape, p.requires_grad, self.world, self.rank, offset, dim, layout
            )
            sp.index = sp.pos = len(self.params)
            if layout is None and has_hooks(p):  # a subclass that gathers itself (extensions.py)
                sp.ext = Extension(fqn, p)
            self.params.append(sp)
            offset += sp.slot
        self.self_gathering = any(sp.ext is not None for sp in self.params)
        self.shard_numel = offset
        # Fixed with the parameters, read by every reduction (reduce.py).
        self.slots = [sp.slot for sp in self.params]
        self.split_dim0 = all(sp.dim == 0 for sp in self.params)  # no piece to move first
        self.whole_pieces = all(sp.local_numel == sp.slot for sp in self.params)  # no padding
        self.local_shapes = [sp.local_shape for sp in self.params]
        self._shard(named)

    def placements(self, sp: ShardedParam) -> tuple[Placement, ...]:
        """The sharded DTensor's placements: ``Shard(dim)``, replicated first under HSDP."""
        shard = Shard(sp.dim)
        return (Replicate(), shard) if self.mesh.ndim == 2 else (shard,)

    def _device_for(self, src: torch.device) -> torch.device:
        """Where the shards of parameters now on ``src`` go."""
        if src.type == "meta":
            return src
        return torch.device("cpu") if self.offload_policy is not None else self.device

    def _shard(self, named: Sequence[tuple[str, nn.Parameter, Any]]) -> None:
        """Copy this rank's rows of each parameter into a fresh flat shard.

        Deterministic and free of random state: every rank slices the same
        tensor the same way. Padding stays zero so gathered padding is too.
        """
        device = self._device_for(named[0][1].device)
        rows: list[torch.Tensor | None] = []
        for sp, (_, p, _) in zip(self.params, named):
            src = local_of(p) if sp.tp is not None else p
            rows.append(None if device.type == "meta" else sp.my_piece(src.detach()))
        self._build(device, rows, [sp.requires_grad for sp in self.params])

    def _build(
        self, device: torch.device, rows: list[torch.Tensor | None], requires_grad: list[bool]
    ) -> None:
        """A new flat shard on ``device`` holding ``rows[i]`` for parameter i (None: zeros),
        and new sharded ``nn.Parameter``s viewing it, installed in the modules."""
        self.flat = self._new_flat(device)
        self.shard_locals = []
        for sp, r, grad in zip(self.params, rows, requires_grad):
            view = self._flat_view(sp)
            if r is not None and sp.local_numel:
                view.copy_(r)
            if sp.tp is None:
                mesh, placements, shape = self.mesh, self.placements(sp), sp.shape
            else:
                mesh, placements, shape = sp.tp.sharded_mesh, sp.tp.sharded_placements, sp.tp.shape
            # The constructor, not from_local: that would move an offloaded
            # shard to the mesh's device.
            meta = TensorMeta(shape, contiguous_stride(shape), view.dtype)
            local = view if sp.ext is None else sp.ext.wrap(view)
            dt = DTensor(local, DTensorSpec(mesh, tuple(placements), meta), requires_grad=False)  # type: ignore[call-arg]
            sp.sharded = nn.Parameter(dt, requires_grad=grad)
            self.shard_locals.append(local_of(sp.sharded))
            sp.install(sp.sharded)
        self._make_unsharded_views(device)

    def load_assigned(self, state_dict: dict[str, Any], keys: list[list[str]]) -> bool:
        """``load_state_dict(sd, assign=True)``: the loaded values become the shards.

        This is how a model sharded on the meta device receives its weights
        (DCP's ``set_model_state_dict(..., broadcast_from_rank0=True)`` loads
        with assign). The values may be DTensors laid out like our shards or
        full tensors (this rank keeps its rows); everything is checked before
        anything changes. A new flat shard is built on the values' device,
        and the state dict's entries are replaced by the new sharded
        parameters so that ``nn.Module``'s own assignment installs exactly
        them. ``keys[i]``: every state-dict key of parameter i (tied weights
        have several). True if anything was loaded (the flat shard is new).
        """
        rows: list[torch.Tensor | None] = []
        for sp, ks in zip(self.params, keys):
            key = next((k for k in ks if k in state_dict), None)
            rows.append(None if key is None else self._rows_of(sp, key, state_dict[key]))
        loaded = [r for r in rows if r is not None]
        if not loaded:
            return False
        device = self._device_for(loaded[0].device)
        if not self.flat.is_meta:  # parameters the state dict lacks keep their values
            rows = [self._flat_view(sp) if r is None else r for sp, r in zip(self.params, rows)]
        self._build(device, rows, [sp.sharded.requires_grad for sp in self.params])
        for sp, ks in zip(self.params, keys):
            for k in ks:
                if k in state_dict:
                    state_dict[k] = sp.sharded
        return True

    def _rows_of(self, sp: ShardedParam, key: str, value: Any) -> torch.Tensor:
        """This rank's rows of parameter ``sp`` from a loaded ``value``; ValueError if it does not fit."""
        mine: Any = sp.sharded  # a DTensor parameter
        if isinstance(value, DTensor):
            if (
                value.device_mesh == mine.device_mesh
                and tuple(value.placements) == tuple(mine.placements)
                and value.shape == mine.shape
                and local_of(value).shape == sp.local_shape
            ):
                return local_of(value).detach()
        elif isinstance(value, torch.Tensor) and sp.tp is None and value.shape == sp.shape:
            return sp.my_piece(value.detach())
        what = (
            f"a DTensor {tuple(value.shape)} with placements {tuple(value.placements)}"
            if isinstance(value, DTensor)
            else f"{type(value).__name__} {tuple(getattr(value, 'shape', ()))}"
        )
        raise ValueError(
            f"load_state_dict(assign=True): {key!r} is {what}, but the sharded parameter is "
            f"{tuple(mine.shape)} with placements {tuple(mine.placements)}; pass the full "
            "tensor or a DTensor laid out like model.state_dict()'s"
        )

    def _new_flat(self, device: torch.device) -> torch.Tensor:
        if self.offload_policy is not None and device.type == "cpu":
            return offload.host_buffer(
                self.shard_numel, self.orig_dtype, self.offload_policy.pin_memory
            )
        return torch.zeros(self.shard_numel, dtype=self.orig_dtype, device=device)

    def _flat_view(self, sp: ShardedParam) -> torch.Tensor:
        return self.flat[sp.offset : sp.offset + sp.local_numel].view(sp.local_shape)

    def _make_unsharded_views(self, device: torch.device) -> None:
        if self.offload_policy is not None and device.type != "meta":
            device = self.device  # gathered on the GPU, from shards in host memory
        # One rank in the parameters' own dtype: the shards are the whole
        # parameters, so the unsharded forms simply alias them.
        self.aliased = (
            self.world == 1
            and self.compute_dtype == self.orig_dtype
            and self.offload_policy is None
            and not self.self_gathering
        )
        # Where each parameter starts in the unsharded buffer. Parameters that
        # gather themselves (extensions.py) have their own outputs instead.
        starts, n = [], 0
        for sp in self.params:
            starts.append(n * self.world)
            n += sp.slot if sp.ext is None else 0
        if self.aliased:
            self.unsharded_flat = self.flat
        else:
            self.unsharded_flat = torch.empty(
                self.world * n, dtype=self.compute_dtype, device=device
            )
        storage = self.unsharded_flat.untyped_storage()
        self.copy_out = []
        for sp, start in zip(self.params, starts):
            if sp.ext is not None:
                sp.ext.reset()  # its unsharded form is made by its first gather
                self.copy_out.append(self.unsharded_flat[:0])
                continue
            sp.unsharded = torch.empty(0, dtype=self.compute_dtype, device=device).set_(
                storage, start, sp.shape, contiguous_stride(sp.shape)
            )
            sp.plain = sp.unsharded if sp.tp is None else sp.tp.constant(sp.unsharded)
            # Rank-major gather output -> param-major parameters, one kernel.
            # (Views of the flat buffer, not of the parameters: writing through them
            # must not bump the parameters' version counters, which autograd checks.)
            # Split along another dim: [before, world, piece, after], each rank's piece in place.
            self.copy_out.append(
                self.unsharded_flat[start : start + sp.slot * self.world].view(
                    (self.world, sp.slot)
                    if sp.dim == 0
                    else (sp.before, self.world, sp.chunk, sp.after)
                )
            )
        parts = [
            (sp, c)
            for sp, c in zip(self.params, self.copy_out)
            if sp.slot and sp.ext is None and sp.dim == 0
        ]
        self.in_place = InPlaceOperands(
            [c.view(-1) for _, c in parts],
            [c[self.rank] for _, c in parts],
            [self.flat[sp.offset : sp.offset + sp.slot] for sp, _ in parts],
            [sp.slot for sp, _ in parts],
        )
        if not self.aliased and device.type != "meta":
            self.unsharded_flat.untyped_storage().resize_(0)  # views first: they check bounds

    @torch.inference_mode(False)  # from an eval's gather: the new buffers are the parameters
    def repack(self) -> None:
        """Re-point shards into a flat buffer after someone replaced them.

        ``module.to_empty()``, ``.to()`` and friends swap a DTensor parameter's
        local tensor for a new one; its values are the truth, so copy them into
        a flat buffer on their device, in their dtype (``.to(torch.bfloat16)``:
        the gathers and gradients follow, the mixed-precision policy still
        applies), and make the locals views of it again.
        (``ParamGroup.unshard`` notices, by an identity check per parameter.)
        """
        first = local_of(self.params[0].sharded)
        # Offloaded shards go back to host memory (to_empty(device="cuda") moved them).
        device = self._device_for(first.device) if self.offload_policy else first.device
        dtypes = {local_of(sp.sharded).dtype for sp in self.params}
        if len(dtypes) > 1:
            raise ValueError(
                f"module {self.label!r}: its parameters now have several dtypes "
                f"{sorted(map(str, dtypes))}, from a .to() on part of it; one fully_shard "
                "call keeps them in one flat buffer, so cast the whole module, or shard the "
                "parts you cast separately"
            )
        if first.dtype != self.orig_dtype:  # model.to(torch.bfloat16): the shards' new dtype
            self.orig_dtype = first.dtype
            self.compute_dtype, self.reduce_dtype = resolve_dtypes(self.mp_policy, first.dtype)
        self.flat = self._new_flat(device)
        self.shard_locals = []
        for sp in self.params:
            view = self._flat_view(sp)
            view.copy_(local_of(sp.sharded))
            local = view if sp.ext is None else sp.ext.wrap(view)
            sp.sharded._local_tensor = local  # type: ignore[attr-defined]
            self.shard_locals.append(local)
        self._make_unsharded_views(device)

    # ---- the unsharded storage ----------------------------------------------------------

    def allocate_unsharded(self) -> None:
        """Give the unsharded parameters their storage back (a gather fills it)."""
        with label("unsharded"):
            self.unsharded_flat.untyped_storage().resize_(
                self.unsharded_flat.numel() * self.unsharded_flat.element_size()
            )

    @property
    def unsharded_nbytes(self) -> int:
        """Bytes of unsharded storage held now (none when aliased: it is the shards)."""
        held = sum(sp.ext.nbytes for sp in self.params if sp.ext is not None)
        if self.aliased:
            return held
        return self.unsharded_flat.untyped_storage().nbytes() + held

    def part_for(self, n: int) -> torch.Tensor:
        """The rank-major gather input for a group of ``n`` ranks (``reshard_after_forward=n``):
        the pieces of ``world / n`` consecutive ranks, so that gathering it over the n
        ranks of the group (in their order) yields every rank's piece in rank order.
        Read from the gathered parameters: call it while they are unsharded."""
        per = self.world // n
        start = (self.rank % n) * per
        parts = []
        for sp, out in zip(self.params, self.copy_out):
            if sp.dim == 0:
                parts.append(out[start : start + per])
            else:
                parts.append(out.transpose(0, 1)[start : start + per].reshape(per, sp.slot))
        with label("post-forward part"):
            return torch.cat(parts, dim=1).view(-1)
