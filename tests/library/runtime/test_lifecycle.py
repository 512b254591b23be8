"""The lifecycle's tables are the transitions the runtime makes, all of them and only them.

src/shardwise/runtime/lifecycle.py names every stage a sharded module goes through and every
memory state of its parameters, and admits only the transitions in its two tables
(``TRANSITIONS``, ``GROUP_TRANSITIONS``); anything else raises ``LifecycleError`` in
every run. Here every kind of step the runtime supports runs on 4 gloo ranks with the
transitions recorded (``lifecycle.observed``): each table entry must be taken by some
step (no transition the runtime never makes), and none outside it can be (it would
have raised). A wrong order of events is refused with one error naming the module,
its stage and the event.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

import shardwise
from dist_utils import run_distributed
from models import Block
from shardwise import fully_shard
from shardwise.runtime import lifecycle
from shardwise.runtime.lifecycle import Event, GroupState, LifecycleError, Stage

D = 8


class Net(nn.Module):
    """Three blocks and a head; ``ac``: how the blocks' forwards are checkpointed."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(D) for _ in range(3))
        self.head = nn.Linear(D, 1)
        self.ac = "none"
        self.detach_first = False  # block 0's backward is not reached
        self.skip_first = False  # block 0 does not run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ac == "pair":  # one non-reentrant region around two sharded blocks
            x = checkpoint(lambda t: self.blocks[1](self.blocks[0](t)), x, use_reentrant=False)
            x = self.blocks[2](x)
        else:
            for b in self.blocks[1:] if self.skip_first else self.blocks:
                if self.ac == "none":
                    x = b(x)
                else:
                    x = checkpoint(b, x, use_reentrant=self.ac == "reentrant")
                if self.detach_first and b is self.blocks[0]:
                    x = x.detach()
        return self.head(x).sum()


