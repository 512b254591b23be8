"""The stop rules (cli/stop_rules.py) as tables: a worker's (and its launcher's) events ->
what it does.

No process, no signal, no clock: each row is a history of events, and the
action the last one gets. tests/app/test_cli_stop.py checks the same rules on
real processes; these rows name every case one by one, quickly.
"""

from __future__ import annotations

import ast
import signal
from pathlib import Path

import pytest

from shardwise_app.cli.stop_rules import (
    EXIT_STOP_OVERDUE,
    GRACE_S,
    SAME_STOP_S,
    Act,
    LauncherAct,
    Phase,
    Poll,
    Signal,
    Source,
    decide,
    decide_launcher,
    stopped_by,
)

TERM, INT, HUP = int(signal.SIGTERM), int(signal.SIGINT), int(signal.SIGHUP)
ARMED, PIPED, STOPPABLE, JOINED = Phase.ARMED, Phase.ARMED_PIPED, Phase.STOPPABLE, Phase.JOINED
OURS = [PIPED, STOPPABLE, JOINED]  # a training worker our launcher started, joined
TORCHRUN = [STOPPABLE, JOINED]  # the same under torchrun: no entry of ours, no pipe
SOON, LATER = SAME_STOP_S / 4, SAME_STOP_S + 0.5


def direct(signum: int, at: float = 0.0) -> Signal:
    return Signal(signum, at, Source.DIRECT)


def piped(signum: int, at: float = 0.0) -> Signal:
    return Signal(signum, at, Source.PASSED_ON)


def orphaned(at: float = 0.0) -> Signal:
    return Signal(TERM, at, Source.ORPHANED)


STOP, NOTHING, EXIT = Act.STOP_AT_BOUNDARY, Act.NOTHING, Act.EXIT_AT_ONCE

TABLE = [
    # Still starting: any stop ends the worker at once (rule 1).
    ("starting, a signal", [PIPED, direct(INT)], EXIT, INT),
    ("starting, the launcher's copy", [PIPED, piped(TERM)], EXIT, TERM),
    ("starting, the launcher gone", [PIPED, orphaned()], EXIT, TERM),
    ("stoppable but not joined yet", [PIPED, STOPPABLE, direct(TERM)], EXIT, TERM),
    ("sample/export: joined, never stoppable", [PIPED, JOINED, direct(TERM)], EXIT, TERM),
    ("sample/export: the launcher gone", [PIPED, JOINED, orphaned()], EXIT, TERM),
    # Torchrun's worker: a stop request from its StopRequest on, even before joining.
    ("torchrun, stoppable, not joined", [STOPPABLE, direct(TERM)], STOP, TERM),
    # The first stop: at the next step boundary (rule 2).
    ("joined, a signal", [*OURS, direct(TERM)], STOP, TERM),
    ("joined, the launcher's copy", [*OURS, piped(INT)], STOP, INT),
    ("joined, the launcher gone", [*OURS, orphaned()], STOP, TERM),
    ("torchrun, a signal", [*TORCHRUN, direct(HUP)], STOP, HUP),
    # The same stop again: nothing more (rules 3 and 4).
    ("the launcher's copy after the direct one", [*OURS, direct(INT), piped(INT, SOON)], NOTHING, None),
    ("the direct copy after the launcher's", [*OURS, piped(INT), direct(INT, SOON)], NOTHING, None),
    ("the launcher gone after a stop", [*OURS, direct(TERM), orphaned(LATER)], NOTHING, None),
    ("the launcher's copy, late", [*OURS, direct(TERM), piped(TERM, LATER)], NOTHING, None),
    ("torchrun repeats the signal", [*TORCHRUN, direct(TERM), direct(TERM, SOON)], NOTHING, None),
    ("torchrun gone after a stop", [*TORCHRUN, direct(TERM), orphaned(SOON)], NOTHING, None),
    # A second stop: at once (rule 5).
    ("two direct signals, piped", [*OURS, direct(TERM), direct(TERM, SOON)], EXIT, TERM),
    ("after the pipe's copy and its echo", [*OURS, piped(INT), direct(INT, SOON), direct(INT, SOON)], EXIT, INT),
    ("the echo, too late", [*OURS, piped(INT), direct(INT, LATER)], EXIT, INT),
    ("another signal than the one passed on", [*OURS, piped(INT), direct(TERM, SOON)], EXIT, TERM),
    ("torchrun, the same signal later", [*TORCHRUN, direct(TERM), direct(TERM, LATER)], EXIT, TERM),
    ("torchrun, another signal", [*TORCHRUN, direct(TERM), direct(INT, SOON)], EXIT, INT),
    ("after the launcher is gone, a signal", [*OURS, orphaned(), direct(INT, SOON)], EXIT, INT),
    ("orphaned under torchrun, then its SIGTERM", [*TORCHRUN, orphaned(), direct(TERM, SOON)], NOTHING, None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("events", "act", "signum"), [row[1:] for row in TABLE], ids=[row[0] for row in TABLE]
)
def test_each_history_gets_its_action(events, act, signum) -> None:  # fmt: skip
    decision = decide(events)
    assert decision.act is act
    assert decision.signum == signum
    if act is EXIT:
        assert decision.exit_code == 128 + signum


def test_phases_alone_do_nothing() -> None:
    for events in ([], [PIPED], OURS, TORCHRUN, [ARMED, JOINED]):
        assert decide(events).act is NOTHING


def test_what_the_deadline_line_names() -> None:
    assert stopped_by([*OURS, direct(INT)]) == (INT, False)
    assert stopped_by([*OURS, orphaned()]) == (TERM, True)
    # Gone after the stop: the line says the launcher is gone, the signal stays the first.
    assert stopped_by([*OURS, direct(INT), orphaned(LATER)]) == (INT, True)
    # A peer ended at its deadline before any signal here: SIGTERM, as documented.
    assert stopped_by(OURS) == (TERM, False)


def test_a_decision_reads_only_its_events() -> None:
    """The same history twice, the same answer: nothing kept between calls."""
    events = [*OURS, piped(INT), direct(INT, SOON)]
    assert decide(events) == decide(list(events))
    assert decide(events[:-1]).act is STOP


# ---- one module installs signal handlers ---------------------------------------------------

SRC = Path(__file__).resolve().parents[2] / "src"
INSTALLS = {"signal", "set_wakeup_fd", "pthread_sigmask", "siginterrupt"}


def test_only_signals_py_installs_signal_handlers() -> None:
    """``signal.signal`` and its kin appear in cli/signals.py alone, in the application
    and in the planner: one place says what every process does with a signal."""
    found = []
    files = sorted(
        [*(SRC / "shardwise_app").rglob("*.py"), *(SRC / "shardwise_plan").rglob("*.py")]
    )
    assert len(files) > 20, files
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in INSTALLS
                and isinstance(node.value, ast.Name)
                and node.value.id == "signal"
            ):
                found.append(str(path.relative_to(SRC)))
    assert found and set(found) == {"shardwise_app/cli/signals.py"}, found


