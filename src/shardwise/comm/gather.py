"""How one group gathers its parameters: one strategy object, chosen when the layout is built.

Why a strategy: which way a group gathers (the shards aliased, one rank's
cast, each parameter in place, one rank-major buffer with a copy-out, the
packed bytes of parameters that gather themselves, the part kept after
forward) follows from settings that rarely change: the mesh, the dtypes,
where the shards live, a custom all-gather or allocator, a post-forward
group. So ``choose`` decides once, when the group's layout is built or
rebuilt (construction, ``repack``, ``load_state_dict(assign=True)``) and when
one of those settings changes through its public setter; the hot path only
calls ``issue`` and ``finish``.

A strategy is given what it needs and knows no group: the layout
(``FlatShard``: the shards, the unsharded storage and its views) and a
``GatherComm`` (the process group, a custom all-gather or allocator, the
post-forward group), fixed when it is chosen. ``issue(kept)`` starts the
gather from the shards (or from ``kept``, the part kept after forward) and
returns the collective in flight, or None when the parameters are unsharded
already (nothing to wait for); ``finish`` lays the gathered bytes out in the
layout's storage once the wait is over. The group (param_group.py) keeps its
own state (gathering, unsharded) and installs the parameters. The buffers in
flight live on the strategy (``drop`` forgets them), so that a gather's
operands outlive the collective. This is the gather half of what reduce.py
is for reductions.

Parameters that gather themselves (extensions.py: torchao's float8 weights)
gather through ``PackedGather``: a group mixes them with plain ones (norm
weights), and the inputs differ in dtype (fp8 next to bf16). Every input is
laid in a slot of one uint8 buffer, slots end to end and sized for the
largest piece (``chunk`` rows) so every rank sends the same bytes; one
all-gather moves them all. Packing is one ``cat`` into the send buffer and
unpacking one ``split_with_sizes_copy`` into byte views of the outputs: two
kernels per group, not two per parameter (a 1B float8 model has hundreds of
such inputs, and per-parameter copies left the step bound by kernel
launches). The packing is fixed at the first gather and checked at every
later one; the group keeps it across a change of strategy.

Alternatives considered for what a strategy is given. (1) The group itself,
typed as its base class ``FlatShard`` (as before): the strategy still held
the group and reached its private views; the import said less than the call.
(2) A frozen dataclass of every operand, built at each gather: one more
allocation per module per step on the hot path, for operands (views of the
unsharded storage) that change only when the layout is rebuilt, and the
layout object already holds them. (3) Free functions, as FSDP2's
``foreach_all_gather``: which way a group gathers is decided once, and a
gather's buffers must outlive its collective, so an object chosen with the
layout holds both. The layout object plus a frozen ``GatherComm`` (what
``choose`` decided from) is what remains.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import ProcessGroup

from ..layout import offload
from ..layout.flat_shard import FlatShard
from ..layout.labels import label
from . import collectives, node_collectives
from .comm_policy import CommPolicy


@dataclass(frozen=True)
class GatherComm:
    """What a group's gathers communicate over, fixed until a setter chooses again."""

    group: ProcessGroup  # the shard group
    custom: Any  # a user's all-gather (set_custom_all_gather), or None
    alloc: collectives.Allocator | None  # gather outputs' allocator (None: the caching one)
    post_forward_group: ProcessGroup | None  # reshard_after_forward=n's n ranks
    offload: bool  # the shards live in host memory: uploaded first
    policy: CommPolicy | None = None  # quantize_gather: gathers through int8/fp8 blocks


