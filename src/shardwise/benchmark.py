"""Side-by-side benchmark: the bare model, torch's FSDP2 and shardwise, in one invocation.

Why one process per (configuration, round): peak memory (CUDA max allocated,
CPU peak RSS) is only clean when nothing else lives in the process, and
alternating rounds (A B C A B C ...) spreads machine drift over every
configuration equally. Each job builds the same model from the same seed,
trains ``warmup + steps`` steps on the same data, and reports the median step.

    shardwise bench --model tiny --nproc 2                     # CPU, gloo
    shardwise bench --model medium --nproc 1 --mp bf16 --ac none,non-reentrant
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import resource
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

CONFIGS = ("bare", "fsdp2", "shardwise")
H200_BF16_PEAK = 989e12  # dense bf16 FLOP/s of one H100/H200 SXM


@dataclass
class Job:
    config: str
    model: str
    nproc: int
    ac: str
    mp: str
    batch_size: int
    seq_len: int
    steps: int
    warmup: int
    device: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _build(job: Job) -> tuple[torch.nn.Module, Any]:
    """The model under one configuration, and its AdamW."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from . import MixedPrecisionPolicy, fully_shard
    from .models.gpt import GPT, SIZES, set_activation_checkpointing

    torch.manual_seed(0)
    cfg = SIZES[job.model].with_seq_len(job.seq_len)
    device = torch.device(job.device)
    with device:
        model = GPT(cfg)
    set_activation_checkpointing(model, job.ac)
    bf16 = job.mp == "bf16"
    from torch.distributed.device_mesh import init_device_mesh

    # Explicit: on a GPU machine a CPU benchmark must not land on the default CUDA mesh.
    mesh = init_device_mesh(job.device, (job.nproc,))
    if job.config == "fsdp2":
        kw: dict[str, Any] = {"mesh": mesh}
        if bf16:
            kw["mp_policy"] = TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            torch_fully_shard(block, **kw)
        torch_fully_shard(model, **kw)
    elif job.config == "shardwise":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy if bf16 else None)
        fully_shard(model, mesh=mesh, mp_policy=policy if bf16 else None)
    # The fused AdamW on CUDA for every configuration: the fastest each can use.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda" or None)
    return model, opt


def _worker(rank: int, job: Job, port: int, q: Any) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    try:
        cuda = job.device == "cuda"
        if cuda:
            torch.cuda.set_device(rank)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // job.nproc))
        backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=job.nproc
        )
        model, opt = _build(job)
        g = torch.Generator().manual_seed(1 + rank)
        vocab = 256
        autocast = torch.autocast(
            job.device, dtype=torch.bfloat16, enabled=job.config == "bare" and job.mp == "bf16"
        )
        times = []
        for step in range(job.warmup + job.steps):
            idx = torch.randint(0, vocab, (job.batch_size, job.seq_len + 1), generator=g)
            idx = idx.to(job.device)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with autocast:
                logits = model(idx[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, vocab), idx[:, 1:].reshape(-1))
            loss.backward()
            try:
                opt.step()
            except RuntimeError:
                if step or not opt.defaults.get("fused"):
                    raise
                # fused AdamW refused these parameters (DTensor on an older torch)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
                opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            if step >= job.warmup:
                times.append(time.perf_counter() - t0)
        peak = (
            torch.cuda.max_memory_allocated()
            if cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        )
        stats = torch.tensor([statistics.median(times), float(peak)], dtype=torch.float64)
        gathered = [torch.zeros_like(stats) for _ in range(job.nproc)]
        dist.all_gather(gathered, stats)  # gloo on CPU tensors: fine for both backends
        n_params = sum(p.numel() for p in model.parameters())
        if rank == 0:
            q.put(
                (
                    "ok",
                    {
                        "fused_adamw": bool(opt.defaults.get("fused")),
                        "step_s": max(float(t[0]) for t in gathered),
                        "peak_bytes": max(float(t[1]) for t in gathered),
                        "params": n_params,
                    },
                )
            )
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - the parent prints it
        import traceback

        q.put(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_job(job: Job, timeout: float = 900) -> dict[str, Any]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, job, port, q)) for r in range(job.nproc)]
    for p in procs:
        p.start()
    try:
        status, payload = q.get(timeout=timeout)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if status != "ok":
        raise RuntimeError(f"{job.config} failed: {payload}")
    return payload


