"""Compute measured on this machine's device: every distinct operator of the step, timed once.

Why measured and not only rates: a roofline of one matmul rate and one
memory bandwidth is right for large kernels on a GPU, and wrong wherever
the cost of an operator is not its FLOPs or bytes: on a CPU a GELU or a
softmax runs at a fraction of an add's bandwidth, a bf16 product without
native bf16 runs at rates several times apart by its operands' layout, and
small operators cost their dispatch. When the
device the plan is for is the device here, each operator the simulation
recorded can simply be run: its shapes, strides and dtypes are known, and
the values do not matter to its time.

How: ``call_spec`` keeps, per recorded operator, the function and its
arguments with every tensor replaced by its layout (the tracker calls it while
it records). ``measure`` then builds real tensors of those layouts (floats in
[0.5, 1.5): no denormals, no NaNs from a log or a square root; integers and
booleans zero, which every index accepts), runs each distinct call a few
times and keeps the best time (CUDA: several calls between two events, as a
stream runs them back to back). Identical blocks share their calls, so a
step of a GPT costs one block's distinct operators. A call that cannot be
rebuilt or raises keeps the rates' estimate; ``Costs`` says how many did.

What it does not see: the runtime's and autograd's Python between the
operators (hooks, the engine), and caches colder in a real step than in a
repeated call.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

_LITERALS = (int, float, bool, str, type(None), torch.dtype, torch.layout, torch.memory_format)


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Call:
    """One operator call with its tensors as layouts: what ``measure`` rebuilds."""

    func: Any
    tree: Any  # the (args, kwargs) pytree's structure
    leaves: tuple[Any, ...]  # TensorSpec, a literal, or a torch.device

    @property
    def key(self) -> tuple[Any, ...]:
        return (self.func, str(self.tree), self.leaves)


def call_spec(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call | None:
    """The call with its tensors as layouts; None if an argument cannot be rebuilt."""
    leaves, tree = tree_flatten((args, kwargs))
    spec: list[Any] = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            t = x._local_tensor if hasattr(x, "_local_tensor") else x
            spec.append(TensorSpec(tuple(t.shape), tuple(t.stride()), t.dtype))
        elif isinstance(x, torch.device):
            spec.append(torch.device("cpu"))  # replaced by the measuring device
        elif isinstance(x, _LITERALS):
            spec.append(x)
        else:  # a generator, a process group, a Python object: not ours to rebuild
            return None
    return Call(func, tree, tuple(spec))


@dataclass
class Costs:
    """What ``measure`` found: seconds per distinct call, and how many it could not time."""

    seconds: dict[tuple[Any, ...], float]
    measured: int  # distinct calls timed
    failed: int  # distinct calls left to the rates (could not be rebuilt or raised)
    wall_s: float  # how long measuring took


def _tensor(s: TensorSpec, device: torch.device) -> torch.Tensor:
    # One storage as large as the layout reaches (expanded and overlapping strides
    # included), filled, then viewed as the layout.
    n = 1 + sum((d - 1) * st for d, st in zip(s.shape, s.stride)) if all(s.shape) else 0
    if s.dtype.is_floating_point or s.dtype.is_complex:
        base = torch.rand(n, device=device).add_(0.5).to(s.dtype)
    else:
        base = torch.zeros(n, dtype=s.dtype, device=device)
    return base.as_strided(s.shape, s.stride)


def _args(call: Call, device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
    leaves = [
        _tensor(x, device)
        if isinstance(x, TensorSpec)
        else device
        if isinstance(x, torch.device)
        else x
        for x in call.leaves
    ]
    args, kwargs = tree_unflatten(leaves, call.tree)
    return args, kwargs


def _time(call: Call, device: torch.device, repeats: int, median: bool = False) -> float:
    args, kwargs = _args(call, device)
    call.func(*args, **kwargs)  # warm: first-call work, caches
    if device.type == "cuda":
        n = 4
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        best = float("inf")
        for _ in range(repeats):
            torch.cuda.synchronize(device)
            start.record()
            for _ in range(n):
                call.func(*args, **kwargs)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3 / n)
        return best
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call.func(*args, **kwargs)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) if median else min(times)


def measure(
    calls: list[Call | None], device: str = "cpu", repeats: int = 3, median: bool = False
) -> Costs:
    """Time every distinct call in ``calls`` on ``device`` (None entries are skipped).
    ``median``: the middle of the repeats, not the best (a host that others share,
    where a step's operators meet the spread, not the best round)."""
    dev = torch.device(device)
    t0 = time.perf_counter()
    seconds: dict[tuple[Any, ...], float] = {}
    failed: set[tuple[Any, ...]] = set()
    for call in calls:
        if call is None:
            continue
        key = call.key
        if key in seconds or key in failed:
            continue
        try:
            with torch.no_grad():
                seconds[key] = _time(call, dev, repeats, median)
        except Exception:  # an operator that needs real values or a real context
            failed.add(key)
    return Costs(seconds, len(seconds), len(failed), time.perf_counter() - t0)
