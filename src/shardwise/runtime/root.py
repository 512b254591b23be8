"""The root's boundaries: what happens to every module when a forward starts or ends,
when a backward ends, when one raised, and on a reset.

Why a layer of its own: these walk every module of a root (``FSDPContext.states``)
and tell each what to do, through the module's own lifecycle
(``ModuleLifecycle`` in context.py, whose phase only it writes). The hooks
(module.py) call them; the context below holds the state they change and
calls none of them. Reductions are finished here too (``finish_reduces``),
since the layer that finishes a module's reduction is the one that tells
optimizer_in_backward its gradients are ready (``BackwardSteps``,
step_in_backward.py): the group puts the reduced shards on ``.grad`` and
knows nothing of steps.

Alternatives considered: the same walks as methods of ``ModuleState`` in
module.py (FSDP2 keeps them on its state class) would put the root's
boundaries and one module's hooks in one file past 600 lines; callbacks the
hooks register with the context would keep the call up, hidden behind a
registration. Here each module's side of a boundary is a method of its
``ModuleLifecycle`` (context.py), so this file never writes a module's
phase, and the context below never calls a module.
"""

from __future__ import annotations

import torch

from .check import check_backward_end
from .context import FSDPContext, ModuleLifecycle, Phase
from .lifecycle import Event
from .mesh_part import Reduction
from .step_in_backward import StepInBackward

# ---- forward ----------------------------------------------------------------------------


def begin_forward(ctx: FSDPContext) -> None:
    """The root's pre-forward: every module IDLE, sharded or kept as it should be."""
    for s in ctx.states:
        s.root_forward_starts()
    ctx.begin_forward()


def end_forward(ctx: FSDPContext, backward_follows: bool) -> None:
    """The root's post-forward. A backward follows: the root runs it first, so by
    default (``reshard_after_forward`` None) the root is kept, and wasted
    prefetches are dropped. None follows: nobody may stay gathered, root
    included. A group some of whose modules did not run ends here too."""
    ctx.in_forward = False
    for s in ctx.states:
        if not backward_follows:
            s.reshard_now()
        elif s.settings.reshard_after_forward:
            s.reshard_now(keep=True)
        if s.to_run:
            s.root_forward_ends(backward_follows)
        if not backward_follows:
            s.no_backward()
    ctx.end_forward()


# ---- backward ---------------------------------------------------------------------------


class _EndOfBackward:
    """The final callback queued with autograd for one backward pass.

    The context keeps only a weak reference to it: autograd owns it, and
    drops it with the graph task. So while it is alive, its backward is still
    running (a nested reentrant pass belongs to it); once it is gone without
    having run, its backward raised.
    """

    __slots__ = ("ctx", "__weakref__")

    def __init__(self, ctx: FSDPContext) -> None:
        self.ctx = ctx

    def __call__(self) -> None:
        end_of_backward(self.ctx)


def enter_backward(ctx: FSDPContext) -> None:
    """Idempotent: the first pre-backward of a backward pass switches phase.

    A backward that raised left the phase BACKWARD; a new one started
    without a forward in between (the same graph again, ``retain_graph``)
    cleans up after it first, then is entered like any other.
    """
    if ctx.phase is Phase.BACKWARD:
        if not ctx.abandoned():
            return
        abandon_backward(ctx)
    end = _EndOfBackward(ctx)
    ctx.begin_backward(end)
    for s in ctx.states:
        s.backward_starts()
    torch.autograd.Variable._execution_engine.queue_callback(end)


def hold(ctx: FSDPContext, state: ModuleLifecycle) -> None:
    """Keep ``state`` gathered and its gradients summed until another module's
    backward starts or this backward ends; then ``release_held`` reduces them."""
    if ctx.held is not None and ctx.held is not state:
        release_held(ctx)
    state.on(Event.HOLD)
    ctx.held = state


def release_held(ctx: FSDPContext) -> None:
    state, ctx.held = ctx.held, None
    if state is not None:
        finish_backward(ctx, state, None)


def finish_backward(
    ctx: FSDPContext, state: ModuleLifecycle, grads: list[torch.Tensor | None] | None
) -> None:
    """``state``'s backward is over: reduce (``grads`` None: only what was
    accumulated) and reshard."""
    group = state.group
    assert group is not None
    # Reshard first: the reduction reads gradients, not parameters, so the
    # unsharded parameters go before its buffers are allocated.
    if state.settings.reshard_after_backward:
        group.reshard()
    if grads is not None or group.owes_reduction:
        # One reduction in flight at a time (by default) bounds the gradient
        # memory held.
        finish_reduces(ctx, keep=state.settings.max_reduces_in_flight - 1, overlap=True)
        job = group.reduce_grads(
            grads or [None] * len(group.params), ctx.settings.is_last_backward, ctx.downloads
        )
        if job is not None:
            ctx.pending_reduces.append((state, job))
    state.backward_finished()
    ctx.backwards_done += 1


