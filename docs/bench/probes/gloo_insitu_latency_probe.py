"""Which estimate of gloo's latency per gathered tensor predicts a real step's: the
calibration's (gathers beside matrix products) or a reference model's real step?

Each round, at 2 gloo ranks on this machine: calibrate (``plan --calibrate``); then
``plan --measure --launches 1 --compute measured`` with those rates for a reference
model that is not in the CPU suite (the tiny Llama: another architecture, most of its
step communication) and for suite rows (the tiny and small GPTs). On a CPU a step's
prediction is linear in the latency (timeline.comm_seconds: each gathered or reduced
tensor pays it once), so each run gives the latency its measured step implies:
``L + (measured - predicted) / n``, with ``n`` the tensors charged (from the plan's
communication time less its bytes over the bus). A row's error is then given with the
calibrated latency and with the reference's implied one.

Run: PYTHONPATH=src .venv/bin/python docs/bench/probes/gloo_insitu_latency_probe.py ROUNDS OUTDIR
"""

import json
import statistics
import subprocess
import sys
from pathlib import Path

PY = sys.executable
REFERENCE = [
    "--model",
    "shardwise_app.models.shapes:llama_tiny",
    "--batch-size",
    "8",
    "--seq-len",
    "256",
]
ROWS = {
    "tiny": ["--model", "tiny", "--batch-size", "8", "--seq-len", "128"],
    "small": ["--model", "small", "--batch-size", "4", "--seq-len", "128"],
}


def plan(argv: list[str], rates: Path, out: Path) -> dict:
    cmd = [PY, "-m", "shardwise", "plan", *argv, "--world-size", "2", "--ac", "none"]
    cmd += ["--compute", "measured", "--measure", "--launches", "1", "--rates", str(rates)]
    subprocess.run([*cmd, "--json", str(out)], check=True, capture_output=True)
    return json.loads(out.read_text())


def implied(p: dict, rates: dict) -> tuple[float, int]:
    """The latency the measured step implies, and the tensors that pay it."""
    moved = sum(p["collectives"]["bytes_per_rank"].values())
    n = round((p["time"]["comm_ms"] / 1e3 - moved / rates["intra_bw"]) / rates["latency"])
    return rates["latency"] + (p["measured"]["step_ms"] - p["step_ms"]) / 1e3 / n, n


def main() -> None:
    rounds, out = int(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    errors: dict[str, dict[str, list[float]]] = {k: {"cal": [], "ref": []} for k in ROWS}
    for i in range(rounds):
        cal = out / f"cal{i}.json"
        subprocess.run(
            [PY, "-m", "shardwise", "plan", "--calibrate", "--nproc", "2", "--json", str(cal)],
            check=True,
            capture_output=True,
        )
        rates = json.loads(cal.read_text())
        ref, _ = implied(plan(REFERENCE, cal, out / f"ref{i}.json"), rates)
        line = f"{i}: calibrated {rates['latency'] * 1e6:.0f} us, reference implies {ref * 1e6:.0f}"
        for name, argv in ROWS.items():
            p = plan(argv, cal, out / f"{name}{i}.json")
            own, n = implied(p, rates)
            m = p["measured"]["step_ms"]
            with_ref = p["step_ms"] + n * (ref - rates["latency"]) * 1e3
            e_cal = 100 * (p["step_ms"] - m) / m
            e_ref = 100 * (with_ref - m) / m
            errors[name]["cal"].append(e_cal)
            errors[name]["ref"].append(e_ref)
            line += (
                f"; {name} implies {own * 1e6:.0f} ({n} tensors), error {e_cal:+.1f}% calibrated,"
                f" {e_ref:+.1f}% reference"
            )
        print(line, flush=True)
    for name, e in errors.items():
        for k, v in e.items():
            print(
                f"{name}, {k}: mean {statistics.mean(v):+.1f}%, max |{max(map(abs, v)):.1f}|%,"
                f" spread {statistics.pstdev(v):.1f}"
            )


if __name__ == "__main__":
    main()