def _overhead_worker(rank: int, n_modules: int, steps: int, port: int, q: Any) -> None:
    """Hook cost per module: many tiny linears, one rank, configurations alternated per step."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from . import fully_shard

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (1,))
        checked = functools.partial(fully_shard, check=True)
        models = {}
        for name, shard in (
            ("bare", None),
            ("fsdp2", torch_fully_shard),
            ("shardwise", fully_shard),
            ("shardwise_check", checked),  # lifecycle checks on: what "off" saves
        ):
            torch.manual_seed(0)
            m = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(n_modules)))
            if shard is not None:
                for layer in m:
                    shard(layer, mesh=mesh)
                shard(m, mesh=mesh)
            models[name] = m
        x = torch.randn(2, 4, requires_grad=True)
        times: dict[str, list[float]] = {k: [] for k in models}
        for step in range(steps + 5):
            for name, m in models.items():
                t0 = time.perf_counter()
                m(x).sum().backward()
                m.zero_grad(set_to_none=True)
                if step >= 5:
                    times[name].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        q.put(("ok", {k: (med[k] - med["bare"]) / n_modules * 1e6 for k in models if k != "bare"}))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001
        q.put(("error", repr(e)))


def hook_overhead_us(n_modules: int = 64, steps: int = 60) -> dict[str, float]:
    """Microseconds per module per forward+backward added over the bare model (CPU, 1 rank)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_overhead_worker, args=(0, n_modules, steps, _free_port(), q))
    proc.start()
    status, payload = q.get(timeout=600)
    proc.join()
    if status != "ok":
        raise RuntimeError(payload)
    return payload


def model_flops_per_token(n_params: int, job: Job) -> float:
    """6N for the matmuls plus causal attention (PaLM appendix B style); no recompute."""
    from .models.gpt import SIZES

    cfg = SIZES[job.model]
    return 6 * n_params + 6 * cfg.n_layer * cfg.d_model * job.seq_len


DESCRIPTION = """\
Measure the bare model, torch's FSDP2 and shardwise side by side on the same
GPT, data and settings: one fresh process group per (configuration, round),
rounds alternated so that machine drift hits all alike.

examples:
  shardwise bench --model tiny --nproc 2                     # CPU, gloo
  shardwise bench --model medium --nproc 1 --mp bf16 --ac none,non-reentrant
"""


