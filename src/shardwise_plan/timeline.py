"""A recorded step replayed against a machine's rates: when compute waits for communication.

Why a replay rather than a formula: the order is the runtime's own. Each
collective is issued where the runtime issued it (a prefetch before the
current module's compute, a reduction after its backward) and waited for
where it waited, so the overlap is exactly what the prefetch plan allows.
Compute is one stream: each operator takes ``max(flops / rate, bytes /
bandwidth) + overhead`` (a roofline with a fixed cost). Communication is a
second stream, one collective at a time: a collective starts when it is
issued and the previous one is done, and lasts ``latency + bytes / bus
bandwidth`` (intra-node or inter-node, by its group); an offloaded gather
first uploads its shard, a reduction then downloads it (at one GPU, with no
collective, the copies have two streams of their own, one each way, and a
module's compute waits for its own upload). A wait moves compute to the
collective's (or upload's) end; that move is exposed communication.

Under a communication policy (comm.py) a collective is its legs one after
the other on the communication stream, each priced by the same rule, with
its quantize and dequantize kernels before and after; those kernels are
charged to the compute stream too, at the issue (phase "quantize").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .comm import CommModel
from .hardware import Hardware
from .tracker import Event

# AdamW reads a parameter, its gradient and two moments and writes the parameter and
# the moments: 28 bytes an fp32 parameter, and the for-loop's temporaries about 4 more.
ADAMW_BYTES_PER_PARAM = 32


@dataclass
class StepTime:
    step_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    by_phase: dict[str, float] = field(default_factory=dict)  # compute seconds
    by_module: dict[str, float] = field(default_factory=dict)  # compute seconds
    times: list[float] = field(default_factory=list)  # compute clock after each event
    ends: dict[int, float] = field(default_factory=dict)  # each collective's end
    flops: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "step_ms": self.step_s * 1e3,
            "compute_ms": self.compute_s * 1e3,
            "comm_ms": self.comm_s * 1e3,
            "exposed_comm_ms": self.exposed_comm_s * 1e3,
            "compute_ms_by_phase": {k: v * 1e3 for k, v in self.by_phase.items()},
            "compute_ms_by_module": {k: v * 1e3 for k, v in self.by_module.items()},
            "flops": self.flops,
        }


def op_seconds(e: Event, hw: Hardware, host_per_byte: float = 0.0, copies: bool = True) -> float:
    """One operator's time. ``host_per_byte``: seconds per byte an offloaded optimizer's
    op touches (its step's whole time spread over its ops); ``copies``: time the
    host-device copies here (else a copy stream or a collective has them)."""
    extra = hw.dtensor_overhead if e.dtensor else 0.0
    copy = e.transfer / hw.h2d_bw if copies else 0.0
    if not e.nbytes and not e.flops:
        return max(hw.view_overhead, copy) + extra
    if e.host and e.seconds is None:
        per_byte = host_per_byte or 1.0 / hw.host_mem_bw
        return e.nbytes * per_byte + hw.op_overhead + extra
    if e.seconds is not None:  # measured on this device (op_costs.py): dispatch included
        return max(e.seconds, copy) + extra
    rate = hw.matmul_flops if e.low_precision else hw.matmul_flops_fp32
    kernel = max(e.flops / rate if e.matmul else 0.0, e.nbytes / hw.mem_bw)
    return max(kernel, copy) + hw.op_overhead + extra


def comm_seconds(e: Event, hw: Hardware, world: int, offload: bool) -> float:
    # An all-reduce is HSDP's, over the replicas: across nodes once the world is.
    crosses = world > hw.ranks_per_node if e.coll == "all_reduce" else e.group > hw.ranks_per_node
    bw = hw.inter_bw if crosses else hw.intra_bw
    # A module's gather is one NCCL launch, but on a CPU (gloo) one collective per
    # tensor, each paying the latency (collectives.all_gather_each).
    latencies = e.parts if hw.device == "cpu" else 1
    t = latencies * hw.latency + e.nbytes / bw if e.group > 1 else 0.0
    if offload and e.coll in ("all_gather", "reduce_scatter"):
        t += e.numel * 4 / hw.h2d_bw  # the fp32 shard up, or the reduced shard down
    return t


def policy_comm_seconds(
    e: Event, hw: Hardware, world: int, offload: bool, comm: CommModel
) -> tuple[float, float]:
    """A collective as ``comm`` runs it: (its time on the communication stream, the time
    of its quantize and dequantize kernels, included in the first)."""
    legs = comm.legs(e)
    kernels = sum(n / hw.mem_bw + hw.op_overhead for n in comm.kernel_bytes(e))
    if not kernels and len(legs) == 1:  # as the runtime runs it
        return comm_seconds(e, hw, world, offload), 0.0
    t = kernels
    for leg in legs:
        if leg.group > 1:
            t += hw.latency + leg.nbytes / (hw.inter_bw if leg.crosses else hw.intra_bw)
    if offload and e.coll in ("all_gather", "reduce_scatter"):
        t += e.numel * 4 / hw.h2d_bw
    return t, kernels


def replay(
    events: list[Event],
    hw: Hardware,
    world: int,
    offload: bool = False,
    host_params: int = 0,
    host_scale: float = 1.0,
    host_bytes_per_param: int = ADAMW_BYTES_PER_PARAM,
    comm: CommModel | None = None,
) -> StepTime:
    """``host_params``: elements of the offloaded shards, whose optimizer step runs on
    the host at ``hw.host_adamw_bw`` (``host_bytes_per_param`` each: the optimizer's,
    optimizers.py). ``host_scale``:
    every operator's time times this (a CPU's Python between them, measured). Host
    operators timed on this machine (op_costs) are charged their measured times
    in place of the AdamW rate's share. ``comm``: a communication policy's model,
    whose collectives replace the runtime's (policy_comm_seconds)."""
    host_ops = [e for e in events if e.kind == "op" and e.host]
    host_bytes = sum(e.nbytes for e in host_ops)
    measured = any(e.seconds is not None for e in host_ops)
    per_byte = 0.0
    if host_params and host_bytes and not measured:
        rate = hw.host_adamw_bw or hw.host_mem_bw
        per_byte = host_params * host_bytes_per_param / rate / host_bytes
    # More than one rank: an offloaded gather's upload and a reduction's download
    # are timed with the collective (comm_seconds). At one rank they run on their
    # own streams (offload.py), one each way, beside compute: a module's compute
    # waits for its own upload where the runtime waits for its gather (the upload
    # event's key, tracker.offload_copies), and the step waits for both streams
    # before the optimizer (backward's end waits for the downloads).
    one_rank = not any(e.kind == "issue" for e in events)
    streams = one_rank and hw.device == "cuda"  # a CPU copies on the rank's core
    copy_free = {True: 0.0, False: 0.0}  # to the host, to the device: when each is done
    clock = 0.0  # compute stream
    comm_free = 0.0  # communication stream
    comm_total = exposed = flops = 0.0
    ends: dict[int, float] = {}
    all_ends: dict[int, float] = {}
    by_phase: dict[str, float] = {}
    by_module: dict[str, float] = {}
    times = []
    for e in events:
        if e.kind == "op" and e.phase == "optimizer" and max(copy_free.values()) > clock:
            exposed += max(copy_free.values()) - clock
            clock = max(copy_free.values())
        if e.kind == "op":
            if streams and e.transfer:
                t = e.transfer / hw.h2d_bw
                copy_free[e.to_host] = max(clock, copy_free[e.to_host]) + t
                comm_total += t
                if e.key:  # an upload a later wait names
                    ends[e.key] = all_ends[e.key] = copy_free[e.to_host]
            copies = one_rank and not streams
            dt = op_seconds(e, hw, per_byte, copies) * host_scale
            clock += dt
            flops += e.flops
            by_phase[e.phase] = by_phase.get(e.phase, 0.0) + dt
            key = e.module or "(root)"
            by_module[key] = by_module.get(key, 0.0) + dt
        elif e.kind == "issue":
            if comm is None:
                dt = comm_seconds(e, hw, world, offload)
            else:
                dt, kernels = policy_comm_seconds(e, hw, world, offload, comm)
                if kernels:  # the SMs and memory bandwidth they take from compute
                    clock += kernels
                    by_phase["quantize"] = by_phase.get("quantize", 0.0) + kernels
            if not hw.comm_overlaps:  # the collective takes the cores compute runs on
                clock += dt
                exposed += dt
                all_ends[e.key] = clock
                comm_total += dt
                times.append(clock)
                continue
            start = max(clock, comm_free)
            comm_free = start + dt
            ends[e.key] = all_ends[e.key] = comm_free
            comm_total += dt
        elif e.kind == "wait":
            end = ends.pop(e.key, clock)
            if end > clock:
                exposed += end - clock
                clock = end
        times.append(clock)
    # What is still in flight at the end is waited for before the next step.
    in_flight = max(comm_free, *copy_free.values())
    if in_flight > clock:
        exposed += in_flight - clock
        clock = in_flight
    compute = sum(by_phase.values())
    return StepTime(
        clock, compute, comm_total, exposed, by_phase, by_module, times, all_ends, flops
    )


