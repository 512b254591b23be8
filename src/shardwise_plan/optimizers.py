"""The optimizers a plan models, by name: the one the user trains with runs in the simulated step.

Why by name and run, not a formula: what an optimizer holds at the peak is its
implementation's, not its algorithm's. AdamW's two moments are the same for
every implementation, but foreach AdamW computes each update over all of a
rank's parameters at once, with temporaries the size of all of them, where
fused AdamW runs one kernel per parameter and allocates nothing; on a large
model that decides where the step peaks. So the simulated step (and the
measured one) makes exactly the optimizer named, under fake tensors.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

DEFAULT = "adamw"
LR = 1e-4


@dataclass(frozen=True)
class OptimizerSpec:
    """How a name is built, said in words for the plan, and its host cost."""

    name: str
    description: str
    # Bytes an offloaded step reads and writes a parameter on the host, for the
    # host's rate (timeline.py): AdamW reads a parameter, its gradient and two
    # moments and writes the parameter and the moments (28 bytes in fp32, about 4
    # more of temporaries); SGD with momentum reads three and writes two.
    host_bytes_per_param: int


OPTIMIZERS = {
    s.name: s
    for s in (
        OptimizerSpec(
            "adamw",
            "torch.optim.AdamW as torch picks its implementation: foreach on a GPU, "
            "the for-loop on the host (CPU or offloaded parameters)",
            32,
        ),
        OptimizerSpec(
            "adamw-foreach",
            "torch.optim.AdamW(foreach=True): each update over all parameters at once, "
            "with temporaries the size of all of them",
            32,
        ),
        OptimizerSpec(
            "adamw-fused",
            "torch.optim.AdamW(fused=True): one kernel a parameter, no temporaries",
            32,
        ),
        OptimizerSpec(
            "sgd",
            "torch.optim.SGD(momentum=0.9): one state tensor a parameter",
            20,
        ),
        # Muon: one momentum buffer a matrix, and the Newton-Schulz matmuls (5 iterations,
        # torch's) of every matrix it orthogonalizes; the rest of the model steps with AdamW.
        # On the host it reads a parameter, its gradient and the buffer and writes two.
        OptimizerSpec(
            "muon",
            "shardwise.optim.Muon over the blocks' matrices (each orthogonalized by one rank "
            "of its shard group, the Newton-Schulz work spread over the ranks), "
            "torch.optim.AdamW over the rest",
            20,
        ),
        OptimizerSpec(
            "muon-torch",
            "torch.optim.Muon over the blocks' matrices (every rank orthogonalizes every "
            "matrix), torch.optim.AdamW over the rest",
            20,
        ),
    )
}
MUON = ("muon", "muon-torch")


def resolve(name: str) -> tuple[OptimizerSpec, str]:
    """The spec modelled for ``name`` and, for a name not in ``OPTIMIZERS``, a note saying
    how it was assumed (empty for a known one)."""
    spec = OPTIMIZERS.get(name)
    if spec is not None:
        return spec, ""
    spec = OPTIMIZERS[DEFAULT]
    return spec, (
        f"unknown optimizer {name!r}: modelled as {spec.name} ({spec.description}); "
        f"known: {', '.join(OPTIMIZERS)}"
    )


def build_optimizer(
    params: Iterable[torch.nn.Parameter], name: str, device: str, offload: bool = False
) -> torch.optim.Optimizer:
    """The optimizer ``name`` over ``params``, on ``device``'s training run ("cuda" or
    "cpu"; offloaded parameters step on the host whatever the device)."""
    spec, _ = resolve(name)
    if spec.name in MUON:  # without the model's blocks: every 2-D parameter is a matrix
        params = list(params)
        matrices = [p for p in params if p.ndim == 2]
        return with_adamw(matrices, [p for p in params if p.ndim != 2], spec.name, device, offload)
    if spec.name == "sgd":
        return torch.optim.SGD(params, lr=LR, momentum=0.9)
    if spec.name == "adamw-fused":
        return torch.optim.AdamW(params, lr=LR, fused=True)
    if spec.name == "adamw-foreach":
        return torch.optim.AdamW(params, lr=LR, foreach=True)
    # torch's own choice: foreach only where every parameter is on a GPU
    return torch.optim.AdamW(params, lr=LR, foreach=device == "cuda" and not offload)


def with_adamw(
    matrices: list[torch.nn.Parameter],
    rest: list[torch.nn.Parameter],
    name: str,
    device: str,
    offload: bool,
) -> torch.optim.Optimizer:
    """Muon (``name``: shardwise's or torch's) over ``matrices`` and AdamW over ``rest``,
    stepped as one optimizer, as a training run steps both."""
    from shardwise.optim import Muon

    cls = Muon if name == "muon" else torch.optim.Muon
    parts: list[torch.optim.Optimizer] = [cls(matrices, lr=LR)] if matrices else []
    if rest:
        parts.append(torch.optim.AdamW(rest, lr=LR, foreach=device == "cuda" and not offload))
    return Both(parts)


class Both(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters, stepped and zeroed as one (the plan's
    step runs ``opt.step()`` once; its memory reads ``opt.state``)."""

    def __init__(self, parts: list[torch.optim.Optimizer]) -> None:
        # Not Optimizer.__init__: the parts own the parameter groups and the state.
        self.parts = parts
        self.defaults = {}
        self.param_groups = [g for part in parts for g in part.param_groups]
        # One state for all: the parts' parameters are disjoint, so they share it.
        self.state = defaultdict(dict)
        for part in parts:
            part.state = self.state

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)
