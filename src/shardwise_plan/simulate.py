"""One rank of a world of any size, in this process: the real runtime on fake tensors.

torch's fake process group makes this process rank 0 of ``world`` ranks
(every collective returns at once and moves nothing) and ``FakeTensorMode``
makes every tensor shape and dtype only, so shardwise's own hooks, layouts,
gathers, reductions and frees run exactly as they would at that size, for a
model of any size, in seconds. Three steps run: the first makes the
optimizer state and records the orders, the second is recorded (memory and
operators in order), the third stops at the second's peak to say what the
live bytes are.

What needs no GPU: all of it. The fake tensors live on the CPU, so the
runtime takes its CPU paths; for a CUDA target what differs is added from
the target's figures (the allocator's block rounding, foreach AdamW, cuBLAS's
workspaces, which no dispatch mode sees), and the CUDA-only side streams (a
collective's copy-in beside compute) are timed, not run. One path is not
reproduced: at world size 1 on a GPU, a bf16 cast is prefetched one block
ahead, which a CPU run never does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from shardwise import observe

from .comm import CommModel, comm_live, traffic
from .hardware import BLAS_THREADS, Hardware
from .local_step import Layout
from .optimizers import DEFAULT
from .policy import Policy
from .setup import InputFn, LossFn, apply_policy, lm_loss, make_optimizer, token_batch
from .timeline import staging_live
from .tracker import Event, Stop, Tracker, saving_as_activations, storages_of
from .world import fake_world, mesh

PARAMS, GRADS, OPTIM = "sharded_params", "grads", "optimizer_state"
WORKSPACES = "blas_workspaces"


@dataclass
class Simulation:
    """What one simulated step saw."""

    events: list[Event]
    peak_bytes: int
    peak_index: int
    # On gloo (a CPU target) the peak is the middle of two ends, ranks in step and
    # ranks that drift apart (timeline.staging_live); elsewhere the three are equal.
    peak_bytes_in_step: int
    peak_bytes_drifting: int
    peak_phase: str
    peak_module: str
    by_kind: dict[str, int]
    host_bytes: dict[str, int]
    host_peak_bytes: int = 0  # offload: the most host memory live in the recorded step
    host_params: int = 0  # offload: elements of this rank's shards (stepped on the host)
    host_layouts: list[Layout] = field(default_factory=list)  # offload: this rank's shards
    collectives: dict[str, Any] = field(default_factory=dict)
    n_params: int = 0


def check_world(world: int, hsdp: int) -> None:
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world size must be a positive int, got {world!r}")
    if not isinstance(hsdp, int) or hsdp < 1 or world % hsdp:
        raise ValueError(
            f"HSDP replicate degree {hsdp} must be a positive divisor of the world size {world}"
        )


def _moved(kind: str, nbytes: int, group: int) -> int:
    """Bytes one rank sends (and receives) in a ring: (g-1)/g of the whole, twice for all-reduce."""
    share = nbytes * (group - 1) // group
    return 2 * share if kind == "all_reduce" else share


def _label_modules(model: nn.Module, blocks: list[nn.Module], tracker: Tracker) -> list[Any]:
    """Name the module running: the blocks and the root's other children, in forward
    (and a recomputation) by forward hooks, in backward when their outputs' gradients arrive."""
    names = {id(b): n for n, b in model.named_modules() if b in blocks}
    for n, m in model.named_children():
        if not isinstance(m, nn.ModuleList):
            names.setdefault(id(m), n)
    handles = []
    for m in model.modules():
        name = names.get(id(m))
        if name is None:
            continue

        def pre(mod: nn.Module, args: Any, name: str = name) -> None:
            tracker.module = name

        def post(mod: nn.Module, args: Any, out: Any, name: str = name) -> None:
            t = out if isinstance(out, torch.Tensor) else None
            if t is not None and t.requires_grad:
                t.register_hook(lambda g, name=name: setattr(tracker, "module", name))

        handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    return handles


