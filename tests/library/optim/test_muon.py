"""``shardwise.optim.Muon``: torch's Muon, each sharded matrix orthogonalized by one owner.

Every distributed check runs on 4 gloo ranks in one set of processes and compares with
one process running ``torch.optim.Muon`` on the whole batch (the same seed), and where
it says so with FSDP2 + ``torch.optim.Muon`` on the same ranks: shardwise's parameters
must be at least as close to one process's as FSDP2's are. The model has 8 matrices of
uneven shapes (rows above and below columns; over 4 ranks their shards are uneven and
one is empty), and biases and a norm stepped by AdamW beside Muon, as torch users split.
"""

from __future__ import annotations

import ast
import copy
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
from torch.distributed.tensor import DTensor
from torch.utils.flop_counter import FlopCounterMode

import shardwise
import shardwise.optim.muon as muon_module
from dist_utils import named_check_test
from shardwise import fully_shard, optimizer_in_backward
from shardwise.optim import Muon
from shardwise.optim.muon import newton_schulz_flops, owners

W = 4
# Linear(DIMS[i], DIMS[i + 1]): weights [out, in], rows above and below columns; 9 rows
# over 4 ranks split 3, 3, 3, 0 (an empty shard), 7 rows 2, 2, 2, 1.
DIMS = [12, 18, 7, 13, 10, 21, 9, 15, 12]
BATCH = 16
STEPS = 4
LR = 0.02


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIMS[0])
        self.layers = nn.ModuleList(
            nn.Linear(DIMS[i], DIMS[i + 1], bias=i % 2 == 0) for i in range(len(DIMS) - 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        return self.layers[-1](x)


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, DIMS[0], generator=g), torch.randn(BATCH, DIMS[-1], generator=g)


def optimizers(model: nn.Module, muon: type) -> list[torch.optim.Optimizer]:
    """Muon for the 2-D weights, AdamW for biases and the norm (torch's documented split)."""
    params = list(model.parameters())
    return [
        muon([p for p in params if p.ndim == 2], lr=LR),
        torch.optim.AdamW([p for p in params if p.ndim != 2], lr=1e-2),
    ]


def reference(steps: int, clip: float | None = None, accum: int = 1) -> dict[str, torch.Tensor]:
    """One process, the whole batch, torch's Muon."""
    torch.manual_seed(0)
    model = Chain()
    opts = optimizers(model, torch.optim.Muon)
    for step in range(steps):
        x, y = data(step)
        for xs, ys in zip(x.chunk(accum), y.chunk(accum)):
            (F.mse_loss(model(xs), ys) / accum).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for o in opts:
            o.step()
            o.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def shard(model: nn.Module, shard_fn: Callable[..., Any], mesh: Any = None) -> nn.Module:
    for layer in model.layers:  # type: ignore[union-attr]
        shard_fn(layer, mesh=mesh)
    shard_fn(model, mesh=mesh)
    return model


def my_batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, ...]:
    x, y = data(step)
    return x.chunk(world)[rank], y.chunk(world)[rank]


def train(
    model: nn.Module,
    opts: list[torch.optim.Optimizer],
    steps: range,
    *,
    clip: Callable[[], Any] | None = None,
    accum: int = 1,
    flops: list[int] | None = None,
) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        x, y = my_batch(step, rank, world)
        for xs, ys in zip(x.chunk(accum), y.chunk(accum)):
            (F.mse_loss(model(xs), ys) / accum).backward()
        if clip is not None:
            clip()
        for i, o in enumerate(opts):
            if i == 0 and flops is not None:
                with FlopCounterMode(display=False) as counter:
                    o.step()
                flops.append(counter.get_total_flops())
            else:
                o.step()
            o.zero_grad()


def full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    return max((a[k] - b[k]).abs().max().item() for k in a)


def fsdp2(mesh: Any = None) -> nn.Module:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(0)
    return shard(Chain(), torch_fully_shard, mesh)


def ours(mesh: Any = None) -> nn.Module:
    torch.manual_seed(0)
    return shard(Chain(), fully_shard, mesh)


def one_flops() -> int:
    """torch's Muon step on one process, the whole model: the FLOPs of one step."""
    torch.manual_seed(0)
    model = Chain()
    opt = optimizers(model, torch.optim.Muon)[0]
    x, y = data(0)
    F.mse_loss(model(x), y).backward()
    with FlopCounterMode(display=False) as counter:
        opt.step()
    return counter.get_total_flops()


# ---- the checks (4 ranks, one set of processes) -----------------------------------------------


