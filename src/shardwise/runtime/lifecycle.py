"""The lifecycle's vocabulary: every state a sharded module and its parameters can be in,
the events that move them, and the only transitions there are.

Two machines, one per concern, each a table:

- ``Stage``: where a module is in the step (module.py's hooks and root.py's
  boundaries send it ``Event``\\ s; ``ModuleLifecycle`` in context.py holds it).
- ``GroupState``: what its parameters are in memory (sharded, sharded with a
  part kept after forward, being gathered, gathered; ``ParamGroup`` holds it).

A module's stage and its group's state together say what happens next: kept
gathered for the next microbatch is ``AFTER_FORWARD`` with ``UNSHARDED``;
sharded after forward is ``AFTER_FORWARD`` with ``SHARDED`` or
``SHARDED_AFTER_FORWARD``; held by a recompute is ``HELD``; reduced is
``REDUCED``; stepped by optimizer_in_backward is ``STEPPED``.

An event the table does not admit raises ``LifecycleError`` naming the module,
its state and the event, in every run (one dict look-up: no cost the host-time
benchmark sees). ``tests/library/runtime/test_lifecycle.py`` drives every kind of step
the runtime supports and checks that the transitions taken are exactly the
table's: none missing from it, none in it that never happens.

Alternatives considered: one product machine (stage x memory state) would name
every combination but most are unreachable or equivalent; flags beside a
three-phase enum (what this replaced) let a wrong order of events pass unseen.
"""

from __future__ import annotations

from enum import Enum


class LifecycleError(RuntimeError):
    """A module broke the unshard/reshard lifecycle; the message says where and how."""


class _State(Enum):
    """An enum hashed by identity: members are singletons, and Enum's own ``__hash__``
    (a Python call hashing the name) is most of a table lookup's cost, paid on every
    event of every module of every step."""

    __hash__ = object.__hash__


class Stage(_State):
    """Where one sharded module is in the step."""

    IDLE = "idle"  # no forward of it waits for its backward
    FORWARD = "forward"  # its forward runs (gathered for forward)
    AFTER_FORWARD = "after forward"  # its forward ran under grad: its backward is to come
    BACKWARD = "backward"  # its backward runs (a recomputed forward runs inside it)
    HELD = "held"  # a reentrant checkpoint's inner pass reached its post-backward: summing
    REDUCED = "reduced"  # its backward is over in this backward: reduction started
    STEPPED = "stepped"  # optimizer_in_backward stepped it: not to be gathered again


class Event(_State):
    """What happens to a module, and who says so."""

    FORWARD = "pre-forward"  # module.py: its forward starts (or a root part's call)
    FORWARD_FOR_BACKWARD = "post-forward (a backward follows)"  # its outputs need grad
    FORWARD_DONE = "post-forward (no backward)"  # no grad, or the root said none follows
    RECOMPUTE = "recomputed forward"  # a pre-forward inside backward (checkpointing)
    PRE_BACKWARD = "pre-backward"  # a hook on its outputs: its backward starts
    HOLD = "post-backward of an inner pass"  # reentrant checkpoint inside it
    REDUCE = "post-backward"  # its gradients exist (or it owes a reduction): reduce
    STEP = "step in backward"  # optimizer_in_backward stepped its parameters
    NO_BACKWARD = "root forward without backward"  # root.py: nobody stays waiting
    RECOVER = "root forward after an error"  # root.py: a forward that raised left it
    BACKWARD_ENDS = "end of backward"  # root.py: the final callback, or abandoned
    RESET = "reset"  # reset_iter_state, zero_grad after an error


S, E = Stage, Event

