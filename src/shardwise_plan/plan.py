"""``shardwise_plan.plan``: will this model fit, and how fast will a step be, on N GPUs with this policy?

One call simulates one rank (simulate.py), replays its step against the
target's rates (timeline.py) and says it as a ``Plan``; with a budget it
tries the policies a user would (checkpointing, resharding, offload,
prefetch depth, and where asked the communication policies of comm.py) and
returns the fastest that fits. Rank 0 is simulated: it
holds the most rows when a dimension does not split evenly, so its peak is
every rank's at most.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn as nn

from .comm import CommModel, CommPolicy
from .hardware import H200, Hardware
from .local_step import HostStep, Layout, host_optimizer_seconds, local_step_seconds
from .op_costs import measure
from .optimizers import DEFAULT, resolve
from .policy import Policy
from .setup import InputFn, LossFn, lm_loss, token_batch
from .simulate import check_world, simulate
from .timeline import StepTime, op_seconds, replay

GIB = 1 << 30


class NothingFits(ValueError):
    """No policy tried fits the budget."""


@dataclass
class Plan:
    """One configuration's prediction, per rank."""

    world_size: int
    hsdp: int
    batch_size: int  # sequences per rank per step
    seq_len: int
    policy: Policy
    hardware: Hardware
    n_params: int
    optimizer: str  # what was modelled (optimizers.OPTIMIZERS)
    # Device bytes, allocator rounding included. On gloo (a CPU target) a launch's
    # peak lies between two ends by which of gloo's buffers are live when it peaks
    # (timeline.staging_live): ``peak_bytes_in_step``, ranks in step, each gathered
    # tensor's buffer freed as it runs, and ``peak_bytes_drifting``, ranks drifting
    # apart, gloo's threads holding the largest two to the wait (docs/scaling.md
    # has how far measured launches fall from each). ``peak_bytes`` is their middle,
    # within half the range of any launch between them. Equal elsewhere.
    peak_bytes: int
    peak_bytes_in_step: int
    peak_bytes_drifting: int
    peak_phase: str  # "forward" | "backward" | "optimizer"
    peak_module: str
    peak_by_kind: dict[str, int]
    host_bytes: dict[str, int]  # offloaded state, on the host, at the device's peak
    host_peak_bytes: int  # offload: the most host memory live in the step
    # What one rank receives: "bytes_per_rank" by collective, "bytes_per_link" by link
    # kind (intra, inter node), "bytes_per_link_by_kind"; "whole_bytes": the runtime's.
    collectives: dict[str, Any]
    time: StepTime
    memory_curve: list[tuple[float, int, str]] = field(default_factory=list)  # (ms, bytes, phase)
    # How compute was timed: {"mode": "rates"} or measured (op_costs.py) with its counts.
    compute: dict[str, Any] = field(default_factory=lambda: {"mode": "rates"})
    # An optimizer asked for by a name the planner does not know: how it was modelled.
    optimizer_note: str = ""
    # The recorded step and how it was replayed: ``replan`` replays it on other rates.
    events: list[Any] = field(default_factory=list, repr=False)
    replay_kw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def step_ms(self) -> float:
        return self.time.step_s * 1e3

    @property
    def peak_is_a_range(self) -> bool:
        """On gloo: a launch's peak lies anywhere from ``peak_bytes_in_step`` to
        ``peak_bytes_drifting``, and what shows the plan says both. Elsewhere one figure."""
        return self.peak_bytes_drifting != self.peak_bytes_in_step

    def as_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "hsdp": self.hsdp,
            "batch_size_per_rank": self.batch_size,
            "seq_len": self.seq_len,
            "policy": self.policy.as_dict(),
            "hardware": self.hardware.as_dict(),
            "n_params": self.n_params,
            "optimizer": self.optimizer,
            **({"optimizer_note": self.optimizer_note} if self.optimizer_note else {}),
            "peak_bytes": self.peak_bytes,
            "peak_gib": self.peak_bytes / GIB,
            "peak_bytes_in_step": self.peak_bytes_in_step,
            "peak_bytes_drifting": self.peak_bytes_drifting,
            "peak_where": {"phase": self.peak_phase, "module": self.peak_module},
            "peak_by_kind": self.peak_by_kind,
            "host_bytes": self.host_bytes,
            "host_peak_bytes": self.host_peak_bytes,
            "collectives": self.collectives,
            "step_ms": self.step_ms,
            "time": self.time.as_dict(),
            "compute": self.compute,
        }


