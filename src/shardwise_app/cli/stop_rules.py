"""What a worker and its launcher do on a stop or a failure: pure functions of what happened.

``decide(events)`` gives the action for the last of ``events`` (the whole
history so far, oldest first); it reads no clock and touches no process, so
every rule is tested as a table (tests/app/test_stop_rules.py). signals.py
records the events as they come (its one signal thread, the launcher's pipe,
the watch on the parent) and carries the action out.

The rules, in the order ``decide`` applies them:

1. Before a training worker can stop at a step boundary (still starting:
   importing torch, joining the process group; or ``sample`` and ``export``,
   which have nothing to save), any stop ends it at once, exit 128 + signal.
   A worker our entry module started (``ARMED``) can stop at a boundary once
   it made its ``StopRequest`` and ``JOINED`` its group; one started by
   another launcher (torchrun) from its ``StopRequest`` on, since nothing of
   ours ran before it.
2. The first stop asks for a stop at the next step boundary and starts the
   ``--stop-grace`` deadline.
3. After it, the launcher's copy (through the pipe, ``PASSED_ON``) and the
   launcher's end (``ORPHANED``) are the same stop: nothing more to do.
4. A direct signal equal to the first within ``SAME_STOP_S``: without our
   launcher's pipe, another launcher's copy (torchrun passes its SIGTERM on as
   a signal, SLURM signals every process of a job); with it, once, the direct
   copy of the stop our launcher passed on (a terminal's Ctrl-C reaches every
   process of the foreground group), whichever of the two arrived first.
5. Any other signal is a second: the worker ends at once, exit 128 + signal.

The launcher's side (``decide_launcher``), at each of its polls: the first
stop signals are passed on to every worker; a signal after one was passed on
kills every worker at once. Workers still running ``GRACE_S`` past
``--stop-grace`` (stopped, stuck in the kernel) are killed. A worker that ended
otherwise than by the stop (``ended_by_stop``) is a failure: the others get
``GRACE_S`` to notice and end on their own, and those still running are killed
as unresponsive.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass, replace

# Without our launcher's pipe, the same signal again this soon is the same stop.
SAME_STOP_S = 2.0
EXIT_STOP_OVERDUE = 7  # a worker asked to stop found no step boundary within --stop-grace
GRACE_S = 5.0  # the launcher's: after a failure or the stop's deadline, before it kills


class Phase(enum.Enum):
    """What the worker has reached; each is an event of its own."""

    ARMED = "armed"  # our entry module took the signals over (cli/worker.py)
    ARMED_PIPED = "armed, piped"  # the same, with our launcher's pipe to listen to
    STOPPABLE = "stoppable"  # a training worker made its StopRequest
    JOINED = "joined"  # the process group is joined


class Source(enum.Enum):
    DIRECT = "direct"  # a signal sent to this process
    PASSED_ON = "passed on"  # our launcher passed its first stop on through the pipe
    ORPHANED = "orphaned"  # the launcher is gone (its pipe closed, or a new parent pid)


@dataclass(frozen=True)
class Signal:
    """A stop: ``signum`` (SIGTERM for a launcher that is gone), when (monotonic seconds)."""

    signum: int
    at: float
    source: Source = Source.DIRECT


Event = Phase | Signal


class Act(enum.Enum):
    NOTHING = "nothing"  # not a stop signal, or the same stop again
    STOP_AT_BOUNDARY = "stop at the next step boundary"  # and start the deadline
    EXIT_AT_ONCE = "exit at once"  # with 128 + the signal, saving nothing


@dataclass(frozen=True)
class Decision:
    act: Act
    signum: int | None = None  # the signal acted on

    @property
    def exit_code(self) -> int:
        assert self.act is Act.EXIT_AT_ONCE and self.signum is not None
        return 128 + self.signum


@dataclass
class _State:
    armed: bool = False
    piped: bool = False
    stoppable: bool = False
    at_boundary: bool = False
    first: Signal | None = None
    echo_seen: bool = False  # the direct copy of a stop passed on through the pipe
    orphaned: bool = False


def _apply(s: _State, event: Event) -> Decision:
    if isinstance(event, Phase):
        if event in (Phase.ARMED, Phase.ARMED_PIPED):
            s.armed = True
            s.piped = s.piped or event is Phase.ARMED_PIPED
        elif event is Phase.STOPPABLE:
            s.stoppable = True
            if not s.armed:  # another launcher's worker: a stop request from now on
                s.at_boundary = True
        elif event is Phase.JOINED:
            s.at_boundary = s.stoppable
        return Decision(Act.NOTHING)
    if not s.at_boundary:  # rule 1
        return Decision(Act.EXIT_AT_ONCE, event.signum)
    if s.first is None:  # rule 2
        s.first, s.orphaned = event, event.source is Source.ORPHANED
        return Decision(Act.STOP_AT_BOUNDARY, event.signum)
    if event.source is not Source.DIRECT:  # rule 3
        s.orphaned = s.orphaned or event.source is Source.ORPHANED
        return Decision(Act.NOTHING)
    soon = event.signum == s.first.signum and event.at - s.first.at < SAME_STOP_S
    if soon and not s.piped:  # rule 4, another launcher's copy
        return Decision(Act.NOTHING)
    if soon and s.first.source is Source.PASSED_ON and not s.echo_seen:  # rule 4, the echo
        s.echo_seen = True
        return Decision(Act.NOTHING)
    return Decision(Act.EXIT_AT_ONCE, event.signum)  # rule 5


def _fold(events: list[Event]) -> tuple[_State, Decision]:
    state, decision = _State(), Decision(Act.NOTHING)
    for event in events:
        decision = _apply(state, event)
    return state, decision


def decide(events: list[Event]) -> Decision:
    """The action for the last of ``events``, given every one before it."""
    return _fold(events)[1]


def stopped_by(events: list[Event]) -> tuple[int, bool]:
    """For the line at the deadline: the first stop's signal (SIGTERM if none was
    taken), and whether the launcher is gone by now."""
    state = _fold(events)[0]
    signum = state.first.signum if state.first else int(signal.SIGTERM)
    return signum, state.orphaned


# ---- the launcher's side ------------------------------------------------------------------


@dataclass(frozen=True)
class Poll:
    """One look at the workers, at ``at``: rank -> exit code, None while it runs."""

    at: float
    codes: tuple[tuple[int, int | None], ...]


class LauncherAct(enum.Enum):
    WAIT = "wait"
    DONE = "every worker ended"
    KILL_ALL = "kill every worker: a second stop signal"
    KILL_LATE = "kill those running well past --stop-grace"
    KILL_UNRESPONSIVE = "kill those running well after a failure"


@dataclass(frozen=True)
class LauncherDecision:
    act: LauncherAct
    pass_on: tuple[int, ...] = ()  # signals to pass on to the workers first
    ranks: tuple[int, ...] = ()  # the ranks KILL_LATE and KILL_UNRESPONSIVE kill


def ended_by_stop(code: int, signum: int | None) -> bool:
    """A clean stop, a worker still starting that ended on the signal, one it killed, or
    one that ended at its --stop-grace deadline."""
    return code == 0 or (signum is not None and code in (128 + signum, -signum, EXIT_STOP_OVERDUE))


@dataclass(frozen=True)
class LauncherState:
    """What the launcher's rules remember between its polls."""

    pending: tuple[int, ...] = ()  # signals recorded since the last poll
    passed: tuple[int, ...] = ()  # signals passed on to the workers
    stop_at: float | None = None  # when the first was passed on
    failed_at: float | None = None  # when a worker was first seen to have failed


