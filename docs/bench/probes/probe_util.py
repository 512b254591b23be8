"""What the probes share: CUDA-event timing, the GPT ``medium`` (1B) parameter shapes, and
gloo ranks of one thread each on this machine."""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from shardwise_app.bench.models import build, resolve

def timeit(fn, iters=20, warmup=3):
    """Mean milliseconds of ``fn`` over ``iters`` calls, timed on the current stream."""
    for _ in range(warmup): fn()
    torch.cuda.synchronize(); s = torch.cuda.Event(True); e = torch.cuda.Event(True)
    s.record()
    for _ in range(iters): fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / iters

def medium_shapes(dev):
    """The 1B GPT's parameter shapes (built once on ``dev``, then freed)."""
    model, _ = build(resolve("medium", 2048, True), dev, "none")
    shapes = [p.shape for p in model.parameters()]
    del model
    torch.cuda.empty_cache()
    return shapes


def gloo_ranks(work, world, port, *args):
    """``work(rank, world, *args)`` in ``world`` processes, each a gloo rank of one thread
    (as the CPU suite's ranks are), the group destroyed after."""
    mp.spawn(_gloo_rank, (work, world, port, args), nprocs=world)


def _gloo_rank(rank, work, world, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        work(rank, world, *args)
    finally:
        dist.destroy_process_group()
