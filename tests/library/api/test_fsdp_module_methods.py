"""The rest of FSDP2's ``FSDPModule`` methods, each against one process.

All checks of one world size run in one set of processes (the module
fixture); each test reads its own check's result.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import shardwise
from dist_utils import named_check_test, run_distributed
from models import Net, batches, loss_fn
from shardwise import fully_shard
from shardwise.comm import collectives
from test_parity_and_prefetch import assert_between_steps, shard_net
from test_training_options import reference_and_sharded

pytestmark = pytest.mark.timeout(300)


def grads_of(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {
        n: None if p.grad is None else p.grad.full_tensor() for n, p in model.named_parameters()
    }


def reference_grads(ref: nn.Module, idx: torch.Tensor, world: int) -> dict[str, torch.Tensor]:
    """One process: the gradient of the mean over the ranks' slice losses."""
    ref.zero_grad()
    sum(loss_fn(ref, part) for part in idx.chunk(world)).div(world).backward()
    return {n: p.grad.clone() for n, p in ref.named_parameters()}


def counting(kind: str) -> tuple[Counter, Callable[[], None]]:
    seen: Counter = Counter()
    remove = collectives.add_observer(
        lambda rec, _: seen.update([rec.label]) if rec.kind == kind else None
    )
    return seen, remove


def each_sharded(model: nn.Module) -> list[shardwise.FSDPModule]:
    """FSDP2's per-module setters are called on every module, as torchtitan does."""
    return [m for m in model.modules() if isinstance(m, shardwise.FSDPModule)]


def close(got: dict, want: dict, scale: float = 1.0) -> None:
    for n, g in got.items():
        assert g is not None, f"{n} has no gradient"
        torch.testing.assert_close(g, want[n] * scale, atol=1e-5, rtol=1e-5, msg=n)


# ---- checks (each runs on every rank) --------------------------------------------------------


def check_divide_factor(rank: int, world: int) -> None:
    idx = batches(1)[0]
    for factor, alias in ((1.0, False), (4.0, True)):
        ref, model = reference_and_sharded(hsdp=False)
        for m in each_sharded(model):
            if alias:
                with pytest.warns(FutureWarning, match="set_gradient_divide_factor"):
                    m.set_reduce_scatter_divide_factor(factor)
            else:
                m.set_gradient_divide_factor(factor)
        loss_fn(model, idx.chunk(world)[rank]).backward()
        # The sum over ranks divided by the factor: world / factor times the mean.
        close(grads_of(model), reference_grads(ref, idx, world), scale=world / factor)


def force_sum_worker(rank: int, world: int, device: str = "cpu") -> None:
    """Reduce-scatters average inside the collective where the backend can (NCCL),
    and sum, then divide, where forced or where it cannot (gloo): same gradients."""
    idx = batches(1)[0].to(device)
    ops: list[str] = []
    remove = collectives.add_observer(
        lambda rec, _: ops.append(rec.op) if rec.kind == "reduce_scatter" else None
    )
    for force in (False, True):
        ops.clear()
        torch.manual_seed(0)
        ref = Net().to(device)
        model = copy.deepcopy(ref)
        shard_net(model, {})
        for m in each_sharded(model):
            m.set_force_sum_reduction_for_comms(force)
        loss_fn(model, idx.chunk(world)[rank]).backward()
        close(grads_of(model), reference_grads(ref, idx, world))
        want = "sum" if force or device == "cpu" else "avg"
        assert ops and set(ops) == {want}, (force, ops)
    remove()


def check_force_sum(rank: int, world: int) -> None:
    force_sum_worker(rank, world)
    shard = fully_shard(nn.Linear(2, 2))
    shard.set_force_sum_reduction_for_comms(True)
    with pytest.raises(TypeError, match="expects a bool"):
        shard.set_force_sum_reduction_for_comms(1)  # type: ignore[arg-type]
    assert all(g.settings.force_sum for g in shard._groups(recurse=False)), (
        "a refused call changed it"
    )


class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(5, 8)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.table(idx)


class EmbedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = Tokens()
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 5)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.body(self.tokens(idx))))


