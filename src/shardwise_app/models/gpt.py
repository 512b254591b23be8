"""A small GPT-style decoder, byte-level, in the spirit of nanoGPT.

Token and position embeddings, pre-norm blocks (causal self-attention through
``F.scaled_dot_product_attention``, then an MLP), a final norm, and an output
head tied to the token embedding. Every block is one ``fully_shard`` unit
(``shard_model``), so a block's parameters are gathered only while it runs.

The model works unsharded too (one process, no process group): build it with
``GPT(SIZES["tiny"])`` and call it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from shardwise import fully_shard

CHECKPOINTING = ("none", "reentrant", "non-reentrant", "selective")


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # bytes
    seq_len: int = 128  # context length: the size of the position table
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128

    def with_seq_len(self, seq_len: int | None) -> GPTConfig:
        return self if seq_len is None else replace(self, seq_len=seq_len)


SIZES: dict[str, GPTConfig] = {
    # Trains visibly within a minute on two CPU cores.
    "tiny": GPTConfig(seq_len=128, n_layer=4, n_head=4, d_model=128),
    # nanoGPT's character-level Shakespeare shape: minutes on a CPU, seconds on a GPU.
    "small": GPTConfig(seq_len=256, n_layer=6, n_head=6, d_model=384),
    # About 86M parameters (GPT-2 small's shape): the small end of the GPU sweeps.
    "base": GPTConfig(seq_len=1024, n_layer=12, n_head=12, d_model=768),
    # About 1.01B parameters: one H200, or several.
    "medium": GPTConfig(seq_len=2048, n_layer=20, n_head=16, d_model=2048),
    # 7B-class (6.5B parameters): with AdamW, two H200s or more.
    "large": GPTConfig(seq_len=2048, n_layer=32, n_head=32, d_model=4096),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_head:
            raise ValueError(f"d_model {cfg.d_model} is not divisible by n_head {cfg.n_head}")
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=False)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        # Per block: "none", "reentrant" or "non-reentrant". A plain attribute,
        # not a wrapper module, so parameter names (and checkpoints) do not
        # depend on it.
        self.checkpointing = ["none"] * cfg.n_layer
        self.apply(self._init_weights)
        # GPT-2: scale the projections into the residual stream by depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear | nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids ``[batch, time]`` to next-token logits ``[batch, time, vocab]``."""
        t = idx.shape[1]
        if t > self.config.seq_len:
            raise ValueError(f"sequence of length {t} is longer than seq_len {self.config.seq_len}")
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block, mode in zip(self.blocks, self.checkpointing):
            if mode == "none" or not torch.is_grad_enabled():
                x = block(x)
            else:
                # Checkpoint the call of the sharded block, hooks included: the
                # recomputation inside backward gathers the block's parameters
                # again through its own pre-forward hook.
                x = checkpoint(block, x, use_reentrant=mode == "reentrant")
        return self.lm_head(self.ln_f(x))


def set_activation_checkpointing(model: GPT, mode: str) -> None:
    """none | reentrant | non-reentrant | selective (every other block, non-reentrant)."""
    if mode not in CHECKPOINTING:
        raise ValueError(f"activation checkpointing must be one of {CHECKPOINTING}, got {mode!r}")
    n = len(model.blocks)
    if mode == "selective":
        model.checkpointing = ["non-reentrant" if i % 2 == 0 else "none" for i in range(n)]
    else:
        model.checkpointing = [mode] * n


def shard_model(
    model: GPT,
    *,
    mesh: Any = None,
    mp_policy: Any = None,
    reshard_after_forward: bool = True,
    activation_checkpointing: str = "none",
    comm_policy: Any = None,
) -> GPT:
    """Checkpoint activations per block, then ``fully_shard`` each block and the root.

    The root owns what no block does: the embeddings (the output head shares
    the token embedding's weight, so it belongs with them) and the final norm.
    ``mesh`` may be 1-D (FSDP) or a 2-D ``("replicate", "shard")`` mesh (HSDP);
    ``comm_policy`` a ``shardwise.CommPolicy`` (or None).
    """
    set_activation_checkpointing(model, activation_checkpointing)
    kwargs = dict(
        mesh=mesh,
        mp_policy=mp_policy,
        reshard_after_forward=reshard_after_forward,
        comm_policy=comm_policy,
    )
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def build_sharded(
    config: dict[str, Any],
    device: torch.device,
    *,
    mesh: Any = None,
    mp_policy: Any = None,
    activation_checkpointing: str = "none",
    compile: bool = False,
    comm_policy: Any = None,
) -> GPT:
    """A run's GPT from its ``model_config`` (config.json): built on ``device``,
    sharded by ``shard_model``, its blocks compiled if ``compile``. Call on every rank."""
    with torch.device(device):
        model = GPT(GPTConfig(**config))
    shard_model(
        model,
        mesh=mesh,
        mp_policy=mp_policy,
        activation_checkpointing=activation_checkpointing,
        comm_policy=comm_policy,
    )
    if compile:
        compile_blocks(list(model.blocks), device.type)
    return model


def compile_blocks(blocks: list[nn.Module], device_type: str) -> None:
    """``block.compile()`` each sharded block, as torchtitan does: inductor on CUDA, aot_eager on CPU.

    After ``fully_shard``: shardwise's hooks run outside dynamo (a graph break
    around each, as FSDP2's), so the compiled region is the block's forward.
    aot_eager on CPU, where inductor would need a C++ compiler.
    """
    backend = "inductor" if device_type == "cuda" else "aot_eager"
    for block in blocks:
        block.compile(backend=backend)


def num_params(model: nn.Module) -> int:
    """Parameters counted once each (the tied head is not counted twice), sharded or not."""
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def generate(
    model: nn.Module,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    seq_len: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Append ``max_new_tokens`` sampled tokens to ``idx`` (``[batch, time]``).

    ``temperature=0`` picks the most likely token. Sharded models work too, as
    long as every rank calls this with the same arguments and seed: every rank
    then samples the same tokens and runs the same forwards.
    """
    for _ in range(max_new_tokens):
        logits = model(idx[:, -seq_len:])[:, -1, :].float()
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.shape[-1]:
                kth = torch.topk(logits, top_k).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(idx.device)
        idx = torch.cat([idx, nxt], dim=1)
    return idx
