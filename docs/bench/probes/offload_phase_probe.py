"""Where an offloaded step's time goes on one GPU, phase by phase, beside the planner's phases.

Why: the planner's offloaded 0.94B rows came out 12 to 21% short of the
measured step (2026-12-02) while the 6.45B row was within 4%; this splits the
measured step into forward, backward and the optimizer (each ended by a device
synchronize, the median of 5 steps after 2) and prints the planner's
prediction of each for the same model, policy and optimizer
(``shardwise plan --measure``'s, planner/setup.py), with measured compute.
Usage (repository root, on the GPU):
  PYTHONPATH=src python docs/bench/probes/offload_phase_probe.py OUT.json \\
      [--model shardwise_app.models.shapes:gpt_094b --batch-size 4 --seq-len 2048 --ac none]
"""
import argparse, importlib, json, multiprocessing as mp, os, statistics, time
import torch


def build(spec):
    mod, _, fn = spec.partition(":")
    return getattr(importlib.import_module(mod), fn)()


def predict(a):
    from shardwise.planner import H200, Policy, plan

    p = plan(lambda: build(a.model), 1, batch_size=a.batch_size, seq_len=a.seq_len,
             policy=Policy(mp="bf16", ac=a.ac, offload=True), hardware=H200, compute="measured")
    return {"step_ms": p.step_ms, "by_phase_ms": {k: v * 1e3 for k, v in p.time.by_phase.items()},
            "exposed_comm_ms": p.time.exposed_comm_s * 1e3, "compute": p.compute}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default="shardwise_app.models.shapes:gpt_094b")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--ac", default="none")
    a = ap.parse_args()
    with mp.get_context("spawn").Pool(1) as pool:  # the fake group in a process of its own
        predicted = pool.apply(predict, (a,))
    import torch.distributed as dist
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29562")
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    from shardwise.api import default_mesh
    from shardwise.planner import Policy
    from shardwise.planner.setup import apply_policy, lm_loss, make_optimizer, token_batch

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build(a.model)
    apply_policy(model, Policy(mp="bf16", ac=a.ac, offload=True), default_mesh())
    opt = make_optimizer(model, "cuda", offload=True)
    with torch.device("cuda"):
        data = token_batch(model, a.batch_size, a.seq_len)
    phases = {"forward": [], "backward": [], "optimizer": [], "step": []}
    for i in range(7):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        loss = lm_loss(model, data); torch.cuda.synchronize(); t1 = time.perf_counter()
        loss.backward(); torch.cuda.synchronize(); t2 = time.perf_counter()
        opt.step(); opt.zero_grad(set_to_none=True); torch.cuda.synchronize(); t3 = time.perf_counter()
        if i >= 2:
            for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                phases[k].append(v * 1e3)
    measured = {k: statistics.median(v) for k, v in phases.items()}
    out = {"args": vars(a), "predicted": predicted, "measured_ms": measured, "steps_ms": phases}
    json.dump(out, open(a.out, "w"), indent=1)
    print(json.dumps({"predicted": predicted["by_phase_ms"], "predicted_step": predicted["step_ms"],
                      "measured": measured}, indent=1))
    dist.destroy_process_group()