# ---- the launcher's side (stop_rules.decide_launcher) --------------------------------------


L_GRACE = 3.0  # --stop-grace
RUN = None


def poll(at: float, *codes: int | None) -> Poll:
    return Poll(at, tuple(enumerate(codes)))


W, D = LauncherAct.WAIT, LauncherAct.DONE
KILL_ALL, LATE, UNRESPONSIVE = (
    LauncherAct.KILL_ALL,
    LauncherAct.KILL_LATE,
    LauncherAct.KILL_UNRESPONSIVE,
)
PAST_GRACE = L_GRACE + GRACE_S + 0.1

LAUNCHER_TABLE = [
    ("running", [poll(0, RUN, RUN)], W, (), ()),
    ("every worker ended well", [poll(0, RUN, RUN), poll(1, 0, 0)], D, (), ()),
    ("the first signal is passed on", [poll(0, RUN, RUN), direct(INT, 0.5), poll(1, RUN, RUN)], W, (INT,), ()),
    ("passed on once only", [direct(INT), poll(0, RUN, RUN), poll(1, RUN, RUN)], W, (), ()),
    ("two signals before one poll: both passed on", [direct(INT), direct(TERM), poll(0, RUN, RUN)], W, (INT, TERM), ()),
    ("a signal after one passed on", [direct(INT), poll(0, RUN, RUN), direct(INT, 1), poll(1, RUN, RUN)], KILL_ALL, (), ()),
    ("stopped and saved", [direct(TERM), poll(0, RUN, RUN), poll(2, 0, 0)], D, (), ()),
    ("a worker still starting ended on the signal: no failure",
     [direct(TERM), poll(0, RUN, RUN), poll(1, 128 + TERM, RUN), poll(1 + GRACE_S + 1, 128 + TERM, RUN)], W, (), ()),
    ("ended at its deadline: no failure",
     [direct(TERM), poll(0, RUN, RUN), poll(1, EXIT_STOP_OVERDUE, RUN), poll(1 + GRACE_S + 1, EXIT_STOP_OVERDUE, RUN)], W, (), ()),
    ("still running well past --stop-grace", [direct(TERM), poll(0, RUN, RUN), poll(PAST_GRACE, 0, RUN)], LATE, (), (1,)),
    ("not yet past it", [direct(TERM), poll(0, RUN, RUN), poll(PAST_GRACE - 0.2, 0, RUN)], W, (), ()),
    ("a failure: the others get the grace", [poll(0, RUN, RUN), poll(1, -9, RUN), poll(1 + GRACE_S - 0.1, -9, RUN)], W, (), ()),
    ("a failure: then the rest are killed", [poll(0, RUN, RUN), poll(1, -9, RUN), poll(1 + GRACE_S + 0.1, -9, RUN)], UNRESPONSIVE, (), (1,)),
    ("a failure and the rest ended", [poll(0, RUN, RUN), poll(1, -9, RUN), poll(2, -9, 1)], D, (), ()),
    ("a worker killed by another signal than the stop's is a failure",
     [direct(INT), poll(0, RUN, RUN), poll(1, -TERM, RUN), poll(1 + GRACE_S + 0.1, -TERM, RUN)], UNRESPONSIVE, (), (1,)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("events", "act", "pass_on", "killed"),
    [row[1:] for row in LAUNCHER_TABLE],
    ids=[row[0] for row in LAUNCHER_TABLE],
)
def test_the_launcher_does_what_each_history_calls_for(events, act, pass_on, killed) -> None:
    decision = decide_launcher(events, L_GRACE)
    assert (decision.act, decision.pass_on, decision.ranks) == (act, pass_on, killed)
