"""The root context: one per outermost sharded module, shared by every module under it.

It exists to answer one question correctly: is autograd in backward right now?
Activation recomputation runs module forwards inside backward. Such a forward
must not prefetch ahead in forward order (that would gather a module whose
backward may already be over, and nothing would reshard it again) and must
keep its parameters gathered for the backward that follows. The context enters
``BACKWARD`` in the first pre-backward hook of a backward pass (the root's,
normally) and leaves it in an autograd final callback, which also reshards
anything still gathered and finishes every gradient reduction in flight.

What lives here is state and its own transitions: the root's (``FSDPContext``:
its phase, the recorded orders, the reductions and downloads in flight,
optimizer_in_backward's record of this backward) and each module's
(``ModuleLifecycle``: its stage, written only through lifecycle.py's table). What walks
the modules at the root's boundaries (a forward's start and end, the end of a
backward, a backward that raised, a reset) is root.py, above this file; the
hooks that drive one module (module.py) are above that. Nothing here calls up
into either.
"""

from __future__ import annotations

import bisect
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Generic, Protocol, TypeVar

import torch
import torch.nn as nn

from ..layout import offload
from . import lifecycle
from .lifecycle import TRANSITIONS, Event, Stage, next_stage
from .mesh_part import Reduction
from .param_group import ParamGroup
from .settings import GroupSettings
from .step_in_backward import BackwardSteps
from .trace import active as active_trace


