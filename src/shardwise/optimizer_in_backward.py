"""The optimizer steps each module's shards inside backward, as their gradients arrive.

Why: with CPU offload the optimizer runs on the host, where AdamW is bound by
memory bandwidth (it reads and writes 28 bytes per fp32 parameter). Run after
backward it is the largest part of an offloaded step (docs/benchmarks.md).
Stepped module by module as soon as a module's gradients are on the host, on
a worker thread while the GPU runs the rest of backward, much of it hides
behind compute. Without offload a module steps on the GPU right after its
reduction, and its gradients are freed there: the whole model's gradients
are never alive at once.

Why opt-in: the step happens inside ``loss.backward()``, so nothing can read
or change the gradients between backward and step. No clipping over all of
them (it needs every gradient before any step; ``clip_grad_norm_`` refuses
these parameters), no gradient logging: ``.grad`` is None after backward, and
the caller's ``optimizer.step()`` finds nothing left to do for these
parameters (it still steps any others, and its step hooks fire there, once).
Every backward that reduces gradients steps them, unless
``set_is_last_backward(False)`` or ``set_requires_gradient_sync(False)`` said
more microbatches follow: then the gradients are summed and the last
backward steps once. A backward that raises has stepped the modules whose
gradients were complete before the error.

How a subset is stepped: a shadow of the caller's optimizer (same class, the
same state, its hyperparameters read anew at every step so that LR schedulers
apply) whose parameter groups hold one module's parameters. Its ``step`` is
the optimizer class's own, without the caller's step hooks. torch's
elementwise optimizers (AdamW, SGD, ...) step the local shards as plain
tensors (``_step_locals`` says why); any other steps the DTensors.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from .param_group import ParamGroup

MARK = "_shardwise_steps_in_backward"  # on parameters stepped inside backward (clip.py reads it)

_pool: ThreadPoolExecutor | None = None


def _worker() -> ThreadPoolExecutor:
    """One thread: offloaded modules step in the order their gradients arrived."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardwise-step")
    return _pool


class OptimizerInBackward:
    """The handle ``optimizer_in_backward`` returns; ``remove()`` restores the usual step."""

    def __init__(self, optimizer: torch.optim.Optimizer, groups: list[ParamGroup]) -> None:
        self.optimizer = optimizer
        self.groups = groups
        for g in groups:
            g.step_in_backward = self
            for sp in g.params:
                setattr(sp.sharded, MARK, True)

    def remove(self) -> None:
        for g in self.groups:
            if g.step_in_backward is self:
                g.step_in_backward = None
                for sp in g.params:
                    if hasattr(sp.sharded, MARK):
                        delattr(sp.sharded, MARK)
        self.groups = []

    def grads_ready(self, group: ParamGroup, download: Any) -> None:
        """``group``'s gradients are assigned (``download``: the event of their copy to
        the host, or None): step it now, or on the worker thread if it is offloaded."""
        ctx = group.owner.context
        assert ctx is not None
        ctx.stepped.append(group)
        if group.offload_policy is None:
            self._step(group, None)
        else:
            ctx.steps.append(_worker().submit(self._step, group, download))

    def _step(self, group: ParamGroup, download: Any) -> None:
        if download is not None:
            download.synchronize()
        mine = {id(sp.sharded) for sp in group.params if sp.sharded.grad is not None}
        opt = self.optimizer
        param_groups = []
        for pg in opt.param_groups:
            params = [p for p in pg["params"] if id(p) in mine]
            if params:
                param_groups.append({**pg, "params": params})
        if not param_groups:
            return
        if type(opt) in ELEMENTWISE:
            _step_locals(opt, param_groups)
        else:
            _shadow(opt, param_groups, opt.state).step()
        for pg in param_groups:
            for p in pg["params"]:
                p.grad = None


