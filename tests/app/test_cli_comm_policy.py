"""``shardwise train --comm-policy NAME --node-size N`` (issue 51): the flag reaches
``fully_shard`` (a run's collectives include qgZ's all-to-all), is recorded in
config.json, defaults its node size to this launch's processes, and bad values are
one line, exit 2, before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_helpers import shardwise


def _bad(args: list[str], cwd: Path) -> str:
    r = shardwise("train", *args, "--out", "never", cwd=cwd, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stdout + r.stderr
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert not (cwd / "never").exists()
    return lines[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--comm-policy", "zero"],
            "--comm-policy 'zero': use one of none, qwz, qwz-always, hpz, qgz, zeropp",
        ),
        (["--node-size", "0"], "--node-size must be at least 1, got 0"),
        (
            ["--nproc", "2", "--comm-policy", "hpz", "--node-size", "3"],
            "--comm-policy hpz: --node-size 3 does not divide the 2 processes",
        ),
        (  # under HSDP the shard group is world / R processes
            ["--nproc", "4", "--hsdp", "2", "--comm-policy", "qgz", "--node-size", "4"],
            "--node-size 4 does not divide the 2 processes each parameter is sharded over",
        ),
    ],
    ids=[
        "unknown name",
        "node size 0",
        "node size 3 of 2",
        "node size 4 of an hsdp shard of 2",
    ],
)
def test_bad_comm_policy_flags(args: list[str], message: str, tmp_path: Path) -> None:
    line = _bad(args, tmp_path)
    assert line.startswith("shardwise train: error: ") and message in line, line


def test_node_size_defaults_to_this_launchs_processes(tmp_path: Path) -> None:
    from shardwise_app.cli.train_config import build_parser, resolve

    out = str(tmp_path / "run")
    args = build_parser().parse_args(["--comm-policy", "qwz", "--out", out])
    config = resolve(args, world=8, local=4)
    assert (config.comm_policy, config.node_size) == ("qwz", 4)
    assert config.to_json()["comm_policy"] == "qwz" and config.to_json()["node_size"] == 4
    plain = resolve(build_parser().parse_args(["--out", out]), world=8, local=4)
    assert "comm_policy" not in plain.to_json()  # older runs' config.json unchanged
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(150)
def test_comm_policy_reaches_fully_shard(tmp_path: Path) -> None:
    """4 processes as 2 nodes x 2 under zeropp: the gradient reduction crosses nodes as
    an all-to-all (qgZ), which no run without the policy issues."""
    run = [
        *["--nproc", "4", "--node-size", "2", "--comm-policy", "zeropp"],
        *["--steps", "3", "--batch-size", "8", "--seq-len", "32", "--eval-every", "3"],
        *["--mixed-precision", "bf16", "--out", "run"],
    ]
    r = shardwise("train", *run, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (config["comm_policy"], config["node_size"]) == ("zeropp", 2)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["timeline"]["collectives"].get("all_to_all", 0) > 0, summary["timeline"]


@pytest.mark.timeout(150)
def test_forward_only_quantization_trains_with_checkpointing(tmp_path: Path) -> None:
    """qwz with activation checkpointing runs (it was refused): the recomputation gathers
    the forward's quantized weights (tests/library/test_comm_policy_training.py checks
    its gradients equal the run without checkpointing)."""
    run = [
        *["--nproc", "2", "--node-size", "1", "--comm-policy", "qwz"],
        *["--activation-checkpointing", "non-reentrant", "--steps", "2", "--eval-every", "2"],
        *["--batch-size", "4", "--seq-len", "32", "--out", "run"],
    ]
    r = shardwise("train", *run, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["comm_policy"] == "qwz" and config["activation_checkpointing"] == "non-reentrant"
