"""FSDP2's other ``fully_shard`` keywords: a list of modules, an int
``reshard_after_forward``, ``shard_placement_fn``, ``dp_mesh_dims``; each
against one process (and FSDP2 where it runs).

All checks of one world size run in one set of processes (the module
fixture); each test reads its own check's result.
"""

from __future__ import annotations

import copy
import re
import tempfile
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import shardwise
from dist_utils import named_check_test
from models import Block, Net, TwoPaths, batches, loss_fn
from shardwise import fully_shard
from shardwise.comm import collectives
from test_parity_and_prefetch import (
    assert_between_steps,
    global_mean,
    make_opt,
    reference_step,
    shard_net,
    step_and_compare,
)

pytestmark = pytest.mark.timeout(300)


def records(kind: str) -> tuple[list[collectives.CollectiveRecord], Callable[[], None]]:
    seen: list[collectives.CollectiveRecord] = []
    remove = collectives.add_observer(lambda rec, _: seen.append(rec) if rec.kind == kind else None)
    return seen, remove


def matches_reference(loss: torch.Tensor, ref: nn.Module, ref_opt, idx: torch.Tensor) -> None:
    """The sharded step's loss (over all ranks) is the one-process step's on the whole batch."""
    want = reference_step(ref, ref_opt, idx)
    torch.testing.assert_close(global_mean(loss), want, atol=1e-5, rtol=1e-5)


def pairs_net(ac: str) -> tuple[Net, Net]:
    """The reference, and a copy whose stages' two blocks share one group each."""
    torch.manual_seed(0)
    ref = Net(ac=ac)
    model = copy.deepcopy(ref)
    for stage in model.stages:
        fully_shard([stage.a, stage.b])
    fully_shard(model.extra)
    fully_shard(model)
    return ref, model


# ---- a list of modules ---------------------------------------------------------------------


def check_list_of_modules(rank: int, world: int) -> None:
    for ac in ("none", "reentrant", "non-reentrant"):
        ref, model = pairs_net(ac)
        stage = model.stages[0]
        assert isinstance(stage.a, shardwise.FSDPModule) and isinstance(
            stage.b, shardwise.FSDPModule
        )
        assert stage.a._shardwise_state is stage.b._shardwise_state
        assert isinstance(stage.b.fc1.weight, DTensor)
        opt, ref_opt = make_opt("adamw", model.parameters()), make_opt("adamw", ref.parameters())
        gathers, remove_g = records("all_gather")
        reduces, remove_r = records("reduce_scatter")
        try:
            for idx in batches(3):
                gathers.clear()
                reduces.clear()
                step_and_compare(model, opt, ref, ref_opt, idx)
                labels = [r.label for r in reduces]
                # One reduce-scatter per group, not one per module of it.
                assert labels.count("stages.0.a") == 1 and "stages.0.b" not in labels, labels
                forward = [r.label for r in gathers].count("stages.0.a")
                # Gathered once in forward and once in backward (the recompute reuses it).
                assert forward == 2 and "stages.0.b" not in [r.label for r in gathers], (
                    ac,
                    gathers,
                )
        finally:
            remove_g()
            remove_r()


def check_list_partial_runs(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ref = TwoPaths()
    model = copy.deepcopy(ref)
    fully_shard([model.enc, model.dec])
    fully_shard(model)
    opt, ref_opt = make_opt("sgd", model.parameters()), make_opt("sgd", ref.parameters())
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(3))
    for path in ("ed", "e", "ede", "ed"):
        loss = model(x.chunk(world)[rank], path)
        loss.backward()
        assert_between_steps(model)
        assert (model.dec.weight.grad is None) == ("d" not in path)
        opt.step()
        opt.zero_grad()
        want = ref(x, path)
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(global_mean(loss), want.detach(), atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, atol=1e-5, rtol=1e-5, msg=name)


def check_list_state_dict(rank: int, world: int) -> None:
    ref, model = pairs_net("none")
    shardwise.share_comm_ctx([model, model.stages[0].a])  # nothing to share: accepted
    sd = model.state_dict()
    assert set(sd) == set(ref.state_dict())
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k].full_tensor(), v, msg=k)


# ---- shard_placement_fn -------------------------------------------------------------------


def columns(world: int) -> Callable[[nn.Parameter], Shard | None]:
    """Shard(1) where the columns split evenly (like MoE experts), else the default."""
    return lambda p: Shard(1) if p.dim() == 2 and p.shape[1] % world == 0 else None