class Gather:
    """The way one group gathers; subclasses differ only in ``issue``/``finish``."""

    name = ""

    def __init__(self, layout: FlatShard, comm: GatherComm) -> None:
        self.layout = layout
        self.comm = comm
        # A cast to param_dtype, or an upload from host memory, comes first (for an
        # offloaded group also on a CPU run, where the devices match: the same
        # path as on a GPU, so a CPU run holds the copies a GPU run holds).
        self.copy_in = (
            layout.flat.dtype != layout.compute_dtype
            or layout.flat.device != layout.device
            or comm.offload
        )
        self.buffers: tuple[torch.Tensor, ...] = ()  # what the collective in flight uses

    def issue(
        self, kept: torch.Tensor | None, backward: bool = False
    ) -> collectives.Pending | None:
        """Start the gather; ``backward``: for backward's gradients (a pre-backward or a
        backward prefetch; not a recomputed forward), which ``CommPolicy(quantize_gather=
        "forward")`` gathers at full precision."""
        raise NotImplementedError

    def finish(self) -> None:
        """The gather has been waited for: lay it out (nothing, where it landed in place)."""

    def drop(self) -> None:
        self.buffers = ()

    def _uploaded(self) -> torch.Tensor:
        """The flat shard where the gather reads it: a copy on the device when offloaded."""
        f = self.layout
        return offload.upload(f.flat, f.device, f.label) if self.comm.offload else f.flat


class Aliased(Gather):
    """One rank in the parameters' own dtype: the unsharded parameters are the shards."""

    name = "aliased"

    def issue(
        self, kept: torch.Tensor | None, backward: bool = False
    ) -> collectives.Pending | None:
        return None


class CastNow(Gather):
    """One rank on the CPU, not offloaded: one casting copy, done at once."""

    name = "cast"

    def issue(
        self, kept: torch.Tensor | None, backward: bool = False
    ) -> collectives.Pending | None:
        f = self.layout
        f.allocate_unsharded()
        with label("gather"):
            f.unsharded_flat.copy_(f.flat)
        return None


class CastBeside(Gather):
    """One rank on a GPU (or offloaded): the cast or upload runs on the gather side
    stream, beside compute like a gather's copy-in, so a prefetch hides it."""

    name = "cast beside"

    def issue(
        self, kept: torch.Tensor | None, backward: bool = False
    ) -> collectives.Pending | None:
        f = self.layout
        f.allocate_unsharded()
        with collectives.side_stream("gather", f.device), label("gather"):
            f.unsharded_flat.copy_(self._uploaded())
            work = collectives.StreamWork(f.device)
        kind = "upload" if self.comm.offload else "cast"
        return collectives.Pending(work, label=f.label, kind=kind)


class InPlace(Gather):
    """Each parameter gathered straight into its own storage, one grouped collective:
    no copy-out (split along dim 0, the ranks' pieces rank after rank are the parameter)."""

    name = "in place"

    def issue(
        self, kept: torch.Tensor | None, backward: bool = False
    ) -> collectives.Pending | None:
        f = self.layout
        f.allocate_unsharded()
        outs, slots, shards, sizes = f.in_place
        with collectives.side_stream("gather", f.device if self.copy_in else None):
            with label("gather"):
                if self.copy_in:  # cast (or uploaded) into this rank's slot of each output
                    if self.comm.offload:
                        # Uploaded as it is, cast on the device.
                        shards = list(self._uploaded().split(sizes))
                    torch._foreach_copy_(slots, shards)
                return collectives.all_gather_each(
                    outs, slots if self.copy_in else shards, self.comm.group, f.label
                )


