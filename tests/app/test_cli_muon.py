"""``shardwise train --optimizer muon`` (issue 59): shardwise.optim.Muon on the blocks'
matrices, AdamW on the rest; it learns about as AdamW does at equal steps, resumes with
the very same losses, is recorded in config.json, and bad values are one line, exit 2,
before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_helpers import rows, shardwise

# A short real run: 2 ranks, a validation every 8 steps, checkpoints at 8 and 16.
SHORT = ["--steps", "16", "--batch-size", "8", "--seq-len", "64", "--eval-every", "8"]


def _bad(args: list[str], cwd: Path) -> str:
    r = shardwise("train", *args, "--out", "never", cwd=cwd, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stdout + r.stderr
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert not (cwd / "never").exists()
    return lines[0]


@pytest.mark.timeout(400)
def test_muon_learns_like_adamw_and_resumes_exactly(tmp_path: Path) -> None:
    r = shardwise(
        "train", *SHORT, "--nproc", "2", "--optimizer", "muon", "--save-every", "8",
        "--out", "muon", cwd=tmp_path, timeout=200,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((tmp_path / "muon" / "config.json").read_text())["optimizer"] == "muon"
    r = shardwise("train", *SHORT, "--nproc", "2", "--out", "adamw", cwd=tmp_path, timeout=200)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "optimizer" not in json.loads((tmp_path / "adamw" / "config.json").read_text())
    muon, adamw = rows(tmp_path / "muon"), rows(tmp_path / "adamw")
    vals = [r["val_loss"] for r in muon if "val_loss" in r]
    adamw_vals = [r["val_loss"] for r in adamw if "val_loss" in r]
    assert vals[-1] < vals[0] < muon[0]["loss"]  # it learns
    # About as well as AdamW at equal steps (docs/optimizers.md: the 200-step default job).
    assert abs(vals[-1] - adamw_vals[-1]) < 0.15 * adamw_vals[-1], (vals, adamw_vals)
    # Resumed from step 8's checkpoint (both optimizers' state): the same losses after it.
    ckpt = tmp_path / "muon" / "checkpoints" / "step_000008"
    r = shardwise(
        "train", "--resume", str(ckpt), "--nproc", "2", "--out", "resumed",
        cwd=tmp_path, timeout=200,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    resumed = [r for r in rows(tmp_path / "resumed") if r["step"] > 8]
    assert [r["step"] for r in resumed] == list(range(9, 17))
    expected = [r for r in muon if r["step"] > 8]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in expected]
    assert [r.get("val_loss") for r in resumed] == [r.get("val_loss") for r in expected]
    # Continuing a Muon run with AdamW is refused: the checkpoint holds Muon's state.
    line = _bad(["--resume", str(ckpt), "--optimizer", "adamw"], tmp_path)
    assert "the run trained with --optimizer muon" in line, line


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "args, message",
    [
        (["--optimizer", "lion"], "--optimizer 'lion': use one of adamw, muon"),
        (["--optimizer", "muon", "--hf", "."], "--optimizer muon is for the built-in GPT"),
    ],
    ids=["unknown name", "with --hf"],
)
def test_bad_optimizer_flags(args: list[str], message: str, tmp_path: Path) -> None:
    line = _bad(args, tmp_path)
    assert line.startswith("shardwise train: error: ") and message in line, line
