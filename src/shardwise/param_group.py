"""One module's parameters as one flat shard: the unit that is gathered and reduced.

Why a flat shard: each rank keeps its pieces of all of a module's parameters
in one contiguous buffer, and every sharded parameter's local tensor is a view
into it. The all-gather input is then that buffer itself (or one cast kernel
of it to ``param_dtype``): no copy-in. The gathered buffer is rank-major while
parameters are param-major, so one ``split_with_sizes_copy`` lays them out
(copy-out); it is skipped when the group holds one parameter, and a one-rank
mesh in the parameters' own dtype needs no gather at all (the unsharded
parameters alias the shards).

Why resize storage instead of dropping it: autograd saves the unsharded
parameters for backward. Freeing their storage (resize to 0) leaves those
saved tensors as valid objects holding no memory; the next gather refills the
same storage, so backward sees the data again without keeping it alive between
forward and backward. The unsharded parameter tensors are made with ``set_``
so they have their own version counters: refilling the storage through the
flat buffer never trips autograd's in-place checks.

Why an autograd Function: the unsharded parameters a forward uses are outputs
of ``_Unsharded`` whose inputs are the sharded parameters. Autograd runs its
backward exactly once per backward pass, after every used trainable
parameter's gradient exists (unused ones arrive as None), whether or not the
module's inputs required grad. That backward is the post-backward hook; it
returns no gradients itself: reduced shards are put on ``.grad`` by us.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from . import collectives
from .precision import MixedPrecisionPolicy, resolve_dtypes
from .trace import active as active_trace

if TYPE_CHECKING:
    from .module import ModuleState


class GroupState(Enum):
    SHARDED = auto()
    GATHERING = auto()  # all-gather issued, not yet waited for
    UNSHARDED = auto()


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor without going through autograd (hot path)."""
    return t._local_tensor  # type: ignore[attr-defined]


@dataclass
class ShardedParam:
    """One parameter: where it is registered, how it is split, its two forms."""

    fqn: str
    locations: list[tuple[nn.Module, str]]
    shape: torch.Size
    requires_grad: bool
    chunk_rows: int  # rows per rank, like torch.chunk: ceil(rows / world)
    row_numel: int
    offset: int  # start of this parameter's slot in the per-rank flat shard
    local_rows: int
    sharded: nn.Parameter = field(init=False)
    unsharded: torch.Tensor = field(init=False)

    @property
    def slot(self) -> int:
        return self.chunk_rows * self.row_numel

    @property
    def local_numel(self) -> int:
        return self.local_rows * self.row_numel

    @property
    def local_shape(self) -> tuple[int, ...]:
        return (self.local_rows, *self.shape[1:])

    def install(self, t: torch.Tensor) -> None:
        # Direct dict writes: nn.Module.__setattr__ refuses non-Parameters, and
        # the unsharded forms are autograd outputs, not leaves.
        for module, name in self.locations:
            module._parameters[name] = t  # type: ignore[assignment]


class _Unsharded(torch.autograd.Function):
    """Hands out the unsharded parameters; its backward is the post-backward."""

    @staticmethod
    def forward(ctx: Any, group: ParamGroup, *sharded: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.group = group
        ctx.set_materialize_grads(False)
        return tuple(p.unsharded.detach() for p in group.trainable)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, ...]:  # type: ignore[override]
        ctx.group.owner.post_backward(list(grads))
        return (None,) * (1 + len(grads))


