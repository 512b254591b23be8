"""docs/scaling_predictions.md's communication-policy table: each policy predicted at 64 and 512 GPUs.

    python benchmarks/comm_policy_table.py [--json FILE] [--worlds 8,64,512]

For the 6.45B GPT (batch 2 x 2048) and the Llama-2-70B shape (batch 1 x 4096),
bf16 parameters with fp32 reduction and every block checkpointed, 8 GPUs a
node: plain full sharding, HSDP over nodes (R = nodes; 2 x 4 within one node, as
the scaling suite's), and full sharding with
each communication policy (``shardwise plan --comm-policy``: qwz, hpz, qgz,
zeropp). Each row is a ``shardwise plan`` invocation read by the command's own
parser and checks; it is simulated once and replayed on the ``h200`` and
``h100`` presets (the two differ only in rates: ``shardwise_plan.replan``).

Under each (model, GPUs) the verdict line: the policy with the least exposed
communication among those whose peak is no higher than HSDP's, and its
exposed communication as a share of plain full sharding's (issue 51's target:
at most one third). ``--json FILE`` writes the rows after each one, with the
markdown beside it (``FILE`` with ``.md``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from shardwise_app.cli import plan as plan_cli
from shardwise_app.cli.common import UsageError
from shardwise_app.cli.plan_args import OneLineParser

MODELS = {
    "gpt_645b": ["--model", "shardwise_app.models.shapes:gpt_645b", "--batch-size", "2",
                 "--seq-len", "2048"],
    "llama2_70b": ["--model", "shardwise_app.models.shapes:llama2_70b", "--batch-size", "1",
                   "--seq-len", "4096"],
}  # fmt: skip
COMMON = ["--mp", "bf16", "--ac", "non-reentrant"]
POLICIES = ("none", "hsdp", "qwz", "hpz", "qgz", "zeropp")
HARDWARE = ("h200", "h100")  # simulated on the first, replayed on the rest
NODE = 8
GIB = 1 << 30


def row_argv(model_flags: list[str], world: int, policy: str) -> list[str]:
    """The ``shardwise plan`` flags of one row."""
    mesh = ["--hsdp", str(replicas(world))] if policy == "hsdp" else ["--comm-policy", policy]
    return [*model_flags, "--world-size", str(world), *COMMON, *mesh, "--hardware", HARDWARE[0]]


def replicas(world: int) -> int:
    """HSDP's replicate degree: one a node, two within one node."""
    return max(2, world // NODE)


def plan_row(argv: list[str]) -> dict[str, Any]:
    """One row: planned as ``shardwise plan ARGV`` plans it, then replayed on each preset."""
    from shardwise_plan import HARDWARE as PRESETS
    from shardwise_plan import replan

    t0 = time.perf_counter()
    p, args, _ = plan_cli.planned(argv)
    wall = time.perf_counter() - t0
    hw = plan_cli.hardware(args)
    link = p.collectives["bytes_per_link"]
    out: dict[str, Any] = {
        "argv": " ".join(argv),
        "n_params": p.n_params,
        "peak_bytes": p.peak_bytes,
        "peak_where": {"phase": p.peak_phase, "module": p.peak_module},
        "peak_by_kind": p.peak_by_kind,
        "inter_bytes": link["inter"],
        "intra_bytes": link["intra"],
        "collectives": {k: v for k, v in p.collectives.items() if k != "whole_bytes"},
        "wall_s": wall,
        "time": {},
    }
    for name in HARDWARE:
        q = p if name == hw.name else replan(p, PRESETS[name])
        out["time"][name] = {
            "step_ms": q.step_ms,
            "exposed_comm_ms": q.time.exposed_comm_s * 1e3,
            "comm_ms": q.time.comm_s * 1e3,
            "compute_ms": q.time.compute_s * 1e3,
            "quantize_ms": q.time.by_phase.get("quantize", 0.0) * 1e3,
        }
    return out


def verdicts(group: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per preset: the communication policy with the least exposed communication among
    those whose peak is at most HSDP's, and that as a share of plain full sharding's."""
    out: dict[str, dict[str, Any]] = {}
    hsdp = group.get("hsdp")
    plain = group.get("none")
    if hsdp is None or plain is None:
        return out
    for hw in HARDWARE:
        fits = [
            (r["time"][hw]["exposed_comm_ms"], name)
            for name, r in group.items()
            if name not in ("none", "hsdp") and r["peak_bytes"] <= hsdp["peak_bytes"]
        ]
        if not fits:
            out[hw] = {"best": None}
            continue
        exposed, best = min(fits)
        share = exposed / plain["time"][hw]["exposed_comm_ms"]
        out[hw] = {"best": best, "exposed_ms": exposed, "share_of_full_shard": share}
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    head = (
        "| model | GPUs | policy | inter-node GiB/step/rank | intra-node GiB | exposed comm ms "
        "H100 / H200 | step ms H100 / H200 | peak GiB |"
    )
    lines = [head, "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        t = r["time"]
        w, rep = int(r["world"]), replicas(int(r["world"]))
        name = f"HSDP {rep} x {w // rep}" if r["policy"] == "hsdp" else r["policy"]
        name = "full shard" if name == "none" else name
        lines.append(
            f"| {r['model']} | {r['world']} | {name} | {r['inter_bytes'] / GIB:.2f} | "
            f"{r['intra_bytes'] / GIB:.2f} | {t['h100']['exposed_comm_ms']:.0f} / "
            f"{t['h200']['exposed_comm_ms']:.0f} | {t['h100']['step_ms']:.0f} / "
            f"{t['h200']['step_ms']:.0f} | {r['peak_bytes'] / GIB:.2f} |"
        )
    lines.append("")
    for (model, world), v in _groups_verdicts(rows).items():
        for hw, d in v.items():
            if d["best"] is None:
                lines.append(f"- {model} at {world} on {hw}: no policy's peak is at most HSDP's")
                continue
            met = "met" if d["share_of_full_shard"] <= 1 / 3 else "not met"
            lines.append(
                f"- {model} at {world} GPUs on {hw}: best within HSDP's peak is {d['best']}, "
                f"{d['exposed_ms']:.0f} ms exposed, {d['share_of_full_shard']:.2f} of full "
                f"sharding's (target 1/3: {met})"
            )
    return "\n".join(lines)


def _groups_verdicts(rows: list[dict[str, Any]]) -> dict[tuple[str, int], Any]:
    groups: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for r in rows:
        if r["world"] <= NODE:  # one node: nothing crosses nodes, no target to judge
            continue
        groups.setdefault((r["model"], r["world"]), {})[r["policy"]] = r
    return {k: verdicts(g) for k, g in groups.items()}


def run(
    models: dict[str, list[str]], worlds: list[int], out_json: str | None
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for world in worlds:
        for model, flags in models.items():
            for policy in POLICIES:
                r = plan_row(row_argv(flags, world, policy))
                r.update(model=model, world=world, policy=policy)
                rows.append(r)
                t = r["time"]["h200"]
                print(
                    f"{model} {world} {policy}: inter {r['inter_bytes'] / GIB:.2f} GiB, exposed "
                    f"{t['exposed_comm_ms']:.0f} ms, step {t['step_ms']:.0f} ms, peak "
                    f"{r['peak_bytes'] / GIB:.2f} GiB ({r['wall_s']:.0f} s)",
                    flush=True,
                )
                if out_json:  # after every row: a run cut short keeps what it has
                    _write(out_json, rows)
    return rows


def _write(out_json: str, rows: list[dict[str, Any]]) -> None:
    doc = {"rows": rows, "verdicts": [
        {"model": m, "world": w, **v} for (m, w), v in _groups_verdicts(rows).items()
    ]}  # fmt: skip
    Path(out_json).write_text(json.dumps(doc, indent=2) + "\n")
    Path(out_json).with_suffix(".md").write_text(markdown(rows) + "\n")


def parse_worlds(text: str) -> list[int]:
    try:
        worlds = [int(x) for x in text.split(",")]
    except ValueError:
        worlds = []
    if not worlds or any(w < NODE or w % NODE for w in worlds):
        raise UsageError(
            f"--worlds {text!r}: give world sizes of whole {NODE}-GPU nodes, separated by "
            "commas (e.g. 8,64,512)"
        )
    return worlds


def main(argv: list[str]) -> int:
    p = OneLineParser(prog="comm_policy_table.py", description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, metavar="FILE", help="the rows (and FILE.md)")
    p.add_argument("--worlds", default="8,64,512", help="GPUs, comma-separated")
    args = p.parse_args(argv)
    worlds = parse_worlds(args.worlds)
    if args.json:
        plan_cli.check_output(args.json, "--json")
    rows = run(MODELS, worlds, args.json)
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except UsageError as e:
        print(f"comm_policy_table.py: error: {e}", file=sys.stderr)
        sys.exit(2)
