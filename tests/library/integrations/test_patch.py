"""Frameworks' way in: shardwise's modules are torch's ``FSDPModule``s, and
``patch_fsdp2()`` routes torch's FSDP2 entry points to shardwise.

Frameworks decide on ``isinstance(m, torch.distributed.fsdp.FSDPModule)``
(torchtitan turns gradient division off on such modules; Lightning's
``no_backward_sync`` looks for them), then call FSDP2's methods on them:
those must be shardwise's. The patch is checked in this process (names
replaced by identity, restored by ``unpatch_fsdp2``), and at 2 ranks a model
sharded through torch's patched name trains like one process, with a
framework's gradient-division switch found and obeyed.
"""

from __future__ import annotations

import copy
import importlib
import sys
import types

import pytest
import torch
import torch.distributed._composable.fsdp as composable
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn

import shardwise
from dist_utils import run_distributed
from models import Net, batches, loss_fn

pytestmark = pytest.mark.timeout(120)

# In a tuple: the patch replaces module attributes that *are* torch's function,
# this module's own too.
TORCH = (torch_fsdp.fully_shard,)


@pytest.fixture
def patched():
    shardwise.patch_fsdp2()
    try:
        yield
    finally:
        shardwise.unpatch_fsdp2()


def routed(f: object, ours: object) -> bool:
    """Whether ``f`` is patch_fsdp2's stand-in for shardwise's ``ours``."""
    return bool(getattr(f, "_shardwise_routed", False)) and f.__wrapped__ is ours  # type: ignore[attr-defined]


def test_patch_routes_torch_names_and_unpatch_restores_them(patched: None) -> None:
    assert routed(torch_fsdp.fully_shard, shardwise.fully_shard)
    assert routed(composable.fully_shard, shardwise.fully_shard)
    assert routed(torch_fsdp.register_fsdp_forward_method, shardwise.register_fsdp_forward_method)
    assert shardwise.fsdp2_patched()
    # A user's own import of shardwise's function is not a routed name.
    mine = types.ModuleType("users_own")
    exec("from shardwise import fully_shard\n", mine.__dict__)
    sys.modules["users_own"] = mine
    # torch's own module keeps its names (its internals call fully_shard.state).
    impl = importlib.import_module("torch.distributed.fsdp._fully_shard._fully_shard")
    assert impl.fully_shard is TORCH[0]
    # Imported after the patch: a framework's module-level import binds ours.
    code = "from torch.distributed.fsdp import fully_shard\n"
    late = types.ModuleType("late_framework")
    exec(code, late.__dict__)
    assert routed(late.fully_shard, shardwise.fully_shard)
    sys.modules["late_framework"] = late
    try:
        shardwise.unpatch_fsdp2()
        shardwise.unpatch_fsdp2()  # idempotent
        assert torch_fsdp.fully_shard is TORCH[0]
        assert composable.fully_shard is TORCH[0]
        assert late.fully_shard is TORCH[0]  # bound while patched: restored too
        assert mine.fully_shard is shardwise.fully_shard  # the user's own: untouched
        assert not shardwise.fsdp2_patched()
    finally:
        del sys.modules["late_framework"], sys.modules["users_own"]


def test_patch_reaches_names_bound_before_it() -> None:
    early = types.ModuleType("early_framework")
    early.fully_shard = TORCH[0]  # type: ignore[attr-defined]
    early.other = len  # type: ignore[attr-defined]
    sys.modules["early_framework"] = early
    try:
        shardwise.patch_fsdp2()
        shardwise.patch_fsdp2()  # idempotent: nothing is swapped twice
        assert routed(early.fully_shard, shardwise.fully_shard)  # type: ignore[attr-defined]
        assert early.other is len  # type: ignore[attr-defined]
        shardwise.unpatch_fsdp2()
        assert early.fully_shard is TORCH[0]  # type: ignore[attr-defined]
        assert torch_fsdp.fully_shard is TORCH[0]
    finally:
        shardwise.unpatch_fsdp2()
        del sys.modules["early_framework"]


def test_every_torch_fsdpmodule_method_is_shardwise_own() -> None:
    """None of FSDP2's method bodies can run on a shardwise module."""
    for name, value in vars(torch_fsdp.FSDPModule).items():
        if name.startswith("__") or not callable(value):
            continue
        ours = getattr(shardwise.FSDPModule, name)
        assert ours is not value, name
        assert ours.__module__.startswith("shardwise"), (name, ours.__module__)


def sharded_worker(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    shardwise.patch_fsdp2()
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard  # what frameworks write

        for stage in model.stages:
            fully_shard(stage)
        fully_shard(model)
    finally:
        shardwise.unpatch_fsdp2()
    sharded = [m for m in model.modules() if hasattr(m, "_shardwise_state")]
    assert len(sharded) == 1 + len(model.stages)
    for m in sharded:
        assert isinstance(m, FSDPModule) and isinstance(m, composable.FSDPModule)
        assert isinstance(m, shardwise.FSDPModule)
    handle = model.unshard(async_op=True)
    assert isinstance(handle, torch_fsdp.UnshardHandle)
    handle.wait()
    model.reshard()
    with pytest.raises(RuntimeError, match="patch_fsdp2"):
        model._get_fsdp_state()  # type: ignore[operator]
    # torchtitan's disable_fsdp_gradient_division: found by isinstance, and obeyed
    # (the sum over ranks, not the mean).
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
    idx = batches(1)[0]
    loss_fn(model, idx.chunk(world)[rank]).backward()
    loss_fn(ref, idx).backward()
    for (n, p), rp in zip(model.named_parameters(), ref.parameters()):
        want = rp.grad * world  # each rank's mean gradient, summed over ranks
        torch.testing.assert_close(p.grad.full_tensor(), want, rtol=1e-4, atol=1e-5, msg=n)


def test_modules_sharded_through_torch_names_are_torch_fsdpmodules() -> None:
    run_distributed(sharded_worker, 2)


def test_slicing_keeps_the_original_class_under_torch_fsdpmodule() -> None:
    """``FSDPModule.__new__``: a new instance of a sharded container's class is plain."""
    seq = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    cls = type("FSDPSequential", (shardwise.FSDPModule, nn.Sequential), {})
    cls._shardwise_orig_cls = nn.Sequential
    made = cls(*list(seq))
    assert type(made) is nn.Sequential