class ParamGroup:
    """The parameters one ``fully_shard`` call owns, sharded over one mesh."""

    def __init__(
        self,
        owner: ModuleState,
        named: Sequence[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]],
        mesh: DeviceMesh,
        mp_policy: MixedPrecisionPolicy | None,
        label: str,
    ) -> None:
        self.owner = owner
        self.label = label
        self.mesh = mesh
        self.shard_group = mesh.get_group(mesh.ndim - 1)
        self.replicate_group = mesh.get_group(0) if mesh.ndim == 2 else None
        self.world = mesh.size(mesh.ndim - 1)
        self.rank = mesh.get_local_rank(mesh.ndim - 1)
        self.placements = (Replicate(), Shard(0)) if mesh.ndim == 2 else (Shard(0),)
        self.communicates = self.world > 1  # gathers go over the wire (else: alias or cast)
        self.orig_dtype = named[0][1].dtype
        self.mp_policy = mp_policy
        self.compute_dtype, self.reduce_dtype = resolve_dtypes(mp_policy, self.orig_dtype)
        self.state = GroupState.SHARDED
        self.requires_gradient_sync = True
        self.prefetched = False  # gathered by another module's prefetch, not yet used
        self.last_used: list[bool] | None = None  # which trainables got gradients last time
        self._pending: collectives.Pending | None = None
        self._gather_out: torch.Tensor | None = None
        self._gather_in: torch.Tensor | None = None
        self._attached: tuple[torch.Tensor, ...] | None = None
        self._accum: list[torch.Tensor | None] | None = None

        self.params: list[ShardedParam] = []
        offset = 0
        for fqn, p, locs in named:
            rows = p.shape[0]
            chunk = math.ceil(rows / self.world)
            local_rows = max(0, min(chunk, rows - self.rank * chunk))
            sp = ShardedParam(
                fqn,
                locs,
                p.shape,
                p.requires_grad,
                chunk,
                math.prod(p.shape[1:]),
                offset,
                local_rows,
            )
            self.params.append(sp)
            offset += sp.slot
        self.shard_numel = offset
        self.trainable = [sp for sp in self.params if sp.requires_grad]
        self._shard(named)

    # ---- construction -------------------------------------------------------------------

    def _device_for(self, src: torch.device) -> torch.device:
        if src.type == "meta":
            return src
        if self.mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.mesh.device_type)

    def _shard(self, named: Sequence[tuple[str, nn.Parameter, Any]]) -> None:
        """Copy this rank's rows of each parameter into a fresh flat shard.

        Deterministic and free of random state: every rank slices the same
        tensor the same way. Padding stays zero so gathered padding is too.
        """
        device = self._device_for(named[0][1].device)
        self.flat = torch.zeros(self.shard_numel, dtype=self.orig_dtype, device=device)
        self._locals: list[torch.Tensor] = []
        for sp, (_, p, _) in zip(self.params, named):
            view = self._flat_view(sp)
            if device.type != "meta" and sp.local_rows:
                start = self.rank * sp.chunk_rows
                view.copy_(p.detach()[start : start + sp.local_rows])
            dt = DTensor.from_local(
                view,
                self.mesh,
                self.placements,
                run_check=False,
                shape=sp.shape,
                stride=_contiguous_stride(sp.shape),
            )
            sp.sharded = nn.Parameter(dt, requires_grad=sp.requires_grad)
            self._locals.append(local_of(sp.sharded))
            sp.install(sp.sharded)
        self._make_unsharded_views(device)

    def _flat_view(self, sp: ShardedParam) -> torch.Tensor:
        return self.flat[sp.offset : sp.offset + sp.local_numel].view(sp.local_shape)

    def _make_unsharded_views(self, device: torch.device) -> None:
        # One rank in the parameters' own dtype: the shards are the whole
        # parameters, so the unsharded forms simply alias them.
        self.aliased = self.world == 1 and self.compute_dtype == self.orig_dtype
        if self.aliased:
            self.unsharded_flat = self.flat
        else:
            n = self.world * self.shard_numel
            self.unsharded_flat = torch.empty(n, dtype=self.compute_dtype, device=device)
        storage = self.unsharded_flat.untyped_storage()
        for sp in self.params:
            start = sp.offset * self.world
            sp.unsharded = torch.empty(0, dtype=self.compute_dtype, device=device).set_(
                storage, start, sp.shape, _contiguous_stride(sp.shape)
            )
        # Rank-major gather output -> param-major parameters, one kernel.
        self._copy_out = [
            self.unsharded_flat[sp.offset * self.world : (sp.offset + sp.slot) * self.world].view(
                self.world, sp.slot
            )
            for sp in self.params
        ]
        if not self.aliased and device.type != "meta":
            self.unsharded_flat.untyped_storage().resize_(0)  # views first: they check bounds

    def _ensure_packed(self) -> None:
        """Re-point shards into the flat buffer if someone replaced them.

        ``module.to_empty()``, ``.to()`` and friends swap a DTensor parameter's
        local tensor for a new one; its values are the truth, so copy them into
        a flat buffer on their device and make the locals views of it again.
        """
        if all(local_of(sp.sharded) is loc for sp, loc in zip(self.params, self._locals)):
            return
        first = local_of(self.params[0].sharded)
        self.flat = torch.zeros(self.shard_numel, dtype=self.orig_dtype, device=first.device)
        self._locals = []
        for sp in self.params:
            view = self._flat_view(sp)
            view.copy_(local_of(sp.sharded))
            sp.sharded._local_tensor = view  # type: ignore[attr-defined]
            self._locals.append(view)
        self._make_unsharded_views(first.device)

    # ---- unshard / reshard --------------------------------------------------------------

    def unshard(self) -> None:
        """Issue this group's all-gather (async); ``wait_unsharded`` finishes it."""
        if self.state is not GroupState.SHARDED:
            return
        self._ensure_packed()
        if self.aliased:
            self.state = GroupState.UNSHARDED
            self._install_plain()
            return
        self.unsharded_flat.untyped_storage().resize_(
            self.unsharded_flat.numel() * self.unsharded_flat.element_size()
        )
        if self.world == 1:
            self.unsharded_flat.copy_(self.flat)  # one casting copy is the whole "gather"
            self.state = GroupState.UNSHARDED
            self._install_plain()
            return
        src = (
            self.flat if self.compute_dtype == self.orig_dtype else self.flat.to(self.compute_dtype)
        )
        direct = len(self.params) == 1  # rank-major == param-major
        out = (
            self.unsharded_flat
            if direct
            else torch.empty(
                self.world * self.shard_numel, dtype=self.compute_dtype, device=self.flat.device
            )
        )
        self._gather_in, self._gather_out = src, out
        self._pending = collectives.all_gather(out, src, self.shard_group, self.label)
        self.state = GroupState.GATHERING

    def wait_unsharded(self) -> None:
        if self.state is GroupState.SHARDED:
            self.unshard()
        if self.state is not GroupState.GATHERING:
            return
        assert self._pending is not None and self._gather_out is not None
        self._pending.wait()
        if self._gather_out is not self.unsharded_flat:
            torch.split_with_sizes_copy(
                self._gather_out.view(self.world, self.shard_numel),
                [sp.slot for sp in self.params],
                dim=1,
                out=self._copy_out,
            )
        self._pending = self._gather_in = self._gather_out = None
        self.state = GroupState.UNSHARDED
        self._install_plain()

    def _shards_version(self) -> int:
        # In-place updates through DTensor (optimizers) bump the parameter's own
        # version counter, not the local tensor's: dispatch runs below autograd.
        return sum(sp.sharded._version for sp in self.params)

    def stale(self) -> bool:
        """Gathered, but the shards changed since (an optimizer step while kept gathered)."""
        return (
            self.state is GroupState.UNSHARDED
            and self._shards_version() != self._gathered_version
        )

    def _install_plain(self) -> None:
        self._gathered_version = self._shards_version()  # what this gather read
        for sp in self.params:
            sp.install(sp.unsharded)

    def attach(self) -> None:
        """Install unsharded parameters that autograd tracks back to this group.

        Done at most once per forward pass (a module called twice reuses it),
        so one backward runs one post-backward for the group.
        """
        if not self.trainable:
            return
        if self._attached is None:
            out = _Unsharded.apply(self, *(sp.sharded for sp in self.trainable))
            self._attached = out if isinstance(out, tuple) else (out,)
        for sp, t in zip(self.trainable, self._attached):
            sp.install(t)

    def detach_autograd(self) -> None:
        """Forget the forward pass's attachment (a new graph needs a new one)."""
        self._attached = None

    def reshard(self) -> None:
        if self.state is GroupState.GATHERING:
            assert self._pending is not None
            self._pending.wait()
            self._pending = self._gather_in = self._gather_out = None
        elif self.state is GroupState.SHARDED:
            return
        for sp in self.params:
            sp.install(sp.sharded)
        if not self.aliased:
            self.unsharded_flat.untyped_storage().resize_(0)
        # _attached survives a reshard: a module called twice in one forward
        # uses the same autograd outputs (the storage is refilled in place), so
        # its backward runs one post-backward. The context clears it per forward.
        self.prefetched = False
        self.state = GroupState.SHARDED
        tracer = active_trace()
        if tracer is not None:
            tracer.instant("reshard", self.label)

    @property
    def unsharded_bytes(self) -> int:
        """Bytes of unsharded storage this group holds right now."""
        if self.aliased:
            return 0
        return self.unsharded_flat.untyped_storage().nbytes()

    # ---- gradients ----------------------------------------------------------------------

    def reduce_grads(self, grads: list[torch.Tensor | None]) -> ReduceJob | None:
        """Start averaging the unsharded gradients; returns the job to finish later.

        With gradient sync off, gradients are summed locally instead and the
        first synced backward reduces that sum once.
        """
        grads = [None if g is None else g.to(self.reduce_dtype) for g in grads]
        if not self.requires_gradient_sync:
            if self._accum is None:
                self._accum = grads
            else:
                self._accum = [
                    a if g is None else (g if a is None else a.add_(g))
                    for a, g in zip(self._accum, grads)
                ]
            return None
        if self._accum is not None:
            grads = [
                a if g is None else (g if a is None else a.add_(g))
                for a, g in zip(self._accum, grads)
            ]
            self._accum = None
        used = [g is not None for g in grads]
        self.last_used = used
        if not any(used):
            return None
        return ReduceJob(self, grads, used)

    def assign_grads(self, shards: list[Any], used: list[bool]) -> None:
        for sp, g, u in zip(self.trainable, shards, used):
            if not u:
                continue
            if g.dtype != self.orig_dtype:
                g = g.to(self.orig_dtype)
            p = sp.sharded
            if p.grad is None:
                # The parameter's own spec fits its gradient (same mesh, placements,
                # shape, dtype); the constructor skips from_local's autograd and checks.
                p.grad = DTensor(g, p._spec, requires_grad=False)  # type: ignore[attr-defined]
            else:
                local_of(p.grad).add_(g)