def shard_by_columns(model: Net, world: int) -> None:
    fn = columns(world)
    for stage in model.stages:
        fully_shard(stage.a, shard_placement_fn=fn)
        fully_shard(stage.b, shard_placement_fn=fn)
    fully_shard(model.extra, shard_placement_fn=fn)
    fully_shard(model, shard_placement_fn=fn)


def check_shard_placement_fn(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ref = Net(ac="reentrant")
    model = copy.deepcopy(ref)
    shard_by_columns(model, world)
    w = model.stages[0].a.fc1.weight  # (16, 8)
    assert w.placements == (Shard(1),) and w.to_local().shape == (16, 8 // world)
    torch.testing.assert_close(w.to_local(), ref.stages[0].a.fc1.weight.chunk(world, dim=1)[rank])
    assert model.stages[0].a.fc1.bias.placements == (Shard(0),)
    opt, ref_opt = make_opt("adamw", model.parameters()), make_opt("adamw", ref.parameters())
    for idx in batches(3):
        loss = loss_fn(model, idx.chunk(world)[rank])
        loss.backward()
        assert w.grad is not None and w.grad.placements == (Shard(1),)
        opt.step()
        opt.zero_grad()
        matches_reference(loss, ref, ref_opt, idx)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, atol=1e-5, rtol=1e-5, msg=name)

    # The same local pieces as FSDP2's Shard(1), and DCP round trips unchanged.
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(0)
    theirs = Net()
    torch_fully_shard(theirs.stages[0].a, shard_placement_fn=columns(world))
    torch.manual_seed(0)
    ours = Net()
    fully_shard(ours.stages[0].a, shard_placement_fn=columns(world))
    for (name, a), b in zip(ours.stages[0].a.named_parameters(), theirs.stages[0].a.parameters()):
        assert a.placements == b.placements, name
        torch.testing.assert_close(a.to_local(), b.to_local(), msg=name)

    torch.manual_seed(1)
    fresh = Net(ac="reentrant")
    shard_by_columns(fresh, world)
    dcp_round_trip(rank, model, fresh)


def dcp_round_trip(rank: int, saved: nn.Module, fresh: nn.Module) -> None:
    """``saved``'s state dict through DCP into ``fresh`` (sharded the same way, another
    init): the same placements and local pieces afterwards."""
    import torch.distributed.checkpoint as dcp

    path = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(path)
    dcp.save(saved.state_dict(), checkpoint_id=path[0])
    sd = fresh.state_dict()
    dcp.load(sd, checkpoint_id=path[0])
    fresh.load_state_dict(sd)
    for (name, a), b in zip(fresh.named_parameters(), saved.parameters()):
        assert a.placements == b.placements, name
        torch.testing.assert_close(a.to_local(), b.to_local(), msg=name)


# ---- reshard_after_forward: int ------------------------------------------------------------


def check_reshard_to_smaller_group(rank: int, world: int) -> None:
    for ac in ("none", "non-reentrant"):
        torch.manual_seed(0)
        ref = Net(ac=ac)
        model = copy.deepcopy(ref)
        for stage in model.stages:
            fully_shard(stage.a, reshard_after_forward=2)
            fully_shard(stage.b, reshard_after_forward=2)
        fully_shard(model.extra, reshard_after_forward=2)
        # The root too: its 5-row embedding pads unevenly over 4 ranks.
        fully_shard(model, reshard_after_forward=2)
        group = model.stages[1].a._shardwise_state.group
        opt, ref_opt = make_opt("adamw", model.parameters()), make_opt("adamw", ref.parameters())
        gathers, remove = records("all_gather")
        try:
            for idx in batches(3):
                gathers.clear()
                loss = loss_fn(model, idx.chunk(world)[rank])
                in_forward = [(r.label, r.group_size) for r in gathers]
                # After forward it keeps its part over 2 ranks: half of the parameters.
                full = group.world * group.shard_numel * 4
                assert group.unsharded_bytes == full // 2, (group.unsharded_bytes, full)
                gathers.clear()
                loss.backward()
                in_backward = [(r.label, r.group_size) for r in gathers]
                assert_between_steps(model)  # the kept parts are freed too
                opt.step()
                opt.zero_grad()
                matches_reference(loss, ref, ref_opt, idx)
                blocks = {"stages.0.a", "stages.0.b", "stages.1.a", "stages.1.b", "extra", "Net"}
                assert {n for n, size in in_forward if size == world} >= blocks, in_forward
                # Backward gathers every module over 2 ranks only.
                assert {n for n, size in in_backward if n in blocks} == blocks, in_backward
                assert all(size == 2 for n, size in in_backward if n in blocks), in_backward
        finally:
            remove()
        # set_reshard_after_forward(True) replaces the int, as FSDP2's does, even
        # between a forward and its backward.
        idx = batches(4)[3]
        loss = loss_fn(model, idx.chunk(world)[rank])
        model.set_reshard_after_forward(True)
        assert group.unsharded_bytes == 0
        gathers, remove = records("all_gather")
        loss.backward()
        remove()
        assert {r.group_size for r in gathers} == {world}, gathers
        assert_between_steps(model)
        opt.step()
        opt.zero_grad()
        matches_reference(loss, ref, ref_opt, idx)


def check_reshard_int_edges(rank: int, world: int) -> None:
    lin = nn.Linear(4, 4)
    with pytest.warns(UserWarning, match="reshard_after_forward=False"):
        fully_shard(lin, reshard_after_forward=1)
    assert lin._shardwise_state.settings.reshard_after_forward is False
    whole = nn.Linear(4, 4)
    fully_shard(whole, reshard_after_forward=world)  # the whole group: plain True
    assert whole._shardwise_state.settings.post_forward_group is None
    # Not yet with a tensor subclass that gathers itself (test_extensions.py).
    from models import Tiny
    from test_extensions import convert

    model = convert(Tiny())
    before = model.blocks[0].fc1.weight
    with pytest.raises(ValueError, match="reshard_after_forward=<int>"):
        fully_shard(model.blocks[0], reshard_after_forward=2)
    assert model.blocks[0].fc1.weight is before


# ---- offload_policy ------------------------------------------------------------------------


def offload_worker(rank: int, world: int, device: str = "cpu") -> None:
    """Shards, gradients and optimizer state in host memory; the steps as one process's.

    Also on the GPUs (tests/library/cuda/test_cuda.py), where the copies really happen.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy

    torch.manual_seed(0)
    ref = Net(d=16, ac="non-reentrant").to(device)
    model = copy.deepcopy(ref)
    for stage in model.stages:
        fully_shard(stage.a, offload_policy=shardwise.CPUOffloadPolicy())
        fully_shard(stage.b, offload_policy=shardwise.CPUOffloadPolicy(pin_memory=False))
    fully_shard(
        model.extra, offload_policy=shardwise.CPUOffloadPolicy(), reshard_after_forward=False
    )
    fully_shard(model, offload_policy=TorchCPUOffloadPolicy())  # torch's policy works too
    pinned = device == "cuda"
    for name, p in model.named_parameters():
        assert p.to_local().device.type == "cpu", name
        if "stages.0.a." in name:
            assert p.to_local().is_pinned() == pinned, name
    opt, ref_opt = make_opt("adamw", model.parameters()), make_opt("adamw", ref.parameters())
    for step, idx in enumerate(batches(3)):
        idx = idx.to(device)
        mine = idx.chunk(world)[rank]
        if step == 1:  # two backwards into the same (CPU) gradients
            loss = torch.zeros((), device=device)
            for half in mine.chunk(2):
                part = loss_fn(model, half) / 2
                part.backward()
                loss += part.detach()
        else:
            loss = loss_fn(model, mine)
            loss.backward()
        assert_between_steps(model)
        for name, p in model.named_parameters():
            assert p.grad is not None and p.grad.to_local().device.type == "cpu", name
        opt.step()
        opt.zero_grad()
        matches_reference(loss, ref, ref_opt, idx)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.to_local().device.type == "cpu", name
        torch.testing.assert_close(p.full_tensor().to(device), q, atol=1e-5, rtol=1e-5, msg=name)


# ---- compiled blocks -------------------------------------------------------------------------


def check_compiled_blocks(rank: int, world: int) -> None:
    """``block.compile()`` after ``fully_shard``, per block as torchtitan does: our hooks
    stay eager around the compiled forward, and the steps are one process's."""
    torch.manual_seed(0)
    ref = Net(ac="non-reentrant")
    model = copy.deepcopy(ref)
    shard_net(model, {})
    for stage in model.stages:
        stage.a.compile(backend="aot_eager")
        stage.b.compile(backend="aot_eager")
    opt, ref_opt = make_opt("adamw", model.parameters()), make_opt("adamw", ref.parameters())
    for idx in batches(2):
        step_and_compare(model, opt, ref, ref_opt, idx)


# ---- dp_mesh_dims: parameters already DTensors on the full SPMD mesh ------------------------


class SpmdNet(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(d, hidden=16), Block(d, hidden=16)])
        self.head = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# Column-parallel fc1, row-parallel fc2 on a "tp" mesh dim; everything else replicated.
