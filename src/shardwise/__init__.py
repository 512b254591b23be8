"""shardwise: fully sharded data parallelism for PyTorch, module by module.

    from shardwise import fully_shard        # instead of torch.distributed.fsdp
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)

See docs/design.md for the lifecycle every sharded module follows.
"""

from . import _moved, observe
from .api import fully_shard, hsdp_mesh, no_sync
from .clip import clip_grad_norm_
from .comm.comm_policy import CommPolicy
from .layout.offload import CPUOffloadPolicy, OffloadPolicy
from .layout.placement import ShardPlacementResult
from .layout.precision import MixedPrecisionPolicy
from .materialize import materialize
from .optimizer_in_backward import OptimizerInBackward, optimizer_in_backward
from .patch import fsdp2_patched, patch_fsdp2, unpatch_fsdp2
from .runtime.context import FSDPContext, Phase
from .runtime.fsdp_module import (
    FSDPModule,
    UnshardHandle,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from .runtime.lifecycle import LifecycleError, Stage
from .runtime.trace import Tracer, trace

__all__ = [
    "CPUOffloadPolicy",
    "CommPolicy",
    "FSDPContext",
    "FSDPModule",
    "LifecycleError",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "OptimizerInBackward",
    "Phase",
    "Stage",
    "ShardPlacementResult",
    "Tracer",
    "UnshardHandle",
    "clip_grad_norm_",
    "fsdp2_patched",
    "fully_shard",
    "hsdp_mesh",
    "materialize",
    "no_sync",
    "observe",
    "optimizer_in_backward",
    "patch_fsdp2",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "trace",
    "unpatch_fsdp2",
]
__version__ = "0.1.0"
_moved.install()  # ``shardwise.collectives`` and the other old paths (_moved.py)


def __getattr__(name: str) -> object:
    # ``shardwise.plan`` (the planner, moved to its own package) is gone: importing it
    # from here was the one import cycle between the packages. The old name still
    # says where the planner lives rather than a bare "no attribute".
    if name == "plan":
        raise AttributeError(
            "module 'shardwise' has no attribute 'plan': the planner is "
            "shardwise_plan.plan (from shardwise_plan import plan)"
        )
    moved = _moved.attribute(name)
    if moved is not None:
        return moved
    raise AttributeError(f"module 'shardwise' has no attribute {name!r}")
