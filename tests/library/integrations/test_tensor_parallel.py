"""Tensor parallel x FSDP on a 2-D (dp, tp) mesh: parity, collectives, checkpoints, bad input.

Layers are parallelized with torch's own API (``parallelize_module`` on
``mesh["tp"]``), then sharded with ``fully_shard(mesh=mesh["dp"])``. Every test
compares with one process running the same model unsharded.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils.checkpoint import checkpoint

import models
import shardwise
import shardwise.checkpoint as sw_checkpoint
from dist_utils import check_results, run_distributed
from shardwise import FSDPModule, fully_shard
from shardwise.comm import collectives
from shardwise_app.models.gpt import Block, GPTConfig

pytestmark = pytest.mark.timeout(300)

D = 7  # model width: odd, so dp shards of the norms and of fc2's TP pieces are uneven
HIDDEN = 12  # fc1 rows: 6 per tp rank, then 3 per dp rank (tp x dp must divide them)
SEQ = 8


class MLPBlock(models.Block):
    """The tests' pre-norm block, HIDDEN rows wide (a class: the checks below subclass it
    and take it as a factory)."""

    def __init__(self, d: int = D) -> None:
        super().__init__(d, hidden=HIDDEN)


class Body(nn.Module):
    """The blocks; with sequence parallelism, activations are split over tp inside it."""

    def __init__(self, blocks: list[nn.Module], ac: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.ac = ac

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.ac == "none":
                x = block(x)
            else:  # around the sharded block, hooks included
                x = checkpoint(block, x, use_reentrant=self.ac == "reentrant")
        return x


class Stack(nn.Module):
    """Plain (not tensor parallel) layers around the body: the root's own parameters."""

    def __init__(self, kind: str, ac: str = "none") -> None:
        super().__init__()
        if kind == "mlp":
            d, blocks = D, [MLPBlock() for _ in range(2)]
        else:
            cfg = GPTConfig(seq_len=SEQ, n_layer=2, n_head=2, d_model=8)
            d, blocks = cfg.d_model, [Block(cfg) for _ in range(2)]
        self.width = d
        self.inp = nn.Linear(d, d)
        self.body = Body(blocks, ac)
        self.out = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(self.inp(x)))


def tp_plan(kind: str, sp: bool) -> dict[str, Any]:
    """Megatron-style plans. The GPT block splits its fused qkv output by ``d``, so every
    rank needs all of q, k and v: qkv's output is gathered over tp (its weight stays split)."""
    plan: dict[str, Any] = {}
    for i in range(2):
        b = f"body.blocks.{i}"
        if kind == "mlp":
            plan[f"{b}.fc1"] = ColwiseParallel()
            plan[f"{b}.fc2"] = RowwiseParallel()
            continue
        seq_out = Shard(1) if sp else Replicate()
        plan[f"{b}.attn.qkv"] = ColwiseParallel(output_layouts=Replicate())
        plan[f"{b}.attn.proj"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq_out)
        plan[f"{b}.mlp.fc"] = ColwiseParallel()
        plan[f"{b}.mlp.proj"] = RowwiseParallel(output_layouts=seq_out)
        if sp:
            plan[f"{b}.ln_1"] = SequenceParallel()
            plan[f"{b}.ln_2"] = SequenceParallel()
            for name in ("attn", "mlp"):
                plan[f"{b}.{name}"] = PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                )
    return plan


def parallelize(model: Stack, kind: str, sp: bool, mesh: DeviceMesh) -> Stack:
    """TP on mesh["tp"], then FSDP on the data-parallel dimension(s)."""
    tp_mesh = mesh["tp"]
    parallelize_module(model, tp_mesh, tp_plan(kind, sp))
    if sp:
        # Activations are split over the sequence inside the body only.
        into = PrepareModuleInput(
            input_layouts=Replicate(), desired_input_layouts=Shard(1), use_local_output=True
        )
        out_of = PrepareModuleOutput(
            output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True
        )
        parallelize_module(model.body, tp_mesh, into)
        parallelize_module(model.body, tp_mesh, out_of)
    names = tuple(mesh.mesh_dim_names or ())
    dp_mesh = mesh[names[:-1]] if len(names) > 2 else mesh[names[0]]
    for block in model.body.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def dp_coordinate(mesh: DeviceMesh) -> tuple[int, int]:
    """(index, count) of this rank's data-parallel replica (every dim but tp)."""
    coord = mesh.get_coordinate()
    assert coord is not None
    index, count = 0, 1
    for dim in range(mesh.ndim - 1):
        index = index * mesh.size(dim) + coord[dim]
        count *= mesh.size(dim)
    return index, count


