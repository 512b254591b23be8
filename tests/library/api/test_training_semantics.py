"""FSDP2's training semantics that real clients rely on, each against one process.

Dataclass and namedtuple inputs and outputs; ``requires_grad`` changed after
``fully_shard``; the model cast with ``.to(dtype)`` after it;
``reset_iter_state`` after an exception; slicing a sharded
``nn.Sequential``; ``load_state_dict(assign=True)`` into a model sharded on
the meta device (directly and through DCP's broadcast from rank 0);
``reshard_after_forward``'s defaults (side by side with FSDP2); frozen modules
resharded as soon as their backward is done.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from dist_utils import run_distributed
from models import Net, batches, loss_fn
from shardwise import FSDPModule, MixedPrecisionPolicy, Phase, fully_shard
from shardwise.comm import collectives
from test_parity_and_prefetch import (
    Boom,
    assert_between_steps,
    global_mean,
    shard_net,
    step_and_compare,
)

pytestmark = pytest.mark.timeout(240)


def is_gathered(module: nn.Module) -> bool:
    group = module._shardwise_state.group  # type: ignore[attr-defined]
    return group.unsharded_bytes > 0


# ---- dataclass and namedtuple inputs and outputs ---------------------------------------------


class Pair(NamedTuple):
    a: torch.Tensor
    extras: dict


@dataclass(frozen=True)
class Hidden:
    x: torch.Tensor


@dataclass
class BlockOut:
    main: torch.Tensor
    pair: Pair
    note: str = "block"
    cache: list = field(default_factory=list, init=False)


@dataclass
class Result:  # the root's output: what a user's training loop reads .loss from
    loss: torch.Tensor
    logits: torch.Tensor


class DCBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.seen_dtype: torch.dtype | None = None

    def forward(self, h: Hidden) -> BlockOut:
        self.seen_dtype = h.x.dtype
        y = self.fc2(F.gelu(self.fc1(h.x)))
        out = BlockOut(h.x + y, Pair(y * 0.5, {"deep": [y.tanh()]}))
        out.cache.append(y.sum(-1, keepdim=True))  # an init=False field holding a tensor
        return out


class DCNet(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, d)
        self.blocks = nn.ModuleList(DCBlock(d) for _ in range(3))
        self.head = nn.Linear(d, 5)

    def forward(self, idx: torch.Tensor) -> Result:
        h = Hidden(self.emb(idx[:, :-1]))
        for block in self.blocks:
            out = block(h)
            h = Hidden(out.main + out.pair.a + out.pair.extras["deep"][0] + 0.01 * out.cache[0])
        logits = self.head(h.x).float()
        loss = F.cross_entropy(logits.reshape(-1, 5), idx[:, 1:].reshape(-1))
        return Result(loss, logits)


def dataclass_worker(rank: int, world: int, bf16: bool, device: str = "cpu") -> None:
    torch.manual_seed(0)
    ref = DCNet().to(device)
    model = copy.deepcopy(ref)
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
        if bf16
        else None
    )
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)  # resharded after forward (the default)
    fully_shard(model)  # the root computes in fp32 on the blocks' fp32 outputs
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for idx in batches(3):
        idx = idx.to(device)
        out = model(idx.chunk(world)[rank])
        assert isinstance(out, Result)
        # The loss inside the dataclass told the root that a backward follows.
        assert is_gathered(model) and not any(is_gathered(b) for b in model.blocks)
        if bf16:
            assert all(b.seen_dtype == torch.bfloat16 for b in model.blocks)
        out.loss.backward()
        assert_between_steps(model)
        opt.step()
        opt.zero_grad()
        ref_out = ref(idx)
        ref_out.loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        tol = 3e-2 if bf16 else 1e-5
        torch.testing.assert_close(global_mean(out.loss), ref_out.loss.detach(), atol=tol, rtol=tol)
    # output_dtype reaches tensors inside the block's dataclass, whose type is kept.
    blocks_out = model.blocks[0](Hidden(torch.randn(2, 3, 8, device=device)))
    assert type(blocks_out) is BlockOut and type(blocks_out.pair) is Pair
    if bf16:
        assert blocks_out.main.dtype == torch.float32
        assert blocks_out.pair.extras["deep"][0].dtype == torch.float32
    with torch.no_grad():
        model(batches(1)[0].chunk(world)[rank].to(device))
    assert not is_gathered(model)  # no backward follows a no-grad forward: all sharded


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_dataclass_inputs_and_outputs(bf16: bool) -> None:
    run_distributed(dataclass_worker, 2, bf16)


# ---- requires_grad changed after fully_shard ---------------------------------------------------


def requires_grad_worker(rank: int, world: int, device: str = "cpu") -> None:
    torch.manual_seed(0)
    ref = Net().to(device)
    for p in ref.stages[1].parameters():
        p.requires_grad_(False)  # frozen before sharding
    model = copy.deepcopy(ref)
    shard_net(model, {})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)

    def schedule(m: nn.Module) -> None:
        for p in m.stages[0].a.parameters():  # a whole module frozen
            p.requires_grad_(False)
        m.stages[0].b.fc1.weight.requires_grad_(False)  # one parameter of a module
        for p in m.stages[1].b.parameters():  # unfrozen
            p.requires_grad_(True)

    frozen_at: dict[str, torch.Tensor] = {}
    for step, idx in enumerate(batches(4)):
        idx = idx.to(device)
        if step == 1:
            schedule(model)
            schedule(ref)
            frozen_at = {
                n: p.full_tensor() for n, p in model.named_parameters() if not p.requires_grad
            }

        def grads_follow_flags(step: int = step) -> None:
            for n, p in model.named_parameters():
                assert (p.grad is not None) == p.requires_grad, f"step {step}: {n}"

        step_and_compare(model, opt, ref, ref_opt, idx, grads_follow_flags)
    assert "stages.1.b.fc1.weight" not in frozen_at and "stages.0.b.fc1.weight" in frozen_at
    for (n, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.full_tensor(), rp.detach(), atol=1e-5, rtol=1e-5, msg=n)
        if n in frozen_at:
            assert torch.equal(p.full_tensor(), frozen_at[n]), f"frozen {n} moved"


@pytest.mark.parametrize("world", [2, 3])
def test_requires_grad_changed_after_fully_shard(world: int) -> None:
    run_distributed(requires_grad_worker, world)


def frozen_between_microbatches_worker(rank: int, world: int, kept: bool) -> None:
    """Two microbatches, gradient sync off for the first, with a parameter of a block
    and one of the root frozen and a whole block unfrozen between them: the second
    microbatch computes with what is trainable now, and each gradient equals one
    process's. ``kept``: the blocks stay gathered between the microbatches
    (``reshard_after_forward=False``, not resharded after backward), so the second
    forward finds the first's attachment installed; else they are resharded after
    forward and backward and gather anew (the root stays gathered either way)."""
    torch.manual_seed(0)
    ref = Net()
    for p in ref.stages[1].b.parameters():
        p.requires_grad_(False)
    model = copy.deepcopy(ref)
    shard_net(model, {"raf": not kept})
    idx = batches(1)[0]
    mine = idx.chunk(world)[rank]
    half = mine.shape[0] // 2
    microbatches = [mine[:half], mine[half:]]
    whole = [torch.cat([c[:half] for c in idx.chunk(world)]), None]
    whole[1] = torch.cat([c[half:] for c in idx.chunk(world)])

    # Taken before any forward, as an optimizer holds them: while a module is gathered
    # its attributes are the tracked unsharded tensors, whose flags cannot change.
    sharded = dict(model.named_parameters())

    def flip(m: nn.Module) -> None:
        for n, p in (sharded if m is model else dict(m.named_parameters())).items():
            if n in ("stages.0.b.fc1.weight", "pos"):
                p.requires_grad_(False)
            elif n.startswith("stages.1.b."):
                p.requires_grad_(True)

    model.set_reshard_after_backward(not kept)
    for i, (mb, ref_mb) in enumerate(zip(microbatches, whole)):
        if i == 1:
            assert all(is_gathered(b) == kept for b in (model.stages[0].b, model.stages[1].b))
            flip(model)
            flip(ref)
        model.set_requires_gradient_sync(i == 1)
        loss_fn(model, mb).backward()
        loss_fn(ref, ref_mb).backward()
    for (n, p), (_, rp) in zip(sharded.items(), ref.named_parameters()):
        assert (p.grad is None) == (rp.grad is None), n
        if p.grad is not None:
            torch.testing.assert_close(p.grad.full_tensor(), rp.grad, atol=1e-5, rtol=1e-5, msg=n)


def test_requires_grad_changed_between_microbatches_while_kept_gathered() -> None:
    run_distributed(frozen_between_microbatches_worker, 2, True)


def test_requires_grad_changed_between_microbatches_while_resharded() -> None:
    run_distributed(frozen_between_microbatches_worker, 2, False)


# ---- the model cast to another dtype after fully_shard -------------------------------------------


def cast_worker(rank: int, world: int, dtype: torch.dtype, first_step: bool) -> None:
    """``model.to(dtype)`` after ``fully_shard`` (a pure-bf16 fine-tune), before the
    first forward or after a step: the shards, gathers and gradients follow the
    new dtype, as under FSDP2, and training matches one process cast alike,
    also when the first forward after the cast is an inference-mode eval."""
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    shard_net(model, {})
    idxs = batches(3, seed=4)
    if first_step:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step_and_compare(model, opt, ref, torch.optim.SGD(ref.parameters(), lr=0.1), idxs[0])
    model.to(dtype)
    ref.to(dtype)
    with torch.inference_mode():  # an evaluation first: the re-pack happens inside it
        loss_fn(model, idxs[0].chunk(world)[rank])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {}
    for idx in idxs[1:]:
        loss = loss_fn(model, idx.chunk(world)[rank])
        loss.backward()
        assert_between_steps(model)
        for n, p in model.named_parameters():
            assert p.dtype == p.to_local().dtype == p.grad.dtype == dtype, n
        opt.step()
        opt.zero_grad()
        ref_loss = loss_fn(ref, idx)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(global_mean(loss).to(dtype), ref_loss.detach(), **tol)
    for (n, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.full_tensor(), rp.detach(), msg=n, **tol)
    # Part of one group cast (the root's norm, not its embedding): one clear error.
    model.norm.to(torch.float32)
    with pytest.raises(ValueError, match="several dtypes.*cast the whole module"):
        loss_fn(model, idxs[0].chunk(world)[rank])


@pytest.mark.parametrize(
    "dtype,first_step", [(torch.float64, True), (torch.bfloat16, False)], ids=["f64-after", "bf16"]
)
def test_model_cast_after_fully_shard(dtype: torch.dtype, first_step: bool) -> None:
    run_distributed(cast_worker, 2, dtype, first_step)


# ---- backward passes that do not accumulate into every parameter ------------------------------


def partial_backward_worker(rank: int, world: int) -> None:
    """``.grad`` is written only by a backward that accumulates: not by
    ``torch.autograd.grad`` (gradient-norm logging, adversarial training on
    an activation); and the parameters' own hooks run as under FSDP2."""
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    shard_net(model, {"check": True})
    idx = batches(1, seed=6)[0]
    mine = idx.chunk(world)[rank]
    params = [p for p in model.parameters() if p.requires_grad]
    names = {id(p): n for n, p in model.named_parameters()}  # sharded: before any forward

    # autograd.grad on the parameters, then the step's backward: not doubled.
    loss = loss_fn(model, mine)
    torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    assert all(p.grad is None for p in params), "autograd.grad wrote .grad"
    loss.backward()
    loss_fn(ref, idx).backward()
    for (n, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), rp.grad, atol=1e-5, rtol=1e-5, msg=n)
    model.zero_grad()
    ref.zero_grad()

    # autograd.grad on an activation (FGM/PGD), then backward through all of it.
    hidden: list[torch.Tensor] = []
    handle = model.stages[1].register_forward_hook(lambda m, a, out: hidden.append(out))
    loss = loss_fn(model, mine)
    handle.remove()
    (g,) = torch.autograd.grad(loss, hidden, retain_graph=True)
    assert g.shape == hidden[0].shape
    assert all(p.grad is None for p in params), "autograd.grad wrote .grad"
    loss.backward()
    assert_between_steps(model)
    loss_fn(ref, idx).backward()
    for (n, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), rp.grad, atol=1e-5, rtol=1e-5, msg=n)
    model.zero_grad()
    ref.zero_grad()

    # As under FSDP2 the sharded parameters are not in the autograd graph:
    # backward(inputs=[p]) reaches no module, and writes no gradient (the
    # root stays gathered, as after any forward without backward).
    loss_fn(model, mine).backward(inputs=[model.stages[1].a.fc1.weight])
    assert all(p.grad is None for p in params)

    # Their hooks: a tensor hook never runs (autograd never computes their
    # gradient: FSDP2's behaviour, where a clamp hook used to get None), a
    # post-accumulate-grad hook runs once per backward, with the reduced
    # gradient on .grad. torch's optimizer-in-backward idiom then trains as
    # one process does.
    seen: list[str] = []
    handles = [p.register_hook(lambda g: seen.append("tensor hook")) for p in params]
    opts = {p: torch.optim.SGD([p], lr=0.1) for p in params}

    def step_in_backward(p: torch.Tensor) -> None:
        assert p.grad is not None, f"{names[id(p)]}: hook ran before its gradient"
        seen.append(names[id(p)])
        opts[p].step()
        opts[p].zero_grad()

    handles += [p.register_post_accumulate_grad_hook(step_in_backward) for p in params]
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step_idx in batches(2, seed=7):
        seen.clear()
        loss_fn(model, step_idx.chunk(world)[rank]).backward()
        assert sorted(seen) == sorted(names.values()), seen  # each once, no tensor hook
        assert_between_steps(model)
        loss_fn(ref, step_idx).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for h in handles:
        h.remove()
    for (n, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.full_tensor(), rp.detach(), atol=1e-5, rtol=1e-5, msg=n)


