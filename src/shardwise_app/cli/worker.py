"""What a worker process does to itself: signals before torch, output that may go, its end.

The launcher passes Ctrl-C, SIGTERM and SIGHUP on to its workers at once,
often while they are still importing torch or waiting for each other in
``init_process_group``. Python's default handler would raise
KeyboardInterrupt inside that import (a long traceback per worker), and a
worker that dies there leaves the others waiting for it, for good.

So a worker runs ``python -m shardwise_app.cli`` (the package's
``__main__.py``; not ``-m shardwise``, whose package import pulls torch in
before any of our code runs: the application's packages import nothing on
import), which calls ``exit_on_first_signal`` first: until the worker has
joined its process group the first such signal ends it at once, quietly.
Nothing is lost: a worker writes nothing before it has joined. A helper
thread does the exiting, woken through ``signal.set_wakeup_fd``, because a
Python signal handler cannot run while the main thread is blocked inside
torch's C++ rendezvous (signals.py). Once joined, the same thread makes a
training worker stop at a step boundary instead, within ``--stop-grace``.
"""

import os
import sys
from collections.abc import Callable

from .signals import arm


def exit_on_first_signal() -> None:
    """Until the worker has joined its process group, the first stop signal ends it."""
    arm()


class _OutputOrNothing:
    """``sys.stdout`` that turns quiet once its reader is gone (``| head -1``, a
    dead ssh or tee): a progress line must not end the training it reports on."""

    def __init__(self, stream: object) -> None:
        self._stream = stream
        self._gone = False

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                return self._stream.write(text)  # type: ignore[attr-defined, no-any-return]
            except BrokenPipeError:
                self._gone = True
        return len(text)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()  # type: ignore[attr-defined]
            except BrokenPipeError:
                self._gone = True

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


def keep_going_without_stdout() -> None:
    """Once for a process running a command: its output may vanish, it goes on."""
    if not isinstance(sys.stdout, _OutputOrNothing):
        sys.stdout = _OutputOrNothing(sys.stdout)  # type: ignore[assignment]


def end(code: int | str | None) -> None:
    """End a worker whose command returned: output flushed, then ``os._exit``.

    Why not a normal exit: interpreter finalization races gloo's worker
    threads. A thread that finished the last collective may still be
    releasing its tensors, which needs the GIL; once finalization has begun,
    Python ends such a thread with ``pthread_exit``, and C++ turns that into
    ``std::terminate``: "terminate called without an active exception", exit
    -6, after a run that succeeded (seen in CI; a core dump showed the stack,
    ``ProcessGroupGloo::AsyncWork::~AsyncWork`` in ``take_gil``). FSDP2's
    processes hit it too. By the time a command returns, its files are
    closed (and, unless it failed, its process group destroyed): only
    finalization is skipped.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    if code is None:
        code = 0
    elif not isinstance(code, int):  # SystemExit("message"): Python prints it, exit 1
        print(code, file=sys.stderr, flush=True)
        code = 1
    os._exit(code)


def run_to_end(main: Callable[[], int | None]) -> None:
    """Run a worker's command, then ``end`` with its status (a ``SystemExit``'s too:
    flags rank 0 refused under torchrun, process_group.py's ``from_rank0``)."""
    try:
        status: int | str | None = main()
    except SystemExit as e:
        status = e.code
    end(status)