def check_parity_and_flops(rank: int, world: int) -> None:
    """Several steps equal one process's torch Muon at least as closely as FSDP2 + torch's
    Muon; per-rank optimizer FLOPs at most 0.35x one process's (FSDP2's: 1x)."""
    ref = reference(STEPS)
    theirs = fsdp2()
    their_flops: list[int] = []
    train(theirs, optimizers(theirs, torch.optim.Muon), range(STEPS), flops=their_flops)
    model = ours()
    flops: list[int] = []
    train(model, optimizers(model, Muon), range(STEPS), flops=flops)
    ours_err, their_err = error(full(model), ref), error(full(theirs), ref)
    assert ours_err <= their_err, (ours_err, their_err)
    assert ours_err < 1e-3, ours_err  # and close in absolute terms
    # Batched: one gather and one scatter per step for the model (one bucket) ...
    seen: list[str] = []
    remove = shardwise.observe.add_collective_observer(
        lambda rec, pending: seen.append(rec.label) if rec.kind == "all_to_all" else None
    )
    small = ours()
    small_opts = optimizers(small, Muon)
    train(small, small_opts, range(1))
    remove()
    assert seen == ["muon gather", "muon scatter"], seen
    # ... and buckets of a few matrices, pipelined, give the same parameters.
    muon_module.BUCKET_NUMEL, before = 200, muon_module.BUCKET_NUMEL
    try:
        train(small, small_opts, range(1, STEPS))
    finally:
        muon_module.BUCKET_NUMEL = before
    assert error(full(small), full(model)) == 0.0
    single = one_flops()
    mine = max(flops) / single
    every = [0.0] * world
    dist.all_gather_object(every, mine)
    assert max(every) <= 0.35, every
    assert sum(every) == pytest.approx(1.0), every  # each matrix once across the job
    assert their_flops[-1] == single, (their_flops, single)  # FSDP2 + torch's: all of it


def check_clip_and_accumulation(rank: int, world: int) -> None:
    """clip_grad_norm_ before the step and 2 microbatches per step, against one process
    doing the same, at least as closely as FSDP2 does."""
    ref = reference(STEPS, clip=0.5, accum=2)
    theirs = fsdp2()
    train(
        theirs,
        optimizers(theirs, torch.optim.Muon),
        range(STEPS),
        clip=lambda: torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5),
        accum=2,
    )
    model = ours()
    train(
        model,
        optimizers(model, Muon),
        range(STEPS),
        clip=lambda: shardwise.clip_grad_norm_(model.parameters(), 0.5),
        accum=2,
    )
    ours_err, their_err = error(full(model), ref), error(full(theirs), ref)
    assert ours_err <= their_err and ours_err < 1e-3, (ours_err, their_err)


def check_hsdp(rank: int, world: int) -> None:
    """HSDP 2 x 2: owners inside each shard group, each replica the same work."""
    ref = reference(STEPS)
    mesh = shardwise.hsdp_mesh(2, "cpu")
    theirs = fsdp2(mesh)
    train(theirs, optimizers(theirs, torch.optim.Muon), range(STEPS))
    model = ours(mesh)
    flops: list[int] = []
    train(model, optimizers(model, Muon), range(STEPS), flops=flops)
    ours_err, their_err = error(full(model), ref), error(full(theirs), ref)
    assert ours_err <= their_err and ours_err < 1e-3, (ours_err, their_err)
    every = [0] * world
    dist.all_gather_object(every, flops[-1])
    # Ranks 0, 1 are one shard group, 2, 3 the other: the same split of the work in each.
    assert every[0] + every[1] == every[2] + every[3] == one_flops(), every


def check_dcp_resume(rank: int, world: int) -> None:
    """A DCP save after 2 steps, loaded into a fresh model and optimizers: the next step
    equals the uninterrupted run's exactly; the saved state is torch's format."""
    model = ours()
    opts = optimizers(model, Muon)
    train(model, opts, range(2))
    box = [tempfile.mkdtemp(prefix="muon_dcp_") if rank == 0 else None]
    dist.broadcast_object_list(box)
    path = box[0]
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opts)}
    buffers = [
        k for k in state["optim"]["state"] if "momentum_buffer" in state["optim"]["state"][k]
    ]
    assert len(buffers) == len(DIMS) - 1, buffers
    dcp.save(state, checkpoint_id=path)
    train(model, opts, range(2, 3))
    fresh = ours()
    fresh_opts = optimizers(fresh, Muon)
    loaded = {
        "model": get_model_state_dict(fresh),
        "optim": get_optimizer_state_dict(fresh, fresh_opts),
    }
    dcp.load(loaded, checkpoint_id=path)
    set_model_state_dict(fresh, loaded["model"])
    set_optimizer_state_dict(fresh, fresh_opts, loaded["optim"])
    train(fresh, fresh_opts, range(2, 3))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path)
    assert error(full(fresh), full(model)) == 0.0


