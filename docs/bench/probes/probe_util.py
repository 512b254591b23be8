"""What the GPU probes share: CUDA-event timing, and the GPT ``medium`` (1B) parameter shapes."""
import torch
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
