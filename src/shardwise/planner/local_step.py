"""One rank's step run for real on this CPU, under the fake process group: the host's share.

Why: on a CPU the operators and all the Python between them (the modules'
calls, autograd's engine, the runtime's hooks, DTensor's dispatch in the
optimizer) run on the one core a rank has, one after another, so a step
costs both. Timing each operator alone (op_costs.py) sees only the first:
on the tiny GPT at 2 gloo ranks the operators were about 80% of the step
less its communication (2026-12-02). The Python is hard to predict and
easy to run: the real runtime trains the model with real tensors under
torch's fake process group, which makes this process rank 0 of the world
and completes every collective locally (its copies are the bytes a real
collective lands here; the wire and the peers are what the timeline adds).
What is left after the operators is the host's time, and the plan spreads
it over them (plan.py). The fake backend's local copies land each gather's
bytes once more than the timeline's ``bytes / bandwidth`` (calibrated on a
real gloo gather, which lands them too) accounts for: counted twice, at most
the bandwidth term, small next to gloo's latency per tensor on the CPU rows
measured (2026-12-02: the tiny GPT gathers about 0.2 MB a module).

Only for a CPU target on a CPU (a GPU's host runs ahead of its kernels, so
its Python is hidden there unless the step is host-bound, which the rates
model does not claim to see), and only where the whole model and one rank's
training fit here (the model is built whole on the CPU, then sharded): it
is what ``compute="measured"`` costs beyond timing the operators.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn as nn

from .. import collectives
from ..api import hsdp_mesh
from .policy import Policy
from .setup import InputFn, LossFn, apply_policy, make_optimizer

WARM_STEPS = 2  # the optimizer state, the recorded orders, caches
TIMED_STEPS = 9


def local_step_seconds(
    build: Callable[[], nn.Module],
    world: int,
    policy: Policy,
    batch: int,
    seq: int,
    hsdp: int,
    input_fn: InputFn,
    loss_fn: LossFn,
) -> float:
    """The median wall time of one training step of rank 0, every collective local."""
    with collectives.fake_world(world):
        mesh = hsdp_mesh(hsdp, "cpu") if hsdp > 1 else collectives.device_mesh("cpu", (world,))
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
        apply_policy(model, policy, mesh)
        opt = make_optimizer(model, "cpu", policy.offload)
        data = input_fn(model, batch, seq)

        def step() -> None:
            loss_fn(model, data).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(WARM_STEPS):
            step()
        times = []
        for _ in range(TIMED_STEPS):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
