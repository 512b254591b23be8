"""What a sharded root checks when its first forward runs inside a torch pipeline stage.

Three ways of sharding a stage of ``torch.distributed.pipelining`` train wrong,
and each is refused here, at the root's first forward, before its first gather
(no collective of shardwise has run), with one ``ValueError`` naming the stage:

- the stage's module is not sharded while modules under it are: the runtime then
  treats the stage as a plain module, every sharded block reduces at every
  microbatch, and a zero-bubble weight pass's gradients are never reduced;
- a module of the stage is sharded over ranks of its pipeline group, which hold
  other stages: their gathers would pair collectives of different modules;
- a module of the stage reshards after forward (``reshard_after_forward`` True or
  an int) under a schedule that splits each backward into an input pass and a
  later weight pass (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV): both
  passes find the parameters' gradient nodes through the stage's
  ``parameters()`` (torch's ``_backward.py``), which a module resharded after
  forward no longer yields; its weight gradients would be lost. torch's FSDP2
  loses or miscomputes them the same way. Kept gathered
  (``reshard_after_forward=False``, as torchtitan shards under pipeline
  parallel) it trains exactly (pipeline.py).

Why the call stack: a ``PipelineStage`` calls nothing of its module before the
schedule's first forward, and torch's pipelining hands a stage's module no
other mark. The stage and its schedule are the ``self`` of frames of that
forward (``forward_one_chunk``, the metadata inference); they are looked for
once per root, and only once ``torch.distributed.pipelining`` is imported.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any

import torch.nn as nn

from ..comm import collectives


def running_stage() -> tuple[Any, Any] | None:
    """The pipeline stage whose forward runs now and its schedule (None: none runs)."""
    if "torch.distributed.pipelining" not in sys.modules:
        return None
    from torch.distributed.pipelining.schedules import _PipelineSchedule
    from torch.distributed.pipelining.stage import _PipelineStageBase

    stage = None
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if stage is None and isinstance(obj, _PipelineStageBase):
            stage = obj
        elif stage is not None and isinstance(obj, _PipelineSchedule):
            return stage, obj
        frame = frame.f_back
    return None if stage is None else (stage, None)


def splits_backward(schedule: Any) -> bool:
    """Whether ``schedule`` runs input passes (``I``) with weight passes apart (``W``)."""
    from torch.distributed.pipelining.schedules import _ComputationType

    order = getattr(schedule, "pipeline_order", None) or {}
    for actions in order.values():
        for action in actions:
            subs = getattr(action, "sub_actions", None) or ()
            for a in (action, *subs):
                if a is not None and a.computation_type == _ComputationType.BACKWARD_INPUT:
                    return True
    return False


def check(root: nn.Module, states: Sequence[Any]) -> None:
    """Refuse a stage sharded in a way it would train wrong (the docstring's three).
    ``root``: the module whose first forward makes it a root; ``states``: its
    sharded modules' ``ModuleState``, the root's first (its settings not yet
    resolved: ``reshard_after_forward`` None is True for all but the root)."""
    found = running_stage()
    if found is None:
        return
    stage, schedule = found
    sub = stage.submod
    path = next((n for n, m in sub.named_modules() if m is root), None)
    if path is None:
        return  # not of this stage (a loss module, say)
    cls = getattr(sub, "_shardwise_orig_cls", type(sub))  # (fully_shard's subclass: its base)
    name = f"pipeline stage {stage.stage_index} ({cls.__name__})"
    where = f"its submodule {path!r}" if path else "its module"
    if getattr(sub, "_shardwise_state", None) is None:
        raise ValueError(
            f"{name}: its module is not sharded, but {where} is: fully_shard the stage's "
            "module too (after its blocks), so that the pipelining runtime reduces the "
            "stage once per step; unsharded, each block reduces at every microbatch and a "
            "zero-bubble weight pass's gradients are never reduced"
        )
    pp = stage.group
    pp_ranks = set(
        collectives.group_ranks(pp) if pp is not None else range(collectives.world_size())
    )
    me = collectives.rank()
    for s in states:
        if s.group is None:
            continue
        ranks = {
            r
            for part in s.group.parts
            for g in (part.shard_group, part.replicate_group)
            if g is not None
            for r in collectives.group_ranks(g)
        }
        others = sorted((ranks & pp_ranks) - {me})
        if others:
            raise ValueError(
                f"{name}: module {s.label!r} is sharded over ranks {sorted(ranks)}, among them "
                f"{others} of its pipeline group, which hold other stages: shard each stage "
                "over its own data-parallel ranks (mesh['dp'] of a ('pp', 'dp') mesh)"
            )
    if schedule is None or not splits_backward(schedule):
        return
    for s in states:
        setting = s.settings.reshard_after_forward_setting
        reshards = s is not states[0] if setting is None else s.settings.reshard_after_forward
        if s.group is not None and reshards:
            raise ValueError(
                f"{name}: module {s.label!r} reshards after forward (reshard_after_forward "
                f"True, an int, or None below the root) under {type(schedule).__name__}, "
                "whose weight pass finds each microbatch's parameter gradients through the "
                "stage's parameters(), which a resharded module no longer yields: its "
                "gradients would be lost; use reshard_after_forward=False for a stage's "
                "modules, as torchtitan does under pipeline parallel"
            )
