"""Real clients, continued (issue #30): PEFT LoRA on fused MoE experts, and a
root-owned module called on its own after a no-grad forward.

1. ``LoraConfig(target_parameters=[...experts.gate_up_proj, ...experts.down_proj])``
   wraps each experts module in PEFT's ``ParamWrapper``, which registers a
   parametrization on the expert weight at the start of every forward and
   removes it (``leave_parametrized=False``) before returning. Under shardwise
   the weight it finds is our unsharded form, not an ``nn.Parameter``, and
   torch puts it back as a *buffer*: before the fix in ``ShardedParam.install``
   the second forward failed with ``Module already has an attribute named
   'down_proj'`` and ``state_dict`` held the zero-byte buffer. Tiny Mixtral and
   Qwen3-MoE, experts split on dim 0 (by expert) and on dim 1
   (``shard_placement_fn``), without the model's own checkpointing and with it
   (non-reentrant, reentrant, and ``gradient_checkpointing_enable()``'s default,
   non-reentrant in transformers 5).
2. A no-grad forward for the hidden states, then ``model.lm_head(h)``: the head
   is owned by the root, whose hooks do not run for it (a reward or value model
   on a policy's hidden states, a chunked loss). Under no_grad (eval) and with
   grad (a loss on it, stepped), between ordinary training steps. FSDP2 fails
   the second (``FSDP2_FAILS``): it leaves the root gathered after the no-grad
   forward, so the head's gradient stays on the unsharded weight, unreduced.

Every case is trained with AdamW at 2 ranks (fp32), under shardwise and under
torch's FSDP2 (the second reference), and compared step by step with one
process on the whole batch: the loss, every gradient, the final parameters.
All cases run in one set of processes (importing transformers costs seconds).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from dist_utils import run_tasks
from test_clients import adamw, enable_checkpointing, hf_loss, hf_model, tolerance
from test_parity_and_prefetch import global_mean

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytestmark = pytest.mark.timeout(400)

VOCAB, SEQ, STEPS = 64, 8, 3
EXPERTS = ("gate_up_proj", "down_proj")  # transformers 5's fused expert weights: [E, out, in]


# ---- the models -----------------------------------------------------------------------------


def moe_model(arch: str) -> nn.Module:
    """A tiny MoE model (random weights, seed set by the caller): 4 experts, top 2."""
    import transformers as tf

    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "max_position_embeddings": 32,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts_per_tok": 2,
    }
    if arch == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(num_local_experts=4, **common))
    if arch == "qwen3moe":
        cfg = tf.Qwen3MoeConfig(num_experts=4, moe_intermediate_size=16, head_dim=8, **common)
        return tf.Qwen3MoeForCausalLM(cfg)
    raise ValueError(arch)


def lora_moe(arch: str, ckpt: str) -> nn.Module:
    """The MoE model with LoRA on its experts' fused weights (PEFT's ParamWrapper)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = moe_model(arch)
    names = {n.rsplit(".", 1)[-1] for n, _ in base.named_parameters() if ".experts." in n}
    assert names == set(EXPERTS), f"{arch}: expert weights are now {names}; adapt the targets"
    targets = [f"mlp.experts.{n}" for n in EXPERTS]
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_parameters=targets))
    # PEFT initialises B to zero; make it non-zero so A's gradients are too.
    for n, p in model.named_parameters():
        if "lora_B" in n:
            nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(len(n)))
    if ckpt == "default":  # what a user types; transformers 5 means use_reentrant=False
        model.gradient_checkpointing_enable()
    elif ckpt != "none":
        enable_checkpointing(model, reentrant=ckpt == "reentrant")
    return model.train()


def layers_of(model: nn.Module) -> list[nn.Module]:
    from peft import PeftModel

    inner = model.base_model.model if isinstance(model, PeftModel) else model
    return list(inner.model.layers)


def is_expert(name: str) -> bool:
    return ".experts." in name and name.rsplit(".", 1)[-1] in EXPERTS


# ---- sharding: ours or torch's --------------------------------------------------------------


def shard(model: nn.Module, impl: str, fn: Callable[[nn.Parameter], Shard | None] | None) -> None:
    """Each decoder layer, then the root, with shardwise or FSDP2."""
    if impl == "shardwise":
        from shardwise import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    for layer in layers_of(model):
        fully_shard(layer, shard_placement_fn=fn)
    fully_shard(model)
    if impl == "fsdp2":
        from torch.distributed.fsdp import FSDPModule

        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def assert_resharded(model: nn.Module, impl: str, when: str) -> None:
    """Nothing left gathered outside a call: every parameter is its sharded DTensor."""
    left = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    assert not left, f"{when}: gathered parameters left registered: {left}"
    if impl == "shardwise":
        from shardwise.runtime.context import Phase

        for m in model.modules():
            state = getattr(m, "_shardwise_state", None)
            if state is None:
                continue
            assert m.phase is Phase.IDLE, f"{when}: {state.label} in {m.phase}"
            assert state.group is None or state.group.unsharded_bytes == 0, (
                f"{when}: {state.label} still holds its unsharded storage"
            )