# Optimizers whose update of an element reads only that element (and scalars):
# stepping each rank's local shards is the same as stepping the DTensors. Their
# subclasses may not be, and step the DTensors.
ELEMENTWISE = frozenset(
    {
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adamax,
        torch.optim.Adagrad,
        torch.optim.Adadelta,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.RMSprop,
        torch.optim.Rprop,
        torch.optim.ASGD,
    }
)


def _shadow(opt: torch.optim.Optimizer, param_groups: list[dict[str, Any]], state: Any) -> Any:
    """``opt`` restricted to ``param_groups``: its class's own ``step``, none of the
    caller's step hooks (they fire once, on the caller's ``optimizer.step()``)."""
    shadow = object.__new__(type(opt))
    # Read anew each time: load_state_dict replaces the state and the groups.
    shadow.__dict__.update(opt.__dict__)
    shadow.__dict__.pop("step", None)  # an LR scheduler's wrapper of the caller's step
    shadow._optimizer_step_pre_hooks = OrderedDict()
    shadow._optimizer_step_post_hooks = OrderedDict()
    shadow.param_groups = param_groups
    shadow.state = state
    return shadow


def _step_locals(opt: torch.optim.Optimizer, param_groups: list[dict[str, Any]]) -> None:
    """Step the local shards as plain tensors.

    Why not the DTensors: DTensor dispatches in Python and holds the GIL for the
    whole kernel, so the worker thread would stall the backward's hooks for the
    length of every step. The optimizer state stays DTensors (checkpoints see
    no difference): the plain tensors stepped here are views of them, and state
    the step creates is wrapped back with the parameter's spec.
    """
    state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
    pairs = []
    local_groups = []
    for pg in param_groups:
        params = []
        for p in pg["params"]:
            lp = _local(p).detach()
            lp.grad = _local(p.grad)
            if p in opt.state:
                state[lp] = {k: _local(v) for k, v in opt.state[p].items()}
            pairs.append((p, lp))
            params.append(lp)
        local_groups.append({**pg, "params": params})
    _shadow(opt, local_groups, state).step()
    for p, lp in pairs:
        before = opt.state.get(p, {})
        after = {}
        for k, v in state[lp].items():
            old = before.get(k)
            if old is not None and _local(old) is v:
                after[k] = old  # updated in place
            elif isinstance(v, torch.Tensor) and isinstance(p, DTensor) and _like(v, lp, k):
                after[k] = DTensor(v, p._spec, requires_grad=False)  # type: ignore[attr-defined]
            else:
                after[k] = v
        opt.state[p] = after
        lp.grad = None


def _local(t: Any) -> Any:
    return t._local_tensor if isinstance(t, DTensor) else t


def _like(v: torch.Tensor, local_param: torch.Tensor, key: str) -> bool:
    """State shaped as the parameter's shard (moments, buffers), not a step count."""
    return key != "step" and v.shape == local_param.shape and v.dtype.is_floating_point


def optimizer_in_backward(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> OptimizerInBackward:
    """Step ``optimizer`` inside backward, module by module, as gradients arrive.

    For the parameters of every module sharded under ``model`` (call it after
    ``fully_shard``); see this module's docstring for what changes for the
    caller. Returns a handle whose ``remove()`` restores the usual step.
    """
    from .fsdp_module import FSDPModule

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
    ids = {id(p) for pg in optimizer.param_groups for p in pg["params"]}
    groups = [
        g for g in model._groups(recurse=True) if any(id(sp.sharded) in ids for sp in g.params)
    ]
    if not groups:
        raise ValueError(
            "optimizer_in_backward: none of the optimizer's parameters belongs to a module "
            f"sharded under {type(model).__name__}; build the optimizer on "
            "model.parameters() after fully_shard"
        )
    taken = [g.label for g in groups if g.step_in_backward is not None]
    if taken:
        raise RuntimeError(
            f"optimizer_in_backward: module(s) {', '.join(map(repr, taken))} already step inside "
            "backward with another optimizer; call remove() on that handle first"
        )
    return OptimizerInBackward(optimizer, groups)