class BenchUsageError(Exception):
    """Bad input: one line on stderr, exit code 2, before anything runs or is written."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shardwise bench",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model", default="tiny", help="model size: tiny, small, medium (default: tiny)"
    )
    p.add_argument(
        "--nproc", type=int, default=None, help="ranks (default: 1 on a GPU, else 2 CPU processes)"
    )
    p.add_argument(
        "--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available"
    )
    p.add_argument(
        "--ac", default="none", help="comma list of activation checkpointing modes (default: none)"
    )
    p.add_argument("--mp", default="none", help="comma list of: none, bf16 (default: none)")
    p.add_argument(
        "--batch-size", type=int, default=None, help="per rank (default: 4 on a GPU, 8 on CPU)"
    )
    p.add_argument("--seq-len", type=int, default=None, help="(default: the model's)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per job (default: 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default: 3)")
    p.add_argument("--rounds", type=int, default=2, help="A B C rounds, alternated (default: 2)")
    p.add_argument(
        "--configs",
        default=None,
        help="comma list of: bare, fsdp2, shardwise (default: all; bare only at --nproc 1)",
    )
    p.add_argument(
        "--json", default="bench.json", help="where to write the results (default: bench.json)"
    )
    p.add_argument("--plot", default=None, help="also draw a bar chart PNG here (default: none)")
    p.add_argument(
        "--overhead",
        action="store_true",
        help="also measure hook CPU overhead per module (1 CPU rank, tiny layers)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cuda, nproc, configs, acs, mps = _check(args)
    except BenchUsageError as e:
        print(f"shardwise bench: error: {e}", file=sys.stderr)
        return 2
    from .models.gpt import SIZES

    cfg = SIZES[args.model]
    seq = args.seq_len or cfg.seq_len
    batch = args.batch_size or (4 if cuda else 8)
    device = "cuda" if cuda else "cpu"
    rows = []
    for ac in acs:
        for mp in mps:
            results: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
            for _ in range(args.rounds):
                for c in configs:
                    job = Job(
                        c, args.model, nproc, ac, mp, batch, seq, args.steps, args.warmup, device
                    )
                    results[c].append(run_job(job))
            for c in configs:
                step = statistics.median(r["step_s"] for r in results[c])
                peak = max(r["peak_bytes"] for r in results[c])
                tokens = batch * seq * nproc / step
                row = {
                    "config": c,
                    "model": args.model,
                    "nproc": nproc,
                    "ac": ac,
                    "mp": mp,
                    "step_ms": step * 1e3,
                    "tokens_per_s": tokens,
                    "peak_gib": peak / 2**30,
                    "params": results[c][0]["params"],
                    "device": device,
                    "fused_adamw": results[c][0]["fused_adamw"],
                }
                if cuda:
                    flops = model_flops_per_token(row["params"], job) * tokens / nproc
                    row["mfu"] = flops / H200_BF16_PEAK
                rows.append(row)
            _add_ratios(rows, ac, mp)
    _print_table(rows)
    overhead = None
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "argv": sys.argv[1:] if argv is None else argv,
        "device_name": torch.cuda.get_device_name() if cuda else "cpu",
        "batch_size_per_rank": batch,
        "seq_len": seq,
        "steps": args.steps,
        "rounds": args.rounds,
    }
    try:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    except OSError as e:  # checked at the start; the table above keeps the results
        print(f"shardwise bench: error: cannot write {args.json} ({e.strerror})", file=sys.stderr)
        return 1
    if args.overhead:
        overhead = hook_overhead_us()
        print(
            "hook overhead per module per forward+backward (us, over bare): "
            + ", ".join(f"{k} {v:.1f}" for k, v in overhead.items())
        )
        Path(args.json).write_text(
            json.dumps({"meta": meta, "rows": rows, "hook_overhead_us": overhead}, indent=2)
        )
    if args.plot:
        _plot(rows, args.plot)
    return 0


def _check(args: argparse.Namespace) -> tuple[bool, int, list[str], list[str], list[str]]:
    """Every flag, before any process starts or any file is written."""
    from .models.gpt import CHECKPOINTING, SIZES

    if args.model not in SIZES:
        raise BenchUsageError(f"unknown --model {args.model!r}; choose from {sorted(SIZES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise BenchUsageError("--device cuda: no CUDA GPU is available here; use --device cpu")
    cuda = torch.cuda.is_available() if args.device is None else args.device == "cuda"
    nproc = (1 if cuda else 2) if args.nproc is None else args.nproc
    limit = torch.cuda.device_count() if cuda else 4 * (os.cpu_count() or 1)
    if not 1 <= nproc <= limit:
        where = "GPUs" if cuda else "(4 per CPU core)"
        raise BenchUsageError(f"--nproc must be from 1 to {limit} {where}, got {nproc}")
    for flag, value, least in (
        ("--steps", args.steps, 1),
        ("--warmup", args.warmup, 0),
        ("--rounds", args.rounds, 1),
        ("--batch-size", args.batch_size, 1),
        ("--seq-len", args.seq_len, 1),
    ):
        if value is not None and value < least:
            raise BenchUsageError(f"{flag} must be at least {least}, got {value}")
    acs = _choices("--ac", args.ac, CHECKPOINTING)
    mps = _choices("--mp", args.mp, ("none", "bf16"))
    if args.configs is None:
        configs = [c for c in CONFIGS if c != "bare" or nproc == 1]
    else:
        configs = _choices("--configs", args.configs, CONFIGS)
        if "bare" in configs and nproc != 1:
            raise BenchUsageError(
                f"--configs bare: the bare model runs only at --nproc 1, not {nproc}"
            )
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None:
            _check_writable(flag, Path(path))
    return cuda, nproc, configs, acs, mps


def _choices(flag: str, value: str, allowed: Any) -> list[str]:
    items = value.split(",")
    for item in items:
        if item not in allowed:  # exact: a miscased name must not run as something else
            raise BenchUsageError(
                f"unknown {flag} value {item!r}; choose from {', '.join(allowed)}"
            )
    if len(set(items)) != len(items):
        raise BenchUsageError(f"{flag} {value}: a value is listed twice")
    return items


def _check_writable(flag: str, path: Path) -> None:
    """Try it: a results file that cannot be written would be found out only at the end."""
    if path.is_dir():
        raise BenchUsageError(f"{flag} {path}: is a folder")
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise BenchUsageError(f"{flag} {path}: cannot write it ({e.strerror})") from None
    if not existed:
        path.unlink()  # bad input or not, nothing is left behind before the run


def _add_ratios(rows: list[dict[str, Any]], ac: str, mp: str) -> None:
    mine = {r["config"]: r for r in rows if r["ac"] == ac and r["mp"] == mp}
    ours = mine.get("shardwise")
    if ours is None:
        return
    for other in ("fsdp2", "bare"):
        if other in mine:
            ours[f"step_vs_{other}"] = ours["step_ms"] / mine[other]["step_ms"]
            ours[f"mem_vs_{other}"] = ours["peak_gib"] / mine[other]["peak_gib"]


def _print_table(rows: list[dict[str, Any]]) -> None:
    head = [
        "config",
        "ac",
        "mp",
        "nproc",
        "step_ms",
        "tokens_per_s",
        "peak_gib",
        "mfu",
        "step_vs_fsdp2",
        "step_vs_bare",
        "mem_vs_fsdp2",
    ]
    print(" | ".join(f"{h:>13}" for h in head))
    for r in rows:
        cells = []
        for h in head:
            v = r.get(h, "")
            cells.append(f"{v:>13.3f}" if isinstance(v, float) else f"{v!s:>13}")
        print(" | ".join(cells))


def _plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    labels = [f"{r['config']}\n{r['ac']}/{r['mp']}" for r in rows]
    axes[0].bar(labels, [r["step_ms"] for r in rows])
    axes[0].set_ylabel("median step (ms)")
    axes[1].bar(labels, [r["peak_gib"] for r in rows], color="tab:orange")
    axes[1].set_ylabel("peak memory (GiB)")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
