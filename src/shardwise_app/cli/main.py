"""``shardwise``: the console entry, and the table of its subcommands.

Each subcommand module has ``main(argv) -> int``. What they share (the
bad-input error: one line on stderr, exit code 2; where workers run) is in
``common.py``; the launcher that starts and watches the workers is
``launcher.py``, joining the process group inside one ``process_group.py``.
Workers our launcher starts enter through ``__main__.py``, which runs
``main`` here as the console does.
"""

from __future__ import annotations

import importlib
import sys
import threading

from ..extras import CLI, CLI_INSTALL, first_missing
from .common import EXIT_USAGE, UsageError, in_worker
from .signals import interrupt_on_ctrl_c
from .worker import keep_going_without_stdout, run_to_end

COMMANDS = {
    "train": (
        "shardwise_app.cli.train",
        "train a small GPT, or fine-tune a transformers model (--hf), fully sharded",
    ),
    "sample": ("shardwise_app.cli.sample", "print a continuation from a trained checkpoint"),
    "export": (
        "shardwise_app.cli.export",
        "write a fine-tuned run (--hf) as a folder transformers loads",
    ),
    "bench": ("shardwise_app.bench.command", "measure throughput and memory"),
    "plan": (
        "shardwise_app.cli.plan",
        "predict per-rank memory and step time at any world size (--measure: and check it)",
    ),
    "calibrate": (
        "shardwise_app.cli.plan_rates",
        "measure this machine's rates for shardwise plan --rates FILE",
    ),
}


def main(argv: list[str] | None = None) -> int:
    # Ctrl-C while Python imports torch (the first seconds) raises
    # KeyboardInterrupt inside that import: one line, not its traceback.
    # Nothing is written before the run folder's lock is taken, and a folder
    # holding only the lock is reused as new.
    if not in_worker() and threading.current_thread() is threading.main_thread():
        interrupt_on_ctrl_c()
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("shardwise: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    if argv is None:  # the console script: a process of its own
        keep_going_without_stdout()
    missing = first_missing(CLI)
    if missing is not None:
        print(
            f"shardwise: the command line needs {' and '.join(CLI)} ({missing} is not "
            f"installed): {CLI_INSTALL}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else EXIT_USAGE
    if argv[0] == "--version":
        from shardwise import __version__

        print(f"shardwise {__version__}")
        return 0
    command = argv[0]
    if command not in COMMANDS:
        print(
            f"shardwise: error: unknown command {command!r}; choose from {', '.join(COMMANDS)}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        module = importlib.import_module(COMMANDS[command][0])
        return int(module.main(argv[1:]) or 0)
    except UsageError as e:
        print(f"shardwise {command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        # Ctrl-C before workers start, or in a one-process command.
        print(f"shardwise {command}: interrupted", file=sys.stderr)
        return 130


def _usage() -> str:
    lines = [f"usage: shardwise {{{','.join(COMMANDS)}}} ...", "", "commands:"]
    lines += [f"  {name:<11}{help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'shardwise COMMAND --help' for a command's flags."]
    return "\n".join(lines)


def run_as_module() -> None:
    """``python -m shardwise``: the console script, or one rank under torchrun
    (``torchrun ... -m shardwise train``), which ends as the workers our own
    launcher starts do (worker.py's ``end``)."""
    keep_going_without_stdout()
    if not in_worker():
        sys.exit(main())
    run_to_end(main)


if __name__ == "__main__":
    sys.exit(main())
