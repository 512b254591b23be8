"""Real clients: code nobody here wrote, called the way its users call it.

transformers models from tiny random configs (no download) with their own
activation checkpointing, which wraps each layer's ``forward`` and so leaves
our hooks *outside* the checkpoint; torch's ``checkpoint_wrapper`` applied
before ``fully_shard`` (torchtitan's pattern); a hand-written ``forward`` that
checkpoints its body; PEFT LoRA. Each is trained for a few AdamW steps at 2
ranks (and some at 3) and compared with one process on the whole batch, step
by step; the gathers of every step are counted (each layer twice: forward and
backward, never a third time for the recomputation).

Importing transformers costs seconds per process, so all cases of one world
size run in one set of processes (the module fixture) and each test reads its
own case's result.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dist_utils import Outcome, run_tasks
from models import Block
from shardwise import fully_shard
from shardwise.comm import collectives
from test_parity_and_prefetch import assert_between_steps, global_mean

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytestmark = pytest.mark.timeout(400)

VOCAB, SEQ, STEPS = 64, 8, 3


def tolerance(device: str) -> float:
    # fp32 throughout; only the order of sums differs from one process (and
    # on GPUs the kernels chosen for each batch size).
    return 2e-5 if device == "cpu" else 2e-4


def adamw(params: Any) -> torch.optim.Optimizer:
    # eps 1e-6: some gradients are zero but for rounding (GPT-2's key bias), and
    # Adam would scale that noise up to lr-sized steps that differ between runs.
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-6)


# ---- the clients ----------------------------------------------------------------------------


def hf_model(arch: str) -> tuple[nn.Module, list[nn.Module]]:
    """A tiny transformers model (random weights, seed set by the caller) and its layers."""
    import transformers as tf

    common: dict[str, Any] = {"vocab_size": VOCAB, "max_position_embeddings": 32}
    if arch == "llama":
        cfg = tf.LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            **common,
        )
        model = tf.LlamaForCausalLM(cfg)
        return model, list(model.model.layers)
    if arch == "qwen2":
        cfg = tf.Qwen2Config(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            **common,
        )
        model = tf.Qwen2ForCausalLM(cfg)
        return model, list(model.model.layers)
    if arch == "gpt2":
        cfg = tf.GPT2Config(
            vocab_size=VOCAB,
            n_positions=32,
            n_embd=32,
            n_layer=2,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        model = tf.GPT2LMHeadModel(cfg)  # tied embedding and head, both in the root
        return model, list(model.transformer.h)
    if arch == "bert":
        cfg = tf.BertConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            **common,
        )
        model = tf.BertForMaskedLM(cfg)
        return model, list(model.bert.encoder.layer)
    raise ValueError(arch)


def enable_checkpointing(model: nn.Module, reentrant: bool) -> None:
    """The model's own switch (``gradient_checkpointing_enable`` before transformers 5)."""
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def hf_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    # Every position is a target (no -100), so each rank's mean over its
    # slice averages to the whole batch's mean, as the reduction assumes.
    out = model(input_ids=ids, labels=ids)
    return out.loss


class SelfCheckpointing(nn.Module):
    """A layer whose own forward checkpoints its body (hooks stay outside)."""

    def __init__(self, d: int, reentrant: bool) -> None:
        super().__init__()
        self.body = Block(d)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.body, x, use_reentrant=self.reentrant)


class LayerStack(nn.Module):
    def __init__(self, layers: list[nn.Module], d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList(layers)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def stack_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def build(case: str) -> tuple[nn.Module, list[nn.Module], Callable[..., torch.Tensor]]:
    """The unsharded model for ``case`` (seeded), its layers, and its loss."""
    torch.manual_seed(0)
    kind, _, mode = case.partition(":")
    reentrant = mode == "reentrant"
    if kind in ("llama", "qwen2", "gpt2", "bert"):
        model, layers = hf_model(kind)
        if mode:
            enable_checkpointing(model, reentrant)
        return model, layers, hf_loss
    if kind == "wrapper":  # torchtitan: checkpoint_wrapper(block), then fully_shard(wrapper)
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            checkpoint_wrapper,
        )

        impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT
        layers = [checkpoint_wrapper(Block(16), checkpoint_impl=impl) for _ in range(3)]
        return LayerStack(layers), layers, stack_loss
    if kind == "handwritten":
        layers = [SelfCheckpointing(16, reentrant) for _ in range(3)]
        return LayerStack(layers), layers, stack_loss
    raise ValueError(case)


