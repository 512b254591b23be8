"""Where an offloaded optimizer's host time goes, beside the planner's timing of its operators.

Why: the planner's offloaded 0.94B rows on the H200 came out 12 to 23% short
of the measured step while the 6.45B row was within 4% (2026-12-02). At one
rank, on this host, this measures in three interleaved rounds (the host's own
spread is some 10% between minutes):
  - the planner's host operators summed, timed as ``op_costs.measure`` does
    (warm caches), and again with a buffer twice the last-level caches written
    before each repeat;
  - the real for-loop AdamW step of the same sharded, offloaded parameters
    (DTensors), the median of 3;
  - the same step over their local tensors (same storage, own state): the
    difference is DTensor's dispatch on the host;
  - DTensor's dispatch per operator on this host, as ``calibrate`` times it.
No GPU is needed. On the H200's host (16 cores, a 300 MiB last-level cache),
the 0.94B GPT, 2026-12-03 (the flush then lived in ``op_costs.measure``):
  - ``docs/bench/host_cache_094b_20261203_single.json`` (a777afb, one pass):
    operators 1323 ms warm, 1088 flushed; the DTensor step 1461;
  - ``docs/bench/host_cache_094b_20261203.json`` (20c7bf7, three rounds):
    operators warm 1344 / 1051 / 1342, flushed 1294 / 1094 / 1119; the DTensor
    step 1561 / 1532 / 1372, the plain step 1313 / 1342 / 1305.
The flush moved the sum either way (no cache effect to correct); the sum of
operators timed one by one moved by 25% between passes where the plain step
moved by 3%. Usage (repository root):
  PYTHONPATH=src python docs/bench/probes/host_cache_probe.py OUT.json \\
      [--model shardwise_app.models.shapes:gpt_094b] [--rounds 3]
"""
import argparse, importlib, json, multiprocessing as mp, os, statistics, time
from pathlib import Path
import torch

_OPS = []


def build(spec):
    mod, _, fn = spec.partition(":")
    return getattr(importlib.import_module(mod), fn)()


def llc_bytes():
    """This host's last-level caches, each instance once (sysfs)."""
    seen = {}
    for d in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cache/index[0-9]*"):
        level, size, shared = ((d / f).read_text().strip() for f in ("level", "size", "shared_cpu_list"))
        seen[(int(level), shared)] = int(size[:-1]) << {"K": 10, "M": 20, "G": 30}[size[-1]]
    top = max(k[0] for k in seen)
    return sum(n for k, n in seen.items() if k[0] == top)


def timed(call, flusher, repeats=5):
    """``op_costs.measure``'s CPU timing of one call (the median of 5 after a warm
    call), with ``flusher`` written through before each repeat when given."""
    from shardwise.planner.op_costs import _args

    args, kwargs = _args(call, torch.device("cpu"))
    call.func(*args, **kwargs)
    times = []
    for _ in range(repeats):
        if flusher is not None:
            flusher.add_(1)
        t0 = time.perf_counter(); call.func(*args, **kwargs); times.append(time.perf_counter() - t0)
    return statistics.median(times)


def host_operators(model, flush):
    from shardwise.planner import H200, Policy
    from shardwise.planner.simulate import simulate

    if not _OPS:  # simulated once per process (the fake group lives here)
        sim = simulate(lambda: build(model), 1, Policy(mp="bf16", offload=True), H200, 1, 128,
                       record_calls=True)
        _OPS.extend(e for e in sim.events if e.kind == "op" and e.host)
    flusher = torch.zeros(max(2 * llc_bytes(), 64 << 20) // 4) if flush else None
    seconds = {}
    with torch.no_grad():
        for e in _OPS:
            if e.call is not None and e.call.key not in seconds:
                seconds[e.call.key] = timed(e.call, flusher)
    return 1e3 * sum(seconds[e.call.key] for e in _OPS if e.call is not None), len(_OPS)


def median_step(opt, params, n=3):
    times = []
    for _ in range(n + 1):
        for p in params:
            p.grad = torch.zeros_like(p)
        t0 = time.perf_counter(); opt.step(); times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[1:])


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default="shardwise_app.models.shapes:gpt_094b")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29563")
    pool = mp.get_context("spawn").Pool(1)  # the fake group in a process of its own
    dist.init_process_group("gloo", rank=0, world_size=1)
    from shardwise.api import default_mesh
    from shardwise.planner import Policy
    from shardwise.planner.setup import apply_policy, make_optimizer

    model = build(a.model)
    mesh = default_mesh()
    apply_policy(model, Policy(mp="bf16", offload=True), mesh)
    dparams = list(model.parameters())
    lparams = [torch.nn.Parameter(p._local_tensor) for p in dparams]
    opt_d = make_optimizer(model, "cpu", offload=True)
    opt_l = torch.optim.AdamW(lparams, lr=1e-4, foreach=False)
    tiny = DTensor.from_local(torch.ones(1), mesh, [Shard(0)])
    rounds = []
    for r in range(a.rounds):
        warm, n_ops = pool.apply(host_operators, (a.model, False))
        flushed, _ = pool.apply(host_operators, (a.model, True))
        t0 = time.perf_counter()
        for _ in range(200):
            tiny.add_(1.0)
        d_add = (time.perf_counter() - t0) / 200
        t0 = time.perf_counter()
        for _ in range(200):
            tiny._local_tensor.add_(1.0)
        dispatch_us = (d_add - (time.perf_counter() - t0) / 200) * 1e6
        rounds.append({"ops_warm_ms": warm, "ops_flushed_ms": flushed,
                       "step_dtensor_ms": median_step(opt_d, dparams),
                       "step_local_ms": median_step(opt_l, lparams),
                       "dtensor_dispatch_us": dispatch_us, "host_ops": n_ops})
        print(json.dumps(rounds[-1]), flush=True)
    pool.close()
    out = {"model": a.model, "llc_bytes": llc_bytes(), "threads": torch.get_num_threads(),
           "rounds": rounds}
    json.dump(out, open(a.out, "w"), indent=1)
    dist.destroy_process_group()
