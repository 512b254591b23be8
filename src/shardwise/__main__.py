"""``python -m shardwise``: the same as the ``shardwise`` console script."""

import sys

from shardwise.cli.main import in_worker, main
from shardwise.cli.worker import keep_going_without_stdout

if __name__ == "__main__":
    keep_going_without_stdout()
    if not in_worker():
        sys.exit(main())
    # One rank under torchrun (``torchrun ... -m shardwise train``): ends as the
    # workers our own launcher starts do (cli/worker.py's ``end``).
    from shardwise.cli.worker import run_to_end

    run_to_end(main)
