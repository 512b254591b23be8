"""``shardwise bench``: the bare model, torch's FSDP2 and shardwise side by side, in one invocation.

Why side by side in one invocation: a ratio between two libraries is only
worth something when both ran the same model, data and settings on the same
machine at the same time. Each (configuration, round) runs in fresh processes,
rounds alternate (A B C A B C ...) so drift hits all alike, and every job ends
with one untimed step whose memory is broken down into parameters, gradients,
optimizer state, gathered parameters, communication buffers and activations
(``memory.py`` says how). ``--model`` takes a comma list (a size
sweep, ratios per size) and ``hf:PATH`` (a transformers causal LM from a
local config); ``--compile`` compiles every block in every configuration.

    shardwise bench --model tiny --nproc 2                     # CPU, gloo
    shardwise bench --model medium --nproc 1 --mp bf16 --ac none,non-reentrant
    shardwise bench --model small,medium,large --nproc 2 --mp bf16 --configs fsdp2,shardwise

This module is the command line (flags, checks, alternated rounds, the
results file); the parts are its neighbours in this package. Results are in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from ..cli.common import OneLineParser, cannot_create
from .jobs import Job, hook_overhead_us, run_job
from .models import HF_AC, BenchUsageError, ModelSpec, flops_per_token, resolve
from .tables import add_ratios, plot, print_memory_table, print_table

__all__ = ["BenchUsageError", "Job", "build_parser", "hook_overhead_us", "main", "run_job"]

CONFIGS = ("bare", "fsdp2", "shardwise")
H200_BF16_PEAK = 989e12  # dense bf16 FLOP/s of one H100/H200 SXM


def model_flops_per_token(n_params: int, job: Job) -> float:
    """6N for the matmuls plus causal attention (PaLM appendix B style); no recompute."""
    spec = job.spec or resolve(job.model, job.seq_len, job.device == "cuda")
    return flops_per_token(n_params, spec)


DESCRIPTION = """\
Measure the bare model, torch's FSDP2 and shardwise side by side on the same
model, data and settings: one fresh process group per (configuration, round),
rounds alternated so that machine drift hits all alike. Every row also says
where its peak memory went (parameters, gradients, optimizer state, gathered
parameters, communication buffers, activations; see docs/benchmarks.md).

examples:
  shardwise bench --model tiny --nproc 2                     # CPU, gloo
  shardwise bench --model medium --nproc 1 --mp bf16 --ac none,non-reentrant
  shardwise bench --model small,medium,large --nproc 2 --mp bf16 --configs fsdp2,shardwise
  shardwise bench --model hf:./llama-1b --nproc 2 --mp bf16 --ac non-reentrant
  shardwise bench --model medium --nproc 1 --mp bf16 --compile off,on
