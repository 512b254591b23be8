"""The planner predicted and measured over fixed configurations: docs/scaling.md's tables,
and docs/scaling_predictions.md's (the scaling suite).

    python benchmarks/plan_suite.py --suite h200|h200-offload|h200-no-offload|cpu|scaling
        [--rows 0,2] [--json FILE] [--rates FILE] [--compute rates|measured] [--launches N]

Each row is a ``shardwise plan`` invocation (its flags, in ``SUITES``), read by
the command's own parser and checked as it checks them. The row is predicted
here (``shardwise_plan.plan``) and, except in the scaling suite, measured
(``shardwise_plan.measure``: the same model, policy and optimizer on real
ranks, in processes of their own, so every measured peak starts clean). A
configuration that fails (out of memory, say) is reported as such and the
rest go on. ``--json FILE`` is written after every row (a run cut short keeps
the rows it has), with its markdown table beside it (``FILE`` with ``.md``).

The h200 suites run on one GPU and predict with the ``h200`` preset unless
``--rates`` names a calibrated file; the cpu suite runs gloo ranks here and
checks memory (a CPU target's step time is indicative). With ``--compute
measured`` (GPU suites) the operators and an offloaded optimizer's host step
are timed on this machine, one draw of its speed as a launch is one: each
row is then predicted and measured in pairs (``PAIRS``), one after the other,
and the median prediction compared with the median launch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from shardwise_app.cli import plan as plan_cli
from shardwise_app.cli.common import UsageError
from shardwise_app.cli.plan_args import OneLineParser

GPT_094B = "shardwise_app.models.shapes:gpt_094b"
GPT_645B = "shardwise_app.models.shapes:gpt_645b"
LLAMA_70B = "shardwise_app.models.shapes:llama2_70b"

# One GPU: the 0.94B GPT (d 2048 x 16) at batch 4 x 2048 and the 6.45B GPT (d 4096
# x 32) at batch 2 x 2048, bf16 parameters and fp32 reduction, AdamW.
H200_SUITE = [
    ["--world-size", "1", *m, "--mp", "bf16", "--ac", ac, *off]
    for m, acs in (
        (
            ["--model", GPT_094B, "--batch-size", "4", "--seq-len", "2048"],
            ("none", "non-reentrant"),
        ),
        (["--model", GPT_645B, "--batch-size", "2", "--seq-len", "2048"], ("non-reentrant",)),
    )
    for ac in acs
    for off in ([], ["--offload"])
]
H200_OFFLOAD_SUITE = [c for c in H200_SUITE if "--offload" in c]
H200_DEVICE_SUITE = [c for c in H200_SUITE if "--offload" not in c]

# gloo ranks here: the built-in GPTs at sizes a small machine trains in seconds.
CPU_SUITE = [
    ["--model", m, "--world-size", str(w), "--batch-size", b, "--seq-len", t, "--ac", ac,
     "--hardware", "cpu", *extra]
    for m, b, t in (("tiny", "8", "128"), ("small", "4", "128"))
    for w in (2, 4)
    for ac, extra in (("none", []), ("non-reentrant", []), ("none", ["--mp", "bf16"]))
]  # fmt: skip

# Predictions only: 8 GPUs a node, HSDP over nodes.
SCALING_SUITE = [
    ["--model", m, "--batch-size", b, "--seq-len", t, "--world-size", str(w), "--hsdp", str(h),
     "--mp", "bf16", "--ac", "non-reentrant"]
    for w in (8, 64, 512)
    for m, b, t in ((GPT_645B, "2", "2048"), (LLAMA_70B, "1", "4096"))
    for h in (1, max(2, w // 8))
]  # fmt: skip

SUITES = {
    "h200": H200_SUITE,
    "h200-offload": H200_OFFLOAD_SUITE,
    "h200-no-offload": H200_DEVICE_SUITE,
    "cpu": CPU_SUITE,
    "scaling": SCALING_SUITE,
}

# Pairs of a prediction with compute timed here and one measured launch, a row: the
# machine's speed moves between minutes, and both medians then sample the same ones.
PAIRS = 3


def suite_rows(name: str, text: str) -> list[int]:
    """``--rows 0,2``: the indexes into suite ``name``, or a UsageError saying which exist."""
    last = len(SUITES[name]) - 1
    try:
        rows = [int(x) for x in text.split(",")]
    except ValueError:
        rows = []
    if not rows or any(not 0 <= r <= last for r in rows) or len(set(rows)) != len(rows):
        raise UsageError(
            f"--rows {text!r}: give distinct indexes 0 to {last} of suite {name!r}, "
            "separated by commas (e.g. --rows 0,2)"
        )
    return sorted(rows)


def predict(argv: list[str], compute: str) -> tuple[Any, Any, int]:
    """The row's plan (``shardwise plan ARGV``, as the command makes it), its parsed
    flags and its sequence length."""
    return plan_cli.planned(argv, compute=compute)


def measure_row(args: Any, p: Any, seq: int, launches: int | None) -> dict[str, Any]:
    """The row run here, as ``shardwise plan --measure`` runs it."""
    from shardwise_app.cli.plan_measure import measured_run
    from shardwise_plan.measure import measure

    return measure(measured_run(args, p, seq), launches)


def run_suite(
    name: str,
    out_json: str | None,
    extra: list[str] | None = None,
    only: list[int] | None = None,
    launches: int | None = None,
    compute: str = "rates",
) -> int:
    """``extra``: flags every row gets (``--rates FILE``); ``only``: the indexes of the
    rows to run (default all); ``launches``: how many launches each measured step time
    is the median of (default ``shardwise plan --measure``'s); with ``compute``
    "measured", the pairs a row (``PAIRS``)."""
    rows: list[dict[str, Any]] = []
    configs = [c for i, c in enumerate(SUITES[name]) if only is None or i in only]
    measuring = name != "scaling"
    paired = measuring and compute == "measured"
    pairs = (launches or PAIRS) if paired else 1
    for argv in configs:
        t0 = time.perf_counter()
        row: dict[str, Any] = {"argv": " ".join(argv)}
        plans: list[dict[str, Any]] = []
        try:
            for _ in range(pairs):
                p, args, seq = predict([*argv, *(extra or [])], compute)
                d = p.as_dict()
                if measuring:
                    d["measured"] = measure_row(args, p, seq, 1 if paired else launches)
                plans.append(d)
        except (RuntimeError, ValueError, UsageError) as e:  # out of memory, a failed rank
            row["failed"] = (str(e).strip().splitlines() or ["?"])[0][:200]
        row["wall_s"] = time.perf_counter() - t0
        if "failed" not in row:
            d = median_prediction(plans)
            if paired:
                d["measured"] = merged_measurements([p["measured"] for p in plans])
            row.update(_summary(d) if measuring else _prediction(d))
            if paired:
                row.update(_pairs(plans))
        rows.append(row)
        print(_line(row), flush=True)
        if out_json:  # after every row: a run cut short keeps the rows it measured
            _write(out_json, name, rows, only)
    print(_table(name, rows))
    return 0


def _table(name: str, rows: list[dict[str, Any]]) -> str:
    return markdown(rows) if name != "scaling" else predictions_markdown(rows)


def _write(out_json: str, name: str, rows: list[dict[str, Any]], only: list[int] | None) -> None:
    """The JSON and its markdown table, the rows so far (``"complete"`` once each
    configuration asked for has one; ``"only"``: the indexes ``--rows`` asked for)."""
    wanted = len(only) if only is not None else len(SUITES[name])
    doc = {
        "suite": name,
        "complete": len(rows) == wanted,
        **({"only": only} if only is not None else {}),
        "rows": rows,
    }
    Path(out_json).write_text(json.dumps(doc, indent=2) + "\n")
    Path(out_json).with_suffix(".md").write_text(_table(name, rows) + "\n")


def median_prediction(plans: list[dict[str, Any]]) -> dict[str, Any]:
    """The last plan with the step time, its parts and its compute record taken from the
    plan whose step is the median of ``plans`` (an odd count; for an even one the upper
    middle)."""
    middle = sorted(plans, key=lambda p: p["step_ms"])[len(plans) // 2]
    return {**plans[-1], **{k: middle[k] for k in ("step_ms", "time", "compute") if k in middle}}


def merged_measurements(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several ``plan --measure`` runs' figures as one: the step time over every launch
    (``shardwise_plan.measure.launch_figures``, as one run's launches), each rank's peak the
    median over the runs (the upper middle of an even count: a peak measured, not an
    average), each run's kept beside."""
    from shardwise_plan.measure import launch_figures

    peaks = [m["peak_bytes"] for m in runs]
    return {
        **runs[-1],
        **launch_figures(
            [s for m in runs for s in m["step_ms_per_launch"]],
            [r for m in runs for r in m["step_ms_per_rank_per_launch"]],
        ),
        "peak_bytes": [statistics.median_high(r) for r in zip(*peaks)],
        "peak_bytes_per_run": peaks,
        "frees_unrecorded": [sum(r) for r in zip(*(m["frees_unrecorded"] for m in runs))],
    }


def _pairs(plans: list[dict[str, Any]]) -> dict[str, Any]:
    """Each pair's prediction, its error against its own launch, and rank 0's peak there."""
    return {
        "predicted_step_ms_per_draw": [p["step_ms"] for p in plans],
        "step_error_pct_per_pair": [
            100.0 * (p["step_ms"] - p["measured"]["step_ms"]) / p["measured"]["step_ms"]
            for p in plans
        ],
        "measured_peak_bytes_per_run": [p["measured"]["peak_bytes"][0] for p in plans],
    }


def _summary(d: dict[str, Any]) -> dict[str, Any]:
    m = d["measured"]
    peak = m["peak_bytes"][0]
    return {
        "predicted_peak_bytes": d["peak_bytes"],
        "measured_peak_bytes": peak,
        "peak_error_pct": 100.0 * (d["peak_bytes"] - peak) / peak,
        "predicted_peak_in_step_bytes": d["peak_bytes_in_step"],
        "peak_in_step_error_pct": 100.0 * (d["peak_bytes_in_step"] - peak) / peak,
        "predicted_peak_drifting_bytes": d["peak_bytes_drifting"],
        "peak_drifting_error_pct": 100.0 * (d["peak_bytes_drifting"] - peak) / peak,
        "predicted_step_ms": d["step_ms"],
        "measured_step_ms": m["step_ms"],
        "step_error_pct": 100.0 * (d["step_ms"] - m["step_ms"]) / m["step_ms"],
        "peak_where": d["peak_where"],
        "device": m["device"],
        "predicted_compute_ms": d["time"]["compute_ms"],
        "predicted_comm_ms": d["time"]["comm_ms"],
        "compute": d["compute"],
        "measured_step_ms_per_launch": m.get("step_ms_per_launch"),
        "measured_frees_unrecorded": m.get("frees_unrecorded"),  # CPU: measure.live_peak
    }


def _prediction(d: dict[str, Any]) -> dict[str, Any]:
    return {
        "predicted_peak_bytes": d["peak_bytes"],
        "peak_where": d["peak_where"],
        "peak_by_kind": d["peak_by_kind"],
        "predicted_step_ms": d["step_ms"],
        "exposed_comm_ms": d["time"]["exposed_comm_ms"],
        "bytes_per_rank": d["collectives"]["bytes_per_rank"],
    }


def prediction_row(argv: str, r: dict[str, Any]) -> str:
    a = argv.split()
    model = a[a.index("--model") + 1].rpartition(":")[2]
    w, h = a[a.index("--world-size") + 1], a[a.index("--hsdp") + 1]
    mesh = f"HSDP {h} x {int(w) // int(h)}" if h != "1" else "FSDP"
    kinds = r["peak_by_kind"]
    state = sum(kinds.get(k, 0) for k in ("sharded_params", "grads", "optimizer_state"))
    moved = sum(r["bytes_per_rank"].values())
    return (
        f"| {model} | {w} | {mesh} | {r['predicted_peak_bytes'] / 2**30:.2f} | "
        f"{state / 2**30:.2f} | {r['peak_where']['phase']} {r['peak_where']['module']} | "
        f"{r['predicted_step_ms']:.0f} | {r['exposed_comm_ms']:.0f} | {moved / 2**30:.1f} |"
    )


def predictions_markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | GPUs | mesh | peak GiB | of it sharded state GiB | peak in | step ms "
        "| exposed comm ms | GiB moved per GPU per step |",
        "| --- | ---: | --- | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "failed" in r:
            lines.append(f"| `{r['argv']}` | failed: {r['failed']} | | | | | | | |")
        else:
            lines.append(prediction_row(r["argv"], r))
    return "\n".join(lines)


def _line(r: dict[str, Any]) -> str:
    if "failed" in r:
        return f"{r['argv']}: failed: {r['failed']}"
    if "measured_peak_bytes" not in r:
        return f"{r['argv']}: peak {r['predicted_peak_bytes'] / 2**30:.2f} GiB, step {r['predicted_step_ms']:.0f} ms"
    drifting = ""
    if r["predicted_peak_drifting_bytes"] != r["predicted_peak_in_step_bytes"]:
        drifting = (
            f"; ranks in step {r['peak_in_step_error_pct']:+.1f}%,"
            f" drifting {r['peak_drifting_error_pct']:+.1f}%"
        )
    return (
        f"{r['argv']}: peak {r['predicted_peak_bytes'] / 2**20:.1f} vs "
        f"{r['measured_peak_bytes'] / 2**20:.1f} MiB ({r['peak_error_pct']:+.1f}%{drifting}), step "
        f"{r['predicted_step_ms']:.1f} vs {r['measured_step_ms']:.1f} ms ({r['step_error_pct']:+.1f}%)"
    )


def markdown(rows: list[dict[str, Any]]) -> str:
    """The suite's table. On gloo a row's peak lies between two ends, ranks in step and
    ranks drifting apart (Plan.peak_bytes_in_step, peak_bytes_drifting), each given
    with its error; the plan's peak is their middle."""
    gloo = any(r.get("device") == "cpu" for r in rows)
    extra = (
        (
            " ranks in step MiB | error | ranks drifting MiB | error |",
            " ---: | ---: | ---: | ---: |",
        )
        if gloo
        else ("", "")
    )
    lines = [
        "| configuration | peak predicted MiB | measured MiB | error |" + extra[0]
        + " step predicted ms | measured ms | error |",
        "| --- | ---: | ---: | ---: |" + extra[1] + " ---: | ---: | ---: |",
    ]  # fmt: skip
    for r in rows:
        if "failed" in r:
            lines.append(f"| `{r['argv']}` | failed: {r['failed']} |" + " |" * (9 if gloo else 5))
            continue
        drifting = (
            f" {r['predicted_peak_in_step_bytes'] / 2**20:.2f} | {r['peak_in_step_error_pct']:+.1f}% |"
            f" {r['predicted_peak_drifting_bytes'] / 2**20:.2f} | {r['peak_drifting_error_pct']:+.1f}% |"
            if gloo
            else ""
        )
        lines.append(
            f"| `{r['argv']}` | {r['predicted_peak_bytes'] / 2**20:.2f} | "
            f"{r['measured_peak_bytes'] / 2**20:.2f} | {r['peak_error_pct']:+.1f}% |{drifting} "
            f"{r['predicted_step_ms']:.1f} | {r['measured_step_ms']:.1f} | {r['step_error_pct']:+.1f}% |"
        )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="plan_suite.py", description=__doc__.splitlines()[0])
    p.add_argument("--suite", choices=tuple(SUITES), required=True)
    p.add_argument("--rows", default=None, help="only these rows, by index from 0 (e.g. 0,2)")
    p.add_argument("--json", default=None, metavar="FILE", help="the rows (and FILE.md)")
    p.add_argument("--rates", default=None, metavar="FILE", help="`shardwise calibrate` rates")
    p.add_argument("--compute", choices=("rates", "measured"), default="rates")
    p.add_argument("--launches", type=int, default=None, metavar="N")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.launches is not None and args.launches < 1:
        raise UsageError(f"--launches must be at least 1, got {args.launches}")
    if args.suite == "scaling" and args.launches is not None:
        raise UsageError("--launches counts measured runs: the scaling suite measures none")
    if args.suite == "cpu" and args.compute == "measured":
        raise UsageError(
            "--compute measured: the cpu suite checks memory (a CPU step is indicative)"
        )
    only = suite_rows(args.suite, args.rows) if args.rows is not None else None
    if args.json:
        plan_cli.check_output(args.json, "--json")
    extra = ["--rates", args.rates] if args.rates else []
    return run_suite(args.suite, args.json, extra, only, args.launches, args.compute)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except UsageError as e:
        print(f"plan_suite.py: error: {e}", file=sys.stderr)
        sys.exit(2)
