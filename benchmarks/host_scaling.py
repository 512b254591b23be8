"""Host time per module per step at any world size: shardwise vs FSDP2 under torch's fake process group.

Why the fake group: it makes one process rank 0 of a world of any size, so the
runtime's own host code (hooks, layouts, copy-ins, the orders) runs as it
would at that size, on one CPU. A Python loop over ranks per parameter per
step is invisible at 2 ranks and dominant at 1024; this shows whether one is
left, beside FSDP2 (``torch.distributed.fsdp.fully_shard``) on the same model
and group.

What is timed: a training step (forward, backward, SGD step, zero_grad) of a
stack of small blocks on CPU tensors, so host time is most of it. Every
parameter's dim 0 is 1024 (it splits evenly over every world size here), so
the gathered parameters, the compute and the bytes are the same at every size.
The fake group's collectives are not free: in torch 2.13 each all-gather splits
its output into one chunk per rank and copies its input into each (a
reduce-scatter splits its input so, and copies one chunk), in C++: per rank,
per gathered tensor, per call. No real backend has that loop on the host
(NCCL runs a grouped gather as one launch; gloo's work runs on its threads).
The time inside ``dist.all_gather_single`` / ``reduce_scatter_single`` /
``all_reduce`` (torch's c10d wrapper and the backend) is therefore measured
and reported apart; "host" is the step less that. "over bare" is host less
the same model's step unsharded, per module: what the runtime adds.

Three modes say what the collectives do. "skip": nothing (a finished work
handle back): the runtime's own host time. "copy": each all-gather writes its
output and each reduce-scatter its output, one copy each, as many bytes as a
real collective lands in this process, without the per-rank loop. "fake": the
fake backend's own collectives; the table also counts the chunks its loops
make per step (one per rank per tensor per call). The loop costs more than
its own time (the work after a 1024-rank fake all-gather runs about as slowly
as after a flush of the caches), so "host" in this mode carries some of the
backend's cost too.

Each (implementation, world) runs in a process of its own (one process group
per process), interleaved: every round runs every world size and
implementation once, in a rotated order. Per run: warm-up steps, then the
median step of many; per cell: min and median over the rounds, and the spread
(max - min) / median.

Bookkeeping memory: Python bytes (tracemalloc: Python objects, not tensor
storage) and Python objects (gc) that ``fully_shard`` and two training steps
leave alive, per parameter; and the tensor objects among them.

Shapes (``--shapes``, comma-separated; each printed with its own bare model):
"blocks" (the default: 16 blocks of 4 parameters, every dim 0 1024), "large"
(few large blocks: 4 of LayerNorm + two Linears, 256 <-> 1024), "small" (many
small blocks: 64 of LayerNorm + two Linears, 64 <-> 256) and "moe" (4 blocks of a
router and 16 experts, each expert fully_shard'ed apart). Only "blocks" splits
evenly over every world size; "per module" divides by the modules sharded besides
the root.

Usage: python benchmarks/host_scaling.py [--rounds 5] [--steps 40]
  [--worlds 2,8,64,512,1024] [--modes skip,copy,fake] [--shapes blocks,large,small,moe]
  [--json OUT] [--profile] [--torch-profile]
(``PYTHONPATH=src``; ``--profile`` prints shardwise's cProfile top entries at
the smallest and largest world size instead of timing, collectives skipped;
``--torch-profile`` counts the aten and c10d operators per step of shardwise
and FSDP2 at those sizes, in the first of ``--modes``, and lists those whose
count grows with the world.)
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
import tracemalloc
from typing import Any

HIDDEN = 1024  # every parameter's dim 0 in "blocks" (the default shape)
WIDTH = 16
BLOCKS = 16
BATCH = 4

# The shapes (``--shape``): what is fully_shard'ed, besides the root.
SHAPES = {
    "blocks": f"{BLOCKS} blocks of 4 parameters (dim 0: {HIDDEN}), batch {BATCH} x {WIDTH}",
    "large": "4 large blocks (LayerNorm 256, Linear 256->1024, Linear 1024->256), batch 1 x 256",
    "small": "64 small blocks (LayerNorm 64, Linear 64->256, Linear 256->64), batch 4 x 64",
    "moe": "4 MoE blocks, each a router (LayerNorm 64, Linear 64->16) and 16 experts "
    "(Linear 64->128, Linear 128->64) sharded apart, batch 4 x 64",
}


def build(shape: str = "blocks"):
    """(model, the modules fully_shard'ed before the root, an input) for ``shape``."""
    import torch
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(WIDTH, HIDDEN)  # (1024, 16), (1024,)
            self.scale = nn.Parameter(torch.ones(HIDDEN))
            self.down = nn.Parameter(torch.randn(HIDDEN, WIDTH) / HIDDEN**0.5)

        def forward(self, x):
            return x + (torch.relu(self.up(x)) * self.scale) @ self.down

    class MLP(nn.Module):
        def __init__(self, width: int, hidden: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.up = nn.Linear(width, hidden)
            self.down = nn.Linear(hidden, width)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(self.norm(x))))

    class Expert(nn.Module):
        def __init__(self, width: int, hidden: int) -> None:
            super().__init__()
            self.up = nn.Linear(width, hidden)
            self.down = nn.Linear(hidden, width)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))

    class MoE(nn.Module):
        """Every expert runs on every row, weighted by the router (dense): the host
        work of a sharded module per expert, with no routing to vary it."""

        def __init__(self, width: int, hidden: int, experts: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.router = nn.Linear(width, experts)
            self.experts = nn.ModuleList(Expert(width, hidden) for _ in range(experts))

        def forward(self, x):
            h = self.norm(x)
            gates = torch.softmax(self.router(h), dim=-1)
            out = x
            for i, expert in enumerate(self.experts):
                out = out + gates[:, i : i + 1] * expert(h)
            return out

    torch.manual_seed(0)
    if shape == "blocks":
        model = nn.Sequential(*[Block() for _ in range(BLOCKS)])
        return model, list(model), torch.randn(BATCH, WIDTH)
    if shape == "large":
        model = nn.Sequential(*[MLP(256, 1024) for _ in range(4)])
        return model, list(model), torch.randn(1, 256)
    if shape == "small":
        model = nn.Sequential(*[MLP(64, 256) for _ in range(64)])
        return model, list(model), torch.randn(4, 64)
    if shape == "moe":
        blocks = [MoE(64, 128, 16) for _ in range(4)]
        # Experts first, then their block (inner modules before outer ones).
        sharded = [m for block in blocks for m in [*block.experts, block]]
        model = nn.Sequential(*blocks)
        return model, sharded, torch.randn(4, 64)
    raise ValueError(f"unknown shape {shape!r}: one of {sorted(SHAPES)}")


_in_collectives = [0.0]
_chunks = [0]  # the fake backend's per-rank chunks, this step


class _Done:
    """A finished collective's work handle ("skip" and "copy")."""

    def wait(self, *args) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _operands(args: tuple, kwargs: dict):
    """(output, input) of an all-gather or reduce-scatter (FSDP2 names them)."""
    out = args[0] if args else kwargs.get("output_tensor", kwargs.get("output"))
    inp = args[1] if len(args) > 1 else kwargs.get("input_tensor", kwargs.get("input"))
    return out, inp


def _one_copy(name: str, args: tuple, kwargs: dict) -> None:
    """What the collective lands here, in one copy: the gathered output (this
    rank's shard in every rank's place), or this rank's chunk of the sum."""
    import torch

    if name == "all_reduce":
        return  # in place: the fake backend writes nothing either
    out, inp = _operands(args, kwargs)
    with torch.no_grad():
        if name == "all_gather_single":
            n = out.numel() // inp.numel()
            out.view(n, -1).copy_(inp.reshape(1, -1).expand(n, -1))
        else:
            out.view(-1).copy_(inp.view(-1)[: out.numel()])


def _timed(fn, name: str, mode: str):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            if mode == "fake":
                if name != "all_reduce":
                    out, inp = _operands(args, kwargs)
                    _chunks[0] += max(out.numel(), inp.numel()) // min(out.numel(), inp.numel())
                return fn(*args, **kwargs)
            if mode == "copy":
                _one_copy(name, args, kwargs)
            return _Done() if kwargs.get("async_op") else None
        finally:
            _in_collectives[0] += time.perf_counter() - start

    return wrapper


def _tensors() -> int:
    import torch

    # type(), not isinstance: gc holds deprecated proxies that warn on __class__
    return sum(issubclass(type(o), torch.Tensor) for o in gc.get_objects())


def _op_counts(step, steps: int) -> dict:
    """aten/c10d operators per step (torch.profiler): count and self time, us."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    return {
        e.key: (e.count / steps, e.self_cpu_time_total / steps)
        for e in prof.key_averages()
        if e.key.startswith(("aten::", "c10d::"))
    }


def one(
    impl: str, world: int, steps: int, profile: str, mode: str = "fake", shape: str = "blocks"
) -> dict:
    """One run in this process: ``impl`` ("shardwise", "fsdp2", "bare") at ``world``
    ranks; ``profile``: "" (timed), "cprofile" or "torch"."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # Before shardwise is imported: collectives.py binds these at import; FSDP2
    # looks them up at each call.
    for name in ("all_gather_single", "reduce_scatter_single", "all_reduce"):
        setattr(dist, name, _timed(getattr(dist, name), name, mode))
    torch.set_num_threads(1)
    # Skipped gathers leave their outputs as allocated: no slow denormals in them.
    torch.set_flush_denormal(True)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    from torch.distributed.fsdp import fully_shard

    import shardwise

    warm, _, x = build(shape)  # torch's own first-step work, outside what is counted
    warm(x).sum().backward()
    torch.optim.SGD(warm.parameters(), lr=1e-3).step()
    del warm
    model, sharded, x = build(shape)
    nparams = len(list(model.parameters()))
    gc.collect()
    tracemalloc.start()
    before_bytes = tracemalloc.get_traced_memory()[0]
    before_objs = len(gc.get_objects())
    before_tensors = _tensors()
    shards: dict[str, Any] = {
        "shardwise": shardwise.fully_shard,
        "fsdp2": fully_shard,
    }
    shard = shards.get(impl)
    if shard is not None:
        for m in sharded:
            shard(m)
        shard(model)
    gc.collect()
    sharded_bytes = tracemalloc.get_traced_memory()[0] - before_bytes
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        step()
    gc.collect()
    held_bytes = tracemalloc.get_traced_memory()[0] - before_bytes
    tracemalloc.stop()
    objs = len(gc.get_objects()) - before_objs
    tensors = _tensors() - before_tensors
    for _ in range(3):
        step()
    if profile == "torch":
        return {"ops": _op_counts(step, steps)}
    if profile:
        import cProfile
        import io
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        for _ in range(steps):
            step()
        pr.disable()
        out = io.StringIO()
        stats = pstats.Stats(pr, stream=out)
        calls = stats.total_calls // steps  # type: ignore[attr-defined]
        stats.sort_stats("tottime").print_stats(12)
        return {"calls_per_step": calls, "profile": out.getvalue()}
    times, coll = [], []
    for _ in range(steps):
        _in_collectives[0] = 0.0
        _chunks[0] = 0
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        coll.append(_in_collectives[0])
    dist.destroy_process_group()
    host = sorted(t - c for t, c in zip(times, coll))
    return {
        "modules": len(sharded),  # what "per module" divides by (the root not counted)
        "step_ms": statistics.median(times) * 1e3,
        "coll_ms": statistics.median(coll) * 1e3,
        "backend_chunks": _chunks[0],  # the last step's (the same every step)
        "host_ms": statistics.median(host) * 1e3,
        "py_bytes_per_param": held_bytes / nparams,
        "py_bytes_per_param_sharded": sharded_bytes / nparams,
        "py_objects_per_param": objs / nparams,
        "tensors_per_param": tensors / nparams,
    }


def child(
    impl: str, world: int, steps: int, profile: str = "", mode: str = "fake", shape: str = "blocks"
) -> dict:
    cmd = [sys.executable, __file__, "--one", impl, str(world), "--steps", str(steps)]
    cmd += ["--mode", mode, "--shape", shape] + (["--profile-as", profile] if profile else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def spread(xs: list[float]) -> float:
    return (max(xs) - min(xs)) / statistics.median(xs)


MODES = {
    "skip": "collectives skipped (the runtime's own host time)",
    "copy": "each collective one copy of the bytes it lands here (host = step less the copies)",
    "fake": "the fake backend's collectives run (host = step less the time inside them)",
}


def table(runs: dict, mode: str, worlds: list[int], bare_med: float) -> list[dict]:
    rows = []
    print(f"\n{MODES[mode]}:\n")
    head = (
        "| world | impl | host us/module/step min | median | spread | over bare (median) "
        "| in collectives ms/step | whole step ms | fake backend's chunks/step "
        "| Python bytes/param: sharded, +2 steps "
        "| objects/param | tensors/param |"
    )
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for w in worlds:
        for impl in ("shardwise", "fsdp2"):
            rs = runs[(mode, impl, w)]
            host = [x["host_ms"] / x["modules"] * 1e3 for x in rs]  # us per module
            x = {
                "mode": mode,
                "impl": impl,
                "world": w,
                "host_us": host,
                "host_us_min": min(host),
                "host_us_median": statistics.median(host),
                "host_spread": spread(host),
                "over_bare_us_median": statistics.median(host) - bare_med,
                "coll_ms_median": statistics.median(x["coll_ms"] for x in rs),
                "step_ms_median": statistics.median(x["step_ms"] for x in rs),
                "backend_chunks": rs[0]["backend_chunks"],
                **{k: v for k, v in rs[0].items() if "per_param" in k},
            }
            rows.append(x)
            print(
                f"| {w} | {impl} | {x['host_us_min']:.0f} | {x['host_us_median']:.0f} "
                f"| {x['host_spread']:.0%} | {x['over_bare_us_median']:.0f} "
                f"| {x['coll_ms_median']:.1f} | {x['step_ms_median']:.1f} "
                f"| {x['backend_chunks']} "
                f"| {x['py_bytes_per_param_sharded']:.0f}, {x['py_bytes_per_param']:.0f} "
                f"| {x['py_objects_per_param']:.1f} | {x['tensors_per_param']:.1f} |"
            )
    print()
    for impl in ("shardwise", "fsdp2"):
        lo = next(x for x in rows if x["impl"] == impl and x["world"] == worlds[0])
        hi = next(x for x in rows if x["impl"] == impl and x["world"] == worlds[-1])
        print(
            f"{impl}: host time per module, world {worlds[-1]} / world {worlds[0]}: "
            f"{hi['host_us_median'] / lo['host_us_median']:.3f}x (medians), "
            f"{hi['host_us_min'] / lo['host_us_min']:.3f}x (minima)"
        )
    # The measure: what shardwise adds over the bare model, against what FSDP2
    # adds, from this one invocation.
    for w in worlds:
        ours, theirs = (
            next(x for x in rows if x["impl"] == i and x["world"] == w)["over_bare_us_median"]
            for i in ("shardwise", "fsdp2")
        )
        print(
            f"world {w}: over bare per module (medians) shardwise {ours:.0f} us, "
            f"FSDP2 {theirs:.0f} us: {ours / theirs:.2f}x FSDP2's"
        )
    return rows


def torch_profile(worlds: list[int], mode: str, steps: int = 3) -> None:
    """Which aten/c10d operators run more often per step at the largest world than at
    the smallest, for each implementation: a per-rank loop shows up here."""
    lo, hi = worlds[0], worlds[-1]
    for impl in ("shardwise", "fsdp2"):
        a, b = (child(impl, w, steps, profile="torch", mode=mode)["ops"] for w in (lo, hi))
        print(f"== {impl}, collectives {mode!r}: operators per step, world {lo} -> {hi}")
        print(f"| operator | calls/step at {lo} | at {hi} | self ms/step at {lo} | at {hi} |")
        print("|---|---|---|---|---|")
        for op in sorted(b, key=lambda k: -b[k][1]):
            n_lo, t_lo = a.get(op, (0, 0.0))
            n_hi, t_hi = b[op]
            if n_hi > n_lo or t_hi > 1e3:  # grows with the world, or a millisecond a step
                print(f"| {op} | {n_lo:.0f} | {n_hi:.0f} | {t_lo / 1e3:.2f} | {t_hi / 1e3:.2f} |")
        print()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--worlds", default="2,8,64,512,1024")
    ap.add_argument("--modes", default="skip,copy,fake")
    ap.add_argument("--json")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--torch-profile", action="store_true")
    ap.add_argument("--one", nargs=2)
    ap.add_argument("--mode", default="fake", choices=sorted(MODES))
    ap.add_argument("--profile-as", default="", choices=["", "cprofile", "torch"])
    ap.add_argument("--shapes", default="blocks", help=f"comma-separated, of {sorted(SHAPES)}")
    ap.add_argument("--shape", default="blocks", choices=sorted(SHAPES))  # the child's
    args = ap.parse_args()
    if args.one:
        impl, world = args.one[0], int(args.one[1])
        print(json.dumps(one(impl, world, args.steps, args.profile_as, args.mode, args.shape)))
        return
    worlds = [int(w) for w in args.worlds.split(",")]
    if args.profile:
        for w in (worlds[0], worlds[-1]):
            prof = child("shardwise", w, 5, "cprofile", "skip", args.shapes.split(",")[0])
            calls = prof["calls_per_step"]
            print(f"== shardwise, world {w}, collectives skipped: {calls} calls/step")
            print(prof["profile"])
        return
    if args.torch_profile:
        torch_profile(worlds, args.modes.split(",")[0])
        return
    modes = args.modes.split(",")
    shapes = args.shapes.split(",")
    out: dict[str, Any] = {}
    for shape in shapes:
        out[shape] = run_shape(shape, worlds, modes, args.rounds, args.steps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out if len(shapes) > 1 else out[shapes[0]], f, indent=1)


def run_shape(shape: str, worlds: list[int], modes: list[str], rounds: int, steps: int) -> dict:
    """Every cell of one shape, interleaved over the rounds; its tables printed."""
    cells = [(m, i, w) for w in worlds for m in modes for i in ("shardwise", "fsdp2")]
    cells.append(("skip", "bare", worlds[0]))
    runs: dict[tuple, list[dict]] = {c: [] for c in cells}
    for r in range(rounds):
        k = r * 3 % len(cells)  # a rotated order each round
        for mode, impl, w in cells[k:] + cells[:k]:
            runs[(mode, impl, w)].append(child(impl, w, steps, mode=mode, shape=shape))
            done = runs[(mode, impl, w)][-1]["host_ms"]
            print(f"round {r} {shape} {mode} {impl} {w}: {done:.2f} ms", file=sys.stderr)
    bare_runs = runs[("skip", "bare", worlds[0])]
    bare = [x["host_ms"] / x["modules"] * 1e3 for x in bare_runs]
    bare_med = statistics.median(bare)
    print(
        f"== {shape}: {SHAPES[shape]}, SGD; {bare_runs[0]['modules']} modules sharded "
        f"besides the root; {rounds} rounds x {steps} steps (after 5 warm-up steps)\n"
        f"bare model (unsharded): {min(bare):.0f} / {bare_med:.0f} us per module per step "
        f"(min / median), spread {spread(bare):.0%}"
    )
    rows = [row for m in modes for row in table(runs, m, worlds, bare_med)]
    for row in rows:
        row["shape"] = shape
    return {"rows": rows, "bare_us": bare, "rounds": rounds}


if __name__ == "__main__":
    main()
