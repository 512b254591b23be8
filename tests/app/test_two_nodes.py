"""``shardwise train`` across two nodes made on one machine trains exactly like one node.

Two launchers (``--nnodes 2 --node-rank 0|1 --rdzv-endpoint 127.0.0.1:PORT``,
one process each) meet at node 0's endpoint; the run must be the one-node,
two-process run of the same flags, loss for loss, bit for bit. Node 0's
launcher holds the run folder; node 1's only checks the flags, and its
workers take rank 0's config (one folder, one seed, one data order).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_helpers import env, rows, shardwise
from dist_utils import free_port

FLAGS = ["--steps", "4", "--batch-size", "4", "--seq-len", "32", "--eval-every", "2"]


def run_on(cpus: list[int], *args: str, cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    """``shardwise ARGS`` in the background on the cores ``cpus`` only, its output in ``log``."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "shardwise", *args],
            cwd=cwd,
            env=env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=lambda: os.sched_setaffinity(0, cpus),
        )


@pytest.mark.timeout(420)
@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs Linux CPU affinity")
def test_two_nodes_of_one_process_train_like_one_node_of_two(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    endpoint = f"127.0.0.1:{free_port()}"
    # Each node its own core, as on two machines, and the one node two: every
    # worker then computes with one thread (the CLI sizes its threads by the
    # cores it may use), so the kernels sum in the same order.
    cpus = sorted(os.sched_getaffinity(0))
    nodes = [
        run_on(
            [cpus[rank % len(cpus)]],
            "train",
            *FLAGS,
            "--nproc",
            "1",
            "--nnodes",
            "2",
            "--node-rank",
            str(rank),
            "--rdzv-endpoint",
            endpoint,
            "--out",
            "run",
            cwd=two,
            log=two / f"node{rank}.log",
        )
        for rank in (0, 1)
    ]
    try:
        codes = [node.wait(timeout=300) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    logs = "\n".join((two / f"node{rank}.log").read_text() for rank in (0, 1))
    assert codes == [0, 0], logs
    ref = run_on(
        cpus[:2],
        "train",
        *FLAGS,
        "--nproc",
        "2",
        "--out",
        "run",
        cwd=one,
        log=one.parent / "one.log",
    )
    assert ref.wait(timeout=300) == 0, (one.parent / "one.log").read_text()

    got, want = rows(two / "run"), rows(one / "run")
    assert [x["step"] for x in got] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm", "val_loss"):
        assert [x.get(key) for x in got] == [x.get(key) for x in want], key  # bitwise
    summary = json.loads((two / "run" / "summary.json").read_text())
    assert (
        summary["steps_done"] == 4
        and summary["train_loss"]
        == json.loads((one / "run" / "summary.json").read_text())["train_loss"]
    )
    config = json.loads((two / "run" / "config.json").read_text())
    assert config["world_size"] == 2
    # One run folder, written by node 0, with every rank's part of the checkpoint.
    assert sorted(p.name for p in two.iterdir()) == ["node0.log", "node1.log", "run"]
    assert (two / "run" / "checkpoints" / "step_000004" / ".metadata").is_file()
    shards = sorted(p.name for p in (two / "run" / "checkpoints" / "step_000004").glob("*.distcp"))
    assert shards == sorted(
        p.name for p in (one / "run" / "checkpoints" / "step_000004").glob("*.distcp")
    )
    assert len(shards) == 2, shards


def test_a_node_rank_past_the_nodes_is_one_line(tmp_path: Path) -> None:
    r = shardwise(
        "train",
        *FLAGS,
        "--nnodes",
        "2",
        "--node-rank",
        "2",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        cwd=tmp_path,
        timeout=60,
    )
    assert r.returncode == 2 and "--node-rank 2 is not in [0, 2)" in r.stderr, r.stderr
    assert not list(tmp_path.iterdir())
