"""A stop is honoured within a bound, whatever the workers are doing (issue 52).

A step or a save is made to last for good (``SHARDWISE_TEST_STALL``, read by the
test-only ``stall_plugin/sitecustomize.py`` this test puts on ``PYTHONPATH``):
the stalled worker's main thread blocks its stop signals and sleeps, as a long
C++ call would, and its peer waits for it inside a real gloo collective. So
nothing that needs the main thread (a Python signal handler, the next step
boundary) can end either: only what signals.py does on its own threads. The
bound is ``--stop-grace``, short here (3 s). 2 CPU ranks, a tiny model.

The workers are found by what they announce (``SHARDWISE_READY_DIR``,
cli/signals.py's ``announce``), not guessed from the process table.
Every test kills what it started in ``finally``, whatever happened.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli_helpers import alive, announced, env, one_line, rows, wait_announced, wait_for
from shardwise_app.cli.signals import READY_DIR_ENV, STOP_FD_ENV

GRACE = 3.0
TINY = ["--batch-size", "4", "--seq-len", "32", "--eval-every", "4", "--nproc", "2"]
STALL_PLUGIN = Path(__file__).parent / "stall_plugin"


class Job:
    """``shardwise ARGS`` in its own session, output to a file; every worker it announced
    is remembered, so that ``kill_all`` can end them even once the launcher is gone."""

    def __init__(self, tmp: Path, args: list[str], stall: str | None, torchrun: bool) -> None:
        self.mark = tmp / "stalled"
        self.log = tmp / "log"
        self.ready = tmp / "ready"
        shutil.rmtree(self.ready, ignore_errors=True)  # a job before this one's
        self.ready.mkdir()
        e = env() | {READY_DIR_ENV: str(self.ready)}
        if stall:
            path = [str(STALL_PLUGIN), *filter(None, [e.get("PYTHONPATH")])]
            e |= {
                "PYTHONPATH": os.pathsep.join(path),
                "SHARDWISE_TEST_STALL": stall,
                "SHARDWISE_TEST_STALL_MARK": str(self.mark),
            }
        head = [sys.executable, "-m", "shardwise"]
        if torchrun:
            torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
            head = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "shardwise"]
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [*head, *args],
                cwd=tmp,
                env=e,
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        self.seen: set[int] = set()

    def workers(self, phase: str = "joined") -> dict[int, int]:
        """rank -> pid of the workers that announced ``phase``."""
        found = announced(self.ready, phase)
        self.seen.update(found.values())
        return found

    def wait_joined(self, ranks: int = 2) -> dict[int, int]:
        """Every rank joined its process group: past its start, its stop rules final."""
        found = wait_announced(self.ready, "joined", ranks, self.proc)
        self.seen.update(found.values())
        return found

    def wait_for_stall(self, ranks: int = 2) -> list[int]:
        joined = self.wait_joined(ranks)

        def stalled() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"ended ({self.proc.returncode}): {self.output()}")
            return self.mark.exists()

        wait_for("the stall", stalled, timeout=150)
        return list(joined.values())

    def output(self) -> str:
        return self.log.read_text()

    def kill_all(self) -> None:
        self.workers("armed")
        self.workers("joined")
        for pid in [self.proc.pid, *self.seen]:
            try:
                os.killpg(pid, signal.SIGKILL)  # a session leader: the launcher, torchrun's ranks
            except (ProcessLookupError, PermissionError):
                pass
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    made: list[Job] = []

    def make(*args: str, stall: str | None = None, torchrun: bool = False) -> Job:
        j = Job(tmp_path, list(args), stall, torchrun)
        made.append(j)
        return j

    try:
        yield make  # type: ignore[misc]
    finally:
        for j in made:
            j.kill_all()


def said(output: str) -> str:
    """What a job said beyond its first line and its progress lines."""
    lines = output.splitlines()[1:]
    return "\n".join(line for line in lines if not line.startswith("step "))


def gone_within(pids: list[int], seconds: float) -> float:
    """Seconds until none of ``pids`` is alive; fails past ``seconds``."""
    t0 = time.monotonic()
    wait_for("every worker to end", lambda: not any(map(alive, pids)), timeout=seconds)
    return time.monotonic() - t0


# ---- the launcher gets one SIGTERM, or is killed -------------------------------------------


@pytest.mark.timeout(240)
def test_one_sigterm_to_the_launcher_ends_a_stalled_job_within_the_grace(job, tmp_path) -> None:
    j = job(
        "train", *TINY, "--steps", "12", "--save-every", "2", "--stop-grace", str(GRACE),
        "--out", "run", stall="step 3 1",
    )  # fmt: skip
    workers = j.wait_for_stall()
    os.kill(j.proc.pid, signal.SIGTERM)  # the launcher alone, as a scheduler sends it
    t0 = time.monotonic()
    assert j.proc.wait(timeout=GRACE + 10) == 128 + signal.SIGTERM, j.output()
    took = time.monotonic() - t0
    assert took < GRACE + 10 and not any(map(alive, workers)), j.output()
    assert took > GRACE - 0.5, "ended before the grace period: the stop was not waited for"
    line = one_line(said(j.output()))
    assert line.startswith("shardwise train: stopped by SIGTERM, but the workers did not reach")
    assert f"within --stop-grace {GRACE:g} s" in line
    assert "the last good checkpoint, checkpoints/step_000002, is kept" in line, line
    # Nothing left behind: the lock is free, the checkpoint is the newest.
    r = subprocess.run(
        [sys.executable, "-m", "shardwise", "train", "--resume", "run", "--steps", "3"],
        cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resumed at step 2" in r.stdout, r.stdout


@pytest.mark.timeout(240)
def test_sigkill_of_the_launcher_ends_orphans_stalled_in_a_step(job) -> None:
    j = job(
        "train", *TINY, "--steps", "12", "--stop-grace", str(GRACE), "--out", "run",
        stall="step 3 1",
    )  # fmt: skip
    workers = j.wait_for_stall()
    j.proc.kill()  # the OOM killer, or a scheduler's grace period over
    j.proc.wait(timeout=10)
    took = gone_within(workers, GRACE + 10)
    assert took > GRACE - 1.5, "the orphans did not wait for a step boundary first"
    # Rank 0 says it (the launcher that would is gone), in one line.
    said = [line for line in j.output().splitlines() if "--stop-grace" in line]
    assert len(said) == 1 and said[0].startswith("shardwise train: the launcher is gone"), said


@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_sigkill_of_the_launcher_ends_orphans_on_gpus(job) -> None:
    """CUDA and NCCL: the launcher killed while the last rank stalls in a step and the
    others wait in an NCCL collective it never joins (on one GPU, the one rank stalls):
    no worker outlives the grace period + 10 s."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    n = min(2, torch.cuda.device_count())
    j = job(
        "train", "--batch-size", "4", "--seq-len", "32", "--eval-every", "4", "--nproc", str(n),
        "--steps", "12", "--stop-grace", str(GRACE), "--out", "run", stall=f"step 3 {n - 1}",
    )  # fmt: skip
    workers = j.wait_for_stall(n)
    j.proc.kill()
    j.proc.wait(timeout=10)
    took = gone_within(workers, GRACE + 10)
    assert took > GRACE - 1.5, "the orphans did not wait for a step boundary first"


