"""A checkpoint cannot run code: loading a folder someone else wrote runs nothing from it.

Each file shardwise reads is replaced by one whose unpickling would create a
marker file (what a crafted checkpoint would do with ``os.system``), with the
checksums left out or rewritten to match, as whoever crafts one would. The
loaders refuse it in one line, the marker never appears and the model keeps
its values; the same file, read as torch reads it, does create the marker,
so the test shows the danger is real. A checkpoint saved by the previous
format (tests/library/checkpoint/fixtures/checkpoint_format2) still loads, bit for bit.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import pickle
import random
import shutil
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

import shardwise
from dist_utils import run_distributed
from shardwise import checkpoint
from shardwise.checkpoint import DamagedCheckpoint, UnsafeCheckpoint

SUMS = "shardwise_checksums.json"
EXTRA = "shardwise_extra.pt"
FIXTURES = Path(__file__).parent / "fixtures"

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Touch:
    """Unpickling this creates ``marker``: any callable would run as easily."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


class System:
    """Unpickling this runs a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))


def _trained(model: nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return opt


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _rewrite_sums(folder: Path) -> None:
    """What whoever crafts a checkpoint does: checksums that match the crafted files."""
    files = {}
    for f in sorted(folder.iterdir()):
        if f.name != SUMS:
            data = f.read_bytes()
            files[f.name] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    (folder / SUMS).write_text(json.dumps({"format": 1, "algorithm": "crc32", "files": files}))


# ---- crafting: each file we read, made to run code ------------------------------------------


def _craft_extra(folder: Path, marker: Path) -> str:
    payload = torch.load(folder / EXTRA, weights_only=True)
    payload["extra"] = {"step": 3, "hook": Touch(marker)}
    torch.save(payload, folder / EXTRA)
    return "builtins.getattr"  # how protocol 2 (torch.save's) spells Path.touch


def _craft_extra_raw(folder: Path, marker: Path) -> str:
    """Not a torch.save file at all: a raw pickle (protocol 5), os.system by STACK_GLOBAL."""
    (folder / EXTRA).write_bytes(pickle.dumps({"format": 3, "extra": System(marker)}, protocol=5))
    return f"{os.system.__module__}.system"


def _craft_metadata(folder: Path, marker: Path) -> str:
    with open(folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own honest file, read as torch reads it
    metadata.planner_data = {"model.0.weight": System(marker)}
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    return f"{os.system.__module__}.system"


def _craft_metadata_touch(folder: Path, marker: Path) -> str:
    with open(folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    metadata.storage_meta.modules = [Touch(marker)]
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    return "pathlib.Path.touch"


def _craft_sums(folder: Path, marker: Path) -> str:
    (folder / SUMS).write_bytes(pickle.dumps(System(marker)))
    return ""


CRAFTS = {
    "extra": _craft_extra,
    "extra as a raw pickle": _craft_extra_raw,
    "metadata": _craft_metadata,
    "metadata, Path.touch": _craft_metadata_touch,
    "checksums": _craft_sums,
}


def _read_as_torch_does(folder: Path, what: str) -> None:
    """The crafted file, read as torch.load(weights_only=False) / DCP's pickle.load would."""
    try:
        if what.startswith("extra"):
            torch.load(folder / EXTRA, weights_only=False)
        elif what.startswith("metadata"):
            dcp.FileSystemReader(str(folder)).read_metadata()
        else:
            pickle.loads((folder / SUMS).read_bytes())
    except Exception:  # noqa: BLE001 - a raw pickle is no torch.save file: it ran, then failed
        pass


# The checksums file itself is crafted in one case: no other checksums to leave out.
CASES = [(w, s) for w in CRAFTS for s in ("left out", "rewritten") if w != "checksums"]


@pytest.mark.parametrize(("what", "sums"), [*CASES, ("checksums", "crafted")])
def test_a_crafted_file_runs_nothing_and_loads_nothing(what: str, sums: str, tmp_path: Path):
    model = _net()
    opt = _trained(model)
    folder, marker = tmp_path / "ck", tmp_path / "marker"
    checkpoint.save(folder, model, opt, extra={"step": 3})
    names = CRAFTS[what](folder, marker)
    if what != "checksums":
        (folder / SUMS).unlink()
        if sums == "rewritten":
            _rewrite_sums(folder)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # so that a load would show
    before = _weights(model)
    state_before = {k: v.clone() for k, v in opt.state[next(iter(model.parameters()))].items()}

    for load in (
        lambda: checkpoint.verify(folder),
        lambda: checkpoint.load(folder, model, opt),
        lambda: checkpoint.load(folder, model),
    ):
        expected = DamagedCheckpoint if what == "checksums" else UnsafeCheckpoint
        with pytest.raises(expected) as info:
            load()
        message = str(info.value)
        assert "\n" not in message, message
        if expected is UnsafeCheckpoint:
            assert message.startswith(str(folder)) and "would run code" in message, message
            assert f"it calls {names}," in message, message
        else:
            assert message == f"{folder / SUMS} is unreadable (UnicodeDecodeError)", message
        assert not marker.exists(), f"loading ran the crafted {what}"
        after = _weights(model)
        assert all(torch.equal(after[k], before[k]) for k in before), "the model changed"
        state = opt.state[next(iter(model.parameters()))]
        assert all(torch.equal(state[k], state_before[k]) for k in state_before)

    _read_as_torch_does(folder, what)  # the danger is real: read the torch way, it runs
    assert marker.exists()


