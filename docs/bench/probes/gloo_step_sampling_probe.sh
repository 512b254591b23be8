#!/bin/bash
# How much of a CPU launch's measured step is sampling? The tiny GPT at 2 gloo ranks, 8 launches with the ranks
# free to move between cores and 8 with each pinned to a core of its own (a sitecustomize that sets the affinity
# before torch starts, so gloo's and OpenMP's threads inherit it), interleaved; each launch's steps (after 2 untimed),
# then the spread of steps within a launch against the spread of the launches' means less their predicted compute.
# Run from anywhere: bash docs/bench/probes/gloo_step_sampling_probe.sh  (about 4 minutes on the 2-core machine)
cd "$(dirname "$0")/../../.."
T=${OUT:-$(mktemp -d)}
cat > "$T/sitecustomize.py" <<'PY'
import os
if os.environ.get("PIN_RANKS") == "1" and "LOCAL_RANK" in os.environ:
    os.sched_setaffinity(0, {int(os.environ["LOCAL_RANK"]) % (os.cpu_count() or 1)})
PY
for i in 1 2 3 4 5 6 7 8; do
  for pin in 0 1; do
    PIN_RANKS=$pin PYTHONPATH=src:$T .venv/bin/python -m shardwise plan --model tiny --world-size 2 --batch-size 8 \
      --seq-len 128 --ac none --compute measured --measure --launches 1 --json "$T/p_${pin}_$i.json" > /dev/null 2>&1
  done
done
python3 - "$T" <<'PY'
import json, statistics as st, sys
rows = []
for pin in (0, 1):
    for i in range(1, 9):
        p = json.load(open(f"{sys.argv[1]}/p_{pin}_{i}.json"))
        s, c = p["measured"]["steps_ms"], p["time"]["compute_ms"]
        rows.append((pin, s, c))
        print(f"pinned={pin} launch {i}: compute {c:.1f} ms, steps", [round(x) for x in s])
within = st.mean(st.pvariance(s) for _, s, _ in rows)
for pin in (0, 1, None):
    b = [st.mean(s) - c for q, s, c in rows if pin is None or q == pin]
    print(f"pinned={pin}: launches' mean less compute, sd {st.stdev(b):.1f} ms")
n = st.mean(len(s) for _, s, _ in rows)  # 7 before 179c149 (CPU_TIMED_S), about 20 since
print(f"within a launch, sd {within**.5:.1f} ms; of a mean of {n:.0f} from sampling alone {(within / n) ** .5:.1f} ms")
PY
