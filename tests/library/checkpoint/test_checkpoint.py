"""Checkpointing: exact resume, resharding, full state dicts, FSDP2 interop, crash safety.

Workers run on real gloo ranks (tests/dist_utils.py) and must live at module
level. Tensors come back to the test as numpy arrays: a tensor sent through the
result queue lives in shared memory that dies with its worker.

Every global batch is the same at every world size (each rank takes its slice
of 12 samples), so runs at different world sizes train the same model and
their losses agree up to fp32 rounding.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import shardwise
from dist_utils import Outcome, run_distributed, run_tasks
from shardwise import checkpoint

D_IN, D, H = 5, 6, 10
GLOBAL_BATCH = 12  # divisible by 2, 3 and 4
K = 3  # steps before and after the checkpoint

# name -> (dropout, HSDP, mixed precision). Dropout makes exact resume depend on RNG states.
CONFIGS = {
    "adamw": (0.1, False, False),
    "mixed": (0.1, False, True),
    "hsdp": (0.1, True, False),
    "nodrop": (0.0, False, False),  # comparable across world sizes
}


class PostNormBlock(nn.Module):
    def __init__(self, dropout: float, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, hidden)
        self.fc2 = nn.Linear(hidden, D)
        self.norm = nn.LayerNorm(D)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.drop(self.fc2(torch.relu(self.fc1(x)))))


class PostNormNet(nn.Module):
    """Shapes chosen for uneven and empty shards: 10, 6 and 1 rows over 2, 3, 4 ranks."""

    def __init__(self, dropout: float = 0.0, hidden: int = H, blocks: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.blocks = nn.ModuleList([PostNormBlock(dropout, hidden) for _ in range(blocks)])
        self.head = nn.Linear(D, 1)
        self.register_buffer("scale", torch.tensor([1.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h) * self.scale


class PostNormNetPlus(PostNormNet):
    """One parameter more than PostNormNet."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(2, 3)


