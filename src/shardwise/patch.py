"""``patch_fsdp2()``: frameworks that call torch's FSDP2 get shardwise instead.

Why a patch at all: torchtitan, torchtune, Lightning, accelerate (and so HF
``Trainer``) never take a ``fully_shard`` from their user; they import torch's,
some at import time into their own module (``from torch.distributed.fsdp
import fully_shard``), some inside a function. So the one place a user can
route them is torch's own names, and the names already copied out of torch
into modules that are loaded.

What is swapped in is a *stand-in* for each of shardwise's functions (it
calls shardwise's), not shardwise's function itself: a module imported while
patched binds the stand-in, and ``unpatch_fsdp2()`` finds it there by
identity and puts torch's back, without touching a user's own ``from
shardwise import fully_shard``. Likewise only attributes that *are* torch's
objects are swapped.

What is routed: ``fully_shard``, ``register_fsdp_forward_method`` and
``share_comm_ctx``. A stand-in carries its function's attributes:
``fully_shard.state``, which torch's pipelining calls through the name it
bound at import (pipeline.py). Not the classes: ``FSDPModule`` stays torch's, and the
modules shardwise shards are instances of it (fsdp_module.py), so
``isinstance`` checks in frameworks find them; torch's
``MixedPrecisionPolicy``, ``CPUOffloadPolicy`` and ``OffloadPolicy`` are
accepted by shardwise's ``fully_shard`` as they are.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

# torch's object -> shardwise's stand-in for it, made once (ids: functions hash
# by identity anyway, but torch's may be wrapped objects that do not).
_stand_ins: dict[int, tuple[Any, Callable[..., Any]]] = {}


def _stand_in(ours: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(ours)
    def routed(*args: Any, **kwargs: Any) -> Any:
        return ours(*args, **kwargs)

    routed._shardwise_routed = True  # type: ignore[attr-defined]
    return routed


def _routes() -> tuple[Any, dict[int, tuple[Any, Callable[..., Any]]]]:
    """torch's defining module, and id(torch's object) -> (it, shardwise's stand-in)."""
    from torch.distributed.fsdp._fully_shard import _fully_shard as torch_impl

    from . import api
    from .runtime import fsdp_module

    if not _stand_ins:
        pairs: list[tuple[str, Callable[..., Any]]] = [
            ("fully_shard", api.fully_shard),
            ("register_fsdp_forward_method", fsdp_module.register_fsdp_forward_method),
            ("share_comm_ctx", fsdp_module.share_comm_ctx),
        ]
        for name, ours in pairs:
            theirs = getattr(torch_impl, name, None)
            if theirs is not None:
                _stand_ins[id(theirs)] = (theirs, _stand_in(ours))
    return torch_impl, _stand_ins


def _modules(skip: Any) -> list[Any]:
    """Loaded modules whose attributes may hold a routed name (not torch's defining
    module, whose internals call ``fully_shard.state`` on torch-FSDP2 modules)."""
    found = []
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", None)
        if isinstance(names, dict) and module is not skip:
            found.append(module)
    return found


def patch_fsdp2() -> None:
    """Route torch's FSDP2 entry points to shardwise, in every loaded module.

    Call it once, before building the model, best before importing the
    framework (then its ``from torch.distributed.fsdp import fully_shard``
    binds shardwise's too); modules imported earlier are patched where they
    hold torch's function. Idempotent. ``unpatch_fsdp2()`` restores torch's.

        import shardwise
        shardwise.patch_fsdp2()
        import torchtitan  # or lightning, accelerate, torchtune: as usual
    """
    torch_impl, routes = _routes()
    for module in _modules(torch_impl):
        for attr, value in list(module.__dict__.items()):
            route = routes.get(id(value))
            if route is not None and route[0] is value:
                setattr(module, attr, route[1])


def unpatch_fsdp2() -> None:
    """Put torch's FSDP2 names back wherever a stand-in of ``patch_fsdp2`` is
    bound, also in modules imported while patched. Idempotent."""
    torch_impl, routes = _routes()
    back = {id(ours): theirs for theirs, ours in routes.values()}
    for module in _modules(torch_impl):
        for attr, value in list(module.__dict__.items()):
            theirs = back.get(id(value))
            if theirs is not None and getattr(value, "_shardwise_routed", False):
                setattr(module, attr, theirs)


def fsdp2_patched() -> bool:
    """Whether ``torch.distributed.fsdp.fully_shard`` is routed to shardwise now."""
    import torch.distributed.fsdp as fsdp

    return getattr(fsdp.fully_shard, "_shardwise_routed", False)
