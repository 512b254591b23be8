"""How a worker stops: on a signal at a step boundary, and when its launcher is gone."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

# A closed terminal or SSH session sends SIGHUP; a scheduler sends SIGTERM.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def joined() -> None:
    """The worker joined its process group: stop exiting on the first signal (cli/worker.py)."""
    signal.set_wakeup_fd(-1)


class StopRequest:
    """Ctrl-C, SIGTERM and SIGHUP only raise a flag; the loop stops at the next step boundary."""

    def __init__(self) -> None:
        self.signum: int | None = None
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum


def restore_default_signals() -> None:
    """For workers that do not stop at step boundaries (sample): plain signal behaviour again."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


def stop_when_orphaned(poll_s: float = 0.5) -> None:
    """Send ourselves SIGTERM once the process that started us is gone.

    A launcher killed with SIGKILL (the OOM killer, a scheduler) cannot pass
    anything on; its workers would train on, unsupervised, holding their GPUs
    until the end. The parent's death shows as a new parent pid (init or a
    subreaper). SIGTERM then stops the worker as any stop does: at the next
    step boundary, with a checkpoint. Polling works on every POSIX system,
    unlike Linux's parent-death signal, which is also tied to the thread that
    started the child.
    """
    parent = os.getppid()
    if parent <= 1:
        return  # started by init itself: there is no launcher to lose

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="shardwise-launcher-watch", daemon=True).start()