class TwoRegions(nn.Module):
    """A sharded module with two reentrant-checkpointed regions inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = checkpoint(self.a, x, use_reentrant=True)
        return checkpoint(self.b, x, use_reentrant=True)


def _model(**kw: object) -> Net:
    torch.manual_seed(0)
    net = Net()
    for b in net.blocks:
        fully_shard(b, **kw)  # type: ignore[arg-type]
    fully_shard(net, **kw)  # type: ignore[arg-type]
    return net


def _x() -> torch.Tensor:
    return torch.randn(4, D, requires_grad=True)  # as an embedding's output would


@contextlib.contextmanager
def _raises_in(module: nn.Module) -> Iterator[None]:
    def boom(*_: object) -> None:
        raise RuntimeError("boom")

    handle = module.register_forward_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            yield
    finally:
        handle.remove()


def _steps() -> dict[str, Callable[[], None]]:
    """Every kind of step, each on a model of its own."""

    def plain() -> None:
        net = _model()
        for _ in range(2):
            net(_x()).backward()
        net.skip_first = True  # a module this step does not use: IDLE throughout
        net(_x()).backward()

    def no_grad_and_eval() -> None:
        net = _model()
        with torch.no_grad():
            net(_x())
        net.eval()  # outputs need grad, but an eval forward says no backward follows
        net(_x())
        net.train()

    def forward_raises_then_recovers() -> None:
        net = _model()
        with _raises_in(net.blocks[1]):
            net(_x())
        net(_x()).backward()
        with _raises_in(net.blocks[1]):
            net(_x())
        net.reset_iter_state()  # type: ignore[operator]
        net(_x())
        net.reset_iter_state()  # type: ignore[operator]

    def two_forwards_one_backward() -> None:
        net = _model()
        (net(_x()) + net(_x())).backward()

    def retain_graph() -> None:
        net = _model(reshard_after_forward=False)
        loss = net(_x())
        loss.backward(retain_graph=True)
        loss.backward()

    def recompute(ac: str) -> Callable[[], None]:
        def run() -> None:
            net = _model()
            net.ac = ac
            net(_x()).backward()
            (net(_x()) + net(_x())).backward()  # a module recomputed after its backward

        return run

    def held() -> None:
        torch.manual_seed(0)
        inner = TwoRegions()
        fully_shard(inner)
        inner(_x()).sum().backward()

        def boom(_: torch.Tensor) -> None:
            raise RuntimeError("boom")

        # Held after both regions' inner passes when the input's gradient raises.
        x = _x()
        y = inner(x)
        x.register_hook(boom)
        with pytest.raises(RuntimeError, match="boom"):
            y.sum().backward()
        inner(_x()).sum().backward()  # the abandoned backward is cleaned up first

    def accumulation() -> None:
        net = _model(reshard_after_forward=2)  # a part kept after forward
        net.set_requires_gradient_sync(False)  # type: ignore[operator]
        net(_x()).backward()
        net.set_requires_gradient_sync(True)  # type: ignore[operator]
        net.detach_first = True  # the synced microbatch does not reach block 0's backward:
        net(_x()).backward()  # it owes the reduction of its sum all the same
        net.detach_first = False
        net.set_requires_gradient_sync(False)  # type: ignore[operator]
        net(_x()).backward()
        net.set_requires_gradient_sync(True)  # type: ignore[operator]
        net.skip_first = True  # not used by the synced microbatch at all
        net(_x()).backward()
        net(_x())  # a part kept after forward for a backward that never comes...
        with torch.no_grad():
            net(_x())  # ...is dropped by the next forward

    def hsdp_sums_held_back() -> None:
        net = _model(mesh=shardwise.hsdp_mesh(2))
        net.set_requires_all_reduce(False)  # type: ignore[operator]
        net(_x()).backward()
        net.set_requires_all_reduce(True)  # type: ignore[operator]
        net(_x()).backward()  # reduced, then reduced again for the sums held back

    def one_rank_shards() -> None:
        world = torch.distributed.get_world_size()
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
        net = _model(mesh=mesh)  # HSDP over shards of one rank: nothing to gather
        net(_x()).backward()

    def stepped_in_backward() -> None:
        net = _model()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        handle = shardwise.optimizer_in_backward(net, opt)
        net(_x()).backward()
        handle.remove()

    def backward_raises() -> None:
        net = _model()

        def boom(_: torch.Tensor) -> None:
            raise RuntimeError("boom")

        def arm(_m: nn.Module, _i: object, out: torch.Tensor) -> None:
            out.register_hook(boom)

        hook = net.blocks[1].register_forward_hook(arm)
        loss = net(_x())  # block 1's output raises in backward, after block 2's backward
        hook.remove()
        with pytest.raises(RuntimeError, match="boom"):
            loss.backward()
        net.reset_iter_state()  # type: ignore[operator]
        net(_x()).backward()

    return {
        "plain": plain,
        "no_grad_and_eval": no_grad_and_eval,
        "forward_raises_then_recovers": forward_raises_then_recovers,
        "two_forwards_one_backward": two_forwards_one_backward,
        "retain_graph": retain_graph,
        "recompute_reentrant": recompute("reentrant"),
        "recompute_non_reentrant": recompute("non-reentrant"),
        "recompute_a_region_of_two": recompute("pair"),
        "held_by_a_reentrant_region": held,
        "accumulation": accumulation,
        "one_rank_shards": one_rank_shards,
        "hsdp_sums_held_back": hsdp_sums_held_back,
        "stepped_in_backward": stepped_in_backward,
        "backward_raises": backward_raises,
    }


def record_worker(rank: int, world: int) -> dict[str, list[tuple[str, str]]]:
    """Every step above with the transitions recorded; by step, what each took."""
    taken: dict[str, list[tuple[str, str]]] = {}
    for name, step in _steps().items():
        print(f"rank {rank}: {name}", flush=True)  # a hang names its step
        lifecycle.observed, lifecycle.observed_groups = set(), set()
        try:
            step()
            pairs = {(s.name, e.name) for s, e in lifecycle.observed}
            pairs |= {("group:" + a.name, b.name) for a, b in lifecycle.observed_groups}
            taken[name] = sorted(pairs)
        finally:
            lifecycle.observed = lifecycle.observed_groups = None
    return taken


def test_the_tables_are_the_transitions_the_runtime_makes() -> None:
    results = run_distributed(record_worker, 4, timeout=280)
    stages: set[tuple[str, str]] = set()
    groups: set[tuple[str, str]] = set()
    for by_step in results:
        for pairs in by_step.values():
            for a, b in pairs:
                if a.startswith("group:"):
                    groups.add((a[len("group:") :], b))
                else:
                    stages.add((a, b))
    table = {(s.name, e.name) for s, e in lifecycle.TRANSITIONS}
    never = sorted(table - stages)
    assert not never, f"in the table but never taken by any step: {never}"
    assert stages <= table  # (outside it, the step would have raised)
    group_table = {(a.name, b.name) for a, b in lifecycle.GROUP_TRANSITIONS}
    assert groups == group_table, (sorted(group_table - groups), sorted(groups - group_table))


def test_an_event_out_of_order_raises_naming_module_stage_and_event() -> None:
    with pytest.raises(LifecycleError, match=r"module 'blocks.1': pre-forward .* while it is HELD"):
        lifecycle.next_stage("blocks.1", Stage.HELD, Event.FORWARD)
    with pytest.raises(LifecycleError, match=r"'head': .* from SHARDED to SHARDED_AFTER_FORWARD"):
        lifecycle.check_group("head", GroupState.SHARDED, GroupState.SHARDED_AFTER_FORWARD)
    # every stage leads somewhere and is reached from somewhere
    reached = {new for new in lifecycle.TRANSITIONS.values()}
    left = {s for s, _ in lifecycle.TRANSITIONS}
    assert reached == left == set(Stage)
