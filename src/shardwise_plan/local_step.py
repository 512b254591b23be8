"""One rank's step run for real on this CPU, under the fake process group: the host's share.

Why: on a CPU the operators and all the Python between them (the modules'
calls, autograd's engine, the runtime's hooks, DTensor's dispatch in the
optimizer) run on the one core a rank has, one after another, so a step
costs both. Timing each operator alone (op_costs.py) sees only the first,
and on a small model the second is a good part of the step. The Python is
hard to predict and easy to run: the real runtime trains the model with real tensors under
torch's fake process group, which makes this process rank 0 of the world
and completes every collective locally (its copies are the bytes a real
collective lands here; the wire and the peers are what the timeline adds).
What is left after the operators is the host's time, and the plan spreads
it over them (plan.py). The fake backend's local copies land each gather's
bytes once more than the timeline's ``bytes / bandwidth`` (calibrated on a
real gloo gather, which lands them too) accounts for: counted twice, at most
the bandwidth term, small next to gloo's latency per tensor at the sizes a
CPU trains.

Only for a CPU target on a CPU (a GPU's host runs ahead of its kernels, so
its Python is hidden there unless the step is host-bound, which the rates
model does not claim to see), and only where the whole model and one rank's
training fit here (the model is built whole on the CPU, then sharded): it
is what ``compute="measured"`` costs beyond timing the operators.

``host_optimizer_seconds``, by contrast, serves any target: an offloaded
optimizer at one rank steps this rank's shards on the host whatever the
device, and the honest figure for that is the step itself, run here.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from .optimizers import DEFAULT
from .policy import Policy
from .setup import InputFn, LossFn, apply_policy, make_optimizer
from .world import fake_world, mesh

WARM_STEPS = 2  # the optimizer state, the recorded orders, caches
TIMED_STEPS = 9
# As a measured run times its steps: two untimed (the first makes the optimizer's
# state), the median of seven; a large model's first host steps are its slowest.
HOST_WARM_STEPS = 2
HOST_TIMED_STEPS = 7
HOST_MAX_BYTES = 32 * 2**30  # what stepping the host's optimizer for real may take here

Layout = tuple[tuple[int, ...], torch.dtype]


def local_step_seconds(
    build: Callable[[], nn.Module],
    world: int,
    policy: Policy,
    batch: int,
    seq: int,
    hsdp: int,
    input_fn: InputFn,
    loss_fn: LossFn,
    optimizer: str = DEFAULT,
) -> float:
    """The median wall time of one training step of rank 0, every collective local."""
    with fake_world(world):
        world_mesh = mesh(world, hsdp)
        torch.manual_seed(0)
        model = build()
        if any(p.is_meta for p in model.parameters()):
            model = model.to_empty(device="cpu")
            with torch.no_grad():  # no NaNs or denormals to slow it down, no wild indices
                for t in [*model.parameters(), *model.buffers()]:
                    if t.is_floating_point():
                        t.normal_(0.0, 0.02)
                    else:
                        t.zero_()
        apply_policy(model, policy, world_mesh)
        opt = make_optimizer(model, "cpu", policy.offload, optimizer)
        data = input_fn(model, batch, seq)

        def step() -> None:
            loss_fn(model, data).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        times = _step_times(step, WARM_STEPS, TIMED_STEPS)
    return statistics.median(times)


def _step_times(step: Callable[[], object], warm: int, timed: int) -> list[float]:
    """Seconds of each of ``timed`` calls of ``step``, after ``warm`` untimed ones."""
    for _ in range(warm):
        step()
    times = []
    for _ in range(timed):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


@dataclass(frozen=True)
class HostStep:
    """An offloaded optimizer's step, timed for real on this host."""

    seconds: float  # one step over every layout (the sample's median, scaled up)
    sampled: float  # the share of the elements stepped for real (1.0: all of them)
    steps_ms: list[float]  # the sample's timed steps
    threads: int


def sample_layouts(layouts: list[Layout], max_bytes: int) -> tuple[list[Layout], float]:
    """The layouts to step for real, and their share of the elements. All of them when
    a parameter, its gradient and AdamW's two moments of each fit in ``max_bytes``;
    else the same share of every distinct layout (at least one each), so that the
    mix of large and small tensors, and with it the operators per byte, stays."""

    def nbytes(ls: list[Layout]) -> int:
        return sum(4 * math.prod(shape) * dtype.itemsize for shape, dtype in ls)

    def elements(ls: list[Layout]) -> int:
        return sum(math.prod(shape) for shape, _ in ls)

    total = nbytes(layouts)
    if total <= max_bytes:
        return list(layouts), 1.0
    share = max_bytes / total
    counts: dict[Layout, int] = {}
    for layout in layouts:
        counts[layout] = counts.get(layout, 0) + 1
    sample = [lay for lay, n in counts.items() for _ in range(max(1, int(n * share)))]
    return sample, elements(sample) / max(elements(layouts), 1)


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def host_optimizer_seconds(
    layouts: list[Layout], max_bytes: int | None = None, optimizer: str = DEFAULT
) -> HostStep:
    """The offloaded optimizer's step over this rank's shards (``layouts``), run for real
    on this host: the ``optimizer`` named (optimizers.py), as the offloaded run makes
    it, on DTensors under a one-rank fake group, so DTensor's dispatch is in it.

    Why the whole step and not its operators one by one (op_costs.py): each distinct
    operator is timed in a burst of well under a second, and the host's speed moves
    between bursts, far more than a whole step's time moves between steps. Timed
    whole, it averages the host's speed as a real step does.
    Where this rank's shards, their gradients and two moments would take more than
    ``max_bytes`` (default: 32 GiB or a quarter of the memory free here), a share of
    each layout is stepped and the time scaled by the elements."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    cap = max_bytes if max_bytes is not None else min(HOST_MAX_BYTES, _available_bytes() // 4)
    sample, share = sample_layouts(layouts, cap)
    with fake_world(1):
        one = mesh(1)
        params = nn.ParameterList()
        for shape, dtype in sample:
            # ones and a small gradient: no denormals, no NaNs in the square root
            on = [Shard(0) if shape else Replicate()]
            p = nn.Parameter(DTensor.from_local(torch.ones(shape, dtype=dtype), one, on))
            p.grad = DTensor.from_local(torch.full(shape, 1e-3, dtype=dtype), one, on)
            params.append(p)
        opt = make_optimizer(params, "cpu", True, optimizer)
        times = _step_times(opt.step, HOST_WARM_STEPS, HOST_TIMED_STEPS)
        del opt, params
    return HostStep(
        seconds=statistics.median(times) / share,
        sampled=share,
        steps_ms=[1e3 * t for t in times],
        threads=torch.get_num_threads(),
    )
