"""What torch's pipeline parallel runtime asks of a sharded stage, answered by shardwise.

``torch.distributed.pipelining`` drives an FSDP stage through ``FSDPModule``'s
public methods (``set_requires_gradient_sync(False)``,
``set_reshard_after_backward(False)`` and ``set_is_last_backward(False)`` on
every microbatch's backward; ``unshard(async_op=True)`` and ``reshard()`` for
the runtime's UNSHARD and RESHARD actions; ``reshard()`` after its metadata
inference), which shardwise's modules have (fsdp_module.py). In one place it
reaches FSDP2's private state: ``_PipelineStageBase.perform_reduce_grad``
(the REDUCE_GRAD action, once per step after every microbatch's backward) runs

    state = fully_shard.state(stage_module)
    for s in state._state_ctx.all_states:
        for group in s._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()

For a shardwise module ``fully_shard.state`` returns a ``PipelineState``,
which answers to those four names and to nothing else of FSDP2's: the
post-backward reduces, once, what the microbatches summed locally (gradient
sync was off for them) and reshards; the final callback waits for the
reductions, which put the gradients on ``.grad``. Both are root.py's
``finish_backward`` and ``finish_reduces``, the calls a synced backward makes.
Why an adapter and not FSDP2's classes: those are its internals (groups of
``FSDPParam``, streams, events), which shardwise has none of; only these
names are read, so only these are answered.

How torch finds it. stage.py bound ``fully_shard`` when it was imported.
Under ``patch_fsdp2()`` that name is shardwise's stand-in, which carries
``shardwise.fully_shard``'s attributes, ``state`` (``state`` below) among
them. Without the patch (``shardwise.fully_shard`` called directly) stage.py
calls torch's own ``fully_shard.state``, which reads the module's entry in
torch's composable-API registry (``module.__dict__[STATE_KEY]``, keyed by
torch's function): ``register`` puts the adapter there. Nothing else in torch
reads that entry (FSDP2's own look-ups go through
``torch.distributed._composable_state``, which knows no shardwise module).

The zero-bubble schedules (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV)
split each backward into an input pass and a weight pass (torch's
``_backward.py``). The input pass records, for each tensor
``stage_module.parameters()`` yields, its gradient node (a leaf's
AccumulateGrad, else its ``grad_fn``); the weight pass, later and after other
microbatches' forwards, looks the nodes up again from ``parameters()``,
computes each one's gradient and writes it to that tensor's ``.grad``, and
never reaches the post-backward (``_Unsharded.backward``, module.py).
FSDP2's unsharded parameters are leaves, the same objects all step, so its
nodes match. shardwise hands out a module's parameters as the outputs of its
``_Unsharded`` function: what the smallest change gives them (param_group.py)
is a view each after it, so each parameter has a node of its own, and the
same tensors for every forward while the group stays gathered
(``ParamGroup.keeps_attachment``), so the weight pass finds a microbatch's
nodes; the post-backward here takes what it wrote to ``.grad``
(``ParamGroup.take_tensor_grads``) into the sum it reduces. Alternatives
weighed: (a) hand out persistent unsharded leaves as FSDP2 does, with the
post-backward from the inputs' gradients (``_AfterInputGrads``): the input
pass would then signal it before the weight pass has run, and every module's
backward would change for every user; (b) have a stage's ``parameters()``
yield other tensors during backward: every other caller of ``parameters()``
would see them too; (c) route torch's ``stage_backward_input``/``_weight``
to versions of shardwise's: a copy of torch's internals, and only under the
patch. The runtime reshards a stage and gathers it again between
microbatches when a rank holds more than 3 stages (its UNSHARD/RESHARD
actions): a gather reinstalls the step's tracked parameters
(``ParamGroup.reinstall_kept``), so every pass finds the same nodes. The
weight pass needs the stage kept gathered between its own microbatches
(``reshard_after_forward=False``, as torchtitan shards under PP): resharded
after forward, ``parameters()`` yields the sharded parameters, whose nodes
are not in the graph, and a weight pass apart from the input pass would lose
those gradients (FSDP2 loses them the same way). Such a stage is refused at
its first forward, as are an unsharded stage module and a stage sharded over
other stages' ranks (pipeline_stage.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.nn as nn

from .runtime import root

if TYPE_CHECKING:
    from .runtime.module import ModuleState


def _state_of(module: nn.Module) -> ModuleState | None:
    return getattr(module, "_shardwise_state", None)


class _GroupPostBackward:
    """One entry of a module's ``_fsdp_param_groups``: its ``post_backward()``."""

    def __init__(self, state: ModuleState) -> None:
        self._state = state

    def post_backward(self) -> None:
        """Reduce, once, what this module's microbatches summed while gradient sync was
        off (the runtime has turned it on again), with what a weight pass wrote to
        ``.grad``; reshard as the settings say now."""
        s = self._state
        group, ctx = s.group, s.context
        if group is None or ctx is None:
            return  # no parameters, or never ran: nothing to reduce
        group.take_tensor_grads()
        if group.owes_reduction:
            root.finish_backward(ctx, s, None)
        elif s.settings.reshard_after_backward:
            group.reshard()


