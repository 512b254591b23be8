"""The optimizer steps each module's shards inside backward, as their gradients arrive.

Why: without offload a module steps on the GPU right after its reduction,
and its gradients are freed there, so the whole model's gradients are never
alive at once (a lower peak than FSDP2's: docs/benchmarks.md). With CPU
offload a module steps on a worker thread as soon as its gradients are on the
host, beside the GPU's backward; that saves no time where the host's
optimizer step and the PCIe copies share the host's memory bandwidth.

Why opt-in: the step happens inside ``loss.backward()``, so nothing can read
or change the gradients between backward and step. No clipping over all of
them (it needs every gradient before any step; ``clip_grad_norm_`` refuses
these parameters), no gradient logging: ``.grad`` is None after backward, and
the caller's ``optimizer.step()`` finds nothing left to do for these
parameters (it still steps any others, and its step hooks fire there, once).
Every backward that reduces gradients steps them, unless
``set_is_last_backward(False)`` or ``set_requires_gradient_sync(False)`` said
more microbatches follow: then the gradients are summed and the last
backward steps once. Several forwards before one backward step each module
once, at the end. A module needed again in the backward that stepped it (one
block in two reentrant-checkpointed regions) is refused with an error. A
backward that raises has stepped the modules whose reductions had finished;
the others keep their gradients, and the caller's next use of the optimizer
or of a state dict cleans up (so does ``reset_iter_state``). A step that
raises is raised from backward after the clean-up; the modules after it keep
their gradients.

Known limits: a graph built before a step and backpropagated after it (two
backwards over graphs from earlier forwards, ``retain_graph=True``) uses
the stepped weights, where plain training would raise; a module that returns
its own input tensor is refused as "needed again"; after a backward that
raised, an in-place ``zero_grad(set_to_none=False)`` may race the steps still
queued (call ``reset_iter_state()`` first).

This file is the public call and its handle. How a module's shards are stepped
(a shadow of the caller's optimizer over one module's parameters) and the
record of one backward's steps are step_in_backward.py's; the layer that
finishes a module's reduction (root.py) starts its step, and the end of
backward waits for the steps and reshards what they stepped.
"""

from __future__ import annotations

import threading

import torch
import torch.nn as nn

from .runtime import root
from .runtime.fsdp_module import FSDPModule, param_groups, sharded_states
from .runtime.module import ModuleState
from .runtime.param_group import ParamGroup
from .runtime.step_in_backward import ELEMENTWISE, MARK, StepInBackward, TorchClipGuard

__all__ = ["ELEMENTWISE", "MARK", "OptimizerInBackward", "optimizer_in_backward"]


class OptimizerInBackward(StepInBackward):
    """The handle ``optimizer_in_backward`` returns; ``remove()`` restores the usual step."""

    def __init__(
        self, model: FSDPModule, optimizer: torch.optim.Optimizer, groups: list[ParamGroup]
    ) -> None:
        super().__init__(optimizer)
        self.groups = groups
        # The module states, whose contexts are those of the roots that run them
        # (not always ``model``'s: a wrapper whose own forward never runs).
        self._states: list[ModuleState] = [s for s in sharded_states(model) if s.group is not None]
        for g in groups:
            g.step_in_backward = self
            for sp in g.params:
                setattr(sp.sharded, MARK, True)
        TorchClipGuard.acquire()  # torch's clip refuses these parameters, as ours does
        self._guarded = True
        # A backward that raised leaves steps queued on the worker: whatever the
        # caller does next with the optimizer or the state waits for them first.
        settle = lambda *args, **kwargs: self.settle()  # noqa: E731
        self._hooks = [
            optimizer.register_step_pre_hook(settle),
            optimizer.register_state_dict_pre_hook(settle),
            optimizer.register_load_state_dict_pre_hook(settle),
            model.register_state_dict_pre_hook(settle),  # type: ignore[attr-defined]
        ]

    def remove(self) -> None:
        self.settle()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for g in self.groups:
            if g.step_in_backward is self:
                g.step_in_backward = None
                for sp in g.params:
                    if hasattr(sp.sharded, MARK):
                        delattr(sp.sharded, MARK)
        self.groups = []
        if self._guarded:
            self._guarded = False
            TorchClipGuard.release()

    def settle(self) -> None:
        """Outside autograd, a context still in BACKWARD belongs to a backward that
        raised: clean it up now (it waits for the worker) rather than at the next forward."""
        if threading.current_thread() is not threading.main_thread():
            return  # another thread (a logger) while a backward may run
        contexts = {id(c): c for s in self._states if (c := s.context) is not None}
        for ctx in contexts.values():
            if ctx.abandoned():
                root.abandon_backward(ctx)


def optimizer_in_backward(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, separable: bool = False
) -> OptimizerInBackward:
    """Step ``optimizer`` inside backward, module by module, as gradients arrive.

    For the parameters of every module sharded under ``model`` (call it after
    ``fully_shard``); this module's docstring says what changes for the caller.
    torch's elementwise optimizers (``ELEMENTWISE``: AdamW, SGD, ...) are
    accepted as they are. Any other class must update each parameter from
    that parameter's own gradient and state alone, with nothing shared across
    parameters (no global norm, no statistic summed over a parameter group);
    say so with ``separable=True``. Returns a handle whose ``remove()``
    restores the usual step.
    """
    if not isinstance(model, FSDPModule):
        raise TypeError(
            f"optimizer_in_backward: {type(model).__name__} is not sharded; "
            "call fully_shard on it (and its blocks) first"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer_in_backward expects a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, torch.optim.LBFGS):
        raise TypeError(
            "optimizer_in_backward: LBFGS re-evaluates the model in its step (a closure); "
            "it cannot step inside backward"
        )
    if type(optimizer) not in ELEMENTWISE and not separable:
        raise TypeError(
            f"optimizer_in_backward: {type(optimizer).__name__} is not one of torch's "
            "elementwise optimizers, and stepping it one module at a time is only right if "
            "its step updates each parameter from that parameter's gradient and state alone; "
            "if it does, pass separable=True"
        )
    ids = {id(p) for pg in optimizer.param_groups for p in pg["params"]}
    groups = [g for g in param_groups(model) if any(id(sp.sharded) in ids for sp in g.params)]
    if not groups:
        raise ValueError(
            "optimizer_in_backward: none of the optimizer's parameters belongs to a module "
            f"sharded under {type(model).__name__}; build the optimizer on "
            "model.parameters() after fully_shard"
        )
    taken = [g.step_in_backward for g in groups if g.step_in_backward is not None]
    if taken:
        same = all(stepper.optimizer is optimizer for stepper in taken)
        raise RuntimeError(
            f"optimizer_in_backward: {len(taken)} of these modules already step inside backward "
            + ("with this optimizer" if same else "with another optimizer")
            + "; call remove() on that handle first"
        )
    return OptimizerInBackward(model, optimizer, groups)