class Phase(Enum):
    """What a module (or the root context) is doing, coarsely: a module's ``Stage``
    (lifecycle.py) says exactly."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


_PHASE_OF = {
    Stage.IDLE: Phase.IDLE,
    Stage.FORWARD: Phase.FORWARD,
    Stage.AFTER_FORWARD: Phase.IDLE,
    Stage.BACKWARD: Phase.BACKWARD,
    Stage.HELD: Phase.BACKWARD,
    Stage.REDUCED: Phase.IDLE,
    Stage.STEPPED: Phase.IDLE,
}


@dataclass
class RootSettings:
    """Settings of a whole root, the one place they live. FSDP2 takes them on
    any of its modules, also before the first forward (then a module keeps
    them until its root's context is made: ``ModuleState.set_for_root``)."""

    is_last_backward: bool = True  # False: this backward's reductions may stay in flight
    post_optim_event: Any = None  # waited on once, before the next forward's gathers


class Ordered(Protocol):
    """What an execution order is of: something that may gather (a module's lifecycle)."""

    @property
    def group(self) -> object: ...


T = TypeVar("T", bound=Ordered)


class ExecutionOrder(Generic[T]):
    """The order modules needed their parameters in one forward (or backward), and
    for each position the modules to prefetch there.

    The static module-tree order is only a guess; the real order is known after
    one step. A forward that departs from the recorded order stops prefetching
    for the rest of that pass (no wasted gathers) and is recorded instead.
    """

    def __init__(self, states: list[T], depth_of: dict[int, int]) -> None:
        self.states = list(states)  # a copy: the recording list keeps growing
        gathering = [i for i, s in enumerate(states) if s.group is not None]
        self.targets: list[list[T]] = []
        for pos, s in enumerate(states):
            # The next modules that gather, from just after ``pos``: a rebuild
            # (whenever the order changes) costs n * depth, not n * n.
            depth = depth_of[id(s)]
            ahead: list[T] = []
            k = bisect.bisect_right(gathering, pos)
            while len(ahead) < depth and k < len(gathering):
                t = states[gathering[k]]
                if t is not s and t not in ahead:
                    ahead.append(t)
                k += 1
            self.targets.append(ahead)

    def same(self, states: list[T]) -> bool:
        return len(states) == len(self.states) and all(a is b for a, b in zip(states, self.states))


class Recording(Generic[T]):
    """One pass (a forward or a backward) recorded against the last recorded order."""

    def __init__(self) -> None:
        self.order: ExecutionOrder[T] | None = None
        self.seen: list[T] = []
        self.on_track = True

    def start(self) -> None:
        self.seen = []
        self.on_track = True

    def needs(self, state: T) -> list[T] | None:
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


class ModuleLifecycle:
    """One sharded module's place in the lifecycle, and what it does at the root's
    boundaries; ``ModuleState`` (module.py), which adds the hooks, is one.

    Its stage is written here only, by ``on``, through lifecycle.py's table.
    """

    def __init__(self, label: str, settings: GroupSettings, check: bool) -> None:
        self.label = label
        self.settings = settings  # the group's too (settings.py)
        self.check = check
        self.group: ParamGroup | None = None
        self.context: FSDPContext | None = None
        self.stage = Stage.IDLE
        # fully_shard([a, b]): one group for several modules, gathered when the
        # first of them runs and resharded after the last: those still to run.
        self.to_run: set[int] = set()
        self._part: nn.Module | None = None  # the root's part called on its own (module.py)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.label!r}, stage={self.stage.name})"

    @property
    def phase(self) -> Phase:
        return _PHASE_OF[self.stage]

    @property
    def backward_done(self) -> bool:
        """Its backward is over in this backward pass (reduced, maybe stepped)."""
        return self.stage is Stage.REDUCED or self.stage is Stage.STEPPED

    def on(self, event: Event) -> None:
        """Move to the stage ``event`` leads to (lifecycle.py's table), or raise
        ``LifecycleError`` naming this module, its stage and the event."""
        new = TRANSITIONS.get((self.stage, event))
        if new is None or lifecycle.observed is not None:  # refused, or a test records
            new = next_stage(
                self.label, self.stage, event, self.context.events if self.context else ()
            )
        self.stage = new

    def reshard_now(self, keep: bool = False) -> None:
        """Free what is gathered; ``keep``: after forward, what backward gathers from."""
        if self.group is not None:
            self.group.reshard(keep)

    def root_forward_starts(self) -> None:
        """The root's forward starts. A forward that raised left this module FORWARD
        and maybe gathered: recover here rather than refuse every later step."""
        self.to_run.clear()  # a group whose modules did not all run last time
        if self.stage is Stage.FORWARD:
            self.on(Event.RECOVER)
            self.reshard_now()
        if self.group is not None:
            self.group.new_forward()

    def forward_ends(self, backward_follows: bool) -> None:
        self.on(Event.FORWARD_FOR_BACKWARD if backward_follows else Event.FORWARD_DONE)

    def root_forward_ends(self, backward_follows: bool) -> None:
        """The root's forward ended before all of this group's modules ran (or one ran
        again): its forward ends with the root's, as in FSDP2 (the root resharded it)."""
        self.to_run.clear()
        if self.stage is Stage.FORWARD:
            self.forward_ends(backward_follows)

    def no_backward(self) -> None:
        """The root's forward ended and no backward follows: nobody waits for one."""
        if self.stage is Stage.AFTER_FORWARD:
            self.on(Event.NO_BACKWARD)

    def backward_starts(self) -> None:
        if self.group is not None:
            # A forward recomputed with its hooks (checkpoint around the module)
            # builds a new graph: it makes a new attachment, once per backward,
            # unless the group is still gathered from its forward (the attachment
            # kept, ``keeps_attachment``). Pre-backward hooks carry their own
            # forward's attachment.
            self.group.detach_autograd()

    def backward_finished(self) -> None:
        """This module's reduction is started (or not needed): its backward is over."""
        self.on(Event.REDUCE)

    def stepped(self) -> None:
        self.on(Event.STEP)

    def backward_ends(self) -> None:
        """The root's backward ended (or was abandoned): sharded, IDLE."""
        if self.group is not None:
            if self.settings.reshard_after_backward:
                self.group.reshard()
            self.group.detach_autograd()
        self.on(Event.BACKWARD_ENDS)

    def reset(self) -> None:
        """Back to between steps (``reset_iter_state``): sharded, IDLE, no partial sums."""
        self.on(Event.RESET)
        self.to_run.clear()
        self._part = None  # a root part whose call raised: the next call gathers anew
        self.reshard_now()
        if self.group is not None:
            self.group.detach_autograd()
            self.group.clear_accumulated()


class FSDPContext:
    """Shared state of one root: the module orders, the phase, reductions in flight."""

    def __init__(self, root: ModuleLifecycle, states: list[ModuleLifecycle]) -> None:
        self.root = root
        # Static forward order: module-tree pre-order, the order sharded modules
        # are usually called in. Backward runs it in reverse. Replaced by the
        # recorded orders after the first step.
        self.states = states
        self.phase = Phase.IDLE
        # Reductions in flight and the group each is of, in the order they started.
        self.pending_reduces: list[tuple[ModuleLifecycle, Reduction]] = []
        self.downloads: list[Any] = []  # CPU offload: gradients copied to host, in flight
        # optimizer_in_backward: what this backward stepped (step_in_backward.py).
        self.steps: BackwardSteps[ModuleLifecycle] = BackwardSteps()
        self.forwards = 0  # forwards with grad since the last backward ended
        self.events: deque[str] = deque(maxlen=32)
        self.check = any(s.check for s in states)
        self.fwd: Recording[ModuleLifecycle] = Recording()
        self.bwd: Recording[ModuleLifecycle] = Recording()
        self.in_forward = False  # the root's forward is running (between its pre- and post-forward)
        self.settings = RootSettings()  # set_is_last_backward, set_post_optim_event
        # The module whose reduction waits for the rest of a backward (a reentrant
        # checkpoint's inner pass reached it: module.py's post_backward).
        self.held: ModuleLifecycle | None = None
        self._outer_task = -1  # the autograd graph task of the current backward
        self._end: weakref.ref[Callable[[], None]] | None = None  # its queued final callback
        # Modules whose backward finished in this backward: one rank's casts
        # prefetch in backward once one has (param_group.py's ``prefetches``).
        self.backwards_done = 0

    def __repr__(self) -> str:
        return f"FSDPContext(root={self.root.label!r}, modules={len(self.states)}, phase={self.phase.name})"

    # ---- forward ------------------------------------------------------------------------

    def begin_forward(self) -> None:
        """The root's forward starts (root.py has brought every module back to IDLE)."""
        if self.settings.post_optim_event is not None:
            self.settings.post_optim_event.wait()  # one event per step: FSDP2 discards it too
            self.settings.post_optim_event = None
        self.fwd.start()
        self.in_forward = True
        if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            self.forwards += 1  # not a recomputation inside backward: a graph of its own
        tracer = active_trace()
        if tracer is not None:
            tracer.begin("forward", "")

    def forward_needs(self, state: ModuleLifecycle) -> list[ModuleLifecycle] | None:
        """Record that ``state`` runs its forward now; return what to prefetch
        from the recorded order (None: no recorded order yet, use the static one)."""
        if not self.in_forward:
            # A sharded child called on its own: record nothing, prefetch nothing.
            # Its graph is one more forward before the next backward.
            if torch.is_grad_enabled() and self.phase is not Phase.BACKWARD:
                self.forwards += 1
            return []
        return self.fwd.needs(state)

    def end_forward(self) -> None:
        self.in_forward = False
        self.fwd.finish(self._depths())
        tracer = active_trace()
        if tracer is not None:
            tracer.end("forward", "")

    def backward_needs(self, state: ModuleLifecycle) -> list[ModuleLifecycle] | None:
        return self.bwd.needs(state)

    def _depths(self) -> dict[int, int]:
        return {id(s): s.settings.prefetch for s in self.states}

    # ---- backward -----------------------------------------------------------------------

    def begin_backward(self, end: Callable[[], None]) -> None:
        """Enter ``BACKWARD``; ``end`` is the final callback queued for it (held weakly:
        autograd owns it, and drops it with the graph task)."""
        self.phase = Phase.BACKWARD
        self.backwards_done = 0
        self._outer_task = torch._C._current_graph_task_id()
        self._end = weakref.ref(end)
        self.bwd.start()
        if self.check:
            self.log("context: enter BACKWARD")
        tracer = active_trace()
        if tracer is not None:
            tracer.begin("backward", "")

    def end_backward(self, completed: bool = True) -> None:
        """Leave ``BACKWARD``: ``completed`` by the final callback (its order is
        recorded), or abandoned (a backward that raised)."""
        if completed:
            self.bwd.finish(self._depths())
        self.phase = Phase.IDLE
        if completed:
            if self.check:
                self.log("context: leave BACKWARD")
            tracer = active_trace()
            if tracer is not None:
                tracer.end("backward", "")

    def nested_pass(self) -> bool:
        """Whether autograd runs an inner backward of this backward now (a reentrant
        checkpoint recomputes and backpropagates a region on its own)."""
        return torch._C._current_graph_task_id() != self._outer_task

    def abandoned(self) -> bool:
        """Whether a backward that raised left this context in BACKWARD: outside
        autograd (on this thread) no backward of ours can be running, and inside
        it, ours is over once autograd dropped its final callback unrun."""
        if self.phase is not Phase.BACKWARD:
            return False
        return torch._C._current_graph_task_id() == -1 or self._end is None or self._end() is None

    def wait_downloads(self) -> None:
        """CPU offload: the optimizer may read the CPU gradients once this returns.
        The device tensors the copies read go too (the last one would otherwise stay
        until the next step's first download: offload.py)."""
        for event in self.downloads:
            event.synchronize()
        self.downloads.clear()
        offload.release_downloaded()

    def log(self, event: str) -> None:
        self.events.append(event)
