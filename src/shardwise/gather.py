"""How one group gathers its parameters: one strategy object, chosen when the layout is built.

Why a strategy: which way a group gathers (the shards aliased, one rank's
cast, each parameter in place, one rank-major buffer with a copy-out, the
packed bytes of parameters that gather themselves, the part kept after
forward) follows from settings that rarely change: the mesh, the dtypes,
where the shards live, a custom all-gather or allocator, a post-forward
group. So ``choose`` decides once, when the group's layout is built or
rebuilt (``FlatShard._make_unsharded_views``: construction, ``repack``,
``load_state_dict(assign=True)``) and when one of those settings changes
through its public setter; the hot path only calls ``issue`` and ``finish``.

Each strategy's ``issue`` starts the gather from the shards and returns the
collective in flight, or None when the parameters are already unsharded
(nothing to wait for); ``finish`` lays the gathered bytes out once the wait is
over. The buffers in flight live on the strategy (``drop`` forgets them), so
that a gather's operands outlive the collective. This is the gather half of
what reduce.py is for reductions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import collectives, offload
from .labels import label

if TYPE_CHECKING:
    from .param_group import ParamGroup


class Gather:
    """The way one group gathers; subclasses differ only in ``issue``/``finish``."""

    name = ""

    def __init__(self, g: ParamGroup) -> None:
        # A cast to param_dtype, or an upload from host memory, comes first (for an
        # offloaded group also on a CPU run, where the devices match: the same
        # path as on a GPU, so a CPU run holds the copies a GPU run holds).
        self.copy_in = (
            g.flat.dtype != g.compute_dtype
            or g.flat.device != g.device
            or g.settings.offload_policy is not None
        )
        self.buffers: tuple[torch.Tensor, ...] = ()  # what the collective in flight uses

    def issue(self, g: ParamGroup) -> collectives.Pending | None:
        raise NotImplementedError

    def finish(self, g: ParamGroup) -> None:
        """The gather has been waited for: lay it out (nothing, where it landed in place)."""

    def drop(self) -> None:
        self.buffers = ()


class Aliased(Gather):
    """One rank in the parameters' own dtype: the unsharded parameters are the shards."""

    name = "aliased"

    def issue(self, g: ParamGroup) -> collectives.Pending | None:
        return None


class CastNow(Gather):
    """One rank on the CPU, not offloaded: one casting copy, done at once."""

    name = "cast"

    def issue(self, g: ParamGroup) -> collectives.Pending | None:
        g.allocate_unsharded()
        with label("gather"):
            g.unsharded_flat.copy_(g.flat)
        return None


class CastBeside(Gather):
    """One rank on a GPU (or offloaded): the cast or upload runs on the gather side
    stream, beside compute like a gather's copy-in, so a prefetch hides it."""

    name = "cast beside"

    def issue(self, g: ParamGroup) -> collectives.Pending | None:
        g.allocate_unsharded()
        offloaded = g.settings.offload_policy is not None
        with collectives.side_stream("gather", g.device), label("gather"):
            src = offload.upload(g.flat, g.device, g.label) if offloaded else g.flat
            g.unsharded_flat.copy_(src)
            work = collectives.StreamWork(g.device)
        kind = "upload" if offloaded else "cast"
        return collectives.Pending(work, label=g.label, kind=kind)


class InPlace(Gather):
    """Each parameter gathered straight into its own storage, one grouped collective:
    no copy-out (split along dim 0, the ranks' pieces rank after rank are the parameter)."""

    name = "in place"

    def issue(self, g: ParamGroup) -> collectives.Pending | None:
        g.allocate_unsharded()
        outs, slots, shards, sizes = g._in_place
        with collectives.side_stream("gather", g.device if self.copy_in else None):
            with label("gather"):
                if self.copy_in:  # cast (or uploaded) into this rank's slot of each output
                    if g.settings.offload_policy is not None:
                        # Uploaded as it is, cast on the GPU (on a CPU run too: a
                        # copy of its own, as a GPU run holds).
                        shards = list(offload.upload(g.flat, g.device, g.label).split(sizes))
                    torch._foreach_copy_(slots, shards)
                return collectives.all_gather_each(
                    outs, slots if self.copy_in else shards, g.shard_group, g.label
                )


