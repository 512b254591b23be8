"""Lightning 2.6.6 ``ModelParallelStrategy``: Fabric and the Trainer, FSDP2 through them.

The processes are started by the test (gloo, already initialised); with
``LOCAL_RANK`` and friends in the environment Lightning takes them as
launched externally (as under torchrun) and joins the existing process group.
The strategy gets ``data_parallel_size=2, tensor_parallel_size=1`` spelled
out: ``"auto"`` means the number of *nodes*, which on one machine of CPU
processes is a data-parallel mesh of size 1 (and a "tensor-parallel" one of
size 2 that nothing uses).

Cases: ``fabric`` (``parallelize_fn`` shards each block and the root; clipped
AdamW), ``accum`` (two microbatches, the first under
``fabric.no_backward_sync``: exactly one reduce-scatter per module and
optimizer step), ``accum-control`` (gradient sync that cannot be turned off:
the count check notices), ``save-load`` (``fabric.save`` a distributed
checkpoint after two steps, ``fabric.load`` it into a new model and
optimizer, one more step), ``empty-init`` (``fabric.init_module(empty_init=True)``:
built on meta, materialised by the strategy, then ``fabric.load_raw`` of a
full state dict), ``trainer`` / ``trainer-accum`` (``configure_model`` shards,
``accumulate_grad_batches=2``), ``trainer-resume`` (``trainer.save_checkpoint``
after an epoch, a new Trainer resumes with ``fit(ckpt_path=...)``). Each
against one process on the batches the ranks actually saw. ``auto-mesh``
checks the ``"auto"`` sizes' mesh, as documented.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from models import Block

from .common import (
    check_sharded_by,
    close,
    count_reduce_scatters,
    expect_failure,
    full,
    global_mean,
    groups_of,
    patched,
    same_params,
)

VOCAB, DIM, SEQ, LOCAL, STEPS, LR, MAX_NORM = 64, 16, 8, 2, 3, 1e-2, 0.5
_dir: dict[str, str] = {}


def setup(rank: int, world: int, impl: str, folder: str) -> None:
    os.environ.update(
        LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29400",
    )  # fmt: skip
    _dir["root"] = os.path.join(folder, impl)
    import lightning  # noqa: F401  (after patch_fsdp2, as a user's script imports it)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(DIM) for _ in range(2)])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def shard(model: nn.Module, mesh: Any) -> nn.Module:
    """What a user's ``parallelize_fn`` / ``configure_model`` writes."""
    from torch.distributed.fsdp import fully_shard  # shardwise's, once patched

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def parallelize(model: nn.Module, device_mesh: Any) -> nn.Module:
    return shard(model, device_mesh["data_parallel"])


def initial() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return Model().state_dict()


def data(world: int, steps: int = STEPS, micro: int = 1) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        [torch.randint(0, VOCAB, (world * LOCAL, SEQ), generator=g) for _ in range(micro)]
        for _ in range(steps)
    ]


def reference(
    steps: list[list[torch.Tensor]], clip: float | None, world: int
) -> tuple[nn.Module, list[float], list[float]]:
    """One process, whole batches: each microbatch's loss the mean of the ranks' means."""
    model = Model()
    model.load_state_dict(initial())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for micro in steps:
        total = 0.0
        for ids in micro:
            loss = sum(loss_of(model, part) for part in ids.chunk(world)) / world
            (loss / len(micro)).backward()
            total += loss.item() / len(micro)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else 1e9)
        norms.append(norm.item())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return model, losses, norms


