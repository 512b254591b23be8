"""torchtune 0.6.1: its distributed recipes' model set-up and step, on a tiny Llama3.

What ``full_finetune_distributed`` and ``lora_finetune_distributed`` do in
``_setup_model`` and ``train``, with torchtune's own helpers: build on meta,
``training.set_activation_checkpointing`` (optional),
``training.shard_model`` with ``training.get_shard_conditions`` (each
``layers.N``, then the root; the full recipe passes its ``dp`` mesh, the LoRA
recipe none), ``rope_init``, ``training.load_from_full_model_state_dict``
(the base, and the LoRA weights), the loss ``CEWithChunkedOutputLoss`` times
the batch's valid tokens, ``training.scale_grads(model, world / tokens)``
(undoing FSDP's averaging: the ranks hold different token counts), clipping,
AdamW. ``resume`` saves as the recipes do (``gather_cpu_state_dict``,
``get_full_optimizer_state_dict``, rank 0 writes), then builds a new model
and optimizer from those files (``load_from_full_optimizer_state_dict``) and
trains on. Each against one process on the whole batch.

Cases: ``full``, ``full-ac``, ``lora``, ``lora-ac``, ``resume``, ``lora-resume``.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .common import check_sharded_by, close, full, global_sum, same_params

VOCAB, SEQ, LOCAL, STEPS, LR, MAX_NORM, CHUNKS = 64, 8, 2, 3, 1e-2, 1.0, 2
_dir: dict[str, str] = {}


def setup(rank: int, world: int, impl: str, folder: str) -> None:
    _dir["root"] = os.path.join(folder, impl)
    os.makedirs(_dir["root"], exist_ok=True)
    torchao_shims()
    import torchtune.training  # noqa: F401  (after patch_fsdp2)


def torchao_shims() -> None:
    """torchtune 0.6.1 does not import with torchao 0.18 (what PEFT 0.21 needs:
    it refuses torchao below 0.16, and torchtune refuses to import without one):
    ``torchao.dtypes.nf4tensor`` moved to ``torchao.quantization.quantize_.workflows.nf4``
    (alias the old name), and ``torchtune.training.quantization`` imports quantizers
    torchao removed (stand in for that module; it is torchtune's QAT/int4 support,
    which no case uses: ``torchtune.training`` takes only ``get_quantizer_mode`` from it)."""
    import importlib
    import sys
    import types

    try:
        importlib.import_module("torchao.dtypes.nf4tensor")
    except ModuleNotFoundError:
        new = importlib.import_module("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
        sys.modules["torchao.dtypes.nf4tensor"] = new
    try:
        importlib.import_module("torchtune.training.quantization")
    except ImportError:
        stand_in = types.ModuleType("torchtune.training.quantization")
        stand_in.get_quantizer_mode = lambda quantizer: None  # type: ignore[attr-defined]
        sys.modules["torchtune.training.quantization"] = stand_in


def build(lora: bool) -> nn.Module:
    from torchtune.models.llama3 import llama3, lora_llama3

    common = dict(vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32,
                  max_seq_len=32, intermediate_dim=64)  # fmt: skip
    if lora:
        return lora_llama3(
            lora_attn_modules=["q_proj", "v_proj"], apply_lora_to_mlp=True,
            lora_rank=4, lora_alpha=8.0, **common,
        )  # fmt: skip
    return llama3(**common)


def initial(lora: bool) -> dict[str, torch.Tensor]:
    """The one-process model's weights (LoRA B made non-zero, so A trains too)."""
    torch.manual_seed(0)
    model = build(lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_b" in name:
                p.normal_(std=0.1)
    return model.state_dict()


def freeze_base(model: nn.Module) -> None:
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    set_trainable_params(model, get_adapter_params(model))


def data(world: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (world * LOCAL, SEQ), generator=g)
        out.append(tokens)
    return out


def labels_of(tokens: torch.Tensor) -> torch.Tensor:
    labels = tokens.clone()
    labels[0, :5] = -100  # rank 0 holds fewer valid tokens
    return labels


def loss_sum(model: nn.Module, loss_fn: Any, tokens: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The recipe's ``loss_fn(logits, labels) * current_num_tokens`` for one batch."""
    labels = labels_of(tokens)
    num = int((labels != loss_fn.ignore_index).sum())
    logits = model(tokens)
    ignore = torch.full((labels.shape[0], 1), loss_fn.ignore_index)
    labels = torch.hstack((labels[..., 1:], ignore))
    return loss_fn(logits, labels) * num, num


def recipe_model(
    world: int, impl: str, lora: bool, ac: bool, sd: dict[str, torch.Tensor]
) -> nn.Module:
    """``_setup_model`` of the full or LoRA recipe."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtune import modules, training
    from torchtune.modules.peft import get_adapter_state_dict

    with torch.device("meta"):
        model = build(lora)
    if lora:
        freeze_base(model)
    if ac:
        training.set_activation_checkpointing(
            model, auto_wrap_policy={modules.TransformerSelfAttentionLayer}
        )
    mesh = None if lora else init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))
    training.shard_model(
        model=model,
        shard_conditions=[partial(training.get_shard_conditions, names_to_match=None)],
        cpu_offload=False,
        reshard_after_forward=True,
        dp_mesh=None if mesh is None else mesh["dp"],
    )
    check_sharded_by(model, impl, at_least=3)
    if lora:
        adapters = get_adapter_state_dict(sd)
        training.load_from_full_model_state_dict(model, adapters, torch.device("cpu"))
    with torch.device("cpu"):
        for m in model.modules():
            if hasattr(m, "rope_init"):
                m.rope_init()
    base = {k: v for k, v in sd.items() if not lora or k not in get_adapter_state_dict(sd)}
    training.load_from_full_model_state_dict(model, base, torch.device("cpu"), strict=not lora)
    training.validate_no_params_on_meta_device(model)
    model.set_num_output_chunks(CHUNKS)
    return model


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)


def recipe_steps(
    model: nn.Module, opt: torch.optim.Optimizer, steps: list[torch.Tensor], rank: int, world: int
) -> tuple[list[float], list[float]]:
    """The recipe's ``train`` loop, one microbatch a step."""
    from torchtune import training
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    loss_fn = CEWithChunkedOutputLoss(num_output_chunks=CHUNKS)
    losses, norms = [], []
    for tokens in steps:
        current, num = loss_sum(model, loss_fn, tokens.chunk(world)[rank])
        current.backward()
        num_tokens = torch.tensor(num)
        dist.all_reduce(num_tokens)
        running = global_sum(current)
        training.scale_grads(model, world / num_tokens)  # FSDP averaged: undo it
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=MAX_NORM)
        norms.append(full(norm).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append((running / num_tokens).item())
    return losses, norms


def reference(lora: bool, steps: list[torch.Tensor], world: int) -> tuple[nn.Module, list, list]:
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    model = build(lora)
    model.load_state_dict(initial(lora))
    if lora:
        freeze_base(model)
    model.set_num_output_chunks(CHUNKS)
    opt = optimizer(model)
    loss_fn = CEWithChunkedOutputLoss(num_output_chunks=CHUNKS)
    losses, norms = [], []
    for tokens in steps:
        parts = [loss_sum(model, loss_fn, part) for part in tokens.chunk(world)]
        total = sum(n for _, n in parts)
        loss = sum(s for s, _ in parts) / total
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses, norms


def run(rank: int, world: int, impl: str, case: str) -> Any:
    from torchtune import training

    lora = case.startswith("lora")
    steps = data(world)
    sd = initial(lora)
    model = recipe_model(world, impl, lora, case.endswith("-ac"), sd)
    frozen = {
        n: full(p.detach()).clone() for n, p in model.named_parameters() if not p.requires_grad
    }
    assert bool(frozen) == lora
    opt = optimizer(model)
    if case.endswith("resume"):
        losses, norms = recipe_steps(model, opt, steps[:2], rank, world)
        # Save as the recipes' checkpointer is fed: full state on rank 0, written by it.
        is_zero = rank == 0
        model_sd = training.gather_cpu_state_dict(model, is_zero)
        opt_sd = training.get_full_optimizer_state_dict(model, opt, is_zero)
        path = os.path.join(_dir["root"], f"{case}.pt")
        if is_zero:
            torch.save({"model": model_sd, "optimizer": opt_sd}, path)
        dist.barrier()
        ckpt = torch.load(path, weights_only=False)  # every rank reads it, as the recipe
        full_sd = {**sd, **ckpt["model"]} if lora else ckpt["model"]
        model = recipe_model(world, impl, lora, False, full_sd)
        opt = optimizer(model)
        training.load_from_full_optimizer_state_dict(
            model, opt, ckpt["optimizer"], torch.device("cpu")
        )
        more = recipe_steps(model, opt, steps[2:], rank, world)
        losses, norms = losses + more[0], norms + more[1]
    else:
        losses, norms = recipe_steps(model, opt, steps, rank, world)
    ref, ref_losses, ref_norms = reference(lora, steps, world)
    close(losses, ref_losses, "losses")
    close(norms, ref_norms, "gradient norms")
    same_params(model, ref, "after training")
    for name, p in model.named_parameters():
        if name in frozen:
            assert torch.equal(full(p.detach()), frozen[name]), f"frozen {name} changed"
    return {"loss": losses, "grad_norm": norms}
