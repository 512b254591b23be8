"""``shardwise plan --suite NAME --json FILE`` (h200, h200-offload, h200-no-offload, cpu, scaling): predicted vs measured over a set of configurations.

Why one command: the planner's error table in docs/scaling.md must be
reproducible by one invocation. Each configuration runs as ``shardwise
plan ... --measure`` processes of its own (their workers are processes of
their own too), so every measured peak starts clean. A configuration that
fails (out of memory, say) is reported as such and the rest go on. Where
the compute is timed on this machine (``--compute measured``), each row is
predicted and measured in pairs, one after the other (``PAIRS``), and the
medians compared. ``--rows`` runs some of a suite's configurations (a
command's time limit).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GPT_094B = "shardwise_app.models.shapes:gpt_094b"
GPT_645B = "shardwise_app.models.shapes:gpt_645b"

# One H200: 0.94B GPT (d 2048 x 16) batch 4 x 2048 and 6.45B GPT (d 4096 x 32)
# batch 2 x 2048, bf16 parameters and fp32 reduction, AdamW.
H200_SUITE = [
    [*m, "--mp", "bf16", "--ac", ac, *off]
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
H200_SUITE = [["--world-size", "1", *c] for c in H200_SUITE]

# This CPU, gloo ranks: the built-in GPTs at sizes a 2-core machine trains in seconds.
CPU_SUITE = [
    ["--model", m, "--world-size", str(w), "--batch-size", b, "--seq-len", t, "--ac", ac, *extra]
    for m, b, t in (("tiny", "8", "128"), ("small", "4", "128"))
    for w in (2, 4)
    for ac, extra in (("none", []), ("non-reentrant", []), ("none", ["--mp", "bf16"]))
]

# docs/scaling.md's predictions (no measurement): 8 GPUs a node, HSDP over nodes.
LLAMA_70B = "shardwise_app.models.shapes:llama2_70b"
SCALING_SUITE = [
    ["--model", m, "--batch-size", b, "--seq-len", t, "--world-size", str(w), "--hsdp", str(h),
     "--mp", "bf16", "--ac", "non-reentrant"]
    for w in (8, 64, 512)
    for m, b, t in ((GPT_645B, "2", "2048"), (LLAMA_70B, "1", "4096"))
    for h in (1, max(2, w // 8))
]  # fmt: skip

# Its offloaded rows only (host memory and the host's AdamW: what the planner's
# offload model was fixed for after the 2026-12-02 measurement).
H200_OFFLOAD_SUITE = [c for c in H200_SUITE if "--offload" in c]
H200_DEVICE_SUITE = [c for c in H200_SUITE if "--offload" not in c]  # fits in 10 minutes

SUITES = {
    "h200": H200_SUITE,
    "h200-offload": H200_OFFLOAD_SUITE,
    "h200-no-offload": H200_DEVICE_SUITE,
    "cpu": CPU_SUITE,
    "scaling": SCALING_SUITE,
}


def suite_rows(name: str, text: str) -> list[int]:
    """``--rows 0,2``: the indexes into suite ``name``, or a UsageError saying which exist."""
    from .main import UsageError

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


def run_suite(
    name: str,
    out_json: str | None,
    extra: list[str] | None = None,
    only: list[int] | None = None,
    launches: int | None = None,
) -> int:
    """``extra``: flags every configuration gets (``--rates FILE``, ``--compute``);
    ``only``: the indexes of the configurations to run (default all); ``launches``:
    how many launches each measured step time is the median of (default ``plan
    --measure``'s; with compute timed here, the pairs: ``PAIRS``, ``CPU_PAIRS``).

    The CPU suite without ``--rates`` calibrates this machine first, in the same
    invocation (``calibrated_rates``): a CPU's rates are its own, and a default
    measured on another machine says nothing here."""
    rows: list[dict[str, Any]] = []
    env = dict(os.environ)
    extra = list(extra or [])
    rates: dict[int, str] = {}
    used: dict[int, Any] = {}  # the rates calibrated here, per world size
    configs = [c for i, c in enumerate(SUITES[name]) if only is None or i in only]
    with tempfile.TemporaryDirectory() as tmp:
        if name == "cpu" and "--rates" not in extra:
            rates = calibrated_rates(Path(tmp), sorted({_world(a) for a in configs}))
            used = {w: json.loads(Path(f).read_text()) for w, f in rates.items()}
        measure = [] if name == "scaling" else ["--measure"]
        if measure and _flag(extra, "--compute") == "measured":
            # Compute timed here is one draw of this machine's speed, and so is a launch:
            # predict, measure one launch, and again (``PAIRS``), each in a process of its
            # own, so that both medians sample the same minutes.
            pairs = launches or (CPU_PAIRS if name == "cpu" else PAIRS)
            runs = [[*measure, "--launches", "1"]] * pairs
        else:
            runs = [[*measure, *(["--launches", str(launches)] if measure and launches else [])]]
        for i, argv in enumerate(configs):
            own = ["--rates", rates[_world(argv)]] if rates else []
            cmd = [sys.executable, "-m", "shardwise", "plan", *argv, *extra, *own]
            t0 = time.perf_counter()
            row: dict[str, Any] = {"argv": " ".join(argv)}
            plans: list[dict[str, Any]] = []
            for k, flags in enumerate(runs):
                out = Path(tmp) / f"{i}_{k}.json"
                proc = subprocess.run(
                    [*cmd, *flags, "--json", str(out)], env=env, capture_output=True, text=True
                )
                if proc.returncode or not out.is_file():
                    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
                    row["failed"] = tail[0][:200]
                    break
                plans.append(json.loads(out.read_text()))
            row["wall_s"] = time.perf_counter() - t0
            if "failed" not in row:
                d = median_prediction(plans)
                paired = len(plans) > 1  # each plan measured one launch
                if paired:
                    d["measured"] = merged_measurements([p["measured"] for p in plans])
                row.update(_summary(d) if measure else _prediction(d))
                if paired:
                    row.update(_pairs(plans))
            rows.append(row)
            print(_line(row), flush=True)
            if out_json:  # after every row: a run cut short keeps the rows it measured
                _write(out_json, name, rows, used, only)
    print(_table(name, rows))
    return 0


def _table(name: str, rows: list[dict[str, Any]]) -> str:
    return markdown(rows) if name != "scaling" else predictions_markdown(rows)


def _write(
    out_json: str,
    name: str,
    rows: list[dict[str, Any]],
    used: dict[int, Any],
    only: list[int] | None = None,
) -> None:
    """The JSON and its markdown table, the rows so far (``"complete"`` once each
    configuration asked for has one; ``"only"``: the indexes ``--rows`` asked for)."""
    wanted = len(only) if only is not None else len(SUITES[name])
    doc = {
        "suite": name,
        "complete": len(rows) == wanted,
        **({"only": only} if only is not None else {}),
        "rows": rows,
        **({"rates": used} if used else {}),
    }
    Path(out_json).write_text(json.dumps(doc, indent=2) + "\n")
    Path(out_json).with_suffix(".md").write_text(_table(name, rows) + "\n")


def _flag(argv: list[str], name: str) -> str | None:
    """The value given to ``name`` in ``argv`` (None: not given)."""
    return argv[argv.index(name) + 1] if name in argv else None


def _world(argv: list[str]) -> int:
    world = _flag(argv, "--world-size")
    assert world is not None, argv  # every suite row names its world size
    return int(world)


# Calibrations per rank count, each in processes of its own; the suite predicts with
# their median. One was one draw of a shared machine: the 4-rank gather's bus on the
# 2-core machine came out 1.44 GB/s in one invocation and 0.35 in the next (2026-12-03).
CALIBRATIONS = 3


def calibrated_rates(tmp: Path, worlds: list[int]) -> dict[int, str]:
    """A rates file per world size, measured here now: compute with one rank per core
    (as many ranks as cores, or the fewest the suite runs), each world's collectives
    with that many ranks at once (more ranks than cores share them, which is what
    their latency is then); each rate the median of ``CALIBRATIONS``. Returns the
    file for each world size."""
    from .main import usable_cpus

    def calibrate(nproc: int) -> dict[str, Any]:
        runs = []
        for i in range(CALIBRATIONS):
            out = tmp / f"rates_{nproc}_{i}.json"
            cmd = [sys.executable, "-m", "shardwise", "plan", "--calibrate", "--nproc", str(nproc)]
            subprocess.run([*cmd, "--json", str(out)], check=True, capture_output=True)
            runs.append(json.loads(out.read_text()))
        return median_rates(runs)

    cores = min(usable_cpus(), worlds[0])
    base = calibrate(max(2, cores))
    files = {}
    for w in worlds:
        r = dict(base)
        if w != max(2, cores):
            own = calibrate(w)
            r.update(latency=own["latency"], intra_bw=own["intra_bw"])
            r["source"] = f"{base['source']}; collectives: {own['source']}"
        f = tmp / f"rates_for_{w}.json"
        f.write_text(json.dumps(r))
        files[w] = str(f)
        print(f"rates for {w} ranks: latency {r['latency'] * 1e6:.0f} us, bus "
              f"{r['intra_bw'] / 1e9:.2f} GB/s ({r['source']})", flush=True)  # fmt: skip
    return files


# A prediction whose compute is timed on this machine (``--compute measured``) is one
# draw of its speed: the small GPT's local step at 2 gloo ranks came out 199 to 271 ms
# in five plan processes a few seconds apart on the 2-core machine (2026-12-03), while
# the rounds inside one process move together. A launch of the run is one draw too,
# and so is the host's AdamW in an offloaded GPU step (one prediction's host steps 1166
# to 1623 ms on one H200 machine, 2026-12-03). Made all before the run, the
# predictions sampled other minutes than the launches: the suite takes ``PAIRS``
# pairs, each ``plan --measure --launches 1`` in a process of its own (predict, then
# measure one launch), and compares the median prediction with the median launch.
PAIRS = 3
# The 2-core machine spreads most (one row's launches 751, 854 and 949 ms a step): five.
CPU_PAIRS = 5


def median_prediction(plans: list[dict[str, Any]]) -> dict[str, Any]:
    """The last plan with the step time, its parts and its compute record taken from the
    plan whose step is the median of ``plans`` (an odd count; for an even one the upper
    middle)."""
    middle = sorted(plans, key=lambda p: p["step_ms"])[len(plans) // 2]
    return {**plans[-1], **{k: middle[k] for k in ("step_ms", "time", "compute") if k in middle}}


def merged_measurements(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several ``plan --measure`` runs' figures as one: the step time over every launch
    (``plan_measure.launch_figures``, as one run's launches), each rank's peak the
    median over the runs (the upper middle of an even count: a peak measured, not an
    average), each run's kept beside."""
    from .plan_measure import launch_figures

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


def median_rates(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The first calibration's rates file with each measured rate (a float) the median
    over ``runs``; counts, switches and text as the first has them."""
    first = dict(runs[0])
    for key, value in first.items():
        if isinstance(value, float):
            first[key] = statistics.median(r[key] for r in runs)
    if len(runs) > 1:
        first["source"] = f"{first['source']} (each rate the median of {len(runs)})"
    return first


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
        "measured_frees_unrecorded": m.get("frees_unrecorded"),  # CPU: plan_measure.live_peak
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