def fabric_of(world: int) -> Any:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(parallelize, data_parallel_size=world, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()  # launched externally: nothing to start, the process group exists
    assert fabric.strategy.device_mesh["data_parallel"].size() == world
    return fabric


def fabric_model(fabric: Any, impl: str, empty_init: bool = False) -> tuple[Any, Any]:
    with fabric.init_module(empty_init=empty_init):
        model = Model()
    if not empty_init:
        model.load_state_dict(initial())
    model = fabric.setup(model)
    check_sharded_by(model, impl, at_least=3)
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    return model, opt


def fabric_steps(
    fabric: Any, model: Any, opt: Any, steps: list[list[torch.Tensor]], rank: int, world: int,
    impl: str, counts: list[int] | None = None,
) -> tuple[list[float], list[float]]:  # fmt: skip
    losses, norms = [], []
    for micro in steps:
        total = torch.zeros(())
        with count_reduce_scatters(impl) as seen:
            for i, ids in enumerate(micro):
                with fabric.no_backward_sync(model, enabled=i < len(micro) - 1):
                    loss = loss_of(model, ids.chunk(world)[rank]) / len(micro)
                    fabric.backward(loss)
                total += loss.detach()
        if counts is not None:
            counts.append(sum(seen.values()))
            if impl == "shardwise":  # each module's label once
                assert all(n == 1 for n in seen.values()), f"reduce-scatters by module: {seen}"
        norms.append(full(fabric.clip_gradients(model, opt, max_norm=MAX_NORM)).item())
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(total).item())
    return losses, norms


def compare(losses: list[float], norms: list[float], ref: tuple) -> dict:
    model, ref_losses, ref_norms = ref
    close(losses, ref_losses, "losses")
    close(norms, ref_norms, "gradient norms")
    assert max(ref_norms) > MAX_NORM, "nothing was clipped"
    return {"loss": losses, "grad_norm": norms}


def fabric_case(rank: int, world: int, impl: str, case: str) -> dict:
    fabric = fabric_of(world)
    if case == "fabric":
        model, opt = fabric_model(fabric, impl)
        steps = data(world)
        losses, norms = fabric_steps(fabric, model, opt, steps, rank, world, impl)
        ref = reference(steps, MAX_NORM, world)
        same_params(model, ref[0], "after training")
        return compare(losses, norms, ref)
    if case in ("accum", "accum-control"):
        model, opt = fabric_model(fabric, impl)
        steps = data(world, micro=2)
        groups = len(groups_of(model, impl))
        counts: list[int] = []
        losses, norms = fabric_steps(fabric, model, opt, steps, rank, world, impl, counts)
        assert counts == [groups] * len(steps), (
            f"reduce-scatters per optimizer step {counts}, expected one per module ({groups})"
        )
        ref = reference(steps, MAX_NORM, world)
        same_params(model, ref[0], "after training")
        return compare(losses, norms, ref)
    if case == "save-load":
        steps = data(world)
        model, opt = fabric_model(fabric, impl)
        losses, norms = fabric_steps(fabric, model, opt, steps[:2], rank, world, impl)
        path = os.path.join(_dir["root"], "fabric-ckpt")
        fabric.save(path, {"model": model, "optimizer": opt, "step": 2})
        model2, opt2 = fabric_model(fabric, impl)  # fresh weights (the initial ones)
        state = {"model": model2, "optimizer": opt2, "step": 0}
        fabric.load(path, state)
        assert state["step"] == 2
        more = fabric_steps(fabric, model2, opt2, steps[2:], rank, world, impl)
        ref = reference(steps, MAX_NORM, world)
        same_params(model2, ref[0], "resumed")
        return compare(losses + more[0], norms + more[1], ref)
    if case == "empty-init":
        model, opt = fabric_model(fabric, impl, empty_init=True)
        for name, p in model.named_parameters():
            assert not p.is_meta and p.device.type == "cpu", f"{name} not materialised"
            assert torch.isfinite(p.full_tensor()).all(), name
        path = os.path.join(_dir["root"], "full.pt")
        if rank == 0:
            torch.save(initial(), path)
        dist.barrier()
        fabric.load_raw(path, model)  # a full (one-process) state dict into the shards
        steps = data(world)
        losses, norms = fabric_steps(fabric, model, opt, steps, rank, world, impl)
        ref = reference(steps, MAX_NORM, world)
        same_params(model, ref[0], "after training")
        return compare(losses, norms, ref)
    raise ValueError(case)


