"""What quantized weight gathers (``CommPolicy(quantize_gather=...)``) cost in kernels.

For one block of the 0.94B GPT (``shardwise_app.models.shapes.gpt_094b``: d 2048,
16 blocks), at a shard group of ``--world`` ranks: the time to pack this rank's
shard (quantize to int8 blocks with an fp32 scale each, ``quantize.pack``) and to
unpack the gathered rows into ``param_dtype`` (``quantize.unpack``), eager and
``torch.compile``d, beside the block's forward + backward at ``--batch`` sequences
of 2048 tokens in bf16. A step of ``quantize_gather="forward"`` packs and unpacks
once per block, ``"always"`` twice (backward gathers again); the ratio is that
cost over the block's compute (16 blocks: the same ratio for the model's step,
leaving out the embedding and head).

    python benchmarks/quantize_cost.py --device cuda --world 8 --batch 4
    python benchmarks/quantize_cost.py --device cpu --world 8 --batch 1 --repeats 3

On CUDA each time is ``--repeats`` calls queued back to back between two events,
after two warm-ups; on the CPU the median of ``--repeats`` calls.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from shardwise.comm import quantize
from shardwise_app.models.gpt import Block, GPTConfig


def _time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Seconds per call of ``fn``: on CUDA, ``repeats`` calls queued back to back between
    two events (the device's time, as the stream sees it when the host runs ahead);
    on the CPU the median of ``repeats`` calls. Two warm-up calls first."""
    if device.type == "cuda":
        for _ in range(2):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3 / repeats
    times = []
    for i in range(repeats + 2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--world", type=int, default=8, help="ranks the block is sharded over")
    ap.add_argument("--batch", type=int, default=4, help="sequences of 2048 tokens per rank")
    ap.add_argument("--block-size", type=int, default=256, help="elements per scale")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    device = torch.device(args.device)
    cfg = GPTConfig(seq_len=2048, n_layer=16, n_head=16, d_model=2048)
    block = Block(cfg).to(device)
    numel = sum(p.numel() for p in block.parameters())
    shard = -(-numel // args.world)
    torch.manual_seed(0)
    flat = torch.randn(1, shard, device=device)  # this rank's fp32 master shard
    rows = torch.empty(
        args.world, quantize.row_bytes(shard, args.block_size), dtype=torch.uint8, device=device
    )

    b, nb = args.block_size, quantize.blocks(shard, args.block_size)
    scales = rows[:, : nb * quantize.SCALE_BYTES].view(torch.float32)
    values = rows[:, nb * quantize.SCALE_BYTES : nb * quantize.SCALE_BYTES + nb * b]
    out = torch.empty(args.world, shard, dtype=torch.bfloat16, device=device)

    def torch_ops(quant: Any, dequant: Any) -> tuple[Any, Any]:
        """Pack and unpack by quantize.py's torch ops (the CPU's path), with ``quant``
        and ``dequant`` for its two steps (compiled or not)."""

        def torch_pack() -> None:
            q, s = quant(flat, b)
            scales[:1].copy_(s)
            values[:1].copy_(q.view(torch.uint8).view(1, nb * b))

        def torch_unpack() -> None:
            q = values.view(torch.int8).view(args.world, nb, b)
            out.copy_(dequant(q, scales, shard, torch.bfloat16))

        return torch_pack, torch_unpack

    torch_pack, torch_unpack = torch_ops(quantize.quantize, quantize.dequantize)

    def pack() -> None:  # what the runtime runs (fused on a GPU: quantize_gpu.py)
        quantize.pack(flat, b, torch.int8, rows[:1])

    def unpack() -> None:
        quantize.unpack_into(out, rows, shard, b, torch.int8)

    rows.zero_()
    torch_pack()
    want_rows = rows.clone()
    torch_unpack()
    want = out.clone()
    rows.zero_()
    pack()
    unpack()
    same = torch.equal(rows[:1], want_rows[:1])
    diff = (out.float() - want.float()).abs().max().item()
    print(f"runtime against torch ops: packed row equal {same}, unpacked max |diff| {diff:.3g}")
    # Compiled with dynamic shapes (every module's shard has its own size) the torch
    # ops' unpack ran slower than eager on an H100 (0.62 against 0.51 ms); compiled
    # for one shape it is the row below.
    results = {}
    for name, p, u in (
        ("torch ops, eager", torch_pack, torch_unpack),
        (
            "torch ops, compiled for one shape",
            *torch_ops(torch.compile(quantize.quantize), torch.compile(quantize.dequantize)),
        ),
        ("the runtime's (fused on a GPU)", pack, unpack),
    ):
        results[name] = (_time(p, device, args.repeats), _time(u, device, args.repeats))

    x = torch.randn(args.batch, cfg.seq_len, cfg.d_model, device=device, requires_grad=True)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = block(x)
        out.float().sum().backward()

    compute = _time(step, device, args.repeats)
    print(
        f"device {device}  block {numel / 1e6:.1f}M params  world {args.world}  "
        f"shard {shard / 1e6:.2f}M  batch {args.batch} x {cfg.seq_len} tokens"
    )
    print(f"block forward + backward: {compute * 1e3:.2f} ms")
    print("| kernels | pack ms | unpack ms | forward-only % of compute | always % of compute |")
    print("| --- | --- | --- | --- | --- |")
    for name, (tp, tu) in results.items():
        once = (tp + tu) / compute * 100
        print(f"| {name} | {tp * 1e3:.3f} | {tu * 1e3:.3f} | {once:.2f} | {2 * once:.2f} |")


if __name__ == "__main__":
    main()
