"""Ways to write a module's bf16 gradients into one fp32 buffer (1B elements, GPT medium shapes).

The master-weights probe found torch._chunk_cat with num_chunks=1 and a
dtype change ten times slower than a plain copy; these are the candidates
for one rank (contiguous destination) and for two (rank-major chunks).
Usage: python grad_cast_probe.py OUT.json
"""
import json, sys, torch
from probe_util import medium_shapes, timeit

def timeit10(fn):
    return timeit(fn, iters=10, warmup=2)

if __name__ == "__main__":
    dev = torch.device("cuda")
    shapes = medium_shapes(dev)
    grads = [torch.randn(s, device=dev, dtype=torch.bfloat16) for s in shapes]
    n = sum(g.numel() for g in grads)
    flat = torch.empty(n, device=dev)
    views, o = [], 0
    for g in grads:
        views.append(flat[o:o + g.numel()].view_as(g)); o += g.numel()
    res = {"elements": n}
    res["w1_chunk_cat_ms"] = timeit10(lambda: torch._chunk_cat(grads, dim=0, num_chunks=1, out=flat.view(1, -1)))
    res["w1_foreach_copy_ms"] = timeit10(lambda: torch._foreach_copy_(views, grads))
    def loop():
        for v, g in zip(views, grads): v.copy_(g)
    res["w1_copy_each_ms"] = timeit10(loop)
    res["w1_cat_out_ms"] = timeit10(lambda: torch.cat([g.reshape(-1) for g in grads], out=flat))
    # Two ranks: rank-major (2, per_rank); each gradient's rows split in two halves.
    w = 2
    per_rank = sum(-(-g.shape[0] // w) * (g.numel() // g.shape[0]) for g in grads)
    out = torch.empty(w, per_rank, device=dev)
    res["w2_chunk_cat_ms"] = timeit10(lambda: torch._chunk_cat(grads, dim=0, num_chunks=w, out=out))
    even = [g for g in grads if g.shape[0] % w == 0]
    dsts, o = [], 0
    for g in even:
        k = g.numel() // w
        dsts.append(out[:, o:o + k]); o += k
    srcs = [g.view(w, -1) for g in even]
    res["w2_even_count"] = [len(even), len(grads)]
    res["w2_foreach_copy_strided_ms"] = timeit10(lambda: torch._foreach_copy_(dsts, srcs))
    def loop2():
        for d, s in zip(dsts, srcs): d.copy_(s)
    res["w2_copy_each_strided_ms"] = timeit10(loop2)
    # The same rank-major layout as contiguous pieces: each rank's rows of each
    # gradient into its own stretch of that rank's row (reduce.py's _copy_in).
    pieces_dst, pieces_src, o = [], [], 0
    for g in even:
        k = g.numel() // w
        pieces_dst.extend(out[:, o:o + k].unbind(0)); pieces_src.extend(g.view(w, k).unbind(0)); o += k
    res["w2_foreach_copy_pieces_ms"] = timeit10(lambda: torch._foreach_copy_(pieces_dst, pieces_src))
    w4 = 4
    even4 = [g for g in grads if g.shape[0] % w4 == 0]
    out4 = torch.empty(w4, sum(g.numel() // w4 for g in even4), device=dev)
    res["w4_chunk_cat_ms"] = timeit10(lambda: torch._chunk_cat(even4, dim=0, num_chunks=w4, out=out4))
    p4d, p4s, o = [], [], 0
    for g in even4:
        k = g.numel() // w4
        p4d.extend(out4[:, o:o + k].unbind(0)); p4s.extend(g.view(w4, k).unbind(0)); o += k
    res["w4_foreach_copy_pieces_ms"] = timeit10(lambda: torch._foreach_copy_(p4d, p4s))
    print(json.dumps(res, indent=1))
    json.dump(res, open(sys.argv[1], "w"), indent=1)
