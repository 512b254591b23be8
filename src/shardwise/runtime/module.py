"""A sharded module's hooks (``ModuleState``); its public face is fsdp_module.py.

The four hooks and what each one does to this module's ``ParamGroup``:

- pre-forward: gather (wait for this module only), prefetch the next modules
  in forward order, hand out autograd-tracked unsharded parameters. Inside
  backward (activation recomputation) it prefetches in backward order only.
- post-forward: reshard (unless ``reshard_after_forward=False``, or this is a
  recomputed forward whose backward comes next), register pre-backward hooks
  on the outputs. The root also reshards everything when no backward follows.
- pre-backward (a hook on the forward's output tensors): enter the context's
  backward phase, gather, prefetch in backward order.
- post-backward (``_Unsharded.backward``, below): finish the
  previous module's reduction, start this one's, reshard. A module whose
  parameters are all frozen has no ``_Unsharded`` to tell it; a pass-through
  function on its inputs (``_AfterInputGrads``) does, once their gradients exist.

What a module does at its root's boundaries (a forward's start and end, the
end of a backward) is root.py's, called from here; its phase is written only
by its lifecycle (``ModuleLifecycle``, context.py), through ``ALLOWED``.
docs/design.md draws this as a state machine.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from ..layout.containers import map_tensors, tensors_in
from ..layout.precision import cast_floats
from . import pipeline_stage, root
from .check import check_forward_entry
from .context import ExecutionOrder, FSDPContext, ModuleLifecycle, Phase, RootSettings
from .lifecycle import Event, GroupState
from .param_group import Attachment, will_run
from .settings import GroupSettings
from .trace import active as active_trace


class ModuleState(ModuleLifecycle):
    """Everything ``fully_shard`` attached to one module: its lifecycle, and the hooks."""

    def __init__(
        self,
        modules: list[nn.Module],
        settings: GroupSettings,
        label: str,
        check: bool = False,
    ) -> None:
        super().__init__(label, settings, check)
        # fully_shard([a, b]): one group for several modules (``to_run``).
        self.modules = modules
        self.fwd_targets: list[ModuleLifecycle] | None = None  # None: from the context's order
        self.bwd_targets: list[ModuleLifecycle] | None = None
        self.fwd_default: list[ModuleLifecycle] = []  # from the context's static order
        self.bwd_default: list[ModuleLifecycle] = []
        # Root settings made on this module before its root's context exists
        # (set_is_last_backward before the first forward, as FSDP2 allows):
        # applied, in order, when the context is made.
        self._for_root: list[Callable[[RootSettings], None]] = []
        # The root's submodules that hold its parameters, while they are sharded
        # between forwards: hooks that gather them for a call on its own
        # (``_arm_parts``); the part being called is ``_part``.
        self._part_hooks: list[Any] = []

    # ---- helpers ------------------------------------------------------------------------

    def _lazy_init(self) -> FSDPContext:
        """The first forward of an outermost sharded module makes it the root."""
        states: list[ModuleState] = []
        for top in self.modules:
            for name, m in top.named_modules():
                s = getattr(m, "_shardwise_state", None)  # an FSDPModule
                if s is None or any(s is t for t in states):
                    continue  # a group of several modules appears once, at its first
                s.label = name or s.label  # the root keeps its class name
                if s.group is not None:
                    s.group.label = s.label
                states.append(s)
        # Inside a pipeline stage sharded so that it would train wrong: refused now,
        # before the first gather (pipeline_stage.py).
        pipeline_stage.check(self.modules[0], states)
        lifecycles: list[ModuleLifecycle] = list(states)
        ctx = FSDPContext(self, lifecycles)
        for s in reversed(states):  # the root's own last: it wins
            for apply in s._for_root:
                apply(ctx.settings)
            s._for_root.clear()
        # The static orders' prefetch targets, computed once here (the hooks run
        # for every module, every step), as the recorded orders' are.
        depths = {id(s): s.settings.prefetch for s in states}
        forward = ExecutionOrder(lifecycles, depths)
        backward = ExecutionOrder(lifecycles[::-1], depths)
        for i, s in enumerate(states):
            s.context = ctx
            if s.settings.reshard_after_forward_setting is None:
                s.change_settings(reshard_after_forward=s is not self)
            s.fwd_default = forward.targets[i]
            s.bwd_default = backward.targets[len(states) - 1 - i]
        return ctx

    def _gather(
        self, prefetch: Sequence[ModuleLifecycle], backward: bool = False, recompute: bool = False
    ) -> None:
        """Issue our gather and wait for it, then issue the prefetches. ``backward``:
        ours is for this module's backward (a recomputed forward's is a forward's:
        it must compute with what the first forward gathered); prefetches in a
        backward are for the backward of the modules they gather.

        Ours first: where a copy-out follows the gather, it frees the gather
        buffer before a prefetch allocates another, so one is alive, not two
        (usually ours was prefetched already, so the wait is short). The
        prefetches are still issued before this module computes: they overlap it.
        """
        group = self.group
        if group is None:
            return
        if group.stale():
            group.reshard()  # kept gathered across an optimizer step: gather the new values
        tracer = active_trace()
        if tracer is not None and group.state is not GroupState.UNSHARDED:
            tracer.need(self.label, prefetched=group.state is GroupState.GATHERING)
        group.prefetched = False
        if recompute:
            group.recomputes = True
            group.gather_values(backward=False)  # the values its first forward computed with
        else:
            group.wait_unsharded(backward)
        ctx = self.context
        in_backward = ctx is not None and ctx.phase is Phase.BACKWARD
        past_first = in_backward and ctx is not None and ctx.backwards_done > 0
        if not group.prefetches(in_backward, past_first):
            prefetch = []
        for s in prefetch:
            g = s.group
            if in_backward and not s.settings.unshard_in_backward:
                continue  # its backward needs no parameters
            if in_backward and g is not None and not g.reached_in_backward():
                continue  # this backward stops before it (autograd.grad on an activation)
            if g is not None and not s.backward_done and g.sharded:
                # A module recomputed in backward needs the forward's values first.
                g.unshard(in_backward and not (g.two_values and g.recomputes))
                g.prefetched = True
                if self.context is not None and self.context.check:
                    self.context.log(f"{s.label}: prefetched by {self.label}")

    # ---- hooks --------------------------------------------------------------------------

    def pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        ctx = self.context or self._lazy_init()
        tracer = active_trace()
        if ctx.abandoned():
            root.abandon_backward(ctx)
        later = bool(self.to_run) and ctx.phase is not Phase.BACKWARD
        if later:
            # Another module of this group ran first in this forward: gathered already.
            self.to_run.discard(id(module))
        elif ctx.phase is Phase.BACKWARD:
            # A recomputed forward (activation checkpointing) inside backward:
            # never prefetch in forward order -- that module's backward may be
            # over already, and nothing would reshard it again.
            if ctx.check:
                ctx.log(f"{self.label}: recompute forward")
            if tracer is not None:
                tracer.begin("recompute", self.label)
            if ctx.held is not None and ctx.held is not self:
                root.release_held(ctx)  # another module's recomputation: the held one is done
            if self.phase is Phase.IDLE:  # first need of this module in this backward
                needs = ctx.backward_needs(self)
                targets = self.bwd_targets if self.bwd_targets is not None else needs
                self.on(Event.RECOMPUTE)
                self._gather(targets if targets is not None else self.bwd_default, recompute=True)
            else:  # its pre-backward already gathered it and prefetched
                self._gather([], recompute=True)
        else:
            if self is ctx.root:
                self._disarm_parts()
                root.begin_forward(ctx)  # recovers from a forward that raised, first
                if ctx.check:
                    check_forward_entry(ctx)
            if ctx.check:
                ctx.log(f"{self.label}: forward")
            needs = ctx.forward_needs(self)
            targets = self.fwd_targets if self.fwd_targets is not None else needs
            self.on(Event.FORWARD)
            self._gather(targets if targets is not None else self.fwd_default)
            if len(self.modules) > 1 and ctx.in_forward:
                # Inside the root's forward the others run next, in this gather.
                # Called on its own (a chunked loss calls the head of a
                # [norm, head] group after the root's forward, one backward
                # per chunk), a member is a whole use of the group: its
                # post-forward ends it, as no root post-forward will.
                self.to_run = {id(m) for m in self.modules if m is not module}
        if self.group is not None and torch.is_grad_enabled():
            self._attach()
            if not self.group.attached and not later:
                # (In a group, the first module's inputs get their gradients last.)
                args, kwargs = _AfterInputGrads.wrap(self, args, kwargs)
        return self._cast_inputs(args, kwargs)

    def _cast_inputs(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """The mixed-precision policy's input cast (``cast_forward_inputs``)."""
        policy = self.settings.mp_policy
        if policy.cast_forward_inputs and policy.param_dtype is not None:
            args, kwargs = cast_floats((args, kwargs), policy.param_dtype)
        return args, kwargs

    def _cast_output(self, output: Any) -> Any:
        dtype = self.settings.mp_policy.output_dtype
        if dtype is not None:
            output = cast_floats(output, dtype)
        return output

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        ctx = self.context
        assert ctx is not None
        output = self._cast_output(output)
        if self._backward_values_differ() and torch.is_grad_enabled():
            if ctx.phase is Phase.BACKWARD:
                assert self.group is not None
                # Recomputed with the forward's values: its gradients are computed
                # with the backward's, as without checkpointing.
                self.group.gather_values(backward=True)
            output = _SavesLast.wrap(output)
        tensors = [t for t in tensors_in(output) if t.requires_grad]
        if tensors:
            # Bound to this forward's attachment: another forward (a no-grad
            # one, a second microbatch) may replace the group's before this
            # output's backward comes.
            attachment = self.group.attachment if self.group is not None else None
            hook = functools.partial(self._pre_backward, attachment)
            for t in tensors:
                t.register_hook(hook)
        if ctx.phase is Phase.BACKWARD:
            # Recomputed: keep the parameters for the backward that follows
            # (no second all-gather); post-backward reshards them.
            tracer = active_trace()
            if tracer is not None:
                tracer.end("recompute", self.label)
            return output
        if self.to_run:
            return output  # more modules of this group run in this forward: keep it gathered
        will_backward = bool(tensors) and torch.is_grad_enabled()
        self.forward_ends(will_backward)
        if self is ctx.root:
            root.end_forward(ctx, backward_follows=will_backward and module.training)
            self._arm_parts()
        elif self.settings.reshard_after_forward and self.group is not None:
            self.group.reshard(keep=True)
        return output

    def _pre_backward(self, attachment: Attachment | None, grad: torch.Tensor) -> None:
        ctx = self.context
        assert ctx is not None
        root.enter_backward(ctx)
        if ctx.held is not None and ctx.held is not self:
            root.release_held(ctx)
        if self.phase is Phase.BACKWARD:
            return
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"module {self.label!r}: backward with create_graph=True (double backward, e.g. "
                "a gradient penalty) is not supported by shardwise: the second-order graph "
                "would use parameters that are resharded after their first backward"
            )
        if ctx.check:
            ctx.log(f"{self.label}: pre-backward")
        needs = ctx.backward_needs(self)
        targets = self.bwd_targets if self.bwd_targets is not None else needs
        # From REDUCED too: another forward's use of this module (two forwards, one
        # backward) needs it again after its first post-backward: gather again.
        self.on(Event.PRE_BACKWARD)
        if not self.settings.unshard_in_backward:
            return  # the user's promise: no parameter of this module is needed (an embedding)
        self._gather(targets if targets is not None else self.bwd_default, backward=True)
        if self.group is not None and attachment is not None:
            if self._backward_values_differ():
                # Checkpointing inside would recompute with backward's values.
                _RefuseRecomputeInside.install(self.label, attachment)
            else:
                # Checkpointing inside this module recomputes its body next, without
                # our hooks: it must read the forward's autograd-tracked parameters.
                self.group.install(attachment)

    def post_backward(self, grads: list[torch.Tensor | None] | None) -> None:
        """The group's gradients exist (``_Unsharded.backward``; one per parameter), or,
        for a module with every parameter frozen, its inputs' gradients (``grads`` None)."""
        ctx = self.context
        assert ctx is not None and self.group is not None
        root.enter_backward(ctx)
        if ctx.check:
            ctx.log(f"{self.label}: post-backward")
        tracer = active_trace()
        if tracer is not None:
            # torch's non-reentrant checkpoint stops a recompute early, without
            # post-forward hooks: the recompute span ends here at the latest.
            tracer.end("recompute", self.label)
        if grads is not None and ctx.nested_pass():
            # A reentrant checkpoint's inner backward: more of this module's body
            # may be recomputed later in this backward (several checkpointed
            # regions in one sharded module), so keep it gathered and sum
            # locally; reduce and reshard once another module's backward
            # starts, or at the end (root.release_held).
            self.group.accumulate(grads)
            root.hold(ctx, self)
            return
        if ctx.held is self:
            ctx.held = None  # the outer pass reached it: reduce the sum now
        root.finish_backward(ctx, self, grads)

    # ---- the root's parts, called on their own ---------------------------------------------

    def _arm_parts(self) -> None:
        """After a root forward that left the root's own parameters sharded (no
        backward follows, or ``reshard_after_forward=True``), the submodules
        holding them gather them when called on their own until the next root
        forward: ``model.lm_head(h)`` after a no-grad forward (hidden states
        taken from an eval pass, then a head or a loss on them). FSDP2 keeps
        the root gathered after such a forward instead, which holds its
        parameters through an eval loop. No hooks while the root is gathered,
        the usual training step: they cost nothing there."""
        group = self.group
        if group is None or self._part_hooks or group.state is GroupState.UNSHARDED:
            return
        own = {id(m) for m in self.modules}  # their own hooks gather already
        parts = {id(m): m for sp in group.params for m, _ in sp.locations if id(m) not in own}
        for m in parts.values():
            pre = m.register_forward_pre_hook(outside_compile(self._before_part), with_kwargs=True)
            self._part_hooks.append(pre)
            self._part_hooks.append(m.register_forward_hook(outside_compile(self._after_part)))

    def _disarm_parts(self) -> None:
        for handle in self._part_hooks:
            handle.remove()
        self._part_hooks = []
        self._part = None

    def _before_part(self, part: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        """Gather the root for a call of ``part`` on its own, and cast its inputs as
        the root's pre-forward would: the part computes in ``param_dtype`` too."""
        ctx = self.context
        if ctx is None or self._part is not None or self.phase is not Phase.IDLE:
            return None  # inside a part already, or this module is in use
        if ctx.in_forward or ctx.phase is Phase.BACKWARD or self.group is None:
            return None  # the root's own hooks gathered it
        if self.group.state is GroupState.UNSHARDED:
            return None
        self._part = part
        if ctx.check:
            ctx.log(f"{self.label}: gathered for its part {type(part).__name__}")
        self.on(Event.FORWARD)
        self._gather(ctx.forward_needs(self) or [])  # nothing to prefetch: counts a forward
        if torch.is_grad_enabled():
            self._attach()
        return self._cast_inputs(args, kwargs)

    def _after_part(self, part: nn.Module, args: Any, output: Any) -> Any:
        if self._part is not part or self.group is None:
            return None
        self._part = None
        output = self._cast_output(output)
        tensors = [t for t in tensors_in(output) if t.requires_grad]
        if tensors:
            hook = functools.partial(self._pre_backward, self.group.attachment)
            for t in tensors:
                t.register_hook(hook)
        self.forward_ends(bool(tensors) and torch.is_grad_enabled())
        # As after the root's forward: kept for a backward that follows (the
        # root's default), resharded when none does.
        if not (tensors and torch.is_grad_enabled() and part.training) or (
            self.settings.reshard_after_forward
        ):
            self.group.reshard()
        return output

    def _backward_values_differ(self) -> bool:
        """Whether this module's backward computes with other values than its forward
        (qwZ "forward", resharded after forward with no part kept): a recomputation
        must then gather the forward's values, and the backward's after it."""
        group = self.group
        return (
            group is not None
            and group.two_values
            and self.settings.reshard_after_forward
            and self.settings.post_forward_group is None
        )

    def _attach(self) -> None:
        """Hand out this forward's autograd-tracked parameters (``_Unsharded``)."""
        assert self.group is not None
        recompute = self.context is not None and self.context.phase is Phase.BACKWARD
        self.group.attach(functools.partial(_Unsharded.apply, self), recompute)

    # ---- settings -------------------------------------------------------------------------

    def change_settings(self, **changes: Any) -> None:
        """The one writer of this module's settings (settings.py): its group, which
        holds the same object, re-chooses what a change decides."""
        self.settings.change(**changes)
        if self.group is not None:
            self.group.settings_changed(changes.keys())

    def set_for_root(self, apply: Callable[[RootSettings], None]) -> None:
        """Change the root's settings (``apply`` writes them): now, or once the
        root's context is made."""
        if self.context is not None:
            apply(self.context.settings)
        else:
            self._for_root.append(apply)


_UNSHARDED = attrgetter("unsharded")  # a ShardedParam's gathered storage


class _Unsharded(torch.autograd.Function):
    """Hands out a group's unsharded parameters; its backward is the post-backward.

    Its one tensor input is the group's anchor, an empty leaf that requires
    grad, not the sharded parameters: those stay out of the autograd graph,
    as under FSDP2, so autograd never runs their AccumulateGrad (which would
    call the user's tensor hooks with ``None`` and post-accumulate-grad hooks
    before any gradient exists); ``assign_grads`` runs the latter once the
    reduced gradient is on ``.grad``. It lives with the hooks: its backward
    is one, and calls down into the module's state like the others.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, state: ModuleState, trainable: list[Any], anchor: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.state, ctx.trainable = state, trainable
        ctx.set_materialize_grads(False)
        return tuple(map(torch.Tensor.detach, map(_UNSHARDED, trainable)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, ...]:  # type: ignore[override]
        state: ModuleState = ctx.state
        assert state.group is not None
        full: list[torch.Tensor | None] = [None] * len(state.group.params)
        # Only a pass that accumulates into leaves reaches the anchor's
        # AccumulateGrad: not torch.autograd.grad (gradient-norm logging, or
        # FGM on an activation), which leaves .grad as it was; so do we.
        (anchor_edge,) = ctx.next_functions
        if will_run(anchor_edge[0]):
            for sp, g in zip(ctx.trainable, grads):
                full[sp.pos] = g
        state.post_backward(full)
        return (None, None, None)


class _AfterInputGrads(torch.autograd.Function):
    """Pass-through on the inputs of a module whose parameters are all frozen.

    Its backward runs once the gradients of the module's inputs exist, that is,
    once the module's own backward is over: the post-backward that
    ``_Unsharded`` gives trainable modules. Without it a frozen module (a LoRA
    base layer, a frozen backbone) stays gathered until the whole backward ends.
    """

    @staticmethod
    def forward(ctx: Any, state: ModuleState, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.state = state
        ctx.set_materialize_grads(False)
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        ctx.state.post_backward(None)
        return (None, *grads)

    @staticmethod
    def wrap(state: ModuleState, args: Any, kwargs: Any) -> tuple[Any, Any]:
        needs = {id(t): t for t in tensors_in((args, kwargs)) if t.requires_grad}
        if not needs:
            return args, kwargs  # no gradient flows back through here: nothing to signal
        outs = _AfterInputGrads.apply(state, *needs.values())
        by_id = dict(zip(needs, outs if isinstance(outs, tuple) else (outs,)))
        return map_tensors(lambda t: by_id.get(id(t), t), (args, kwargs))


class _SavesLast(torch.autograd.Function):
    """An identity on a module's outputs that saves one empty tensor for backward.

    Why: torch's non-reentrant checkpoint stops a recomputation as soon as it has
    recomputed as many saved tensors as the forward saved ("early stop"). A
    module whose recomputation must gather the backward's values once its body
    has run (qwZ "forward": ``ModuleState.post_forward``) would be stopped
    inside its body's last op, before that gather. Saving one more tensor
    after it makes the gather part of the recomputation.
    """

    @staticmethod
    def forward(ctx: Any, marker: torch.Tensor, *outputs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.save_for_backward(marker)
        ctx.set_materialize_grads(False)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        return (None, *grads)

    @staticmethod
    def wrap(output: Any) -> Any:
        needs = {id(t): t for t in tensors_in(output) if t.requires_grad}
        if not needs:
            return output
        marker = torch.empty(0, device=next(iter(needs.values())).device)
        outs = _SavesLast.apply(marker, *needs.values())
        by_id = dict(zip(needs, outs if isinstance(outs, tuple) else (outs,)))
        return map_tensors(lambda t: by_id.get(id(t), t), output)


class _RefuseRecomputeInside(torch.Tensor):
    """What a module whose backward gathers other values than its forward (qwZ
    "forward") has installed during its backward: any computation with it raises.

    Only a recomputation the hooks do not see reads a module's parameters in its
    backward (checkpointing inside the sharded module: ``checkpoint_wrapper``
    applied before ``fully_shard``, a layer's own gradient checkpointing); the
    backward itself uses the tensors its forward saved. Such a recomputation would
    compute with the backward's full-precision weights, not the quantized ones
    the forward used, so its activations would not be the forward's: refused,
    with one error, in the first backward, before any optimizer step.
    """

    label: str
    _passthrough = frozenset({"__get__", "__set__", "__delete__", "__repr__", "__format__"})

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in cls._passthrough:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        found = tree_leaves((args, kwargs))
        label = next((a.label for a in found if isinstance(a, _RefuseRecomputeInside)), "?")
        raise ValueError(
            f"module {label!r}: activation checkpointing inside a module sharded with "
            "CommPolicy(quantize_gather='forward') would recompute with backward's "
            "full-precision weights, not the forward's quantized ones; checkpoint around "
            "the sharded module (before fully_shard wraps it), or use quantize_gather='always'"
        )

    @staticmethod
    def install(label: str, attachment: Attachment) -> None:
        for sp, t in zip(attachment.params, attachment.tensors):
            guard = torch.Tensor._make_subclass(_RefuseRecomputeInside, t.detach())
            guard.label = label
            sp.install(guard)


def outside_compile(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` run eagerly even inside a compiled region (``block.compile()``).

    Dynamo would otherwise trace our hooks into the block's graph, and they
    swap parameters and mutate storage it cannot capture. Traced, the check
    below is constant True and dynamo meets a disabled call: it breaks the
    graph there and runs the hook as plain Python (what FSDP2 does for its own
    hooks). Not compiling, it costs one call, and dynamo is never imported.
    """

    @functools.wraps(hook)
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return torch._dynamo.disable(hook, recursive=True)(*args, **kwargs)
        return hook(*args, **kwargs)

    return run
