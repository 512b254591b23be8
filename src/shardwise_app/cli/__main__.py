"""``python -m shardwise_app.cli COMMAND ...``: the entry of every worker our launcher starts.

Signals first, before anything heavy is imported (worker.py says why), then
the command line as the console runs it, ended without interpreter
finalization (worker.py's ``end``).
"""

import os
import sys

from .worker import exit_on_first_signal, keep_going_without_stdout, run_to_end

if __name__ == "__main__":
    exit_on_first_signal()
    keep_going_without_stdout()
    # ``python -m`` put the working directory first on sys.path, where the
    # console script that launched us has none: a file there (a torch.py)
    # must not shadow what the worker imports.
    if not getattr(sys.flags, "safe_path", False) and sys.path[0] == os.getcwd():
        del sys.path[0]

    from .main import main

    run_to_end(main)
