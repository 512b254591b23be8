"""Where a configuration's peak memory went.

Why: FSDP2 and shardwise can differ in peak memory by a gigabyte (7B, two
GPUs) while the peak alone cannot say whether the gap is gathered parameters,
communication buffers or activations. Every configuration gets the same
accounting, taken on one extra, untimed step after the timed ones:

- Exact: parameters, gradients and optimizer state are the storage that the
  model's and optimizer's tensors hold (a DTensor's local shard), counted once
  per storage, right after ``optimizer.step()`` and before ``zero_grad``.
- CUDA, attributed: the caching allocator records every allocation and free of
  that step with its Python stack (``torch.cuda.memory._record_memory_history``).
  Replaying the record finds the moment the allocated total peaks, and each
  block live then is put under what allocated it: a gradient, parameter or
  optimizer-state storage by identity with the tensors above; otherwise by
  the label shardwise's runtime gave it (``shardwise.observe.LABELS``: gathered
  parameters or communication buffers), by stack (FSDP2's gather code and
  collectives, activation recomputation) and else by phase (allocated in forward: activations; in
  backward: backward temporaries). What was allocated before the step and is
  none of the exact parts is ``other``, as are optimizer-step temporaries.
- CPU: there is no allocator record and the peak is the process's RSS, so the
  split is coarse and labelled so: the RSS before the model existed (Python,
  torch, the process group), the exact parts, and the rest as ``transient``.
"""

from __future__ import annotations

import bisect
import os
import resource
from collections.abc import Callable, Iterable
from typing import Any

import torch

from shardwise.observe import LABELS, PREFIX, memory_labels

# Attributed parts on CUDA, in the order the tables print them.
CUDA_PARTS = (
    "parameters",
    "gradients",
    "optimizer_state",
    "gathered_params",
    "comm_buffers",
    "activations",
    "backward_temporaries",
    "other",
)
CPU_PARTS = ("process_baseline", "parameters", "gradients", "optimizer_state", "transient")
EXACT_PARTS = ("parameters", "gradients", "optimizer_state")
MARK = "memory_mark"  # the function whose allocations delimit phases in the record
PHASES = ("forward", "backward", "step")
MAX_ENTRIES = 2_000_000  # far above one step at 7B; a full ring buffer is reported

# shardwise labels its own allocations (``shardwise.observe.LABELS``: the CUDA
# allocator's record carries the label as each allocation's ``user_metadata``):
# the gathered parameters' storage, and what backward gathers from after
# forward, are gathered parameters; every other label is a communication
# buffer (a gather's input or output, a copy-out, a reduction's buffers, an
# offload copy), unless it survives as a gradient.
_GATHERED_LABELS = ("unsharded", "post-forward part")
SHARDWISE_LABELS = {
    PREFIX + name: "gathered_params" if name in _GATHERED_LABELS else "comm_buffers"
    for name in LABELS
}
# FSDP2 has no such labels: its allocations are told apart by function and file.
_FSDP2_GATHERED = {
    "alloc_all_gather_outputs",
    "init_all_gather_outputs",
    "init_unsharded_param",
    "alloc_storage",
    "foreach_all_gather_copy_out",
    "to_sharded_post_forward",  # what reshard_after_forward=int keeps for backward
}
_FSDP2_COMM_FILES = ("_fsdp_collectives.py", "_fsdp_param.py")