def close(actual: torch.Tensor, expected: torch.Tensor, msg: str, tol: float | None = None) -> None:
    """``assert_close`` that every rank passes or fails together.

    Each rank checks its own part of the batch, so a rounding miss can fail on one
    rank alone; a rank that left the case early would then meet the others'
    next collective with its own (gloo aborts on the size mismatch) and take
    every later case in these shared processes down with it.
    """
    import torch.distributed as dist

    tol = tolerance("cpu") if tol is None else tol
    error: AssertionError | None = None
    try:
        torch.testing.assert_close(
            actual, expected, atol=tol, rtol=tol, msg=lambda m: f"{msg}: {m}"
        )
    except AssertionError as e:
        error = e
    failed = torch.tensor([error is not None], dtype=torch.int32)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if error is not None:
        raise error
    if failed.item():
        raise AssertionError(f"{msg}: failed on another rank (its traceback is reported)")


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def compare_grads(model: nn.Module, ref: nn.Module, when: str) -> None:
    """The same gradients as one process: present where its are, equal, absent where not."""
    got = dict(model.named_parameters())
    for name, rp in ref.named_parameters():
        p = got[name]
        if rp.grad is None:
            assert p.grad is None, f"{when}: {name} has a gradient, one process none"
        else:
            assert p.grad is not None, f"{when}: {name} has no gradient"
            close(full(p.grad), rp.grad, f"{when}: grad {name}")


def compare_params(model: nn.Module, ref: nn.Module, when: str) -> None:
    got = dict(model.named_parameters())
    assert set(got) == {n for n, _ in ref.named_parameters()}, f"{when}: parameter names differ"
    for name, rp in ref.named_parameters():
        close(full(got[name].detach()), rp.detach(), f"{when}: {name}")


def batches(world: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2 * world, SEQ), generator=g) for _ in range(n)]


def train_step(model, ref, opt, ref_opt, ids, rank, world, impl, when) -> None:
    """One ordinary step on both: losses, then every gradient, then the update."""
    loss = hf_loss(model, ids.chunk(world)[rank])
    loss.backward()
    ref_loss = hf_loss(ref, ids)
    ref_loss.backward()
    close(global_mean(loss), ref_loss.detach(), f"{when}: loss")
    assert_resharded(model, impl, f"{when}, after backward")
    compare_grads(model, ref, when)
    opt.step()
    opt.zero_grad()
    ref_opt.step()
    ref_opt.zero_grad()


# ---- case 1: LoRA on fused experts ----------------------------------------------------------


