"""The commands that read a checkpoint run no code from it: ``train --resume``, ``sample``,
``export``.

A real run's folder, with one file replaced by a pickle whose loading would
create a marker file (the checksums left out, as whoever crafts a checkpoint
would): each command says one line, exits 2, never creates the marker and
leaves the folder as it was. Each file the commands read is tried: DCP's
metadata, ``shardwise_extra.pt``, an optimizer item inside a ``.distcp`` file,
the checksums and the run's ``config.json``.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cli_helpers import shardwise

SUMS = "shardwise_checksums.json"
EXTRA = "shardwise_extra.pt"
SYSTEM = f"{os.system.__module__}.system"  # posix.system on Linux


class System:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run, as small as a run gets: one process, two steps, one checkpoint."""
    cwd = tmp_path_factory.mktemp("safety")
    fast = ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--eval-every", "2"]
    r = shardwise("train", *fast, "--nproc", "1", "--out", "run", cwd=cwd, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    return cwd / "run"


def _ckpt(run: Path) -> Path:
    return run / "checkpoints" / "step_000002"


def _craft_metadata(run: Path, marker: Path) -> str:
    import torch.distributed.checkpoint as dcp

    ckpt = _ckpt(run)
    metadata = dcp.FileSystemReader(str(ckpt)).read_metadata()  # our own honest file
    metadata.planner_data = {"model.lm_head.weight": System(marker)}
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    return f"{ckpt / '.metadata'} would run code when loaded: it calls {SYSTEM},"


def _craft_extra(run: Path, marker: Path) -> str:
    import torch

    ckpt = _ckpt(run)
    payload = torch.load(ckpt / EXTRA, weights_only=True)
    payload["extra"]["data"] = System(marker)
    torch.save(payload, ckpt / EXTRA)
    return f"{ckpt / EXTRA} would run code when loaded: it calls {SYSTEM},"


def _craft_optimizer_item(run: Path, marker: Path) -> str:
    """An item DCP reads with torch.load(weights_only=False): the learning rate, appended
    to a data file, the metadata pointed at it (itself holding only DCP's classes)."""
    import dataclasses

    import torch
    import torch.distributed.checkpoint as dcp

    ckpt = _ckpt(run)
    metadata = dcp.FileSystemReader(str(ckpt)).read_metadata()
    blob = io.BytesIO()
    torch.save(System(marker), blob)
    for index, info in list(metadata.storage_data.items()):
        if index.fqn == "optim.param_groups.0.lr":
            shard = ckpt / info.relative_path
            offset = shard.stat().st_size
            with open(shard, "ab") as f:
                f.write(blob.getvalue())
            metadata.storage_data[index] = dataclasses.replace(
                info, offset=offset, length=len(blob.getvalue())
            )
            (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
            return f"{shard} (item 'optim.param_groups.0.lr') would run code when loaded"
    raise AssertionError("the run saved no learning rate")


def _craft_sums(run: Path, marker: Path) -> str:
    (_ckpt(run) / SUMS).write_bytes(pickle.dumps(System(marker)))
    return f"{_ckpt(run) / SUMS} is unreadable"


def _craft_config(run: Path, marker: Path) -> str:
    (run / "config.json").write_bytes(pickle.dumps(System(marker)))
    return "cannot read the run's config.json"


CRAFTS: dict[str, Callable[[Path, Path], str]] = {
    "metadata": _craft_metadata,
    "extra": _craft_extra,
    "optimizer item": _craft_optimizer_item,
    "checksums": _craft_sums,
    "config": _craft_config,
}

COMMANDS: dict[str, Callable[[Path, Path], list[str]]] = {
    "train --resume": lambda run, tmp: ["train", "--resume", str(run), "--nproc", "1"],
    "sample": lambda run, tmp: ["sample", "--ckpt", str(run), "--tokens", "4"],
    "export": lambda run, tmp: ["export", "--ckpt", str(run), "--out", str(tmp / "exported")],
}


def _snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in run.rglob("*") if p.is_file()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", list(CRAFTS))
def test_no_command_runs_a_crafted_checkpoint(what: str, run: Path, tmp_path: Path, capsys):
    from shardwise_app.cli.main import main

    crafted, marker = tmp_path / "run", tmp_path / "marker"
    shutil.copytree(run, crafted)
    expected = CRAFTS[what](crafted, marker)
    if what not in ("checksums", "config"):
        (_ckpt(crafted) / SUMS).unlink()  # a checkpoint without checksums loads, unverified
    before = _snapshot(crafted)
    for command, args in COMMANDS.items():
        for given in (crafted, _ckpt(crafted)):  # the run folder, or the checkpoint by name
            if what == "config" and given != crafted:
                continue  # the same config.json, found from the checkpoint
            assert main(args(given, tmp_path)) == 2, command
            err = capsys.readouterr().err
            assert len(err.strip().splitlines()) == 1, err
            name = command.split()[0]
            assert err.startswith(f"shardwise {name}: error: "), err
            assert expected in err, err
            assert not marker.exists(), f"{command} ran the crafted {what}"
    assert _snapshot(crafted) == before
    assert not (tmp_path / "exported").exists()


@pytest.mark.timeout(120)
def test_sample_of_a_crafted_checkpoint_as_a_person_runs_it(run: Path, tmp_path: Path) -> None:
    """The same as a separate process: one line on stderr, exit 2, no marker."""
    crafted, marker = tmp_path / "run", tmp_path / "marker"
    shutil.copytree(run, crafted)
    expected = _craft_metadata(crafted, marker)
    (_ckpt(crafted) / SUMS).unlink()
    r = shardwise("sample", "--ckpt", str(crafted), "--tokens", "4", cwd=tmp_path, timeout=90)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and r.stdout == "", r.stdout + r.stderr
    assert expected in lines[0]
    assert not marker.exists()
