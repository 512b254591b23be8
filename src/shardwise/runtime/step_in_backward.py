"""The machinery of stepping an optimizer inside backward: one module's shards at a time.

``optimizer_in_backward`` (optimizer_in_backward.py) is the public call and its
handle; this file is what the runtime below it needs: ``StepInBackward`` steps
one optimizer's parameters given their gradients, and ``BackwardSteps`` is one
root's record of a backward's steps (those in flight on the worker thread,
the modules stepped, those deferred to the end, the first error). Neither
knows a group or a module: the layer that finished a module's reduction
(root.py) gives them the gradients and the module's group, and reshards the
groups they return when the backward ends. A group refers to the stepper
that steps it (``ParamGroup.step_in_backward``).

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

from collections import OrderedDict, defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ..layout.flat_shard import local_of

MARK = "_shardwise_steps_in_backward"  # on parameters stepped inside backward (clip.py reads it)

_pool: ThreadPoolExecutor | None = None


def _worker() -> ThreadPoolExecutor:
    """One thread: offloaded modules step in the order their gradients arrived."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardwise-step")
    return _pool


Grads = list[tuple[Any, Any]]  # (sharded parameter, its gradient), as they were when stepping began


class StepInBackward:
    """Steps ``optimizer``'s parameters inside backward, given one module's gradients."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        # Only steps that issue no collective may leave the autograd thread: a
        # DTensor step (a norm, a redistribute) would interleave its collectives
        # with the backward's, in a different order on each rank.
        self.threaded = type(optimizer) in ELEMENTWISE

    def step(self, grads: Grads) -> None:
        """Step the parameters of ``grads`` with those gradients; their ``.grad`` goes."""
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


G = TypeVar("G")  # what a step belongs to: a group (param_group.py), resharded once stepped


class BackwardSteps(Generic[G]):
    """One root's steps in one backward: optimizer_in_backward's own bookkeeping.

    Every module stepped in a backward is resharded at its end (a module kept
    gathered would hold the parameters from before its step); steps of
    offloaded modules run on the worker thread, beside the backward; several
    forwards before one backward defer every step to its end, when each
    module's gradients are whole. The first step that fails is kept, the
    later ones are skipped (their modules keep their gradients), and it is
    raised at the end of backward.
    """

    def __init__(self) -> None:
        self.running: list[Future[None]] = []  # offloaded modules' steps on the worker
        self.stepped: list[G] = []  # every module stepped in this backward
        self.deferred: list[tuple[StepInBackward, G]] = []  # to step at the end
        self.error: BaseException | None = None  # the first step that failed

    def defer(self, stepper: StepInBackward, owner: G) -> None:
        if all(o is not owner for _, o in self.deferred):
            self.deferred.append((stepper, owner))

    def start(
        self, stepper: StepInBackward, owner: G, grads: Grads, threaded: bool, download: Any
    ) -> None:
        """Step ``grads`` now, or on the worker thread when ``threaded`` (and the
        stepper may leave the autograd thread) once ``download`` (an event, or
        None) says the gradients are on the host."""
        self.stepped.append(owner)
        if threaded and stepper.threaded:
            self.running.append(_worker().submit(self._run, stepper, grads, download))
        else:
            self._run(stepper, grads, download)

    def _run(self, stepper: StepInBackward, grads: Grads, download: Any) -> None:
        """Step one module; after a failure the rest of this backward keeps its gradients."""
        if self.error is not None:
            return
        try:
            if download is not None:
                download.synchronize()
            stepper.step(grads)
        except BaseException as e:  # noqa: BLE001 - raised at the end of backward
            self.error = e

    def take_deferred(self) -> list[tuple[StepInBackward, G]]:
        deferred, self.deferred = self.deferred, []
        return deferred

    def wait(self) -> tuple[list[G], BaseException | None]:
        """Wait for the steps in flight; what was stepped (to reshard) and the first
        error, both forgotten here."""
        for f in self.running:
            f.result()  # _run records errors, never raises
        self.running = []
        stepped, self.stepped = self.stepped, []
        error, self.error = self.error, None
        return stepped, error


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
    stepped module is resharded before its next gather (root.py's ``wait_steps``).
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


def refuse_stepped_in_backward(params: list[torch.Tensor]) -> None:
    """One error where a clip would see parameters optimizer_in_backward steps: their
    gradients were applied and dropped in backward, so nothing is left to clip."""
    stepped = [p for p in params if getattr(p, MARK, False)]
    if stepped:
        raise RuntimeError(
            f"clip_grad_norm_: {len(stepped)} of these parameters step inside backward "
            "(optimizer_in_backward), so their gradients are applied and gone before any "
            "clipping could see them all; remove() the handle to clip, or do not clip"
        )


class TorchClipGuard:
    """torch's ``clip_grad_norm_``, refusing as ours does while an optimizer_in_backward
    handle is active: it would find no gradients on those parameters and clip nothing,
    silently (the differential fuzzer's one shardwise-only finding). Installed on
    ``torch.nn.utils`` (and ``torch.nn.utils.clip_grad``) by the first handle, restored
    when the last is removed; a name bound before that is torch's own.

    Alternatives considered: keeping ``.grad`` for torch's clip to read would hold the
    gradients optimizer_in_backward exists to free; a warning would still clip nothing.
    """

    active = 0
    _original: Any = None

    @classmethod
    def acquire(cls) -> None:
        if cls.active == 0:
            cls._original = torch.nn.utils.clip_grad_norm_
            torch.nn.utils.clip_grad_norm_ = cls._guarded  # type: ignore[assignment]
            torch.nn.utils.clip_grad.clip_grad_norm_ = cls._guarded  # type: ignore[assignment]
        cls.active += 1

    @classmethod
    def release(cls) -> None:
        cls.active -= 1
        if cls.active == 0 and cls._original is not None:
            torch.nn.utils.clip_grad_norm_ = cls._original
            torch.nn.utils.clip_grad.clip_grad_norm_ = cls._original
            cls._original = None

    @staticmethod
    def _guarded(parameters: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        refuse_stepped_in_backward(params)
        return TorchClipGuard._original(params, *args, **kwargs)
