"""What every framework's cases share: the set-up, routing, checks, counting.

``prepare(rank, world, impl, module)`` runs first in each spawned rank, then
``run_case`` for each case (tests/dist_utils.py's ``run_tasks``). ``impl`` is
"shardwise" (``shardwise.patch_fsdp2()`` before the framework is imported, as
docs/frameworks.md says) or "fsdp2" (torch's FSDP2, unpatched: the second
reference). Every case trains against one process on the whole batch (same
seed) inside the rank and raises on a mismatch; it returns its history (losses,
gradient norms) so the test can also set shardwise beside FSDP2. One failing
case does not stop the others."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

RTOL, ATOL = 1e-4, 1e-5


def prepare(rank: int, world: int, impl: str, module: str, *args: Any) -> None:
    """Before any case of ``frameworks_cases.<module>`` in this process: route torch's
    FSDP2 to shardwise (``impl`` "shardwise") before the framework is imported, then the
    module's own ``setup``."""
    import logging

    logging.disable(logging.WARNING)  # frameworks log a lot at INFO/WARNING on every rank
    if impl == "shardwise":
        import shardwise

        shardwise.patch_fsdp2()  # before the framework is imported (its setup() does that)
    importlib.import_module(f"frameworks_cases.{module}").setup(rank, world, impl, *args)


def run_case(rank: int, world: int, impl: str, module: str, case: str) -> Any:
    """One case of ``frameworks_cases.<module>``: its history, or it raises on a mismatch."""
    return importlib.import_module(f"frameworks_cases.{module}").run(rank, world, impl, case)


# ---- which FSDP sharded the model ----------------------------------------------------------


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def check_sharded_by(model: nn.Module, impl: str, at_least: int = 2) -> None:
    """The framework's sharded modules are shardwise's (or torch's, for the reference)."""
    mods = fsdp_modules(model)
    assert len(mods) >= at_least, f"only {len(mods)} FSDPModules in {type(model).__name__}"
    theirs = [
        type(m).__name__ for m in mods if hasattr(m, "_shardwise_state") != (impl == "shardwise")
    ]
    assert not theirs, f"{impl} run, but these were sharded by the other FSDP: {theirs}"
    if impl == "shardwise":
        for m in mods:
            assert type(m._shardwise_state).__module__.startswith("shardwise"), type(m)


def groups_of(model: nn.Module, impl: str) -> set[int]:
    """One id per parameter group that owns parameters (a reduce-scatter each step)."""
    out = set()
    for m in fsdp_modules(model):
        if impl == "shardwise":
            g = m._shardwise_state.group
        else:
            g = m._get_fsdp_state()._fsdp_param_group
        if g is not None and any(p.requires_grad for p in _group_params(g, impl)):
            out.add(id(g))
    return out


def _group_params(group: Any, impl: str) -> list[torch.Tensor]:
    if impl == "shardwise":
        return [sp.sharded for sp in group.params]
    return [fp.sharded_param for fp in group.fsdp_params]


@contextmanager
def count_reduce_scatters(impl: str) -> Iterator[Counter]:
    """Count gradient reduce-scatters (shardwise: its observer; FSDP2: torch's call)."""
    seen: Counter = Counter()
    if impl == "shardwise":
        from shardwise.comm import collectives

        remove = collectives.add_observer(
            lambda rec, _: seen.update([rec.label]) if rec.kind == "reduce_scatter" else None
        )
        try:
            yield seen
        finally:
            remove()
        return
    original = dist.reduce_scatter_single

    def counted(*args: Any, **kwargs: Any) -> Any:
        seen.update(["reduce_scatter"])
        return original(*args, **kwargs)

    dist.reduce_scatter_single = counted
    try:
        yield seen
    finally:
        dist.reduce_scatter_single = original


# ---- comparisons ---------------------------------------------------------------------------


def close(got: Any, want: Any, what: str, rtol: float = RTOL, atol: float = ATOL) -> None:
    got = torch.as_tensor(got, dtype=torch.float64)
    want = torch.as_tensor(want, dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def clean(name: str) -> str:
    """A parameter's name without the wrappers frameworks put around modules."""
    for wrapper in (
        "_checkpoint_wrapped_module.",
        "_orig_mod.",
        "_fsdp_wrapped_module.",
        "_forward_module.",
    ):
        name = name.replace(wrapper, "")
    return name


def same_params(model: nn.Module, ref: nn.Module, what: str, rtol: float = RTOL) -> None:
    """Every parameter (gathered) against the one-process model's, by name."""
    want = {clean(n): p.detach() for n, p in ref.named_parameters()}
    got = {clean(n): p for n, p in model.named_parameters()}
    assert set(got) == set(want), f"{what}: names differ: {set(got) ^ set(want)}"
    for name, p in got.items():
        close(full(p.detach()), want[name], f"{what}: {name}", rtol=rtol)


def global_sum(t: torch.Tensor) -> torch.Tensor:
    t = full(t.detach()).clone().float()
    dist.all_reduce(t)
    return t


def global_mean(t: torch.Tensor) -> torch.Tensor:
    return global_sum(t) / dist.get_world_size()


def expect_failure(fn: Callable[[], Any], what: str) -> None:
    """A control: the check must catch this sabotage (else the test would be blind)."""
    try:
        fn()
    except AssertionError:
        return
    raise AssertionError(f"control: {what} went unnoticed by the comparison")


@contextmanager
def patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def stub_triton() -> None:
    """torchtitan 0.3.0 imports triton kernels (expert parallel) when it is imported;
    CPU builds of torch have no triton. Give that one import a stand-in, then
    remove it, so torch itself still sees no triton."""
    if importlib.util.find_spec("triton") is not None:
        return

    class _Any:
        def __call__(self, *a: Any, **k: Any) -> _Any:
            return self

        def __getattr__(self, n: str) -> _Any:
            return self

    class _Mod(types.ModuleType):
        def __getattr__(self, n: str) -> Any:
            if n.startswith("__"):
                raise AttributeError(n)
            return _Any()

    triton, tl = _Mod("triton"), _Mod("triton.language")
    triton.jit = lambda fn=None, **kw: fn if fn is not None else (lambda f: f)  # type: ignore[attr-defined]
    triton.language = tl  # type: ignore[attr-defined]
    sys.modules["triton"], sys.modules["triton.language"] = triton, tl
    try:
        importlib.import_module("torchtitan.distributed.minimal_async_ep.kernels")
    finally:
        del sys.modules["triton"], sys.modules["triton.language"]