class RankMajor(Gather):
    """Into one rank-major buffer, copied out to the parameters once gathered: another
    split dim (the ranks' pieces interleave), a custom all-gather or allocator (they
    get one flat buffer, as FSDP2 gives them)."""

    name = "rank-major"

    def __init__(self, layout: FlatShard, comm: GatherComm) -> None:
        super().__init__(layout, comm)
        self.interleaved = any(sp.dim != 0 for sp in layout.params)
        self.slots = [sp.slot for sp in layout.params]

    def _output(self) -> torch.Tensor:
        f = self.layout
        return collectives.comm_buffer(
            self.comm.alloc, f.world * f.shard_numel, f.compute_dtype, f.device
        )

    def issue(
        self, kept: torch.Tensor | None, backward: bool = False
    ) -> collectives.Pending | None:
        f = self.layout
        # The parameters' storage is allocated only at the copy-out: a gather in
        # flight (a prefetch) holds one buffer, not two.
        with label("gather"):
            out = self._output()
            src = f.flat
            if self.copy_in:
                # Cast (or uploaded) straight into this rank's slot of the output:
                # an in-place all-gather, no second buffer.
                src = out.view(f.world, f.shard_numel)[f.rank]
            with collectives.side_stream("gather", f.device if self.copy_in else None):
                if self.copy_in:
                    # Uploaded as it is, cast on the device (a cross-device copy that
                    # also casts would cast on the CPU first).
                    src.copy_(self._uploaded())
                pending = collectives.all_gather(
                    out, src, self.comm.group, f.label, self.comm.custom
                )
        self.buffers = (src, out)
        return pending

    def finish(self) -> None:
        f = self.layout
        out = self.buffers[-1]
        self.buffers = ()
        f.allocate_unsharded()
        with label("copy-out"):
            gathered = out.view(f.world, f.shard_numel)
            if not self.interleaved:
                torch.split_with_sizes_copy(gathered, self.slots, dim=1, out=f.copy_out)
            else:
                pieces = gathered.split(self.slots, dim=1)
                for sp, piece, dst in zip(f.params, pieces, f.copy_out):
                    dst.copy_(piece if sp.dim == 0 else sp.rank_major(piece))


class Around(RankMajor):
    """A rank-major gather of its own for some gathers, ``inner``'s (the way the group
    gathers without it) for the others: ``issue`` sets ``own`` to say which, and
    ``finish`` and ``drop`` follow it."""

    def __init__(self, layout: FlatShard, comm: GatherComm, inner: Gather) -> None:
        super().__init__(layout, comm)
        self.inner = inner
        self.own = False

    def finish(self) -> None:
        if self.own:
            super().finish()
        else:
            self.inner.finish()

    def drop(self) -> None:
        self.buffers = ()
        self.inner.drop()


class AfterForwardPart(Around):
    """``reshard_after_forward=n``: a gather from the part kept after forward runs
    over this rank's group of n ranks (its output is the usual rank-major buffer);
    any other gather is ``inner``'s."""

    name = "post-forward part"

    def __init__(self, layout: FlatShard, comm: GatherComm, inner: Gather) -> None:
        super().__init__(layout, comm, inner)
        self.name = f"{inner.name}, post-forward part"

    def issue(
        self, kept: torch.Tensor | None, backward: bool = False
    ) -> collectives.Pending | None:
        self.own = kept is not None
        if kept is None:
            return self.inner.issue(None, backward)
        assert self.comm.post_forward_group is not None
        with label("gather"):
            out = self._output()
            pending = collectives.all_gather(
                out, kept, self.comm.post_forward_group, self.layout.label, self.comm.custom
            )
        self.buffers = (kept, out)
        return pending


class Quantized(Around):
    """``CommPolicy.quantize_gather`` (qwZ): this rank's flat shard in int8 (or fp8)
    blocks with their scales, one byte-row all-gather, dequantized into a rank-major
    buffer in the compute dtype when waited for, then copied out as ``RankMajor``
    does. Gathers the policy keeps at full precision (backward's, under
    ``"forward"``) are ``inner``'s, the way the group gathers without the policy.

    It quantizes the flat shard as stored (fp32 master weights, say), not its cast
    to ``param_dtype``: one rounding, not two.

    Alternatives considered. Dequantizing straight into the parameters' storage
    (no rank-major buffer): a block spans parameters, so each parameter would
    need its blocks' scales sliced out; one buffer and the copy-out ``RankMajor``
    already has cost one more copy of the unsharded parameters, on the compute
    stream. Quantizing the kept part of ``reshard_after_forward=n`` as well:
    that gather stays inside the node, where bytes are cheap.
    """

    name = "quantized"

    def __init__(self, layout: FlatShard, comm: GatherComm, inner: Gather) -> None:
        super().__init__(layout, comm, inner)
        assert comm.policy is not None
        self.policy = comm.policy

    def issue(
        self, kept: torch.Tensor | None, backward: bool = False
    ) -> collectives.Pending | None:
        self.own = self.policy.quantizes_gather(backward)
        if not self.own:
            return self.inner.issue(kept, backward)
        f, p = self.layout, self.policy
        with label("gather"):
            # Allocated on the compute stream, before the side stream (its docstring).
            out = self._output().view(f.world, f.shard_numel)
            send, recv = node_collectives.quantized_buffers(
                f.shard_numel, f.world, p.block_size, f.device, self.comm.alloc
            )
            with collectives.side_stream("gather", f.device):
                pending = node_collectives.quantized_all_gather(
                    out, self._uploaded(), send, recv, self.comm.group, f.label,
                    p.block_size, p.quant_dtype,
                )  # fmt: skip
        self.buffers = (send, recv, out)
        return pending


