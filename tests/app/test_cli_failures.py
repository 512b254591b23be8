"""What users do to a running ``shardwise train``, done to real processes (issue 15).

Signals go to the whole process group, as a terminal sends them; kill -9 hits
real launchers and workers; the full disk is a real, tiny tmpfs where a
mount namespace can be made. Every failure must end non-zero (or 0 for a
clean stop) with one line and no traceback, and keep what the user had.
Bad input that needs no workers is checked in process, which is much faster
than a subprocess per case and runs the same ``main``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_helpers import (
    LONG,
    alive,
    checkpoints,
    children,
    env,
    one_line,
    rank_of,
    rows,
    shardwise,
    start,
    wait_announced,
    wait_for,
)


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


# ---- signals and kills --------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_ctrl_c_while_starting_then_kill_9_of_the_launcher(tmp_path: Path) -> None:
    """Items 4 and 2: an early Ctrl-C leaves nothing behind; orphaned workers stop and save."""
    run = tmp_path / "run"
    ready = tmp_path / "ready"
    proc = start("train", *LONG, "--out", "run", cwd=tmp_path, ready=ready)
    # The workers are importing torch: the seconds after pressing Enter. (The
    # few milliseconds before Python runs our entry module are not covered.)
    wait_announced(ready, "armed", 2, proc)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out + err
    line = one_line(out + err)
    assert "before the first step; nothing was saved" in line or "interrupted" in line
    assert not run.exists()  # the --out can be used again as it is

    log = tmp_path / "log"
    proc = start("train", *LONG, "--out", "run", cwd=tmp_path, log=log)
    wait_for("two steps", lambda: len(rows(run)) >= 2)
    workers = children(proc.pid)
    proc.kill()  # the OOM killer, or a scheduler
    proc.wait(timeout=10)
    t0 = time.monotonic()
    wait_for("the orphaned workers to exit", lambda: not any(map(alive, workers)), timeout=60)
    assert time.monotonic() - t0 < 30, "workers outlived their launcher too long"
    step = summary(run)["steps_done"]
    assert summary(run)["stopped_early"] and 2 <= step < 500
    assert checkpoints(run) == [f"step_{step:06d}"]  # nothing trained was lost
    # Each worker's watchdog sends itself SIGTERM; rank 0 names it even when
    # another rank's watchdog fired first (the signal is shared with the loss).
    assert "stopped by SIGTERM" in log.read_text()


@pytest.mark.timeout(240)
def test_hangup_saves_and_a_second_writer_is_refused(tmp_path: Path) -> None:
    """Items 1 and 7 (and 6's clean-up at start): a closed terminal keeps the run; one writer."""
    run = tmp_path / "run"
    proc = start("train", *LONG, "--out", "run", cwd=tmp_path)
    wait_for("a step", lambda: len(rows(run)) >= 1)
    os.killpg(proc.pid, signal.SIGHUP)  # the terminal or SSH session went away
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err
    assert "stopped by SIGHUP" in out and "Traceback" not in err
    first = summary(run)["steps_done"]
    assert checkpoints(run) == [f"step_{first:06d}"]

    # A save killed mid-way left a partial folder; the next start removes it.
    stale = run / "checkpoints" / "step_000999.partial"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"\0" * 1000)
    resumed = start("train", "--resume", "run", cwd=tmp_path)
    wait_for("the resume to train", lambda: len(rows(run)) > first + 1)
    assert not stale.exists()
    before = (run / "metrics.jsonl").read_bytes()
    second = shardwise("train", "--resume", "run", "--nproc", "2", cwd=tmp_path, timeout=60)
    assert second.returncode == 2, second.stdout + second.stderr
    assert f"pid {resumed.pid}" in one_line(second.stderr)
    assert (run / "metrics.jsonl").read_bytes().startswith(before)

    resumed.send_signal(signal.SIGTERM)
    out, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, out + err
    last = summary(run)["steps_done"]
    assert [r["step"] for r in rows(run)] == list(range(1, last + 1))
    assert checkpoints(run) == [f"step_{first:06d}", f"step_{last:06d}"]