# ---- the Trainer -------------------------------------------------------------------------------


def trainer_run(
    world: int, impl: str, accumulate: int, max_steps: int, ckpt: str | None = None,
    save: str | None = None,
) -> tuple[list[torch.Tensor], list[float], Any]:  # fmt: skip
    """Fit a LightningModule; the batches this rank saw, its losses, and the module."""
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = Model()
            self.model.load_state_dict(initial())
            self.seen: list[torch.Tensor] = []
            self.losses: list[float] = []

        def configure_model(self) -> None:
            shard(self.model, self.device_mesh["data_parallel"])

        def training_step(self, batch: list[torch.Tensor], idx: int) -> torch.Tensor:
            self.seen.append(batch[0])
            loss = loss_of(self.model, batch[0])
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=LR)

    # One epoch holds two optimizer steps (so a checkpoint after it resumes at
    # an epoch boundary); the loader is sequential, Lightning adds the sampler.
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2 * accumulate * world * LOCAL, SEQ), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=LOCAL)
    strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=max_steps,
        accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    module = Module()
    trainer.fit(module, loader, ckpt_path=ckpt)
    check_sharded_by(module.model, impl, at_least=3)
    if save is not None:
        trainer.save_checkpoint(save)
    return module.seen, module.losses, module


def trainer_case(rank: int, world: int, impl: str, case: str) -> dict:
    accumulate = 2 if case == "trainer-accum" else 1
    if case == "trainer-resume":
        path = os.path.join(_dir["root"], "trainer-ckpt")
        seen, losses, _ = trainer_run(world, impl, 1, 2, save=path)
        more_seen, more_losses, module = trainer_run(world, impl, 1, 3, ckpt=path)
        assert len(more_seen) == 1, f"resumed run took {len(more_seen)} steps, expected 1"
        seen, losses = seen + more_seen, losses + more_losses
    else:
        seen, losses, module = trainer_run(world, impl, accumulate, STEPS)
    assert len(seen) == STEPS * accumulate, (
        f"{len(seen)} training steps, expected {STEPS * accumulate}"
    )
    # The reference trains on what the ranks saw, microbatch by microbatch.
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, seen)
    batches = [torch.cat([everyone[r][i] for r in range(world)]) for i in range(len(seen))]
    steps = [batches[i : i + accumulate] for i in range(0, len(batches), accumulate)]
    ref_model, ref_losses, _ = reference(steps, None, world)
    per_step = [
        global_mean(torch.tensor(sum(losses[i : i + accumulate]) / accumulate)).item()
        for i in range(0, len(losses), accumulate)
    ]
    close(per_step, ref_losses, "losses")
    same_params(module.model, ref_model, "after fit")
    return {"loss": per_step}


def auto_mesh(world: int) -> None:
    """What the docs say: ``data_parallel_size="auto"`` is the number of nodes, so one
    machine's CPU processes get a data-parallel mesh of size 1 (nothing sharded)."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    fabric = Fabric(accelerator="cpu", devices=world, strategy=ModelParallelStrategy(parallelize))
    fabric.launch()
    mesh = fabric.strategy.device_mesh
    assert mesh["data_parallel"].size() == 1 and mesh["tensor_parallel"].size() == world, mesh


def run(rank: int, world: int, impl: str, case: str) -> Any:
    if case == "auto-mesh":
        return auto_mesh(world)
    if case.startswith("trainer"):
        return trainer_case(rank, world, impl, case)
    if case == "accum-control":
        # Sabotage: gradient sync that cannot be turned off (every microbatch reduces).
        if impl == "shardwise":
            from shardwise.runtime.fsdp_module import FSDPModule
        else:
            from torch.distributed.fsdp import FSDPModule
        with patched(FSDPModule, "set_requires_gradient_sync", lambda self, *a, **k: None):
            expect_failure(
                lambda: fabric_case(rank, world, impl, case), "a reduce-scatter per microbatch"
            )
        return None
    return fabric_case(rank, world, impl, case)
