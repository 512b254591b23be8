"""``optimizer_in_backward``: the optimizer steps each module inside backward.

Every check compares with one process that steps after backward as usual
(same seed, whole batch, the same optimizer and LR schedule): the parameters
must be the same, whether the steps run on the worker thread (offload) or
inline, with microbatches, and after ``load_state_dict``. All checks run in
one set of 2 processes; each test reads its own check's result.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

import shardwise
from dist_utils import named_check_test
from models import Block, Net, batches, loss_fn
from shardwise import fully_shard, optimizer_in_backward
from shardwise.comm import collectives
from test_parity_and_prefetch import assert_between_steps, global_mean

pytestmark = pytest.mark.timeout(300)


def adamw(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """Two parameter groups (no decay on vectors) and a schedule that changes every step."""
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2]},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


def sharded(ref: Net, offload: bool, keep_gathered: bool = False) -> Net:
    model = copy.deepcopy(ref)
    policy = shardwise.CPUOffloadPolicy() if offload else None
    for stage in model.stages:  # the blocks checkpointing wraps
        fully_shard(stage.a, offload_policy=policy)
        fully_shard(stage.b, offload_policy=policy)
    fully_shard(model.extra, offload_policy=policy)
    fully_shard(model, offload_policy=policy)
    if keep_gathered:  # kept gathered after backward: stale unless resharded after the step
        model.extra.set_reshard_after_backward(False, recurse=False)
    return model


def train_and_compare(
    rank: int, world: int, model: Net, ref: Net, micro: str, device: str = "cpu"
) -> None:
    """3 steps; step 1 in two microbatches, told apart by ``micro``."""
    opt, sched = adamw(model)
    ref_opt, ref_sched = adamw(ref)
    handle = optimizer_in_backward(model, opt)
    calls = []  # the caller's step hooks fire once per caller's step, not per module
    opt.register_step_pre_hook(lambda *args: calls.append("pre"))
    opt.register_step_post_hook(lambda *args: calls.append("post"))
    for step, idx in enumerate(batches(3)):
        idx = idx.to(device)
        mine = idx.chunk(world)[rank]
        loss = torch.zeros((), device=device)
        parts = mine.chunk(2) if step == 1 else [mine]
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            piece = loss_fn(model, part) / len(parts)
            if micro == "is_last_backward":  # after a forward: the root context exists
                model.set_is_last_backward(last)
            elif micro == "gradient_sync":
                model.set_requires_gradient_sync(last)
            piece.backward()
            loss += piece.detach()
        assert_between_steps(model)
        for name, p in model.named_parameters():
            assert p.grad is None, f"{name}: a gradient left after the step in backward"
        stepped = {n: p.full_tensor() for n, p in model.named_parameters()}
        opt.step()  # the caller's step: nothing left to do for these parameters
        for name, p in model.named_parameters():
            assert torch.equal(p.full_tensor(), stepped[name]), f"{name} stepped twice"
        opt.zero_grad()
        sched.step()
        want = loss_fn(ref, idx)
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
        torch.testing.assert_close(global_mean(loss), want.detach(), atol=1e-5, rtol=1e-5)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(
                p.full_tensor().to(device), q, atol=1e-5, rtol=1e-5, msg=name
            )
    steps = {int(s["step"]) for s in opt.state_dict()["state"].values()}
    assert steps == {3}, f"AdamW's step counts {steps}, expected 3 for every parameter"
    assert calls == ["pre", "post"] * 3, calls
    for name, p in model.named_parameters():  # what checkpoints read: DTensors like p
        for key in ("exp_avg", "exp_avg_sq"):
            s = opt.state[p][key]
            assert isinstance(s, DTensor) and s.placements == p.placements, (name, key)
            assert s.shape == p.shape and s.to_local().shape == p.to_local().shape, (name, key)
    handle.remove()


def check_offload(rank: int, world: int, device: str = "cpu") -> None:
    """Offloaded: the steps run on the worker thread; microbatches by set_is_last_backward.

    Also on the GPUs (tests/library/cuda/test_cuda.py): gradients downloaded to pinned memory
    while the thread steps the modules that arrived before.
    """
    torch.manual_seed(0)
    ref = Net(d=16, ac="non-reentrant").to(device)
    model = sharded(ref, offload=True)
    train_and_compare(rank, world, model, ref, "is_last_backward", device)


def check_inline(rank: int, world: int) -> None:
    """Not offloaded: inline steps; microbatches without sync; a module kept gathered."""
    torch.manual_seed(0)
    ref = Net(d=16)
    model = sharded(ref, offload=False, keep_gathered=True)
    train_and_compare(rank, world, model, ref, "gradient_sync")


class MyAdamW(torch.optim.AdamW):
    """Not one of torch's own classes: stepped as DTensors, not as local shards."""