def test_a_crafted_optimizer_item_runs_nothing(tmp_path: Path) -> None:
    """DCP's non-tensor items (param groups) are torch.save bytes that DCP reads with
    weights_only=False: checked before any tensor is copied, and read safely by the load."""
    model = _net()
    opt = _trained(model)
    folder, marker = tmp_path / "ck", tmp_path / "marker"
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    state["optim"]["param_groups"][0]["lr"] = Touch(marker)
    dcp.save(state, checkpoint_id=folder, no_dist=True)  # a plain DCP checkpoint, no checksums
    before = _weights(model)
    for load in (lambda: checkpoint.verify(folder), lambda: checkpoint.load(folder, model, opt)):
        with pytest.raises(UnsafeCheckpoint) as info:
            load()
        message = str(info.value)
        assert "\n" not in message and "(item 'optim.param_groups.0.lr')" in message, message
        assert "it calls builtins.getattr," in message, message
        assert not marker.exists()
        assert all(torch.equal(v, before[k]) for k, v in _weights(model).items())
    # The planner alone also refuses it (a folder that changed after the check).
    from shardwise.safe_load import SafeFileSystemReader, SafeLoadPlanner

    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    with pytest.raises(BaseException, match="would run code"):  # DCP's CheckpointException
        dcp.load(
            state,
            storage_reader=SafeFileSystemReader(str(folder)),
            planner=SafeLoadPlanner(),
            no_dist=True,
        )
    assert not marker.exists()
    dcp.load(state, checkpoint_id=folder, no_dist=True)  # torch's own reader runs it
    assert marker.exists()


def _crafted_at_two_ranks(rank: int, world: int, root: str) -> str:
    folder, marker = Path(root) / "ck", Path(root) / "marker"
    model = _net()
    for layer in model:
        if isinstance(layer, nn.Linear):
            shardwise.fully_shard(layer)
    shardwise.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters())
    checkpoint.save(folder, model, opt, extra={"step": 1})
    if rank == 0:
        _craft_metadata(folder, marker)
        (folder / SUMS).unlink()
    dist.barrier()
    before = {k: v.full_tensor() for k, v in model.state_dict().items()}
    with pytest.raises(UnsafeCheckpoint) as info:
        checkpoint.load(folder, model, opt)
    assert not marker.exists()
    after = {k: v.full_tensor() for k, v in model.state_dict().items()}
    assert all(torch.equal(after[k], before[k]) for k in before)
    return str(info.value)


@pytest.mark.timeout(120)
def test_every_rank_refuses_a_crafted_checkpoint(tmp_path: Path) -> None:
    messages = run_distributed(_crafted_at_two_ranks, 2, str(tmp_path), timeout=100)
    assert messages[0] == messages[1]
    assert messages[0].startswith(f"{tmp_path / 'ck' / '.metadata'} would run code")


# ---- what save accepts in extra ---------------------------------------------------------------


class Step:
    pass


@pytest.mark.parametrize(
    ("extra", "where", "kind"),
    [
        ({"step": np.int64(3)}, "extra['step']", "numpy.int64"),
        ({"data": {"order": np.arange(3)}}, "extra['data']['order']", "numpy.ndarray"),
        ([1, {"s": Step()}], "extra[1]['s']", f"{__name__}.Step"),
        ({"sched": {"fn": len}}, "extra['sched']['fn']", "builtins.builtin_function_or_method"),
        ({"gen": (i for i in range(2))}, "extra['gen']", "builtins.generator"),
        (Step(), "extra", f"{__name__}.Step"),
    ],
)
def test_save_refuses_an_extra_that_would_need_code_to_load(
    extra: Any, where: str, kind: str, tmp_path: Path
) -> None:
    model = _net()
    path = tmp_path / "ck"
    checkpoint.save(path, model, extra={"step": 1})
    saved = {f.name: f.read_bytes() for f in path.iterdir()}
    with pytest.raises(TypeError) as info:
        checkpoint.save(path, model, extra=extra)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{where} is a {kind}: "), message
    # Refused before anything was written: the previous checkpoint is as it was.
    assert {f.name: f.read_bytes() for f in path.iterdir()} == saved
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_every_plain_kind_of_extra_comes_back(tmp_path: Path) -> None:
    extra = {
        "step": 7,
        "lr": 3e-4,
        "name": "run",
        "none": None,
        "flag": True,
        "z": 1 + 2j,
        "raw": b"\x00\x01",
        "pos": (1, [2, 3], {4, 5}),
        "ordered": OrderedDict(a=1),
        1: "int key",
        "t": torch.arange(4, dtype=torch.bfloat16),
        "dtype": torch.float16,
        "device": torch.device("cpu"),
        "size": torch.Size([2, 3]),
    }
    model = _net()
    checkpoint.save(tmp_path / "ck", model, extra=extra)
    assert torch.serialization.get_unsafe_globals_in_checkpoint(tmp_path / "ck" / EXTRA) == []
    back = checkpoint.load(tmp_path / "ck", model)
    assert torch.equal(back.pop("t"), extra.pop("t")) and back == extra