TP_PLAN = {"fc1.weight": Shard(0), "fc1.bias": Shard(0), "fc2.weight": Shard(1)}


def distribute_params(model: nn.Module, mesh, tp_dim: int | None) -> None:
    """Every parameter a DTensor on ``mesh``: Replicate, but TP_PLAN's on dim ``tp_dim``."""
    for mod_name, mod in model.named_modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            placements: list = [Replicate()] * mesh.ndim
            key = f"{mod_name.rsplit('.', 1)[-1]}.{name}"
            if tp_dim is not None and key in TP_PLAN:
                placements[tp_dim] = TP_PLAN[key]
            mod.register_parameter(
                name, nn.Parameter(distribute_tensor(p.detach(), mesh, placements))
            )


def spmd_model(impl, mesh, dims, d: int, tp_dim: int | None, seed: int = 0) -> SpmdNet:
    torch.manual_seed(seed)
    model = SpmdNet(d)
    distribute_params(model, mesh, tp_dim)
    for block in model.blocks:
        impl(block, mesh=mesh, dp_mesh_dims=dims)
    impl(model, mesh=mesh, dp_mesh_dims=dims)
    return model


def spmd_run(impl, clip, mesh, dims, d: int, tp_dim: int | None, batch: list, steps: int = 2):
    """Two clipped AdamW steps of SpmdNet sharded by ``impl`` with ``dp_mesh_dims=dims``;
    each rank's loss is the mean over its own rows. Returns (placements, losses, model)."""
    model = spmd_model(impl, mesh, dims, d, tp_dim)
    placements = {n: tuple(p.placements) for n, p in model.named_parameters()}
    torch.manual_seed(0)
    for (name, p), q in zip(model.named_parameters(), SpmdNet(d).parameters()):
        torch.testing.assert_close(p.full_tensor(), q.detach(), msg=name)  # pieces line up
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x = torch.randn(8, 3, d, generator=torch.Generator().manual_seed(step))
        out = model(distribute_tensor(x, mesh, batch))
        loss = out.redistribute(mesh, batch).to_local().square().mean()
        loss.backward()
        clip(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(loss))
    return placements, losses, model