def test_autograd_grad_and_parameter_hooks() -> None:
    run_distributed(partial_backward_worker, 2)


# ---- reset_iter_state after an exception --------------------------------------------------------


def reset_worker(rank: int, world: int, device: str = "cpu") -> None:
    torch.manual_seed(0)
    ref = Net().to(device)
    model = copy.deepcopy(ref)
    shard_net(model, {})
    mine = batches(1)[0].chunk(world)[rank].to(device)

    def leaves_again() -> None:
        model.reset_iter_state()
        for n, p in model.named_parameters():
            assert isinstance(p, DTensor) and p.is_leaf, f"{n} is not a sharded leaf"
        assert all(not is_gathered(m) for m in model.modules() if isinstance(m, FSDPModule))
        assert all(m.phase is Phase.IDLE for m in model.modules() if isinstance(m, FSDPModule))
        assert model.fsdp_context.phase is Phase.IDLE

    # In forward: after the root and the first blocks gathered.
    handle = model.stages[1].a.register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(Boom()))
    with pytest.raises(Boom):
        loss_fn(model, mine)
    handle.remove()
    leaves_again()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # fails on non-leaf parameters

    # A microbatch summed locally (no sync), then a backward that fails: the
    # aborted step's sums must not reach the next one (parity below checks it).
    model.set_requires_gradient_sync(False)
    loss_fn(model, mine).backward()
    model.set_requires_gradient_sync(True)
    groups = [m._shardwise_state.group for m in model.modules() if isinstance(m, FSDPModule)]
    assert any(g.has_accumulated for g in groups if g is not None)

    # In backward: half-way through, with reductions in flight.
    def arm(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        out.register_hook(lambda grad: (_ for _ in ()).throw(Boom()))

    handle = model.stages[0].b.register_forward_hook(arm)
    loss = loss_fn(model, mine)
    handle.remove()
    with pytest.raises(Boom):
        loss.backward()
    leaves_again()
    assert not any(g.has_accumulated for g in groups if g is not None)
    opt.zero_grad()

    # Training goes on exactly as a fresh process would.
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for idx in batches(2, seed=2):
        step_and_compare(model, opt, ref, ref_opt, idx.to(device))


def test_reset_iter_state_after_exceptions() -> None:
    run_distributed(reset_worker, 2)


# ---- slicing, containers -------------------------------------------------------------------------


def slicing_worker(rank: int, world: int, device: str = "cpu") -> None:
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 2)).to(device)
    x = torch.randn(3, 4, device=device)
    for shard in (fully_shard, fsdp2_shard):
        model = copy.deepcopy(ref)
        for i in (0, 2, 3):
            shard(model[i])
        shard(model)
        torch.testing.assert_close(model(x), ref(x))  # FSDP2 wants the root run first
        head = model[:2]
        # FSDP2 and shardwise alike: the slice is a plain Sequential of sharded layers.
        assert type(head) is nn.Sequential, (shard.__module__, type(head))
        assert isinstance(head[0], type(model[0]))
        torch.testing.assert_close(head(x), ref[:2](x))
        model.reshard()
        torch.testing.assert_close(model(x), ref(x))


