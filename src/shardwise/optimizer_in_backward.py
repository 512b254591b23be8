"""The optimizer steps each module's shards inside backward, as their gradients arrive.

Why: without offload a module steps on the GPU right after its reduction,
and its gradients are freed there, so the whole model's gradients are never
alive at once (7B on one H200: 0.77x FSDP2's peak). With CPU offload a
module steps on a worker thread as soon as its gradients are on the host,
beside the GPU's backward. That does not make the step faster on the lent
machines: the host AdamW and the PCIe copies share the host's memory
bandwidth (docs/benchmarks.md, 2026-11-30, 385dc01).

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

How a subset is stepped: a shadow of the caller's optimizer (same class, the
same state, its hyperparameters read anew at every step so that LR schedulers
apply) whose parameter groups hold one module's parameters. Its ``step`` is
the optimizer class's own, without the caller's step hooks. torch's
elementwise optimizers (AdamW, SGD, ...) step the local shards as plain
tensors (``_step_locals`` says why), on the worker thread when offloaded. Any
other class must be declared ``separable`` and steps the DTensors on the
autograd thread, since its step may communicate.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from .context import FSDPContext, Phase
from .flat_shard import local_of

if TYPE_CHECKING:
    from .module import ModuleState
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

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, groups: list[ParamGroup]
    ) -> None:
        self.optimizer = optimizer
        self.groups = groups
        # Each group's module state: its context is the one of the root that runs
        # it (not always ``model``'s: a wrapper whose own forward never runs).
        self._states: dict[int, ModuleState] = {
            id(s.group): s
            for s in model._sharded_states(True)  # type: ignore[attr-defined,operator]
            if s.group is not None
        }
        # Only steps that issue no collective may leave the autograd thread: a
        # DTensor step (a norm, a redistribute) would interleave its collectives
        # with the backward's, in a different order on each rank.
        self.threaded = type(optimizer) in ELEMENTWISE
        for g in groups:
            g.step_in_backward = self
            for sp in g.params:
                setattr(sp.sharded, MARK, True)
        # A backward that raised leaves steps queued on the worker: whatever the
        # caller does next with the optimizer or the state waits for them first.
        settle = lambda *args, **kwargs: self.settle()  # noqa: E731
        self._hooks = [
            optimizer.register_step_pre_hook(settle),
            optimizer.register_state_dict_pre_hook(settle),
            optimizer.register_load_state_dict_pre_hook(settle),
            model.register_state_dict_pre_hook(settle),
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

    def settle(self) -> None:
        """Outside autograd, a context still in BACKWARD belongs to a backward that
        raised: clean it up now (it waits for the worker) rather than at the next forward."""
        if threading.current_thread() is not threading.main_thread():
            return  # another thread (a logger) while a backward may run
        contexts = {id(c): c for s in self._states.values() if (c := s.context) is not None}
        for ctx in contexts.values():
            if ctx.abandoned():
                ctx.abandon_backward()

    def _context(self, group: ParamGroup) -> FSDPContext | None:
        """The root context ``group`` runs under (None before its first forward)."""
        return self._states[id(group)].context

    def grads_ready(self, group: ParamGroup, download: Any) -> None:
        """``group``'s gradients are assigned (``download``: the event of their copy to
        the host, or None): step it now, or on the worker thread."""
        ctx = self._context(group)
        assert ctx is not None
        if ctx.forwards > 1:
            # Several forwards before this backward: a module may be reduced once
            # per forward, so it steps at the end, when its gradients are whole.
            if group not in ctx.deferred:
                ctx.deferred.append(group)
            return
        self.start(group, download)

    def start(self, group: ParamGroup, download: Any) -> None:
        ctx = self._context(group)
        assert ctx is not None
        # The gradients as they are now: a caller's zero_grad after a failed
        # backward must not change what a queued step applies.
        grads = [
            (sp.sharded, sp.sharded.grad) for sp in group.params if sp.sharded.grad is not None
        ]
        ctx.stepped.append(group)
        if self.threaded and group.settings.offload_policy is not None:
            ctx.steps.append(_worker().submit(self._run, ctx, grads, download))
        else:
            self._run(ctx, grads, download)

    def check_not_stepped(self, group: ParamGroup) -> None:
        """Refuse to gather a module again in the backward that stepped it."""
        ctx = self._context(group)
        if ctx is not None and ctx.phase is Phase.BACKWARD and group in ctx.stepped:
            raise RuntimeError(
                f"module {group.label!r} is needed again in the backward that already "
                "stepped it (optimizer_in_backward): it runs in two reentrant-checkpointed "
                "regions, so its gradients would be computed with stepped parameters; use "
                "use_reentrant=False there, or remove() the handle"
            )

    def _run(self, ctx: Any, grads: list[tuple[Any, Any]], download: Any) -> None:
        """Step one module; after a failure the rest of this backward keeps its gradients."""
        if ctx.step_error is not None:
            return
        try:
            if download is not None:
                download.synchronize()
            self._step(grads)
        except BaseException as e:  # noqa: BLE001 - raised at the end of backward
            ctx.step_error = e

    def _step(self, grads: list[tuple[Any, Any]]) -> None:
        mine = {id(p): g for p, g in grads}
        opt = self.optimizer
        param_groups = []
        for pg in opt.param_groups:
            params = [p for p in pg["params"] if id(p) in mine]
            if params:
                param_groups.append({**pg, "params": params})
        if not param_groups:
            return
        if self.threaded:
            _step_locals(opt, param_groups, mine)
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
    shadow.__dict__["_shardwise_shadow"] = True  # not a caller's step (param_group.py counts those)
    return shadow


def _step_locals(
    opt: torch.optim.Optimizer, param_groups: list[dict[str, Any]], grads: dict[int, Any]
) -> None:
    """Step the local shards as plain tensors.

    Why not the DTensors: DTensor dispatches in Python and holds the GIL for the
    whole kernel, so the worker thread would stall the backward's hooks for the
    length of every step. The optimizer state stays DTensors (checkpoints see
    no difference): the plain tensors stepped here are views of them, and state
    the step creates is wrapped back with the parameter's spec. Stepping views
    does not bump the DTensors' versions; nothing needs it to, since every
    stepped module is resharded before its next gather (``wait_steps``).
    """
    state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
    pairs = []
    local_groups = []
    for pg in param_groups:
        params = []
        for p in pg["params"]:
            lp = local_of(p).detach()
            lp.grad = local_of(grads[id(p)])
            if p in opt.state:
                state[lp] = {k: local_of(v) for k, v in opt.state[p].items()}
            pairs.append((p, lp))
            params.append(lp)
        local_groups.append({**pg, "params": params})
    _shadow(opt, local_groups, state).step()
    for p, lp in pairs:
        before = opt.state.get(p, {})
        after = {}
        for k, v in state[lp].items():
            old = before.get(k)
            if old is not None and local_of(old) is v:
                after[k] = old  # updated in place
            elif isinstance(v, torch.Tensor) and isinstance(p, DTensor) and _like(v, lp, k):
                meta = TensorMeta(p.shape, p.stride(), v.dtype)
                spec = DTensorSpec(p.device_mesh, p.placements, tensor_meta=meta)
                after[k] = DTensor(v, spec, requires_grad=False)
            else:
                after[k] = v
        opt.state[p] = after
        lp.grad = None


def _like(v: torch.Tensor, local_param: torch.Tensor, key: str) -> bool:
    """State shaped as the parameter's shard (moments, buffers), not a step count."""
    return key != "step" and v.shape == local_param.shape and v.dtype.is_floating_point


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
    if type(optimizer) not in ELEMENTWISE and not separable:
        raise TypeError(
            f"optimizer_in_backward: {type(optimizer).__name__} is not one of torch's "
            "elementwise optimizers, and stepping it one module at a time is only right if "
            "its step updates each parameter from that parameter's gradient and state alone; "
            "if it does, pass separable=True"
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
    taken = [g for g in groups if g.step_in_backward is not None]
    if taken:
        same = all(g.step_in_backward.optimizer is optimizer for g in taken)
        raise RuntimeError(
            f"optimizer_in_backward: {len(taken)} of these modules already step inside backward "
            + ("with this optimizer" if same else "with another optimizer")
            + "; call remove() on that handle first"
        )
    return OptimizerInBackward(model, optimizer, groups)