def spmd_parity(mesh, dims, d: int, tp_dim: int | None, batch: list) -> SpmdNet:
    """shardwise against one process on the whole batch, and against FSDP2 side by side."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch_clip = torch.nn.utils.clip_grad_norm_
    ours = spmd_run(fully_shard, shardwise.clip_grad_norm_, mesh, dims, d, tp_dim, batch)
    torch.manual_seed(0)
    ref = SpmdNet(d)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step, loss in enumerate(ours[1]):
        x = torch.randn(8, 3, d, generator=torch.Generator().manual_seed(step))
        want = ref(x).square().mean()
        want.backward()
        torch_clip(ref.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(loss, want.detach(), atol=1e-5, rtol=1e-5)
    for (name, q), p in zip(ref.named_parameters(), ours[2].parameters()):
        torch.testing.assert_close(p.full_tensor(), q.detach(), atol=1e-5, rtol=1e-5, msg=name)
    theirs = spmd_run(torch_fully_shard, torch_clip, mesh, dims, d, tp_dim, batch)
    assert ours[0] == theirs[0], (ours[0], theirs[0])
    torch.testing.assert_close(torch.stack(ours[1]), torch.stack(theirs[1]), atol=1e-6, rtol=1e-6)
    return ours[2]


def check_spmd_fsdp_x_tp(rank: int, world: int) -> None:
    from torch.distributed.fsdp import DataParallelMeshDims

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dims = DataParallelMeshDims(shard="dp")
    # Width 7: norms and fc2's rows split unevenly over dp; fc1's rows go over tp, then dp.
    trained = spmd_parity(mesh, dims, 7, 1, [Shard(0), Replicate()])
    dcp_round_trip(rank, trained, spmd_model(fully_shard, mesh, dims, 7, 1, seed=1))


def check_spmd_hsdp(rank: int, world: int) -> None:
    from torch.distributed.fsdp import DataParallelMeshDims

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    dims = DataParallelMeshDims(shard="shard", replicate="rep")
    spmd_parity(mesh, dims, 7, None, [Shard(0), Shard(0)])


def check_spmd_flattened(rank: int, world: int) -> None:
    from torch.distributed.fsdp import DataParallelMeshDims

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    dims, batch = DataParallelMeshDims(shard=("a", "b")), [Shard(0), Shard(0)]
    # Width 7 over 4 flattened ranks: uneven pieces, one of them short.
    trained = spmd_parity(mesh, dims, 7, None, batch)

    # FSDP2 refuses an int reshard_after_forward here; shardwise trains the same.
    def by_pairs(module: nn.Module, **kw) -> None:
        fully_shard(module, reshard_after_forward=2, **kw)

    again = spmd_run(by_pairs, shardwise.clip_grad_norm_, mesh, dims, 7, None, batch)[2]
    for (name, a), b in zip(again.named_parameters(), trained.parameters()):
        torch.testing.assert_close(a.full_tensor(), b.full_tensor(), msg=name)


def check_spmd_refusals(rank: int, world: int) -> None:
    """Bad dp_mesh_dims input: one clear error each, the model left as it was."""
    from torch.distributed.fsdp import DataParallelMeshDims as Dims

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    unnamed = init_device_mesh("cpu", (2, 2))

    def fresh(d: int = 8, placed: bool = True) -> SpmdNet:
        torch.manual_seed(0)
        m = SpmdNet(d)
        if placed:
            distribute_params(m, mesh, 1)
        return m

    uneven_two_level = fresh(18)  # head.weight's 18 rows: 9 per tp rank, then over dp
    uneven_two_level.head.weight = nn.Parameter(
        distribute_tensor(torch.ones(18, 18), mesh, [Replicate(), Shard(0)])
    )
    dp_sharded = fresh()
    dp_sharded.head.weight = nn.Parameter(distribute_tensor(torch.ones(8, 8), mesh, [Shard(0)] * 2))
    cases = {
        "plain tensor": (fresh(placed=False), mesh, Dims(shard="dp")),
        "Replicate() there": (dp_sharded, mesh, Dims(shard="dp")),
        "not a dimension of the mesh": (fresh(), mesh, Dims(shard="fsdp")),
        "without shard": (fresh(), mesh, Dims(replicate="dp")),
        "in the mesh's order": (fresh(), mesh, Dims(shard=("tp", "dp"))),
        "must come before the shard dims": (fresh(), mesh, Dims(shard="dp", replicate="tp")),
        "mesh_dim_names": (fresh(), unnamed, Dims(shard="dp")),
        # fc1's rows (16) split over tp, then dp: two levels, which must be even.
        "make it a multiple of 4": (uneven_two_level, mesh, Dims(shard="dp")),
        "already splits along dim 0": (fresh(), mesh, Dims(shard="dp")),
    }
    columns = {"already splits along dim 0": lambda p: Shard(1) if p.dim() == 2 else None}
    for want, (model, m, dims) in cases.items():
        before = {n: p for n, p in model.named_parameters()}
        with pytest.raises(ValueError, match=re.escape(want)):
            fully_shard(model, mesh=m, dp_mesh_dims=dims, shard_placement_fn=columns.get(want))
        assert not isinstance(model, shardwise.FSDPModule), want
        assert {n: p for n, p in model.named_parameters()} == before, want
    with pytest.raises(TypeError, match="DataParallelMeshDims"):
        fully_shard(fresh(), mesh=mesh, dp_mesh_dims=("dp",))


CHECKS: dict[str, Callable[[int, int], None]] = {
    "compiled blocks": check_compiled_blocks,
    "offload_policy": offload_worker,
    "list of modules": check_list_of_modules,
    "list of modules: state dict": check_list_state_dict,
    "list of modules: partial and repeated runs": check_list_partial_runs,
    "shard_placement_fn": check_shard_placement_fn,
    "reshard_after_forward=int": check_reshard_to_smaller_group,
    "reshard_after_forward=int: 1 and world": check_reshard_int_edges,
    "dp_mesh_dims: FSDP x TP": check_spmd_fsdp_x_tp,
    "dp_mesh_dims: HSDP": check_spmd_hsdp,
    "dp_mesh_dims: flattened shard dims": check_spmd_flattened,
    "dp_mesh_dims: bad input": check_spmd_refusals,
}
W2 = {
    "list of modules",
    "list of modules: state dict",
    "list of modules: partial and repeated runs",
    "shard_placement_fn",
    "offload_policy",
    "compiled blocks",
}
# An int needs a group size strictly between 1 and the world: 4 ranks.
# dp_mesh_dims: a 2 x 2 mesh.
W4 = {
    "shard_placement_fn",
    "reshard_after_forward=int",
    "reshard_after_forward=int: 1 and world",
    "dp_mesh_dims: FSDP x TP",
    "dp_mesh_dims: HSDP",
    "dp_mesh_dims: flattened shard dims",
    "dp_mesh_dims: bad input",
}


test_fully_shard_keyword = named_check_test(
    __name__, CHECKS, {2: sorted(W2), 4: sorted(W4)}, timeout=250
)
