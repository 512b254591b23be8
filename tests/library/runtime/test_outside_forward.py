"""Modules used outside the root's forward, and parametrizations inside forward.

Three patterns real clients use, each against one process on the whole batch:

- a member of a ``fully_shard([norm, head])`` group called after the root's
  forward, chunk by chunk, one backward per chunk, then the hidden states'
  backward (torchtitan's chunked loss, without torchtitan);
- a module the root owns (a plain ``nn.Linear`` head) called after a no-grad
  forward, under no_grad (evaluation) and with grad (a loss on it, trained);
- a parametrization registered at the start of ``forward`` and removed
  before it returns (what PEFT does for LoRA on fused MoE experts), with the
  parameter trainable and frozen; ``state_dict()`` keeps the sharded
  parameters afterwards.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.nn.utils import parametrize

from dist_utils import named_check_test
from shardwise import MixedPrecisionPolicy, fully_shard
from test_parity_and_prefetch import assert_between_steps

pytestmark = pytest.mark.timeout(240)

BATCH, SEQ, VOCAB, DIM = 4, 6, 32, 16


class Decoder(nn.Module):
    """Embedding, two layers, a final norm and a head the forward does not call."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([nn.Linear(DIM, DIM) for _ in range(2)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.norm(h)


def data(step: int, rank: int, world: int) -> tuple[torch.Tensor, ...]:
    """The whole batch of a step, and this rank's rows of it."""
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    n = BATCH // world
    return x, y, x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def compare(model: nn.Module, ref: nn.Module, what: str) -> None:
    for (name, p), rp in zip(model.named_parameters(), ref.parameters()):
        if rp.grad is None:
            assert p.grad is None, f"{what}: {name} has a gradient, one process none"
            continue
        assert p.grad is not None, f"{what}: {name} has no gradient"
        torch.testing.assert_close(
            p.grad.full_tensor(),
            rp.grad,
            rtol=1e-4,
            atol=1e-5,
            msg=lambda m, name=name: f"{what} {name}: {m}",
        )


def sgd_step(*opts: torch.optim.Optimizer) -> None:
    for opt in opts:
        opt.step()
        opt.zero_grad()


def shard_decoder(model: Decoder, group_head: bool) -> None:
    for layer in model.layers:
        fully_shard(layer)
    if group_head:
        fully_shard([model.norm, model.head])  # torchtitan's [norm, output] group
    fully_shard(model, check=True)


def chunked_loss(model: Decoder, x: torch.Tensor, y: torch.Tensor, rows: int) -> None:
    """The head outside the root's forward, one backward per chunk, then the trunk's."""
    h = model(x)
    cut = h.detach().requires_grad_()
    for hc, yc in zip(cut.chunk(3, dim=1), y.chunk(3, dim=1)):
        logits = model.head(hc)
        loss = F.cross_entropy(logits.flatten(0, 1), yc.flatten(), reduction="sum")
        (loss / (rows * SEQ)).backward()
    h.backward(cut.grad)