# ---- parity with one process ----------------------------------------------------------------


def train_case(rank: int, world: int, case: str, device: str = "cpu") -> None:
    ref, ref_layers, loss_fn = build(case)
    ref.to(device).train()
    tol = tolerance(device)
    model = copy.deepcopy(ref)
    # The deep copy's layers sit where the reference's do.
    names = {id(m): n for n, m in ref.named_modules()}
    by_name = dict(model.named_modules())
    layers = [by_name[names[id(m)]] for m in ref_layers]
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    opt = adamw(model.parameters())
    ref_opt = adamw(ref.parameters())
    gathers: Counter[str] = Counter()
    remove = collectives.add_observer(
        lambda rec, _: gathers.update([rec.label]) if rec.kind == "all_gather" else None
    )
    g = torch.Generator().manual_seed(1)
    try:
        for step in range(STEPS):
            ids = torch.randint(0, VOCAB, (2 * world, SEQ), generator=g).to(device)
            gathers.clear()
            loss = loss_fn(model, ids.chunk(world)[rank])
            loss.backward()
            assert_between_steps(model)
            missing = [n for n, p in model.named_parameters() if p.grad is None]
            assert not missing, f"step {step}: no gradient for {missing}"
            opt.step()
            opt.zero_grad()
            ref_loss = loss_fn(ref, ids)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            torch.testing.assert_close(
                global_mean(loss), ref_loss.detach(), atol=tol, rtol=tol, msg=f"step {step}"
            )
            # Each layer: once in forward, once in backward (the recomputation
            # reuses the backward's gather); the root once (kept for backward).
            labels = [m._shardwise_state.label for m in layers]
            want = Counter({label: 2 for label in labels})
            want[model._shardwise_state.label] = 1
            assert gathers == want, f"step {step}: gathers {dict(gathers)}, expected {dict(want)}"
    finally:
        remove()
    for (name, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(
            p.full_tensor(), rp.detach(), atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}"
        )


