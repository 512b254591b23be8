"""The root context: one per outermost sharded module, shared by every module under it.

It exists to answer one question correctly: is autograd in backward right now?
Activation recomputation runs module forwards inside backward. Such a forward
must not prefetch ahead in forward order (that would gather a module whose
backward may already be over, and nothing would reshard it again) and must
keep its parameters gathered for the backward that follows. The context enters
``BACKWARD`` in the first pre-backward hook of a backward pass (the root's,
normally) and leaves it in an autograd final callback, which also reshards
anything still gathered and finishes every gradient reduction in flight.
"""

from __future__ import annotations

import bisect
import weakref
from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch

from . import offload
from .trace import active as active_trace

if TYPE_CHECKING:
    from concurrent.futures import Future

    from .module import ModuleState
    from .param_group import ParamGroup
    from .reduce import ReduceJob


class Phase(Enum):
    """What a module (or the root context) is doing."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


# Allowed module phase transitions. FORWARD -> BACKWARD never happens directly:
# a module's forward ends (IDLE) before its backward starts. A recomputed
# forward inside backward keeps the module in BACKWARD (BACKWARD -> BACKWARD).
ALLOWED = frozenset(
    {
        (Phase.IDLE, Phase.FORWARD),
        (Phase.FORWARD, Phase.IDLE),
        (Phase.IDLE, Phase.BACKWARD),
        (Phase.BACKWARD, Phase.BACKWARD),
        (Phase.BACKWARD, Phase.IDLE),
        (Phase.IDLE, Phase.IDLE),
    }
)


@dataclass
class RootSettings:
    """Settings of a whole root, the one place they live. FSDP2 takes them on
    any of its modules, also before the first forward (then a module keeps
    them until its root's context is made: ``ModuleState.set_for_root``)."""

    is_last_backward: bool = True  # False: this backward's reductions may stay in flight
    post_optim_event: Any = None  # waited on once, before the next forward's gathers


class LifecycleError(RuntimeError):
    """A module broke the unshard/reshard lifecycle; the message says where and how."""


class ExecutionOrder:
    """The order modules needed their parameters in one forward (or backward), and
    for each position the modules to prefetch there.

    The static module-tree order is only a guess; the real order is known after
    one step. A forward that departs from the recorded order stops prefetching
    for the rest of that pass (no wasted gathers) and is recorded instead.
    """

    def __init__(self, states: list[ModuleState], depth_of: dict[int, int]) -> None:
        self.states = list(states)  # a copy: the recording list keeps growing
        gathering = [i for i, s in enumerate(states) if s.group is not None]
        self.targets: list[list[ModuleState]] = []
        for pos, s in enumerate(states):
            # The next modules that gather, from just after ``pos``: a rebuild
            # (whenever the order changes) costs n * depth, not n * n.
            depth = depth_of[id(s)]
            ahead: list[ModuleState] = []
            k = bisect.bisect_right(gathering, pos)
            while len(ahead) < depth and k < len(gathering):
                t = states[gathering[k]]
                if t is not s and t not in ahead:
                    ahead.append(t)
                k += 1
            self.targets.append(ahead)

    def same(self, states: list[ModuleState]) -> bool:
        return len(states) == len(self.states) and all(a is b for a, b in zip(states, self.states))


class Recording:
    """One pass (a forward or a backward) recorded against the last recorded order."""

    def __init__(self) -> None:
        self.order: ExecutionOrder | None = None
        self.seen: list[ModuleState] = []
        self.on_track = True

    def start(self) -> None:
        self.seen = []
        self.on_track = True

    def needs(self, state: ModuleState) -> list[ModuleState] | None:
        """Record that ``state`` needs its parameters now; return what to prefetch
        from the recorded order (None: nothing recorded yet, use the static order)."""
        pos = len(self.seen)
        self.seen.append(state)
        order = self.order
        if order is None:
            return None
        if self.on_track and pos < len(order.states) and order.states[pos] is state:
            return order.targets[pos]
        self.on_track = False  # off the recorded path: prefetch nothing more this pass
        return []

    def finish(self, depths: dict[int, int]) -> None:
        if self.order is None or not self.order.same(self.seen):
            self.order = ExecutionOrder(self.seen, depths)


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
        self.ctx._final_callback()


class FSDPContext:
    """Shared state of one root: the module orders, the phase, reductions in flight."""

    def __init__(self, root: ModuleState, states: list[ModuleState]) -> None:
        self.root = root
        # Static forward order: module-tree pre-order, the order sharded modules
        # are usually called in. Backward runs it in reverse. Replaced by the
        # recorded orders after the first step.
        self.states = states
        for i, s in enumerate(states):
            s.order_index = i
        self.phase = Phase.IDLE
        self.pending_reduces: list[ReduceJob] = []
        self.downloads: list[Any] = []  # CPU offload: gradients copied to host, in flight
        # optimizer_in_backward: offloaded modules' steps on the worker thread,
        # and every module stepped in this backward (resharded at its end).
        self.steps: list[Future[None]] = []
        self.stepped: list[ParamGroup] = []
        self.deferred: list[ParamGroup] = []  # to step at the end (several forwards)
        self.step_error: BaseException | None = None  # the first step that failed
        self.forwards = 0  # forwards with grad since the last backward ended
        self.events: deque[str] = deque(maxlen=32)
        self.check = any(s.check for s in states)
        self.fwd = Recording()
        self.bwd = Recording()
        self._in_forward = False
        self.settings = RootSettings()  # set_is_last_backward, set_post_optim_event
        # The module whose reduction waits for the rest of a backward (a reentrant
        # checkpoint's inner pass reached it: module.py's post_backward).
        self.held: ModuleState | None = None
        self._outer_task = -1  # the autograd graph task of the current backward
        self._end: weakref.ref[_EndOfBackward] | None = None  # its queued final callback
        # Modules whose backward finished in this backward: one rank's casts
        # prefetch in backward once one has (param_group.py's ``prefetches``).
        self.backwards_done = 0

    def __repr__(self) -> str:
        return f"FSDPContext(root={self.root.label!r}, modules={len(self.states)}, phase={self.phase.name})"

    # ---- recorded orders -----------------------------------------------------------------

    def begin_forward(self) -> None:
        # A forward that raised leaves modules FORWARD and maybe gathered:
        # recover here rather than refuse every later step.
        for s in self.states:
            s._to_run.clear()  # a group whose modules did not all run last time
            if s.phase is not Phase.IDLE:
                s.phase = Phase.IDLE
                s.reshard_now()
            elif s.group is not None:
                # A part kept for a backward that never came (reshard_after_forward=int)
                # is stale once the optimizer has stepped: gather anew.
                s.group.drop_kept()
            if s.group is not None:
                s.group.detach_autograd()  # a new forward pass: one attachment per module
        if self.settings.post_optim_event is not None:
            self.settings.post_optim_event.wait()  # one event per step: FSDP2 discards it too
            self.settings.post_optim_event = None
        self.fwd.start()
        self._in_forward = True
        if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            self.forwards += 1  # not a recomputation inside backward: a graph of its own
        tracer = active_trace()
        if tracer is not None:
            tracer.begin("forward", "")

    def forward_needs(self, state: ModuleState) -> list[ModuleState] | None:
        """Record that ``state`` runs its forward now; return what to prefetch
        from the recorded order (None: no recorded order yet, use the static one)."""
        if not self._in_forward:
            # A sharded child called on its own: record nothing, prefetch nothing.
            # Its graph is one more forward before the next backward.
            if torch.is_grad_enabled() and self.phase is not Phase.BACKWARD:
                self.forwards += 1
            return []
        return self.fwd.needs(state)

    @property
    def in_forward(self) -> bool:
        """Whether the root's forward is running (between its pre- and post-forward)."""
        return self._in_forward

    def end_forward(self) -> None:
        self._in_forward = False
        for s in self.states:
            if s._to_run:
                # A group some of whose modules did not run (or ran again): its
                # forward ends with the root's, as in FSDP2 (the root resharded it).
                s._to_run.clear()
                s.phase = Phase.IDLE
        self.fwd.finish(self._depths())
        tracer = active_trace()
        if tracer is not None:
            tracer.end("forward", "")

    def backward_needs(self, state: ModuleState) -> list[ModuleState] | None:
        return self.bwd.needs(state)

    def _depths(self) -> dict[int, int]:
        return {id(s): s.settings.prefetch for s in self.states}

    # ---- backward boundaries ------------------------------------------------------------

    def enter_backward(self) -> None:
        """Idempotent: the first pre-backward of a backward pass switches phase.

        A backward that raised left the phase BACKWARD; a new one started
        without a forward in between (the same graph again, ``retain_graph``)
        cleans up after it first, then is entered like any other.
        """
        if self.phase is Phase.BACKWARD:
            if not self.abandoned():
                return
            self.abandon_backward()
        self.phase = Phase.BACKWARD
        self.backwards_done = 0
        self._outer_task = torch._C._current_graph_task_id()
        self.bwd.start()
        if self.check:
            self.log("context: enter BACKWARD")
        tracer = active_trace()
        if tracer is not None:
            tracer.begin("backward", "")
        for s in self.states:
            s.on_backward_start()
        end = _EndOfBackward(self)
        self._end = weakref.ref(end)
        torch.autograd.Variable._execution_engine.queue_callback(end)

    def nested_pass(self) -> bool:
        """Whether autograd runs an inner backward of this backward now (a reentrant
        checkpoint recomputes and backpropagates a region on its own)."""
        return torch._C._current_graph_task_id() != self._outer_task

    def hold(self, state: ModuleState) -> None:
        """Keep ``state`` gathered and its gradients summed until another module's
        backward starts or this backward ends; then ``release_held`` reduces them."""
        if self.held is not None and self.held is not state:
            self.release_held()
        self.held = state

    def release_held(self) -> None:
        state, self.held = self.held, None
        if state is not None:
            state.finish_backward(None)

    def abandoned(self) -> bool:
        """Whether a backward that raised left this context in BACKWARD: outside
        autograd (on this thread) no backward of ours can be running, and inside
        it, ours is over once autograd dropped its final callback unrun."""
        if self.phase is not Phase.BACKWARD:
            return False
        return torch._C._current_graph_task_id() == -1 or self._end is None or self._end() is None

    def abandon_backward(self) -> None:
        """A backward that raised never reaches the final callback: clean up as it would."""
        if self.check:
            self.log("context: backward was abandoned (an exception inside it)")
        # Reductions finished before the error have put their gradients on
        # .grad, as plain autograd has. Those still in flight are waited for
        # and dropped: finished now, at the next forward, they would land after
        # the caller's zero_grad (a skipped batch) and leak into the next step.
        # A held module's partial sum is dropped too: its backward never
        # finished. Nothing steps (optimizer_in_backward): the caller sees the error.
        jobs, self.pending_reduces = self.pending_reduces, []
        for job in jobs:
            job.discard()
        self.wait_downloads()
        self.wait_steps(raise_error=False)
        if self.held is not None and self.held.group is not None:
            self.held.group.clear_accumulated()
        self.held = None
        for s in self.states:
            s.on_backward_end()
        self.phase = Phase.IDLE

    def finish_reduces(self, keep: int = 0, overlap: bool = False) -> None:
        """Finish the reductions in flight, all but the newest ``keep``.

        ``overlap`` (a post-backward: more backward follows): an HSDP job whose
        all-reduce is not issued yet only issues it and stays, to be finished
        by the next call. The all-reduce then runs beside the next module's
        backward, as FSDP2's does, instead of being waited for at once; what it
        holds meanwhile is one reduced shard, not the reduce-scatter's input.
        """
        staying: list[ReduceJob] = []
        try:
            for _ in range(len(self.pending_reduces) - keep):
                # Off the list first: a job that raises is not finished twice
                # (its gradients added twice) when a reset finishes the rest.
                job = self.pending_reduces.pop(0)
                if overlap and job.overlaps:
                    job.scattered()
                    staying.append(job)
                else:
                    job.finish()
        finally:
            self.pending_reduces[:0] = staying

    def wait_downloads(self) -> None:
        """CPU offload: the optimizer may read the CPU gradients once this returns.
        The device tensors the copies read go too (the last one would otherwise stay
        until the next step's first download: offload.py)."""
        for event in self.downloads:
            event.synchronize()
        self.downloads.clear()
        offload.release_downloaded()

    def wait_steps(self, raise_error: bool = True) -> None:
        """optimizer_in_backward: wait until every module stepped, then reshard the
        stepped ones (a module kept gathered would hold the parameters from before
        its step). The first step that raised is raised here; the modules after it
        kept their gradients."""
        if raise_error:
            for group in self.deferred:  # several forwards: every reduction is done now
                assert group.step_in_backward is not None
                group.step_in_backward.start(group, None)
        self.deferred = []
        self.forwards = 0
        for f in self.steps:
            f.result()  # the worker records errors in step_error, never raises
        self.steps = []
        for group in self.stepped:
            group.reshard()
        self.stepped = []
        error, self.step_error = self.step_error, None
        if error is not None and raise_error:
            raise error

    def _final_callback(self) -> None:
        """End of backward: every reduction done, every module sharded and IDLE.

        Unless ``set_is_last_backward(False)`` said more backwards come before
        the optimizer (microbatches): then reductions may stay in flight; the
        next backward finishes them.
        """
        self.release_held()
        for s in self.states:
            # Sums of a module this synced backward did not reach (gradient sync
            # or HSDP's all-reduce was off earlier): reduced now, in the same
            # order on every rank.
            if s.group is not None and s.group.owes_reduction:
                s.finish_backward(None)
        if self.settings.is_last_backward:
            self.finish_reduces()
        self.wait_downloads()
        error: BaseException | None = None
        try:
            self.wait_steps()
        except BaseException as e:  # noqa: BLE001 - raised after the clean-up below
            error = e
        if self.check and error is None:
            from .check import check_backward_end

            error = check_backward_end(self)
        for s in self.states:
            s.on_backward_end()
        self.bwd.finish(self._depths())
        self.phase = Phase.IDLE
        if self.check:
            self.log("context: leave BACKWARD")
        tracer = active_trace()
        if tracer is not None:
            tracer.end("backward", "")
        if error is not None:
            # Raised after the clean-up: no collective is left in flight and the
            # model is usable again (sharded, IDLE) if the caller carries on.
            raise error

    def reset(self) -> None:
        """Back to between steps after an exception: nothing gathered, nothing in flight,
        no partial sums (an aborted microbatch must not reach the next step)."""
        if self.phase is Phase.BACKWARD:
            self.abandon_backward()
        self.finish_reduces()
        self.wait_downloads()
        self.wait_steps(raise_error=False)
        self.held = None
        for s in self.states:
            s.phase = Phase.IDLE
            s.backward_done = False
            s._to_run.clear()
            s.forget_part()  # a root part whose call raised
            s.reshard_now()
            if s.group is not None:
                s.group.detach_autograd()
                s.group.clear_accumulated()
        self._in_forward = False

    def reshard_all(self) -> None:
        for s in self.states:
            s.reshard_now()

    def log(self, event: str) -> None:
        self.events.append(event)