@pytest.mark.timeout(300)
def test_sigkill_of_the_launcher_during_a_save_keeps_the_previous_checkpoint(
    job, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    args = ["train", *TINY, "--steps", "6", "--save-every", "2", "--stop-grace", str(GRACE)]
    j = job(*args, "--out", "run", stall="save 4 1")
    workers = j.wait_for_stall()
    j.proc.kill()
    j.proc.wait(timeout=10)
    gone_within(workers, GRACE + 10)
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000002", "step_000004.partial"]
    before = {r["step"]: r["loss"] for r in rows(run)}
    assert sorted(before) == [1, 2, 3]  # step 4's row comes after its save

    r = subprocess.run(
        [sys.executable, "-m", "shardwise", "train", "--resume", "run"],
        cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=200,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "removed checkpoints/step_000004.partial" in r.stderr, r.stderr
    assert "resumed at step 2" in r.stdout, r.stdout
    after = {r["step"]: r["loss"] for r in rows(run)}
    assert sorted(after) == [1, 2, 3, 4, 5, 6]
    assert after[3] == before[3]  # the same step 3, to the bit
    assert sorted(p.name for p in ckpts.iterdir()) == [f"step_00000{n}" for n in (2, 4, 6)]


# ---- a worker gets two SIGTERMs ------------------------------------------------------------


@pytest.mark.timeout(240)
def test_two_sigterms_to_a_worker_end_it_at_once(job) -> None:
    # A grace far longer than the test: only the second signal can end the worker.
    j = job("train", *TINY, "--steps", "12", "--stop-grace", "600", "--out", "run",
            stall="step 3 1")  # fmt: skip
    workers = j.wait_for_stall()
    rank1 = j.workers()[1]
    os.kill(rank1, signal.SIGTERM)
    time.sleep(0.5)
    assert alive(rank1)  # the first asks for a stop at a boundary
    os.kill(rank1, signal.SIGTERM)
    gone_within([rank1], 5)
    assert j.proc.wait(timeout=30) == 1, j.output()
    line = one_line(said(j.output()))
    assert "worker rank 1 was killed by SIGTERM" in line, j.output()
    assert not any(map(alive, workers))


# ---- torchrun, and sample --------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_under_torchrun_a_killed_torchrun_leaves_no_worker(job) -> None:
    j = job("train", *TINY[:-2], "--steps", "12", "--stop-grace", str(GRACE), "--out", "run",
            stall="step 3 1", torchrun=True)  # fmt: skip
    workers = j.wait_for_stall()
    j.proc.kill()
    j.proc.wait(timeout=10)
    gone_within(workers, GRACE + 10)
    said = [line for line in j.output().splitlines() if "--stop-grace" in line]
    assert len(said) == 1 and said[0].startswith("shardwise train: the launcher is gone"), said


@pytest.mark.timeout(300)
def test_sample_workers_end_at_once_on_a_signal_and_with_their_launcher(job, tmp_path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "shardwise", "train", *TINY[:-2], "--steps", "2", "--nproc", "1",
         "--out", "run"],
        cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    # Far more bytes than the test lasts: the workers are generating when stopped.
    sample = ["sample", "--ckpt", "run", "--nproc", "2", "--tokens", "1000000"]

    j = job(*sample)
    workers = generating(j)
    os.kill(j.proc.pid, signal.SIGTERM)
    assert j.proc.wait(timeout=15) == 128 + signal.SIGTERM, j.output()
    gone_within(workers, 5)
    assert one_line(j.output()) == "shardwise sample: stopped by SIGTERM"

    j = job(*sample)
    workers = generating(j)
    j.proc.kill()
    gone_within(workers, 5)


def generating(j: Job) -> list[int]:
    """The two workers of ``j``, once joined (their stop signals back to the defaults
    before, cli/checkpoint_command.py) and a moment into the work."""
    workers = list(j.wait_joined().values())
    time.sleep(2)
    return workers


# ---- bad values ----------------------------------------------------------------------------


def test_a_bad_stop_grace_is_one_line(tmp_path, capsys, monkeypatch) -> None:
    from shardwise_app.cli.main import main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SHARDWISE_RUN_CONFIG"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.chdir(tmp_path)
    for value, shown in [("-1", "-1.0"), ("0", "0.0"), ("nan", "nan"), ("inf", "inf")]:
        assert main(["train", "--stop-grace", value]) == 2
        line = one_line(capsys.readouterr().err)
        assert f"--stop-grace must be a positive number of seconds, got {shown}" in line
    assert list(tmp_path.iterdir()) == []


def test_what_the_launcher_says_of_a_worker_stopped_by_hand() -> None:
    from shardwise_app.cli.failures import EXIT_PEER_LOST, launcher_message
    from shardwise_app.cli.signals import EXIT_STOP_OVERDUE

    kept = "the last good checkpoint, checkpoints/step_000008, is kept (resume with: ...)"
    # Two signals to rank 1: it exits 128 + SIGTERM at once; rank 0 loses it.
    twice = launcher_message("train", {0: EXIT_PEER_LOST, 1: 128 + signal.SIGTERM}, [], kept)
    assert twice and "worker rank 1 was killed by SIGTERM; the other workers" in twice
    # One signal to rank 1 alone, in a step that never ends: its deadline.
    once = launcher_message("train", {0: EXIT_PEER_LOST, 1: EXIT_STOP_OVERDUE}, [], kept)
    assert once and "worker rank 1 was sent a stop signal (to it alone)" in once
    assert "--stop-grace" in once and once.endswith(kept)


# ---- the signal thread alone, in a process without torch (cli/signals.py) --------------------

_STOPPABLE = """
import signal, sys, time
from shardwise_app.cli.signals import StopRequest
stop = StopRequest(float(sys.argv[1]), say=lambda signum, orphaned: f"said {signum} {orphaned}")
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])  # a main thread deep in C++
print("ready", flush=True)
time.sleep(60)
"""


def _stoppable(grace: float) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-c", _STOPPABLE, str(grace)],
        env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert p.stdout is not None and p.stdout.readline() == "ready\n"
    return p


@pytest.mark.timeout(60)
def test_the_deadline_ends_a_process_whose_main_thread_never_returns() -> None:
    p = _stoppable(1.0)
    try:
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=10)
        assert p.returncode == 7 and err == f"said {signal.SIGTERM.value} False\n", err
        assert 0.9 < time.monotonic() - t0 < 5
    finally:
        p.kill()


@pytest.mark.timeout(60)
def test_a_signal_repeated_at_once_by_another_launcher_is_the_same_stop() -> None:
    """torchrun passes SIGTERM on as a signal, and SLURM sent the worker its own."""
    p = _stoppable(600)
    try:
        p.send_signal(signal.SIGTERM)
        p.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert p.poll() is None  # one stop, waiting for its step boundary
        time.sleep(2.0)
        p.send_signal(signal.SIGTERM)  # a second, later: at once
        p.wait(timeout=5)
        assert p.returncode == 128 + signal.SIGTERM
    finally:
        p.kill()


@pytest.mark.timeout(60)
def test_the_direct_copy_of_a_stop_the_launcher_passed_on_is_the_same_stop() -> None:
    """Our launcher passes its first signal on through a pipe; a terminal's Ctrl-C or a
    scheduler's SIGTERM reaches the worker directly too, after the pipe's copy as often
    as before it: that copy is the same stop (not a second one, which ends at once
    without saving); a signal after it is a second."""
    read, write = os.pipe()
    p = subprocess.Popen(
        [sys.executable, "-c", _STOPPABLE, "600"],
        env={**env(), STOP_FD_ENV: str(read)}, pass_fds=(read,),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    os.close(read)
    try:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        os.write(write, bytes([signal.SIGTERM]))  # the launcher's copy first
        time.sleep(0.3)
        p.send_signal(signal.SIGTERM)  # then the direct one
        time.sleep(0.5)
        assert p.poll() is None, p.communicate()  # one stop, waiting for its boundary
        p.send_signal(signal.SIGTERM)  # a second: at once
        p.wait(timeout=5)
        assert p.returncode == 128 + signal.SIGTERM
    finally:
        os.close(write)
        p.kill()
