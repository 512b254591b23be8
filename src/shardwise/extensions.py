"""Parameters that decide how they are gathered: FSDP2's tensor-subclass hooks.

A parameter whose data is a tensor subclass defining ``fsdp_pre_all_gather``
and ``fsdp_post_all_gather`` (torchao's float8 training weights) chooses what
goes over the wire and what the module computes with: before the gather,
``pre`` turns this rank's piece into one or more tensors to send plus some
metadata (float8: the piece cast to fp8, and its scale); after it, ``post``
builds the unsharded parameter from the gathered tensors (float8: an fp8
tensor that the float8 matmul consumes directly). The same contract as
FSDP2's, so the same subclasses work under both.

Why a byte-packed gather: a group mixes such parameters with plain ones
(norm weights), and the inputs differ in dtype (fp8 next to bf16). Every
input is laid in a slot of one uint8 buffer, slots end to end and sized for
the largest piece (``chunk`` rows) so every rank sends the same bytes; one
all-gather moves them all. Packing is one ``cat`` into the send buffer and
unpacking one ``split_with_sizes_copy`` into byte views of the outputs: two
kernels per group, not two per parameter (a 1B float8 model has hundreds of
such inputs, and per-parameter copies left the step bound by kernel launches).
The layout is fixed at the first gather and checked at every later one.

Why the subclass keeps our storage: the sharded local tensor is the subclass
rebuilt (``__tensor_flatten__``/``__tensor_unflatten__``) around the view of
the group's flat shard, so the optimizer's in-place updates land in the flat
shard as for any parameter. Subclasses with more than one inner tensor are
refused rather than guessed at.

Why persistent outputs: autograd saves the unsharded parameters (the fp8
weight) for backward, so as for plain parameters the gathered tensors keep
their identity across gathers and only their storage is freed and refilled;
``post`` is told to refill in place with ``out=`` after the first time.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor

from . import collectives
from .sharded_param import rows_per_rank
from .tensor_parallel import contiguous_stride

if TYPE_CHECKING:
    from .param_group import ParamGroup
    from .sharded_param import ShardedParam


def has_hooks(t: torch.Tensor) -> bool:
    """Whether ``t`` gathers itself; ValueError if it defines only one of the two hooks."""
    pre, post = hasattr(t, "fsdp_pre_all_gather"), hasattr(t, "fsdp_post_all_gather")
    if pre != post:
        raise ValueError(
            f"{type(t).__name__} defines only {'fsdp_pre_all_gather' if pre else 'fsdp_post_all_gather'}:"
            " a tensor subclass gathered by shardwise (as by FSDP2) needs both"
        )
    return pre


def check(
    named: list[Any], dims: list[int], offload: Any, post_forward_size: int, mesh: Any
) -> None:
    """Refuse, before anything changes, what such parameters cannot be combined with yet."""
    world = mesh.size(mesh.ndim - 1)
    hooked = []
    for fqn, p, _ in named:
        local = p._local_tensor if isinstance(p, DTensor) else p
        if has_hooks(local):
            hooked.append((fqn, p))
    for fqn, p in hooked:
        rows = p.shape[0]
        chunk = rows_per_rank(rows, world)
        split = next((d for d in dims if d != 0), 0)  # any parameter of the group
        why = (
            "tensor parallelism"
            if isinstance(p, DTensor)
            else "CPU offload"
            if offload is not None
            else "reshard_after_forward=<int>"
            if post_forward_size
            else f"Shard({split}) from shard_placement_fn in the same fully_shard call"
            if split
            else "an HSDP mesh without mesh_dim_names"
            if mesh.ndim == 2 and not mesh.mesh_dim_names
            else f"{rows} rows over {world} ranks, which leaves the last rank(s) no rows"
            if (world - 1) * chunk >= rows and world > 1
            else None
        )
        if why is None:
            Extension(fqn, p)  # checks that it can be rebuilt around a shard
        else:
            raise ValueError(
                f"parameter {fqn!r} is a {type(p).__name__} that gathers itself "
                f"(fsdp_pre_all_gather); shardwise does not combine that with {why} yet"
            )


class Extension:
    """One parameter's subclass: how to rebuild it around a shard, and its gathers."""

    def __init__(self, fqn: str, data: torch.Tensor) -> None:
        names, ctx = data.__tensor_flatten__()  # type: ignore[attr-defined]
        if len(names) != 1:
            raise ValueError(
                f"parameter {fqn!r} is a {type(data).__name__} with inner tensors {names}; "
                "shardwise shards tensor subclasses that wrap exactly one tensor"
            )
        self.cls, self.inner, self.ctx = type(data), names[0], ctx
        self.metadata: Any = None
        self.outputs: list[torch.Tensor] = []  # gathered inputs, one per pre() output
        self.storages: list[tuple[torch.UntypedStorage, int]] = []  # freed at reshard
        self.made = False  # post() built the unsharded form; later gathers refill it
        self._old_signature: bool | None = None

    def wrap(self, view: torch.Tensor) -> torch.Tensor:
        """The subclass around ``view`` (this rank's piece in the flat shard)."""
        return self.cls.__tensor_unflatten__(  # type: ignore[attr-defined]
            {self.inner: view}, self.ctx, view.shape, view.stride()
        )

    def reset(self) -> None:
        """Forget gathered tensors (the flat shard was rebuilt)."""
        self.outputs, self.storages, self.made = [], [], False

    def pre(self, local: torch.Tensor, group: ParamGroup, sp: ShardedParam) -> list[torch.Tensor]:
        if self._old_signature is None:
            params = inspect.signature(local.fsdp_pre_all_gather).parameters  # type: ignore[attr-defined]
            if len(params) not in (1, 5):
                raise TypeError(
                    f"{self.cls.__name__}.fsdp_pre_all_gather takes {len(params)} arguments; "
                    "expected (mesh) or (mesh, outer_size, outer_stride, module, mp_policy)"
                )
            self._old_signature = len(params) == 1
        mesh = group.mesh  # the mesh the pieces are split over (HSDP: its shard dim)
        if mesh.ndim == 2:
            mesh = mesh[mesh.mesh_dim_names[-1]]  # type: ignore[index]
        if self._old_signature:
            inputs, self.metadata = local.fsdp_pre_all_gather(mesh)  # type: ignore[attr-defined]
        else:
            inputs, self.metadata = local.fsdp_pre_all_gather(  # type: ignore[attr-defined]
                mesh,
                sp.shape,
                contiguous_stride(sp.shape),
                sp.locations[0][0],
                group.settings.mp_policy,
            )
        return list(inputs)

    def post(self, local: torch.Tensor, group: ParamGroup, sp: ShardedParam) -> torch.Tensor:
        outs = tuple(self.outputs)
        dtype = group.compute_dtype
        if self.made:
            # The installed tensor, as FSDP2 passes it: with uneven pieces it is a
            # view of what post() first made, and metadata (a float8 scale) set on
            # that would not reach it.
            local.fsdp_post_all_gather(outs, self.metadata, dtype, out=sp.unsharded)  # type: ignore[attr-defined]
            return sp.unsharded
        made, inners = local.fsdp_post_all_gather(outs, self.metadata, dtype)  # type: ignore[attr-defined]
        self.made = True
        if tuple(made.shape) != tuple(sp.shape):  # padding rows of an uneven split
            made = torch.as_strided(made, sp.shape, contiguous_stride(sp.shape), 0)
        seen: set[int] = set()
        for t in [*self.outputs, *inners]:
            s = t.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                self.storages.append((s, s.nbytes()))
        return made

    def free(self) -> None:
        for s, _ in self.storages:
            s.resize_(0)

    def refill(self) -> None:
        for s, n in self.storages:
            if s.nbytes() != n:
                s.resize_(n)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes() for s, _ in self.storages)