def check_optimizer_in_backward(rank: int, world: int) -> None:
    """Stepped module by module inside backward (separable: each matrix's update reads
    its own gradient and state only): the same parameters as the usual step."""
    model = ours()
    train(model, optimizers(model, Muon), range(STEPS))
    stepped = ours()
    muon, adamw = optimizers(stepped, Muon)
    handle = optimizer_in_backward(stepped, muon, separable=True)
    for step in range(STEPS):
        x, y = my_batch(step, rank, world)
        F.mse_loss(stepped(x), y).backward()
        assert all(p.grad is None for p in muon.param_groups[0]["params"])
        muon.step()  # nothing left to do for its parameters
        adamw.step()
        adamw.zero_grad()
    handle.remove()
    assert error(full(stepped), full(model)) == 0.0


def check_bad_input(rank: int, world: int) -> None:
    """A DTensor shardwise did not shard (FSDP2's), or a tensor-parallel one: one ValueError
    at construction."""
    theirs = fsdp2()
    with pytest.raises(ValueError, match="that shardwise did not shard") as e:
        Muon([theirs.layers[0].weight])  # type: ignore[index]
    assert len(str(e.value).splitlines()) == 1
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    tp = nn.Sequential(nn.Linear(8, 8, bias=False))
    parallelize_module(tp, mesh["tp"], {"0": ColwiseParallel()})
    fully_shard(tp, mesh=mesh["dp"])
    with pytest.raises(ValueError, match="tensor parallelism") as e:
        Muon(tp.parameters())
    assert len(str(e.value).splitlines()) == 1


CHECKS = {
    "parity_and_flops": check_parity_and_flops,
    "clip_and_accumulation": check_clip_and_accumulation,
    "hsdp_2x2": check_hsdp,
    "dcp_resume": check_dcp_resume,
    "optimizer_in_backward": check_optimizer_in_backward,
    "bad_input": check_bad_input,
}
test_muon_on_four_ranks = named_check_test(__name__, CHECKS, W, timeout=300)


# ---- one process ------------------------------------------------------------------------------


def test_one_process_equals_torch_muon() -> None:
    """Plain tensors: torch's Muon exactly, every argument passed through, the same state
    dict (nesterov off and the RMS-matching learning rate too)."""
    for kwargs in ({}, {"nesterov": False, "adjust_lr_fn": "match_rms_adamw", "lr": 0.1}):
        torch.manual_seed(0)
        a = Chain()
        b = copy.deepcopy(a)
        oa = torch.optim.Muon([p for p in a.parameters() if p.ndim == 2], **kwargs)
        ob = Muon([p for p in b.parameters() if p.ndim == 2], **kwargs)
        for step in range(3):
            x, y = data(step)
            for m, o in ((a, oa), (b, ob)):
                F.mse_loss(m(x), y).backward()
                o.step()
                o.zero_grad()
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
        sa, sb = oa.state_dict(), ob.state_dict()
        assert sa["param_groups"] == sb["param_groups"]
        assert all(
            torch.equal(sa["state"][i]["momentum_buffer"], sb["state"][i]["momentum_buffer"])
            for i in sa["state"]
        )
        ob.load_state_dict(oa.state_dict())  # and loads torch's


def test_non_2d_parameters_get_one_clear_error() -> None:
    model = Chain()
    with pytest.raises(ValueError, match="AdamW group") as e:
        Muon(model.parameters())
    assert len(str(e.value).splitlines()) == 1
    opt = Muon([model.layers[0].weight])
    with pytest.raises(ValueError, match="2-D"):
        opt.add_param_group({"params": [model.norm.weight]})
    assert len(opt.param_groups) == 1  # nothing added


def test_owners_balance_the_newton_schulz_work() -> None:
    shapes = [(DIMS[i + 1], DIMS[i]) for i in range(len(DIMS) - 1)]
    costs = [newton_schulz_flops(s) for s in shapes]
    loads = [0] * W
    for c, o in zip(costs, owners(costs, W)):
        loads[o] += c
    assert max(loads) / sum(costs) < 0.3, loads
    a, b = 7, 18  # the count torch's flop counter makes (rows or columns first)
    x = torch.randn(a, b)
    for m in (x, x.T.contiguous()):
        with FlopCounterMode(display=False) as counter:
            torch.optim._muon._zeropower_via_newtonschulz(m, (3.4445, -4.775, 2.0315), 5, 1e-7)
        assert counter.get_total_flops() == newton_schulz_flops(m.shape)


def test_the_optimizer_calls_torch_distributed_only_through_collectives() -> None:
    """test_layers.py's rule, for this subpackage (its scan covers the top level only)."""
    offenders = []
    for path in sorted((Path(shardwise.__file__).parent / "optim").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import) and any(
                a.name == "torch.distributed" for a in node.names
            ):
                offenders.append(f"{path.name}:{node.lineno}")
            if isinstance(node, ast.Call) and ast.unparse(node.func).startswith(
                ("dist.", "torch.distributed.")
            ):
                offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders, offenders
