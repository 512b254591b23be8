"""A CPU suite's rows replayed with other communication rates, against their measured steps.

Why: a CPU row's predicted step is its compute (the rank's step under the fake
group, timed when the row ran: ``predicted_compute_ms``) and gloo's collectives
charged one after the other. To try other rates for the collectives without
running the suite again (22 minutes on the 2-core machine), this records each
row's step once more under the fake group (``simulate``: the order and bytes
do not depend on the machine), scales its operators to the row's compute and
replays it: with the suite's own rates (which gives back the suite's
prediction: a check) and with the rates given, the gathers at ``--ag`` and the
reduce-scatters at ``--rs`` (default: the gathers' rates), one after the
other or, with ``--overlap F``, on a stream of their own with F of each
charged to the compute. Prints each row's error against the measured step,
per suite file.

Run: PYTHONPATH=src python docs/bench/probes/cpu_comm_replay_probe.py SUITE.json [...]
       [--ag 2:LATENCY_US:GBPS,4:LATENCY_US:GBPS] [--rs 2:LATENCY_US:GBPS,...] [--overlap F]
"""

import argparse
import json
from dataclasses import replace
from typing import Any

from shardwise.planner import Policy
from shardwise.planner.policy import Hardware
from shardwise.planner.simulate import Simulation, simulate
from shardwise.planner.timeline import comm_seconds, op_seconds, replay
from shardwise.planner.tracker import Event
from shardwise_app.cli.plan import resolve_model


def rates(text: str | None) -> dict[int, tuple[float, float]]:
    out = {}
    for part in (text or "").split(","):
        if part:
            world, lat, gbps = part.split(":")
            out[int(world)] = (float(lat) * 1e-6, float(gbps) * 1e9)
    return out


def simulated(argv: str, hw: Hardware) -> Simulation:
    """A suite row's step as the planner simulates it (``simulate``, as ``plan`` calls
    it); gloo_gather_bound_probe.py takes its peaks from here too."""
    a = argv.split()
    opt = {a[i]: a[i + 1] for i in range(0, len(a) - 1, 2) if a[i].startswith("--")}
    build, _ = resolve_model(opt["--model"], int(opt["--seq-len"]))
    policy = Policy(opt.get("--mp", "none"), opt["--ac"])
    world, batch, seq = (int(opt[k]) for k in ("--world-size", "--batch-size", "--seq-len"))
    return simulate(build, world, policy, hw, batch, seq)


def recorded(argv: str, hw: Hardware) -> list[Event]:
    """The row's step as the planner records it."""
    return simulated(argv, hw).events


def op_scale(events: list[Event], hw: Hardware, compute_s: float) -> float:
    """What the row's operators are multiplied by to sum to its compute, as ``plan`` scales
    them to the rank's step (``host_scale``)."""
    return compute_s / sum(op_seconds(e, hw, copies=False) for e in events if e.kind == "op")


def step_s(
    events: list[Event],
    hw: Hardware,
    world: int,
    scale: float,
    ag: Any,
    rs: Any,
    overlap: float | None,
) -> float:
    """The step with the given rates (charged as ``timeline.comm_seconds`` charges them):
    each collective one after the other on the compute (``overlap`` None, as the
    planner charges a CPU), or on a stream of its own from its issue, ``overlap`` of
    its time charged to the compute there (the share of the core gloo's threads
    take) and the rest waited for where the runtime waits."""
    at = {
        kind: replace(hw, latency=lat, intra_bw=bw, inter_bw=bw)
        for kind, (lat, bw) in (("all_gather", ag), ("reduce_scatter", rs or ag))
    }
    clock = stream = 0.0
    ends: dict[int, float] = {}
    for e in events:
        if e.kind == "op":
            clock += op_seconds(e, hw, copies=False) * scale
        elif e.kind == "issue":
            t = comm_seconds(e, at[e.coll], world, False)
            if overlap is None:
                clock += t
                continue
            clock += overlap * t
            stream = max(clock, stream) + (1 - overlap) * t
            ends[e.key] = stream
        elif e.kind == "wait":
            clock = max(clock, ends.pop(e.key, clock))
    return max(clock, stream)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("suites", nargs="+")
    p.add_argument("--ag", default=None)
    p.add_argument("--rs", default=None)
    p.add_argument("--overlap", type=float, default=None)
    args = p.parse_args()
    ag, rs = rates(args.ag), rates(args.rs)
    cache: dict[str, list[Event]] = {}  # a row's step is the same in every suite file
    for path in args.suites:
        suite = json.load(open(path))
        print(path)
        for row in suite["rows"]:
            world = int(row["argv"].split("--world-size")[1].split()[0])
            hw = Hardware(**suite["rates"][str(world)])
            if row["argv"] not in cache:
                cache[row["argv"]] = recorded(row["argv"], hw)
            events = cache[row["argv"]]
            scale = op_scale(events, hw, row["predicted_compute_ms"] / 1e3)
            suite_s = replay(events, hw, world, False, 0, host_scale=scale).step_s
            measured = row["measured_step_ms"] / 1e3
            line = f"  {row['argv'][8:]:62s} suite's rates {100 * (suite_s / measured - 1):+6.1f}%"
            line += f" (the suite said {row['step_error_pct']:+6.1f}%)"
            if world in ag:
                given = step_s(events, hw, world, scale, ag[world], rs.get(world), args.overlap)
                line += f"  given rates {100 * (given / measured - 1):+6.1f}%"
            print(line, flush=True)


if __name__ == "__main__":
    main()