@functools.lru_cache(maxsize=2)
def _host_step(layouts: tuple[Layout, ...], optimizer: str) -> HostStep:
    """The host's optimizer step over these shards, timed once a process: a budget
    search plans every offloaded candidate on the same shards (their layouts do not
    depend on checkpointing, resharding or prefetch), and each timing costs the
    shards' state in host memory and nine steps."""
    return host_optimizer_seconds(list(layouts), optimizer=optimizer)


def _curve(
    times: list[float], events: list[Any], points: int = 2000
) -> list[tuple[float, int, str]]:
    stride = max(1, len(events) // points)
    return [
        (times[i] * 1e3, events[i].live, events[i].phase) for i in range(0, len(events), stride)
    ]


def plan(
    build: Callable[[], nn.Module],
    world_size: int,
    *,
    batch_size: int,
    seq_len: int,
    policy: Policy | None = None,
    hsdp: int = 1,
    hardware: Hardware = H200,
    input_fn: InputFn = token_batch,
    loss_fn: LossFn = lm_loss,
    compute: str = "rates",
    slowdown: float = 1.0,
    optimizer: str = DEFAULT,
) -> Plan:
    """Predict one training step of ``build()``'s model at ``world_size`` ranks.

    ``build`` makes the model (it runs under fake tensors; a model it leaves on
    the meta device is materialized as fake). Each block (its largest
    ``nn.ModuleList``'s members) and then the root are ``fully_shard``-ed as
    ``policy`` says; forward, backward and an ``optimizer`` step run on the real
    runtime under a fake process group. ``optimizer``: one of
    ``optimizers.OPTIMIZERS`` ("adamw", torch's default AdamW; "adamw-foreach",
    "adamw-fused", "sgd"); another name is modelled as "adamw", and the plan's
    ``optimizer_note`` says so. ``batch_size`` is sequences per rank.
    ``hsdp`` > 1: a ``(hsdp, world_size // hsdp)`` replicate x shard mesh.
    ``compute``: "rates" times each operator from its FLOPs and bytes at
    ``hardware``'s rates; "measured" runs each distinct operator on this
    machine's device (op_costs.py), which must be ``hardware.device``, and
    multiplies its time by ``slowdown`` (ranks sharing a core: ranks / cores);
    for a CPU target it also runs the rank's step for real under the fake
    process group (local_step.py) and scales the operators' times to it, the
    Python between them included; for a GPU target with offload at one rank it
    runs the host's optimizer step for real and charges that (local_step.py).
    """
    policy = policy or Policy()
    check_world(world_size, hsdp)
    policy.check()
    node = policy.comm.node_size or hardware.ranks_per_node
    check_comm(policy, world_size, hsdp, node)
    if node != hardware.ranks_per_node:  # the timeline splits intra and inter by it too
        hardware = replace(hardware, ranks_per_node=node)
    comm = CommModel(policy.comm, node, world_size, policy.ac != "none", hardware.alloc_round)
    if compute not in COMPUTE_MODES:
        raise ValueError(f"compute must be one of {COMPUTE_MODES}, got {compute!r}")
    measured = compute == "measured"
    if measured:
        check_measurable(hardware)
    spec, note = resolve(optimizer)
    sim = simulate(
        build,
        world_size,
        runtime_policy(policy, world_size, node),
        hardware,
        batch_size,
        seq_len,
        hsdp,
        input_fn,
        loss_fn,
        record_calls=measured,
        optimizer=spec.name,
        comm=comm,
    )
    how: dict[str, Any] = {"mode": compute}
    host_scale = 1.0
    if measured:
        ops = [e for e in sim.events if e.kind == "op"]
        # An offloaded optimizer's operators run on the host, whatever the target:
        # at one rank, timed on this machine's CPU with this process's threads, as
        # the median of five, and for a GPU target then scaled to the whole step
        # run for real (below); the median, because the host's speed moves between
        # repeats. With more ranks, several share a host's cores and memory: the
        # rate stays, calibrated with every rank at once.
        costs = measure([e.call for e in ops if not e.host], hardware.device)
        host_calls = [e.call for e in ops if e.host] if world_size == 1 else []
        host_costs = measure(host_calls, "cpu", repeats=5, median=True)
        for e in ops:
            found = host_costs if e.host else costs
            if e.call is not None and e.call.key in found.seconds:
                e.seconds = found.seconds[e.call.key] * slowdown
        if host_costs.measured and hardware.device != "cpu":
            # Timed one by one, the host's operators sum to the host's speed in each
            # operator's burst, and miss DTensor's dispatch (a GPU target's rates hide
            # it behind the GPU's work; on the host nothing does). The optimizer's
            # whole step, run for real, has both right; the operators keep their
            # shares of it, and one that could not be timed alone is inside it.
            host = _host_step(tuple(sim.host_layouts), spec.name)
            one_by_one = sum(e.seconds or 0.0 for e in ops if e.host)
            scale = host.seconds / one_by_one if one_by_one > 0 else 1.0
            for e in ops:
                if e.host:
                    e.seconds = (e.seconds or 0.0) * scale
            how.update(
                host_step_ms=host.seconds * 1e3,
                host_step_sampled=host.sampled,
                host_steps_ms=host.steps_ms,
                host_threads=host.threads,
                host_operators_one_by_one_ms=one_by_one * 1e3,
            )
        how.update(
            distinct_calls=costs.measured + host_costs.measured,
            host_distinct_calls=host_costs.measured,
            host_operators_ms=1e3 * sum(e.seconds or 0.0 for e in ops if e.host),
            failed=costs.failed + host_costs.failed,
            ops_measured=sum(e.seconds is not None for e in ops),
            ops=len(ops),
            measuring_s=costs.wall_s + host_costs.wall_s,
            slowdown=slowdown,
        )
        if hardware.device == "cpu":
            # The Python between the operators shares the rank's core with them:
            # the rank's real step (local_step.py) says how much it adds.
            local = slowdown * local_step_seconds(
                build, world_size, policy, batch_size, seq_len, hsdp, input_fn, loss_fn, spec.name
            )
            one_rank = not any(e.kind == "issue" for e in sim.events)  # else copies are comm
            ops_s = sum(op_seconds(e, hardware, copies=one_rank) for e in ops)
            # Down as well as up: timed one by one from Python, the smallest
            # operators cost more than inside a step.
            host_scale = local / ops_s if ops_s > 0 else 1.0
            how.update(
                local_step_ms=local * 1e3,
                operators_ms=ops_s * 1e3,
                host_scale=host_scale,
                threads=torch.get_num_threads(),  # the rank's, as timed here
            )
    replay_kw: dict[str, Any] = dict(
        offload=policy.offload,
        host_params=sim.host_params,
        host_scale=host_scale,
        host_bytes_per_param=spec.host_bytes_per_param,
        comm=comm,
    )
    t = replay(sim.events, hardware, world_size, **replay_kw)
    return Plan(
        world_size=world_size,
        hsdp=hsdp,
        batch_size=batch_size,
        seq_len=seq_len,
        policy=policy,
        hardware=hardware,
        n_params=sim.n_params,
        optimizer=spec.name,
        optimizer_note=note,
        peak_bytes=sim.peak_bytes,
        peak_bytes_in_step=sim.peak_bytes_in_step,
        peak_bytes_drifting=sim.peak_bytes_drifting,
        peak_phase=sim.peak_phase,
        peak_module=sim.peak_module,
        peak_by_kind=sim.by_kind,
        host_bytes=sim.host_bytes,
        host_peak_bytes=sim.host_peak_bytes,
        collectives=sim.collectives,
        time=t,
        memory_curve=_curve(t.times, sim.events),
        compute=how,
        events=sim.events,
        replay_kw=replay_kw,
    )


def check_comm(policy: Policy, world: int, hsdp: int, node: int) -> None:
    """A communication policy that cannot run at this world: ValueError, one line."""
    comm = policy.comm
    if (comm.active or comm.node_size is not None) and world > node and world % node:
        raise ValueError(
            f"node size {node} does not divide the world size {world}: a world spans whole nodes"
        )
    if not comm.active:
        return
    if hsdp > 1:
        raise ValueError(
            f"communication policy {comm.name()} splits a flat mesh's traffic by node; HSDP "
            f"(replicate degree {hsdp}) keeps each shard group in its own nodes already: "
            "give one of the two"
        )
    if comm.node_local_backward and policy.reshard_after_forward is not True:
        raise ValueError(
            "hpZ reshards after forward to the node (reshard_after_forward=node size): "
            f"give reshard_after_forward=True, not {policy.reshard_after_forward!r}"
        )


def runtime_policy(policy: Policy, world: int, node: int) -> Policy:
    """What the runtime runs: hpZ's node copy is ``reshard_after_forward=node size``
    (FSDP2's int), which a world of one node does not need."""
    if policy.comm.node_local_backward and world > node:
        return replace(policy, reshard_after_forward=node)
    return policy


# What ``replan`` needs equal: the memory a plan counts depends on these.
_MEMORY_FIELDS = ("alloc_round", "blas_workspace", "device", "ranks_per_node")


def replan(p: Plan, hardware: Hardware) -> Plan:
    """``p``'s simulated step replayed on ``hardware``'s rates: the same memory (the
    target must round and keep memory as ``p``'s does), its own time. Saves the
    simulation, most of a plan's cost, where only the rates differ (H100 and H200)."""
    for f in _MEMORY_FIELDS:
        if getattr(hardware, f) != getattr(p.hardware, f):
            raise ValueError(f"replan: {hardware.name} differs from {p.hardware.name} in {f}")
    if p.compute.get("mode") != "rates" or not p.events:
        raise ValueError("replan replays a plan made with compute='rates'")
    t = replay(p.events, hardware, p.world_size, **p.replay_kw)
    return replace(p, hardware=hardware, time=t, memory_curve=_curve(t.times, p.events))


COMPUTE_MODES = ("rates", "measured")


def check_measurable(hardware: Hardware) -> None:
    """Measured compute runs the operators here: only for a target that is this device."""
    if hardware.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"compute='measured' times operators on this machine's device, and "
            f"{hardware.name!r} is a CUDA target with no GPU here: use compute='rates'"
        )
    if hardware.device == "cpu" and torch.cuda.is_available():
        raise ValueError(
            f"compute='measured' would time on this machine's CPU for {hardware.name!r}, "
            "a CPU target, while a GPU is here: predict the CPU from its rates, or the GPU"
        )


