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

from collections.abc import Iterable
from dataclasses import dataclass

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
    )
}


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
    if spec.name == "sgd":
        return torch.optim.SGD(params, lr=LR, momentum=0.9)
    if spec.name == "adamw-fused":
        return torch.optim.AdamW(params, lr=LR, fused=True)
    if spec.name == "adamw-foreach":
        return torch.optim.AdamW(params, lr=LR, foreach=True)
    # torch's own choice: foreach only where every parameter is on a GPU
    return torch.optim.AdamW(params, lr=LR, foreach=device == "cuda" and not offload)
