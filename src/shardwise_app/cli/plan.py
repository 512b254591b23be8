"""``shardwise plan``: predicted per-rank memory and step time at any world size, before a run.

Why a command of its own: the question comes before any machine is had
("will it fit on 512 GPUs with this policy, and how fast?"), so it runs in
one process with no GPU, through ``shardwise.plan`` (the real runtime on a
fake process group and fake tensors). ``--measure`` then runs the same
configuration for real on this machine and prints both side by side
(plan_measure.py).
"""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .main import UsageError, usable_cpus

HF_PREFIX = "hf:"
SUITE_NAMES = ("h200", "h200-offload", "h200-no-offload", "cpu", "scaling")  # plan_suite.SUITES


def parse_raf(text: str) -> bool | int:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected true, false or an int, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"an int must be at least 1, got {n}")
    return n


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shardwise plan",
        description="Predict per-rank peak memory and step time of fully sharded training.",
    )
    p.add_argument(
        "--model",
        default="tiny",
        help="a built-in GPT size (tiny, small, base, medium, large), hf:PATH to a "
        "transformers config folder, or module:function returning the model",
    )
    p.add_argument("--world-size", type=int, default=8, help="ranks (GPUs) in all")
    p.add_argument(
        "--hsdp",
        type=int,
        default=1,
        metavar="R",
        help="replicate degree: an R x world/R (replicate, shard) mesh",
    )
    p.add_argument("--mp", choices=("none", "bf16"), default="none", help="mixed precision")
    p.add_argument(
        "--ac",
        choices=("none", "non-reentrant", "reentrant"),
        default="none",
        help="activation checkpointing of every block",
    )
    p.add_argument(
        "--reshard-after-forward", type=parse_raf, default=True, metavar="true|false|INT"
    )
    p.add_argument("--offload", action="store_true", help="CPU offload of shards, grads, state")
    p.add_argument("--prefetch", type=int, default=1, help="modules gathered ahead")
    p.add_argument(
        "--batch-size", type=int, default=None, help="sequences per rank per step (default 4)"
    )
    p.add_argument(
        "--seq-len", type=int, default=None, help="tokens per sequence (default: the model's)"
    )
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="GIB",
        help="per-rank memory: print the fastest predicted policy that fits",
    )
    p.add_argument(
        "--hardware",
        choices=("h200", "cpu"),
        default=None,
        help="the rates predicted for (default h200; cpu with --measure on a CPU)",
    )
    p.add_argument(
        "--intra-bw",
        type=float,
        default=None,
        metavar="GB/S",
        help="bus bandwidth inside a node (h200: 360)",
    )
    p.add_argument(
        "--inter-bw",
        type=float,
        default=None,
        metavar="GB/S",
        help="bus bandwidth across nodes (h200: 40, 400 Gb/s InfiniBand)",
    )
    p.add_argument("--ranks-per-node", type=int, default=None, help="GPUs per node (h200: 8)")
    p.add_argument("--matmul-tflops", type=float, default=None, help="achieved matmul TFLOP/s")
    p.add_argument(
        "--compute",
        choices=("rates", "measured"),
        default=None,
        help="time each operator from its FLOPs and bytes at the rates (default), or run "
        "each distinct operator on this machine's device (the target must be this device; "
        "a CPU target also runs one rank's step here under the fake process group; the "
        "default for --suite cpu)",
    )
    p.add_argument(
        "--rates",
        default=None,
        metavar="FILE",
        help="predict with the rates in FILE (written by --calibrate) instead of --hardware",
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine's rates (--nproc ranks at once) and print them; "
        "--json FILE writes them for --rates",
    )
    p.add_argument("--json", default=None, metavar="FILE", help="write the prediction as JSON")
    p.add_argument(
        "--plot", default=None, metavar="FILE", help="plot predicted memory over the step"
    )
    p.add_argument(
        "--measure",
        action="store_true",
        help="also run it for real here and print predicted vs measured",
    )
    p.add_argument(
        "--nproc", type=int, default=None, help="--measure: processes (default: the world size)"
    )
    p.add_argument(
        "--launches",
        type=int,
        default=None,
        help="--measure: the step time is the median of N launches, each in processes "
        "of its own (default 3 on a CPU, 1 on a GPU); --suite with --compute measured: "
        "N predict-then-measure pairs a row (default 5 on the cpu suite, 3 otherwise)",
    )
    p.add_argument(
        "--suite",
        choices=SUITE_NAMES,
        default=None,
        help="predict and measure a fixed set of configurations, each in processes of "
        "its own; --json FILE (and FILE with .md) gets the table",
    )
    p.add_argument(
        "--rows",
        default=None,
        help="--suite: only these of its configurations, by index from 0 (e.g. 0,2)",
    )
    p.add_argument("--measure-out", default=None, help=argparse.SUPPRESS)  # a measuring worker
    p.add_argument(  # what a measuring launch measures: peak, time or both
        "--measure-time", default=None, choices=("peak", "time", "both"), help=argparse.SUPPRESS
    )
    p.add_argument("--calibrate-out", default=None, help=argparse.SUPPRESS)  # a calibrating one
    return p


