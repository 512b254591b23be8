"""Small models for parity tests: every feature the runtime must get right, in a few lines.

The test files' shared models live here, one definition each; a model only one file needs
and made for it stays in that file. Tests compare against one process from fixed seeds,
so a model's layers are created in a fixed order: keep it.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

VOCAB = 5  # 5 rows over 4 ranks -> shards of 2, 2, 1, 0 rows: uneven and empty


class Block(nn.Module):
    """A pre-norm residual MLP, ``x + fc2(act(fc1(norm(x))))``: norm, fc1 and fc2 made in
    that order, fc1 of ``hidden`` rows (``2 * d`` unless given), ``act`` gelu or relu."""

    def __init__(
        self,
        d: int,
        unused: bool = False,
        *,
        hidden: int | None = None,
        bias: bool = True,
        act: str = "gelu",
    ) -> None:
        super().__init__()
        if act not in ("gelu", "relu"):
            raise ValueError(act)
        hidden = 2 * d if hidden is None else hidden
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, d, bias=bias)
        # A parameter no forward touches: its grad must stay None, no hang.
        self.unused = nn.Linear(d, 1) if unused else None
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(self.norm(x))
        h = F.gelu(h) if self.act == "gelu" else F.relu(h)
        return x + self.fc2(h)


class Stage(nn.Module):
    """A parent of two sharded children: the unit that 'parent' AC checkpoints."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.a = Block(d)
        self.b = Block(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class Net(nn.Module):
    """Tied embedding/head in the root, a [1, d] parameter, nested stages."""

    def __init__(
        self, d: int = 8, n_stages: int = 2, ac: str = "none", unused: bool = False
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.randn(1, d) * 0.1)  # [1, d]: empty shard on rank 1+
        self.stages = nn.ModuleList(Stage(d) for _ in range(n_stages))
        self.extra = Block(d, unused=unused)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.ac = ac

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos
        for i, stage in enumerate(self.stages):
            x = self._run(stage, x, i)
        x = self.extra(x)
        return self.head(self.norm(x))

    def _run(self, stage: Stage, x: torch.Tensor, i: int) -> torch.Tensor:
        ac = self.ac
        if ac == "none":
            return stage(x)
        if ac in ("reentrant", "non-reentrant"):  # around each sharded block
            reentrant = ac == "reentrant"
            x = checkpoint(stage.a, x, use_reentrant=reentrant)
            return checkpoint(stage.b, x, use_reentrant=reentrant)
        if ac in ("parent-reentrant", "parent"):  # around a parent of sharded children
            return checkpoint(stage, x, use_reentrant=ac == "parent-reentrant")
        if ac == "selective":  # only some layers
            return checkpoint(stage, x, use_reentrant=False) if i % 2 == 0 else stage(x)
        raise ValueError(ac)


def loss_fn(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), idx[:, 1:].reshape(-1))


def batches(steps: int, batch: int = 12, seq: int = 6, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, seq), generator=g) for _ in range(steps)]


class TwoPaths(nn.Module):
    """An encoder and a decoder; a step may skip the decoder (sharded as one group, or each alone)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 8)
        self.dec = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, path: str) -> torch.Tensor:
        for name in path:  # "ed": encoder then decoder; "e": encoder only; "ede": again
            x = torch.tanh((self.enc if name == "e" else self.dec)(x))
        return self.head(x).square().mean()


class Tiny(nn.Module):
    """An embedding, two bias-free ReLU blocks and a head: the Linear weights that
    tensor-subclass tests swap (fc1's 13 rows split 7 and 6 over 2 ranks)."""

    def __init__(self, d: int = 8, hidden: int = 13) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(
            Block(d, hidden=hidden, bias=False, act="relu") for _ in range(2)
        )
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class TwoLinears(nn.Module):
    """Two independently sharded, checkpointed linears plus a root with its own weight."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 4)
        self.l2 = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = checkpoint(self.l1, x, use_reentrant=self.reentrant)
        x = checkpoint(self.l2, x, use_reentrant=self.reentrant)
        return self.head(x)


class Deep(nn.Module):
    """``n`` square linears, each through tanh, then a head to one output."""

    def __init__(self, n: int = 6, d: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)
