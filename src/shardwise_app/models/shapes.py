"""Model shapes for planning (``shardwise plan --model shardwise_app.models.shapes:NAME``).

Why here: the planner's documented predictions name these shapes, and the
GPU measurements of them build the same modules. The GPTs are the built-in
GPT at other sizes; ``llama2_70b`` is a Llama-2-70B-shaped decoder (RMSNorm,
grouped-query attention with 8 key/value heads, a SwiGLU MLP, untied head)
written with plain modules, so it builds and runs on fake tensors without
transformers. Rotary embeddings are left out: element-wise work on q and k,
no parameters, no saved tensor beyond what attention saves.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .gpt import GPT, GPTConfig


def gpt_094b() -> nn.Module:
    """0.94B parameters: d 2048, 16 blocks, 16 heads, context 2048."""
    return GPT(GPTConfig(seq_len=2048, n_layer=16, n_head=16, d_model=2048))


def gpt_645b() -> nn.Module:
    """6.45B parameters: d 4096, 32 blocks, 32 heads, context 2048 (the built-in ``large``)."""
    return GPT(GPTConfig(seq_len=2048, n_layer=32, n_head=32, d_model=4096))


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, 1e-5)


class LlamaBlock(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.attn_norm = RMSNorm(d)
        self.q = nn.Linear(d, d, bias=False)
        self.kv = nn.Linear(d, 2 * kv_heads * self.hd, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.mlp_norm = RMSNorm(d)
        self.gate_up = nn.Linear(d, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.attn_norm(x)
        q = self.q(h).view(b, t, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(h).view(b, t, 2, self.kv_heads, self.hd).unbind(2)
        rep = self.heads // self.kv_heads
        k = k.transpose(1, 2).repeat_interleave(rep, dim=1)
        v = v.transpose(1, 2).repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, d))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Llama(nn.Module):
    def __init__(
        self, vocab: int, d: int, layers: int, heads: int, kv_heads: int, ffn: int
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(LlamaBlock(d, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def llama2_70b() -> nn.Module:
    """Llama-2-70B's shape: d 8192, 80 blocks, 64 heads (8 key/value), ffn 28672, vocab 32000."""
    return Llama(32000, 8192, 80, 64, 8, 28672)


def llama_tiny() -> nn.Module:
    """The same code at a size a test runs in seconds."""
    return Llama(256, 64, 2, 4, 2, 128)