# ---- the model ------------------------------------------------------------------------------


def resolve_model(name: str, seq_len: int | None) -> tuple[Callable[[], Any], int]:
    """A builder for ``--model`` and the sequence length to use, or UsageError."""
    if name.startswith(HF_PREFIX):
        return _hf_builder(name[len(HF_PREFIX) :], seq_len)
    if ":" in name:
        mod, _, fn_name = name.partition(":")
        try:
            fn = getattr(importlib.import_module(mod), fn_name)
        except (ImportError, AttributeError) as e:
            raise UsageError(f"--model {name}: cannot import {fn_name} from {mod} ({e})") from None
        if not callable(fn):
            raise UsageError(f"--model {name}: {fn_name} is not callable")
        return fn, seq_len or 128
    from ..models.gpt import GPT, SIZES

    if name not in SIZES:
        raise UsageError(
            f"unknown --model {name!r}; choose from {', '.join(SIZES)}, hf:PATH or module:function"
        )
    cfg = SIZES[name].with_seq_len(seq_len)
    return (lambda: GPT(cfg)), cfg.seq_len


def _hf_builder(path: str, seq_len: int | None) -> tuple[Callable[[], Any], int]:
    from ..bench.models import BenchUsageError, hf_config

    try:
        cfg = hf_config(path)
    except BenchUsageError as e:
        raise UsageError(str(e)) from None
    import transformers

    cfg.use_cache = False
    seq = seq_len or min(getattr(cfg, "max_position_embeddings", 2048) or 2048, 2048)

    def build() -> Any:
        import torch

        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
        return model.to(torch.float32).train()

    return build, seq


# ---- output ---------------------------------------------------------------------------------


def gib(n: float) -> str:
    return f"{n / (1 << 30):.3f}"


