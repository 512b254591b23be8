"""Muon's optimizer FLOPs per rank, torch's against shardwise's (issue 59): docs/optimizers.md.

FLOPs: the GPT of ``shardwise train`` (``--size``, default tiny: 16 block matrices),
every block and the root one ``fully_shard`` unit, on 2, 4 and 8 CPU gloo ranks. Muon
steps the blocks' linear weights (AdamW, not counted, would step the rest).
``torch.utils.flop_counter.FlopCounterMode`` counts each rank's ``step()`` of
``torch.optim.Muon`` (every rank orthogonalizes every matrix, through DTensor) and of
``shardwise.optim.Muon`` (each matrix on its owner only), after one step that makes the
state; one process's ``torch.optim.Muon`` on the whole model is the unit. FLOPs depend
on the shapes only.

Newton-Schulz time (``--ns-time``, on a GPU): torch's Newton-Schulz on each distinct
block matrix shape of a planning shape (``shardwise_app.models.shapes``, built on the
meta device), timed with CUDA events (median of 20 after 3 warm-ups), summed over the
blocks: what every rank runs per step with torch's Muon, and what the busiest owner
runs with shardwise's at ``--world`` ranks (the owners as shardwise assigns them).

Usage:
  PYTHONPATH=src python benchmarks/muon_flops.py [--ranks 2 4 8] [--size tiny]
  PYTHONPATH=src python benchmarks/muon_flops.py --ns-time gpt_645b llama2_70b --world 64
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from shardwise import fully_shard
from shardwise.optim import Muon
from shardwise.optim.muon import newton_schulz_flops, owners
from shardwise_app.models.gpt import GPT, SIZES


def _matrices(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for b in model.blocks for p in b.parameters() if p.ndim == 2]  # type: ignore[union-attr]


def _step_flops(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> int:
    """Two steps; the FLOPs of the second one's ``opt.step()``."""
    vocab = SIZES["tiny"].vocab_size  # every size's: bytes
    g = torch.Generator().manual_seed(seed)
    flops = 0
    for _ in range(2):
        tokens = torch.randint(0, vocab, (2, 33), generator=g)
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
        with FlopCounterMode(display=False) as counter:
            opt.step()
        flops = counter.get_total_flops()
        opt.zero_grad()
    return flops


def _worker(rank: int, world: int, size: str, port: int, q: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )  # fmt: skip
    try:
        out = {}
        for name, cls in (("torch", torch.optim.Muon), ("shardwise", Muon)):
            torch.manual_seed(0)
            model = GPT(SIZES[size])
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
            out[name] = _step_flops(model, cls(_matrices(model)), rank)
        q.put((rank, out))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def per_rank(world: int, size: str) -> list[dict[str, int]]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, size, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=900) for _ in procs)
    for p in procs:
        p.join()
    return [got[r] for r in range(world)]


def one_process(size: str) -> int:
    torch.manual_seed(0)
    model = GPT(SIZES[size])
    return _step_flops(model, torch.optim.Muon(_matrices(model)), 0)


def flop_table(ranks: list[int], size: str) -> str:
    one = one_process(size)
    rows = [
        f"One process, torch.optim.Muon on the {size} GPT's block matrices: "
        f"{one / 1e9:.3f} GFLOP a step.",
        "",
        "| ranks | torch.optim.Muon per rank | x one process | shardwise.optim.Muon per rank "
        "(max / min) | max x one process | ideal |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for w in ranks:
        res = per_rank(w, size)
        theirs = max(r["torch"] for r in res)
        mine = [r["shardwise"] for r in res]
        assert sum(mine) == one, (mine, one)  # each matrix orthogonalized once in the job
        rows.append(
            f"| {w} | {theirs / 1e9:.3f} GFLOP | {theirs / one:.2f}x | {max(mine) / 1e9:.3f} / "
            f"{min(mine) / 1e9:.3f} GFLOP | {max(mine) / one:.3f}x | {1 / w:.3f}x |"
        )
    return "\n".join(rows)


def ns_time(names: list[str], world: int) -> str:
    """Newton-Schulz milliseconds a step on this GPU: every rank's with torch's Muon, the
    busiest owner's with shardwise's at ``world`` ranks."""
    from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, _zeropower_via_newtonschulz

    from shardwise_app.models import shapes

    coefficients = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
    rows = [
        f"| shape | block matrices | torch.optim.Muon, every rank | shardwise.optim.Muon, "
        f"busiest of {world} ranks | x |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name in names:
        with torch.device("meta"):
            model = getattr(shapes, name)()
        mats = [tuple(p.shape) for p in _matrices(model)]
        ms: dict[tuple[int, ...], float] = {}
        for shape in sorted(set(mats)):
            x = torch.randn(shape, device="cuda")
            times = []
            for i in range(23):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                _zeropower_via_newtonschulz(x, coefficients, 5, 1e-7)
                end.record()
                torch.cuda.synchronize()
                if i >= 3:
                    times.append(start.elapsed_time(end))
            ms[shape] = statistics.median(times)
            del x
        total = sum(ms[s] for s in mats)
        loads = [0.0] * world
        for s, o in zip(mats, owners([newton_schulz_flops(s) for s in mats], world)):
            loads[o] += ms[s]
        rows.append(
            f"| {name} | {len(mats)} | {total:.1f} ms | {max(loads):.1f} ms | "
            f"{total / max(loads):.1f} |"
        )
    return f"{torch.cuda.get_device_name()}, torch {torch.__version__}:\n\n" + "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--size", default="tiny", choices=list(SIZES))
    ap.add_argument("--ns-time", nargs="+", metavar="SHAPE", help="shapes.py names (a GPU)")
    ap.add_argument("--world", type=int, default=64, help="ranks for --ns-time's owners")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.ns_time:
        if not torch.cuda.is_available():
            print("--ns-time needs a GPU", file=sys.stderr)
            return 2
        print(ns_time(args.ns_time, args.world))
        return 0
    print(flop_table(args.ranks, args.size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
