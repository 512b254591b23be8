#!/bin/bash
# Does the CPU calibration of gloo's latency (beside compute) follow what a real step pays, minute to minute?
# The tiny GPT at 2 gloo ranks: calibrate, predict and measure one launch with those rates, calibrate again; six
# times. "beyond compute": the measured step less the predicted compute (the step under the fake group), per
# gathered tensor after ~5 ms of bytes. Run from anywhere: bash docs/bench/probes/gloo_latency_tracking.sh
cd "$(dirname "$0")/../../.."
export PYTHONPATH=src
for i in 1 2 3 4 5 6; do
  .venv/bin/python -m shardwise plan --calibrate --nproc 2 --json ${OUT:-/tmp}/track_cal$i.json > /dev/null 2>&1
  .venv/bin/python -m shardwise plan --model tiny --world-size 2 --batch-size 8 --seq-len 128 --ac none --compute measured --measure --launches 1 --rates ${OUT:-/tmp}/track_cal$i.json --json ${OUT:-/tmp}/track_p$i.json > /dev/null 2>&1
  .venv/bin/python -m shardwise plan --calibrate --nproc 2 --json ${OUT:-/tmp}/track_calb$i.json > /dev/null 2>&1
  python3 -c "
import json
c=json.load(open('${OUT:-/tmp}/track_cal$i.json')); cb=json.load(open('${OUT:-/tmp}/track_calb$i.json')); p=json.load(open('${OUT:-/tmp}/track_p$i.json'))
C=p['time']['compute_ms']; M=p['measured']['step_ms']
print(f'$i: latency before {c[\"latency\"]*1e6:.0f} us, after {cb[\"latency\"]*1e6:.0f} us; compute {C:.1f} ms, measured {M:.1f}, beyond compute {M-C:.1f} ms = {(M-C-5)/73*1e3:.0f} us a tensor; predicted {p[\"step_ms\"]:.1f} ({100*(p[\"step_ms\"]-M)/M:+.1f}%)', flush=True)
"
done