class PackedGather:
    """One group's byte-packed all-gather (see the module docstring)."""

    def __init__(self) -> None:
        # Per parameter, per input: (byte offset, slot bytes, gathered shape per rank, dtype).
        self.layout: list[list[tuple[int, int, torch.Size, torch.dtype]]] | None = None
        self.bytes_per_rank = 0
        self.sizes: list[int] = []  # every slot's bytes, in order: the unpack's split
        self._zeros: torch.Tensor | None = None  # padding after short pieces, read only

    def _padding(self, n: int, device: torch.device) -> torch.Tensor:
        if self._zeros is None or self._zeros.numel() < n or self._zeros.device != device:
            self._zeros = torch.zeros(n, dtype=torch.uint8, device=device)
        return self._zeros[:n]

    def inputs(self, group: ParamGroup) -> list[list[torch.Tensor]]:
        """Each parameter's tensors to send: ``pre``'s, or its piece in ``param_dtype``."""
        out = []
        for sp, local in zip(group.params, group._locals):
            if sp.ext is not None:
                out.append(sp.ext.pre(local, group, sp))
            else:
                out.append([local.to(group.compute_dtype)])
        return out

    def _plan(self, group: ParamGroup, inputs: list[list[torch.Tensor]]) -> None:
        layout, offset = [], 0
        for sp, ins in zip(group.params, inputs):
            slots = []
            for t in ins:
                row = t.shape[1:]
                # This rank's rows, or padded to ``chunk`` rows (as FSDP2 asks of hooks).
                if (
                    t.dim() == 0
                    or t.shape[0] not in (sp.local_size, sp.chunk)
                    or list(row) != list(sp.shape[1:])
                ):
                    raise ValueError(
                        f"{sp.fqn}: fsdp_pre_all_gather returned a tensor of shape "
                        f"{tuple(t.shape)}; shardwise gathers pieces split along dim 0, shaped "
                        f"like this rank's piece {tuple(sp.local_shape)} (or padded to "
                        f"{sp.chunk} rows) in any dtype"
                    )
                slot = sp.chunk * sp.after * t.element_size()
                slots.append((offset, slot, torch.Size([sp.chunk, *row]), t.dtype))
                offset += slot
            layout.append(slots)
        self.layout, self.bytes_per_rank = layout, offset
        self.sizes = [slot for slots in layout for _, slot, _, _ in slots]

    def issue(self, group: ParamGroup) -> tuple[torch.Tensor, torch.Tensor, collectives.Pending]:
        """Run the ``pre`` hooks, pack, and start the all-gather: (send, out, pending).

        Beside compute, as plain gathers are (collectives.side_stream), once
        the layout is known: the send and receive buffers are allocated first,
        on the compute stream; the hooks' own temporaries come from the side
        stream, as in FSDP2's copy-in. The first gather runs in order, since
        it fixes the layout.
        """
        first = self.layout is None
        if first:
            send = self._pack(group, self.inputs(group))
        else:
            send = torch.zeros(self.bytes_per_rank, dtype=torch.uint8, device=group.device)
        out = group.comm_buffer(group.world * send.numel(), torch.uint8)
        if group.world == 1:  # nothing to gather: the packed bytes are the output
            if not first:
                self._pack(group, self.inputs(group), send)
            out.copy_(send)
            return send, out, collectives.Pending(None)
        with collectives.side_stream("gather", None if first else group.device):
            if not first:
                self._pack(group, self.inputs(group), send)
            pending = collectives.all_gather(
                out, send, group.shard_group, group.label, group.settings.custom_all_gather
            )
        return send, out, pending

    def _pack(
        self,
        group: ParamGroup,
        inputs: list[list[torch.Tensor]],
        send: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This rank's send buffer; padding past a short last piece stays zero."""
        if self.layout is None:
            self._plan(group, inputs)
        assert self.layout is not None
        if [[t.dtype for t in ins] for ins in inputs] != [
            [dt for *_, dt in slots] for slots in self.layout
        ]:
            raise ValueError(
                f"{group.label}: fsdp_pre_all_gather returned other tensors than at the first "
                "gather (count or dtype); the gather layout is fixed at the first one"
            )
        parts = []
        for ins, slots in zip(inputs, self.layout):
            for t, (_, slot, _, _) in zip(ins, slots):
                data = t.contiguous().view(-1).view(torch.uint8)
                parts.append(data)
                if data.numel() < slot:  # a short last piece
                    parts.append(self._padding(slot - data.numel(), data.device))
        if send is None:
            send = torch.empty(self.bytes_per_rank, dtype=torch.uint8, device=group.device)
        torch.cat(parts, out=send)
        return send

    def unpack(self, group: ParamGroup, gathered: torch.Tensor) -> None:
        """Copy every slot of the gathered bytes out (one kernel), then let ``post`` build
        the unsharded parameters."""
        assert self.layout is not None
        rows = gathered.view(group.world, self.bytes_per_rank)
        outs: list[torch.Tensor] = []
        refilled: list[torch.Tensor] = []
        for sp, out, slots in zip(group.params, group._copy_out, self.layout):
            ext = sp.ext
            if ext is None:  # the rank-major view of its part of the unsharded buffer
                outs.append(out.view(torch.uint8))
                continue
            if not ext.outputs:
                for _, _, shape, dt in slots:
                    full = (group.world * shape[0], *shape[1:])
                    ext.outputs.append(torch.empty(full, dtype=dt, device=group.device))
            ext.refill()
            outs.extend(t.view(group.world, -1).view(torch.uint8) for t in ext.outputs)
            refilled.extend(((sp.unsharded,) if ext.made else ()) + tuple(ext.outputs))
        # Refilled in place under autograd's nose, as plain parameters are
        # (param_group.py): the saved tensors must not look modified.
        with torch.autograd._unsafe_preserve_version_counter(tuple(refilled)):
            torch.split_with_sizes_copy(rows, self.sizes, dim=1, out=outs)
            for sp, local in zip(group.params, group._locals):
                if sp.ext is not None:
                    sp.unsharded = sp.ext.post(local, group, sp)
                    sp.plain = sp.unsharded