class Packed(Gather):
    """Parameters that gather themselves (extensions.py): one byte-packed all-gather,
    unpacked and handed to their ``post`` hooks (``PackedGather``)."""

    name = "packed"

    def __init__(self, layout: FlatShard, comm: GatherComm, packed: PackedGather) -> None:
        super().__init__(layout, comm)
        self.packed = packed

    def issue(
        self, kept: torch.Tensor | None, backward: bool = False
    ) -> collectives.Pending | None:
        with label("gather"):
            send, out, pending = self.packed.issue(self.layout, self.comm)
        self.buffers = (send, out)
        return pending

    def finish(self) -> None:
        out = self.buffers[-1]
        self.buffers = ()
        self.layout.allocate_unsharded()
        with label("copy-out"):
            self.packed.unpack(self.layout, out)


def choose(layout: FlatShard, comm: GatherComm, packed: PackedGather | None) -> Gather:
    """The way ``layout`` gathers now (see the module docstring for when it is asked);
    ``packed``: the group's packing, where parameters gather themselves."""
    if layout.aliased:
        return Aliased(layout, comm)
    if packed is not None:
        return Packed(layout, comm, packed)
    if layout.world == 1:
        if layout.device.type != "cuda" and not comm.offload:
            return CastNow(layout, comm)
        return CastBeside(layout, comm)
    interleaved = any(sp.dim != 0 for sp in layout.params)
    if not interleaved and comm.alloc is None and comm.custom is None:
        way: Gather = InPlace(layout, comm)
    else:
        way = RankMajor(layout, comm)
    # A user's all-gather is called with the parameters' dtype, as FSDP2 calls it: it wins.
    if comm.policy is not None and comm.policy.quantize_gather != "none" and comm.custom is None:
        way = Quantized(layout, comm, way)
    if comm.post_forward_group is not None:
        return AfterForwardPart(layout, comm, way)
    return way


# ---- the byte-packed gather of parameters that gather themselves ----------------------------