class TwoRegions(nn.Module):
    """Two checkpointed regions in one sharded module (the root alone sharded)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.first, self.second = Block(16), Block(16)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = checkpoint(self.first, x, use_reentrant=self.reentrant)
        return checkpoint(self.second, x, use_reentrant=self.reentrant)


def pattern_case(rank: int, world: int, case: str, device: str = "cpu") -> None:
    """How training loops call a model whose layers checkpoint themselves.

    ``nograd-between``: a no-grad forward (a reference model pass, as TRL's
    DPO does) between a forward and its backward. ``two-backwards``: two
    forwards, then their backwards in reverse order. ``root-only``: only the
    root sharded, holding several checkpointed regions.
    """
    kind, _, mode = case.partition(":")
    reentrant = mode == "reentrant"
    torch.manual_seed(0)
    if kind == "root-only":
        ref = LayerStack([TwoRegions(reentrant)]).to(device)
    else:
        ref = LayerStack([SelfCheckpointing(16, reentrant) for _ in range(2)]).to(device)
    model = copy.deepcopy(ref)
    if kind != "root-only":
        for layer in model.layers:
            fully_shard(layer)
    fully_shard(model)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, VOCAB, (2 * world, SEQ), generator=g).to(device) for _ in range(2)]
    mine = [i.chunk(world)[rank] for i in ids]
    if kind == "nograd-between":
        loss = stack_loss(model, mine[0])
        with torch.no_grad():
            stack_loss(model, mine[1])
        loss.backward()
        stack_loss(ref, ids[0]).backward()
    elif kind == "two-backwards":
        first, second = stack_loss(model, mine[0]), stack_loss(model, mine[1])
        second.backward()
        first.backward()
        (stack_loss(ref, ids[0]) + stack_loss(ref, ids[1])).backward()
    else:
        stack_loss(model, mine[0]).backward()
        stack_loss(ref, ids[0]).backward()
    assert_between_steps(model)
    tol = tolerance(device)
    for (name, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.grad is not None, f"{name} has no gradient"
        torch.testing.assert_close(p.grad.full_tensor(), rp.grad, atol=tol, rtol=tol, msg=name)


def lora_case(rank: int, world: int, case: str, device: str = "cpu") -> None:
    """PEFT LoRA on the Llama with its checkpointing: adapters match, the base never moves."""
    from peft import LoraConfig, get_peft_model

    reentrant = case.endswith(":reentrant")

    def make() -> nn.Module:
        torch.manual_seed(0)
        base, _ = hf_model("llama")
        enable_checkpointing(base, reentrant)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
        peft_model = get_peft_model(base, lora)
        # PEFT initialises B to zero; make it non-zero so A's gradients are too.
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(len(n)))
        return peft_model

    ref, model = make().to(device), make().to(device)
    tol = tolerance(device)
    ref.train()
    model.train()
    frozen_before = {
        n: p.detach().clone() for n, p in ref.named_parameters() if not p.requires_grad
    }
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = adamw(trainable)
    ref_opt = adamw([p for p in ref.parameters() if p.requires_grad])
    g = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        ids = torch.randint(0, VOCAB, (2 * world, SEQ), generator=g).to(device)
        loss = hf_loss(model, ids.chunk(world)[rank])
        loss.backward()
        assert_between_steps(model)
        for n, p in model.named_parameters():
            assert (p.grad is not None) == p.requires_grad, f"step {step}: {n}"
        opt.step()
        opt.zero_grad()
        ref_loss = hf_loss(ref, ids)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(
            global_mean(loss), ref_loss.detach(), atol=tol, rtol=tol, msg=f"step {step}"
        )
    assert len(trainable) == 2 * 3 * 2  # A and B, three targets, two layers
    for (name, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        full = p.full_tensor()
        torch.testing.assert_close(full, rp.detach(), atol=tol, rtol=tol, msg=name)
        if name in frozen_before:
            assert torch.equal(full, frozen_before[name]), f"frozen {name} changed"


def run_case(rank: int, world: int, case: str, device: str = "cpu") -> None:
    """One case (by its kind) in these processes; all cases of a world share them."""
    import transformers

    transformers.logging.set_verbosity_error()
    kind = case.partition(":")[0]
    run = lora_case if kind == "lora" else pattern_case if kind in PATTERNS else train_case
    run(rank, world, case, device)


ARCHS = ["llama", "qwen2", "gpt2", "bert"]
PATTERNS = ["nograd-between", "two-backwards", "root-only"]
MODES = ["reentrant", "non-reentrant"]
CASES_W2 = (
    [f"{a}:{m}" for a in ARCHS for m in MODES]
    + ["llama"]  # the same model without checkpointing
    + [f"wrapper:{m}" for m in MODES]
    + [f"handwritten:{m}" for m in MODES]
    + [f"lora:{m}" for m in MODES]
    + [f"{p}:{m}" for p in PATTERNS for m in MODES]
)
CASES_W3 = ["llama:reentrant", "gpt2:non-reentrant", "wrapper:reentrant", "lora:non-reentrant"]


def run_cases(world: int, cases: list[str], device: str = "cpu", **kw: Any) -> dict[str, Outcome]:
    """Every case at ``world`` ranks in one set of processes (transformers' import costs
    seconds a process)."""
    tasks = [(case, run_case, (case, device)) for case in cases]
    return run_tasks(tasks, world, timeout=350, **kw)


@pytest.fixture(scope="module")
def results() -> dict[int, dict[str, str | None]]:
    out = {}
    for world, cases in ((2, CASES_W2), (3, CASES_W3)):
        out[world] = {c: o.error for c, o in run_cases(world, cases).items()}
    return out


@pytest.mark.parametrize(
    "world,case", [(2, c) for c in CASES_W2] + [(3, c) for c in CASES_W3], ids=str
)
def test_client_matches_one_process(results: dict[int, dict[str, str | None]], world, case):
    error = results[world][case]
    assert error is None, f"{case} at {world} ranks:\n{error}"
