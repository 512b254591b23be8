"""One policy applied to one model, the same way for a prediction and a measurement.

Why shared: the planner is checked against real runs, and any difference in
how the two build, checkpoint or shard the model would be measured as the
planner's error. Each block (the model's largest ``nn.ModuleList``'s members)
is one ``fully_shard`` unit, then the root; checkpointing wraps each block's
call, hooks included, so a recomputation gathers through the block's own
pre-forward hook.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from shardwise import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from .optimizers import MUON, build_optimizer, with_adamw
from .policy import Policy


class Checkpointed(nn.Module):
    """A block whose activations are recomputed in backward."""

    def __init__(self, inner: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.inner = inner
        self.reentrant = reentrant

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.inner(*args, **kwargs)
        if self.reentrant:  # reentrant checkpoint takes no keyword arguments
            return checkpoint(functools.partial(self.inner, **kwargs), *args, use_reentrant=True)
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


def find_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's repeated blocks: its largest ``nn.ModuleList`` by parameter count."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(
            f"{type(model).__name__} has no nn.ModuleList of blocks to shard one by one"
        )
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def apply_policy(model: nn.Module, policy: Policy, mesh: Any) -> list[nn.Module]:
    """Checkpoint and shard ``model`` as ``policy`` says; returns its sharded blocks."""
    policy.check()
    blocks = find_blocks(model)
    inner = list(blocks)
    if policy.ac != "none":
        for i, b in enumerate(inner):
            blocks[i] = Checkpointed(b, policy.ac == "reentrant")
    mp = None
    if policy.mp == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kw: dict[str, Any] = dict(mesh=mesh, mp_policy=mp, prefetch=policy.prefetch)
    if policy.offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for b in inner:
        fully_shard(b, reshard_after_forward=policy.reshard_after_forward, **kw)
    # The root keeps FSDP2's default (gathered from its forward to its backward,
    # which runs first) unless nothing is to be resharded after forward at all.
    root_raf = False if policy.reshard_after_forward is False else None
    fully_shard(model, reshard_after_forward=root_raf, **kw)
    return inner


def vocab_of(model: nn.Module) -> int:
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            return int(m.num_embeddings)
    raise ValueError(f"{type(model).__name__} has no nn.Embedding: pass input_fn")


InputFn = Callable[[nn.Module, int, int], tuple[Any, ...]]
LossFn = Callable[[Any, tuple[Any, ...]], torch.Tensor]


def token_batch(model: nn.Module, batch: int, seq: int) -> tuple[Any, ...]:
    """Random token ids and their targets, ``[batch, seq]`` each."""
    vocab = vocab_of(model)
    return torch.randint(vocab, (batch, seq)), torch.randint(vocab, (batch, seq))


def lm_loss(model: nn.Module, data: tuple[Any, ...]) -> torch.Tensor:
    """Next-token cross entropy of ``model(ids)`` (a tensor, or an output with ``.logits``)."""
    out = model(data[0])
    logits = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
    if logits is None:
        logits = out[0]
    return F.cross_entropy(logits.flatten(0, 1).float(), data[1].flatten())


def make_optimizer(
    model: nn.Module, device: str, offload: bool = False, optimizer: str = "adamw"
) -> torch.optim.Optimizer:
    """The optimizer named (optimizers.py) over ``model``'s parameters, as a training
    run on ``device`` makes it (offloaded parameters step on the host). Muon steps the
    blocks' matrices, AdamW the rest (embeddings, head, norms), as a training run splits."""
    if optimizer in MUON:
        blocks = {id(p) for p in find_blocks(model).parameters() if p.ndim == 2}
        params = list(model.parameters())
        matrices = [p for p in params if id(p) in blocks]
        rest = [p for p in params if id(p) not in blocks]
        return with_adamw(matrices, rest, optimizer, device, offload)
    return build_optimizer(model.parameters(), optimizer, device, offload)
