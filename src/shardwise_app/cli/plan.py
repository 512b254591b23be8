"""``shardwise plan``: predicted per-rank memory and step time at any world size, before a run.

Why a command of its own: the question comes before any machine is had
("will it fit on 512 GPUs with this policy, and how fast?"), so it runs in
one process with no GPU, through ``shardwise_plan.plan`` (the real runtime on
a fake process group and fake tensors). ``--measure`` then runs the same
configuration for real on this machine and prints both side by side
(plan_measure.py). Every flag is checked, and the output paths tried, before
any of that work starts.
"""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .common import UsageError
from .plan_args import DefaultsFormatter, OneLineParser, check_output, parse_raf

HF_PREFIX = "hf:"
HARDWARE_NAMES = ("h100", "h200", "b200", "cpu")  # shardwise_plan.HARDWARE
# shardwise_plan.OPTIMIZERS
OPTIMIZER_NAMES = ("adamw", "adamw-foreach", "adamw-fused", "sgd", "muon", "muon-torch")
BUDGET_POLICIES = 16  # shardwise_plan.candidate_policies: 2 x 2 x 2 x 2
# With the communication policies: x 5, less hpZ with nothing resharded (2 x 8).
BUDGET_COMM_POLICIES = 64
COMM_POLICY_NAMES = ("none", "qwz", "qwz-always", "hpz", "qgz", "zeropp")  # comm.COMM_NAMES


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="shardwise plan",
        description="Predict one rank's peak memory and step time of fully sharded "
        "training, at any world size, without GPUs.",
        formatter_class=DefaultsFormatter,
        epilog="Memory is counted tensor by tensor from the real runtime; step time comes "
        "from the hardware's rates (on a CPU target it is indicative only). docs/cli.md "
        "says more.",
    )
    what = p.add_argument_group("what is trained")
    what.add_argument(
        "--model",
        default="tiny",
        help="a built-in GPT size (tiny, small, base, medium, large), hf:PATH to a "
        "transformers config folder, or module:function returning the model",
    )
    what.add_argument("--world-size", type=int, default=8, metavar="N", help="ranks (GPUs) in all")
    what.add_argument(
        "--hsdp", type=int, default=1, metavar="R",
        help="replicate degree: an R x world/R (replicate, shard) mesh",
    )  # fmt: skip
    what.add_argument(
        "--batch-size", type=int, default=4, metavar="B", help="sequences per rank per step"
    )
    what.add_argument(
        "--seq-len",
        type=int,
        default=None,
        metavar="T",
        help="tokens per sequence (default: the model's)",
    )
    what.add_argument(
        "--optimizer", choices=OPTIMIZER_NAMES, default="adamw",
        help="the optimizer stepped (adamw is torch's own pick: foreach on a GPU, the "
        "for-loop on the host; muon: shardwise.optim.Muon on the blocks' matrices, AdamW on "
        "the rest; muon-torch: torch.optim.Muon there)",
    )  # fmt: skip
    how = p.add_argument_group("the policy")
    how.add_argument("--mp", choices=("none", "bf16"), default="none", help="mixed precision")
    how.add_argument(
        "--ac", choices=("none", "non-reentrant", "reentrant"), default="none",
        help="activation checkpointing of every block",
    )  # fmt: skip
    how.add_argument(
        "--reshard-after-forward", type=parse_raf, default=True, metavar="true|false|INT",
        help="free each block's gathered parameters after its forward (INT: keep them "
        "sharded over that many ranks)",
    )  # fmt: skip
    how.add_argument(
        "--offload", action="store_true", help="CPU offload of shards, gradients, optimizer state"
    )
    how.add_argument(
        "--comm-policy", default=None, metavar="NAME",
        help=f"communication across nodes: {', '.join(COMM_POLICY_NAMES)} (qwz: int8 weight "
        "gathers in forward, qwz-always in backward too; hpz: backward gathers inside the node; qgz: gradients reduced in the node, "
        "then int8 across; zeropp: all three), or techniques joined by + (default none; "
        "with --budget, every one is tried where the world spans nodes)",
    )  # fmt: skip
    how.add_argument(
        "--budget", type=float, default=None, metavar="GIB",
        help=f"instead, plan every policy a user would pick ({BUDGET_POLICIES}: checkpointing, "
        "resharding, offload, prefetch depth, over the flags above) and print the fastest "
        f"whose peak fits GIB per rank; it takes up to {BUDGET_POLICIES} plans' time, "
        f"{BUDGET_COMM_POLICIES} where it tries the communication policies too",
    )  # fmt: skip
    where = p.add_argument_group("the machine")
    where.add_argument(
        "--hardware", choices=HARDWARE_NAMES, default=None,
        help="a datasheet's rates (default h200; cpu with --measure on a machine "
        "without a GPU: gloo ranks, step time indicative)",
    )  # fmt: skip
    where.add_argument(
        "--rates", default=None, metavar="FILE",
        help="instead of --hardware, the rates `shardwise calibrate --out FILE` measured",
    )  # fmt: skip
    where.add_argument(
        "--node-size", type=int, default=None, metavar="N",
        help="ranks a node, which splits intra- from inter-node traffic (default: the "
        "hardware's, 8 for the GPUs)",
    )  # fmt: skip
    out = p.add_argument_group("output")
    out.add_argument("--json", default=None, metavar="FILE", help="write the prediction as JSON")
    out.add_argument(
        "--plot", default=None, metavar="FILE", help="plot predicted memory over the step (PNG...)"
    )
    out.add_argument(
        "--measure", action="store_true",
        help="also run it here (world-size ranks) and print predicted against measured",
    )  # fmt: skip
    out.add_argument(
        "--launches", type=int, default=None, metavar="N",
        help="--measure: the step time is the median of N launches (default 3 on a CPU, "
        "1 on a GPU)",
    )  # fmt: skip
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
    t.add_row("optimizer", p.optimizer)
    for kind, n in p.host_bytes.items():
        t.add_row(f"host: {kind}", gib(n))
    if p.host_peak_bytes:
        t.add_row("host peak", gib(p.host_peak_bytes))
    for kind, n in p.collectives["bytes_per_rank"].items():
        t.add_row(f"{kind} moved", gib(n))
    for link, n in p.collectives.get("bytes_per_link", {}).items():
        t.add_row(f"received over {link}-node links", gib(n))
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