def check_load_state_dict_and_remove(rank: int, world: int) -> None:
    """A checkpoint loaded into the optimizer is what later steps continue from; an
    optimizer class of the user's own steps the DTensors; after remove() the
    gradients stay for the caller's step again."""
    torch.manual_seed(0)
    ref = Net(d=16)
    model = sharded(ref, offload=True)
    opt = MyAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    handle = optimizer_in_backward(model, opt, separable=True)
    first, second = batches(2)
    loss_fn(model, first.chunk(world)[rank]).backward()
    loss_fn(ref, first).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    saved = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(saved)  # a new state dict object: steps must use it
    loss_fn(model, second.chunk(world)[rank]).backward()
    loss_fn(ref, second).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, atol=1e-5, rtol=1e-5, msg=name)
    assert {int(s["step"]) for s in opt.state_dict()["state"].values()} == {2}
    # torch's clip would find no gradients and clip nothing, silently: refused like ours
    # (the differential fuzzer's finding), by either name torch exports it under.
    for clip in (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad.clip_grad_norm_):
        with pytest.raises(RuntimeError, match="step inside backward"):
            clip(model.parameters(), 1.0)
    handle.remove()
    loss_fn(model, first.chunk(world)[rank]).backward()
    assert all(p.grad is not None for p in model.parameters()), "remove() left steps in backward"
    shardwise.clip_grad_norm_(model.parameters(), 1.0)  # allowed again
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # torch's own again
    assert torch.nn.utils.clip_grad_norm_.__module__ == "torch.nn.utils.clip_grad"
    assert float(norm.full_tensor() if isinstance(norm, DTensor) else norm) > 0


class Failing(torch.optim.SGD):
    fail = False

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> None:
        if self.fail:
            raise ValueError("step failed on purpose")
        super().step(closure)