def assert_sharded(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        assert isinstance(p, nn.Parameter) and isinstance(p, DTensor), f"{name} left unsharded"
    for m in model.modules():
        if isinstance(m, FSDPModule):
            group = m._shardwise_state.group
            assert group is None or group.unsharded_bytes == 0


def expected_gather_numels(model: Stack, dp: int) -> dict[str, int]:
    """What one module's all-gather moves if it gathers TP-local pieces over dp only."""

    def numel(params: list[torch.Tensor]) -> int:
        total = 0
        for p in params:
            shape = p.to_local().shape if isinstance(p, DTensor) else p.shape
            total += math.ceil(shape[0] / dp) * math.prod(shape[1:])
        return dp * total

    out = {f"body.blocks.{i}": numel(list(b.parameters())) for i, b in enumerate(model.body.blocks)}
    out["Stack"] = numel([*model.inp.parameters(), *model.out.parameters()])
    return out


# ---- training parity -----------------------------------------------------------------------------


def run_parity(kind: str, sp: bool, ac: str, mesh: DeviceMesh, steps: int = 3) -> None:
    torch.manual_seed(0)
    ref = Stack(kind, ac)
    model = copy.deepcopy(ref)
    dp_index, dp = dp_coordinate(mesh)
    shard_size = mesh.size(mesh.ndim - 2)  # the FSDP dimension: dp, or HSDP's shard
    tp_only = parallelize_module(copy.deepcopy(model), mesh["tp"], tp_plan(kind, sp))
    expected = expected_gather_numels(tp_only, shard_size)
    parallelize(model, kind, sp, mesh)

    # Placements: dp composed with TP; both shard dim 0 -> _StridedShard on dp.
    first = model.body.blocks[0]
    colwise = first.fc1.weight if kind == "mlp" else first.mlp.fc.weight
    rowwise = first.fc2.weight if kind == "mlp" else first.mlp.proj.weight
    lead = (Replicate(),) if mesh.ndim == 3 else ()
    assert colwise.device_mesh.mesh_dim_names == mesh.mesh_dim_names
    assert colwise.placements == (*lead, _StridedShard(0, split_factor=2), Shard(0))
    assert rowwise.placements == (*lead, Shard(0), Shard(1))
    if sp:
        assert first.ln_1.weight.placements == (*lead, Shard(0), Replicate())
    for (n, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.full_tensor(), rp.detach(), rtol=0, atol=0, msg=n)

    # Gathers and reductions run over the dp group only.
    names = mesh.mesh_dim_names
    assert names is not None
    dp_ranks = dist.get_process_group_ranks(mesh[names[-2]].get_group())
    for m in model.modules():
        if isinstance(m, FSDPModule) and m._shardwise_state.group is not None:
            group = m._shardwise_state.group
            assert dist.get_process_group_ranks(group.shard_group) == dp_ranks

    seen: dict[tuple[str, str], set[int]] = {}

    def observe(rec: collectives.CollectiveRecord, _: collectives.Pending) -> None:
        if rec.kind in ("all_gather", "reduce_scatter"):
            assert rec.group_size == len(dp_ranks), rec
            seen.setdefault((rec.kind, rec.label), set()).add(rec.numel)

    remove = collectives.add_observer(observe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    batch = 2 * dp
    for step in range(steps):
        x = torch.randn(batch, SEQ, ref.width, generator=g)
        y = torch.randn(batch, SEQ, ref.width, generator=g)
        ref_loss = F.mse_loss(ref(x), y)
        ref_loss.backward()
        mine = slice(2 * dp_index, 2 * dp_index + 2)
        loss = F.mse_loss(model(x[mine]), y[mine])
        loss.backward()
        assert_sharded(model)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean /= dist.get_world_size()  # every tp rank holds the same loss
        torch.testing.assert_close(mean, ref_loss.detach(), atol=1e-5, rtol=1e-5)

        # Clipping over both dimensions: the single-process norm, and the same grads.
        norm_type = float("inf") if step == 1 else 2.0
        ref_norm = nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type)
        norm = shardwise.clip_grad_norm_(model.parameters(), 0.05, norm_type)
        torch.testing.assert_close(norm, ref_norm, atol=1e-6, rtol=1e-5)
        for (n, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
            assert p.grad is not None and p.grad.placements == p.placements, n
            torch.testing.assert_close(p.grad.full_tensor(), rp.grad, atol=1e-6, rtol=1e-5, msg=n)

        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    remove()
    for (n, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.full_tensor(), rp.detach(), atol=1e-5, rtol=1e-5, msg=n)
    # Each module gathers (and reduces) exactly its TP-local pieces, padded over dp.
    for (kind_, label), numels in seen.items():
        assert numels == {expected[label]}, (kind_, label, numels, expected[label])
    if shard_size > 1:
        assert {label for _, label in seen} == set(expected)


def parity_worker(rank: int, world: int, kind: str, configs: list[tuple[bool, str]]) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for sp, ac in configs:
        run_parity(kind, sp, ac, mesh)


def test_mlp_tp_x_fsdp_matches_single_process(shared: dict[str, Any]) -> None:
    assert shared["mlp"] is None, shared["mlp"]


def test_gpt_block_tp_x_fsdp_matches_single_process(shared: dict[str, Any]) -> None:
    """shardwise_app.models.gpt.Block: with sequence parallelism (its norms become TP-Replicate
    DTensors), without it (its norms stay plain and are sharded over dp only), with and
    without activation checkpointing."""
    assert shared["gpt"] is None, shared["gpt"]


def hsdp_worker(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))
    run_parity("mlp", False, "none", mesh, steps=2)


def test_hsdp_x_tp_matches_single_process(shared: dict[str, Any]) -> None:
    """A (replicate, shard) FSDP mesh composes with tp the same way (3-D placements)."""
    assert shared["hsdp"] is None, shared["hsdp"]


# ---- checkpoints ---------------------------------------------------------------------------------


def build(dp: int, tp: int) -> tuple[Stack, DeviceMesh]:
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(5)  # a different init than the saved model's
    return parallelize(Stack("gpt"), "gpt", True, mesh), mesh


def save_worker(rank: int, world: int, path: str) -> None:
    model, mesh = build(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, SEQ, model.width, generator=torch.Generator().manual_seed(3))
    dp_index = mesh["dp"].get_local_rank()
    model(x[2 * dp_index : 2 * dp_index + 2]).square().mean().backward()
    opt.step()
    opt.zero_grad()
    sw_checkpoint.save(path, model, opt, extra={"step": 1})
    full = sw_checkpoint.full_state_dict(model)
    moments = {n: opt.state[p]["exp_avg"].full_tensor() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save((full, moments, x), f"{path}.expected.pt")


def load_worker(rank: int, world: int, path: str, dp: int, tp: int) -> None:
    full, moments, x = torch.load(f"{path}.expected.pt")
    model, _ = build(dp, tp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():  # optimizer state to load into
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad()
    assert sw_checkpoint.load(path, model, opt) == {"step": 1}
    mine = sw_checkpoint.full_state_dict(model, rank0_only=False)
    assert set(mine) == set(full)
    for k in full:
        torch.testing.assert_close(mine[k], full[k], rtol=0, atol=0, msg=k)
    for n, p in model.named_parameters():
        torch.testing.assert_close(opt.state[p]["exp_avg"].full_tensor(), moments[n], msg=n)
    # The same model: it computes what a plain model with those weights computes.
    ref = Stack("gpt")
    ref.load_state_dict(full)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), atol=1e-5, rtol=1e-5)
    assert_sharded(model)


def save_then_load_worker(rank: int, world: int, path: str) -> None:
    """Saved at (dp=2, tp=2), loaded at (dp=4, tp=1) by the same 4 processes (a second
    set of processes would cost the suite its startup; the (1, 2) load runs fresh)."""
    save_worker(rank, world, path)
    dist.barrier()  # rank 0's expected values are on disk
    load_worker(rank, world, path, 4, 1)


def test_dcp_checkpoint_reshards_across_dp_tp_layouts(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    run_distributed(save_then_load_worker, 4, path)
    run_distributed(load_worker, 2, path, 1, 2)  # (dp=1, tp=2) on 2 ranks


# ---- bad input -----------------------------------------------------------------------------------


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p.detach()


def _layout(p: torch.Tensor) -> Any:
    return (p.device_mesh, p.placements) if isinstance(p, DTensor) else None


def bad_tp_worker(rank: int, world: int) -> dict[str, str]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    msgs: dict[str, str] = {}

    def expect(name: str, make: Any, shard: Any) -> None:
        torch.manual_seed(0)
        model = make()
        parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        before = {n: (p, _layout(p), _local(p).clone()) for n, p in model.named_parameters()}
        with pytest.raises(ValueError) as info:
            shard(model)
        msgs[name] = str(info.value)
        # nothing changed: same parameter objects, placements and values
        assert not any(isinstance(m, FSDPModule) for m in model.modules())
        for n, p in model.named_parameters():
            q, layout, local = before[n]
            assert p is q and _layout(p) == layout, n
            torch.testing.assert_close(_local(p), local, msg=n)

    expect("tp-as-dp", MLPBlock, lambda m: fully_shard(m, mesh=mesh["tp"]))
    expect("whole-mesh", MLPBlock, lambda m: fully_shard(m, mesh=mesh))
    # Another mesh over the same ranks, laid out differently: its dp groups cut across
    # mesh's tp groups.
    other = DeviceMesh("cpu", torch.arange(4).view(2, 2).T, mesh_dim_names=("dp", "tp"))
    expect("other-root", MLPBlock, lambda m: fully_shard(m, mesh=other["dp"]))
    world_mesh = init_device_mesh("cpu", (world,))
    expect("flat", MLPBlock, lambda m: fully_shard(m, mesh=world_mesh))

    class Odd(MLPBlock):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(D, 6)  # 6 rows over tp=2, then 3 over dp=2: uneven
            self.fc2 = nn.Linear(6, D)

    expect("uneven", Odd, lambda m: fully_shard(m, mesh=mesh["dp"]))

    # Our own sharded parameters stay owned: a sharded weight reused elsewhere.
    block = fully_shard(MLPBlock(), mesh=mesh["dp"])
    reuse = nn.Linear(HIDDEN, D)
    reuse.weight = block.fc2.weight  # type: ignore[assignment]
    with pytest.raises(ValueError) as info:
        fully_shard(reuse, mesh=mesh["dp"])
    msgs["owned"] = str(info.value)
    assert not isinstance(reuse, FSDPModule) and not isinstance(reuse.bias, DTensor)

    # materialize cannot cut TP x FSDP rows yet: it says so instead of guessing.
    torch.manual_seed(0)
    tp_model = MLPBlock()
    parallelize_module(tp_model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    fully_shard(tp_model, mesh=mesh["dp"])
    before = {n: _local(p).clone() for n, p in tp_model.named_parameters()}
    with pytest.raises(NotImplementedError) as nie:
        shardwise.materialize(tp_model)
    msgs["materialize"] = str(nie.value)
    for n, p in tp_model.named_parameters():
        assert isinstance(p, DTensor), n
        torch.testing.assert_close(_local(p), before[n], msg=n)
    return msgs


# ---- one set of 4 processes for the checks above (each spawn costs the suite ~13 s) --------


def _gpt_parity(rank: int, world: int) -> None:
    parity_worker(
        rank, world, "gpt", [(True, "none"), (True, "reentrant"), (False, "non-reentrant")]
    )


def _mlp_parity(rank: int, world: int) -> None:
    parity_worker(rank, world, "mlp", [(False, "none"), (False, "non-reentrant")])


def check_bad_tp_input(rank: int, world: int) -> None:
    msgs = bad_tp_worker(rank, world)
    for name in ("tp-as-dp", "whole-mesh"):
        assert "'tp'" in msgs[name] and "also given as the FSDP mesh" in msgs[name], msgs[name]
        assert "mesh['dp']" in msgs[name]
    for name in ("other-root", "flat"):
        assert "not a data-parallel sub-mesh" in msgs[name], msgs[name]
        assert "fc1.weight" in msgs[name]
    assert (
        "6 rows" in msgs["uneven"]
        and "tp=2" in msgs["uneven"]
        and "multiple of 4" in msgs["uneven"]
    )
    assert "already owned" in msgs["owned"] and "weight" in msgs["owned"]
    assert (
        "tensor parallel" in msgs["materialize"] and "load_full_state_dict" in msgs["materialize"]
    )


# In this order the later checks also see meshes equal to earlier ones (DTensor hands out
# cached specs holding the earlier mesh): compose_tp must accept an equal tp mesh.
SHARED = {"mlp": _mlp_parity, "gpt": _gpt_parity, "hsdp": hsdp_worker, "bad": check_bad_tp_input}


@pytest.fixture(scope="module")
def shared() -> dict[str, str | None]:
    """Each SHARED check's first failing rank's traceback, or None."""
    return check_results(__name__, SHARED, 4, timeout=280)


def test_bad_tp_input_gets_one_clear_error_and_changes_nothing(shared: dict[str, Any]) -> None:
    assert shared["bad"] is None, shared["bad"]