class RankMajor(Gather):
    """Into one rank-major buffer, copied out to the parameters once gathered: another
    split dim (the ranks' pieces interleave), a custom all-gather or allocator (they
    get one flat buffer, as FSDP2 gives them)."""

    name = "rank-major"

    def __init__(self, g: ParamGroup) -> None:
        super().__init__(g)
        self.interleaved = any(sp.dim != 0 for sp in g.params)
        self.slots = [sp.slot for sp in g.params]

    def issue(self, g: ParamGroup) -> collectives.Pending | None:
        # The parameters' storage is allocated only at the copy-out: a gather in
        # flight (a prefetch) holds one buffer, not two.
        with label("gather"):
            out = g.comm_buffer(g.world * g.shard_numel, g.compute_dtype)
            src = g.flat
            if self.copy_in:
                # Cast (or uploaded) straight into this rank's slot of the output:
                # an in-place all-gather, no second buffer.
                src = out.view(g.world, g.shard_numel)[g.rank]
            with collectives.side_stream("gather", g.device if self.copy_in else None):
                if self.copy_in:
                    # Uploaded as it is, cast on the GPU (a cross-device copy that
                    # also casts would cast on the CPU first).
                    offloaded = g.settings.offload_policy is not None
                    src.copy_(offload.upload(g.flat, g.device, g.label) if offloaded else g.flat)
                pending = collectives.all_gather(
                    out, src, g.shard_group, g.label, g.settings.custom_all_gather
                )
        self.buffers = (src, out)
        return pending

    def finish(self, g: ParamGroup) -> None:
        out = self.buffers[-1]
        self.buffers = ()
        g.allocate_unsharded()
        with label("copy-out"):
            gathered = out.view(g.world, g.shard_numel)
            if not self.interleaved:
                torch.split_with_sizes_copy(gathered, self.slots, dim=1, out=g._copy_out)
            else:
                pieces = gathered.split(self.slots, dim=1)
                for sp, piece, dst in zip(g.params, pieces, g._copy_out):
                    dst.copy_(piece if sp.dim == 0 else sp.rank_major(piece))


class AfterForwardPart(RankMajor):
    """``reshard_after_forward=n``: a gather from the part kept after forward runs
    over this rank's group of n ranks (its output is the usual rank-major buffer);
    any other gather is ``inner``'s."""

    name = "post-forward part"

    def __init__(self, g: ParamGroup, inner: Gather) -> None:
        super().__init__(g)
        self.inner = inner
        self.name = f"{inner.name}, post-forward part"
        self._from_kept = False

    def issue(self, g: ParamGroup) -> collectives.Pending | None:
        kept = g.kept
        self._from_kept = kept is not None
        if kept is None:
            return self.inner.issue(g)
        with label("gather"):
            out = g.comm_buffer(g.world * g.shard_numel, g.compute_dtype)
            pending = collectives.all_gather(
                out, kept, g.settings.post_forward_group, g.label, g.settings.custom_all_gather
            )
        self.buffers = (kept, out)
        return pending

    def finish(self, g: ParamGroup) -> None:
        if self._from_kept:
            super().finish(g)
        else:
            self.inner.finish(g)

    def drop(self) -> None:
        self.buffers = ()
        self.inner.drop()


class Packed(Gather):
    """Parameters that gather themselves (extensions.py): one byte-packed all-gather,
    unpacked and handed to their ``post`` hooks."""

    name = "packed"

    def issue(self, g: ParamGroup) -> collectives.Pending | None:
        assert g.ext_gather is not None
        with label("gather"):
            send, out, pending = g.ext_gather.issue(g)
        self.buffers = (send, out)
        return pending

    def finish(self, g: ParamGroup) -> None:
        assert g.ext_gather is not None
        out = self.buffers[-1]
        self.buffers = ()
        g.allocate_unsharded()
        with label("copy-out"):
            g.ext_gather.unpack(g, out)


def choose(g: ParamGroup) -> Gather:
    """The way ``g`` gathers now (see the module docstring for when it is asked)."""
    if g.aliased:
        return Aliased(g)
    if g.ext_gather is not None:
        return Packed(g)
    if g.world == 1:
        if g.device.type != "cuda" and g.settings.offload_policy is None:
            return CastNow(g)
        return CastBeside(g)
    interleaved = any(sp.dim != 0 for sp in g.params)
    if not interleaved and g.settings.comm_alloc is None and g.settings.custom_all_gather is None:
        way: Gather = InPlace(g)
    else:
        way = RankMajor(g)
    if g.settings.post_forward_group is not None:
        return AfterForwardPart(g, way)
    return way