"""


def build_parser() -> argparse.ArgumentParser:
    from .models import bench_sizes

    p = OneLineParser(
        prog="shardwise bench",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default="tiny",
        help=f"comma list of model sizes ({', '.join(bench_sizes())}) or hf:PATH, a folder with a "
        "transformers config.json (random weights); one comparison per entry (default: tiny)",
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
    p.add_argument(
        "--mp",
        default="none",
        help="comma list of: none (fp32), bf16 (fp32 parameters, bf16 compute: autocast for the "
        "bare model, MixedPrecisionPolicy for the others), bf16-pure (the whole model, its "
        "gradients and AdamW in bf16) (default: none)",
    )
    p.add_argument(
        "--compile",
        nargs="?",
        const="on",
        default="off",
        help="compile each block's forward in every configuration (inductor on CUDA, "
        "aot_eager on CPU); a comma list of off, on runs both (default: off)",
    )
    p.add_argument(
        "--offload",
        action="store_true",
        help="CPU offload (CPUOffloadPolicy) in fsdp2 and shardwise: shards, gradients and "
        "AdamW in host memory",
    )
    p.add_argument(
        "--optimizer-in-backward",
        action="store_true",
        help="shardwise only: AdamW steps each module inside backward as its gradients "
        "arrive (shardwise.optimizer_in_backward; with --offload, on a CPU thread beside "
        "the GPU's backward)",
    )
    p.add_argument(
        "--float8",
        action="store_true",
        help="torchao float8 training of the blocks' linears in every configuration, "
        "gathered in fp8 by fsdp2 and shardwise (needs torchao and an fp8 GPU)",
    )
    p.add_argument(
        "--batch-size", type=int, default=None, help="per rank (default: 4 on a GPU, 8 on CPU)"
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="(default: the model's; hf: its max_position_embeddings, at most 2048 on a GPU, 128 on CPU)",
    )
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
        cuda, nproc, configs, acs, mps, compiles, specs = _check(args)
    except BenchUsageError as e:
        print(f"shardwise bench: error: {e}", file=sys.stderr)
        return 2
    batch = args.batch_size or (4 if cuda else 8)
    device = "cuda" if cuda else "cpu"
    rows: list[dict[str, Any]] = []
    seqs = {s.name: s.seq_len for s in specs}
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "argv": sys.argv[1:] if argv is None else argv,
        "device_name": torch.cuda.get_device_name() if cuda else "cpu",
        "batch_size_per_rank": batch,
        "seq_len": specs[0].seq_len if len(set(seqs.values())) == 1 else seqs,
        "models": [s.name for s in specs],
        "steps": args.steps,
        "rounds": args.rounds,
    }
    failed = False
    for spec in specs:
        for ac in acs:
            for mp in mps:
                for compiled in compiles:
                    jobs = [
                        Job(
                            c,
                            spec.name,
                            nproc,
                            ac,
                            mp,
                            batch,
                            spec.seq_len,
                            args.steps,
                            args.warmup,
                            device,
                            compiled,
                            spec,
                            args.offload,
                            args.float8,
                            args.optimizer_in_backward and c == "shardwise",
                        )
                        for c in configs
                    ]
                    new = _run_group(jobs, args.rounds)
                    failed = failed or any("error" in r for r in new)
                    rows += new
        add_ratios([r for r in rows if "error" not in r])
        # After each model: a long sweep that is stopped keeps what it measured.
        if not _write(args.json, {"meta": meta, "rows": rows}):
            return 1
    ok = [r for r in rows if "error" not in r]
    print_table(rows)
    if ok:
        print_memory_table(ok)
    if args.overhead:
        overhead = hook_overhead_us()
        print(
            "hook overhead per module per forward+backward (us, over bare): "
            + ", ".join(f"{k} {v:.1f}" for k, v in overhead.items())
        )
        if not _write(args.json, {"meta": meta, "rows": rows, "hook_overhead_us": overhead}):
            return 1
    if args.plot and ok:
        plot(ok, args.plot)
    return 1 if failed else 0


def _run_group(jobs: list[Job], rounds: int) -> list[dict[str, Any]]:
    """Alternated rounds of one workload; one row per configuration."""
    results: dict[str, list[dict[str, Any]]] = {j.config: [] for j in jobs}
    errors: dict[str, str] = {}
    for _ in range(rounds):
        for job in jobs:
            if job.config in errors:
                continue  # an out-of-memory does not go away in the next round
            try:
                results[job.config].append(run_job(job))
            except Exception as e:  # noqa: BLE001 - one failed job must not lose the sweep
                line = str(e).strip().splitlines()
                errors[job.config] = line[0] if line else type(e).__name__
                print(
                    f"shardwise bench: {job.config} {job.model} ac={job.ac} mp={job.mp} "
                    f"compiled={job.compile} failed: {errors[job.config]}",
                    file=sys.stderr,
                )
    rows = []
    for job in jobs:
        spec = job.spec
        assert spec is not None
        row: dict[str, Any] = {
            "config": job.config,
            "model": job.model,
            "model_type": spec.model_type,
            "nproc": job.nproc,
            "ac": job.ac,
            "mp": job.mp,
            "compiled": job.compile,
            "offload": job.offload,
            "float8": job.float8,
            "optimizer_in_backward": job.optimizer_in_backward,
            "batch_size": job.batch_size,
            "seq_len": job.seq_len,
            "device": job.device,
        }
        if job.config in errors:
            rows.append({**row, "error": errors[job.config]})
            continue
        res = results[job.config]
        step = statistics.median(r["step_s"] for r in res)
        worst = max(res, key=lambda r: r["peak_bytes"])
        tokens = job.batch_size * job.seq_len * job.nproc / step
        row.update(
            step_ms=step * 1e3,
            tokens_per_s=tokens,
            peak_gib=worst["peak_bytes"] / 2**30,
            params=res[0]["params"],
            fused_adamw=res[0]["fused_adamw"],
            loss=res[-1]["loss"],
            gather_mib_per_step=res[0].get("gather_bytes_per_step", 0) / 2**20,
        )
        if job.compile:
            row["dynamo_graphs"] = res[0]["dynamo_graphs"]
        timeline = res[0].get("timeline")
        if timeline:  # shardwise's rows: one traced step after the timed ones
            # Against the traced step's own time: tracing costs a little.
            row["exposed_comm_ms"] = timeline["exposed_comm_s"] * 1e3
            row["traced_step_ms"] = timeline["traced_step_s"] * 1e3
            row["exposed_comm_pct"] = 100 * timeline["exposed_comm_s"] / timeline["traced_step_s"]
            row["prefetch_hit_rate"] = timeline["prefetch_hit_rate"]
            # The largest exposed waits: "<collective> <module>" -> ms.
            row["exposed_by_ms"] = {k: v * 1e3 for k, v in timeline["exposed_by_s"].items()}
        if job.device == "cuda":
            row["peak_reserved_gib"] = worst["peak_reserved_bytes"] / 2**30
            row["mfu"] = flops_per_token(row["params"], spec) * tokens / job.nproc / H200_BF16_PEAK
        row["memory"] = worst["memory"]
        rows.append(row)
    return rows


def _write(path: str, payload: dict[str, Any]) -> bool:
    try:
        Path(path).write_text(json.dumps(payload, indent=2))
    except OSError as e:  # checked at the start; the table keeps the results
        print(f"shardwise bench: error: cannot write {path} ({e.strerror})", file=sys.stderr)
        return False
    return True


def _check(
    args: argparse.Namespace,
) -> tuple[bool, int, list[str], list[str], list[str], list[bool], list[ModelSpec]]:
    """Every flag, before any process starts or any file is written."""
    from ..models.gpt import CHECKPOINTING

    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None:
            _check_writable(flag, Path(path))
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
    if args.float8:
        try:
            import torchao.float8  # noqa: F401
        except ImportError:
            raise BenchUsageError("--float8 needs torchao (pip install torchao)") from None
        if not cuda:
            raise BenchUsageError("--float8: float8 matmuls need a CUDA GPU; drop it on CPU")
    acs = _choices("--ac", args.ac, CHECKPOINTING)
    mps = _choices("--mp", args.mp, ("none", "bf16", "bf16-pure"))
    compiles = [c == "on" for c in _choices("--compile", args.compile, ("off", "on"))]
    if args.configs is None:
        configs = [c for c in CONFIGS if c != "bare" or nproc == 1]
    else:
        configs = _choices("--configs", args.configs, CONFIGS)
        if "bare" in configs and nproc != 1:
            raise BenchUsageError(
                f"--configs bare: the bare model runs only at --nproc 1, not {nproc}"
            )
    names = args.model.split(",")
    if len(set(names)) != len(names):
        raise BenchUsageError(f"--model {args.model}: a model is listed twice")
    # GPT sizes first: a typo in the list is reported before transformers is imported.
    hf = [n for n in names if n.startswith("hf:")]
    for name in names:
        if name not in hf:
            resolve(name, args.seq_len, cuda)
    if hf:
        unsupported = [a for a in acs if a not in HF_AC]
        if unsupported:
            raise BenchUsageError(
                f"--ac {unsupported[0]}: an hf: model checkpoints through its own "
                f"activation/gradient_checkpointing_enable, which offers {', '.join(HF_AC)}"
            )
    specs = [resolve(name, args.seq_len, cuda) for name in names]
    return cuda, nproc, configs, acs, mps, compiles, specs


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
    folder = path.parent
    if not folder.is_dir():  # not made for it: a typo in a folder's name is told, not obeyed
        why = "is a file, not a folder" if folder.exists() else "does not exist"
        raise BenchUsageError(f"{flag} {path}: cannot write it ({folder} {why})")
    refused = cannot_create(path)  # bad input or not, nothing is left behind before the run
    if refused is not None:
        raise BenchUsageError(f"{flag} {path}: cannot write it ({refused})")


if __name__ == "__main__":
    sys.exit(main())
