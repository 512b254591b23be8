"""How a worker stops: at a step boundary when asked, and within a bound whatever it is doing.

One thread per worker acts on Ctrl-C, SIGTERM and SIGHUP, not a Python
signal handler: Python runs handlers on the main thread between two
bytecodes, and a worker's main thread may be inside one long C++ call for
minutes (a huge matmul, a gloo or NCCL collective a peer never joins, a
save). ``signal.set_wakeup_fd`` makes the interpreter's C-level handler,
which runs on whichever thread the kernel picks, write each signal's number
to a socket this thread reads; the Python-level handlers do nothing.

This is the one module of the application that installs signal handlers
(tests/app/test_stop_rules.py checks it): the workers' thread here, the
launcher's recorder (``LauncherSignals``) and the console's Ctrl-C while it
imports (``interrupt_on_ctrl_c``). What the thread does with a signal is
decided by ``stop_rules.decide`` from the events so far, without a clock or a
process of its own; in short, it depends on where the worker is:

- Starting (importing torch, joining the process group): the first signal
  ends it at once, quietly (cli/worker.py says why). Nothing is written before.
- Training, once joined (``StopRequest``): the first signal raises the flag
  the loop reads at the next step boundary, where every rank stops and saves;
  and it starts the grace deadline (``--stop-grace``). A worker still running
  at the deadline ends anyway, exit code ``EXIT_STOP_OVERDUE``; a save cut
  short is left as ``step_N.partial`` (removed at the next start), so the
  newest complete checkpoint stays the one ``--resume`` picks. A second
  signal ends the worker at once, exit code 128 + the signal.
- ``sample`` and ``export`` (``end_at_once``): nothing to save, so the
  signals' default actions, which the kernel carries out without Python.

Our launcher passes its first stop signal on through a pipe, which the
thread also reads: that copy is never a second signal, though the worker
mostly got the same one directly (a terminal's Ctrl-C, a scheduler's SIGTERM
to every process). A worker whose launcher is gone (killed with SIGKILL: the
OOM killer, a scheduler's grace period over) acts as on SIGTERM, and so ends
within the grace period too: our launcher's pipe ends at once; any other
(torchrun) is found gone by polling the parent pid.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import IO, Any

from .common import interrupt
from .stop_rules import EXIT_STOP_OVERDUE, Act, Event, Phase, Source, decide, stopped_by
from .stop_rules import Signal as StopSignal

# A closed terminal or SSH session sends SIGHUP; a scheduler sends SIGTERM.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Fits within the 30 s both Kubernetes (terminationGracePeriodSeconds) and
# SLURM (KillWait) give between their SIGTERM and SIGKILL, with 5 s left for
# the launcher to see its workers end and say so.
DEFAULT_STOP_GRACE_S = 25.0
# The read end of a pipe from our launcher: each byte a stop signal passed on;
# its end, the launcher's (launcher.py says why not a signal).
STOP_FD_ENV = "SHARDWISE_STOP_FD"
# Past the grace deadline, if even the deadline's thread cannot run (a C
# extension holding the GIL): faulthandler's own C thread ends the process.
_LAST_RESORT_S = 5.0

# (signal, whether the launcher is gone) -> the line a worker with no launcher
# of ours left says at the deadline, or None for silence.
Say = Callable[[int, bool], str | None]


# A folder where each worker announces each phase it reaches (``announce``): for a
# supervisor, or a test, to wait for instead of guessing from the process table.
READY_DIR_ENV = "SHARDWISE_READY_DIR"


def announce(phase: str) -> None:
    """Say that this worker reached ``phase``: the file ``rank{RANK}.{phase}`` in the folder
    ``SHARDWISE_READY_DIR`` names (if set), holding this process's pid.

    Phases: ``armed`` (our entry module took the stop signals over: the first ends
    the worker at once), ``joined`` (the process group is joined: a training worker
    stops at step boundaries from now on, ``sample`` and ``export`` at once).

    Written under a temporary name and renamed, so a reader never sees half of it.
    A folder that cannot be written is the watcher's problem, not the run's: the
    worker goes on without saying it.
    """
    folder = os.environ.get(READY_DIR_ENV)
    if not folder:
        return
    path = os.path.join(folder, f"rank{os.environ.get('RANK', '0')}.{phase}")
    try:
        with open(path + ".tmp", "w") as f:
            f.write(f"{os.getpid()}\n")
        os.replace(path + ".tmp", path)
    except OSError:
        pass


class StopRequest:
    """The flag the training loop reads at each step boundary; set by the guard's thread.

    ``signum``: the first stop signal (SIGTERM when the launcher is gone), or None.
    """

    def __init__(self, grace_s: float = DEFAULT_STOP_GRACE_S, say: Say | None = None) -> None:
        self.signum: int | None = None
        _guard.stop_at_boundary(self, grace_s, say)

    def overdue(self) -> None:
        """End now as at the grace deadline: a peer already did (its connection broke)."""
        _guard.overdue()


def arm() -> None:
    """From the first lines of a worker our launcher starts: the first signal ends it."""
    _guard.arm()
    announce("armed")


def joined() -> None:
    """The worker joined its process group: a training worker now stops at step boundaries."""
    _guard.joined()
    announce("joined")


def end_at_once() -> None:
    """For workers that do not stop at step boundaries (sample, export): each stop signal
    takes its default action, and the worker ends at once when its launcher is gone."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    _watch_parent(lambda: os.kill(os.getpid(), signal.SIGTERM))