def launcher_step(
    state: LauncherState, event: Signal | Poll, stop_grace_s: float
) -> tuple[LauncherState, LauncherDecision]:
    """One event: the state after it, and what the launcher does now (a ``Signal`` only
    waits for the next poll). The launcher keeps the state, so a long run's polls cost
    the same each; ``decide_launcher`` is the same rules over a whole history."""
    if isinstance(event, Signal):
        return replace(state, pending=(*state.pending, event.signum)), LauncherDecision(
            LauncherAct.WAIT
        )
    if state.pending and state.passed:  # a signal after one passed on: no more waiting
        return state, LauncherDecision(LauncherAct.KILL_ALL)
    send = state.pending
    state = replace(state, pending=())
    if send:
        state = replace(state, passed=(*state.passed, *send), stop_at=event.at)
    first = state.passed[0] if state.passed else None
    running = tuple(r for r, c in event.codes if c is None)
    if not running:
        return state, LauncherDecision(LauncherAct.DONE, send)
    # Each worker ends itself at the deadline; one that cannot (stopped with
    # SIGSTOP, stuck in the kernel) is killed a little after it.
    if state.stop_at is not None and event.at - state.stop_at > stop_grace_s + GRACE_S:
        return state, LauncherDecision(LauncherAct.KILL_LATE, send, running)
    if state.failed_at is None and any(
        c is not None and not ended_by_stop(c, first) for _, c in event.codes
    ):
        state = replace(state, failed_at=event.at)
    if state.failed_at is not None and event.at - state.failed_at > GRACE_S:
        return state, LauncherDecision(LauncherAct.KILL_UNRESPONSIVE, send, running)
    return state, LauncherDecision(LauncherAct.WAIT, send)


def decide_launcher(events: list[Signal | Poll], stop_grace_s: float) -> LauncherDecision:
    """What the launcher does at the last of ``events``: the stop signals its handler
    recorded and its polls of the workers, oldest first."""
    state, decision = LauncherState(), LauncherDecision(LauncherAct.WAIT)
    for event in events:
        state, decision = launcher_step(state, event, stop_grace_s)
    return decision
