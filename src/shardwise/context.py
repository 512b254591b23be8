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

from collections import deque
from enum import Enum
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .module import ModuleState
    from .param_group import ReduceJob


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


class LifecycleError(RuntimeError):
    """A module broke the unshard/reshard lifecycle; the message says where and how."""


class FSDPContext:
    """Shared state of one root: the module orders, the phase, reductions in flight."""

    def __init__(self, root: ModuleState, states: list[ModuleState]) -> None:
        self.root = root
        # Static forward order: module-tree pre-order, the order sharded modules
        # are usually called in. Backward runs it in reverse.
        self.states = states
        for i, s in enumerate(states):
            s.order_index = i
        self.phase = Phase.IDLE
        self.pending_reduces: list[ReduceJob] = []
        self.events: deque[str] = deque(maxlen=32)

    def __repr__(self) -> str:
        return f"FSDPContext(root={self.root.label!r}, modules={len(self.states)}, phase={self.phase.name})"

    # ---- orders -------------------------------------------------------------------------

    def forward_next(self, state: ModuleState, n: int) -> list[ModuleState]:
        i = state.order_index
        return self.states[i + 1 : i + 1 + n]

    def backward_next(self, state: ModuleState, n: int) -> list[ModuleState]:
        i = state.order_index
        return self.states[max(0, i - n) : i][::-1]

    # ---- backward boundaries ------------------------------------------------------------

    def enter_backward(self) -> None:
        """Idempotent: the first pre-backward of a backward pass switches phase."""
        if self.phase is Phase.BACKWARD:
            return
        self.phase = Phase.BACKWARD
        self.log("context: enter BACKWARD")
        for s in self.states:
            s.on_backward_start()
        torch.autograd.Variable._execution_engine.queue_callback(self._final_callback)

    def finish_reduces(self) -> None:
        jobs, self.pending_reduces = self.pending_reduces, []
        for job in jobs:
            job.finish()

    def _final_callback(self) -> None:
        """End of backward: every reduction done, every module sharded and IDLE."""
        self.finish_reduces()
        for s in self.states:
            s.on_backward_end()
        self.phase = Phase.IDLE
        self.log("context: leave BACKWARD")

    def reshard_all(self) -> None:
        for s in self.states:
            s.reshard_now()

    def log(self, event: str) -> None:
        self.events.append(event)
