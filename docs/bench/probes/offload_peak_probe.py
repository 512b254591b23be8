"""What is live at an offloaded step's device peak, from the allocator's own record (one GPU).

Why: the planner's offloaded rows are checked against ``max_memory_allocated``,
which once moved by one block's fp32 shard between two runs; this names every
allocation live at the peak (size, stream, the innermost shardwise frame), so
two runs can be compared line by line. The model, policy and optimizer are
``shardwise plan --measure``'s (planner/setup.py); the second step is recorded.
Usage (repository root):
  PYTHONPATH=src python docs/bench/probes/offload_peak_probe.py OUT.json \\
      [--model shardwise_app.models.shapes:gpt_645b --batch-size 2 --seq-len 2048 --ac non-reentrant]
Run it twice and diff the two files' "live" lists.

"original_blocks_alive" counts the blocks whose parameters from before
``fully_shard`` still exist at the recorded step: before 841db7d a reference
cycle in ``fully_shard`` kept them (on the device: one block's fp32
parameters, 805,371,904 bytes at 6.45B) until the garbage collector ran, so
they were on some runs' peaks and not others'. ``--collect`` runs the
collector once after sharding, which on such a runtime frees them.
"""
import argparse, collections, gc, json, os, weakref
import torch, torch.distributed as dist

def frame(frames):
    """The innermost frame in shardwise (else the innermost Python frame)."""
    for f in frames:
        if "/shardwise/" in f.get("filename", ""):
            return f"{f['filename'].split('/shardwise/')[-1]}:{f['line']} {f['name']}"
    return next((f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}" for f in frames if f.get("filename", "").endswith(".py")), "?")

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default="shardwise_app.models.shapes:gpt_645b")
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--ac", default="non-reentrant")
    ap.add_argument("--collect", action="store_true", help="gc.collect() once after sharding")
    a = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
    from importlib import import_module
    from shardwise.api import default_mesh
    from shardwise.planner import Policy
    from shardwise.planner.setup import apply_policy, find_blocks, lm_loss, make_optimizer, token_batch
    mod, fn = a.model.split(":")
    build = getattr(import_module(mod), fn)
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    with dev:
        model = build()
    originals = [[weakref.ref(p) for p in b.parameters()] for b in find_blocks(model)]
    apply_policy(model, Policy(mp="bf16", ac=a.ac, offload=True), default_mesh())
    if a.collect:
        gc.collect()
    alive = lambda: sum(any(r() is not None for r in rs) for rs in originals)
    opt = make_optimizer(model, "cuda", True)
    with dev:
        data = token_batch(model, a.batch_size, a.seq_len)
    def step():
        lm_loss(model, data).backward(); opt.step(); opt.zero_grad(set_to_none=True)
    step()
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    before, alive_before = torch.cuda.memory_allocated(), alive()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = [e for e in snap["device_traces"][0] if e["action"] in ("alloc", "free_requested")]
    total, best, at = before, before, -1
    for i, e in enumerate(trace):
        total += e["size"] if e["action"] == "alloc" else -e["size"]
        if total > best:
            best, at = total, i
    live = {}
    for e in trace[: at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        else:
            live.pop(e["addr"], None)
    groups = collections.Counter()
    for e in live.values():
        groups[(e["size"], e["stream"], frame(e.get("frames", [])))] += 1
    rows = sorted(((s * n, s, n, st, f) for (s, st, f), n in groups.items()), reverse=True)
    res = {"max_memory_allocated": peak, "replayed_peak": best, "allocated_before_step": before,
           "original_blocks_alive": {"before_step": alive_before, "after_step": alive()},
           "gc_collections": [g["collections"] for g in gc.get_stats()],
           "live": [{"MiB": round(t / 2**20, 2), "size": s, "count": n, "stream": st, "where": f} for t, s, n, st, f in rows]}
    json.dump(res, open(a.out, "w"), indent=1)
    print(f"peak {peak / 2**20:.1f} MiB (replayed {best / 2**20:.1f}; {before / 2**20:.1f} before the step; "
          f"original blocks alive {res['original_blocks_alive']})")
    for r in res["live"][:20]:
        print(f"  {r['MiB']:10.2f} MiB  {r['count']:3d} x {r['size']:>11d}  stream {r['stream']}  {r['where']}")
    dist.destroy_process_group()