def test_slicing_a_sharded_sequential() -> None:
    run_distributed(slicing_worker, 2)


# ---- load_state_dict(assign=True) on the meta device ---------------------------------------------


def assign_worker(rank: int, world: int, how: str, device: str = "cpu") -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    torch.manual_seed(0)
    ref = Net().to(device)
    with torch.device("meta"):
        model = Net()
    shard_net(model, {})
    if how == "sharded":
        source = copy.deepcopy(ref)
        shard_net(source, {})
        model.load_state_dict(source.state_dict(), assign=True)
    else:  # the full state dict on rank 0 only, broadcast by DCP (loads with assign)
        full = ref.state_dict() if rank == 0 else {}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, full, options=options)
    assert model.head.weight is model.emb.weight, "the tie survives"
    for (n, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        assert isinstance(p, nn.Parameter) and isinstance(p, DTensor) and p.device.type == device
        torch.testing.assert_close(p.full_tensor(), rp.detach(), msg=n)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for idx in batches(2):
        step_and_compare(model, opt, ref, ref_opt, idx.to(device))


@pytest.mark.parametrize(
    "how,world", [("sharded", 2), ("broadcast-from-rank0", 2), ("broadcast-from-rank0", 3)]
)
def test_load_state_dict_assign_on_meta(how: str, world: int) -> None:
    run_distributed(assign_worker, world, how)


# ---- reshard_after_forward defaults, side by side with FSDP2 -------------------------------------


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.layers(x))


