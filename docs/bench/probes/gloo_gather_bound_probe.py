"""Each CPU suite row's measured peaks against the planner's two ends for gloo ranks.

Why: a CPU target's peak depends on which of gloo's buffers are live when the
step peaks (timeline.staging_live). Ranks in step free a gathered tensor's
buffer as it runs; ranks that drift apart keep gathers in flight to the wait,
at most ``GLOO_THREADS`` tensors of them at once. This prints, per row of the
given suite files (their measured runs: ``measured_peak_bytes_per_run``), where
each run lies between the in-step figure (0) and the drifting bound (1), so a
bound that every run stays under, or not, is plain to see; and each run's error
against the middle of the two (the plan's peak since the probe was written).

Run: PYTHONPATH=src python docs/bench/probes/gloo_gather_bound_probe.py SUITE.json [...]
"""

import json
import sys

from cpu_comm_replay_probe import simulated  # beside this file

from shardwise.planner.policy import Hardware


def ends(argv: str, hw: Hardware) -> tuple[int, int]:
    """The row's in-step peak and drifting bound, as ``plan`` computes them (the
    order and bytes of the step do not depend on the rates)."""
    sim = simulated(argv, hw)
    return sim.peak_bytes_in_step, sim.peak_bytes_drifting


def main() -> None:
    suites = [json.load(open(path)) for path in sys.argv[1:]]
    over, within, total = 0.0, 0, 0
    for k, row in enumerate(suites[0]["rows"]):
        world = row["argv"].split("--world-size")[1].split()[0]
        low, high = ends(row["argv"], Hardware(**suites[0]["rates"][world]))
        middle = low + (high - low) // 2
        runs = [r for s in suites for r in s["rows"][k]["measured_peak_bytes_per_run"]]
        where = [(r - low) / (high - low) if high > low else 0.0 for r in runs]
        errors = [100 * (middle - r) / r for r in runs]
        over = max(over, (max(runs) - high) / 2**20)
        within += sum(abs(e) <= 3 for e in errors)
        total += len(runs)
        print(f"{row['argv'][8:70]:62s} in step {low / 2**20:7.2f} MiB, drifting {high / 2**20:7.2f}"
              f" | runs {min(runs) / 2**20:7.2f} to {max(runs) / 2**20:7.2f}"
              f" | the middle's error {min(errors):+.1f} to {max(errors):+.1f}%"
              f" | between: {' '.join(f'{w:.2f}' for w in where)}", flush=True)  # fmt: skip
    print(f"the most any run went over its drifting bound: {over:.2f} MiB")
    print(f"runs within 3% of the middle: {within} of {total}")


if __name__ == "__main__":
    main()
