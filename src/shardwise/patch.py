"""``patch_fsdp2()``: frameworks that call torch's FSDP2 get shardwise instead.

Why a patch at all: torchtitan, torchtune, Lightning, accelerate (and so HF
``Trainer``) never take a ``fully_shard`` from their user; they import torch's,
some at import time into their own module (``from torch.distributed.fsdp
import fully_shard``), some inside a function. So the one place a user can
route them is torch's own names, and the names already copied out of torch
into modules that are loaded. Both are replaced by identity: a module
attribute is swapped only if it *is* torch's object, so nothing else is
touched, and ``unpatch_fsdp2()`` puts back exactly what it swapped.

What is routed: ``fully_shard``, ``register_fsdp_forward_method`` and
``share_comm_ctx``. Not the classes: ``FSDPModule`` stays torch's, and the
modules shardwise shards are instances of it (fsdp_module.py), so
``isinstance`` checks in frameworks find them; torch's
``MixedPrecisionPolicy``, ``CPUOffloadPolicy`` and ``OffloadPolicy`` are
accepted by shardwise's ``fully_shard`` as they are.
"""

from __future__ import annotations

import sys
from typing import Any

# (module, attribute name, the object that was there): what patch_fsdp2 swapped.
_swapped: list[tuple[Any, str, Any]] = []


def _routes() -> tuple[Any, dict[int, tuple[Any, Any]]]:
    """torch's defining module, and id(torch's object) -> (it, shardwise's)."""
    from torch.distributed.fsdp._fully_shard import _fully_shard as torch_impl

    from . import api, fsdp_module

    pairs = [
        ("fully_shard", api.fully_shard),
        ("register_fsdp_forward_method", fsdp_module.register_fsdp_forward_method),
        ("share_comm_ctx", fsdp_module.share_comm_ctx),
    ]
    routes = {}
    for name, ours in pairs:
        theirs = getattr(torch_impl, name, None)
        if theirs is not None:
            routes[id(theirs)] = (theirs, ours)
    return torch_impl, routes


def patch_fsdp2() -> None:
    """Route torch's FSDP2 entry points to shardwise, in every loaded module.

    Call it once, before building the model, best before importing the
    framework (then its ``from torch.distributed.fsdp import fully_shard``
    binds shardwise's too); modules imported earlier are patched where they
    hold torch's function. Idempotent: a second call patches only what was
    imported since. ``unpatch_fsdp2()`` restores torch's.

        import shardwise
        shardwise.patch_fsdp2()
        import torchtitan  # or lightning, accelerate, torchtune: as usual
    """
    torch_impl, routes = _routes()
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", None)
        if not isinstance(names, dict) or module is torch_impl:
            # torch's own module keeps its names: its internals call
            # ``fully_shard.state(module)`` on modules torch's FSDP2 sharded.
            continue
        for attr, value in list(names.items()):
            route = routes.get(id(value))
            if route is not None and route[0] is value:
                setattr(module, attr, route[1])
                _swapped.append((module, attr, value))


def unpatch_fsdp2() -> None:
    """Put back every torch FSDP2 name ``patch_fsdp2`` replaced. Idempotent."""
    while _swapped:
        module, attr, value = _swapped.pop()
        setattr(module, attr, value)


def fsdp2_patched() -> bool:
    """Whether ``torch.distributed.fsdp.fully_shard`` is shardwise's now."""
    import torch.distributed.fsdp as fsdp

    from . import api

    return fsdp.fully_shard is api.fully_shard