def check_unshard_in_backward(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ref = EmbedNet()
    model = copy.deepcopy(ref)
    fully_shard(model.tokens)
    fully_shard(model.body)
    fully_shard(model)
    model.tokens.set_unshard_in_backward(False)  # an embedding's backward needs no weight
    gathers, remove = counting("all_gather")
    idx = batches(1)[0]
    try:
        loss_fn(model, idx.chunk(world)[rank]).backward()
    finally:
        remove()
    assert gathers["tokens"] == 1 and gathers["body"] == 2, gathers
    assert_between_steps(model)
    close(grads_of(model), reference_grads(ref, idx, world))


def check_is_last_backward(rank: int, world: int) -> None:
    ref, model = reference_and_sharded(hsdp=False)
    micro = batches(2)
    model.set_is_last_backward(False)  # before the first forward, as FSDP2 allows
    loss_fn(model, micro[0].chunk(world)[rank]).backward()
    assert model.fsdp_context.pending_reduces, "a reduction should still be in flight"
    model.set_is_last_backward(True)
    loss_fn(model, micro[1].chunk(world)[rank]).backward()
    assert not model.fsdp_context.pending_reduces
    want0 = reference_grads(ref, micro[0], world)
    want1 = reference_grads(ref, micro[1], world)
    close(grads_of(model), {n: want0[n] + want1[n] for n in want0})


class Branchy(nn.Module):
    """``rare`` is used on rank 0 only (conditional control flow, as in MoE)."""

    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Linear(4, 4)
        self.rare = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_rare: bool) -> torch.Tensor:
        y = self.main(x)
        return self.rare(y) if use_rare else y


def check_reduce_scatter_unused(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ref = Branchy()
    x = torch.randn(2 * world, 4, generator=torch.Generator().manual_seed(3))
    ref_loss = sum(ref(part, r == 0).square().mean() for r, part in enumerate(x.chunk(world)))
    (ref_loss / world).backward()
    for flag in (False, True):
        model = copy.deepcopy(ref)
        model.zero_grad()
        fully_shard(model)
        model.set_reduce_scatter_unused_params(flag)
        model(x.chunk(world)[rank], rank == 0).square().mean().backward()
        rare = model.rare.weight.grad
        if flag:  # the mean over ranks (zeros from ranks that did not use it) on every rank
            torch.testing.assert_close(rare.full_tensor(), ref.rare.weight.grad)
        else:  # the default: only ranks that used it hold a gradient
            assert (rare is None) == (rank != 0)
        torch.testing.assert_close(model.main.weight.grad.full_tensor(), ref.main.weight.grad)


def check_all_reduce_hook(rank: int, world: int) -> None:
    ref, model = reference_and_sharded(hsdp=False)
    calls: list[int] = []

    def hook(reduced: torch.Tensor) -> None:
        calls.append(reduced.numel())
        reduced.mul_(2.0)

    for m in each_sharded(model):
        m.set_all_reduce_hook(hook)
    idx = batches(1)[0]
    loss_fn(model, idx.chunk(world)[rank]).backward()
    assert len(calls) == len(each_sharded(model)), calls  # once per module
    close(grads_of(model), reference_grads(ref, idx, world), scale=2.0)


class Event:
    def __init__(self) -> None:
        self.waits = 0

    def wait(self) -> None:
        self.waits += 1


def check_post_optim_event(rank: int, world: int) -> None:
    _, model = reference_and_sharded(hsdp=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    idx = batches(1)[0].chunk(world)[rank]
    first = Event()
    model.set_post_optim_event(first)  # before the first forward: it waits on it
    loss_fn(model, idx).backward()
    assert first.waits == 1
    opt.step()
    event = Event()
    model.set_post_optim_event(event)
    loss_fn(model, idx).backward()
    loss_fn(model, idx).backward()
    assert event.waits == 1  # waited on by the next forward, then discarded


def check_custom_collectives(rank: int, world: int) -> None:
    ref, model = reference_and_sharded(hsdp=False)
    calls: Counter = Counter()

    def gather(output_tensor, input_tensor, group, async_op):  # noqa: ANN001
        calls["all_gather"] += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group, async_op=async_op)

    def reduce(output_tensor, input_tensor, group, op, async_op):  # noqa: ANN001
        calls["reduce_scatter"] += 1
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op, group, async_op)

    block = model.stages[0].a
    block.set_custom_all_gather(gather)
    block.set_custom_reduce_scatter(reduce)
    idx = batches(1)[0]
    loss_fn(model, idx.chunk(world)[rank]).backward()
    assert calls == Counter({"all_gather": 2, "reduce_scatter": 1}), calls  # this module only
    close(grads_of(model), reference_grads(ref, idx, world))