# (stage, event) -> next stage. Each entry is a transition the runtime makes; the
# comment says when.
TRANSITIONS: dict[tuple[Stage, Event], Stage] = {
    (S.IDLE, E.FORWARD): S.FORWARD,
    # a second forward before the first one's backward (microbatches, pipelining)
    (S.AFTER_FORWARD, E.FORWARD): S.FORWARD,
    (S.FORWARD, E.FORWARD_FOR_BACKWARD): S.AFTER_FORWARD,
    (S.FORWARD, E.FORWARD_DONE): S.IDLE,
    # a forward that raised: the next root forward recovers
    (S.FORWARD, E.RECOVER): S.IDLE,
    (S.AFTER_FORWARD, E.NO_BACKWARD): S.IDLE,
    (S.AFTER_FORWARD, E.PRE_BACKWARD): S.BACKWARD,
    # a graph run again (retain_graph), or outputs of an eval-mode forward
    (S.IDLE, E.PRE_BACKWARD): S.BACKWARD,
    # a second use's backward after the first use's post-backward
    (S.REDUCED, E.PRE_BACKWARD): S.BACKWARD,
    # checkpointing around the module: reentrant (its forward ran under no_grad),
    # non-reentrant before its pre-backward, a second use after the first's backward
    (S.IDLE, E.RECOMPUTE): S.BACKWARD,
    (S.AFTER_FORWARD, E.RECOMPUTE): S.BACKWARD,
    (S.REDUCED, E.RECOMPUTE): S.BACKWARD,
    (S.BACKWARD, E.HOLD): S.HELD,
    (S.HELD, E.HOLD): S.HELD,  # several reentrant regions in one module
    (S.BACKWARD, E.REDUCE): S.REDUCED,
    (S.HELD, E.REDUCE): S.REDUCED,
    # a reduction owed without this backward reaching the module (accumulated
    # sums, HSDP sums held back; pipelining's reduce after the microbatches)
    (S.IDLE, E.REDUCE): S.REDUCED,
    (S.AFTER_FORWARD, E.REDUCE): S.REDUCED,
    # reduced in this backward, and at its end again: HSDP sums held back from an
    # earlier microbatch's all-reduce, which is on again (root.end_of_backward)
    (S.REDUCED, E.REDUCE): S.REDUCED,
    (S.REDUCED, E.STEP): S.STEPPED,
    # Whatever the backward did or did not reach (HELD: it raised in between). Not
    # FORWARD: a backward that ends while a module's forward runs is refused.
    **{(s, E.BACKWARD_ENDS): S.IDLE for s in Stage if s is not S.FORWARD},
    # After the backward's own clean-up (a reset abandons a backward first).
    **{(s, E.RESET): S.IDLE for s in (S.IDLE, S.FORWARD, S.AFTER_FORWARD)},
}


class GroupState(_State):
    """What a group's parameters are in memory."""

    SHARDED = "sharded"
    SHARDED_AFTER_FORWARD = "sharded after forward"  # reshard_after_forward=n: a part kept
    GATHERING = "gathering"  # all-gather issued, not yet waited for
    UNSHARDED = "unsharded"


G = GroupState

# (state, next state): what a group's own methods do (param_group.py).
GROUP_TRANSITIONS: frozenset[tuple[GroupState, GroupState]] = frozenset(
    {
        (G.SHARDED, G.GATHERING),  # unshard: a collective in flight
        (G.SHARDED, G.UNSHARDED),  # unshard with nothing to wait for (one rank)
        (G.SHARDED_AFTER_FORWARD, G.GATHERING),  # the backward's gather from the kept part
        (G.SHARDED_AFTER_FORWARD, G.SHARDED),  # the kept part dropped (a new forward)
        (G.GATHERING, G.UNSHARDED),  # waited for
        (G.GATHERING, G.SHARDED),  # dropped unwaited-for (reshard, a setting changed)
        (G.UNSHARDED, G.SHARDED),  # reshard
        (G.UNSHARDED, G.SHARDED_AFTER_FORWARD),  # reshard after forward, a part kept
    }
)


def next_stage(label: str, stage: Stage, event: Event, events: object = ()) -> Stage:
    """The stage ``event`` takes a module in ``stage`` to, or ``LifecycleError``."""
    new = TRANSITIONS.get((stage, event))
    if new is None and stage is S.STEPPED:
        raise LifecycleError(
            f"module {label!r} is needed again in the backward that already stepped it "
            f"(optimizer_in_backward; at its {event.value}): it runs in two reentrant-checkpointed "
            "regions, so its gradients would be computed with stepped parameters; use "
            "use_reentrant=False there, or remove() the handle"
        )
    if new is None:
        raise LifecycleError(
            f"module {label!r}: {event.value} is not allowed while it is {stage.name}; "
            f"last lifecycle events: {list(events)[-8:]}"  # type: ignore[call-overload]
        )
    if observed is not None:
        observed.add((stage, event))
    return new


def check_group(label: str, state: GroupState, new: GroupState) -> None:
    if (state, new) not in GROUP_TRANSITIONS:
        raise LifecycleError(
            f"module {label!r}: its parameters cannot go from {state.name} to {new.name}"
        )
    if observed_groups is not None:
        observed_groups.add((state, new))


# Set to a set by tests/library/runtime/test_lifecycle.py: every transition taken is added.
observed: set[tuple[Stage, Event]] | None = None
observed_groups: set[tuple[GroupState, GroupState]] | None = None