def lora_moe_case(rank: int, world: int, case: str, impl: str) -> None:
    """``case`` is ``arch:dim:ckpt``, e.g. ``mixtral:dim1:non-reentrant``."""
    arch, dim, ckpt = case.split(":")
    ref, model = lora_moe(arch, ckpt), lora_moe(arch, ckpt)
    frozen = {n: p.detach().clone() for n, p in ref.named_parameters() if not p.requires_grad}
    assert sum(is_expert(n) for n in frozen) == 2 * 2, "two fused expert weights per layer"
    split = int(dim[-1])
    # The fused expert weights are the only 3-D parameters.
    shard(model, impl, (lambda p: Shard(1) if p.dim() == 3 else None) if split else None)
    for name, p in model.named_parameters():
        if is_expert(name):
            assert p.placements == (Shard(split),), f"{name}: {p.placements}"
    trainable = [n for n, p in ref.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * 2 * 2 and all("lora_" in n for n in trainable), trainable
    opt = adamw([p for p in model.parameters() if p.requires_grad])
    ref_opt = adamw([p for p in ref.parameters() if p.requires_grad])
    for step, ids in enumerate(batches(world, STEPS)):
        train_step(model, ref, opt, ref_opt, ids, rank, world, impl, f"step {step}")
        # The state dict a checkpoint would save: the same keys as one process,
        # each expert weight its sharded DTensor (the parametrization's round
        # trip once left a zero-byte plain tensor there, as a buffer).
        sd, ref_sd = model.state_dict(), ref.state_dict()
        assert set(sd) == set(ref_sd), f"step {step}: keys {set(sd) ^ set(ref_sd)}"
        for key, v in sd.items():
            assert isinstance(v, DTensor), f"step {step}: state_dict[{key}] is {type(v).__name__}"
            if is_expert(key):
                assert v.placements == (Shard(split),) and v.to_local().numel() > 0, key
                close(v.full_tensor(), ref_sd[key], f"step {step}: state_dict[{key}]")
    compare_params(model, ref, "end")
    for name, p in model.named_parameters():
        if name in frozen:
            assert torch.equal(p.full_tensor(), frozen[name]), f"frozen {name} changed"


# ---- case 2: the root's lm_head after a no-grad forward -------------------------------------


def head_case(rank: int, world: int, case: str, impl: str) -> None:
    """Train; a no-grad forward for the hidden states, then ``model.lm_head(h)``: under
    no_grad (``llama:eval``), or with a loss on it, backpropagated and stepped
    (``llama:train``); train again, another no-grad forward, train. Every step against
    one process."""
    train_head = case.endswith(":train")
    torch.manual_seed(0)
    ref, _ = hf_model("llama")
    ref.train()
    model = copy.deepcopy(ref)
    shard(model, impl, None)
    opt, ref_opt = adamw(model.parameters()), adamw(ref.parameters())
    ids = batches(world, 5)
    train_step(model, ref, opt, ref_opt, ids[0], rank, world, impl, "step 0")

    def hidden(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return m(input_ids=x, output_hidden_states=True).hidden_states[-1]

    def resharded(when: str) -> None:
        # FSDP2 keeps the root gathered after its forward, no_grad or not (and
        # after a backward its hooks did not see); shardwise reshards everything
        # when no backward follows.
        if impl == "shardwise":
            assert_resharded(model, impl, when)

    x = ids[1].chunk(world)[rank]
    h, ref_h = hidden(model, x), hidden(ref, ids[1])
    close(h, ref_h.chunk(world)[rank], "no-grad hidden states")
    resharded("after the no-grad forward")
    if not train_head:
        with torch.no_grad():
            logits = model.lm_head(h)
            ref_logits = ref.lm_head(ref_h)
        assert not isinstance(logits, DTensor), type(logits)
        close(logits, ref_logits.chunk(world)[rank], "no-grad lm_head logits")
        resharded("after the no-grad lm_head")
    else:

        def head_loss(m: nn.Module, hs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(m.lm_head(hs).reshape(-1, VOCAB), targets.reshape(-1))

        loss = head_loss(model, h, x)
        loss.backward()
        ref_loss = head_loss(ref, ref_h, ids[1])
        ref_loss.backward()
        close(global_mean(loss), ref_loss.detach(), "lm_head loss")
        resharded("after the lm_head backward")
        assert model.lm_head.weight.grad is not None, "lm_head.weight got no gradient"
        compare_grads(model, ref, "lm_head step")  # every other parameter: none
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        compare_params(model, ref, "after the lm_head step")

    # Ordinary training still matches afterwards, and so does another no-grad forward.
    train_step(model, ref, opt, ref_opt, ids[2], rank, world, impl, "step 2")
    x = ids[3].chunk(world)[rank]
    # Three AdamW steps in, the last layer's output carries the summed rounding of
    # every layer (the order of the gradient sums differs from one process): a
    # few 1e-5 here, while a wrong parameter would differ by 1e-2.
    close(
        hidden(model, x),
        hidden(ref, ids[3]).chunk(world)[rank],
        "second no-grad forward",
        tol=1e-4,
    )
    resharded("after the second no-grad forward")
    train_step(model, ref, opt, ref_opt, ids[4], rank, world, impl, "step 4")
    compare_params(model, ref, "end")


# ---- one set of processes for every case ----------------------------------------------------


def run_case(rank: int, world: int, key: str) -> None:
    """One case, ``impl/kind/case``; every case runs in one set of processes."""
    import transformers

    transformers.logging.set_verbosity_error()
    impl, kind, case = key.split("/")
    (lora_moe_case if kind == "lora-moe" else head_case)(rank, world, case, impl)


IMPLS = ["shardwise", "fsdp2"]
LORA_CASES = [
    f"lora-moe/{arch}:{dim}:{ckpt}"
    for arch in ("mixtral", "qwen3moe")
    for dim in ("dim0", "dim1")
    for ckpt in ("none", "non-reentrant", "reentrant")
] + ["lora-moe/mixtral:dim0:default", "lora-moe/qwen3moe:dim1:default"]
HEAD_CASES = ["head-after-nograd/llama:eval", "head-after-nograd/llama:train"]
CASES = [f"{impl}/{c}" for impl in IMPLS for c in LORA_CASES + HEAD_CASES]
# FSDP2 leaves the root gathered after the no-grad forward, so the head runs on
# the unsharded weight and its gradient stays there, this rank's alone: the
# sharded weight gets none and nothing is reduced (shardwise gathers the root's
# parameters for the head and reduces its gradient).
FSDP2_FAILS = {"fsdp2/head-after-nograd/llama:train": "lm_head step: grad lm_head.weight"}


@pytest.fixture(scope="module")
def results() -> dict[str, str | None]:
    tasks = [(case, run_case, (case,)) for case in CASES]
    outcomes = run_tasks(tasks, 2, timeout=350, quiet=(UserWarning, FutureWarning))
    return {c: o.error for c, o in outcomes.items()}


@pytest.mark.parametrize("case", CASES)
def test_client_matches_one_process(results: dict[str, str | None], case: str) -> None:
    error = results[case]
    if case in FSDP2_FAILS:  # torch's own behaviour, kept to see if it changes
        assert error is not None and FSDP2_FAILS[case] in error, f"{case}:\n{error}"
        pytest.xfail("FSDP2 leaves the head's gradient unreduced on the unsharded weight")
    assert error is None, f"{case} at 2 ranks:\n{error}"