class ReduceJob:
    """A module's gradient reduction in flight: reduce-scatter, then (HSDP) all-reduce."""

    def __init__(self, group: ParamGroup, grads: list[torch.Tensor | None], used: list[bool]):
        self.group = group
        self.used = used
        g = group
        self._pending: collectives.Pending | None = None
        if g.world == 1 and g.replicate_group is None:
            # Nothing to average: the gradients are the shards.
            self.shards: list[Any] = [t.contiguous() if t is not None else t for t in grads]
            return
        device = g.flat.device
        # Every parameter owns a slot in the flat layout; frozen and unused ones
        # contribute zeros.
        by_param = {id(sp): t for sp, t in zip(g.trainable, grads)}
        filled: list[torch.Tensor] = []
        for sp in g.params:
            t = by_param.get(id(sp))
            filled.append(
                t if t is not None else torch.zeros(sp.shape, dtype=g.reduce_dtype, device=device)
            )
        self.out = torch.empty(g.shard_numel, dtype=g.reduce_dtype, device=device)
        if g.world == 1:
            torch._chunk_cat(filled, dim=0, num_chunks=1, out=self.out.view(1, -1))
            self._rs_in = None
        else:
            self._rs_in = torch.empty(g.world, g.shard_numel, dtype=g.reduce_dtype, device=device)
            torch._chunk_cat(filled, dim=0, num_chunks=g.world, out=self._rs_in)
            self._pending = collectives.reduce_scatter_mean(
                self.out, self._rs_in.view(-1), g.shard_group, g.label
            )
        self.shards = []

    def finish(self) -> None:
        """Wait for the reduction and put the shards on the parameters' ``.grad``."""
        g = self.group
        if self._pending is not None:
            self._pending.wait()
            self._pending = self._rs_in = None
        if not self.shards:
            if g.replicate_group is not None:
                collectives.all_reduce_mean(self.out, g.replicate_group, g.label).wait()
            self.shards = [
                self.out[sp.offset : sp.offset + sp.local_numel].view(sp.local_shape)
                for sp in g.trainable
            ]
        g.assign_grads(self.shards, self.used)


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))