def build_model(name: str, seq_len: int | None) -> Any:
    """The model ``--model name`` names, built: what each rank of ``--measure`` calls
    (shardwise_plan.measure.Run's ``build``)."""
    return resolve_model(name, seq_len)[0]()


# ---- the command ----------------------------------------------------------------------------


def check_plot_format(path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    known = Figure().canvas.get_supported_filetypes()
    suffix = Path(path).suffix.lstrip(".").lower()
    if suffix not in known:
        raise UsageError(
            f"--plot {path}: matplotlib writes {', '.join(sorted(known))}; end the name with one"
        )


def check_args(args: Any) -> None:
    """Every bad flag, before any work: one line and exit code 2 (``UsageError``)."""
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
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.seq_len is not None and args.seq_len < 1:
        raise UsageError(f"--seq-len must be at least 1, got {args.seq_len}")
    if args.budget is not None and args.budget <= 0:
        raise UsageError(f"--budget must be a positive number of GiB, got {args.budget}")
    if args.node_size is not None and args.node_size < 1:
        raise UsageError(f"--node-size must be at least 1, got {args.node_size}")
    if args.comm_policy is not None:
        from shardwise_plan import parse_comm

        try:
            comm = parse_comm(args.comm_policy)
        except ValueError as e:
            raise UsageError(f"--comm-policy: {e}") from None
        if comm.active and args.measure:
            raise UsageError(
                "--measure runs the step without a communication policy (the measured run "
                "does not take one yet): leave out --measure or --comm-policy"
            )
    if args.rates and args.hardware:
        raise UsageError("--rates and --hardware both say which rates to use: give one")
    if args.launches is not None:
        if not args.measure:
            raise UsageError("--launches counts --measure's runs: add --measure (or leave it out)")
        if args.launches < 1:
            raise UsageError(f"--launches must be at least 1, got {args.launches}")
    if args.measure:
        check_ranks_here(args.world_size)
    if args.json:
        check_output(args.json, "--json")
    if args.plot:
        check_output(args.plot, "--plot")
        check_plot_format(args.plot)


def check_ranks_here(ranks: int) -> None:
    """--measure runs every rank here: a GPU each, or gloo ranks sharing the cores."""
    import torch

    from .common import CPU_OVERSUBSCRIPTION, usable_cpus

    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        if ranks > gpus:
            raise UsageError(
                f"--measure runs --world-size {ranks} ranks here, one a GPU, and there are "
                f"{gpus}: lower --world-size, or plan without --measure"
            )
    elif ranks > CPU_OVERSUBSCRIPTION * usable_cpus():
        raise UsageError(
            f"--measure runs --world-size {ranks} gloo ranks here, more than "
            f"{CPU_OVERSUBSCRIPTION} a core ({usable_cpus()} cores): lower --world-size"
        )


def hardware(args: Any) -> Any:
    from shardwise_plan import HARDWARE

    if args.rates:
        from .plan_rates import load_rates

        return load_rates(args.rates)
    return HARDWARE[args.hardware or ("cpu" if args.measure and not _cuda() else "h200")]


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    check_args(args)
    hw = hardware(args)
    build, seq = resolve_model(args.model, args.seq_len)
    from shardwise_plan import GIB, NothingFits, fastest_within, plan

    policy = policy_of(args)
    comms = budget_comms(args, hw) if args.budget is not None else []
    check_policy(args, policy, hw)
    batch = args.batch_size
    kw: dict[str, Any] = dict(
        batch_size=batch, seq_len=seq, hsdp=args.hsdp, hardware=hw, optimizer=args.optimizer
    )
    try:
        if args.budget is not None:
            best, tried = fastest_within(
                build, args.world_size, int(args.budget * GIB), base=policy, comms=comms, **kw
            )
        else:
            best, tried = plan(build, args.world_size, policy=policy, **kw), []
    except NothingFits as e:
        raise UsageError(str(e)) from None
    shard = args.world_size // args.hsdp
    title = f"shardwise plan: {args.model}, {args.world_size} ranks" + (
        f" (HSDP {args.hsdp} x {shard})" if args.hsdp > 1 else ""
    )
    print_plan(best, f"{title}, {best.policy.label()}, {best.optimizer}, on {hw.name}")
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

        out["measured"] = measure_and_compare(args, best, seq)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    if args.plot:
        plot(best, args.plot)
    return 0


def planned(argv: list[str], **extra: Any) -> tuple[Any, Any, int]:
    """``shardwise plan ARGV``'s one plan (no ``--budget``), its flags checked as the
    command checks them: (the plan, the parsed flags, the sequence length). ``extra``
    goes to ``shardwise_plan.plan`` (``compute=``). The benchmarks that tabulate plans
    build their rows by it (benchmarks/plan_suite.py, comm_policy_table.py)."""
    from shardwise_plan import plan

    args = parser().parse_args(argv)
    check_args(args)
    hw = hardware(args)
    build, seq = resolve_model(args.model, args.seq_len)
    policy = policy_of(args)
    check_policy(args, policy, hw)
    p = plan(
        build,
        args.world_size,
        batch_size=args.batch_size,
        seq_len=seq,
        policy=policy,
        hsdp=args.hsdp,
        hardware=hw,
        optimizer=args.optimizer,
        **extra,
    )
    return p, args, seq


def policy_of(args: Any) -> Any:
    """The policy the flags name (a budget search varies it)."""
    from shardwise_plan import CommPolicy, Policy, parse_comm

    comm = parse_comm(args.comm_policy or "none", args.node_size)
    if not comm.active and args.node_size is not None:
        comm = CommPolicy(node_size=args.node_size)
    return Policy(args.mp, args.ac, args.reshard_after_forward, args.offload, comm=comm)


def budget_comms(args: Any, hw: Any) -> list[Any]:
    """The communication policies a budget search tries: each, where the world spans
    nodes of a flat mesh and --comm-policy names none; else the one it names."""
    from shardwise_plan import parse_comm
    from shardwise_plan.comm import SEARCHED

    node = args.node_size or hw.ranks_per_node
    spans = args.world_size > node and args.world_size % node == 0
    if args.comm_policy is not None or args.hsdp > 1 or not spans:
        return []
    return [parse_comm(n, args.node_size) for n in SEARCHED]


def check_policy(args: Any, policy: Any, hw: Any) -> None:
    """What the policy cannot be at this world (the node size, HSDP, hpZ's resharding),
    known once the hardware is: one line, before any work."""
    from shardwise_plan.plan import check_comm

    node = policy.comm.node_size or hw.ranks_per_node
    try:
        check_comm(policy, args.world_size, args.hsdp, node)
    except ValueError as e:
        flag = f"--comm-policy {policy.comm.name()}" if policy.comm.active else "--node-size"
        raise UsageError(f"{flag}: {e}") from None


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