def raf_worker(rank: int, world: int, device: str = "cpu") -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    seen: dict[str, Any] = {}
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0)).to(device)  # same everywhere
    for name, shard in (("shardwise", fully_shard), ("fsdp2", fsdp2_shard)):
        for root_raf in ("default", True):
            torch.manual_seed(0)
            ref = Chain().to(device)
            model = copy.deepcopy(ref)
            for layer in model.layers:
                shard(layer)
            shard(model, **({} if root_raf == "default" else {"reshard_after_forward": True}))
            y = model(x)
            # After a training forward: is each module's parameter still a DTensor (sharded)?
            seen[f"{name}/{root_raf}"] = (
                isinstance(model.out.weight, DTensor),
                [isinstance(layer.weight, DTensor) for layer in model.layers],
            )
            y.sum().backward()
            ref(x).sum().backward()  # every rank has the same x: the mean is ref's gradient
            for (n, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
                torch.testing.assert_close(
                    p.grad.full_tensor(), rp.grad, msg=lambda m, n=n, k=name: f"{k} {n}: {m}"
                )
            if name == "shardwise":
                with torch.no_grad():
                    model(x)  # our extra: nothing stays gathered without a backward
                seen[f"{name}/{root_raf}/no_grad"] = isinstance(model.out.weight, DTensor)
    return seen


def test_reshard_after_forward_defaults_match_fsdp2() -> None:
    seen = run_distributed(raf_worker, 2)[0]
    assert seen["shardwise/default"] == seen["fsdp2/default"] == (False, [True, True])
    assert seen["shardwise/True"] == seen["fsdp2/True"] == (True, [True, True])
    assert seen["shardwise/default/no_grad"] and seen["shardwise/True/no_grad"]


# ---- frozen modules are resharded after their own backward ---------------------------------------


def frozen_worker(rank: int, world: int, device: str = "cpu") -> int:
    """A frozen backbone between a trainable embedding and head (a LoRA base is the same)."""
    torch.manual_seed(0)
    ref = Net(n_stages=3).to(device)
    for stage in ref.stages:
        for p in stage.parameters():
            p.requires_grad_(False)
    model = copy.deepcopy(ref)
    shard_net(model, {})
    blocks = [b for s in model.stages for b in (s.a, s.b)]
    most = 0

    def count(record: Any, pending: Any) -> None:
        nonlocal most
        if record.kind == "all_gather" and model.fsdp_context.phase is Phase.BACKWARD:
            most = max(most, sum(is_gathered(b) for b in blocks))

    remove = collectives.add_observer(count)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    try:
        for idx in batches(3):
            step_and_compare(model, opt, ref, ref_opt, idx.to(device))
    finally:
        remove()
    return most


def test_frozen_modules_reshard_after_their_backward() -> None:
    most = run_distributed(frozen_worker, 2)[0]
    # The block being gathered and the one prefetched; the bug kept all six.
    assert most <= 2, f"{most} frozen blocks gathered at once in backward"