@pytest.mark.timeout(180)
def test_a_killed_worker_is_named_in_one_line(tmp_path: Path) -> None:
    """Item 9: the launcher names the worker that was killed, not its peer's lost connection."""
    proc = start("train", *LONG, "--out", "run", cwd=tmp_path)
    wait_for("a step", lambda: len(rows(tmp_path / "run")) >= 1)
    victim = next(p for p in children(proc.pid) if rank_of(p) == 1)
    os.kill(victim, signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, out + err
    assert "worker rank 1 was killed by SIGKILL" in one_line(err)


@pytest.mark.timeout(180)
def test_a_diverging_run_stops_and_keeps_the_last_good_checkpoint(tmp_path: Path) -> None:
    """Item 3: a loss that stops being finite ends the run, non-zero, saving nothing bad."""
    r = shardwise(
        "train", *LONG[:-4], "--steps", "6", "--nproc", "2", "--lr", "1e30", "--save-every", "1",
        "--out", "run", cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr
    line = one_line(r.stderr)
    assert "training diverged" in line and "step_000001, is kept" in line, line
    assert checkpoints(tmp_path / "run") == ["step_000001"]
    assert [row["step"] for row in rows(tmp_path / "run")] == [1]


# ---- a full disk --------------------------------------------------------------------------


def _can_mount_tmpfs() -> bool:
    if not shutil.which("unshare"):
        return False
    probe = "d=$(mktemp -d) && mount -t tmpfs -o size=1m none $d && umount $d"
    return (
        subprocess.run(["unshare", "-rm", "sh", "-c", probe], capture_output=True).returncode == 0
    )


@pytest.mark.timeout(240)
@pytest.mark.skipif(not _can_mount_tmpfs(), reason="cannot mount a tmpfs (no user namespaces)")
def test_full_disk(tmp_path: Path) -> None:
    """Item 6: a real 18 MiB tmpfs holds the tokenized corpus (4 MiB) and one checkpoint,
    not two; then the user frees space.

    A mount namespace (unshare -rm) lets an unprivileged test mount it; the
    results are copied out before the namespace, and the tmpfs, go away.
    """
    disk, report = tmp_path / "disk", tmp_path / "report"
    disk.mkdir()
    report.mkdir()
    train = f"{sys.executable} -m shardwise train --nproc 2"
    script = f"""
        mount -t tmpfs -o size=18m none {disk} && cd {disk} || exit 99
        {train} {" ".join(LONG[:-4])} --steps 4 --save-every 2 --out run >{report}/1.out 2>{report}/1.err
        echo $? >{report}/1.rc
        ls -a run/checkpoints >{report}/1.ls
        mount -o remount,size=40m {disk}
        {train} --resume run >{report}/2.out 2>{report}/2.err
        echo $? >{report}/2.rc
        ls -a run/checkpoints >{report}/2.ls
    """
    subprocess.run(["unshare", "-rm", "sh", "-c", script], env=env(), timeout=220, check=True)

    def read(name: str) -> str:
        return (report / name).read_text()

    assert read("1.rc").strip() == "1", read("1.out") + read("1.err")
    line = one_line(read("1.err"))
    assert "saving checkpoints/step_000004 failed: no space left on device" in line
    assert "step_000002, is kept" in line
    assert read("1.ls").split() == [".", "..", "step_000002"]  # no .partial holds the space
    assert read("2.rc").strip() == "0", read("2.out") + read("2.err")
    assert "resumed at step 2" in read("2.out")
    assert read("2.ls").split() == [".", "..", "step_000002", "step_000004"]


@pytest.mark.timeout(60)
def test_full_disk_pieces_without_a_tmpfs(tmp_path: Path) -> None:
    """Item 6 where no tmpfs can be mounted: the two pieces, with ENOSPC simulated.

    Not the real thing (test_full_disk is): a failed save's error is put in
    words, and the partial folder it left is removed.
    """
    import errno

    from shardwise_app.cli.failures import save_failure
    from shardwise_app.cli.run_folder import remove_unfinished_saves

    (tmp_path / "checkpoints" / "step_000002").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_000004.partial").mkdir()
    full = OSError(errno.ENOSPC, "No space left on device")
    assert save_failure(full, tmp_path, need=1).startswith("no space left on device")
    short_write = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704")
    assert save_failure(short_write, tmp_path, need=2**62).startswith("no space left on device")
    assert save_failure(short_write, tmp_path, need=1) == f"RuntimeError: {short_write}"
    assert remove_unfinished_saves(tmp_path) == ["step_000004.partial"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002"]


# ---- bad input: one line, exit 2, nothing written (in process: no workers are needed) -----


def _bad_in_process(argv: list[str], cwd: Path, capsys, monkeypatch) -> str:
    from shardwise_app.cli.main import main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SHARDWISE_RUN_CONFIG"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.chdir(cwd)
    before = sorted(cwd.rglob("*"))
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert sorted(cwd.rglob("*")) == before  # nothing written
    return one_line(err)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--grad-clip", "-1"], "--grad-clip must be a number at least 0"),
        (["train", "--grad-clip", "nan"], "--grad-clip must be a number at least 0"),
        (["train", "--lr", "inf"], "--lr must be a positive number, got inf"),
        (["train", "--lr", "-1"], "--lr must be a positive number, got -1"),
        (["train", "--lr", "nan"], "--lr must be a positive number, got nan"),
        (["train", "--out", "/sys/shardwise-run"], "--out /sys/shardwise-run: cannot write"),
        (["train", "--out", "notes.txt/run"], "notes.txt is a file, not a folder"),
        (["train", "--data", "weights.bin"], "--data weights.bin: looks binary"),
        (["train", "--resume", "notes.txt"], "--resume notes.txt: is a file"),
        # The position table is the model size's: longer looked like a hang.
        (
            ["train", "--seq-len", "100000"],
            "--seq-len 100000 is longer than the model's context (128 bytes for --model tiny)",
        ),
        # Output paths before the checkpoint ("." is none) is even looked at.
        (["export", "--ckpt", ".", "--out", "notes.txt/x"], "notes.txt is a file, not a folder"),
        (["export", "--ckpt", ".", "--out", "/sys/x"], "--out /sys/x: cannot write in /sys"),
        (["sample", "--ckpt", ".", "--temperature", "nan"], "--temperature must be a number"),
        (["bench", "--configs", "Shardwise"], "unknown --configs value 'Shardwise'"),
        (["bench", "--configs", "fsdp3"], "unknown --configs value 'fsdp3'"),
        (["bench", "--nproc", "0"], "--nproc must be from 1 to"),
        (["bench", "--configs", "bare", "--nproc", "2"], "the bare model runs only at --nproc 1"),
        (["bench", "--steps", "0"], "--steps must be at least 1, got 0"),
        (["bench", "--rounds", "0"], "--rounds must be at least 1, got 0"),
        (
            ["bench", "--json", "no/such/folder/bench.json"],
            "--json no/such/folder/bench.json: cannot write it (no/such/folder does not exist)",
        ),
        (["bench", "--plot", "notes.txt/b.png"], "(notes.txt is a file, not a folder)"),
        (["bench", "--json", "/sys/bench.json"], "--json /sys/bench.json: cannot write it"),
    ],
)
def test_bad_input_in_process(argv: list[str], message: str, tmp_path, capsys, monkeypatch):
    """Items 3, 8 and 9: refused before anything runs, with the flag and the reason."""
    (tmp_path / "notes.txt").write_text("text\n")
    (tmp_path / "weights.bin").write_bytes(bytes(range(256)) * 64)
    line = _bad_in_process(argv, tmp_path, capsys, monkeypatch)
    assert message in line, line
    assert line.startswith(f"shardwise {argv[0]}: error: ")


@pytest.mark.timeout(60)
def test_memory_beyond_a_process_is_warned_in_one_line(tmp_path, capsys, monkeypatch) -> None:
    """One step's activations past what a process has here: a warning with the figures,
    before anything is written; the run itself may go on (the estimate is rough)."""
    from shardwise_app.cli import train_config

    monkeypatch.setattr(train_config, "memory_per_process", lambda device, local: 2**20)
    args = train_config.build_parser().parse_args(["--out", str(tmp_path / "run")])
    config = train_config.resolve(args, world=2)
    line = one_line(capsys.readouterr().err)
    assert line.startswith("warning: one step's activations need about 36 MiB per process")
    assert "(8 sequences of 128 bytes through 4 blocks), more than the 1 MiB each" in line
    assert "lower --batch-size or --seq-len" in line
    assert config.seq_len == 128 and list(tmp_path.iterdir()) == []


def test_activation_estimate() -> None:
    """The estimate's arithmetic: checkpointing keeps one input per block, bf16 halves."""
    from shardwise_app.cli.fits import Shape, activation_bytes

    gpt = Shape(d_model=128, n_layer=4, ffn=512, vocab=256, gated=False)
    per_block = 9 * 128 + 2 * 512  # values per token
    logits = 256 * 8  # bytes per token
    assert activation_bytes(gpt, 10, "none", bf16=False) == 10 * (4 * per_block * 4 + logits)
    checkpointed = 4 * 128 + per_block  # each block's input, one block recomputed
    assert activation_bytes(gpt, 10, "reentrant", False) == 10 * (checkpointed * 4 + logits)
    assert activation_bytes(gpt, 10, "none", bf16=True) == 10 * (4 * per_block * 2 + 256 * 10)
    assert Shape.of({"hidden_size": 32, "num_hidden_layers": 2, "vocab_size": 320}, hf=True)
    assert Shape.of({"hidden_size": 32}, hf=True) is None


@pytest.mark.timeout(60)
def test_bench_device_cuda_without_a_gpu(tmp_path, capsys, monkeypatch) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("there is a GPU here")
    line = _bad_in_process(["bench", "--device", "cuda"], tmp_path, capsys, monkeypatch)
    assert "--device cuda: no CUDA GPU is available here" in line


@pytest.mark.timeout(60)
def test_bench_help_shows_defaults_without_markup(capsys) -> None:
    from shardwise_app.cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert "``" not in out and "(default: 10)" in out and "(default: bench.json)" in out


@pytest.mark.parametrize(
    "words",
    [
        "[../gloo/transport/tcp/pair.cc:534] Timed out waiting 20000ms for recv operation",
        "[../gloo/transport/tcp/unbound_buffer.cc:81] Application timeout caused pair closure",
    ],
)
def test_a_collective_timeout_leaves_the_line_to_the_launcher(words: str, capsys) -> None:
    # Both of gloo's timeout messages reach a worker (which one is a race
    # between its waits); either way the launcher, which knows which rank
    # hung, tells it, and the waiting worker prints nothing of its own.
    from shardwise_app.cli.failures import EXIT_PEER_TIMEOUT, report_worker_failure

    assert report_worker_failure("train", RuntimeError(words), rank=0) == EXIT_PEER_TIMEOUT
    assert capsys.readouterr().err == ""
