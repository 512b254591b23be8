"""torch.distributed.checkpoint.state_dict's helpers on a model sharded through torch's name.

``get_model_state_dict`` / ``set_model_state_dict`` and
``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` with the options
frameworks pass (sharded; ``full_state_dict``; ``cpu_offload``;
``broadcast_from_rank0`` into a model built on meta), against one process
trained on the whole batch. The model is sharded with
``torch.distributed.fsdp.fully_shard`` (shardwise's once patched).

Cases: ``sharded`` (sharded model and optimizer state through ``dcp.save`` /
``dcp.load`` into a fresh model, then a step), ``full`` (full state dicts,
``cpu_offload``: rank 0 holds the one-process model's tensors and AdamW
state, the other rank nothing), ``broadcast`` (rank 0's full model and
optimizer state loaded with ``broadcast_from_rank0`` into a model sharded on
the meta device, then a step), ``frozen`` (a frozen module: the optimizer
state dict holds only the trainable parameters).
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .common import check_sharded_by, close, same_params

VOCAB, DIM, SEQ, LOCAL, LR = 32, 16, 6, 2, 1e-2
_dir: dict[str, str] = {}


def setup(rank: int, world: int, impl: str, folder: str) -> None:
    _dir["root"] = os.path.join(folder, impl)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, DIM), nn.GELU()) for _ in range(2)]
        )
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def shard(model: Model) -> Model:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids[:, :-1]).reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def batch(step: int, world: int) -> torch.Tensor:
    return torch.randint(
        0, VOCAB, (world * LOCAL, SEQ), generator=torch.Generator().manual_seed(step)
    )


def step(
    model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, world: int, rank: int | None
) -> None:
    loss = (
        loss_of(model, ids.chunk(world)[rank])
        if rank is not None
        else (sum(loss_of(model, part) for part in ids.chunk(world)) / world)
    )
    loss.backward()
    opt.step()
    opt.zero_grad()


def pair(
    impl: str, frozen: bool = False
) -> tuple[Model, torch.optim.Optimizer, Model, torch.optim.Optimizer]:
    torch.manual_seed(0)
    ref = Model()
    if frozen:
        ref.blocks[0].requires_grad_(False)
    model = shard(copy.deepcopy(ref))
    check_sharded_by(model, impl, at_least=3)

    def adamw(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=LR)

    return model, adamw(model), ref, adamw(ref)


def trained(rank: int, world: int, impl: str, frozen: bool = False) -> tuple:
    model, opt, ref, ref_opt = pair(impl, frozen)
    for s in range(2):
        step(model, opt, batch(s, world), world, rank)
        step(ref, ref_opt, batch(s, world), world, None)
    same_params(model, ref, "after two steps")
    return model, opt, ref, ref_opt


def optim_states_close(got: dict, ref_opt: torch.optim.Optimizer, ref: nn.Module) -> None:
    """A full (FQN-keyed) optimizer state dict against the one-process optimizer's."""
    names = {p: n for n, p in ref.named_parameters()}
    want = {names[p]: s for p, s in ref_opt.state.items()}
    assert set(got["state"]) == set(want), set(got["state"]) ^ set(want)
    for name, state in got["state"].items():
        for key, value in state.items():
            value = value.full_tensor() if hasattr(value, "full_tensor") else value
            close(value, want[name][key], f"optimizer {name}.{key}")


def run(rank: int, world: int, impl: str, case: str) -> Any:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.tensor import DTensor

    model, opt, ref, ref_opt = trained(rank, world, impl, frozen=case == "frozen")
    if case in ("sharded", "frozen"):
        msd, osd = get_model_state_dict(model), get_optimizer_state_dict(model, opt)
        assert all(isinstance(v, DTensor) for v in msd.values())
        if case == "frozen":
            assert not any(k.startswith("blocks.0.") for k in osd["state"]), list(osd["state"])
        path = os.path.join(_dir["root"], f"dcp-{case}")
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        model2, opt2, _, _ = pair(impl, frozen=case == "frozen")
        state = {
            "model": get_model_state_dict(model2),
            "optim": get_optimizer_state_dict(model2, opt2),
        }
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model2, state["model"])
        set_optimizer_state_dict(model2, opt2, state["optim"])
    elif case == "full":
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        msd = get_model_state_dict(model, options=options)
        osd = get_optimizer_state_dict(model, opt, options=options)
        if rank == 0:
            want = ref.state_dict()
            assert set(msd) == set(want)
            for k, v in msd.items():
                assert type(v) is torch.Tensor and v.device.type == "cpu", (k, type(v))
                close(v, want[k], k)
            optim_states_close(osd, ref_opt, ref)
        else:
            assert msd == {} and osd.get("state", {}) == {}, "cpu_offload: only rank 0 holds it"
        model2, opt2 = model, opt
    elif case == "broadcast":
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        msd = get_model_state_dict(model, options=full)
        osd = get_optimizer_state_dict(model, opt, options=full)
        with torch.device("meta"):
            model2 = shard(Model())
        model2.to_empty(device="cpu")
        opt2 = torch.optim.AdamW(model2.parameters(), lr=LR)
        load = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model2, msd if rank == 0 else {}, options=load)
        set_optimizer_state_dict(model2, opt2, osd if rank == 0 else {}, options=load)
    else:
        raise ValueError(case)
    same_params(model2, ref, "loaded")
    # One more step from the loaded state: the same as one process (optimizer state included).
    step(model2, opt2, batch(2, world), world, rank)
    step(ref, ref_opt, batch(2, world), world, None)
    same_params(model2, ref, "a step after loading")
    dist.barrier()
    return None