def finish_reduces(ctx: FSDPContext, keep: int = 0, overlap: bool = False) -> None:
    """Finish the reductions in flight, all but the newest ``keep``; tell
    optimizer_in_backward of each group whose gradients are now on ``.grad``.

    ``overlap`` (a post-backward: more backward follows): an HSDP job whose
    all-reduce is not issued yet only issues it and stays, to be finished
    by the next call. The all-reduce then runs beside the next module's
    backward, as FSDP2's does, instead of being waited for at once; what it
    holds meanwhile is one reduced shard, not the reduce-scatter's input.
    """
    pending = ctx.pending_reduces
    staying: list[tuple[ModuleLifecycle, Reduction]] = []
    try:
        for _ in range(len(pending) - keep):
            # Off the list first: a job that raises is not finished twice
            # (its gradients added twice) when a reset finishes the rest.
            state, job = pending.pop(0)
            if overlap and job.overlaps:
                job.scattered()
                staying.append((state, job))
                continue
            shards = job.finish()
            if shards is None:
                continue  # held back (set_requires_all_reduce(False)): no gradient yet
            group = state.group
            assert group is not None
            group.assign_grads(shards, job.used)
            stepper = group.step_in_backward
            if job.last_backward and stepper is not None:
                _grads_ready(ctx, stepper, state, job.downloaded)
    finally:
        pending[:0] = staying


def _grads_ready(
    ctx: FSDPContext, stepper: StepInBackward, state: ModuleLifecycle, download: object
) -> None:
    """``state``'s gradients are on ``.grad`` (``download``: the event of their copy
    to the host, or None): optimizer_in_backward steps it now, on its worker
    thread, or at the end of this backward."""
    if ctx.forwards > 1:
        # Several forwards before this backward: a module may be reduced once
        # per forward, so it steps at the end, when its gradients are whole.
        ctx.steps.defer(stepper, state)
        return
    _start_step(ctx, stepper, state, download)


def _start_step(
    ctx: FSDPContext, stepper: StepInBackward, state: ModuleLifecycle, download: object
) -> None:
    group = state.group
    assert group is not None
    state.stepped()
    group.mark_stepped(True)  # gathered again in this backward: refused (param_group.py)
    offloaded = group.settings.offload_policy is not None
    ctx.steps.start(stepper, state, group.grads_to_step(), offloaded, download)


def wait_steps(ctx: FSDPContext, raise_error: bool = True) -> None:
    """optimizer_in_backward: wait until every module stepped, then reshard the
    stepped ones (a module kept gathered would hold the parameters from before
    its step). The first step that raised is raised here; the modules after it
    kept their gradients."""
    deferred = ctx.steps.take_deferred()
    if raise_error:
        for stepper, state in deferred:  # several forwards: every reduction is done now
            _start_step(ctx, stepper, state, None)
    ctx.forwards = 0
    stepped, error = ctx.steps.wait()
    for state in stepped:
        assert state.group is not None
        state.group.mark_stepped(False)
        state.group.reshard()
    if error is not None and raise_error:
        raise error


def end_of_backward(ctx: FSDPContext) -> None:
    """The autograd final callback: every reduction done, every module sharded and IDLE.

    Unless ``set_is_last_backward(False)`` said more backwards come before
    the optimizer (microbatches): then reductions may stay in flight; the
    next backward finishes them.
    """
    release_held(ctx)
    for s in ctx.states:
        # Sums of a module this synced backward did not reach (gradient sync
        # or HSDP's all-reduce was off earlier): reduced now, in the same
        # order on every rank.
        if s.group is not None and s.group.owes_reduction:
            finish_backward(ctx, s, None)
    if ctx.settings.is_last_backward:
        finish_reduces(ctx)
    ctx.wait_downloads()
    error: BaseException | None = None
    try:
        wait_steps(ctx)
    except BaseException as e:  # noqa: BLE001 - raised after the clean-up below
        error = e
    if ctx.check and error is None:
        error = check_backward_end(ctx)
    for s in ctx.states:
        s.backward_ends()
    ctx.end_backward()
    if error is not None:
        # Raised after the clean-up: no collective is left in flight and the
        # model is usable again (sharded, IDLE) if the caller carries on.
        raise error


def abandon_backward(ctx: FSDPContext) -> None:
    """A backward that raised never reaches the final callback: clean up as it would."""
    if ctx.check:
        ctx.log("context: backward was abandoned (an exception inside it)")
    # Reductions finished before the error have put their gradients on
    # .grad, as plain autograd has. Those still in flight are waited for
    # and dropped: finished now, at the next forward, they would land after
    # the caller's zero_grad (a skipped batch) and leak into the next step.
    # A held module's partial sum is dropped too: its backward never
    # finished. Nothing steps (optimizer_in_backward): the caller sees the error.
    jobs, ctx.pending_reduces = ctx.pending_reduces, []
    for _, job in jobs:
        job.discard()
    ctx.wait_downloads()
    wait_steps(ctx, raise_error=False)
    if ctx.held is not None and ctx.held.group is not None:
        ctx.held.group.clear_accumulated()
    ctx.held = None
    for s in ctx.states:
        s.backward_ends()
    ctx.end_backward(completed=False)


def reset(ctx: FSDPContext) -> None:
    """Back to between steps after an exception: nothing gathered, nothing in flight,
    no partial sums (an aborted microbatch must not reach the next step)."""
    if ctx.phase is Phase.BACKWARD:
        abandon_backward(ctx)
    finish_reduces(ctx)
    ctx.wait_downloads()
    wait_steps(ctx, raise_error=False)
    ctx.held = None
    for s in ctx.states:
        s.reset()
    ctx.in_forward = False