class _ModuleView:
    """One entry of ``_state_ctx.all_states``: a sharded module's groups."""

    def __init__(self, state: ModuleState) -> None:
        groups = [_GroupPostBackward(state)] if state.group is not None else []
        self._fsdp_param_groups = groups


class PipelineState:
    """``fully_shard.state(module)`` for a shardwise module: the names
    ``perform_reduce_grad`` reads (the module docstring says which and why)."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module  # its states are looked up when read

    @property
    def _state_ctx(self) -> PipelineState:
        """FSDP2's root context; here the adapter answers ``all_states`` itself."""
        return self

    def _states(self) -> list[ModuleState]:
        """Every sharded module under this one, in module order (the same on every
        rank, so every rank reduces in one order); a group of several modules once."""
        found: dict[int, ModuleState] = {}
        for m in self._module.modules():
            s = _state_of(m)
            if s is not None:
                found.setdefault(id(s), s)
        return list(found.values())

    @property
    def all_states(self) -> list[_ModuleView]:
        return [_ModuleView(s) for s in self._states()]

    def _root_post_backward_final_callback(self) -> None:
        """What a synced backward's end does: finish the reductions in flight (their
        shards land on ``.grad``), wait for their copies to the host and for
        optimizer_in_backward's steps, and end every module's backward (else its
        ``backward_done`` would stop the next step's forward from prefetching it)."""
        states = self._states()
        contexts = {id(s.context): s.context for s in states if s.context is not None}
        for ctx in contexts.values():
            root.finish_reduces(ctx)
            ctx.wait_downloads()
            root.wait_steps(ctx)
        for s in states:
            s.backward_ends()


def state(module: nn.Module) -> Any:
    """``fully_shard.state(module)``: a ``PipelineState`` for a shardwise module; for
    one torch's FSDP2 sharded, torch's own state (under ``patch_fsdp2()`` torch's
    pipelining calls this for both)."""
    if _state_of(module) is not None:
        return PipelineState(module)
    from torch.distributed.fsdp._fully_shard._fully_shard import fully_shard as torch_fully_shard

    return torch_fully_shard.state(module)  # type: ignore[attr-defined]


def register(module: nn.Module) -> None:
    """Let torch's own ``fully_shard.state(module)`` find this module's adapter
    (stage.py calls it when shardwise is used without ``patch_fsdp2()``)."""
    from torch.distributed._composable.contract import STATE_KEY
    from torch.distributed.fsdp._fully_shard._fully_shard import fully_shard as torch_fully_shard

    key = getattr(torch_fully_shard, "__wrapped__", None)
    if key is None:
        return  # a torch whose fully_shard has no composable-API registry
    module.__dict__.setdefault(STATE_KEY, {})[key] = PipelineState(module)