class PackedGather:
    """One group's byte-packed all-gather (see the module docstring)."""

    def __init__(self) -> None:
        # Per parameter, per input: (byte offset, slot bytes, gathered shape per rank, dtype).
        self.packing: list[list[tuple[int, int, torch.Size, torch.dtype]]] | None = None
        self.bytes_per_rank = 0
        self.sizes: list[int] = []  # every slot's bytes, in order: the unpack's split
        self._zeros: torch.Tensor | None = None  # padding after short pieces, read only

    def _padding(self, n: int, device: torch.device) -> torch.Tensor:
        if self._zeros is None or self._zeros.numel() < n or self._zeros.device != device:
            self._zeros = torch.zeros(n, dtype=torch.uint8, device=device)
        return self._zeros[:n]

    def inputs(self, f: FlatShard) -> list[list[torch.Tensor]]:
        """Each parameter's tensors to send: ``pre``'s, or its piece in ``param_dtype``."""
        out = []
        for sp, local in zip(f.params, f.shard_locals):
            if sp.ext is not None:
                module = sp.locations[0][0]
                out.append(sp.ext.pre(local, f.mesh, sp.shape, module, f.mp_policy))
            else:
                out.append([local.to(f.compute_dtype)])
        return out

    def _plan(self, f: FlatShard, inputs: list[list[torch.Tensor]]) -> None:
        packing, offset = [], 0
        for sp, ins in zip(f.params, inputs):
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
            packing.append(slots)
        self.packing, self.bytes_per_rank = packing, offset
        self.sizes = [slot for slots in packing for _, slot, _, _ in slots]

    def issue(
        self, f: FlatShard, comm: GatherComm
    ) -> tuple[torch.Tensor, torch.Tensor, collectives.Pending]:
        """Run the ``pre`` hooks, pack, and start the all-gather: (send, out, pending).

        Beside compute, as plain gathers are (collectives.side_stream), once
        the packing is known: the send and receive buffers are allocated first,
        on the compute stream; the hooks' own temporaries come from the side
        stream, as in FSDP2's copy-in. The first gather runs in order, since
        it fixes the packing.
        """
        first = self.packing is None
        if first:
            send = self._pack(f, self.inputs(f))
        else:
            send = torch.zeros(self.bytes_per_rank, dtype=torch.uint8, device=f.device)
        out = collectives.comm_buffer(comm.alloc, f.world * send.numel(), torch.uint8, f.device)
        if f.world == 1:  # nothing to gather: the packed bytes are the output
            if not first:
                self._pack(f, self.inputs(f), send)
            out.copy_(send)
            return send, out, collectives.Pending(None)
        with collectives.side_stream("gather", None if first else f.device):
            if not first:
                self._pack(f, self.inputs(f), send)
            pending = collectives.all_gather(out, send, comm.group, f.label, comm.custom)
        return send, out, pending

    def _pack(
        self,
        f: FlatShard,
        inputs: list[list[torch.Tensor]],
        send: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This rank's send buffer; padding past a short last piece stays zero."""
        if self.packing is None:
            self._plan(f, inputs)
        assert self.packing is not None
        if [[t.dtype for t in ins] for ins in inputs] != [
            [dt for *_, dt in slots] for slots in self.packing
        ]:
            raise ValueError(
                f"{f.label}: fsdp_pre_all_gather returned other tensors than at the first "
                "gather (count or dtype); the gather layout is fixed at the first one"
            )
        parts = []
        for ins, slots in zip(inputs, self.packing):
            for t, (_, slot, _, _) in zip(ins, slots):
                data = t.contiguous().view(-1).view(torch.uint8)
                parts.append(data)
                if data.numel() < slot:  # a short last piece
                    parts.append(self._padding(slot - data.numel(), data.device))
        if send is None:
            send = torch.empty(self.bytes_per_rank, dtype=torch.uint8, device=f.device)
        torch.cat(parts, out=send)
        return send

    def unpack(self, f: FlatShard, gathered: torch.Tensor) -> None:
        """Copy every slot of the gathered bytes out (one kernel), then let ``post`` build
        the unsharded parameters."""
        assert self.packing is not None
        rows = gathered.view(f.world, self.bytes_per_rank)
        outs: list[torch.Tensor] = []
        refilled: list[torch.Tensor] = []
        for sp, out, slots in zip(f.params, f.copy_out, self.packing):
            ext = sp.ext
            if ext is None:  # the rank-major view of its part of the unsharded buffer
                outs.append(out.view(torch.uint8))
                continue
            if not ext.outputs:
                for _, _, shape, dt in slots:
                    full = (f.world * shape[0], *shape[1:])
                    ext.outputs.append(torch.empty(full, dtype=dt, device=f.device))
            ext.refill()
            outs.extend(t.view(f.world, -1).view(torch.uint8) for t in ext.outputs)
            refilled.extend(((sp.unsharded,) if ext.made else ()) + tuple(ext.outputs))
        # Refilled in place under autograd's nose, as plain parameters are
        # (param_group.py): the saved tensors must not look modified.
        with torch.autograd._unsafe_preserve_version_counter(tuple(refilled)):
            torch.split_with_sizes_copy(rows, self.sizes, dim=1, out=outs)
            for sp, local in zip(f.params, f.shard_locals):
                if sp.ext is not None:
                    made = sp.unsharded if sp.ext.made else None
                    sp.unsharded = sp.ext.post(local, f.compute_dtype, made, sp.shape)
                    sp.plain = sp.unsharded
