"""A real gloo step, split: time in the collectives' issue, in their waits, and the rest.

Why: the planner charges a CPU step as the rank's step under the fake process
group (compute and Python, ``local_step.py``) plus gloo's latency per tensor
and bytes over the calibrated bus (the communication), one after the other.
When a row misses, this says which side: the same model, policy and batch as
``plan --measure`` (``planner.setup``), on real gloo ranks, with
``collectives.Pending.wait`` and the gather and reduce-scatter entries timed
on each rank, median over 9 steps after 2. Each rank also reports the CPU
time of the thread that runs the step and of the whole process: the
difference is gloo's threads (and the kernel's work for its sockets, charged
to them).

Run: PYTHONPATH=src python docs/bench/probes/gloo_step_split_probe.py MODEL BATCH MP AC [WORLD]
(e.g. ``tiny 8 bf16 none``; WORLD ranks, default 2, sequence 128; each rank prints).
"""

import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def work(rank: int, world: int, port: int, model_name: str, batch: int, mpm: str, ac: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from shardwise import collectives
    from shardwise.api import default_mesh
    from shardwise.planner import Policy
    from shardwise.planner.setup import apply_policy, lm_loss, make_optimizer, token_batch
    from shardwise_app.cli.plan import resolve_model

    build, _ = resolve_model(model_name, 128)
    torch.manual_seed(0)
    model = build()
    apply_policy(model, Policy(mpm, ac), default_mesh())
    opt = make_optimizer(model, "cpu", False)
    data = token_batch(model, batch, 128)
    acc = {"wait": 0.0, "issue": 0.0, "n": 0}
    wait0 = collectives.Pending.wait

    def wait(self: Any) -> None:
        t0 = time.perf_counter()
        wait0(self)
        acc["wait"] += time.perf_counter() - t0
        acc["n"] += 1

    collectives.Pending.wait = wait  # type: ignore[method-assign]
    inside = [False]  # all_gather_each of one tensor calls all_gather: time it once
    for name in ("all_gather_each", "all_gather", "reduce_scatter"):
        issue0 = getattr(collectives, name)

        def issue(*a: Any, _issue0: Any = issue0, **k: Any) -> Any:
            if inside[0]:
                return _issue0(*a, **k)
            inside[0] = True
            t0 = time.perf_counter()
            try:
                return _issue0(*a, **k)
            finally:
                acc["issue"] += time.perf_counter() - t0
                inside[0] = False

        setattr(collectives, name, issue)

    def step() -> None:
        lm_loss(model, data).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    rows = []
    for _ in range(9):
        acc.update(wait=0.0, issue=0.0, n=0)
        dist.barrier()
        t0, main0, all0 = time.perf_counter(), time.thread_time(), time.process_time()
        step()
        wall, main, cpu = (
            time.perf_counter() - t0,
            time.thread_time() - main0,
            time.process_time() - all0,
        )
        rows.append((wall, acc["wait"], acc["issue"], main, cpu, acc["n"]))
    total, waits, issues, main, cpu = (
        1e3 * statistics.median(r[i] for r in rows) for i in range(5)
    )
    print(
        f"rank {rank}: step {total:.1f} ms, in waits {waits:.1f}, in issue {issues:.1f}, "
        f"rest {total - waits - issues:.1f} ({rows[0][5]} waits a step); CPU time: the "
        f"step's thread {main:.1f}, the process {cpu:.1f} (gloo's threads {cpu - main:.1f})",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    name, batch, mpm, ac = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    world = int(sys.argv[5]) if len(sys.argv) > 5 else 2
    mp.spawn(work, (world, 29521, name, batch, mpm, ac), nprocs=world)