def shard(model: nn.Module, mesh: Any = None, mp: bool = False, fsdp2: bool = False) -> nn.Module:
    if fsdp2:
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        for b in model.blocks:  # type: ignore[union-attr]
            torch_fully_shard(b)
        torch_fully_shard(model)
        return model
    policy = shardwise.MixedPrecisionPolicy(torch.bfloat16, torch.float32) if mp else None
    for b in model.blocks:  # type: ignore[union-attr]
        shardwise.fully_shard(b, mesh=mesh, mp_policy=policy)
    shardwise.fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def build(
    name: str, world: int, seed: int, device: str = "cpu"
) -> tuple[nn.Module, torch.optim.Optimizer]:
    dropout, hsdp, mp = CONFIGS[name]
    torch.manual_seed(seed)
    mesh = init_device_mesh(device, (2, world // 2)) if hsdp else None
    model = shard(PostNormNet(dropout).to(device), mesh=mesh, mp=mp)
    return model, torch.optim.AdamW(model.parameters(), lr=0.02)


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, D_IN, generator=g)
    y = torch.randn(GLOBAL_BATCH, 1, generator=g)
    per = GLOBAL_BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    """Global mean losses of ``steps``; the data depends on the step only."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = model.scale.device  # type: ignore[union-attr]
    losses = []
    for step in steps:
        x, y = (t.to(device) for t in batch(step, rank, world))
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append((total / world).item())
    return losses


def weights(model: nn.Module) -> dict[str, np.ndarray]:
    out = {}
    for k, v in model.state_dict().items():
        out[k] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().numpy().copy()
    return out


def opt_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, np.ndarray]:
    osd = get_optimizer_state_dict(model, opt)
    return {
        f"{fqn}.{n}": (v.full_tensor() if isinstance(v, DTensor) else v).cpu().numpy().copy()
        for fqn, entries in osd["state"].items()
        for n, v in entries.items()
    }


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def close(a: dict[str, np.ndarray], b: dict[str, np.ndarray], tol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=tol, atol=tol, err_msg=k)


def expect_error(fn: Any, *needles: str) -> str:
    try:
        fn()
    except ValueError as e:
        for n in needles:
            assert n in str(e), f"{n!r} not in error:\n{e}"
        return str(e)
    raise AssertionError(f"no ValueError (expected one mentioning {needles})")


def extra_for(step: int) -> dict[str, Any]:
    return {"step": step, "data": {"epoch": 0, "sample": step * GLOBAL_BATCH}}


# ---- grouped runs: spawning ranks costs seconds, so each run does several checks ---------------


def result(run: dict[str, Outcome], label: str) -> Any:
    """Rank 0's value of one task; fails the test with each failing rank's traceback."""
    if run[label].error is not None:
        pytest.fail(f"task {label!r} failed:\n{run[label].error}", pytrace=False)
    return run[label].value


def _train_save_continue(rank: int, world: int, name: str, path: str) -> Any:
    """K steps, save, K more: the uninterrupted run a resume is compared with."""
    model, opt = build(name, world, seed=0)
    torch.manual_seed(100 + rank)  # per-rank dropout streams
    first = train(model, opt, range(K))
    checkpoint.save(path, model, opt, extra=extra_for(K))
    at_save = weights(model)
    after, final = train(model, opt, range(K, 2 * K)), weights(model)
    if name == "hsdp":  # the export path on a 2-D mesh
        fsd = checkpoint.full_state_dict(model, rank0_only=False)
        assert same({k: v.numpy() for k, v in fsd.items()}, final)
    return first, after, final, at_save


def _load_continue(rank: int, world: int, name: str, path: str) -> Any:
    """Another init and RNG state (fresh processes, or at 4 ranks the ones that saved
    after training on): load, then the same K steps."""
    model, opt = build(name, world, seed=7)
    torch.manual_seed(999)
    extra = checkpoint.load(path, model, opt)
    assert extra == extra_for(K), extra
    return train(model, opt, range(K, 2 * K)), weights(model)


def _load_weights(rank: int, world: int, name: str, path: str) -> dict[str, np.ndarray]:
    model, opt = build(name, world, seed=7)
    checkpoint.load(path, model, opt)
    return weights(model)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def first2(root: Path) -> dict[str, Outcome]:
    tasks = [
        (f"save {n}", _train_save_continue, (n, f"{root}/w2/{n}"))
        for n in ("adamw", "mixed", "nodrop")
    ]
    tasks += [
        (fn.__name__, fn, (str(root / fn.__name__),))
        for fn in (_interop, _bad_input, _failed_save, _gathered_save)
    ]
    return run_tasks(tasks, 2, timeout=240, stop_after_failure=True, agree=True)


@pytest.fixture(scope="module")
def first4(root: Path, first2: Any) -> dict[str, Outcome]:
    """Saves at 4 ranks, then loads into 4-rank models in the same processes (a second set
    of 4 processes costs the suite ~15 s of startup; the loads at 2 and 3 ranks are fresh)."""
    tasks = [(f"save {n}", _train_save_continue, (n, f"{root}/w4/{n}")) for n in ("hsdp", "nodrop")]
    tasks += [
        ("load hsdp", _load_continue, ("hsdp", f"{root}/w4/hsdp")),
        ("load fsdp into hsdp", _load_weights, ("hsdp", f"{root}/w2/nodrop")),
    ]
    return run_tasks(tasks, 4, timeout=180, stop_after_failure=True, agree=True)


@pytest.fixture(scope="module")
def second2(root: Path, first2: Any, first4: Any) -> dict[str, Outcome]:
    tasks = [(f"load {n}", _load_continue, (n, f"{root}/w2/{n}")) for n in ("adamw", "mixed")]
    tasks += [("load nodrop from 4", _load_continue, ("nodrop", f"{root}/w4/nodrop"))]
    tasks += [("load hsdp into fsdp", _load_weights, ("adamw", f"{root}/w4/hsdp"))]
    return run_tasks(tasks, 2, timeout=180, stop_after_failure=True, agree=True)


@pytest.fixture(scope="module")
def second3(root: Path, first2: Any) -> dict[str, Outcome]:
    torch.manual_seed(0)
    ref_file = str(root / "plain.pt")
    torch.save(PostNormNet().state_dict(), ref_file)  # a plain single-process checkpoint
    tasks = [  # 3 ranks: some shards are empty
        ("load nodrop from 2", _load_continue, ("nodrop", f"{root}/w2/nodrop")),
        ("full state dict", _full_state_dict, (ref_file,)),
    ]
    return run_tasks(tasks, 3, timeout=180, stop_after_failure=True, agree=True)


@pytest.fixture(scope="module")
def second4(first4: Any) -> dict[str, Outcome]:
    return first4  # the 4-rank loads ran after the saves (see first4)


def _assert_bitwise(before: Any, after: Any) -> None:
    _, losses, final, _ = before
    assert after[0] == losses  # == on floats: bitwise
    assert same(after[1], final)


def test_exact_resume_adamw_and_mixed_precision(first2: Any, second2: Any) -> None:
    for name in ("adamw", "mixed"):
        before = result(first2, f"save {name}")
        assert before[0] != before[1]  # it did train
        result(second2, f"load {name}")
        for value in second2[f"load {name}"].values:  # every rank continues identically
            _assert_bitwise(before, value)


def test_exact_resume_hsdp(first4: Any, second4: Any) -> None:
    before = result(first4, "save hsdp")
    result(second4, "load hsdp")
    for value in second4["load hsdp"].values:
        _assert_bitwise(before, value)


@pytest.mark.parametrize("saved,resumed", [("first4", "second2"), ("first2", "second3")])
def test_reshard(saved: str, resumed: str, request: pytest.FixtureRequest) -> None:
    """4 -> 2 and 2 -> 3 ranks: the same losses as the uninterrupted run, up to fp32 rounding."""
    _, expected_losses, expected, _ = result(request.getfixturevalue(saved), "save nodrop")
    world = saved[-1]
    losses, final = result(request.getfixturevalue(resumed), f"load nodrop from {world}")
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5, atol=1e-6)
    close(final, expected)


def test_checkpoints_move_between_hsdp_fsdp_and_plain_models(
    root: Path, first2: Any, first4: Any, second2: Any, second4: Any
) -> None:
    assert same(result(second4, "load fsdp into hsdp"), result(first2, "save nodrop")[3])
    at_save = result(first4, "save hsdp")[3]
    assert same(result(second2, "load hsdp into fsdp"), at_save)
    plain = PostNormNet(0.1)  # one process, no torch.distributed
    assert checkpoint.load(root / "w4" / "hsdp", plain, restore_rng=False) == extra_for(K)
    assert same({k: v.numpy() for k, v in plain.state_dict().items()}, at_save)


# ---- full state dicts -----------------------------------------------------------------------


def _full_state_dict(rank: int, world: int, ref_file: str) -> None:
    ref = torch.load(ref_file)
    torch.manual_seed(0)  # the same init as the reference
    model = shard(PostNormNet())
    fsd = checkpoint.full_state_dict(model)
    if rank == 0:
        assert list(fsd) == list(ref) and all(torch.equal(fsd[k], ref[k]) for k in ref)
    else:
        assert fsd == {}
    every = checkpoint.full_state_dict(model, cpu_offload=False, rank0_only=False)
    assert list(every) == list(ref) and all(torch.equal(every[k], ref[k]) for k in ref)
    for v in every.values():
        v.add_(1.0)  # an export never aliases the model
    assert same(weights(model), {k: v.numpy() for k, v in ref.items()})

    # Round trip after training: export, shard into a fresh model (rank 0 only), export again.
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    train(model, opt, range(2))
    trained = checkpoint.full_state_dict(model, rank0_only=False)
    torch.manual_seed(5)
    fresh = shard(PostNormNet())
    ptrs = [p.to_local().data_ptr() for p in fresh.parameters()]
    checkpoint.load_full_state_dict(fresh, trained if rank == 0 else None)
    assert [p.to_local().data_ptr() for p in fresh.parameters()] == ptrs  # in place
    again = checkpoint.full_state_dict(fresh, rank0_only=False)
    assert all(torch.equal(again[k], trained[k]) for k in trained)
    plain = PostNormNet()
    plain.load_state_dict(trained)  # any PyTorch code can load an export
    x = batch(0, 0, 1)[0]
    torch.testing.assert_close(fresh(x), plain(x))

    # A plain torch.save'd single-process checkpoint, passed on every rank.
    torch.manual_seed(9)
    other = shard(PostNormNet())
    checkpoint.load_full_state_dict(other, torch.load(ref_file))
    assert same(weights(other), {k: v.numpy() for k, v in ref.items()})

    # Meta-device init, then weights from rank 0: the usual way to start from an export.
    with torch.device("meta"):
        meta = PostNormNet()
    shard(meta)
    meta.to_empty(device="cpu")
    checkpoint.load_full_state_dict(meta, torch.load(ref_file) if rank == 0 else None)
    reference = PostNormNet()
    reference.load_state_dict(torch.load(ref_file))
    torch.testing.assert_close(meta(x), reference(x))


def test_full_state_dict_round_trip(second3: Any) -> None:
    result(second3, "full state dict")


# ---- torch FSDP2 interoperability -------------------------------------------------------------


def _interop(rank: int, world: int, root: str) -> None:
    # The state dict contract: original names, DTensor parameters, plain buffers.
    torch.manual_seed(0)
    ours = shard(PostNormNet())
    sd = ours.state_dict()
    assert list(sd) == list(PostNormNet().state_dict())
    for k, v in sd.items():
        if k == "scale":
            assert type(v) is torch.Tensor
        else:
            assert isinstance(v, DTensor) and v.placements == (Shard(0),), k
    # dcp.save/load and load_state_dict work on it directly, in place.
    dcp.save(sd, checkpoint_id=f"{root}/raw")
    torch.manual_seed(1)
    fresh = shard(PostNormNet())
    ptrs = [p.to_local().data_ptr() for p in fresh.parameters()]
    fresh_sd = fresh.state_dict()
    dcp.load(fresh_sd, checkpoint_id=f"{root}/raw")
    fresh.load_state_dict(fresh_sd)
    assert [p.to_local().data_ptr() for p in fresh.parameters()] == ptrs
    assert same(weights(fresh), weights(ours))

    # FSDP2 -> shardwise: DCP's usual {"model", "optim"} layout, then a flat model-only one.
    torch.manual_seed(0)
    theirs = shard(PostNormNet(), fsdp2=True)
    topt = torch.optim.AdamW(theirs.parameters(), lr=0.02)
    train(theirs, topt, range(2))
    dcp.save(
        {"model": get_model_state_dict(theirs), "optim": get_optimizer_state_dict(theirs, topt)},
        checkpoint_id=f"{root}/fsdp2",
    )
    dcp.save(theirs.state_dict(), checkpoint_id=f"{root}/fsdp2_flat")
    at_step2 = weights(theirs)
    torch.manual_seed(5)
    ours = shard(PostNormNet())
    opt = torch.optim.AdamW(ours.parameters(), lr=0.02)
    assert checkpoint.load(f"{root}/fsdp2", ours, opt) is None  # no extra in a plain DCP folder
    assert same(weights(ours), weights(theirs))
    assert same(opt_state(ours, opt), opt_state(theirs, topt))
    np.testing.assert_allclose(
        train(ours, opt, range(2, 4)), train(theirs, topt, range(2, 4)), rtol=1e-6
    )
    torch.manual_seed(6)
    flat = shard(PostNormNet())
    checkpoint.load(f"{root}/fsdp2_flat", flat)
    assert same(weights(flat), at_step2)

    # shardwise -> FSDP2, with DCP's own calls on the FSDP2 side.
    checkpoint.save(f"{root}/ours", ours, opt, extra={"step": 4})
    torch.manual_seed(7)
    back = shard(PostNormNet(), fsdp2=True)
    bopt = torch.optim.AdamW(back.parameters(), lr=0.02)
    state = {"model": get_model_state_dict(back), "optim": get_optimizer_state_dict(back, bopt)}
    dcp.load(state, checkpoint_id=f"{root}/ours")
    set_model_state_dict(back, state["model"])
    set_optimizer_state_dict(back, bopt, state["optim"])
    assert same(weights(back), weights(ours))
    assert same(opt_state(back, bopt), opt_state(ours, opt))
    torch.manual_seed(8)  # and our helper on an FSDP2 model
    helper = shard(PostNormNet(), fsdp2=True)
    hopt = torch.optim.AdamW(helper.parameters(), lr=0.02)
    assert checkpoint.load(f"{root}/ours", helper, hopt) == {"step": 4}
    assert same(weights(helper), weights(ours))
    assert same(opt_state(helper, hopt), opt_state(ours, opt))
    np.testing.assert_allclose(
        train(back, bopt, range(4, 6)), train(ours, opt, range(4, 6)), rtol=1e-6
    )


def test_state_dict_contract_and_fsdp2_interop(first2: Any) -> None:
    result(first2, "_interop")


# ---- interrupted saves ------------------------------------------------------------------------


def _gathered_save(rank: int, world: int, root: str) -> None:
    """A module left gathered (no reshard after backward) still saves its fp32 shards."""
    torch.manual_seed(0)
    model = shard(PostNormNet(), mp=True)
    model.set_reshard_after_backward(False)  # type: ignore[operator]
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    train(model, opt, range(2))
    checkpoint.save(f"{root}/gathered", model, opt)
    expected = weights(model)
    torch.manual_seed(1)
    fresh, fopt = build("nodrop", world, seed=1)
    checkpoint.load(f"{root}/gathered", fresh, fopt)
    assert same(weights(fresh), expected)


def _failed_save(rank: int, world: int, root: str) -> None:
    path = Path(root) / "ck"
    model, opt = build("nodrop", world, seed=0)
    train(model, opt, range(1))
    checkpoint.save(path, model, opt, extra=extra_for(1))
    v1 = weights(model)
    train(model, opt, range(1, 2))

    # Rank 1's writer dies after writing its data, before DCP's metadata exists.
    original = dcp.FileSystemWriter.write_data

    def broken(self: Any, plan: Any, planner: Any) -> Any:
        written = original(self, plan, planner)
        if rank == 1:
            raise OSError("disk full (simulated)")
        return written

    dcp.FileSystemWriter.write_data = broken  # type: ignore[method-assign]
    try:
        checkpoint.save(path, model, opt, extra=extra_for(2))
    except BaseException as e:  # noqa: BLE001 - DCP raises CheckpointException (a BaseException)
        assert "disk full" in str(e), e
    else:
        raise AssertionError("the broken save did not raise")
    finally:
        dcp.FileSystemWriter.write_data = original  # type: ignore[method-assign]

    # Rank 0 fails while committing: an unpicklable extra. Every rank must raise.
    try:
        checkpoint.save(path, model, opt, extra={"step": 2, "oops": lambda: None})
    except Exception as e:  # noqa: BLE001
        assert rank == 0 or "rank 0" in str(e), e
    else:
        raise AssertionError("the unpicklable extra did not raise")

    dist.barrier()
    assert sorted(os.listdir(path.parent)) == ["ck", "ck.partial"]
    fresh, fopt = build("nodrop", world, seed=3)
    assert checkpoint.load(path, fresh, fopt) == extra_for(1)
    assert same(weights(fresh), v1)

    # The next good save replaces it and leaves nothing else behind.
    checkpoint.save(path, model, opt, extra=extra_for(2))
    dist.barrier()
    assert sorted(os.listdir(path.parent)) == ["ck"]
    assert checkpoint.load(path, fresh, fopt) == extra_for(2)
    assert same(weights(fresh), weights(model))


def _killed_save(rank: int, world: int, root: str) -> None:
    model, opt = build("nodrop", world, seed=0)
    checkpoint.save(f"{root}/ck", model, opt, extra=extra_for(1))
    original = dcp.FileSystemWriter.write_data

    def killed(self: Any, plan: Any, planner: Any) -> Any:
        original(self, plan, planner)
        os._exit(1)  # killed half-way: data written, no metadata, no extra, no rename

    dcp.FileSystemWriter.write_data = killed  # type: ignore[method-assign]
    checkpoint.save(f"{root}/ck", model, opt, extra=extra_for(2))


def test_failed_save_keeps_previous_checkpoint(first2: Any) -> None:
    result(first2, "_failed_save")


def test_save_of_a_gathered_module(first2: Any) -> None:
    result(first2, "_gathered_save")


def test_killed_save_keeps_previous_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="crashed"):
        run_distributed(_killed_save, 1, str(tmp_path), timeout=60)
    path = tmp_path / "ck"
    assert (path / ".metadata").is_file() and (tmp_path / "ck.partial").is_dir()
    # Read back without torch.distributed: a plain model loads a sharded checkpoint.
    plain = PostNormNet()
    assert checkpoint.load(path, plain) == extra_for(1)
    checkpoint.save(path, plain, extra=extra_for(2))
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_crash_between_renames_falls_back_and_recovers(tmp_path: Path) -> None:
    """Single process, no torch.distributed: the commit's one window without ``path``."""
    path = tmp_path / "ck"
    torch.manual_seed(0)
    model = PostNormNet()
    checkpoint.save(path, model, extra=1)
    path.rename(tmp_path / "ck.previous")  # as if killed between the two renames
    other = PostNormNet()
    with pytest.warns(UserWarning, match="interrupted"):
        assert checkpoint.load(path, other) == 1
    assert all(
        torch.equal(a, b) for a, b in zip(other.state_dict().values(), model.state_dict().values())
    )
    checkpoint.save(path, model, extra=2)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert checkpoint.load(path, other) == 2

    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("not a checkpoint")
    with pytest.raises(FileExistsError, match="not a checkpoint"):
        checkpoint.save(tmp_path / "notes", model)
    assert (tmp_path / "notes" / "todo.txt").read_text() == "not a checkpoint"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile's own imports
def test_compiled_model_uses_plain_names(tmp_path: Path) -> None:
    torch.manual_seed(0)
    compiled = torch.compile(PostNormNet())  # wrapped only: nothing is compiled or run
    checkpoint.save(tmp_path / "ck", compiled, extra=1)
    plain = PostNormNet()
    assert checkpoint.load(tmp_path / "ck", plain, restore_rng=False) == 1
    exported = checkpoint.full_state_dict(compiled)
    assert list(exported) == list(plain.state_dict())  # no "_orig_mod." prefix
    assert all(torch.equal(v, exported[k]) for k, v in plain.state_dict().items())


# ---- bad input --------------------------------------------------------------------------------


def _bad_input(rank: int, world: int, root: str) -> None:
    model, opt = build("nodrop", world, seed=0)
    train(model, opt, range(1))
    checkpoint.save(f"{root}/ck", model, opt, extra=extra_for(1))
    checkpoint.save(f"{root}/model_only", model)
    good = checkpoint.full_state_dict(model, rank0_only=False)

    def victim(net: nn.Module, steps: int = 1) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        torch.manual_seed(3)
        m = shard(net)
        o = torch.optim.AdamW(m.parameters(), lr=0.02)
        train(m, o, range(steps))  # optimizer state exists: it must survive a failed load too
        return m, o, (weights(m), opt_state(m, o))

    def unchanged(m: nn.Module, o: torch.optim.Optimizer, snap: Any) -> None:
        assert same(weights(m), snap[0]) and same(opt_state(m, o), snap[1])

    ck = f"{root}/ck"
    m, o, snap = victim(PostNormNet(hidden=12))
    expect_error(
        lambda: checkpoint.load(ck, m, o),
        "'blocks.0.fc1.weight' has shape [10, 6] in the checkpoint but [12, 6]",
    )
    unchanged(m, o, snap)
    m, o, snap = victim(PostNormNetPlus())
    expect_error(lambda: checkpoint.load(ck, m, o), "'extra.weight' is missing", "[3, 2]")
    unchanged(m, o, snap)
    m, o, snap = victim(PostNormNet(blocks=1))
    expect_error(
        lambda: checkpoint.load(ck, m, o),
        "'blocks.1.fc1.weight' (checkpoint shape [10, 6]) is not in the model",
    )
    unchanged(m, o, snap)
    m, o, snap = victim(PostNormNet().double(), steps=0)
    expect_error(lambda: checkpoint.load(ck, m, o), "'inp.weight' has dtype torch.float32")
    unchanged(m, o, snap)

    m, o, snap = victim(PostNormNet())
    expect_error(lambda: checkpoint.load(f"{root}/model_only", m, o), "holds no optimizer state")
    unchanged(m, o, snap)
    sgd = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    expect_error(lambda: checkpoint.load(ck, m, sgd), "momentum_buffer", "another optimizer")
    unchanged(m, o, snap)

    # Full state dicts: from rank 0 only (every rank must raise), then from every rank.
    wide = PostNormNet(hidden=12).state_dict()
    expect_error(
        lambda: checkpoint.load_full_state_dict(m, wide if rank == 0 else None),
        "'blocks.0.fc1.weight' has shape [12, 6] in the state dict but [10, 6]",
    )
    unchanged(m, o, snap)
    partial = {k: v for k, v in good.items() if k != "head.bias"}
    partial["head.extra"] = torch.zeros(2)
    expect_error(
        lambda: checkpoint.load_full_state_dict(m, partial),
        "'head.bias' is missing from the state dict (model shape [1])",
        "'head.extra' (state dict shape [2]) is not in the model",
    )
    unchanged(m, o, snap)
    expect_error(lambda: checkpoint.load_full_state_dict(m, None), "rank 0 passed no state dict")
    unchanged(m, o, snap)


def test_bad_input_raises_clear_error_and_changes_nothing(first2: Any) -> None:
    result(first2, "_bad_input")


# ---- CUDA (NCCL, one rank per GPU; skipped without a GPU) ----------------------------------------


def _cuda(rank: int, world: int, root: str) -> None:
    """Resume, RNG (CUDA dropout) and export/import with NCCL and tensors on the GPU."""
    torch.cuda.manual_seed(100 + rank)
    model, opt = build("mixed", world, seed=0, device="cuda")
    train(model, opt, range(K))
    checkpoint.save(f"{root}/ck", model, opt, extra=extra_for(K))
    at_save = weights(model)
    after = train(model, opt, range(K, 2 * K))
    fresh, fopt = build("mixed", world, seed=7, device="cuda")
    torch.cuda.manual_seed(999)
    assert checkpoint.load(f"{root}/ck", fresh, fopt) == extra_for(K)
    assert same(weights(fresh), at_save)
    np.testing.assert_allclose(train(fresh, fopt, range(K, 2 * K)), after, rtol=1e-6)
    fsd = checkpoint.full_state_dict(fresh)
    assert all(v.device.type == "cpu" for v in fsd.values())
    other, _ = build("mixed", world, seed=9, device="cuda")
    checkpoint.load_full_state_dict(other, fsd if rank == 0 else None)
    assert same(weights(other), weights(fresh))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_resume_and_export(tmp_path: Path) -> None:
    world = min(torch.cuda.device_count(), 2)
    run_distributed(_cuda, world, str(tmp_path), backend="cpu:gloo,cuda:nccl", timeout=180)
