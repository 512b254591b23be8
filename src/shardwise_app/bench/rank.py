"""``python -m shardwise_app.bench.rank TASK RESULT``: one rank of a benchmark job.

Started by the one local launcher (shardwise_plan/ranks.py) for ``jobs.run_job``
and ``jobs.hook_overhead_us``, with torchrun's environment. ``TASK`` is the
pickled task; the first result a rank delivers (rank 0's, or a failing rank's
error) is pickled to ``RESULT``, written whole under another name and renamed,
so that the launcher never reads half of it.
"""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path
from typing import Any


class _ResultFile:
    """What a rank ``put``s, as the parent's queue took it before: the first one stays."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def put(self, item: Any) -> None:
        if self.path.exists():
            return
        part = self.path.with_name(f"{self.path.name}.{os.environ.get('RANK', '0')}")
        part.write_bytes(pickle.dumps(item))
        os.replace(part, self.path)


def main(argv: list[str]) -> None:
    task, result = Path(argv[0]), _ResultFile(Path(argv[1]))
    kind, *args = pickle.loads(task.read_bytes())
    from . import jobs

    if kind == "job":
        (job,) = args
        jobs.job_rank(job, result)
    else:
        n_modules, steps = args
        jobs.overhead_rank(n_modules, steps, result)


if __name__ == "__main__":
    from ..cli.worker import end

    # Delivered, end without interpreter finalization, whose race with gloo's
    # threads can abort a finished worker (cli/worker.py's ``end`` says how).
    try:
        main(sys.argv[1:])
    except BaseException as e:  # noqa: BLE001 - said, then the exit code tells
        print(f"shardwise bench: a rank failed to start: {type(e).__name__}: {e}", file=sys.stderr)
        end(1)
    end(0)