def candidate_policies(base: Policy, comms: Iterable[CommPolicy] = ()) -> list[Policy]:
    """The choices a budget search tries: checkpointing, resharding, offload, prefetch
    depth, and each of ``comms`` (default: ``base``'s communication policy only). hpZ
    is a way to reshard after forward: with ``reshard_after_forward=False`` (nothing
    resharded) it is not tried."""
    out = []
    for ac, raf, offload, prefetch, comm in itertools.product(
        ("none", "non-reentrant"), (True, False), (False, True), (1, 2), list(comms) or [base.comm]
    ):
        if comm.node_local_backward and raf is False:
            continue
        out.append(
            replace(
                base,
                ac=ac,
                reshard_after_forward=raf,
                offload=offload,
                prefetch=prefetch,
                comm=comm,
            )
        )
    return out


def _frugality(p: Policy) -> tuple[int, int, int, int, int, int]:
    # A policy's own buffers and hpZ's kept node copies are memory too: none is frugal.
    c = p.comm
    quantizes = c.quantize_gather != "none" or c.quantize_reduce
    return (
        p.ac == "none",
        p.reshard_after_forward is False,
        not p.offload,
        c.node_local_backward,
        quantizes,
        p.prefetch,
    )


def fastest_within(
    build: Callable[[], nn.Module],
    world_size: int,
    budget_bytes: int,
    *,
    batch_size: int,
    seq_len: int,
    policies: Iterable[Policy] | None = None,
    base: Policy | None = None,
    comms: Iterable[CommPolicy] = (),
    **kw: Any,
) -> tuple[Plan, list[Plan]]:
    """The fastest predicted policy whose peak fits ``budget_bytes``, and every plan tried.

    A policy fits when its ``peak_bytes_drifting`` does: the most a launch may
    reach (on gloo, where a launch's peak lies anywhere between the two ends,
    the upper one; elsewhere it is ``peak_bytes``). A budget is a limit, and
    the middle can be up to half gloo's range under a launch's peak.
    ``comms``: the communication policies to try (candidate_policies).
    Raises ``NothingFits`` (a ``ValueError``) naming the smallest peak seen. The
    most frugal candidate (checkpointing, resharding, offload, no communication
    policy, least prefetch) is tried first: if it does not fit, none will, and the search stops there.
    """
    todo = list(policies or candidate_policies(base or Policy(), comms))
    todo.sort(key=_frugality)
    tried = [plan(build, world_size, batch_size=batch_size, seq_len=seq_len, policy=todo[0], **kw)]
    if tried[0].peak_bytes_drifting <= budget_bytes:
        tried += [
            plan(build, world_size, batch_size=batch_size, seq_len=seq_len, policy=p, **kw)
            for p in todo[1:]
        ]
    fits = [p for p in tried if p.peak_bytes_drifting <= budget_bytes]
    if not fits:
        least = min(tried, key=lambda p: p.peak_bytes_drifting)
        raise NothingFits(
            f"no policy fits {budget_bytes / GIB:.2f} GiB per rank: the smallest predicted "
            f"peak is {least.peak_bytes_drifting / GIB:.2f} GiB ({least.policy.label()}); "
            "raise the budget, the world size, or lower the batch size"
        )
    return min(fits, key=lambda p: p.time.step_s), tried