class NormSGD(torch.optim.Optimizer):
    """Each parameter moves by its own normalised gradient: separable, but the norm
    of a DTensor gradient is a collective, so it must not run on the worker thread."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / (p.grad.norm() + 1e-3), alpha=-group["lr"])


def check_errors(rank: int, world: int) -> None:
    """Bad input: one clear error, nothing changed; a failing step raises from backward
    after the clean-up, and every module keeps its gradients."""
    torch.manual_seed(0)
    ref = Net(d=16)
    model = sharded(ref, offload=True)
    opt, _ = adamw(model)
    with pytest.raises(TypeError, match="is not sharded"):
        optimizer_in_backward(ref, opt)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        optimizer_in_backward(model, object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="LBFGS"):
        optimizer_in_backward(model, torch.optim.LBFGS(model.parameters()))
    with pytest.raises(TypeError, match="pass separable=True"):
        optimizer_in_backward(model, NormSGD(model.parameters()))
    with pytest.raises(ValueError, match="none of the optimizer's parameters"):
        optimizer_in_backward(model, torch.optim.SGD(ref.parameters(), lr=0.1))
    assert all(s.group is None or s.group.step_in_backward is None for s in states(model))
    handle = optimizer_in_backward(model, opt)
    with pytest.raises(RuntimeError, match="already step inside backward with this optimizer"):
        optimizer_in_backward(model, opt)
    with pytest.raises(RuntimeError, match="with another optimizer"):
        optimizer_in_backward(model, torch.optim.SGD(model.parameters(), lr=0.1))
    idx = batches(1)[0].chunk(world)[rank]
    loss_fn(model, idx).backward()
    before = {n: p.full_tensor() for n, p in model.named_parameters()}
    with pytest.raises(RuntimeError, match="step inside backward"):
        shardwise.clip_grad_norm_(model.parameters(), 1.0)
    handle.remove()

    failing = Failing(model.parameters(), lr=0.1)
    handle = optimizer_in_backward(model, failing, separable=True)
    failing.fail = True
    with pytest.raises(ValueError, match="step failed on purpose"):
        loss_fn(model, idx).backward()
    assert_between_steps(model)  # the error came after the clean-up
    for name, p in model.named_parameters():
        assert torch.equal(p.full_tensor(), before[name]), f"{name} changed by a failed step"
        assert p.grad is not None, f"{name} lost its gradient to a failed step"
    failing.fail = False
    model.zero_grad()
    loss_fn(model, idx).backward()  # usable again: this one steps
    assert any(not torch.equal(p.full_tensor(), before[n]) for n, p in model.named_parameters())
    handle.remove()


def check_two_forwards_and_separable(rank: int, world: int) -> None:
    """Two forwards, one backward: a module reduced once per forward steps once, at
    the end. A separable optimizer whose step communicates, offloaded, steps on the
    autograd thread (on the worker its norms would interleave with the backward's
    collectives)."""
    for make in (
        lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
        lambda params: NormSGD(params, lr=0.05),
    ):
        torch.manual_seed(0)
        ref = Net(d=16)
        model = sharded(ref, offload=True)
        opt, ref_opt = make(model.parameters()), make(ref.parameters())
        handle = optimizer_in_backward(model, opt, separable=True)
        for idx in batches(2):
            first, second = idx.chunk(world)[rank].chunk(2)
            (loss_fn(model, first) + loss_fn(model, second)).backward()
            assert_between_steps(model)
            half, other = idx.chunk(2 * world)[2 * rank : 2 * rank + 2]
            assert torch.equal(half, first) and torch.equal(other, second)
            # The reference: the same two losses per rank, averaged over the ranks.
            pieces = idx.chunk(2 * world)
            want = sum(
                loss_fn(ref, pieces[2 * r]) + loss_fn(ref, pieces[2 * r + 1]) for r in range(world)
            )
            (want / world).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                assert p.grad is None, name
                torch.testing.assert_close(p.full_tensor(), q, atol=1e-5, rtol=1e-5, msg=name)
        if isinstance(opt, torch.optim.AdamW):
            assert {int(s["step"]) for s in opt.state_dict()["state"].values()} == {2}
        handle.remove()


class BlockTwice(nn.Module):
    """One block in two reentrant-checkpointed regions, another between them."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, d)
        self.blk = Block(d)
        self.mid = Block(d)
        self.head = nn.Linear(d, 5)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for m in (self.blk, self.mid, self.blk):
            x = checkpoint(m, x, use_reentrant=True)
        return self.head(x)


