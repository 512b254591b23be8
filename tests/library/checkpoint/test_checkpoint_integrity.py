"""Checksums of checkpoint files: damaged bytes of the same length are named, never loaded.

Workers run on real gloo ranks (tests/dist_utils.py) and live at module level.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

import shardwise
from dist_utils import run_distributed
from shardwise import checkpoint
from shardwise.checkpoint import DamagedCheckpoint

SUMS = "shardwise_checksums.json"
EXTRA = "shardwise_extra.pt"


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _flip(file: Path, at: float = 0.5, n: int = 4) -> None:
    """Invert ``n`` bytes in place, ``at`` of the way in: the length stays the same."""
    data = bytearray(file.read_bytes())
    start = int(len(data) * at)
    data[start : start + n] = bytes(b ^ 0xFF for b in data[start : start + n])
    file.write_bytes(bytes(data))


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


def _save_damage_load(rank: int, world: int, root: str) -> list[str]:
    path = Path(root) / "ck"
    model = _net()
    for layer in model:
        if isinstance(layer, nn.Linear):
            shardwise.fully_shard(layer)
    shardwise.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters())
    checkpoint.save(path, model, opt, extra={"step": 1})
    if rank == 0:
        sums = json.loads((path / SUMS).read_text())["files"]
        # Every rank's data file, the metadata and extra; each sum is of the bytes on disk.
        assert sorted(sums) == [".metadata", "__0_0.distcp", "__1_0.distcp", EXTRA], sums
        for name, s in sums.items():
            data = (path / name).read_bytes()
            assert s == {"bytes": len(data), "crc32": zlib.crc32(data)}, name
        checkpoint.verify(path)  # whole: returns
        _flip(path / "__1_0.distcp")
    dist.barrier()
    before = _weights(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # so that a load would show
    changed = _weights(model)
    messages = []
    try:
        checkpoint.load(path, model, opt)
    except DamagedCheckpoint as e:
        messages.append(str(e))
    after = _weights(model)
    assert all(torch.equal(after[k], changed[k]) for k in after), "load changed the model"
    assert not all(torch.equal(before[k], changed[k]) for k in before)
    if rank == 0:
        with pytest.raises(DamagedCheckpoint) as info:
            checkpoint.verify(path)
        messages.append(str(info.value))
    return messages


@pytest.mark.timeout(120)
def test_flipped_bytes_are_named_at_load_on_every_rank_and_by_verify(tmp_path: Path) -> None:
    per_rank = run_distributed(_save_damage_load, 2, str(tmp_path), timeout=100)
    assert [len(m) for m in per_rank] == [2, 1]  # load on both ranks, verify on rank 0
    for message in [m for ms in per_rank for m in ms]:
        assert message.startswith(f"{tmp_path / 'ck' / '__1_0.distcp'} is damaged"), message
        assert "not those saved" in message and "\n" not in message


def test_each_file_kind_is_checked(tmp_path: Path) -> None:
    """Single process: damaged metadata, extra, a shard; a lost, a grown and a missing file."""
    model = _net()
    path = tmp_path / "ck"
    cases = {
        ".metadata": lambda f: _flip(f, 0.9),
        EXTRA: lambda f: _flip(f, 0.9),
        "__0_0.distcp": lambda f: _flip(f, 0.1, n=1),
    }
    for name, damage in cases.items():
        checkpoint.save(path, model, extra=1)
        damage(path / name)
        with pytest.raises(DamagedCheckpoint, match=rf"^{path / name} is damaged: its bytes"):
            checkpoint.verify(path)
        with pytest.raises(DamagedCheckpoint, match=rf"^{path / name} is damaged"):
            checkpoint.load(path, model)
    checkpoint.save(path, model, extra=1)
    with open(path / "__0_0.distcp", "ab") as f:
        f.write(b"more")
    with pytest.raises(
        DamagedCheckpoint, match="distcp is damaged: .* bytes, .* when it was saved"
    ):
        checkpoint.verify(path)
    checkpoint.save(path, model, extra=1)
    (path / "__0_0.distcp").unlink()
    with pytest.raises(DamagedCheckpoint, match=r"__0_0.distcp is missing$"):
        checkpoint.verify(path)
    checkpoint.save(path, model, extra=1)
    (path / SUMS).unlink()  # a partial copy that lost it: not mistaken for an old checkpoint
    with pytest.raises(DamagedCheckpoint, match=f"{SUMS} is missing"):
        checkpoint.load(path, model)
    checkpoint.save(path, model, extra=1)
    (path / SUMS).write_text("{not json")
    with pytest.raises(DamagedCheckpoint, match=f"{SUMS} is unreadable"):
        checkpoint.verify(path)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpoints_saved_without_checksums_still_load(tmp_path: Path) -> None:
    """Saved before checksums existed (no checksum file, extra of format 1), or by plain
    DCP: they load, unverified, so bytes damaged in place there are not caught."""
    model = _net()
    old = tmp_path / "old"
    checkpoint.save(old, model, extra={"step": 5})
    (old / SUMS).unlink()
    payload = torch.load(old / EXTRA, weights_only=False)
    torch.save({**payload, "format": 1}, old / EXTRA)
    plain = tmp_path / "plain"
    dcp.save({"model": model.state_dict()}, checkpoint_id=plain, no_dist=True)
    for folder in (old, plain):
        checkpoint.verify(folder)
        other = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        checkpoint.load(folder, other, restore_rng=False)
        for a, b in zip(other.state_dict().values(), model.state_dict().values()):
            assert torch.equal(a, b)
    # Truncation is still caught there: the metadata says how long each file is.
    data = old / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(DamagedCheckpoint, match="is truncated"):
        checkpoint.verify(old)
