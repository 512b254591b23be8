"""Bytes per training step inside and across nodes under each ``CommPolicy`` (issue 51).

The GPT of ``shardwise train --size tiny`` (each block and the root one
``fully_shard`` unit, bf16 parameters, fp32 reduction) on CPU gloo ranks laid out
as nodes of ``--node-size`` consecutive ranks (default 4 ranks as 2 x 2).
``observe.LinkBytes`` counts what every rank sends to a rank of its own node
(intra) and of another node (inter), under its "direct" model (each rank sends
each other member what that member needs, straight to it); the sums over all
ranks of the last of ``--steps`` steps are printed (the first step may do
one-off work), with ratios to plain full sharding. Bytes depend on the shapes
only, not on the values or the batch.

Usage: PYTHONPATH=src python benchmarks/comm_bytes.py [--nproc 4] [--node-size 2]
  [--size tiny] [--block-size 256] [--steps 2]
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from shardwise import CommPolicy, MixedPrecisionPolicy, fully_shard, observe
from shardwise_app.models.gpt import GPT, SIZES

KINDS = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")
LINKS = ("intra", "inter")
PHASES = ("fwd", "bwd")
KEYS = [(ph, k, li) for ph in PHASES for k in KINDS for li in LINKS]

# (name in the table, CommPolicy keywords; node_size and block_size are added).
POLICIES: list[tuple[str, dict[str, Any] | None]] = [
    ("plain", None),
    ("qwZ (forward)", {"quantize_gather": "forward"}),
    ("qwZ (always)", {"quantize_gather": "always"}),
    ("hpZ", {"node_local_backward": True}),
    ("qgZ", {"quantize_reduce": True}),
    (
        "all three",
        {"quantize_gather": "forward", "node_local_backward": True, "quantize_reduce": True},
    ),
]


def _step_counts(
    model: GPT, opt: torch.optim.Optimizer, tokens: torch.Tensor, node: int
) -> list[int]:
    """One training step; this rank's bytes by (phase, kind, link) in ``KEYS`` order."""
    seen = {}
    for phase in PHASES:
        counter = observe.LinkBytes(node)
        remove = observe.add_collective_observer(counter)
        try:
            if phase == "fwd":
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            else:
                loss.backward()
        finally:
            remove()
        seen[phase] = counter.by_kind
    opt.step()
    opt.zero_grad()
    return [seen[ph].get((k, li), 0) for ph, k, li in KEYS]


def _worker(rank: int, args: argparse.Namespace, port: int, q: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.nproc,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    try:
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        cfg = SIZES[args.size]
        out = {}
        for name, kwargs in POLICIES:
            policy = (
                None
                if kwargs is None
                else CommPolicy(node_size=args.node_size, block_size=args.block_size, **kwargs)
            )
            torch.manual_seed(0)
            model = GPT(cfg)
            for block in model.blocks:
                fully_shard(block, mp_policy=mp_policy, comm_policy=policy)
            fully_shard(model, mp_policy=mp_policy, comm_policy=policy)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            g = torch.Generator().manual_seed(rank)
            for _ in range(args.steps):
                tokens = torch.randint(0, cfg.vocab_size, (2, args.seq + 1), generator=g)
                counts = _step_counts(model, opt, tokens, args.node_size)
            total = torch.tensor(counts, dtype=torch.int64)
            dist.all_reduce(total)  # through torch, not shardwise: not counted
            out[name] = dict(zip(KEYS, total.tolist()))
        if rank == 0:
            q.put(out)
    finally:
        dist.destroy_process_group()


def _sum(c: dict[tuple[str, str, str], int], link: str, phase: str = "", kind: str = "") -> int:
    return sum(
        v for (ph, k, li), v in c.items() if li == link and phase in ("", ph) and kind in ("", k)
    )


def table(results: dict[str, dict[tuple[str, str, str], int]]) -> str:
    """The markdown table: per policy, inter and intra bytes per step and their ratios
    to plain, and the inter bytes of forward's gathers, backward's, and the reduction."""
    plain = results["plain"]
    pi, pa = _sum(plain, "inter"), _sum(plain, "intra")
    rows = [
        "| policy | inter-node bytes/step | x plain | intra-node bytes/step | x plain "
        "| inter: fwd gathers | bwd gathers | reduction |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, c in results.items():
        inter, intra = _sum(c, "inter"), _sum(c, "intra")
        reduction = _sum(c, "inter", "bwd") - _sum(c, "inter", "bwd", "all_gather")
        rows.append(
            f"| {name} | {inter:,} | {inter / pi:.3f} | {intra:,} | {intra / pa:.3f} "
            f"| {_sum(c, 'inter', 'fwd', 'all_gather'):,} "
            f"| {_sum(c, 'inter', 'bwd', 'all_gather'):,} | {reduction:,} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--node-size", type=int, default=2)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument(
        "--seq", type=int, default=32, help="tokens per sequence (bytes do not depend on it)"
    )
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args(argv)
    if args.nproc < 2 or args.node_size < 1 or args.nproc % args.node_size or args.steps < 1:
        print("comm_bytes: --node-size must divide --nproc (>= 2); --steps >= 1", file=sys.stderr)
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args, port, q)) for r in range(args.nproc)]
    for p in procs:
        p.start()
    results = q.get(timeout=600)
    for p in procs:
        p.join()
    cfg = SIZES[args.size]
    print(
        f"GPT {args.size} ({cfg.n_layer} layers, d_model {cfg.d_model}, vocab {cfg.vocab_size}), "
        f"{args.nproc} gloo ranks as {args.nproc // args.node_size} nodes x {args.node_size}, "
        f"bf16 params, fp32 reduce, block {args.block_size}; bytes summed over ranks, "
        f"step {args.steps}; torch {torch.__version__}\n"
    )
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
