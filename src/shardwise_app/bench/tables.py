"""Rows into ratios, tables and a chart.

Why ratios are computed per (model, checkpointing, precision, compiled) group:
shardwise is only ever compared with FSDP2 and the bare model on the same
workload, so a size sweep reads as one ratio per size.
"""

from __future__ import annotations

from typing import Any

from .memory import CPU_PARTS, CUDA_PARTS
from .models import short_name

GROUP = ("model", "ac", "mp", "compiled")
GIB = 2**30


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """``step_vs_*`` and ``mem_vs_*`` on each shardwise row, against its own group."""
    groups: dict[tuple[Any, ...], dict[str, dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in GROUP), {})[r["config"]] = r
    for mine in groups.values():
        ours = mine.get("shardwise")
        if ours is None:
            continue
        for other in ("fsdp2", "bare"):
            if other in mine:
                ours[f"step_vs_{other}"] = ours["step_ms"] / mine[other]["step_ms"]
                ours[f"mem_vs_{other}"] = ours["peak_gib"] / mine[other]["peak_gib"]


def _cells(values: list[Any], width: int = 13) -> str:
    out = []
    for v in values:
        out.append(f"{v:>{width}.3f}" if isinstance(v, float) else f"{v!s:>{width}}")
    return " | ".join(out)


def _by_model(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r["model"], []).append(r)
    return groups


def print_table(rows: list[dict[str, Any]]) -> None:
    head = [
        "config",
        "ac",
        "mp",
        "compiled",
        "nproc",
        "step_ms",
        "tokens_per_s",
        "peak_gib",
        "mfu",
        "step_vs_fsdp2",
        "step_vs_bare",
        "mem_vs_fsdp2",
        "exposed_comm_pct",
    ]
    for model, group in _by_model(rows).items():
        sizes = [f"{r['params'] / 1e6:.2f}M parameters, " for r in group if "params" in r]
        print(f"model {model}: {sizes[0] if sizes else ''}seq {group[0]['seq_len']}")
        print(_cells(head))
        for r in group:
            if "error" in r:
                print(_cells([r[h] for h in head[:5]]) + f" | failed: {r['error']}")
            else:
                print(_cells([r.get(h, "") for h in head]))


def print_memory_table(rows: list[dict[str, Any]]) -> None:
    """Where the peak went, in GiB, per row: the breakdown step of the rank that peaked highest."""
    cuda = rows[0]["device"] == "cuda"
    parts = list(CUDA_PARTS if cuda else CPU_PARTS)
    short = {
        "optimizer_state": "optimizer",
        "gathered_params": "gathered",
        "comm_buffers": "comm",
        "backward_temporaries": "bwd_temps",
        "process_baseline": "process",
    }
    head = ["model", "config", "ac", "mp", "compiled", "peak", *[short.get(p, p) for p in parts]]
    if cuda:
        head += ["unattributed", "peak_during"]
    print()
    print(f"memory at the peak (GiB): {rows[0]['memory']['method']}")
    print(_cells(head, 11))
    for r in rows:
        m = r["memory"]
        cells: list[Any] = [short_name(r["model"]), r["config"], r["ac"], r["mp"], r["compiled"]]
        cells += [m["peak_bytes"] / GIB, *[m["parts"][p] / GIB for p in parts]]
        if cuda:
            cells += [m["unattributed_bytes"] / GIB, m["peak_during"]]
        print(_cells(cells, 11))


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    several = len({r["model"] for r in rows}) > 1
    labels = [
        (f"{short_name(r['model'])}\n" if several else "")
        + f"{r['config']}\n{r['ac']}/{r['mp']}"
        + ("/compiled" if r["compiled"] else "")
        for r in rows
    ]
    x = range(len(rows))
    axes[0].bar(x, [r["step_ms"] for r in rows])
    axes[0].set_ylabel("median step (ms)")
    axes[1].bar(x, [r["peak_gib"] for r in rows], color="tab:orange")
    axes[1].set_ylabel("peak memory (GiB)")
    parts = CUDA_PARTS if rows[0]["device"] == "cuda" else CPU_PARTS
    bottom = [0.0] * len(rows)
    for part in parts:
        heights = [max(0.0, r["memory"]["parts"][part] / GIB) for r in rows]
        axes[2].bar(x, heights, bottom=bottom, label=part)
        bottom = [b + h for b, h in zip(bottom, heights)]
    axes[2].set_ylabel("at the breakdown step's peak (GiB)")
    axes[2].legend(fontsize=6)
    for ax in axes:
        ax.set_xticks(list(x), labels)
        ax.tick_params(axis="x", labelsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
