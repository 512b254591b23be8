"""Where an offloaded optimizer's host time goes, beside the planner's timing of its operators.

Why: the planner's offloaded 0.94B rows on the H200 came out 12 to 23% short
of the measured step while the 6.45B row was within 4% (2026-12-02). At one
rank, on this host, this measures in three interleaved rounds (the host's own
spread is some 10% between minutes):
  - the planner's host operators summed, timed as ``measure`` does with warm
    caches and with ``flush`` (op_costs.py);
  - the real for-loop AdamW step of the same sharded, offloaded parameters
    (DTensors), the median of 3;
  - the same step over their local tensors (same storage, own state): the
    difference is DTensor's dispatch on the host;
  - DTensor's dispatch per operator on this host, as ``calibrate`` times it.
No GPU is needed. Usage (repository root):
  PYTHONPATH=src python docs/bench/probes/host_cache_probe.py OUT.json \\
      [--model shardwise_app.models.shapes:gpt_094b] [--rounds 3]
"""
import argparse, importlib, json, multiprocessing as mp, os, statistics, time
import torch

_OPS = []


def build(spec):
    mod, _, fn = spec.partition(":")
    return getattr(importlib.import_module(mod), fn)()


def host_operators(model, flush):
    from shardwise.planner import H200, Policy
    from shardwise.planner.op_costs import measure
    from shardwise.planner.simulate import simulate

    if not _OPS:  # simulated once per process (the fake group lives here)
        sim = simulate(lambda: build(model), 1, Policy(mp="bf16", offload=True), H200, 1, 128,
                       record_calls=True)
        _OPS.extend(e for e in sim.events if e.kind == "op" and e.host)
    c = measure([e.call for e in _OPS], "cpu", repeats=5, median=True, flush=flush)
    return 1e3 * sum(c.seconds.get(e.call.key, 0.0) for e in _OPS if e.call is not None), len(_OPS)


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
    from shardwise.planner.op_costs import last_level_cache_bytes
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
    out = {"model": a.model, "llc_bytes": last_level_cache_bytes(), "threads": torch.get_num_threads(),
           "rounds": rounds}
    json.dump(out, open(a.out, "w"), indent=1)
    dist.destroy_process_group()
