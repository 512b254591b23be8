"""What fp32 master weights cost one GPU at 1B, op by op: the floor under mixed precision.

Against a pure-bf16 model without sharding, mixed precision with fp32 master
weights must at least (a) step AdamW over fp32 parameters, gradients and
moments instead of bf16 ones, (b) cast each block's parameters fp32 -> bf16
before its forward and again before its backward (FSDP2 and shardwise free
the bf16 copy after forward, as their peaks require), (c) cast the bf16
gradients to fp32 (the faster of a plain copy and shardwise's _chunk_cat). Each is timed alone here on the GPT ``medium`` model's
parameter shapes; their sum over the pure-bf16 step is the floor.
Usage: python master_weights_probe.py OUT.json [pure_bf16_step_ms]
"""
import json, sys, torch
from probe_util import medium_shapes, timeit

if __name__ == "__main__":
    dev = torch.device("cuda")
    shapes = medium_shapes(dev)
    res = {"params": sum(torch.Size(s).numel() for s in shapes)}
    for name, dt in (("adamw_fp32_ms", torch.float32), ("adamw_bf16_ms", torch.bfloat16)):
        ps = [torch.nn.Parameter(torch.randn(s, device=dev, dtype=dt)) for s in shapes]
        for p in ps: p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(ps, lr=1e-4, fused=True)
        res[name] = timeit(opt.step)
        del ps, opt
        torch.cuda.empty_cache()
    n = res["params"]
    f32 = torch.randn(n, device=dev); b16 = torch.empty(n, device=dev, dtype=torch.bfloat16)
    res["cast_fp32_to_bf16_ms"] = timeit(lambda: b16.copy_(f32))
    res["cast_bf16_to_fp32_ms"] = timeit(lambda: f32.copy_(b16))
    # The gradients' cast as the libraries run it: bf16 gradients into an fp32
    # buffer by _chunk_cat (shardwise, one pass), or cast first and then
    # _chunk_cat (FSDP2 with reduce_dtype fp32), at 1 and 2 ranks.
    grads = [torch.randn(s, device=dev, dtype=torch.bfloat16) for s in shapes]
    del b16
    for w in (1, 2):
        per_rank = sum(-(-g.shape[0] // w) * (g.numel() // g.shape[0]) for g in grads)
        out = torch.empty(w, per_rank, device=dev)
        res[f"chunk_cat_bf16_into_fp32_w{w}_ms"] = timeit(
            lambda: torch._chunk_cat(grads, dim=0, num_chunks=w, out=out))
        res[f"cast_then_chunk_cat_w{w}_ms"] = timeit(
            lambda: torch._chunk_cat([g.float() for g in grads], dim=0, num_chunks=w, out=out))
    extra = (res["adamw_fp32_ms"] - res["adamw_bf16_ms"]
             + 2 * res["cast_fp32_to_bf16_ms"]
             + min(res["cast_bf16_to_fp32_ms"], res["chunk_cat_bf16_into_fp32_w1_ms"]))
    res["floor_extra_ms"] = extra
    if len(sys.argv) > 2:
        pure = float(sys.argv[2])
        res["pure_bf16_step_ms"] = pure
        res["floor_vs_pure"] = (pure + extra) / pure
    print(json.dumps(res, indent=1))
    json.dump(res, open(sys.argv[1], "w"), indent=1)