def check_group_member_after_the_root_forward(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ref = Decoder()
    model = copy.deepcopy(ref)
    shard_decoder(model, group_head=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(3):
        x, y, mx, my = data(step, rank, world)
        chunked_loss(model, mx, my, len(mx))
        chunked_loss(ref, x, y, len(x))
        assert_between_steps(model)
        compare(model, ref, f"step {step}")
        sgd_step(opt, ref_opt)


def check_root_part_after_a_no_grad_forward(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ref = Decoder()
    model = copy.deepcopy(ref)
    shard_decoder(model, group_head=False)  # the root owns emb, norm and head
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(3):
        x, y, mx, my = data(step, rank, world)
        n = len(mx)
        with torch.no_grad():
            h, rh = model(mx), ref(x)
            assert_between_steps(model)  # a no-grad forward leaves everything sharded
            logits = model.head(h)
            assert_between_steps(model)  # and so does the head's own call after it
            torch.testing.assert_close(logits, ref.head(rh)[rank * n : (rank + 1) * n])
        # Trained on the no-grad forward's hidden states: only the head learns.
        F.cross_entropy(model.head(h).flatten(0, 1), my.flatten()).backward()
        F.cross_entropy(ref.head(rh).flatten(0, 1), y.flatten()).backward()
        assert_between_steps(model)
        compare(model, ref, f"head step {step}")
        sgd_step(opt, ref_opt)
        # A usual step after it: the root is kept gathered for its backward again.
        F.cross_entropy(model.head(model(mx)).flatten(0, 1), my.flatten()).backward()
        F.cross_entropy(ref.head(ref(x)).flatten(0, 1), y.flatten()).backward()
        assert_between_steps(model)
        compare(model, ref, f"step {step}")
        sgd_step(opt, ref_opt)


def check_root_part_under_mixed_precision(rank: int, world: int) -> None:
    """The root's head called on its own after a no-grad forward, under a bf16 policy
    with fp32 outputs: its fp32 input is cast to bf16 as the root's pre-forward
    casts the root's (else bf16 weights meet an fp32 input and the matmul
    refuses), and its output comes back in fp32; with grad it trains as one
    process does in bf16."""
    torch.manual_seed(0)
    ref = Decoder()
    model = copy.deepcopy(ref)
    for layer in model.layers:
        fully_shard(layer, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    fully_shard(model, mp_policy=policy, check=True)
    x, y, mx, my = data(0, rank, world)
    with torch.no_grad():
        h = model(mx)
        assert h.dtype == torch.float32, h.dtype
        logits = model.head(h)
        assert_between_steps(model)
    # One process, the same call in bf16: the same input, the same bf16 weights.
    w, b = ref.head.weight.bfloat16(), ref.head.bias.bfloat16()
    assert logits.dtype == torch.float32, logits.dtype
    torch.testing.assert_close(logits, F.linear(h.bfloat16(), w, b).float())
    F.cross_entropy(model.head(h).flatten(0, 1), my.flatten()).backward()
    assert_between_steps(model)
    hb = h.bfloat16()
    all_h = torch.cat(global_gather(hb))
    wr = ref.head.weight.detach().bfloat16().requires_grad_()
    F.cross_entropy(F.linear(all_h, wr, b).float().flatten(0, 1), y.flatten()).backward()
    assert wr.grad is not None and model.head.weight.grad is not None
    torch.testing.assert_close(
        model.head.weight.grad.full_tensor(), wr.grad.float(), rtol=2e-2, atol=2e-3
    )


def global_gather(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``t``, in rank order."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.full((1,), 1.5))

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * self.s


class Experts(nn.Module):
    """A fused expert weight parametrized for the length of each forward (PEFT's way)."""

    def __init__(self, trainable: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, DIM, DIM) * 0.3, requires_grad=trainable)
        self.scale = Scale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parametrize.register_parametrization(self, "w", self.scale, unsafe=True)
        y = torch.einsum("btd,edf->btf", x, self.w)
        parametrize.remove_parametrizations(self, "w", leave_parametrized=False)
        return y


class MoE(nn.Module):
    def __init__(self, trainable: bool) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.experts = Experts(trainable)
        self.b = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.experts(self.a(x))))


def parametrized_round_trip(trainable: bool) -> Callable[[int, int], None]:
    def check(rank: int, world: int) -> None:
        torch.manual_seed(0)
        ref = MoE(trainable)
        model = copy.deepcopy(ref)
        fully_shard(model.experts)
        fully_shard(model, check=True)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
        n = BATCH // world
        for step in range(3):
            x = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(step))
            model(x[rank * n : (rank + 1) * n]).square().mean().backward()
            ref(x).square().mean().backward()
            assert_between_steps(model)
            compare(model, ref, f"step {step}")
            sgd_step(opt, ref_opt)
            sd = model.state_dict()
            assert set(sd) == set(ref.state_dict()), sorted(sd)
            assert isinstance(sd["experts.w"], DTensor), type(sd["experts.w"])
            torch.testing.assert_close(sd["experts.w"].full_tensor(), ref.experts.w.detach())
        with torch.no_grad():
            torch.testing.assert_close(model(x[:n]), ref(x[:n]), rtol=1e-4, atol=1e-5)

    return check


CHECKS: dict[str, Callable[[int, int], None]] = {
    "group member after the root's forward": check_group_member_after_the_root_forward,
    "root part after a no-grad forward": check_root_part_after_a_no_grad_forward,
    "root part under mixed precision": check_root_part_under_mixed_precision,
    "parametrization in forward, trainable": parametrized_round_trip(True),
    "parametrization in forward, frozen": parametrized_round_trip(False),
}


test_matches_one_process = named_check_test(__name__, CHECKS, 2, timeout=200)