# gloo's worker threads per process group (ProcessGroupGloo's default options: two a
# device): at most this many of its collectives run at once, each gathered tensor one.
GLOO_THREADS = 2


def staging_live(events: list[Event], in_step: bool = False) -> list[int]:
    """Per event, the bytes of gloo's own buffers live then: a reduce-scatter's
    clone of its input, which the work handle holds from the issue until the
    runtime releases it at the wait, and a gathered tensor's flat buffer, which
    lives while one of gloo's threads runs that tensor's gather.

    A module's gather is one gloo collective per tensor (collectives.py), queued
    on the group's ``GLOO_THREADS`` threads, so at most that many flat buffers
    live at once, and each until its gather is done, which waits for the
    slowest rank. Ranks in step (``in_step``) finish their gathers while the
    next operators run: the buffers are counted at the issue only. Ranks that
    drift apart (the default) keep gathers in flight up to the wait: then the
    largest ``GLOO_THREADS`` tensors of the gathers issued and not yet waited
    for (at the issue itself, no less than in step). A launch lies between the
    two by which tensors are in flight when it peaks (docs/scaling.md has the
    measured launches: holding a module's every buffer to the wait was past
    all of them)."""
    extra = [0] * len(events)
    waited: dict[int, int] = {}
    for i, e in enumerate(events):
        if e.kind == "wait":
            waited.setdefault(e.key, i)
    gathers: list[tuple[int, int, tuple[int, ...]]] = []  # issue, wait, each tensor's bytes
    for i, e in enumerate(events):
        if e.kind != "issue" or not e.staging:
            continue
        if e.coll == "all_gather":
            extra[i] += e.staging
            gathers.append((i, waited.get(e.key, len(events)), e.staging_parts or (e.staging,)))
            continue
        for j in range(i, max(i + 1, waited.get(e.key, len(events)))):
            extra[j] += e.staging
    if in_step:
        return extra
    pending: list[tuple[int, int, tuple[int, ...]]] = []
    issued = 0  # gathers[:issued] have been issued by event j
    for j, e in enumerate(events):
        while issued < len(gathers) and gathers[issued][0] <= j:
            pending.append(gathers[issued])
            issued += 1
        pending = [g for g in pending if j < g[1]]
        flight = sorted(p for _, _, parts in pending for p in parts)[-GLOO_THREADS:]
        here = e.staging if e.kind == "issue" and e.coll == "all_gather" else 0
        extra[j] += max(0, sum(flight) - here)
    return extra
