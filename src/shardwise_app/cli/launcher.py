"""Starting the workers of one node and watching them until they end: the launcher's side.

Our launcher starts one process per rank itself (the environment of
``torchrun``'s static rendezvous: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``
...), rather than through ``torch.distributed.run``, because what matters
when something goes wrong is decided here, in a loop that polls the workers
and the signals every tenth of a second:

- a stop signal (Ctrl-C, SIGTERM, SIGHUP) is passed on to every worker, which
  stops at its next step boundary and saves, or ends without saving when
  none comes within ``--stop-grace`` (signals.py); workers still running a
  few seconds past that (a stopped process) are killed; a second signal kills
  every worker at once (a save in progress is left as a ``.partial`` folder,
  removed at the next start);
- when a worker fails, the others get a few seconds to notice and end on
  their own; any still running then is killed (a stopped or hung process
  never ends by itself), and is the one that stopped responding;
- with restarts left, a failure that a restart can mend (a killed worker, a
  lost peer, a hang: not bad input, not a run that diverged or filled its
  disk) starts every worker again, after the command has prepared the resume.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .common import (
    EXIT_USAGE,
    LAUNCH_ID_ENV,
    Launch,
    UsageError,
    raise_if_interrupted,
    usable_cpus,
)
from .failures import EXIT_NO_RETRY, launcher_message, overdue_message, what_failed
from .signals import DEFAULT_STOP_GRACE_S, STOP_FD_ENV, LauncherSignals
from .stop_rules import (
    EXIT_STOP_OVERDUE,
    LauncherAct,
    LauncherState,
    Poll,
    ended_by_stop,
    launcher_step,
)
from .stop_rules import Signal as StopSignal

if TYPE_CHECKING:
    from shardwise_plan.ranks import LocalRanks

# The process group's timeout: a worker that waits this long for a peer in a
# collective gives up. The backends wait 10 (NCCL) or 30 (gloo) minutes.
DEFAULT_TIMEOUT_S = 300
TIMEOUT_ENV = "SHARDWISE_TIMEOUT_S"
_POLL_S = 0.1


def add_fault_arguments(p: Any) -> None:
    g = p.add_argument_group("faults")
    g.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="when a worker dies or hangs, restart every worker from the newest checkpoint, "
        "up to N times (default: 0; steps since the last --save-every checkpoint are redone)",
    )
    g.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help="end the job when a worker waits this long for another that does not answer "
        f"(default: {DEFAULT_TIMEOUT_S})",
    )
    g.add_argument(
        "--stop-grace",
        type=float,
        default=DEFAULT_STOP_GRACE_S,
        metavar="SECONDS",
        help="on Ctrl-C, SIGTERM or SIGHUP, end without saving when the workers have not "
        "reached a step boundary and saved within this time (default: "
        f"{DEFAULT_STOP_GRACE_S:g}, within a scheduler's usual 30 s grace period)",
    )


def check_fault_arguments(args: Any) -> None:
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts must be at least 0, got {args.max_restarts}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise UsageError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if not (math.isfinite(args.stop_grace) and args.stop_grace > 0):
        raise UsageError(
            f"--stop-grace must be a positive number of seconds, got {args.stop_grace}"
        )


def launch(
    command: str,
    worker_args: dict[str, Any],
    where: Launch,
    on_signal: Callable[[str, int], int],
    *,
    then: Callable[[], str] | None = None,
    max_restarts: int = 0,
    on_restart: Callable[[str], str] | None = None,
    stop_grace_s: float = DEFAULT_STOP_GRACE_S,
) -> int:
    """Run ``shardwise COMMAND --flag=value ...`` on every rank of this node; the exit code.

    The worker flags are passed as ``--flag=value``; a ``True`` value passes a
    bare switch, and ``False`` or ``None`` none.

    On Ctrl-C, SIGTERM or SIGHUP every worker gets the signal and the
    launcher waits for them; ``on_signal(launch_id, signum)`` then decides the
    exit code from what they left behind. Workers that did not stop within
    ``stop_grace_s`` end on their own (or are killed a little later): one
    line, exit code 128 + the signal. A second signal kills them.

    ``then()`` says what the user has and can do after a failure (a train
    run: the checkpoint to resume from). After a failure that a restart can
    mend, with restarts left, ``on_restart(what_failed)`` prepares the resume
    and gives the line to print; the workers then start again.
    """
    launch_id = uuid.uuid4().hex
    os.environ[LAUNCH_ID_ENV] = launch_id
    # Workers size their own thread pools; this is the default for anything else.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, usable_cpus() // where.nproc)))
    argv = [
        f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}")
        for k, v in worker_args.items()
        if v is not None and v is not False
    ]
    raise_if_interrupted()
    signals = LauncherSignals()
    try:
        for attempt in range(max_restarts + 1):
            workers = _Workers(command, argv, where, attempt)
            try:
                ended = workers.watch(signals, stop_grace_s)
            finally:
                workers.close()
            first = signals.received[0] if signals.received else None
            if ended.forced:
                name = signal.Signals(signals.received[-1]).name
                kept = f", this stop saved nothing; {then()}" if then else ""
                print(
                    f"shardwise {command}: stopped at once by a second {name}: every worker was "
                    f"killed{kept}",
                    file=sys.stderr,
                    flush=True,
                )
                return 128 + signals.received[-1]
            if first is not None and ended.overdue:
                name = signal.Signals(first).name
                kept = then() if then else f"run shardwise {command} again"
                line = overdue_message(command, f"stopped by {name}", stop_grace_s, kept)
                print(line, file=sys.stderr, flush=True)
                return 128 + first
            if first is not None and not ended.failed_beyond(first):
                return on_signal(launch_id, first)
            if not ended.failed:
                return 0
            codes = ended.codes
            # A worker someone asked to stop (EXIT_STOP_OVERDUE) is not a fault to mend.
            restartable = not {EXIT_USAGE, EXIT_NO_RETRY, EXIT_STOP_OVERDUE} & set(codes.values())
            if first is None and attempt < max_restarts and restartable and on_restart:
                what = what_failed(codes, ended.unresponsive)
                line = on_restart(what)
                print(f"{line} (restart {attempt + 1} of {max_restarts})", file=sys.stderr)
                continue
            message = launcher_message(command, codes, ended.unresponsive, then() if then else None)
            if message:
                print(message, file=sys.stderr, flush=True)
            if first is not None:
                return on_signal(launch_id, first)
            return EXIT_USAGE if EXIT_USAGE in codes.values() else 1
        raise AssertionError("unreachable: the last attempt returns")
    finally:
        signals.restore()


class _Ended:
    def __init__(
        self,
        codes: dict[int, int],
        unresponsive: list[int],
        forced: bool = False,
        late: bool = False,
    ) -> None:
        self.codes = codes  # rank -> exit code (negative: killed by that signal)
        self.unresponsive = unresponsive  # ranks still running after a failure, killed by us
        self.forced = forced  # killed by us on a second stop signal
        self.late = late  # killed by us, still running well past --stop-grace

    @property
    def overdue(self) -> bool:
        """A stop that ran out of time: a worker ended at its deadline, none for another
        reason (a kill by a signal other than ours: that is the story to tell)."""
        if self.late:
            return True
        codes = set(self.codes.values())
        return EXIT_STOP_OVERDUE in codes and all(c >= 0 for c in codes)

    @property
    def failed(self) -> bool:
        return any(c != 0 for c in self.codes.values()) or bool(self.unresponsive)

    def failed_beyond(self, signum: int) -> bool:
        """Whether a worker failed otherwise than by stopping on ``signum``."""
        return bool(self.unresponsive) or any(
            not ended_by_stop(c, signum) for c in self.codes.values()
        )


class _Workers:
    """One start of this node's workers, as ``python -m shardwise_app.cli COMMAND``, through
    the one local launcher (shardwise_plan/ranks.py, which the planner and the benchmark
    use too).

    That entry module sets up signals before torch is imported (worker.py).
    Each worker shares the launcher's process group, so that a terminal's
    Ctrl-C reaches it directly, as it reaches the launcher.

    A stop signal is passed on through a pipe per worker, not as a signal:
    a worker that got the terminal's Ctrl-C (or a scheduler's SIGTERM sent
    to every process) would count our copy as a second signal, which ends it
    at once, unsaved. Through the pipe it is only ever a first request
    (signals.py). The pipe's end also tells the worker its launcher is gone.
    """

    def __init__(self, command: str, argv: list[str], where: Launch, attempt: int) -> None:
        # Here, not at the top: the planner's package imports torch and the library,
        # which a command checking its flags must not wait for.
        from shardwise_plan.ranks import LocalRanks

        node = where.node_rank or 0
        self._stop_pipes: dict[int, int] = {}  # rank -> the write end

        def per_rank(rank: int) -> tuple[dict[str, str], tuple[int, ...]]:
            read, self._stop_pipes[rank] = os.pipe()  # neither end inherited by others
            env = {
                "GROUP_RANK": str(node),
                "TORCHELASTIC_RESTART_COUNT": str(attempt),
                STOP_FD_ENV: str(read),
            }
            return env, (read,)  # the read end: the worker's alone once it started

        self.ranks: LocalRanks = LocalRanks(
            "shardwise_app.cli",
            [command, *argv],
            where.nproc,
            world=where.world,
            node_rank=node,
            endpoint=where.rdzv_endpoint,
            per_rank=per_rank,
        )
        self.procs = self.ranks.procs

    def watch(self, signals: LauncherSignals, stop_grace_s: float) -> _Ended:
        """Poll until every worker has ended, doing what the launcher's stop rules say
        (stop_rules.launcher_step) of the signals and the workers' exits."""
        state, seen = LauncherState(), 0
        while True:
            for sig in signals.received[seen:]:
                state, _ = launcher_step(state, StopSignal(sig, time.monotonic()), stop_grace_s)
            seen = len(signals.received)
            poll = Poll(time.monotonic(), tuple(self.ranks.poll().items()))
            state, decision = launcher_step(state, poll, stop_grace_s)
            for sig in decision.pass_on:
                self._send(sig)
            if decision.act is LauncherAct.KILL_ALL:
                self.ranks.kill(list(self.procs))
                return _Ended(self.ranks.codes(), [], forced=True)
            if decision.act is LauncherAct.DONE:
                return _Ended(self.ranks.codes(), [])
            if decision.act is LauncherAct.KILL_LATE:
                self.ranks.kill(list(decision.ranks))
                return _Ended(self.ranks.codes(), [], late=True)
            if decision.act is LauncherAct.KILL_UNRESPONSIVE:
                self.ranks.kill(list(decision.ranks))
                return _Ended(self.ranks.codes(), list(decision.ranks))
            time.sleep(_POLL_S)

    def _send(self, sig: int) -> None:
        for rank, pipe in self._stop_pipes.items():
            if self.procs[rank].poll() is None:
                try:
                    os.write(pipe, bytes([sig]))
                except OSError:  # it ended meanwhile
                    pass

    def close(self) -> None:
        """Close the pipes: a worker still running (ours never are) would see its launcher gone."""
        for pipe in self._stop_pipes.values():
            os.close(pipe)
        self._stop_pipes.clear()