def check_max_input_buffers(rank: int, world: int) -> None:
    ref, model = reference_and_sharded(hsdp=False)
    model.set_reduce_scatter_max_input_buffers(2)
    most = 0

    def watch(rec: Any, _: Any) -> None:
        nonlocal most
        if rec.kind == "reduce_scatter":
            most = max(most, len(model.fsdp_context.pending_reduces) + 1)

    remove = collectives.add_observer(watch)
    idx = batches(1)[0]
    try:
        loss_fn(model, idx.chunk(world)[rank]).backward()
    finally:
        remove()
    assert most == 2, most
    close(grads_of(model), reference_grads(ref, idx, world))


def check_separate_reduce_scatter_group(rank: int, world: int) -> None:
    ref, model = reference_and_sharded(hsdp=False)
    model.set_separate_reduce_scatter_group(True)
    group = model._shardwise_state.group
    assert group.settings.reduce_scatter_group is not group.shard_group
    assert dist.get_process_group_ranks(group.settings.reduce_scatter_group) == list(range(world))
    idx = batches(1)[0]
    loss_fn(model, idx.chunk(world)[rank]).backward()
    close(grads_of(model), reference_grads(ref, idx, world))


def check_backend_specific_errors(rank: int, world: int) -> None:
    _, model = reference_and_sharded(hsdp=False)
    with pytest.raises(ValueError, match="gloo"):
        model.set_symm_mem_for_comm()
    with pytest.raises(ValueError, match="gloo"):
        model.set_allocate_memory_from_process_group_for_comm(True)
    assert model._shardwise_state.settings.comm_alloc is None  # nothing changed
    model.set_allocate_memory_from_process_group_for_comm(False)
    # Symmetric memory allows one reduction in flight, whichever is set first (as FSDP2).
    model.set_reduce_scatter_max_input_buffers(2, recurse=False)
    with pytest.raises(ValueError, match="one reduction in flight"):
        model.set_symm_mem_for_comm()
    model.set_reduce_scatter_max_input_buffers(1, recurse=False)

    def symmetric(numel: int, dtype: torch.dtype) -> torch.Tensor:  # stands in for NCCL's
        return torch.empty(numel, dtype=dtype)

    symmetric.symmetric = True  # type: ignore[attr-defined]
    model._shardwise_state.change_settings(comm_alloc=symmetric)
    with pytest.raises(ValueError, match="symmetric memory"):
        model.set_reduce_scatter_max_input_buffers(2)
    assert model._shardwise_state.settings.max_reduces_in_flight == 1
    model._shardwise_state.change_settings(comm_alloc=None)
    bad = [
        (lambda: model.set_gradient_divide_factor(0), ValueError),
        (lambda: model.set_requires_all_reduce("no"), TypeError),
        (lambda: model.set_reduce_scatter_max_input_buffers(0), ValueError),
        (lambda: model.set_all_reduce_hook(3), TypeError),
    ]
    for call, exc in bad:
        with pytest.raises(exc):
            call()
    assert model._shardwise_state.settings.divide_factor is None
    with pytest.raises(RuntimeError, match="deepcopy.*state_dict"):
        copy.deepcopy(model)
    # FSDP2's signature: recurse may be positional.
    model.set_reshard_after_forward(False, False)
    assert not model._shardwise_state.settings.reshard_after_forward
    assert model.extra._shardwise_state.settings.reshard_after_forward
    # Per module, as in FSDP2: the root's setting leaves its children alone.
    model.set_gradient_divide_factor(2.0)
    assert model._shardwise_state.settings.divide_factor == 2.0
    assert model.extra._shardwise_state.settings.divide_factor is None


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 5)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)

    def generate(self, idx: torch.Tensor, steps: int) -> torch.Tensor:
        for _ in range(steps):
            nxt = self.emb(idx[:, -1:])  # a method other than forward touching the root's weights
            for b in self.blocks:
                nxt = torch.tanh(b(nxt))
            idx = torch.cat([idx, self.head(nxt).argmax(-1)], dim=1)
        return idx


