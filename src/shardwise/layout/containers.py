"""Tensors inside what clients pass to and return from a module.

Why not ``torch.utils._pytree``: it treats an unregistered dataclass as a
leaf, and clients return dataclasses all the time (transformers'
``ModelOutput``, users' own output records). A tensor the hooks do not see
gets no pre-backward hook (backward then reads freed parameters), is not cast
by the mixed-precision policy, and does not tell the root that a backward
follows. So the hooks walk the containers FSDP2 walks: dataclasses,
namedtuples, dicts (``OrderedDict`` and subclasses), lists, tuples, sets, to
any depth.

Rebuilding keeps each container's type and never copies one that holds no
changed tensor, so a forward without a cast pays only the walk.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """Every tensor in ``tree``, depth first, in container order."""
    found: list[torch.Tensor] = []

    def visit(x: Any) -> Any:
        found.append(x)
        return x

    map_tensors(visit, tree)
    return found


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """``tree`` with every tensor ``t`` replaced by ``fn(t)``; containers rebuilt only if changed."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        # Before dicts: transformers' ModelOutput is both (an OrderedDict whose
        # entries mirror its fields), and rebuilding it through its fields
        # keeps the two in step.
        return _map_dataclass(fn, tree)
    if isinstance(tree, dict):
        items = [(k, map_tensors(fn, v)) for k, v in tree.items()]
        if all(new is old for (_, new), old in zip(items, tree.values())):
            return tree
        out = dict(items)
        if type(tree) is dict:
            return out
        try:
            return type(tree)(out)  # OrderedDict, defaultdict-free subclasses
        except TypeError:
            return out
    if isinstance(tree, (list, tuple, set, frozenset)):
        items = [map_tensors(fn, v) for v in tree]
        if all(new is old for new, old in zip(items, tree)):
            return tree
        if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # namedtuple
            return type(tree)(*items)
        return type(tree)(items)
    return tree


def _map_dataclass(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        old = getattr(obj, f.name)
        new = map_tensors(fn, old)
        if new is not old:
            changes[f.name] = new
    if not changes:
        return obj
    init = {k: v for k, v in changes.items() if _field(obj, k).init}
    out = dataclasses.replace(obj, **init)
    for k, v in changes.items():
        if k not in init:
            object.__setattr__(out, k, v)  # init=False fields (and frozen classes)
    return out


def _field(obj: Any, name: str) -> dataclasses.Field:
    return obj.__dataclass_fields__[name]
