"""What machines do to a running ``shardwise train`` (issue 29), done to real processes.

A worker killed (the OOM killer, a preempted node) is restarted with
``--max-restarts`` and the run ends with the very losses of one that never
was; a worker that stops answering (SIGSTOP, a stuck kernel) ends the job
within ``--timeout``; a second Ctrl-C ends everything at once; Ctrl-C while
the command is still importing prints no traceback. 2 CPU ranks (gloo), a
tiny model and a dozen steps. The launcher's lines for each failure are
checked in process at the end.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_helpers import (
    LONG,
    alive,
    announced,
    checkpoints,
    env,
    one_line,
    rows,
    shardwise,
    start,
    wait_for,
)

# 12 steps of about half a second on 2 cores, a checkpoint every 4.
SHORT = ["--steps", "12", "--batch-size", "4", "--seq-len", "32", "--eval-every", "4"]
SHORT += ["--save-every", "4", "--nproc", "2"]


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def saved(run: Path) -> list[str]:
    """Complete checkpoints, oldest first."""
    folder = run / "checkpoints"
    return sorted(c.name for c in folder.glob("step_*") if (c / ".metadata").is_file())


def while_running(proc: subprocess.Popen[str], what: str, cond) -> None:
    """``wait_for``, failing at once with the output if the job ended first."""

    def done() -> bool:
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"ended ({proc.returncode}) before {what}: {out}{err}")
        return bool(cond())

    wait_for(what, done)


def in_session(sid: int) -> list[int]:
    """Live processes of the session ``start`` made (its leader's pid is the session id)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields: state, ppid, pgrp, session
            found.append(int(stat.parent.name))
    return found


@pytest.mark.timeout(360)
def test_a_killed_then_a_hung_worker_are_restarted_and_the_run_ends_as_if_neither_was(
    tmp_path: Path,
) -> None:
    ref = shardwise("train", *SHORT, "--out", "ref", cwd=tmp_path)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    run, log, ready = tmp_path / "run", tmp_path / "log", tmp_path / "ready"
    proc = start(
        "train", *SHORT, "--max-restarts", "2", "--timeout", "15", "--out", "run",
        cwd=tmp_path, log=log, ready=ready,
    )  # fmt: skip

    def rank1() -> int:
        """Rank 1's pid as it announced it (a restarted rank 1 announces itself anew)."""
        return announced(ready, "joined")[1]

    def restarts() -> list[re.Match[str]]:
        pattern = (
            r"shardwise train: (.*) at step (\d+); restarting every worker from "
            r"checkpoints/step_(\d+) \(restart (\d) of 2\)"
        )
        return list(re.finditer(pattern, log.read_text()))

    while_running(proc, "step 5", lambda: len(rows(run)) >= 5)
    os.kill(rank1(), signal.SIGKILL)
    while_running(proc, "the restart", lambda: len(restarts()) == 1)
    died = int(restarts()[0].group(2))
    # The restarted workers train past the step the first failure ended: then one hangs.
    while_running(proc, "the step after", lambda: rows(run) and rows(run)[-1]["step"] >= died)
    os.kill(rank1(), signal.SIGSTOP)
    assert proc.wait(timeout=200) == 0, log.read_text()
    text = log.read_text()
    assert "Traceback" not in text, text
    (killed, hung) = restarts()
    assert killed.group(1) == "worker rank 1 was killed by SIGKILL", text
    assert hung.group(1).startswith("worker rank 1 stopped responding"), text
    for m in (killed, hung):
        died, resumed = int(m.group(2)), int(m.group(3))
        assert 0 < died - resumed <= 4  # lost at most --save-every steps
        assert f"resumed at step {resumed}" in text
    # The same losses, bitwise: data order and every RNG state resumed too.
    assert [r["step"] for r in rows(run)] == list(range(1, 13))
    for key in ("loss", "val_loss"):
        assert [r.get(key) for r in rows(run)] == [r.get(key) for r in rows(tmp_path / "ref")]
    for key in ("steps_done", "train_loss", "val_loss"):
        assert summary(run)[key] == summary(tmp_path / "ref")[key]
    assert checkpoints(run) == ["step_000004", "step_000008", "step_000012"]


@pytest.mark.timeout(240)
def test_a_worker_that_stops_answering_ends_the_job_within_the_timeout(tmp_path: Path) -> None:
    run, ready = tmp_path / "run", tmp_path / "ready"
    proc = start(
        "train", *LONG, "--save-every", "2", "--timeout", "20", "--out", "run", cwd=tmp_path,
        ready=ready,
    )  # fmt: skip
    while_running(proc, "a checkpoint", lambda: len(rows(run)) >= 3 and bool(saved(run)))
    pids = announced(ready, "joined")
    workers = list(pids.values())
    os.kill(pids[1], signal.SIGSTOP)
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=120)
    assert time.monotonic() - t0 < 60, "the job outlived --timeout 20 by far"
    assert proc.returncode == 1, out + err
    line = one_line(err)
    assert "worker rank 1 stopped responding" in line and "it was killed" in line, line
    assert "is kept (resume with: shardwise train --resume" in line, line
    assert not any(map(alive, workers))  # the stopped one too

    last = saved(run)[-1]
    step = int(last[len("step_") :])
    r = shardwise(
        "train", "--resume", "run", "--steps", str(step + 2), "--nproc", "2", cwd=tmp_path
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"resumed at step {step}" in r.stdout
    assert summary(run)["steps_done"] == step + 2


@pytest.mark.timeout(240)
def test_a_second_ctrl_c_ends_every_process_at_once(tmp_path: Path) -> None:
    run, ready = tmp_path / "run", tmp_path / "ready"
    proc = start("train", *LONG, "--save-every", "2", "--out", "run", cwd=tmp_path, ready=ready)
    while_running(proc, "a checkpoint", lambda: len(rows(run)) >= 3 and bool(saved(run)))
    # A long step: rank 0 waits in a collective for rank 1, which does nothing.
    os.kill(announced(ready, "joined")[1], signal.SIGSTOP)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(1.0)
    assert proc.poll() is None  # the first Ctrl-C waits for the step boundary
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    wait_for("every process to end", lambda: not in_session(proc.pid), timeout=15)
    assert time.monotonic() - t0 < 15
    assert proc.returncode == 128 + signal.SIGINT, out + err
    line = one_line(err)
    assert "stopped at once by a second SIGINT" in line and "is kept" in line, line


@pytest.mark.timeout(120)
@pytest.mark.parametrize("after_s", [0.5, 1.0, 2.0])
def test_ctrl_c_while_starting_prints_no_traceback(after_s: float, tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("shardwise")  # what a user types
    if not script.is_file():
        pytest.skip("the shardwise console script is not installed next to this Python")
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [str(script), "train", *LONG, "--out", "run"],
        cwd=tmp_path,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    time.sleep(after_s)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=100)
    assert "Traceback" not in out + err, out + err
    wait_for("every process to end", lambda: not in_session(proc.pid), timeout=15)
    if proc.returncode == 0:  # a fast machine had trained a step: stopped and saved
        assert summary(run)["stopped_early"]
        return
    assert proc.returncode == 128 + signal.SIGINT, out + err
    assert "interrupted" in one_line(err) or "before the first step" in one_line(err)
    # Used again as it is: gone, or holding nothing but the lock.
    assert not run.exists() or [p.name for p in run.iterdir()] == [".lock"]


# ---- the launcher's lines, each path (in process) --------------------------------------------


KEPT = "the last good checkpoint, checkpoints/step_000008, is kept (resume with: ...)"


def test_what_the_launcher_says_for_each_failure() -> None:
    from shardwise_app.cli.failures import (
        EXIT_NO_RETRY,
        EXIT_PEER_LOST,
        EXIT_PEER_TIMEOUT,
        EXIT_REPORTED,
        launcher_message,
    )

    oom = launcher_message("train", {0: EXIT_PEER_LOST, 1: -signal.SIGKILL}, [], KEPT)
    assert oom and "worker rank 1 was killed by SIGKILL (out of memory? `dmesg`" in oom
    assert oom.endswith(KEPT)
    # Our own SIGTERM to the survivors is the consequence, not the cause.
    term = launcher_message("train", {0: -signal.SIGTERM, 1: -signal.SIGSEGV}, [], KEPT)
    assert term and "worker rank 1 was killed by SIGSEGV; the other workers" in term
    assert term.endswith(KEPT)
    hung = launcher_message("train", {0: EXIT_PEER_TIMEOUT, 1: -signal.SIGKILL}, [1], KEPT)
    assert hung and "worker rank 1 stopped responding" in hung and KEPT in hung
    assert "raise --timeout" in hung and "SIGKILL" not in hung
    lost = launcher_message("train", {0: EXIT_PEER_LOST, 1: EXIT_PEER_LOST}, [], KEPT)
    assert lost and "lost contact with each other" in lost and lost.endswith(KEPT)
    plain = launcher_message("sample", {0: -signal.SIGKILL}, [])
    assert plain and plain.endswith("run shardwise sample again")
    for said in (EXIT_REPORTED, EXIT_NO_RETRY):  # a worker already said it, in one line
        assert launcher_message("train", {0: said, 1: EXIT_PEER_LOST}, [], KEPT) is None


def test_a_full_disk_says_what_to_do(tmp_path: Path) -> None:
    import errno

    from shardwise_app.cli.failures import save_failure

    full = OSError(errno.ENOSPC, "No space left on device")
    why = save_failure(full, tmp_path, need=12 * 2**20)
    assert why.startswith("no space left on device (") and "MiB free in" in why
    assert why.endswith("a checkpoint takes about 12.0 MiB: free that much there, then resume)")


def test_bad_fault_flags_are_one_line(tmp_path, capsys, monkeypatch) -> None:
    from shardwise_app.cli.main import main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SHARDWISE_RUN_CONFIG"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.chdir(tmp_path)
    for argv, message in [
        (["--max-restarts", "-1"], "--max-restarts must be at least 0, got -1"),
        (["--timeout", "0"], "--timeout must be a positive number of seconds, got 0.0"),
        (["--timeout", "nan"], "--timeout must be a positive number of seconds, got nan"),
    ]:
        assert main(["train", *argv]) == 2
        assert message in one_line(capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == []
