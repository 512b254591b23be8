"""Nothing shardwise makes is freed only by the garbage collector.

Why: a tensor held by a reference cycle lives until the collector runs, and
when it runs depends on how many objects the process has allocated since it
started, so the device memory a step measures would differ between
processes running the same program. On a GPU that was one or two of a
6.45B GPT's blocks (their original parameters, kept by a recursive closure
in ``fully_shard``) on top of some runs' peaks. Each worker shards and
trains with the collector off and ``DEBUG_SAVEALL`` on, and after
``fully_shard`` and after the steps asks it what only it could free: no
tensor, no shardwise object, no function defined in shardwise. (torch
leaves cycles of its own, e.g. DTensor's sharding propagation, which hold
no tensor; they are not ours to assert on.)
"""

from __future__ import annotations

import gc
import types
from collections.abc import Callable
from typing import Any

import pytest

from dist_utils import run_distributed

pytestmark = pytest.mark.timeout(240)

CONFIGS = [(ac, offload) for ac in ("none", "non-reentrant", "reentrant") for offload in (0, 1)]


def _ours(o: Any) -> bool:
    if type(o).__module__.split(".")[0] == "shardwise":
        return True
    return isinstance(o, types.FunctionType) and "/shardwise/" in o.__code__.co_filename


def _uncollected(where: str) -> list[str]:
    """What the collector finds unreachable now (then freed, so the next call sees only
    what came after), described: tensors and shardwise objects only."""
    import torch

    gc.collect()
    found = [
        f"{where}: {type(o).__name__} {tuple(o.shape)}"
        if isinstance(o, torch.Tensor)
        else f"{where}: {type(o).__qualname__} {getattr(o, '__qualname__', '')}"
        for o in gc.garbage
        if isinstance(o, torch.Tensor) or _ours(o)
    ]
    gc.set_debug(0)
    gc.garbage.clear()
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    return found


def _train(ac: str, offload: bool, steps: int, after: Callable[[str], None]) -> None:
    """Shard a small GPT as the planner's measurement does, and train ``steps`` steps;
    ``after(stage)`` once sharded and once trained (a cycle made in any step is
    still there then: only the collector would free it)."""
    import torch

    from shardwise.api import default_mesh
    from shardwise_app.models.gpt import GPT, GPTConfig
    from shardwise_plan import Policy
    from shardwise_plan.setup import apply_policy, lm_loss, make_optimizer, token_batch

    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=16, n_layer=3, n_head=2, d_model=32))
    apply_policy(model, Policy(mp="bf16", ac=ac, offload=offload), default_mesh())
    after(f"ac={ac} offload={offload} fully_shard")
    opt = make_optimizer(model, "cpu", offload)
    data = token_batch(model, 2, 16)
    for _ in range(steps):
        lm_loss(model, data).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    after(f"ac={ac} offload={offload} {steps} steps")


def no_cycles_worker(rank: int, world: int) -> tuple[list[str], int]:
    """What the collector alone would have freed, and how many times it was asked."""
    _train("non-reentrant", True, 1, lambda stage: None)  # torch's lazy imports, unchecked
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    found: list[str] = []
    checks = [0]

    def check(stage: str) -> None:
        checks[0] += 1
        found.extend(_uncollected(stage))

    try:
        for ac, offload in CONFIGS:
            _train(ac, bool(offload), 2, check)
            # The model just dropped is the collector's: a module and the state
            # its hooks are bound to refer to each other (as under FSDP2).
            gc.set_debug(0)
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    return found, checks[0]


@pytest.mark.parametrize("world", [1, 2])
def test_nothing_waits_for_the_garbage_collector(world: int) -> None:
    for found, checks in run_distributed(no_cycles_worker, world, timeout=200):
        assert checks == 2 * len(CONFIGS)
        assert found == [], found
