"""Mixed precision: which dtype lives where, and the casts between them.

The sharded parameters keep their own dtype (fp32 main weights, what the
optimizer updates). A module's flat shard is cast to ``param_dtype`` once per
unshard, before the all-gather, so bf16 halves the bytes on the wire; the
module computes in ``param_dtype``. Gradients are reduced in ``reduce_dtype``
(default: ``param_dtype``) and land on the sharded parameter's ``.grad`` in the
parameter's own dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .containers import map_tensors


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Same fields and meaning as ``torch.distributed.fsdp.MixedPrecisionPolicy``."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            dt = getattr(self, field)
            if dt is None:
                continue
            if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
                raise ValueError(
                    f"MixedPrecisionPolicy.{field} must be a floating-point torch.dtype "
                    f"(e.g. torch.bfloat16), got {dt!r}"
                )


def resolve_dtypes(
    policy: MixedPrecisionPolicy | None, orig: torch.dtype
) -> tuple[torch.dtype, torch.dtype]:
    """(dtype the module computes in, dtype gradients are reduced in)."""
    if policy is None:
        return orig, orig
    compute = policy.param_dtype or orig
    return compute, policy.reduce_dtype or compute


def cast_floats(tree: Any, dtype: torch.dtype | None) -> Any:
    """Cast every floating-point tensor in a nested structure (containers.py) to ``dtype``."""
    if dtype is None:
        return tree

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return map_tensors(cast, tree)