def check_refusals_in_backward(rank: int, world: int) -> None:
    """A module needed again after it stepped is refused, not stepped twice; a backward
    that raised steps none of the reductions still pending, and the caller's next use
    of the optimizer cleans it up."""
    torch.manual_seed(0)
    model = BlockTwice()
    for m in (model.blk, model.mid, model):
        fully_shard(m)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    handle = optimizer_in_backward(model, opt)
    idx = batches(1)[0].chunk(world)[rank]
    with pytest.raises(RuntimeError, match="needed again in the backward that already stepped"):
        loss_fn(model, idx).backward()
    model.reset_iter_state()
    handle.remove()

    # A sharded child called on its own before the root: two graphs, so every
    # module steps once, at the end (not refused, not stepped twice).
    torch.manual_seed(0)
    model = sharded(Net(d=16), offload=False)
    loss_fn(model, idx).backward()  # the root is known once it ran
    model.zero_grad()
    opt, _ = adamw(model)
    handle = optimizer_in_backward(model, opt)
    aux = model.extra(torch.randn(2, 3, 16)).pow(2).mean()
    (aux + loss_fn(model, idx)).backward()
    assert_between_steps(model)
    assert {int(s["step"]) for s in opt.state_dict()["state"].values()} == {1}
    handle.remove()

    # The error is raised at the gradient of stages.0.b's output. By then
    # stages.1.a's post-backward has run (its autograd node came later in
    # forward), so its reduction is the one still in flight: it must not step,
    # and its gradients are dropped (context.py's abandon_backward says why).
    torch.manual_seed(0)
    model = sharded(Net(d=16), offload=False)
    opt, _ = adamw(model)
    handle = optimizer_in_backward(model, opt)
    before = {n: p.full_tensor() for n, p in model.named_parameters()}

    def boom(grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("backward failed on purpose")

    def arm(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        out.register_hook(boom)

    model.stages[0].b.register_forward_hook(arm)
    with pytest.raises(ValueError, match="backward failed on purpose"):
        loss_fn(model, idx).backward()
    opt.state_dict()  # the caller's next use of the optimizer settles the failed backward
    ctx = model.fsdp_context
    assert ctx is not None and ctx.phase is shardwise.Phase.IDLE and not ctx.pending_reduces
    stepped = {
        n for n, p in model.named_parameters() if not torch.equal(p.full_tensor(), before[n])
    }
    want = {n for n, _ in model.named_parameters() if n.startswith(("extra.", "stages.1.b."))}
    assert stepped == want, sorted(stepped ^ want)
    for name, p in model.named_parameters():
        if name.startswith("stages.1.a."):
            assert p.grad is None, f"{name}: the failed pass's reduction reached .grad"
    handle.remove()


def check_per_parameter_steps_regather_nothing_else(rank: int, world: int) -> None:
    """torch's own idiom, one optimizer per parameter stepped in its
    post-accumulate-grad hook: modules kept gathered from forward
    (``reshard_after_forward=False``) are not gathered again in backward because
    another module stepped, and a module kept gathered across its own step
    (``set_reshard_after_backward(False)``) gathers the stepped values. foreach
    AdamW steps bump no version counter, so only a precise record of what stepped
    tells the two apart. Parity with one process stepping after backward."""
    torch.manual_seed(0)
    ref = Net(d=16)
    model = copy.deepcopy(ref)
    for stage in model.stages:
        fully_shard(stage.a, reshard_after_forward=False)
        fully_shard(stage.b, reshard_after_forward=False)
    fully_shard(model.extra, reshard_after_forward=False)
    fully_shard(model)
    model.extra.set_reshard_after_backward(False, recurse=False)
    opts = {id(p): torch.optim.AdamW([p], lr=1e-2, foreach=True) for p in model.parameters()}

    def step(p: torch.Tensor) -> None:
        opts[id(p)].step()
        opts[id(p)].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)
    # The reference first: its steps, outside backward, would make every kept
    # module gather again (_OptimizerSteps counts them), hiding a stale one.
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    wants = []
    for idx in batches(3):
        want = loss_fn(ref, idx)
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        wants.append(want.detach())
    gathers: list[str] = []
    counting = [False]

    def seen(rec: collectives.CollectiveRecord, pending: collectives.Pending) -> None:
        if counting[0] and rec.kind == "all_gather":
            gathers.append(rec.label)

    remove = collectives.add_observer(seen)
    try:
        for idx, want in zip(batches(3), wants):
            loss = loss_fn(model, idx.chunk(world)[rank])
            counting[0] = True
            loss.backward()
            counting[0] = False
            assert not gathers, f"gathered again in backward: {gathers}"
            # The next forward reads the kept module: stale values would show here.
            torch.testing.assert_close(global_mean(loss.detach()), want)
    finally:
        remove()
    sd = model.state_dict()  # resharded first: the sharded parameters
    for name, q in ref.state_dict().items():
        torch.testing.assert_close(sd[name].full_tensor(), q, atol=1e-5, rtol=1e-5, msg=name)


def states(model: nn.Module) -> list:
    return [m._shardwise_state for m in model.modules() if isinstance(m, shardwise.FSDPModule)]


CHECKS: dict[str, Callable[[int, int], None]] = {
    "offloaded, worker thread, set_is_last_backward": check_offload,
    "inline, gradient sync off, kept gathered": check_inline,
    "load_state_dict and remove": check_load_state_dict_and_remove,
    "bad input and a failing step": check_errors,
    "two forwards, and a separable optimizer offloaded": check_two_forwards_and_separable,
    "refused in backward: stepped twice, a failed backward": check_refusals_in_backward,
    "per-parameter steps regather nothing else": check_per_parameter_steps_regather_nothing_else,
}


test_optimizer_in_backward = named_check_test(__name__, CHECKS, 2, timeout=200)
