"""Per-parameter meshes in one ``fully_shard`` (placement.py): expert parallelism's path.

4 gloo ranks. A mixture-of-experts block (a dense input projection, four
experts, a dense output projection) under expert parallelism of 2: ranks
``{0, 1}`` and ``{2, 3}`` each hold all four experts between them, two per
rank, and send each token to its expert's rank with an all-to-all (autograd
through ``torch.distributed.nn``); ranks ``{0, 2}`` and ``{1, 3}`` hold the same
experts. One ``fully_shard(block, shard_placement_fn=...)`` shards the dense
weights over the 4-rank data-parallel mesh and the experts over their
2-rank expert-data-parallel mesh, as torchtitan's ``EP > 1`` path does.

Compared with one process on the whole batch holding all four experts (the
block's gradient divide factor 4, the number of data-parallel ranks, as
torchtitan normalises by the global token count): every loss and every
parameter after 3 AdamW steps (rtol 1e-4), with the experts split along
dim 0 and along dim 1, with shardwise's ``ShardPlacementResult`` and with
torch's. With FSDP2's default divide factors (each mesh's own mean), the
gradients equal torch's FSDP2 run of the same case. Each step gathers and
reduces each mesh's parameters over their own group: one all-gather and one
reduce-scatter over 4 ranks and one of each over 2 per module. Full and
sharded state dicts (torch.distributed.checkpoint's helpers) hold per mesh.
Bad input (a mesh without this rank, ``reshard_after_forward=<int>``, a
custom collective) is refused naming the module, nothing changed.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import shardwise
from dist_utils import named_check_test
from shardwise import FSDPModule, ShardPlacementResult, fully_shard

pytestmark = pytest.mark.timeout(300)

WORLD, EP, EXPERTS, D, TOKENS, STEPS = 4, 2, 4, 8, 8, 3
LOCAL = EXPERTS // EP
RTOL, ATOL = 1e-4, 1e-6


class MoE(nn.Module):
    """Token i goes to expert ``i % EXPERTS``; ``experts`` holds this rank's experts
    (all of them in one process: ``ep_group`` None)."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.experts = nn.Parameter(torch.randn(experts, D, D) * 0.3)
        self.out = nn.Linear(D, D)
        self.ep_group: Any = None
        self.ep_rank = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if self.ep_group is None:
            ids = torch.arange(x.shape[0]) % EXPERTS
            y = torch.einsum("nd,nde->ne", h, self.experts[ids])
        else:
            y = self._dispatched(h)
        return self.out(h + y)

    def _dispatched(self, h: torch.Tensor) -> torch.Tensor:
        # Tokens by owner (expert // LOCAL), each owner's in token order: every rank
        # routes alike, so what an owner receives from each peer has the same experts.
        ids = torch.arange(h.shape[0]) % EXPERTS
        order = torch.cat([torch.nonzero(ids // LOCAL == k).flatten() for k in range(EP)])
        sent = h[order]
        got = dist_fn.all_to_all_single(torch.empty_like(sent), sent, group=self.ep_group)
        mine = ids[ids // LOCAL == self.ep_rank].repeat(EP) - self.ep_rank * LOCAL
        done = torch.einsum("nd,nde->ne", got, self.experts[mine])
        back = dist_fn.all_to_all_single(torch.empty_like(done), done, group=self.ep_group)
        y = torch.empty_like(back)
        y[order] = back
        return y


class Model(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.block = MoE(experts)
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def _reference() -> Model:
    torch.manual_seed(0)
    return Model(EXPERTS)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(WORLD * TOKENS, D, generator=g), torch.randint(
        0, 3, (WORLD * TOKENS,), generator=g
    )


def _meshes() -> tuple[DeviceMesh, DeviceMesh, Any]:
    """The dp mesh of 4, the expert-data-parallel mesh of 2 (ranks holding the same
    experts) and the expert-parallel group (ranks exchanging tokens)."""
    dp = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    grid = init_device_mesh("cpu", (WORLD // EP, EP), mesh_dim_names=("efsdp", "ep"))
    return dp, grid["efsdp"], grid.get_group("ep")


def _local_model(rank: int, ep_group: Any) -> Model:
    """This rank's copy: the reference's dense weights, its EP rank's experts."""
    ref = _reference()
    model = Model(LOCAL)
    k = rank % EP
    with torch.no_grad():
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            p.copy_(q[k * LOCAL : (k + 1) * LOCAL] if name == "block.experts" else q)
    model.block.ep_group, model.block.ep_rank = ep_group, k
    return model


def _shard(
    model: Model, edp: DeviceMesh, dp: DeviceMesh, how: str, impl: str = "shardwise"
) -> None:
    experts = model.block.experts
    dim = 1 if how == "shard1" else 0
    if impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard
        from torch.distributed.fsdp._fully_shard._fsdp_common import (
            FSDPMeshInfo,
        )
        from torch.distributed.fsdp._fully_shard._fsdp_common import (
            ShardPlacementResult as TorchResult,
        )

        info = FSDPMeshInfo(edp, shard_mesh_dim=0)

        def torch_fn(p: nn.Parameter) -> Any:
            return TorchResult(Shard(dim), info) if p is experts else None

        torch_fully_shard(model.block, mesh=dp, shard_placement_fn=torch_fn)
        torch_fully_shard(model, mesh=dp)
        return
    if how == "torch-result":
        from torch.distributed.fsdp._fully_shard._fsdp_common import (
            FSDPMeshInfo,
        )
        from torch.distributed.fsdp._fully_shard._fsdp_common import (
            ShardPlacementResult as TorchResult,
        )

        info = FSDPMeshInfo(edp, shard_mesh_dim=0)

        def fn(p: nn.Parameter) -> Any:
            return TorchResult(Shard(0), info) if p is experts else None
    else:

        def fn(p: nn.Parameter) -> Any:
            return ShardPlacementResult(Shard(dim), edp) if p is experts else None

    fully_shard(model.block, mesh=dp, shard_placement_fn=fn)
    fully_shard(model, mesh=dp)


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p


def _train(model: nn.Module, rank: int, steps: int = STEPS) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        if rank >= 0:
            x, y = x[rank * TOKENS : (rank + 1) * TOKENS], y[rank * TOKENS : (rank + 1) * TOKENS]
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank >= 0:
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= WORLD
        losses.append(loss.item())
    return losses


def _check_equal_to_one_process(how: str) -> Callable[[int, int], None]:
    def check(rank: int, world: int) -> None:
        dp, edp, ep_group = _meshes()
        ref = _reference()
        want = _train(ref, -1)
        model = _local_model(rank, ep_group)
        _shard(model, edp, dp, how)
        assert isinstance(model.block, FSDPModule)
        model.block.set_gradient_divide_factor(float(WORLD))
        model.set_gradient_divide_factor(float(WORLD))
        experts = model.block.experts
        assert isinstance(experts, DTensor) and experts.device_mesh == edp
        assert experts.placements == (Shard(1 if how == "shard1" else 0),)
        assert model.block.inp.weight.device_mesh == dp
        got = _train(model, rank)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=ATOL)
        k = rank % EP
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            q = q.detach()[k * LOCAL : (k + 1) * LOCAL] if name == "block.experts" else q.detach()
            torch.testing.assert_close(_full(p.detach()), q, rtol=RTOL, atol=ATOL, msg=name)

    return check


def check_default_divide_equals_fsdp2(rank: int, world: int) -> None:
    """Each mesh's parameters averaged over their own mesh (FSDP2's default): shardwise's
    gradients equal torch's FSDP2 run of the same case."""
    dp, edp, ep_group = _meshes()
    grads = {}
    for impl in ("shardwise", "fsdp2"):
        model = _local_model(rank, ep_group)
        _shard(model, edp, dp, "shard0", impl)
        x, y = _batch(0)
        F.cross_entropy(
            model(x[rank * TOKENS : (rank + 1) * TOKENS]), y[rank * TOKENS : (rank + 1) * TOKENS]
        ).backward()
        grads[impl] = {n: _full(p.grad) for n, p in model.named_parameters()}
    for name, g in grads["shardwise"].items():
        torch.testing.assert_close(g, grads["fsdp2"][name], rtol=RTOL, atol=ATOL, msg=name)


def check_one_collective_per_mesh(rank: int, world: int) -> None:
    """Each step: the block gathers over 4 ranks and over 2 (forward; backward again),
    and reduces once over each; the root's parameters over 4 only."""
    dp, edp, ep_group = _meshes()
    model = _local_model(rank, ep_group)
    _shard(model, edp, dp, "shard0")
    seen: Counter[tuple[str, str, int]] = Counter()

    def observe(record: Any, pending: Any) -> None:
        seen[(record.kind, record.label, record.group_size)] += 1

    remove = shardwise.observe.add_collective_observer(observe)
    try:
        _train(model, rank, steps=1)
    finally:
        remove()
    gathers = {k: v for k, v in seen.items() if k[0] == "all_gather" and k[1] == "block"}
    reduces = {k: v for k, v in seen.items() if k[0] == "reduce_scatter" and k[1] == "block"}
    assert gathers == {("all_gather", "block", 4): 2, ("all_gather", "block", 2): 2}, seen
    assert reduces == {("reduce_scatter", "block", 4): 1, ("reduce_scatter", "block", 2): 1}, seen


def check_state_dicts_per_mesh(rank: int, world: int) -> None:
    """DCP's full state dict holds each rank's experts whole (gathered over their mesh)
    and the dense weights whole; loaded into a fresh sharded model (full and sharded),
    it gives the same parameters and the same next loss."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    dp, edp, ep_group = _meshes()
    model = _local_model(rank, ep_group)
    _shard(model, edp, dp, "shard0")
    _train(model, rank, steps=1)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    assert full["block.experts"].shape == (LOCAL, D, D)
    torch.testing.assert_close(full["block.experts"], _full(model.block.experts.detach()))
    sharded = {k: v.detach().clone() for k, v in get_model_state_dict(model).items()}
    assert sharded["block.experts"].device_mesh == edp
    for state, options in ((full, StateDictOptions(full_state_dict=True)), (sharded, None)):
        fresh = _local_model(rank, ep_group)
        _shard(fresh, edp, dp, "shard0")
        set_model_state_dict(fresh, state, options=options)
        for (name, p), (_, q) in zip(fresh.named_parameters(), model.named_parameters()):
            torch.testing.assert_close(_full(p.detach()), _full(q.detach()), msg=name)


class Sometimes(nn.Module):
    """A dense layer on dp and an extra one on the expert mesh that only ranks 0 and 1
    use (an expert no token reached on ranks 2 and 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.extra = nn.Linear(D, D)
        self.head = nn.Linear(D, 3)
        self.use_extra = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if self.use_extra:
            h = h + self.extra(h)
        return self.head(h)


def check_a_part_unused_on_some_ranks(rank: int, world: int) -> None:
    """Ranks 2 and 3 give the expert-mesh part no gradient: every rank still reduces
    it (zeros from those), so no rank waits on a reduce-scatter its peer skipped, and
    the gradient is the mean over its mesh of what each rank computed."""
    dp, edp, _ = _meshes()
    torch.manual_seed(0)
    ref = Sometimes()
    ref.use_extra = rank < 2
    x, y = _batch(0)
    x, y = x[rank * TOKENS : (rank + 1) * TOKENS], y[rank * TOKENS : (rank + 1) * TOKENS]
    model = copy.deepcopy(ref)
    F.cross_entropy(ref(x), y).backward()
    want = ref.extra.weight.grad if ref.extra.weight.grad is not None else torch.zeros(D, D)
    dist.all_reduce(want, group=edp.get_group())
    want /= edp.size()
    extra = set(model.extra.parameters())
    fully_shard(
        model,
        mesh=dp,
        shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), edp) if p in extra else None,
    )
    model.set_reduce_scatter_unused_params(True)
    F.cross_entropy(model(x), y).backward()
    got = model.extra.weight.grad
    assert got is not None
    torch.testing.assert_close(got.full_tensor(), want, rtol=RTOL, atol=ATOL)


def check_bad_meshes_refused(rank: int, world: int) -> None:
    """A mesh without this rank, reshard_after_forward=<int>, a custom collective:
    refused naming the module, the module left as it was."""
    dp, edp, ep_group = _meshes()
    pair = DeviceMesh("cpu", [0, 1])  # every rank builds it (its groups are collective)

    def untouched(m: nn.Module) -> None:
        assert not isinstance(m, FSDPModule)
        assert not any(isinstance(p, DTensor) for p in m.parameters())

    model = _local_model(rank, ep_group)
    on_pair = model.block.experts
    if rank >= 2:
        with pytest.raises(ValueError, match=r"MoE.*does not contain this rank"):
            fully_shard(
                model.block,
                mesh=dp,
                shard_placement_fn=lambda p: (
                    ShardPlacementResult(Shard(0), pair) if p is on_pair else None
                ),
            )
        untouched(model.block)
    with pytest.raises(ValueError, match=r"fully_shard\(MoE\).*reshard_after_forward=<int>"):
        fully_shard(
            model.block,
            mesh=dp,
            reshard_after_forward=2,
            shard_placement_fn=lambda p: (
                ShardPlacementResult(Shard(0), edp) if p is on_pair else None
            ),
        )
    untouched(model.block)
    with pytest.raises(ValueError, match=r"experts.*not a 1-D"):
        fully_shard(
            model.block, mesh=dp, shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), "edp")
        )  # type: ignore[arg-type]
    untouched(model.block)
    _shard(model, edp, dp, "shard0")
    with pytest.raises(ValueError, match="several meshes"):
        model.block.set_custom_all_gather(lambda **kw: None)
    dist.barrier()


CHECKS: dict[str, Callable[[int, int], None]] = {
    "shard0": _check_equal_to_one_process("shard0"),
    "shard1": _check_equal_to_one_process("shard1"),
    "torch-result": _check_equal_to_one_process("torch-result"),
    "default-divide-equals-fsdp2": check_default_divide_equals_fsdp2,
    "one-collective-per-mesh": check_one_collective_per_mesh,
    "state-dicts": check_state_dicts_per_mesh,
    "part-unused-on-some-ranks": check_a_part_unused_on_some_ranks,
    "bad-meshes": check_bad_meshes_refused,
}

test_per_parameter_meshes = named_check_test(__name__, CHECKS, WORLD, timeout=240)