def print_plan(p: Any, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    t = Table(title=title)
    t.add_column("per rank")
    t.add_column("GiB", justify="right")
    for kind, n in sorted(p.peak_by_kind.items(), key=lambda kv: -kv[1]):
        t.add_row(kind, gib(n))
    t.add_row("[bold]peak[/bold]", f"[bold]{gib(p.peak_bytes)}[/bold]")
    if p.peak_is_a_range:
        # gloo: which of its buffers are live at the peak is the ranks' timing; the
        # peak above is the middle of these two
        t.add_row("peak if the ranks keep in step", gib(p.peak_bytes_in_step))
        t.add_row("peak if the ranks drift apart", gib(p.peak_bytes_drifting))
    t.add_row("reached in", f"{p.peak_phase} {p.peak_module}".strip())
    for kind, n in p.host_bytes.items():
        t.add_row(f"host: {kind}", gib(n))
    if p.host_peak_bytes:
        t.add_row("host peak", gib(p.host_peak_bytes))
    for kind, n in p.collectives["bytes_per_rank"].items():
        t.add_row(f"{kind} moved", gib(n))
    tm = p.time
    t.add_row("compute ms", f"{tm.compute_s * 1e3:.2f}")
    t.add_row("communication ms", f"{tm.comm_s * 1e3:.2f}")
    t.add_row("exposed communication ms", f"{tm.exposed_comm_s * 1e3:.2f}")
    t.add_row("[bold]step ms[/bold]", f"[bold]{p.step_ms:.2f}[/bold]")
    console.print(t)


def plot_unit(p: Any) -> tuple[str, int]:
    """GiB, or MiB for a plan whose peak is under one (a tiny model's figures would
    all read 0.00x GiB)."""
    return ("GiB", 1 << 30) if p.peak_bytes_drifting >= 1 << 30 else ("MiB", 1 << 20)


def plot_title(p: Any) -> str:
    """The memory plot's title: on gloo it names the curve's own peak (ranks in step)
    beside the predicted one, which the curve does not reach."""
    unit, size = plot_unit(p)
    head = f"{p.policy.label()}, {p.world_size} ranks: peak {p.peak_bytes / size:.3f} {unit}"
    if not p.peak_is_a_range:
        return head
    return f"{head}\n(curve: ranks in step, peak {p.peak_bytes_in_step / size:.3f} {unit})"


def plot(p: Any, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit, size = plot_unit(p)
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = [c[0] for c in p.memory_curve]
    ys = [c[1] / size for c in p.memory_curve]
    ax.plot(xs, ys, lw=1)
    for phase, color in (("backward", "tab:orange"), ("optimizer", "tab:green")):
        inside = [x for x, _, ph in p.memory_curve if ph == phase]
        if inside:
            ax.axvspan(min(inside), max(inside), color=color, alpha=0.1, label=phase)
    if p.peak_is_a_range:
        # gloo: the curve is the ranks-in-step one; the predicted peak lies between it
        # and the drifting end, so both are drawn where the curve cannot reach them
        for n, style, name in (
            (p.peak_bytes, "--", "predicted peak"),
            (p.peak_bytes_drifting, ":", "ranks drifting apart"),
        ):
            ax.axhline(n / size, color="tab:red", ls=style, lw=1, label=name)
    ax.set_xlabel("predicted time in the step (ms)")
    ax.set_ylabel(f"live memory per rank ({unit})")
    ax.set_title(plot_title(p))
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---- the command ----------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.compute is None:
        args.compute = "measured" if args.suite == "cpu" else "rates"
    if args.launches is not None and args.launches < 1:
        raise UsageError(f"--launches must be at least 1, got {args.launches}")
    if args.suite == "scaling" and args.launches is not None:
        raise UsageError("--launches counts measured runs: the scaling suite measures none")
    if args.suite:
        from .plan_suite import run_suite, suite_rows

        extra = ["--rates", args.rates] if args.rates else []
        rows = suite_rows(args.suite, args.rows) if args.rows is not None else None
        extra += ["--compute", args.compute]
        return run_suite(args.suite, args.json, extra, rows, args.launches)
    if args.rows is not None:
        raise UsageError("--rows picks configurations of a --suite: give --suite NAME too")
    if args.launches is not None and not args.measure:
        raise UsageError("--launches counts --measure's runs: add --measure (or leave it out)")
    if args.calibrate or args.calibrate_out:
        from .plan_rates import calibrate_worker, is_calibrating_worker, run_calibration

        return calibrate_worker(args) if is_calibrating_worker(args) else run_calibration(args)
    from shardwise_plan import GIB, HARDWARE, NothingFits, Policy, fastest_within, plan

    if args.world_size < 1:
        raise UsageError(f"--world-size must be at least 1, got {args.world_size}")
    if args.hsdp < 1 or args.world_size % args.hsdp:
        raise UsageError(
            f"--hsdp {args.hsdp} does not divide --world-size {args.world_size}: the mesh is "
            "R x world/R, so pick a divisor"
        )
    raf = args.reshard_after_forward
    shard = args.world_size // args.hsdp
    if not isinstance(raf, bool) and shard % raf:
        raise UsageError(
            f"--reshard-after-forward {raf} must divide the shard group's size {shard}"
        )
    if args.batch_size is not None and args.batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.budget is not None and args.budget <= 0:
        raise UsageError(f"--budget must be a positive number of GiB, got {args.budget}")
    if args.prefetch < 0:
        raise UsageError(f"--prefetch must be at least 0, got {args.prefetch}")
    build, seq = resolve_model(args.model, args.seq_len)
    batch = args.batch_size or 4
    from .plan_measure import is_measuring_worker, run_worker

    if is_measuring_worker(args):
        return run_worker(args, build)
    policy = Policy(args.mp, args.ac, raf, args.offload, args.prefetch)
    if args.rates and args.hardware:
        raise UsageError("--rates and --hardware both say which rates to use: give one")
    if args.rates:
        from .plan_rates import load_rates

        base = load_rates(args.rates)
    else:
        base = HARDWARE[args.hardware or ("cpu" if args.measure and not _cuda() else "h200")]
    hw = base.with_overrides(
        intra_bw=args.intra_bw and args.intra_bw * 1e9,
        inter_bw=args.inter_bw and args.inter_bw * 1e9,
        ranks_per_node=args.ranks_per_node,
        matmul_flops=args.matmul_tflops and args.matmul_tflops * 1e12,
    )
    slowdown = 1.0
    # The ranks run on this machine's cores: measured here, or timed here (measured
    # compute times a CPU target on this CPU), with or without --measure.
    here = hw.device == "cpu" and (args.measure or args.compute == "measured")
    if here:
        hw, slowdown = _shared_cores(hw, args.world_size)
    if args.compute == "measured":
        import torch

        from shardwise_plan.plan import check_measurable

        try:
            check_measurable(hw)
        except ValueError as e:
            raise UsageError(f"--compute measured: {e}") from None
        if here:  # the threads each rank gets
            torch.set_num_threads(max(1, usable_cpus() // args.world_size))
    kw: dict[str, Any] = dict(
        batch_size=batch,
        seq_len=seq,
        hsdp=args.hsdp,
        hardware=hw,
        compute=args.compute,
        slowdown=slowdown,
    )
    try:
        if args.budget is not None:
            best, tried = fastest_within(
                build, args.world_size, int(args.budget * GIB), base=policy, **kw
            )
        else:
            best, tried = plan(build, args.world_size, policy=policy, **kw), []
    except NothingFits as e:
        raise UsageError(str(e)) from None
    title = f"shardwise plan: {args.model}, {args.world_size} ranks" + (
        f" (HSDP {args.hsdp} x {shard})" if args.hsdp > 1 else ""
    )
    print_plan(best, f"{title}, {best.policy.label()}, on {hw.name}")
    if tried:
        _print_tried(tried, int(args.budget * GIB))
    out: dict[str, Any] = {"model": args.model, **best.as_dict()}
    if tried:
        out["tried"] = [
            {
                "policy": t.policy.as_dict(),
                "peak_bytes": t.peak_bytes,
                "peak_bytes_drifting": t.peak_bytes_drifting,
                "step_ms": t.step_ms,
            }
            for t in tried
        ]
    if args.measure:
        from .plan_measure import measure_and_compare

        out["measured"] = measure_and_compare(args, best, seq, batch)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    if args.plot:
        plot(best, args.plot)
    return 0


def _shared_cores(hw: Any, ranks: int) -> tuple[Any, float]:
    """The CPU's rates were calibrated with one rank per core (two on two): more
    ranks than cores share them, and each rank computes that much slower. Returns
    the rates scaled so, and the slowdown (for operators measured here)."""
    from dataclasses import replace

    share = min(1.0, usable_cpus() / ranks)
    if share == 1.0:
        return hw, 1.0
    return replace(
        hw,
        matmul_flops=hw.matmul_flops * share,
        matmul_flops_fp32=hw.matmul_flops_fp32 * share,
        mem_bw=hw.mem_bw * share,
        host_mem_bw=hw.host_mem_bw * share,
        host_adamw_bw=hw.host_adamw_bw * share,
        op_overhead=hw.op_overhead / share,
        view_overhead=hw.view_overhead / share,
        dtensor_overhead=hw.dtensor_overhead / share,
        source=hw.source + f"; {ranks} ranks on {usable_cpus()} cores: rates x {share:.2f}",
    ), 1.0 / share


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _print_tried(tried: list[Any], budget: int) -> None:
    from rich.console import Console
    from rich.table import Table

    # A policy fits by the most a launch may reach (fastest_within); on gloo that is
    # above the plan's peak, and the table shows it beside.
    gloo = any(p.peak_is_a_range for p in tried)
    t = Table(title="policies tried (fastest that fits first)")
    for c in ("policy", "peak GiB", *(["at most GiB"] if gloo else []), "step ms", "fits"):
        t.add_column(c)
    for p in sorted(tried, key=lambda p: (p.peak_bytes_drifting > budget, p.time.step_s)):
        t.add_row(
            p.policy.label(),
            gib(p.peak_bytes),
            *([gib(p.peak_bytes_drifting)] if gloo else []),
            f"{p.step_ms:.2f}",
            "yes" if p.peak_bytes_drifting <= budget else "no",
        )
    Console().print(t)
