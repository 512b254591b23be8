"""The one local launcher: real ranks of one process group on this machine, started and watched.

Three callers start ranks here and nowhere else: ``shardwise train``,
``sample`` and ``export`` (shardwise_app/cli/launcher.py, which adds stops,
restarts and its failure lines on top), the planner's measurement and
calibration (``run_ranks``: measure.py, calibrate.py), and the benchmark's
jobs (shardwise_app/bench/jobs.py). Each rank is ``python -m MODULE ARGS``
with torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` ...), a process of its own, so that a measured peak starts clean
and a rank that dies takes nothing of the caller with it.

Why here, in the planner: the application imports the planner (``shardwise
plan``, ``shardwise calibrate``), and the planner must never import the
application (tests/library/test_layers.py checks that neither cycles); the
library (src/shardwise) is torch's FSDP and knows no processes. So the planner's
module of ranks is the one both may import. It imports nothing but the
standard library.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping

GRACE_S = 5.0  # after a rank fails, for the others to notice and end on their own
POLL_S = 0.05
# Set by the application's launcher for one start of its workers (cli/common.py):
# ranks started for anything else must not inherit it.
_LAUNCH_ID_ENV = "SHARDWISE_LAUNCH_ID"

# rank -> (extra environment, file descriptors the rank inherits)
PerRank = Callable[[int], tuple[dict[str, str], tuple[int, ...]]]


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalRanks:
    """One start of this node's ``nproc`` ranks of a ``world``-rank process group.

    ``module``: what each rank runs (``python -m MODULE *argv``). ``endpoint``:
    HOST:PORT where the nodes meet (default: a free port here). ``node_rank``:
    this node's place (ranks ``node_rank * nproc`` on). ``env``: the ranks'
    environment before torchrun's variables (default: this process's).
    ``per_rank(rank)``: each rank's own extra variables and inherited file
    descriptors; those descriptors are closed here once the rank holds its copy.
    """

    def __init__(
        self,
        module: str,
        argv: list[str],
        nproc: int,
        *,
        world: int | None = None,
        node_rank: int = 0,
        endpoint: str | None = None,
        env: Mapping[str, str] | None = None,
        per_rank: PerRank | None = None,
    ) -> None:
        if endpoint:
            host, _, port = endpoint.rpartition(":")
        else:
            host, port = "127.0.0.1", str(free_port())
        base = dict(os.environ if env is None else env)
        # Each rank sizes its own threads; this is the default for anything else.
        base.setdefault("OMP_NUM_THREADS", str(max(1, usable_cpus() // nproc)))
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        try:
            for local in range(nproc):
                rank = node_rank * nproc + local
                extra, fds = per_rank(rank) if per_rank else ({}, ())
                rank_env = {
                    **base,
                    "RANK": str(rank),
                    "LOCAL_RANK": str(local),
                    "WORLD_SIZE": str(world or nproc),
                    "LOCAL_WORLD_SIZE": str(nproc),
                    "MASTER_ADDR": host,
                    "MASTER_PORT": port,
                    **extra,
                }
                try:
                    self.procs[rank] = subprocess.Popen(
                        [sys.executable, "-m", module, *argv], env=rank_env, pass_fds=fds
                    )
                finally:
                    for fd in fds:
                        os.close(fd)
        except BaseException:
            self.kill(list(self.procs))
            raise

    def poll(self) -> dict[int, int | None]:
        """rank -> exit code, or None while it runs (negative: killed by that signal)."""
        return {r: p.poll() for r, p in self.procs.items()}

    def codes(self) -> dict[int, int]:
        """rank -> exit code, of the ranks that have ended."""
        return {r: int(p.returncode) for r, p in self.procs.items() if p.returncode is not None}

    def running(self) -> list[int]:
        return [r for r, c in self.poll().items() if c is None]

    def kill(self, ranks: list[int]) -> None:
        """SIGKILL, which a stopped process cannot hold pending as it holds SIGTERM; then
        reap them (a process in uninterruptible sleep is left after 10 s)."""
        for r in ranks:
            if self.procs[r].poll() is None:
                self.procs[r].kill()
        for r in ranks:
            try:
                self.procs[r].wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def wait(
        self, grace_s: float = GRACE_S, poll_s: float = POLL_S
    ) -> tuple[dict[int, int], list[int]]:
        """Until every rank has ended; when one fails, the others get ``grace_s`` to
        notice and end on their own, and are then killed. (rank -> exit code, the
        ranks killed here: still running after a failure)."""
        failed_at: float | None = None
        while True:
            codes = self.poll()
            if all(c is not None for c in codes.values()):
                return self.codes(), []
            if failed_at is None and any(c not in (None, 0) for c in codes.values()):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > grace_s:
                killed = self.running()
                self.kill(killed)
                return self.codes(), killed
            time.sleep(poll_s)


def exit_code(returncode: int) -> int:
    """A rank's exit code as a shell says it: killed by signal N is 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def run_ranks(argv: list[str], nproc: int) -> int:
    """``python -m shardwise_plan.worker ARGV`` as ``nproc`` ranks of one process group
    here; 0 if every rank succeeded, else the first failure's exit code (a rank
    killed by a signal: 128 + its number). Nothing else is needed: no restarts or
    saves, only ending together."""
    env = {k: v for k, v in os.environ.items() if k != _LAUNCH_ID_ENV}
    ranks = LocalRanks("shardwise_plan.worker", argv, nproc, env=env)
    try:
        codes, killed = ranks.wait()
    finally:
        ranks.kill(ranks.running())  # only these ranks, started above, if any still runs
    bad = [c for r, c in sorted(codes.items()) if c != 0 and r not in killed]
    return exit_code(bad[0]) if bad else 0