def simulate(
    build: Callable[[], nn.Module],
    world: int,
    policy: Policy,
    hw: Hardware,
    batch: int,
    seq: int,
    hsdp: int = 1,
    input_fn: InputFn = token_batch,
    loss_fn: LossFn = lm_loss,
    record_calls: bool = False,
    optimizer: str = DEFAULT,
    comm: CommModel | None = None,
) -> Simulation:
    """Three training steps of ``build()``'s model under ``policy`` at ``world`` ranks,
    stepping ``optimizer`` (optimizers.py).

    ``record_calls``: keep each operator's call on its event, to be timed
    (op_costs.py). ``comm``: a communication policy's model (comm.py): its
    buffers are counted in the peak (as communication buffers) and the bytes
    moved are as it runs the collectives, by link kind too; the runtime runs
    its own (hpZ's resharding is ``policy``'s, plan.py)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    check_world(world, hsdp)
    policy.check()
    tracker = Tracker(hw.alloc_round)
    tracker.gloo_staging = hw.device == "cpu"
    tracker.record_calls = record_calls
    whole: dict[str, int] = {}
    moved: dict[str, int] = {}
    offload = policy.offload

    with fake_world(world):
        world_mesh = mesh(world, hsdp)
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        with (
            fake,
            tracker,
            tracker.watching_resize(),
            tracker.offload_copies(),
            saving_as_activations(tracker),
        ):
            torch.manual_seed(0)
            model = build()
            if any(p.is_meta for p in model.parameters()):
                model = model.to_empty(device="cpu")
            blocks = apply_policy(model, policy, world_mesh)
            params = list(model.parameters())
            n_params = sum(p.numel() for p in params)
            opt = make_optimizer(model, hw.device, offload, optimizer)
            host_params = 0
            host_layouts: list[Layout] = []
            if offload:
                local = [getattr(p, "_local_tensor", p) for p in params]
                tracker.mark_host(storages_of(local))
                host_params = sum(t.numel() for t in local)
                host_layouts = [(tuple(t.shape), t.dtype) for t in local]
            handles = _label_modules(model, blocks, tracker)

            def grads_to_host() -> None:
                grads = [p.grad for p in params if p.grad is not None]
                tracker.mark_host(storages_of([getattr(g, "_local_tensor", g) for g in grads]))

            issued: dict[int, tuple[Any, int]] = {}  # id(pending): (pending, its key)

            def on_collective(rec: Any, pending: Any) -> None:
                staging = tracker.take_staging()
                if tracker.events is None:
                    return
                share = _moved(rec.kind, rec.nbytes, rec.group_size)
                if counting:  # the recorded step only (the third stops part way)
                    whole[rec.kind] = whole.get(rec.kind, 0) + rec.nbytes
                    moved[rec.kind] = moved.get(rec.kind, 0) + share
                key = len(tracker.events)  # unique within the step (an id may be reused)
                issued[id(pending)] = (pending, key)
                tracker.record(
                    kind="issue",
                    coll=rec.kind,
                    nbytes=share,
                    group=rec.group_size,
                    key=key,
                    numel=rec.numel // max(1, rec.group_size),
                    full_numel=rec.numel,
                    itemsize=rec.nbytes // max(1, rec.numel),
                    staging=sum(staging),
                    staging_parts=staging,
                    parts=rec.parts,
                )

            def on_wait(pending: Any, done: bool) -> None:
                if not done:
                    return
                _, key = issued.pop(id(pending), (None, -1))
                if key < 0:
                    return  # a cast or an upload (the tracker's), or an earlier step's
                if offload:
                    grads_to_host()
                tracker.record(kind="wait", key=key)

            removers = [
                observe.add_collective_observer(on_collective),
                observe.add_wait_observer(on_wait),
            ]
            by_kind: dict[str, int] = {}
            host: dict[str, int] = {}
            stop_at = -1
            host_peak = 0
            peak_drifting = half = 0
            # Made in the first step's forward and backward, live through every later one.
            workspaces = hw.blas_workspace * BLAS_THREADS if hw.device == "cuda" else 0
            counting = False

            def take() -> None:
                known = _known(params, opt)
                by_kind.update(tracker.snapshot(known))
                if workspaces:
                    by_kind[WORKSPACES] = workspaces
                host.update(tracker.host_bytes(known))

            try:
                for step in range(3):
                    recording = counting = step == 1
                    tracker.events = [] if step >= 1 else None
                    issued.clear()
                    tracker.peak = 0
                    tracker.host_peak = tracker.host_total
                    stopped = _one_step(
                        model,
                        opt,
                        input_fn,
                        loss_fn,
                        batch,
                        seq,
                        tracker,
                        stop_at if step == 2 else -1,
                        take,
                    )
                    if offload:
                        tracker.mark_host(storages_of(_state_tensors(opt)))
                        grads_to_host()
                    if recording:
                        assert tracker.events is not None
                        events = tracker.events
                        # gloo's buffers as ranks in step hold them; ranks drifting
                        # apart hold more (timeline.py). The plan's peak is the middle
                        # of the two, its breakdown the in-step peak's with the half
                        # added to gloo's buffers.
                        staging = staging_live(events, in_step=True)
                        # The policy's buffers, counted as gloo's are (a communication
                        # buffer, live from the issue to the wait).
                        policy_bufs = comm_live(events, comm) if comm else [0] * len(events)
                        for e, extra, bufs in zip(events, staging, policy_bufs):
                            e.live += extra + bufs + workspaces
                        peak_index = max(range(len(events)), key=lambda i: events[i].live)
                        more = [a - b for a, b in zip(staging_live(events), staging)]
                        peak_drifting = max(e.live + d for e, d in zip(events, more))
                        half = (peak_drifting - events[peak_index].live) // 2
                        stop_at = peak_index
                        host_peak = tracker.host_peak
                        tracker.staging_now = staging[peak_index] + policy_bufs[peak_index]
                        tracker.staging_now += half
                    if stopped:
                        break
            finally:
                for remove in removers:
                    remove()
                for h in handles:
                    h.remove()
    at = events[peak_index]
    collectives: dict[str, Any] = {"whole_bytes": whole, "bytes_per_rank": moved}
    if comm is not None:
        collectives.update(traffic(events, comm))
    return Simulation(
        events=events,
        peak_bytes=at.live + half,
        peak_index=peak_index,
        peak_bytes_in_step=at.live,
        peak_bytes_drifting=peak_drifting,
        peak_phase=at.phase,
        peak_module=at.module,
        by_kind=by_kind,
        host_bytes=host,
        host_peak_bytes=host_peak,
        host_params=host_params,
        host_layouts=host_layouts,
        collectives=collectives,
        n_params=n_params,
    )


def _one_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    input_fn: InputFn,
    loss_fn: LossFn,
    batch: int,
    seq: int,
    tracker: Tracker,
    stop_at: int,
    at_stop: Callable[[], None],
) -> bool:
    """One training step; with ``stop_at`` >= 0, stopped once that event is recorded,
    ``at_stop()`` first (tracker.Stop). True if it stopped."""
    tracker.stop_at, tracker.at_stop = stop_at, at_stop
    try:
        tracker.phase, tracker.module = "forward", ""
        data = input_fn(model, batch, seq)
        loss = loss_fn(model, data)
        tracker.phase = "backward"
        loss.backward()
        del loss
        tracker.phase, tracker.module = "optimizer", ""
        opt.step()
        opt.zero_grad(set_to_none=True)
        return False
    except Stop:
        return True
    finally:
        tracker.stop_at, tracker.at_stop = -1, None


def _state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = []
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                out.append(getattr(v, "_local_tensor", v))
    return out


def _known(params: list[nn.Parameter], opt: torch.optim.Optimizer) -> dict[int, str]:
    known: dict[int, str] = {}
    for t in _state_tensors(opt):
        known[id(t.untyped_storage())] = OPTIM
    for p in params:
        if p.grad is not None:
            g = getattr(p.grad, "_local_tensor", p.grad)
            known[id(g.untyped_storage())] = GRADS
    for p in params:
        known[id(getattr(p, "_local_tensor", p).untyped_storage())] = PARAMS
    return known
