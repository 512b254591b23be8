"""How a worker stops: at a step boundary when asked, and within a bound whatever it is doing.

One thread per worker acts on Ctrl-C, SIGTERM and SIGHUP, not a Python
signal handler: Python runs handlers on the main thread between two
bytecodes, and a worker's main thread may be inside one long C++ call for
minutes (a huge matmul, a gloo or NCCL collective a peer never joins, a
save). ``signal.set_wakeup_fd`` makes the interpreter's C-level handler,
which runs on whichever thread the kernel picks, write each signal's number
to a socket this thread reads; the Python-level handlers do nothing.

What the thread does with a signal depends on where the worker is:

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
from typing import IO

# A closed terminal or SSH session sends SIGHUP; a scheduler sends SIGTERM.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Fits within the 30 s both Kubernetes (terminationGracePeriodSeconds) and
# SLURM (KillWait) give between their SIGTERM and SIGKILL, with 5 s left for
# the launcher to see its workers end and say so.
DEFAULT_STOP_GRACE_S = 25.0
EXIT_STOP_OVERDUE = 7  # a worker asked to stop found no step boundary within --stop-grace
# The read end of a pipe from our launcher: each byte a stop signal passed on;
# its end, the launcher's (launcher.py says why not a signal).
STOP_FD_ENV = "SHARDWISE_STOP_FD"
# Without our launcher's pipe, the same signal again this soon is the same
# stop: torchrun passes its SIGTERM on as a signal, and a scheduler that
# signals every process of a job (SLURM) has already sent the worker its own.
_SAME_STOP_S = 2.0
# Past the grace deadline, if even the deadline's thread cannot run (a C
# extension holding the GIL): faulthandler's own C thread ends the process.
_LAST_RESORT_S = 5.0

# (signal, whether the launcher is gone) -> the line a worker with no launcher
# of ours left says at the deadline, or None for silence.
Say = Callable[[int, bool], str | None]


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


def joined() -> None:
    """The worker joined its process group: a training worker now stops at step boundaries."""
    _guard.joined()


def end_at_once() -> None:
    """For workers that do not stop at step boundaries (sample, export): each stop signal
    takes its default action, and the worker ends at once when its launcher is gone."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    _watch_parent(lambda: os.kill(os.getpid(), signal.SIGTERM))


def stop_when_orphaned() -> None:
    """Stop as on SIGTERM once the process that started us is gone (see ``_watch_parent``)."""
    _watch_parent(lambda: _guard.signalled(signal.SIGTERM, orphaned=True))


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
    """The process's one signal thread, and what it does with each signal."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pair: tuple[socket.socket, socket.socket] | None = None  # open for life
        self._stop: StopRequest | None = None
        self._at_boundary = False
        self._grace_s = DEFAULT_STOP_GRACE_S
        self._say: Say | None = None
        self._first: int | None = None
        self._first_at = 0.0
        self._piped = False  # our launcher passes its signals on through a pipe
        # The first stop came through that pipe, and whether the same signal has since
        # come directly too (a terminal's Ctrl-C, a scheduler's SIGTERM reach every
        # process): that one direct copy is the same stop, whichever arrived first.
        self._first_passed_on = False
        self._echo_seen = False
        self._orphaned = False
        self._devnull: IO[str] | None = None

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
        if fd is not None:
            self._piped = True
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
                    self.signalled(signal.SIGTERM, orphaned=True)
                    return
                self.signalled(got[0], passed_on=True)

        threading.Thread(target=read, name="shardwise-launcher", daemon=True).start()

    def stop_at_boundary(self, stop: StopRequest, grace_s: float, say: Say | None) -> None:
        with self._lock:
            self._stop, self._grace_s, self._say = stop, grace_s, say
            if self._pair is None:
                # Not started by our entry module (torchrun): from now on a
                # signal is a stop request, also while the group is joined.
                self._at_boundary = True
        self.arm()

    def joined(self) -> None:
        with self._lock:
            self._at_boundary = self._stop is not None

    def signalled(self, signum: int, orphaned: bool = False, passed_on: bool = False) -> None:
        """A stop signal: sent to this process, ``passed_on`` by our launcher (which passes
        on only its first), or SIGTERM for a launcher that is gone (``orphaned``)."""
        with self._lock:
            if not self._at_boundary:
                os._exit(128 + signum)
            if self._first is not None:
                if orphaned or passed_on:  # the same stop again: the deadline already runs
                    self._orphaned = self._orphaned or orphaned
                    return
                again = time.monotonic() - self._first_at < _SAME_STOP_S
                if signum == self._first and again and not self._piped:
                    return  # another launcher's copy of the first
                if signum == self._first and again and self._first_passed_on:
                    if not self._echo_seen:
                        self._echo_seen = True
                        return  # the direct copy of the stop our launcher passed on
                os._exit(128 + signum)  # a second signal: no more waiting
            self._first, self._first_at, self._orphaned = signum, time.monotonic(), orphaned
            self._first_passed_on = passed_on
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
        """The grace period is over (or a peer ended on its own): say so if ours to say, end."""
        with self._lock:
            signum, orphaned = self._first or signal.SIGTERM, self._orphaned
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