def interrupt_on_ctrl_c() -> None:
    """The console, from its first line: Ctrl-C raises KeyboardInterrupt (remembered,
    since an import may swallow it: ``common.raise_if_interrupted``)."""
    signal.signal(signal.SIGINT, interrupt)


class LauncherSignals:
    """The launcher's stop signals, recorded by the handler and acted on by its polling
    loop (launcher.py); ``restore`` puts the handlers from before back."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._before = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    def _handle(self, signum: int, frame: Any) -> None:
        self.received.append(signum)

    def restore(self) -> None:
        for sig, handler in self._before.items():
            signal.signal(sig, handler)


def stop_when_orphaned() -> None:
    """Stop as on SIGTERM once the process that started us is gone (see ``_watch_parent``)."""
    _watch_parent(lambda: _guard.signalled(signal.SIGTERM, Source.ORPHANED))


def _watch_parent(then: Callable[[], None], poll_s: float = 0.5) -> None:
    """Call ``then`` once our parent process is gone.

    A launcher killed with SIGKILL cannot pass anything on; its workers would
    run on, unsupervised, holding their GPUs. The parent's death shows as a
    new parent pid (init or a subreaper). Polling works on every POSIX
    system, unlike Linux's parent-death signal, which is also tied to the
    thread that started the child.
    """
    parent = os.getppid()
    if parent <= 1:
        return  # started by init itself: there is no launcher to lose

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        then()

    threading.Thread(target=watch, name="shardwise-launcher-watch", daemon=True).start()


class _Guard:
    """The process's one signal thread: records each event, does what ``decide`` says."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pair: tuple[socket.socket, socket.socket] | None = None  # open for life
        self._stop: StopRequest | None = None
        self._grace_s = DEFAULT_STOP_GRACE_S
        self._say: Say | None = None
        self._events: list[Event] = []  # a handful: phases and the stops of one run
        self._devnull: IO[str] | None = None
        self._ending = False  # overdue() is saying its line and ending the process

    def arm(self) -> None:
        if self._pair is not None:
            return
        reader, writer = self._pair = socket.socketpair()
        writer.setblocking(False)
        for sig in STOP_SIGNALS:
            signal.signal(sig, lambda signum, frame: None)  # the thread below acts
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)

        def read() -> None:
            while True:
                got = reader.recv(1)
                if not got:  # the process is ending anyway
                    return
                self.signalled(got[0])

        threading.Thread(target=read, name="shardwise-signals", daemon=True).start()
        fd = os.environ.pop(STOP_FD_ENV, None)
        with self._lock:
            self._events.append(Phase.ARMED if fd is None else Phase.ARMED_PIPED)
        if fd is not None:
            self._listen_to_launcher(int(fd))

    def _listen_to_launcher(self, fd: int) -> None:
        os.set_inheritable(fd, False)  # not for the processes this worker starts

        def read() -> None:
            while True:
                try:
                    got = os.read(fd, 1)
                except OSError:
                    got = b""
                if not got:  # the launcher is gone, whatever killed it
                    self.signalled(signal.SIGTERM, Source.ORPHANED)
                    return
                self.signalled(got[0], Source.PASSED_ON)

        threading.Thread(target=read, name="shardwise-launcher", daemon=True).start()

    def stop_at_boundary(self, stop: StopRequest, grace_s: float, say: Say | None) -> None:
        with self._lock:
            self._stop, self._grace_s, self._say = stop, grace_s, say
            self._events.append(Phase.STOPPABLE)
        self.arm()

    def joined(self) -> None:
        with self._lock:
            self._events.append(Phase.JOINED)

    def signalled(self, signum: int, source: Source = Source.DIRECT) -> None:
        """A stop signal: sent to this process, passed on by our launcher (which passes
        on only its first), or SIGTERM for a launcher that is gone (``ORPHANED``)."""
        with self._lock:
            self._events.append(StopSignal(signum, time.monotonic(), source))
            decision = decide(self._events)
            if decision.act is Act.EXIT_AT_ONCE:
                os._exit(decision.exit_code)
            if decision.act is Act.NOTHING:
                return
            assert self._stop is not None
            self._stop.signum = signum
            timer = threading.Timer(self._grace_s, self.overdue)
            timer.daemon = True
            timer.start()
            self._devnull = open(os.devnull, "w")  # noqa: SIM115 - open until the exit
            faulthandler.dump_traceback_later(
                self._grace_s + _LAST_RESORT_S, exit=True, file=self._devnull
            )

    def overdue(self) -> None:
        """The grace period is over (or a peer ended on its own): say so if ours to say, end.

        Once: the deadline's timer and the main thread (its collective broken by a peer
        that ended at its own deadline) can both get here; the second waits for the
        first's exit instead of saying the line again."""
        with self._lock:
            ending, self._ending = self._ending, True
            signum, orphaned = stopped_by(self._events)
        if ending:
            while True:
                time.sleep(3600)
        line = None
        if self._say is not None:
            try:
                line = self._say(signum, orphaned)
            except Exception as e:  # the exit matters more than the words
                line = f"shardwise: ending without saving ({type(e).__name__}: {e})"
        if line:
            # Not print(): the main thread may hold sys.stderr's lock, inside a write
            # to a full pipe; os.write needs no lock. Nobody may be reading any more.
            try:
                os.write(2, (line + "\n").encode())
            except OSError:
                pass
        os._exit(EXIT_STOP_OVERDUE)


_guard = _Guard()
