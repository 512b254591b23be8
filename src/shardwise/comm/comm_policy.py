"""``CommPolicy``: which collectives cross nodes quantized or stay inside one (ZeRO++'s three).

Past one node, FSDP's step time goes to the network. Three techniques cut the
bytes that cross nodes, each opt-in:

- ``quantize_gather`` (qwZ): the weight all-gather sends int8 (or fp8) blocks
  with one fp32 scale each (quantize.py) and dequantizes into ``param_dtype``:
  about half a bf16 gather's bytes. ``"forward"``: forward's gathers only,
  backward's at full precision; ``"always"``: both. A recomputed forward
  (activation checkpointing around a sharded module) gathers the forward's
  values, then the backward's (module.py); checkpointing inside a sharded
  module is refused under ``"forward"`` (docs/communication.md).
- ``node_local_backward`` (hpZ): after forward each rank keeps the weights
  sharded over its node's ranks only (``reshard_after_forward=node_size``),
  so backward's gathers never leave the node; the price is ``world /
  node_size`` times the sharded parameters' memory, held between forward and
  backward.
- ``quantize_reduce`` (qgZ): gradients are reduce-scattered inside the node
  at the reduce dtype, then exchanged across nodes as int8 blocks by one
  all-to-all over the ranks of the same local rank, dequantized and summed in
  fp32. Each rank ends with exactly the shard a plain reduce-scatter gives it.

``node_size`` is the number of consecutive ranks of the shard group that form a
node (8 for 8-GPU nodes); when the policy names none it is the launcher's
``LOCAL_WORLD_SIZE`` (torchrun's: the processes of one machine) where that
divides the shard group (``launcher_node_size``).

Alternatives considered. (1) Three keywords of ``fully_shard``: they belong
together (one node size, one block size), and a frozen object can be set on
an ``FSDPModule`` as the other policies are. (2) A node mesh dimension as the
only way to give the node size: a flat mesh with a given node size covers
the same layouts without reshaping the user's mesh.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from .quantize import fp8_dtype

GATHER_MODES = ("none", "forward", "always")


@dataclass(frozen=True)
class CommPolicy:
    """How a ``fully_shard`` call's collectives treat the node boundary (module docstring)."""

    quantize_gather: str = "none"  # "none" | "forward" | "always" (qwZ)
    node_local_backward: bool = False  # hpZ: reshard_after_forward=node_size
    quantize_reduce: bool = False  # qgZ: intra-node reduce-scatter, inter-node int8 all-to-all
    node_size: int | None = None  # ranks per node along the shard group (consecutive)
    block_size: int = 256  # elements per quantization block (one fp32 scale each)
    quant_dtype: torch.dtype = torch.int8  # or torch.float8_e4m3fn where the device has it

    @property
    def enabled(self) -> bool:
        """Whether any technique is on (the default policy changes nothing)."""
        return self.quantize_gather != "none" or self.node_local_backward or self.quantize_reduce

    def quantizes_gather(self, backward: bool) -> bool:
        """Whether a weight gather quantizes: ``backward``, one for backward's gradients
        (not a recomputed forward's)."""
        return self.quantize_gather == "always" or (
            self.quantize_gather == "forward" and not backward
        )


def fp8_supported(device: torch.device) -> bool:
    """Whether ``device`` quantizes to ``float8_e4m3fn``: a GPU with fp8 (compute
    capability 8.9 or later: Ada, Hopper, Blackwell) or the CPU (torch's own casts)."""
    if fp8_dtype() is None:
        return False
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_capability(index) >= (8, 9)
    return False


def launcher_node_size(shard_size: int) -> int | None:
    """The processes of this machine (``LOCAL_WORLD_SIZE``, which torchrun sets) if it
    divides a shard group of ``shard_size`` ranks, else None."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and int(local) > 0 and shard_size % int(local) == 0:
        return int(local)
    return None


def check(
    policy: CommPolicy,
    shard_size: int,
    device: torch.device,
    derived_node_size: int | None = None,
) -> CommPolicy:
    """``policy`` checked against a shard group of ``shard_size`` ranks on ``device``,
    with its node size filled in (``derived_node_size``: what the mesh or the launcher
    says, used when the policy names none). ValueError naming the first problem;
    nothing is changed by a call that raises (the policy is frozen)."""
    if not isinstance(policy, CommPolicy):
        raise ValueError(f"comm_policy must be a shardwise.CommPolicy, not {type(policy).__name__}")
    if policy.quantize_gather not in GATHER_MODES:
        raise ValueError(
            f"CommPolicy.quantize_gather={policy.quantize_gather!r}: use one of {GATHER_MODES}"
        )
    b = policy.block_size
    if isinstance(b, bool) or not isinstance(b, int) or b <= 0:
        raise ValueError(f"CommPolicy.block_size={b!r}: a positive number of elements, e.g. 256")
    quantizes = policy.quantize_gather != "none" or policy.quantize_reduce
    if policy.quant_dtype not in (torch.int8, fp8_dtype()) or policy.quant_dtype is None:
        raise ValueError(
            f"CommPolicy.quant_dtype={policy.quant_dtype}: use torch.int8 or torch.float8_e4m3fn"
        )
    if quantizes and policy.quant_dtype != torch.int8 and not fp8_supported(device):
        raise ValueError(
            f"CommPolicy.quant_dtype={policy.quant_dtype}: {device} has no fp8 (a GPU needs "
            "compute capability 8.9 or later); use torch.int8"
        )
    node = policy.node_size if policy.node_size is not None else derived_node_size
    if node is not None and (isinstance(node, bool) or not isinstance(node, int) or node < 1):
        raise ValueError(f"CommPolicy.node_size={node!r}: a positive number of ranks")
    if node is not None and shard_size % node:
        raise ValueError(
            f"CommPolicy.node_size={node} does not divide the shard group size {shard_size} "
            "(the ranks each parameter is split over); give the GPUs per node"
        )
    if node is None and (policy.node_local_backward or policy.quantize_reduce):
        what = "node_local_backward" if policy.node_local_backward else "quantize_reduce"
        raise ValueError(
            f"CommPolicy.{what} needs node_size (the ranks of one node along the shard "
            "group), which the mesh does not give: set CommPolicy(node_size=...)"
        )
    return replace(policy, node_size=node)
