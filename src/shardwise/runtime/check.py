"""Lifecycle verification: say at the moment it happens that a module broke the lifecycle.

Turned on by ``fully_shard(..., check=True)`` or ``SHARDWISE_CHECK=1`` (read
when ``fully_shard`` is called). Off, none of this runs: the hooks test one
boolean. The recompute-prefetch bug (a recomputed forward that gathers a
module whose backward is over) surfaced only as an optimizer error far downstream
("sharded gradients must be either all set or all None"); with checks on, the
backward that leaves a module gathered raises ``LifecycleError`` naming it.

Checks at every forward entry (the root's pre-forward, module.py) and at the end
of every backward (the autograd final callback, root.py, before the runtime's
own clean-up). They read the root's context and its modules' lifecycles and
change nothing.
"""

from __future__ import annotations

from .context import FSDPContext, ModuleLifecycle, Phase
from .lifecycle import GroupState, LifecycleError


def _fail(ctx: FSDPContext, s: ModuleLifecycle, what: str) -> LifecycleError:
    params = [sp.fqn for sp in s.group.params] if s.group is not None else []
    events = "\n  ".join(list(ctx.events)[-10:]) or "(none)"
    return LifecycleError(
        f"module {s.label!r} {what}\n"
        f"parameters: {params}\n"
        f"module stage: {s.stage.name}, context phase: {ctx.phase.name}\n"
        f"last lifecycle events:\n  {events}"
    )


def check_forward_entry(ctx: FSDPContext) -> None:
    if ctx.phase is not Phase.IDLE:
        raise _fail(ctx, ctx.root, f"starts a forward while the context is {ctx.phase.name}")
    for s in ctx.states:
        if s.phase is not Phase.IDLE:
            raise _fail(ctx, s, f"is {s.phase.name} at the start of a forward (expected IDLE)")
        g = s.group
        if (
            g is None
            or not s.settings.reshard_after_forward
            or not s.settings.reshard_after_backward
        ):
            continue
        if s is ctx.root:
            continue  # kept after a training forward whose backward never came: legitimate
        if g.state is not GroupState.SHARDED or g.unsharded_bytes:
            raise _fail(ctx, s, "is still unsharded at the start of a forward")


def check_backward_end(ctx: FSDPContext) -> LifecycleError | None:
    """The first violation found, returned so the caller can clean up before raising."""
    for s in ctx.states:
        g = s.group
        if g is None:
            continue
        if (
            s.backward_done
            and s.settings.reshard_after_backward
            and g.state is not GroupState.SHARDED
        ):
            return _fail(
                ctx,
                s,
                "was gathered again after its post-backward (nothing would "
                "reshard it: a recomputed forward prefetched it after its backward?)",
            )
        if g.prefetched and ctx.bwd.order is not None:
            # (The first backward prefetches from the static order, a guess.)
            return _fail(ctx, s, "was prefetched in backward but its gather was never used")
        used = g.last_used
        if used is not None:
            states = {sp.sharded.grad is None for sp, u in zip(g.params, used) if u}
            if len(states) > 1:
                return _fail(
                    ctx,
                    s,
                    "has a mix of set and missing gradients among its used trainable parameters",
                )
    return None
