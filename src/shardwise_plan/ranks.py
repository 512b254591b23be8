"""Real ranks on this machine, for what a plan is checked and calibrated against.

Why a launcher of its own: a plan is checked against a real run (measure.py)
and a machine's rates are measured with every rank at once (calibrate.py),
each in processes of their own so that every measured peak starts clean.
Those ranks run ``python -m shardwise_plan.worker`` (worker.py) with
torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` ...); they
need no restarts or saves, only to end together: when one fails, the others
get a few seconds and are then killed.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

GRACE_S = 5.0  # after a rank fails, for the others to notice and end on their own
POLL_S = 0.05


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(argv: list[str], nproc: int) -> int:
    """``python -m shardwise_plan.worker ARGV`` as ``nproc`` ranks of one process group
    here; 0 if every rank succeeded, else the first failure's exit code (a rank
    killed by a signal: 128 + its number)."""
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if k != "SHARDWISE_LAUNCH_ID"}
    # Each rank sizes its own threads; this is the default for anything else.
    env.setdefault("OMP_NUM_THREADS", str(max(1, usable_cpus() // nproc)))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "shardwise_plan.worker", *argv],
            env={
                **env,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            },
        )
        for rank in range(nproc)
    ]
    try:
        return _watch(procs)
    finally:
        for p in procs:  # only these ranks, started above, if any is still running
            if p.poll() is None:
                p.kill()
                p.wait()


def _watch(procs: list[subprocess.Popen[bytes]]) -> int:
    failed_at: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        bad = [c for c in codes if c not in (None, 0)]
        if all(c is not None for c in codes):
            return _code(bad[0]) if bad else 0
        if bad and failed_at is None:
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
            return _code(bad[0])
        time.sleep(POLL_S)


def _code(returncode: int | None) -> int:
    assert returncode is not None
    return 128 - returncode if returncode < 0 else returncode
