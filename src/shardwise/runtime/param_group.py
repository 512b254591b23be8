"""One module's parameters as the unit that is gathered and reduced: its lifecycle.

What a forward computes with, under grad, is an *attachment*: the outputs of
the hooks' autograd function (``_Unsharded`` in module.py, whose one input is
this group's anchor, an empty leaf that requires grad; the sharded
parameters stay out of the graph, as under FSDP2). Its backward is the
post-backward hook; reduced shards are put on ``.grad`` by ``assign_grads``.
Which parameters are trainable is read from the sharded parameters'
``requires_grad`` at every attachment, so freezing or unfreezing after
``fully_shard`` takes effect at the next forward.

Why the attachment outlives the forward: activation checkpointing *inside* a
sharded module (transformers' layers, ``checkpoint_wrapper``) recomputes the
module's body in backward without running its hooks, reading whatever tensors
are installed in the module then. The pre-backward re-installs the forward's
attachment (its storage refilled by its gather), so the
recomputation computes with the same autograd-tracked tensors as the forward:
a non-reentrant checkpoint finds the same saved tensors, and a reentrant one's
inner backward reaches the post-backward.

The group holds its layout (``FlatShard``, flat_shard.py: the flat shard, the
unsharded storage, the views between them) and the strategy it gathers by
(gather.py); it builds its reductions (``ReduceJob``, reduce.py). Each is
given the layout and what it needs, and returns what it made (a collective
in flight, the reduced shards); the group applies it: its state, the
installed parameters, ``.grad``. Nothing below it names it.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from itertools import compress
from operator import attrgetter
from typing import Any

import torch
import torch.nn as nn
from torch.autograd.graph import increment_version
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..comm import gather
from ..comm.reduce import ReduceComm
from ..layout.flat_shard import local_of
from ..layout.sharded_param import ShardedParam, install_each
from ..layout.tensor_parallel import TPLayout
from . import lifecycle
from .lifecycle import GROUP_TRANSITIONS, GroupState, check_group
from .mesh_part import MeshPart, Reduction, Reductions, split_by_mesh
from .settings import COMM_SETTINGS, GroupSettings
from .step_in_backward import StepInBackward
from .trace import active as active_trace

# Read per parameter per step without a Python call each (``map``).
_SHARDED, _PLAIN = attrgetter("sharded"), attrgetter("plain")
_UNSHARDED, _VERSION = attrgetter("unsharded"), attrgetter("_version")
_REQUIRES_GRAD = attrgetter("requires_grad")


class _OptimizerSteps:
    """What optimizer steps changed, so that a group kept gathered gathers again.

    Why: a group kept gathered across a step (``set_reshard_after_backward(False)``,
    ``reshard_after_forward=False``, an explicit ``unshard()``) must gather the
    new values, and foreach and fused optimizer kernels bump no version counter
    that would say so (``ParamGroup.stale``). Registered when the first group
    is built (not at import).

    A step outside backward (the caller's ``optimizer.step()``) adds one to a
    counter for the process, O(1): it touches no parameter, and every kept
    group gathers again (a step of another optimizer over other parameters
    too: once more than needed, never stale). A step inside backward (torch's
    idiom, one optimizer per parameter stepped in its post-accumulate-grad
    hook) bumps the version of each parameter it holds instead, as an in-place
    update through autograd would: it steps one module's parameters while other
    modules are kept gathered for their own backward, which must not gather
    again. optimizer_in_backward's own steps are not counted: they reshard
    what they step themselves (its shadow optimizers are marked,
    step_in_backward.py).
    """

    count = 0
    _handle: Any = None

    @classmethod
    def watch(cls) -> None:
        if cls._handle is None:
            cls._handle = register_optimizer_step_post_hook(cls._stepped)

    @classmethod
    def _stepped(cls, optimizer: Any, *args: Any) -> None:
        if getattr(optimizer, "_shardwise_shadow", False):
            return
        if torch._C._current_graph_task_id() == -1:
            cls.count += 1
        else:
            increment_version([p for pg in optimizer.param_groups for p in pg["params"]])


@dataclass(frozen=True)
class Attachment:
    """One forward's ``_Unsharded`` outputs (``tensors``) for the parameters ``params``:
    views of ``sources`` (the parameters' unsharded storage then), made from the shards
    at ``version`` (``ParamGroup._shards_version``)."""

    params: list[ShardedParam]
    tensors: tuple[torch.Tensor, ...]
    sources: tuple[torch.Tensor, ...] = ()
    version: tuple[int, int] = (-1, -1)


def will_run(node: Any) -> bool:
    """Whether the backward pass running now executes autograd node ``node``: an
    ``_Unsharded`` node, or the anchor's AccumulateGrad (which no ``autograd.grad``
    asks for, the one leaf torch would refuse the question about)."""
    return bool(torch._C._will_engine_execute_node(node))


class ParamGroup:
    """The parameters one ``fully_shard`` call owns, sharded over its mesh (or, by
    ``shard_placement_fn``, over a mesh per parameter: one ``MeshPart`` each)."""

    def __init__(
        self,
        named: Sequence[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]],
        mesh: DeviceMesh,
        settings: GroupSettings,
        label: str,
        tp: Sequence[TPLayout | None] | None = None,
        dims: Sequence[int] | None = None,
        meshes: Sequence[DeviceMesh] | None = None,
    ) -> None:
        """``settings``: the module state's own (one object, settings.py); ``tp[i]``: how
        tensor parallelism split ``named[i]`` (None: a plain parameter); ``dims[i]``:
        the dimension it is split along (default 0); ``meshes[i]``: the mesh it is
        sharded over (default ``mesh``; placement.py)."""
        self.settings = settings
        self.mesh = mesh
        # Where gathered parameters and gradients live; the shards too, unless
        # offloaded to host memory (offload.py).
        cuda = mesh.device_type == "cuda"
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        )
        self.state = GroupState.SHARDED  # written by ``_to`` only (lifecycle.py's table)
        # optimizer_in_backward's stepper: steps this group once its gradients are reduced.
        self.step_in_backward: StepInBackward | None = None
        self.stepped = False  # stepped in this backward: gathering it again is refused
        # What reshard_after_forward=int kept for backward (state SHARDED_AFTER_FORWARD).
        self.kept: torch.Tensor | None = None
        self.prefetched = False  # gathered by another module's prefetch, not yet used
        # What the gather in flight or done holds: backward's values (True) or the
        # forward's (False). They differ only where ``two_values`` (qwZ "forward").
        self.for_backward = False
        self.two_values = False  # forward and backward gathers hold other values
        self.recomputes = False  # its forward was recomputed in a backward (checkpointing)
        self.last_used: list[bool] | None = None  # which parameters got gradients last time
        # The parts' gathers in flight (the list is this gather's identity: ``in_flight``).
        self._pending: list[MeshPart] | None = None
        # The current forward's tracked parameters and the parameters they stand for.
        self.attachment: Attachment | None = None
        # Their autograd node, kept for backward (``reached_in_backward``).
        self._forward_node: Any = None
        # The one input of that node: it needs one that requires grad.
        self.anchor = torch.empty(0, device=self.device, requires_grad=True)
        self._accum: list[torch.Tensor | None] | None = None
        _OptimizerSteps.watch()
        self._gathered_version = (-1, -1)  # what the last gather read (``stale``)

        self.parts = split_by_mesh(
            named,
            mesh,
            meshes,
            self.device,
            settings.mp_policy,
            settings.offload_policy,
            label,
            tp,
            dims,
        )
        self.params: list[ShardedParam] = [sp for p in self.parts for sp in p.layout.params]
        # The call's mesh (the first part): what one-mesh callers and settings mean.
        first = self.parts[0]
        self.layout = first.layout
        self.shard_group, self.replicate_group = first.shard_group, first.replicate_group
        self.world, self.rank = self.layout.world, self.layout.rank
        self.shard_numel = self.layout.shard_numel
        self.has_tp = any(p.layout.has_tp for p in self.parts)
        # Parameters that gather themselves (extensions.py) free their own outputs.
        self.self_gathering = any(p.layout.self_gathering for p in self.parts)
        # Whether any part's gather is a collective (a mesh's world is fixed).
        self.communicates = any(p.layout.world > 1 for p in self.parts)
        self.choose_comm()

    @property
    def one_mesh(self) -> bool:
        """Whether every parameter is sharded over the ``fully_shard`` call's mesh."""
        return len(self.parts) == 1

    @property
    def label(self) -> str:
        return self.layout.label

    @label.setter
    def label(self, name: str) -> None:
        for part in self.parts:
            part.layout.label = name  # what the collectives and copies are labelled by

    @property
    def orig_dtype(self) -> torch.dtype:
        return self.layout.orig_dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.layout.compute_dtype

    @property
    def reduce_dtype(self) -> torch.dtype:
        return self.layout.reduce_dtype

    def load_assigned(self, state_dict: dict[str, Any], keys: list[list[str]]) -> bool:
        """``load_state_dict(sd, assign=True)`` (``FlatShard.load_assigned``): a new
        flat shard holds nothing gathered, and may gather another way."""
        if self.state is GroupState.GATHERING:
            self.reshard()  # the gather in flight reads the old flat shard
        rebuilt = False
        for part in self.parts:
            rebuilt |= part.layout.load_assigned(state_dict, keys[part.start : part.stop])
        if rebuilt:
            self.kept = None
            if self.state is not GroupState.SHARDED:
                self._to(GroupState.SHARDED)
            self.choose_comm()
        return rebuilt

    # ---- unshard / reshard --------------------------------------------------------------

    def mark_stepped(self, stepped: bool) -> None:
        """optimizer_in_backward stepped this group in this backward (True: a gather
        before the backward ends is refused) or the backward is over (False)."""
        self.stepped = stepped

    def unshard(self, backward: bool = False) -> None:
        """Issue this group's all-gather (async); ``wait_unsharded`` finishes it.
        ``backward``: for a backward's gradients (a communication policy may gather
        those at full precision; a recomputed forward's gather is a forward's)."""
        if not self.sharded:
            return
        if self.stepped:
            raise RuntimeError(
                f"module {self.label!r} is needed again in the backward that already "
                "stepped it (optimizer_in_backward): it runs in two reentrant-checkpointed "
                "regions, so its gradients would be computed with stepped parameters; use "
                "use_reentrant=False there, or remove() the handle"
            )
        # A gather from the part kept after forward holds the forward's values.
        self.for_backward = backward and self.kept is None
        in_flight = []
        for part in self.parts:
            if part.replaced():
                part.layout.repack()  # someone replaced the shards (to_empty, .to())
                self._choose(part)  # a new layout may gather another way
            assert part.gather is not None
            part.pending = part.gather.issue(self.kept if self._serves(part) else None, backward)
            if part.pending is not None:  # else nothing to wait for (aliased, a cast done)
                in_flight.append(part)
        if not in_flight:
            self.kept = None
            self._to(GroupState.UNSHARDED)
            self._install_plain()
        else:
            self._pending = in_flight
            self._to(GroupState.GATHERING)

    def prefetches(self, in_backward: bool, past_first: bool = False) -> bool:
        """Whether this group's gather issues prefetches: whether gathering ahead
        hides anything. A collective or an upload, yes. One rank's cast on a GPU
        (on the side stream): in forward, and in backward only once a module's
        backward has finished (``past_first``). The first module's backward is
        where the peak is, with every activation alive: a layer cast ahead
        there would hold one more than FSDP2 does (it casts on demand at one
        rank); after it, the finished block has freed more activations than
        one layer cast ahead holds. An alias, or a cast on the CPU, never:
        gathering those ahead only holds memory sooner."""
        if self.communicates or self.settings.offload_policy is not None:
            return True
        cast_on_gpu = self.device.type == "cuda" and all(
            not p.layout.aliased and p.packed is None for p in self.parts
        )
        return cast_on_gpu and (not in_backward or past_first)

    @property
    def in_flight(self) -> Any:
        """The gather issued and not yet waited for (None: none is)."""
        return self._pending if self.state is GroupState.GATHERING else None

    @property
    def sharded(self) -> bool:
        """Nothing gathered or being gathered (a part kept after forward may be)."""
        return self.state is GroupState.SHARDED or self.state is GroupState.SHARDED_AFTER_FORWARD

    def _to(self, new: GroupState) -> None:
        if (self.state, new) not in GROUP_TRANSITIONS or lifecycle.observed_groups is not None:
            check_group(self.label, self.state, new)  # raises, or a test records
        self.state = new

    def wait_unsharded(self, backward: bool = False) -> None:
        if self.sharded:
            self.unshard(backward)
        if self.state is not GroupState.GATHERING:
            return
        assert self._pending is not None
        for part in self._pending:
            assert part.pending is not None and part.gather is not None
            part.pending.wait()
            part.gather.finish()
            part.pending = None
        self._pending = self.kept = None
        self._to(GroupState.UNSHARDED)
        self._install_plain()

    def settings_changed(self, names: Collection[str]) -> None:
        """``ModuleState.change_settings`` changed ``names``: a part kept after forward
        for another post-forward group is stale, and how the group communicates is
        chosen again where a setting that decides it changed."""
        if "post_forward_group" in names:
            self._drop_kept()
        if not COMM_SETTINGS.isdisjoint(names):
            self.choose_comm()

    def choose_comm(self) -> None:
        """Decide how each part gathers and reduce-scatters (gather.py, reduce.py): when
        the layout is built or rebuilt and when a setting that decides it changes."""
        if self.state is GroupState.GATHERING:
            self.reshard()  # the gather in flight belongs to the old way
        for part in self.parts:
            self._choose(part)
        policy = self.settings.comm_policy
        self.two_values = (
            self.communicates and policy is not None and policy.quantize_gather == "forward"
        )

    def _serves(self, part: MeshPart) -> bool:
        """Whether the communication settings serve ``part``: they were made for the
        ``fully_shard`` call's process group (an allocator, a separate reduce-scatter
        group, node groups, a post-forward group of its ranks), so they serve the
        part that communicates over it; a part on a mesh of its own (placement.py)
        communicates plainly. The collectives a user supplies, node-local backward and
        ``reshard_after_forward=int`` are refused with several meshes."""
        return part.shard_group is self.shard_group

    def _choose(self, part: MeshPart) -> None:
        s, own = self.settings, self._serves(part)
        part.choose(
            gather.GatherComm(
                part.shard_group,
                s.custom_all_gather if own else None,
                s.comm_alloc if own else None,
                s.post_forward_group if own else None,
                s.offload_policy is not None,
                s.comm_policy if own else None,
            ),
            ReduceComm(
                (s.reduce_scatter_group or part.shard_group) if own else part.shard_group,
                s.custom_reduce_scatter if own else None,
                s.comm_alloc if own else None,
                s.comm_policy if own else None,
            ),
        )

    def gather_values(self, backward: bool) -> None:
        """Gathered (or gathering) with the values ``backward`` asks for: under qwZ
        "forward" a forward's gather holds the quantized weights and a backward's the
        full-precision ones. A recomputed forward must compute with the forward's
        (else its activations are not the ones the forward made) and the gradients
        that follow with the backward's, as without checkpointing: what is gathered
        with the other values is dropped and gathered again."""
        if self.two_values and not self.sharded:
            if self.for_backward != backward:
                self.reshard()
        self.wait_unsharded(backward)

    def _shards_version(self) -> tuple[int, int]:
        # In-place updates through DTensor bump the parameter's own version
        # counter, not the local tensor's: dispatch runs below autograd. foreach
        # and fused optimizer kernels bump neither, so an optimizer step counts
        # as a change too (_OptimizerSteps). Both only grow.
        return sum(map(_VERSION, map(_SHARDED, self.params))), _OptimizerSteps.count

    def stale(self) -> bool:
        """Gathered, but the shards changed since (an optimizer step while kept gathered)."""
        return (
            self.state is GroupState.UNSHARDED and self._shards_version() != self._gathered_version
        )

    def _install_plain(self) -> None:
        self._gathered_version = self._shards_version()  # what this gather read
        install_each(self.params, map(_PLAIN, self.params))
        self.reinstall_kept()

    @property
    def trainable(self) -> list[ShardedParam]:
        """The parameters that require grad now (users may freeze after fully_shard)."""
        return list(compress(self.params, map(_REQUIRES_GRAD, map(_SHARDED, self.params))))

    def attach(self, track: Any, recompute: bool) -> None:
        """Install unsharded parameters that autograd tracks back to this group:
        ``track(trainable, anchor)``, the hooks' autograd function, makes them.

        Done at most once per forward pass (a module called twice reuses it),
        so one backward runs one post-backward for the group. A recomputed
        forward's node is not the one backward asks about (``reached_in_backward``).
        """
        if self.attachment is None:
            trainable = self.trainable
            if len(trainable) != len(self.params):
                # Frozen since an earlier attachment still installed: its tracked
                # tensor would carry gradients to that post-backward once more.
                tracked = {id(sp) for sp in trainable}
                for sp in self.params:
                    if id(sp) not in tracked:
                        sp.install(sp.plain)
            if not trainable:
                return
            out = track(trainable, self.anchor)
            out = out if isinstance(out, tuple) else (out,)
            if not recompute:
                # The function's node, which runs once any parameter has a gradient.
                self._forward_node = out[0].grad_fn
            # A view each: every parameter gets a gradient node of its own (the
            # function's node is shared by the group), which pipeline parallel's
            # zero-bubble weight pass looks up per parameter (pipeline.py).
            out = tuple(map(torch.Tensor.view_as, out, out))
            if self.has_tp:
                out = tuple(t if sp.tp is None else sp.tp.wrap(t) for sp, t in zip(trainable, out))
            sources = tuple(map(_UNSHARDED, trainable))
            self.attachment = Attachment(trainable, out, sources, self._shards_version())
        self.install(self.attachment)

    @staticmethod
    def install(attachment: Attachment) -> None:
        """Install an attachment's tracked parameters (again: see the module docstring)."""
        install_each(attachment.params, attachment.tensors)

    def reached_in_backward(self) -> bool:
        """Whether the backward running now reaches this group's post-backward (an
        ``autograd.grad`` on an activation stops short of the modules before it:
        gathering those ahead would be wasted). True when unknown."""
        node = self._forward_node
        return node is None or will_run(node)

    @property
    def attached(self) -> bool:
        """Whether this forward handed out autograd-tracked parameters (some are trainable)."""
        return self.attachment is not None

    def detach_autograd(self) -> None:
        """Forget the forward pass's attachment (a new forward needs a new one),
        unless the group stays gathered (``keeps_attachment``)."""
        if not self.keeps_attachment():
            self.attachment = None

    def keeps_attachment(self) -> bool:
        """Whether the next forward reuses this one's tracked parameters: the group is
        still gathered from it, and no optimizer step changed the shards since (the
        microbatches of a step, kept gathered). Pipeline parallel's zero-bubble
        schedules need it: their weight pass finds a microbatch's parameters through
        ``module.parameters()``, after other microbatches' forwards (pipeline.py).
        Gathered anew, or with other parameters trainable now (frozen or unfrozen
        since), a forward makes a new attachment."""
        att = self.attachment
        if att is None or self.state is not GroupState.UNSHARDED:
            return False
        if att.version != self._shards_version():
            return False  # an optimizer step since (also one while resharded in between)
        trainable = self.trainable
        return (
            len(trainable) == len(att.params)
            and all(a is b for a, b in zip(att.params, trainable))
            # (A rebuilt layout has new unsharded storage: the views are of the old.)
            and all(src is sp.unsharded for src, sp in zip(att.sources, trainable))
        )

    def reinstall_kept(self) -> None:
        """Gathered again with an attachment still kept: install it, not the plain
        tensors. Pipelining's runtime reshards and regathers a stage between
        microbatches; its weight pass finds their gradient nodes through
        ``parameters()`` (pipeline.py)."""
        if self.attachment is not None and self.keeps_attachment():
            self.install(self.attachment)

    def take_tensor_grads(self) -> None:
        """Add the gradients written to the tracked parameters' ``.grad`` (pipeline
        parallel's zero-bubble weight pass writes them there instead of running the
        post-backward) to the local sum, and clear them."""
        att = self.attachment
        if att is None:
            return
        grads: list[torch.Tensor | None] = [None] * len(self.params)
        with warnings.catch_warnings():  # .grad of a non-leaf: read on purpose
            warnings.simplefilter("ignore", UserWarning)
            for sp, t in zip(att.params, att.tensors):
                grads[sp.pos], t.grad = t.grad, None
        if any(g is not None for g in grads):
            self.accumulate(grads)

    def reshard(self, keep: bool = False) -> None:
        """Free the unsharded parameters. ``keep``: after forward, with a post-forward
        group (``reshard_after_forward=int``), keep this rank's part for backward."""
        kept = None
        if (
            keep
            and self.settings.post_forward_group is not None
            and self.state is GroupState.UNSHARDED
        ):
            kept = self.layout.part_for(self.settings.post_forward_group.size())
        if self.state is GroupState.GATHERING:
            assert self._pending is not None
            for part in self._pending:
                assert part.pending is not None and part.gather is not None
                part.pending.wait()
                part.pending = None
                part.gather.drop()
            self._pending = None
        elif self.state is GroupState.SHARDED_AFTER_FORWARD:
            if not keep:
                self._drop_kept()
            return
        elif self.state is GroupState.SHARDED:
            return
        install_each(self.params, map(_SHARDED, self.params))
        if self.self_gathering:
            for sp in self.params:
                if sp.ext is not None:
                    sp.ext.free()
        for part in self.parts:
            if not part.layout.aliased:
                part.layout.unsharded_flat.untyped_storage().resize_(0)
        # The attachment survives a reshard: a module called twice in one forward
        # uses the same autograd outputs (the storage is refilled in place), so
        # its backward runs one post-backward. The context clears it per forward.
        self.prefetched = False
        self.kept = kept
        self._to(GroupState.SHARDED if kept is None else GroupState.SHARDED_AFTER_FORWARD)
        tracer = active_trace()
        if tracer is not None:
            tracer.instant("reshard", self.label)

    def _drop_kept(self) -> None:
        """Forget the part kept after forward (stale once the optimizer stepped)."""
        self.kept = None
        if self.state is GroupState.SHARDED_AFTER_FORWARD:
            self._to(GroupState.SHARDED)

    def new_forward(self) -> None:
        """A root forward starts: it makes its own attachment (one per module per
        forward; the one of a group still gathered is kept, ``keeps_attachment``),
        and a part kept after forward (``reshard_after_forward=int``) for a
        backward that never came is stale once the optimizer has stepped: gather anew."""
        self._drop_kept()
        if not self.keeps_attachment():
            self.attachment = None

    @property
    def unsharded_bytes(self) -> int:
        """Bytes of unsharded storage this group holds right now (also a kept part)."""
        kept = 0 if self.kept is None else self.kept.nbytes
        return sum(p.layout.unsharded_nbytes for p in self.parts) + kept

    # ---- gradients ----------------------------------------------------------------------

    def reduce_grads(
        self, grads: list[torch.Tensor | None], last_backward: bool, downloads: list[Any]
    ) -> Reduction | None:
        """Start averaging the unsharded gradients; returns the job in flight (None:
        nothing to reduce now). Its ``finish`` returns the reduced shards, which
        ``assign_grads`` puts on ``.grad``.

        ``grads`` has one entry per parameter of the group, ``None`` for those
        without a gradient (frozen, unused). With gradient sync off, gradients
        are summed locally instead and the first synced backward reduces that
        sum once.
        """
        if not self.settings.requires_gradient_sync:
            self.accumulate(grads)
            return None
        if self._accum is not None:
            grads = [
                a if g is None else (g if a is None else a.add_(g))
                for a, g in zip(self._accum, grads)
            ]
            self._accum = None
        used = [g is not None for g in grads]
        if not any(used) and self.settings.requires_all_reduce:
            # HSDP sums held back, of a module this backward did not reach:
            # zeros carry them through the reduce-scatter to the all-reduce.
            for part in self.parts:
                if part.held_back.sums is not None:
                    held = set(part.held_back.sums[0])
                    for sp in part.layout.params:
                        used[sp.pos] = sp.index in held
        self.last_used = used
        if not any(used):
            return None
        jobs = [
            (part, job)
            for part in self.parts
            if (job := part.reduce(self.settings.reduce, grads, used, last_backward, downloads))
        ]
        if not jobs:
            return None
        return jobs[0][1] if self.one_mesh else Reductions(jobs, len(self.params))

    def grads_to_step(self) -> list[tuple[Any, Any]]:
        """The sharded parameters with a gradient, and those gradients as they are now
        (a caller's zero_grad after a failed backward must not change what a queued
        step applies)."""
        return [(sp.sharded, sp.sharded.grad) for sp in self.params if sp.sharded.grad is not None]

    def accumulate(self, grads: list[torch.Tensor | None]) -> None:
        """Add ``grads`` to the local sum that the next reduction includes."""
        # In reduce_dtype. A synced backward does not cast: the copy-in into the
        # reduce-scatter buffer does (an fp32 copy of a layer's bf16 gradients
        # would be held for nothing).
        grads = [None if g is None else g.to(self.reduce_dtype) for g in grads]
        if self._accum is None:
            # Our own copies: autograd's gradients may be expanded views, and
            # later microbatches add into these in place.
            self._accum = [None if g is None else g.clone() for g in grads]
        else:
            self._accum = [
                a if g is None else (g if a is None else a.add_(g))
                for a, g in zip(self._accum, grads)
            ]

    @property
    def has_accumulated(self) -> bool:
        return self._accum is not None

    @property
    def owes_reduction(self) -> bool:
        """Whether a synced backward must reduce for this group even if it did not
        reach its module: a local sum (gradient sync was off) or HSDP sums held
        back from the all-reduce, which is on again. Left for the module's next
        use, they would land on a later step."""
        if not self.settings.requires_gradient_sync:
            return False
        return self._accum is not None or (
            any(p.held_back.sums is not None for p in self.parts)
            and self.settings.requires_all_reduce
        )

    def clear_accumulated(self) -> None:
        """Drop local sums and held-back reductions (``reset_iter_state``)."""
        self._accum = None
        for part in self.parts:
            part.held_back.sums = None

    def assign_grads(self, shards: list[Any], used: list[bool]) -> None:
        """Put a finished reduction's shards (``ReduceJob.finish``) on ``.grad``."""
        orig_dtype = self.orig_dtype
        for sp, g, u in zip(self.params, shards, used):
            if not u:
                continue
            if g.dtype != orig_dtype:
                g = g.to(orig_dtype)
            p = sp.sharded
            if p.grad is None:
                # The parameter's own spec fits its gradient (same mesh, placements,
                # shape, dtype); the constructor skips from_local's autograd and checks,
                # and ``__new__`` alone DTensor's ``__init__``, which does nothing but
                # pass through dynamo's and export's wrappers (a third of the cost).
                p.grad = DTensor.__new__(DTensor, g, p._spec, requires_grad=False)  # type: ignore[attr-defined]
            else:
                local_of(p.grad).add_(g)
            # torch's optimizer-in-backward idiom steps here, as under FSDP2.
            hooks = getattr(p, "_post_accumulate_grad_hooks", None)
            if hooks:
                for hook in list(hooks.values()):
                    hook(p)