def test_a_folder_of_the_previous_format_loads(tmp_path: Path) -> None:
    """Saved by format 2 (NumPy's RNG state as a pickled array): weights, optimizer state,
    extra and every RNG come back as they were saved."""
    expected = json.loads((FIXTURES / "checkpoint_format2.json").read_text())
    folder = tmp_path / "old"
    shutil.copytree(FIXTURES / "checkpoint_format2", folder)
    assert torch.load(folder / EXTRA, weights_only=False)["format"] == 2
    checkpoint.verify(folder)
    model = nn.Linear(3, 2)
    opt = _trained_linear(model)
    extra = checkpoint.load(folder, model, opt)
    assert extra == expected["extra"]
    for k, v in model.state_dict().items():
        assert v.flatten().tolist() == expected["weights"][k], k
    for k, p in model.named_parameters():
        assert opt.state[p]["exp_avg"].flatten().tolist() == expected["exp_avg"][k], k
    assert torch.rand(3).tolist() == expected["torch_rng_next"]
    assert random.random() == expected["python_rng_next"]
    assert float(np.random.rand()) == expected["numpy_rng_next"]


def _trained_linear(model: nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return opt


def test_rng_states_are_saved_as_plain_data_and_come_back(tmp_path: Path) -> None:
    model = _net()
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    np.random.randn()  # a cached Gaussian: has_gauss=1 must survive too
    checkpoint.save(tmp_path / "ck", model)
    drawn = (torch.rand(4), random.random(), np.random.randn(3))
    torch.manual_seed(9)
    random.seed(9)
    np.random.seed(9)
    payload = torch.load(tmp_path / "ck" / EXTRA, weights_only=True)  # no safe_globals needed
    rng = payload["rng"][0]
    assert payload["format"] == 3 and isinstance(rng["numpy"]["key"], torch.Tensor)
    assert isinstance(rng["python"]["words"], torch.Tensor)  # fast to read, unlike 625 ints
    checkpoint.load(tmp_path / "ck", model)
    assert torch.equal(torch.rand(4), drawn[0]) and random.random() == drawn[1]
    assert np.array_equal(np.random.randn(3), drawn[2])


def test_what_the_metadata_reader_admits(tmp_path: Path) -> None:
    """Plain dtypes and DCP's own classes, nothing else: not even a harmless-looking
    builtin, since a pickle calls what it names with arguments of its choosing."""
    from shardwise.safe_load import read_metadata

    folder = tmp_path / "ck"
    checkpoint.save(folder, _net().to(torch.bfloat16))
    metadata = read_metadata(folder / ".metadata")
    assert metadata.state_dict_metadata["model.0.weight"].properties.dtype == torch.bfloat16
    with open(folder / ".metadata", "rb") as f:
        honest = pickle.load(f)
    for smuggled, name in [(io.BytesIO, "_io.BytesIO"), (eval, "builtins.eval")]:
        honest.planner_data = {"x": smuggled}
        (folder / ".metadata").write_bytes(pickle.dumps(honest))
        with pytest.raises(UnsafeCheckpoint, match=f"it calls {name},"):
            read_metadata(folder / ".metadata")
    (folder / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    (folder / SUMS).unlink()
    with pytest.raises(DamagedCheckpoint, match=r"\.metadata is unreadable \(UnpicklingError\)$"):
        checkpoint.verify(folder)


def test_metadata_naming_a_file_outside_the_folder_is_refused(tmp_path: Path) -> None:
    """DCP writes plain file names; one that leads out of the folder is never opened."""
    import dataclasses

    folder = tmp_path / "ck"
    checkpoint.save(folder, _net())
    with open(folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    index, info = next(iter(metadata.storage_data.items()))
    metadata.storage_data[index] = dataclasses.replace(info, relative_path="../elsewhere")
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    _rewrite_sums(folder)
    with pytest.raises(DamagedCheckpoint, match="names a data file outside the folder: '../"):
        checkpoint.load(folder, _net())