def _round_block(n: int) -> int:
    """The caching allocator's block size for a request (multiples of 512 B)."""
    return -(-n // 512) * 512


def held_tensors(
    model: torch.nn.Module, opt: torch.optim.Optimizer, device: torch.device
) -> dict[str, dict[int, int]]:
    """``{part: {storage data_ptr: nbytes}}`` of the exact parts on ``device``.

    Storage, not ``numel``: a shard that is a view into a flat buffer holds the
    whole buffer (padding included), and a tied weight is one storage.
    """
    out: dict[str, dict[int, int]] = {p: {} for p in EXACT_PARTS}
    seen: set[int] = set()

    def add(part: str, tensors: Iterable[Any]) -> None:
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            local = getattr(t, "_local_tensor", t)  # a DTensor's shard on this rank
            if local.device.type != device.type:
                continue  # e.g. a CPU step counter of a non-fused AdamW on a GPU
            while hasattr(local, "__tensor_flatten__"):  # a wrapper subclass (float8 weights)
                names, _ = local.__tensor_flatten__()
                local = getattr(local, names[0])
            storage = local.untyped_storage()
            ptr, n = storage.data_ptr(), storage.nbytes()
            if n and ptr not in seen:
                seen.add(ptr)
                out[part][ptr] = n

    params = list(model.parameters())
    add("parameters", params)
    add("gradients", (p.grad for p in params))
    add("optimizer_state", (v for state in opt.state.values() for v in state.values()))
    return out


def exact_bytes(held: dict[str, dict[int, int]]) -> dict[str, int]:
    return {part: sum(held[part].values()) for part in EXACT_PARTS}


# ---- CPU -----------------------------------------------------------------------------------


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None  # not Linux: the stage table just has no RSS


def cpu_breakdown(baseline_rss: int, peak_rss: int, exact: dict[str, int]) -> dict[str, int]:
    parts = {"process_baseline": baseline_rss, **exact}
    parts["transient"] = peak_rss - sum(parts.values())
    return parts


# ---- CUDA ----------------------------------------------------------------------------------


def memory_mark(device: torch.device) -> None:
    """One tiny allocation whose stack names this function: a phase boundary in the record."""
    torch.empty(1, device=device)


def classify(frames: list[dict[str, Any]], phase: str, label: str = "") -> str:
    """The part an allocation that is none of the exact parts belongs to; ``label``:
    the scope the runtime had labelled it with (the record's ``user_metadata``)."""
    if label in SHARDWISE_LABELS:
        return SHARDWISE_LABELS[label]
    comm = recompute = False
    for f in frames:
        filename = str(f.get("filename", "")).replace("\\", "/")
        name = f.get("name", "")
        if "torch/distributed/fsdp/" in filename:
            if name in _FSDP2_GATHERED:
                return "gathered_params"
            comm = comm or filename.endswith(_FSDP2_COMM_FILES)
        elif filename.endswith("torch/utils/checkpoint.py"):
            recompute = True  # activations recomputed inside backward
    if comm:
        return "comm_buffers"
    if recompute:
        return "activations"
    return {"forward": "activations", "backward": "backward_temporaries"}.get(phase, "other")


def attribute_peak(
    trace: list[dict[str, Any]], baseline: int, held: dict[str, dict[int, int]]
) -> dict[str, Any]:
    """Replay one step's allocator record; the parts live at its highest allocated total.

    ``baseline`` is ``torch.cuda.memory_allocated()`` when recording began and
    ``held`` the exact parts at its end. Frees count when requested, as
    ``memory_allocated`` counts them; sizes are rounded to the allocator's
    512-byte blocks.
    """
    live: dict[int, int] = {}  # address -> index of the allocation that holds it
    marks: list[int] = []
    for i, e in enumerate(trace):
        if e.get("action") == "alloc":
            if any(f.get("name") == MARK for f in e.get("frames", ())):
                marks.append(i)
            else:
                live[e["addr"]] = i
        elif e.get("action") == "free_requested":
            live.pop(e["addr"], None)
    owner = {ptr: part for part, ptrs in held.items() for ptr in ptrs}
    # Held storage allocated inside the step (gradients): by identity, from its allocation on.
    identity = {i: owner[addr] for addr, i in live.items() if addr in owner}
    traced = {trace[i]["addr"] for i in identity}
    totals = dict.fromkeys(CUDA_PARTS, 0)
    for part, ptrs in held.items():
        totals[part] += sum(_round_block(n) for p, n in ptrs.items() if p not in traced)
    totals["other"] = baseline - sum(totals.values())
    total = baseline
    best, best_total, best_phase = dict(totals), total, "start"
    mark_set, mark_addrs = set(marks), set()
    blocks: dict[int, tuple[int, str]] = {}  # live address -> (bytes, part)
    for i, e in enumerate(trace):
        action = e.get("action")
        if action == "alloc":
            if i in mark_set:
                mark_addrs.add(e["addr"])
                continue
            k = bisect.bisect(marks, i)  # marks before this allocation
            phase = PHASES[k] if k < len(PHASES) else "other"
            part = identity.get(i) or classify(
                e.get("frames", []), phase, e.get("user_metadata", "")
            )
            n = _round_block(e["size"])
            blocks[e["addr"]] = (n, part)
            totals[part] += n
            total += n
            if total > best_total:
                best, best_total, best_phase = dict(totals), total, phase
        elif action == "free_requested":
            if e["addr"] in mark_addrs:
                mark_addrs.discard(e["addr"])
                continue
            n, part = blocks.pop(e["addr"], (_round_block(e["size"]), "other"))
            totals[part] -= n  # "other" if it was allocated before the step began
            total -= n
    return {"peak_bytes": best_total, "parts": best, "peak_during": best_phase}


def cuda_memory_step(
    run_step: Callable[[Callable[[str], None]], None],
    device: torch.device,
    held_fn: Callable[[], dict[str, dict[int, int]]],
) -> dict[str, Any]:
    """Run one step under the allocator's record; the attributed breakdown at its peak.

    ``run_step(mark)`` runs forward, backward and the optimizer step, calling
    ``mark(phase)`` after each; ``held_fn`` reads the exact parts afterwards.
    """
    from torch.cuda import memory as cuda_memory

    stages: dict[str, dict[str, int]] = {}

    def mark(phase: str) -> None:
        memory_mark(device)
        stages[phase] = {
            "allocated": torch.cuda.memory_allocated(),
            "peak": torch.cuda.max_memory_allocated(),  # since the previous mark
        }
        torch.cuda.reset_peak_memory_stats()

    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    # Failures of the record itself (not of the step, whose collectives every
    # rank must finish) cost the attribution, never the row's timings.
    problem = None
    try:
        cuda_memory._record_memory_history(
            "all", context="alloc", stacks="python", max_entries=MAX_ENTRIES
        )
    except Exception as e:  # noqa: BLE001
        problem = f"recording: {type(e).__name__}: {e}"
    snapshot: Any = None
    recording = problem is None
    try:
        with memory_labels():  # shardwise's allocations carry their scope's label
            run_step(mark)
        torch.cuda.synchronize()
        if problem is None:
            try:
                snapshot = cuda_memory._snapshot()
            except Exception as e:  # noqa: BLE001
                problem = f"snapshot: {type(e).__name__}: {e}"
    finally:
        if recording:
            cuda_memory._record_memory_history(None)
    held = held_fn()
    exact = exact_bytes(held)
    allocator_peak = max(s["peak"] for s in stages.values())
    out: dict[str, Any] = {
        "method": "cuda allocator record, attributed at the peak",
        "peak_bytes": allocator_peak,
        "stages": {"start": {"allocated": baseline}, **stages},
        "exact": exact,
    }
    try:
        if problem is not None:
            raise RuntimeError(problem)
        trace = snapshot["device_traces"][torch.cuda.current_device()]
        result = attribute_peak(trace, baseline, held)
    except Exception as e:  # noqa: BLE001
        parts = dict.fromkeys(CUDA_PARTS, 0) | exact
        parts["other"] = allocator_peak - sum(exact.values())
        out.update(
            method=f"cuda, exact parts only (attribution failed: {str(e).splitlines()[0]})",
            parts=parts,
            unattributed_bytes=0,
            peak_during="unknown",
            record_truncated=False,
        )
        return out
    out.update(
        parts=result["parts"],
        # The replayed total against the allocator's own peak: what rounding
        # and blocks larger than requested leave unattributed (or a truncated record).
        unattributed_bytes=allocator_peak - result["peak_bytes"],
        peak_during=result["peak_during"],
        record_truncated=len(trace) >= MAX_ENTRIES,
    )
    return out


def cpu_memory_step(
    run_step: Callable[[Callable[[str], None]], None],
    baseline_rss: int,
    held_fn: Callable[[], dict[str, dict[int, int]]],
) -> dict[str, Any]:
    """The coarse CPU split: exact parts read after the step, the rest of the peak RSS lumped."""
    stages: dict[str, dict[str, int | None]] = {"start": {"rss": rss_bytes()}}
    run_step(lambda phase: stages.__setitem__(phase, {"rss": rss_bytes()}))
    exact = exact_bytes(held_fn())
    peak = peak_rss_bytes()
    return {
        "method": "cpu peak RSS (coarse: gathered, comm and activations are one 'transient' part)",
        "peak_bytes": peak,
        "parts": cpu_breakdown(baseline_rss, peak, exact),
        "stages": stages,
        "exact": exact,
    }