def check_forward_method(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ref = Generator()
    model = copy.deepcopy(ref)
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    shardwise.register_fsdp_forward_method(model, "generate")
    prompt = torch.tensor([[1, 2], [3, 4]])
    with torch.no_grad():
        out = model.generate(prompt, 3)
    torch.testing.assert_close(out, ref.generate(prompt, 3))
    # Unlike FSDP2, nothing stays gathered after a no-grad call, the root included.
    assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
    assert_between_steps(model)
    with pytest.raises(ValueError, match="no method"):
        shardwise.register_fsdp_forward_method(model, "sample")
    # A module without forward, called only through a registered method.
    torch.manual_seed(0)
    ref_enc = Encoder()
    enc = copy.deepcopy(ref_enc)
    fully_shard(enc)
    shardwise.register_fsdp_forward_method(enc, "encode")
    x = torch.randn(2 * world, 4, generator=torch.Generator().manual_seed(5))
    enc.encode(x.chunk(world)[rank]).square().mean().backward()
    ref_enc.encode(x).square().mean().backward()
    assert_between_steps(enc)
    torch.testing.assert_close(enc.proj.weight.grad.full_tensor(), ref_enc.proj.weight.grad)


class Encoder(nn.Module):
    """No forward of its own: its users call ``encode``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x))


def check_unshard_handle(rank: int, world: int) -> None:
    ref, model = reference_and_sharded(hsdp=False)
    idx = batches(1)[0]
    handle = model.extra.unshard(async_op=True)
    assert handle is not None
    handle.wait()  # waited for before forward: gathered
    assert not isinstance(model.extra.fc1.weight, torch.distributed.tensor.DTensor)
    handle = model.stages[0].a.unshard(async_op=True)
    loss_fn(model, idx.chunk(world)[rank]).backward()  # its forward used that gather
    assert handle is not None
    handle.wait()  # late: nothing left to wait for, nothing gathered again
    assert_between_steps(model)
    close(grads_of(model), reference_grads(ref, idx, world))


CHECKS_W2: dict[str, Callable[[int, int], None]] = {
    "set_gradient_divide_factor": check_divide_factor,
    "set_force_sum_reduction_for_comms": check_force_sum,
    "set_unshard_in_backward": check_unshard_in_backward,
    "set_is_last_backward": check_is_last_backward,
    "set_reduce_scatter_unused_params": check_reduce_scatter_unused,
    "set_all_reduce_hook": check_all_reduce_hook,
    "set_post_optim_event": check_post_optim_event,
    "set_custom_all_gather/reduce_scatter": check_custom_collectives,
    "set_reduce_scatter_max_input_buffers": check_max_input_buffers,
    "set_separate_reduce_scatter_group": check_separate_reduce_scatter_group,
    "backend-specific and bad input": check_backend_specific_errors,
    "register_fsdp_forward_method": check_forward_method,
    "unshard(async_op=True)": check_unshard_handle,
}


test_fsdp2_method = named_check_test(__name__, CHECKS_W2, 2, timeout=250)


# ---- HSDP: all-reduce held back over microbatches ---------------------------------------------


def requires_all_reduce_worker(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    shard_net(model, {"mesh": shardwise.hsdp_mesh(2)})
    micro = batches(2)
    reduces, remove = counting("all_reduce")
    try:
        model.set_requires_all_reduce(False)
        loss_fn(model, micro[0].chunk(world)[rank]).backward()
        assert sum(reduces.values()) == 0 and all(p.grad is None for p in model.parameters())
        model.set_requires_all_reduce(True)
        loss_fn(model, micro[1].chunk(world)[rank]).backward()
    finally:
        remove()
    sharded = [m for m in model.modules() if isinstance(m, shardwise.FSDPModule)]
    assert sum(reduces.values()) == len(sharded), reduces  # one all-reduce per module, once
    assert_between_steps(model)
    want0 = reference_grads(ref, micro[0], world)
    want1 = reference_grads(ref, micro[1], world)
    close(grads_of(model), {n: want0[n] + want1[n] for n in want0})


def test_set_requires_all_reduce_holds_hsdp_sums_back() -> None:
    run_distributed(requires_all_reduce_worker, 4)
