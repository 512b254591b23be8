"""A group's parameters on one mesh: ``MeshPart``; and its reductions as one job.

Almost every group has one part: all of a ``fully_shard`` call's parameters
on its mesh. A ``shard_placement_fn`` that returns a mesh per parameter
(placement.py; torchtitan's expert parallelism) gives the group one part per
mesh. A part is what one collective can move: its own layout (``FlatShard``:
a flat shard and an unsharded buffer sized by its mesh's world), its own
process groups, the strategy it gathers by, the gather it has in flight and
its HSDP sums held back. The group (param_group.py) still runs one lifecycle:
one gather state, one attachment, one post-backward; it issues each part's
gather and waits for them all, and starts one ``ReduceJob`` per part with
gradients, which ``Reductions`` finishes as one.

Alternatives considered: one ``ParamGroup`` per mesh under one module state
(FSDP2's list of param groups) would give a module several post-backwards,
anchors and attachments, each a lifecycle the hooks would have to keep in
step; one part per mesh keeps everything above the collectives unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter, is_not
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..comm import collectives, gather, reduce
from ..comm.reduce import HeldBack, ReduceComm, ReduceJob, ReduceSettings
from ..layout.flat_shard import FlatShard
from ..layout.offload import CPUOffloadPolicy
from ..layout.precision import MixedPrecisionPolicy
from ..layout.tensor_parallel import TPLayout

_SHARDED = attrgetter("sharded")
_LOCAL = attrgetter("_local_tensor")  # a sharded parameter's (always a DTensor) local tensor


class MeshPart:
    """The parameters of a group on one mesh: ``layout.params``, group positions
    ``start`` to ``start + len(layout.params)``."""

    def __init__(self, layout: FlatShard, mesh: DeviceMesh, start: int) -> None:
        self.layout = layout
        self.mesh = mesh
        self.start = start
        self.stop = start + len(layout.params)  # (a layout's parameters are fixed)
        self.shard_group = mesh.get_group(mesh.ndim - 1)
        self.replicate_group = mesh.get_group(0) if mesh.ndim == 2 else None
        self.held_back = HeldBack()  # HSDP sums held back from the all-reduce
        # Parameters that gather themselves share one packing (gather.py), kept
        # across a change of strategy.
        self.packed = gather.PackedGather() if layout.self_gathering else None
        self.gather: gather.Gather | None = None
        # How it reduce-scatters, and over what (``choose``).
        self.scatter: reduce.Scatter | None = None
        self.reduce_comm = ReduceComm(self.shard_group)
        self.pending: collectives.Pending | None = None
        for sp in layout.params:
            sp.pos = start + sp.index

    def choose(self, gather_comm: gather.GatherComm, reduce_comm: ReduceComm) -> None:
        """Decide how this part gathers and reduce-scatters (gather.py, reduce.py),
        over what the group says (``ParamGroup.choose_comm``)."""
        self.gather = gather.choose(self.layout, gather_comm, self.packed)
        self.reduce_comm = reduce_comm
        self.scatter = reduce.choose(self.layout, reduce_comm)

    def replaced(self) -> bool:
        """Whether someone replaced the shards (``to_empty``, ``.to()``): repack."""
        f = self.layout
        # (Once per gather: compared in C, no Python call per parameter.)
        return any(map(is_not, map(_LOCAL, map(_SHARDED, f.params)), f.shard_locals))

    def reduce(
        self,
        settings: ReduceSettings,
        grads: Sequence[torch.Tensor | None],
        used: Sequence[bool],
        last_backward: bool,
        downloads: list[Any],
    ) -> ReduceJob | None:
        """This part's reduction of ``grads`` (the group's, by position), None if it has
        nothing to reduce on any rank: no parameter with a gradient here, none
        trainable (the same on every rank: a trainable one sends zeros where it got
        no gradient, as in a one-mesh group), and no HSDP sums held back. Deciding
        by this rank's gradients alone would skip a reduce-scatter its peers issue
        (an expert that got no token here)."""
        mine = list(used[self.start : self.stop])
        if (
            not any(mine)
            and self.held_back.sums is None
            and not any(sp.sharded.requires_grad for sp in self.layout.params)
        ):
            return None
        assert self.scatter is not None
        job = ReduceJob(
            self.layout,
            settings,
            self.reduce_comm,
            self.scatter,
            self.replicate_group,
            self.held_back,
            list(grads[self.start : self.stop]),
            mine,
            last_backward,
            downloads,
        )
        job.issue()
        return job


class Reductions:
    """The reductions of a group's parts, finished as one job: what root.py does
    with a ``ReduceJob`` (``overlaps``, ``scattered``, ``finish``, ``discard``),
    with shards and ``used`` by group position."""

    def __init__(self, jobs: list[tuple[MeshPart, ReduceJob]], size: int) -> None:
        self.jobs = jobs
        self.size = size
        self.last_backward = jobs[0][1].last_backward
        self.used = [False] * size
        for part, job in jobs:
            self.used[part.start : part.stop] = job.used

    @property
    def overlaps(self) -> bool:
        return any(job.overlaps for _, job in self.jobs)

    @property
    def downloaded(self) -> Any:
        # Offload's copies to the host run in order on one stream: the last one's
        # event says every earlier one has arrived too.
        events = [job.downloaded for _, job in self.jobs if job.downloaded is not None]
        return events[-1] if events else None

    def scattered(self) -> None:
        for i, (_, job) in enumerate(self.jobs):
            try:
                job.scattered()
            except BaseException:
                self._discard(i + 1)
                raise

    def discard(self) -> None:
        self._discard(0)

    def _discard(self, start: int) -> None:
        """Wait for what the jobs from ``start`` on issued, without applying it (their
        buffers must outlive their collectives), even if one of them raises."""
        error: BaseException | None = None
        for _, job in self.jobs[start:]:
            try:
                job.discard()
            except BaseException as e:  # the others still wait
                error = error or e
        if error is not None:
            raise error

    def finish(self) -> list[Any] | None:
        """Every part's shards by group position; None only when every part held its
        sums back (HSDP, ``set_requires_all_reduce(False)``)."""
        shards: list[Any] = [None] * self.size
        any_shards = False
        for i, (part, job) in enumerate(self.jobs):
            try:
                got = job.finish()
            except BaseException:
                self._discard(i + 1)  # popped from the context's list: nothing else waits
                raise
            if got is None:  # held back: nothing for its parameters this time
                self.used[part.start : part.stop] = [False] * (part.stop - part.start)
                continue
            shards[part.start : part.stop] = got
            any_shards = True
        return shards if any_shards else None


def split_by_mesh(
    named: Sequence[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]],
    mesh: DeviceMesh,
    meshes: Sequence[DeviceMesh] | None,
    device: torch.device,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: CPUOffloadPolicy | None,
    label: str,
    tp: Sequence[TPLayout | None] | None,
    dims: Sequence[int] | None,
) -> list[MeshPart]:
    """One part per mesh: the call's mesh first, then the others in the order their
    first parameter comes (the same on every rank: the order of the module's
    parameters)."""
    policies = (mp_policy, offload_policy)
    if meshes is None:
        return [MeshPart(FlatShard(named, mesh, device, *policies, label, tp, dims), mesh, 0)]
    order: list[DeviceMesh] = [mesh] if any(m == mesh for m in meshes) else []
    for m in meshes:
        if not any(m == o for o in order):
            order.append(m)
    parts: list[MeshPart] = []
    start = 0
    for m in order:
        idx = [i for i, own in enumerate(meshes) if own == m]
        layout = FlatShard(
            [named[i] for i in idx],
            m,
            device,
            *policies,
            label,
            None if tp is None else [tp[i] for i in idx],
            None if dims is None else [dims[i] for i in idx],
        )
        parts.append(MeshPart(layout, m, start))
        start += len(idx)
    return parts


# What a group's ``reduce_grads`` starts: one part's job, or every part's.
Reduction = ReduceJob | Reductions
