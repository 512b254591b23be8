"""``CommPolicy`` (issue 51: ZeRO++'s qwZ, hpZ, qgZ): block quantization's error bound, the
quantized all-gather and the hierarchical reduce-scatter against their plain collectives
on 4 gloo ranks laid out as 2 nodes x 2, the bytes each link carries, bad input.

The byte model (``observe.LinkBytes``, "direct"): each rank sends each other member of
the group what that member needs, straight to it. At 2 x 2 a plain fp32 reduce-scatter
of ``4 * s`` elements a rank sends ``2 * s * 4`` bytes to the other node; the
hierarchical one sends ``s`` int8 elements (plus one fp32 scale per block) there: 1/8.
A quantized all-gather sends one byte (plus scales) where a bf16 one sends two: 1/2.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dist_utils import named_check_test
from shardwise import fully_shard, observe
from shardwise.comm import collectives, gather, node_collectives, quantize
from shardwise.comm.comm_policy import CommPolicy, check, fp8_supported

pytestmark = pytest.mark.timeout(300)

W, L = 4, 2  # 2 nodes x 2 ranks
BLOCK = 64


def _per_block_error(x: torch.Tensor, y: torch.Tensor, block: int) -> torch.Tensor:
    """max |x - y| in each block of the last dim (zero-padded)."""
    n = x.shape[-1]
    nb = quantize.blocks(n, block)
    err = F.pad((x.float() - y.float()).abs(), (0, nb * block - n))
    return err.unflatten(-1, (nb, block)).amax(-1)


def _samples() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 1000, generator=g) * 3
    x[0, 5] = 400.0  # an outlier: only its block loses precision
    x[1, :256] = 0.0  # zero blocks dequantize to exact zeros
    x[2, 300:310] = 1e-30  # tiny values
    return [x, torch.randn(7, generator=g), torch.randn(2, 256, generator=g).bfloat16()]


@pytest.mark.parametrize("block", [1, 7, 64, 256])
def test_int8_error_is_within_half_a_scale_per_block(block: int) -> None:
    for x in _samples():
        q, scales = quantize.quantize(x, block)
        assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
        deq = quantize.dequantize(q, scales, x.shape[-1])
        err = _per_block_error(x, deq, block)
        absmax = _per_block_error(x, torch.zeros_like(x), block)
        bound = quantize.error_bound(scales)
        assert torch.all(err <= bound), (err - bound).max()
        assert torch.all(bound <= absmax / 254 + absmax * 1e-6)  # documented, + fp32 ulps
        assert torch.equal(scales, absmax / 127)
    zero = _samples()[0][1, :256]
    q, s = quantize.quantize(zero, block)
    assert torch.equal(quantize.dequantize(q, s, 256), zero)  # exact zeros, no NaN


def test_int8_error_bound_is_tight_and_nonfinite_stays_visible() -> None:
    """The bound is reached (a broken scale would overshoot it), and a NaN or inf makes
    its block NaN, as a loss scaler needs to see."""
    x = torch.linspace(-1, 1, 2541)  # many values between the int8 steps
    q, s = quantize.quantize(x, 2541)
    err = (quantize.dequantize(q, s, x.numel()) - x).abs().max()
    assert err > 0.9 * float(s[0]) / 2
    y = torch.randn(512)
    y[3] = float("inf")
    q, s = quantize.quantize(y, 256)
    deq = quantize.dequantize(q, s, 512)
    assert deq[:256].isnan().all() and deq[256:].isfinite().all()


@pytest.mark.skipif(not fp8_supported(torch.device("cpu")), reason="no float8_e4m3fn here")
def test_fp8_error_is_within_a_sixteenth_of_the_block_absmax() -> None:
    fp8 = quantize.fp8_dtype()
    assert fp8 is not None
    for x in _samples():
        q, scales = quantize.quantize(x, 64, fp8)
        assert q.dtype == fp8
        deq = quantize.dequantize(q, scales, x.shape[-1])
        err = _per_block_error(x, deq, 64)
        assert torch.all(err <= quantize.error_bound(scales, fp8))
        # Relative where normal: 3 mantissa bits round to within 1/16.
        big = x.float().abs() >= scales.repeat_interleave(64)[: x.shape[-1]] * 2**-6 * 448
        rel = ((x.float() - deq).abs() / x.float().abs().clamp_min(1e-38))[big]
        assert rel.numel() and rel.max() <= 1 / 16 + 1e-6


def test_packing_round_trips_and_quantize_traces_in_one_graph() -> None:
    x = torch.randn(3, 1000)
    buf = torch.zeros(3, quantize.row_bytes(1000, 256), dtype=torch.uint8)
    quantize.pack(x, 256, torch.int8, buf)
    q, s = quantize.quantize(x, 256)
    assert buf.shape[1] % quantize.ALIGN == 0
    assert torch.equal(quantize.unpack(buf, 1000, 256, torch.int8, torch.float32),
                       quantize.dequantize(q, s, 1000))  # fmt: skip
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda t: quantize.dequantize(*quantize.quantize(t, 256), 1000, torch.bfloat16),
        fullgraph=True,  # a graph break would raise
        backend="eager",
    )
    assert torch.equal(compiled(x), quantize.dequantize(q, s, 1000, torch.bfloat16))


# ---- the policy ------------------------------------------------------------------------------

BAD = [
    (CommPolicy(node_size=3), "does not divide the shard group size 4"),
    (CommPolicy(block_size=0), "block_size=0"),
    (CommPolicy(block_size=True), "block_size=True"),
    (CommPolicy(quantize_gather="sometimes"), "quantize_gather='sometimes'"),
    (CommPolicy(quantize_reduce=True), "quantize_reduce needs node_size"),
    (CommPolicy(node_local_backward=True), "node_local_backward needs node_size"),
    (CommPolicy(node_size=0), "node_size=0"),
    (CommPolicy(quant_dtype=torch.float16), "quant_dtype=torch.float16"),
]


@pytest.mark.parametrize(("policy", "message"), BAD, ids=[m for _, m in BAD])
def test_bad_policy_gets_one_clear_error(policy: CommPolicy, message: str) -> None:
    with pytest.raises(ValueError, match="CommPolicy") as info:
        check(policy, 4, torch.device("cpu"))
    assert message in str(info.value)


def test_fp8_is_refused_on_a_device_without_it() -> None:
    fp8 = quantize.fp8_dtype()
    if fp8 is None:
        pytest.skip("this torch has no float8_e4m3fn")
    device = torch.device("cuda", 0)
    if fp8_supported(device):
        pytest.skip("this machine's GPU has fp8")
    with pytest.raises(ValueError, match="has no fp8"):
        check(CommPolicy(quantize_gather="forward", quant_dtype=fp8), 4, device)
    # Nothing quantizes: the dtype is never used, so nothing to refuse.
    assert check(CommPolicy(quant_dtype=fp8), 4, device).quant_dtype == fp8


def test_policy_check_fills_the_node_size_and_says_which_gathers_quantize() -> None:
    p = check(CommPolicy(quantize_reduce=True), 8, torch.device("cpu"), derived_node_size=4)
    assert p.node_size == 4 and p.enabled
    assert check(CommPolicy(node_size=2), 8, torch.device("cpu"), 4).node_size == 2
    assert not CommPolicy().enabled
    fwd, always = CommPolicy(quantize_gather="forward"), CommPolicy(quantize_gather="always")
    assert fwd.quantizes_gather(backward=False) and not fwd.quantizes_gather(backward=True)
    assert always.quantizes_gather(backward=True)
    assert not CommPolicy().quantizes_gather(backward=False)


def test_link_bytes_models() -> None:
    rec = collectives.CollectiveRecord(
        "reduce_scatter", torch.float32, 16, 64, 4, "", ranks=(0, 1, 2, 3)
    )
    direct, ring = observe.LinkBytes(2, rank=1), observe.LinkBytes(2, "ring", rank=1)
    direct(rec, None)
    ring(rec, None)
    assert (direct.intra, direct.inter) == (16, 32)  # a 16-byte piece to 0; to 2 and 3
    assert (ring.intra, ring.inter) == (0, 48)  # 3 pieces to rank 2, on the other node
    with pytest.raises(ValueError, match="model"):
        observe.LinkBytes(2, "tree")


# ---- on 4 ranks, 2 nodes x 2 -----------------------------------------------------------------


def _shard(rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, generator=g)
    x[rank * 37 % n] = 50.0  # an outlier in one block
    return x


def check_node_groups(rank: int, world: int) -> None:
    nodes = node_collectives.node_groups(dist.group.WORLD, L)
    assert (nodes.nodes, nodes.node_size) == (2, 2)
    assert (nodes.node_index, nodes.local_rank) == divmod(rank, L)
    assert nodes.node is not None and nodes.cross is not None
    assert collectives.group_ranks(nodes.node) == [rank // L * L, rank // L * L + 1]
    assert collectives.group_ranks(nodes.cross) == [rank % L, rank % L + L]
    assert node_collectives.node_groups(dist.group.WORLD, L) is nodes  # made once


def check_quantized_gather(rank: int, world: int) -> None:
    n = 1000
    shards = [_shard(r, n) for r in range(world)]
    full = torch.stack(shards)
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.empty(world, n, dtype=dtype)
        send, recv = node_collectives.quantized_buffers(n, world, BLOCK, out.device)
        node_collectives.quantized_all_gather(
            out, shards[rank], send, recv, dist.group.WORLD, "t", BLOCK, torch.int8
        ).wait()
        _, scales = quantize.quantize(full, BLOCK)
        bound = quantize.error_bound(scales)
        if dtype == torch.bfloat16:  # and the rounding to bf16: half an ulp of the value
            bound = bound + _per_block_error(full, torch.zeros_like(full), BLOCK) * 2**-8
        assert torch.all(_per_block_error(full, out, BLOCK) <= bound)
        assert not torch.equal(out.float(), full)  # it did quantize


def _rs_inputs(rank: int, numel: int, integers: bool = False) -> list[torch.Tensor]:
    """Every rank's reduce-scatter input (``[W, numel]``), made alike on every rank."""
    out = []
    for r in range(W):
        g = torch.Generator().manual_seed(7 + r)
        x = torch.randn(W, numel, generator=g)
        out.append(x.mul(8).round() if integers else x)
    return out


def _hierarchical(x: torch.Tensor, quantized: bool = True) -> torch.Tensor:
    nodes = node_collectives.node_groups(dist.group.WORLD, L)
    numel = x.shape[1]
    rs_in = torch.empty(W * numel)
    node_collectives.node_major(rs_in, nodes).copy_(x.view(W // L, L, numel))
    out = torch.empty(numel)
    node_collectives.hierarchical_reduce_scatter(
        out, rs_in, nodes, "t", W, BLOCK, torch.int8, quantize=quantized
    ).wait()
    return out


def _plain(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape[1])
    collectives.reduce_scatter(
        out, x.reshape(-1).clone(), dist.group.WORLD, "t", divide_by=W
    ).wait()
    return out


def check_hierarchical_reduce_scatter_within_the_bound(rank: int, world: int) -> None:
    numel = 1000
    xs = _rs_inputs(rank, numel)
    got, want = _hierarchical(xs[rank]), _plain(xs[rank])
    exact = torch.stack(xs).sum(0)[rank] / W
    assert torch.allclose(want, exact, atol=1e-5)
    # Node k' sums its ranks' rows for this rank; the rows of the other node are
    # quantized, each within its bound, then everything is divided by W.
    k = rank // L
    bound = torch.zeros(quantize.blocks(numel, BLOCK))
    for node in range(W // L):
        if node != k:
            partial = sum(xs[node * L + lr][rank] for lr in range(L))
            _, scales = quantize.quantize(partial, BLOCK)
            bound += quantize.error_bound(scales)
    bound = bound / W + 1e-5  # plus fp32 summation order
    err = _per_block_error(exact, got, BLOCK)
    assert torch.all(err <= bound), (err - bound).max()
    assert not torch.equal(got, want)  # it did quantize


def check_hierarchical_reduce_scatter_is_exact_without_quantization(rank: int, world: int) -> None:
    xs = _rs_inputs(rank, 333, integers=True)  # sums of small integers are exact
    assert torch.equal(_hierarchical(xs[rank], quantized=False), _plain(xs[rank]))


def _counted(fn: object, node_size: int = L) -> observe.LinkBytes:
    counter = observe.LinkBytes(node_size)
    remove = observe.add_collective_observer(counter)
    try:
        fn()  # type: ignore[operator]
    finally:
        remove()
    return counter


def check_bytes_per_link(rank: int, world: int) -> None:
    numel = 1 << 14  # a shard of 16k elements: padding and scales are small next to it
    x = _rs_inputs(rank, numel)[rank]
    plain = _counted(lambda: _plain(x))
    hier = _counted(lambda: _hierarchical(x))
    # Direct model: the plain one sends 2 pieces of fp32 out of the node, 1 inside.
    assert (plain.inter, plain.intra) == (2 * numel * 4, numel * 4)
    # Hierarchical: 2 pieces of fp32 inside (the node's reduce-scatter of 2 rows per
    # member), one int8 row plus scales out.
    assert hier.intra == 2 * numel * 4
    assert hier.inter == quantize.row_bytes(numel, BLOCK)
    assert 1 / 8 <= hier.inter / plain.inter <= 1 / 8 * 1.07, hier.inter / plain.inter
    shard = _shard(rank, numel)
    bf16 = _counted(
        lambda: collectives.all_gather(
            torch.empty(world * numel, dtype=torch.bfloat16),
            shard.bfloat16(),
            dist.group.WORLD,
            "t",
        ).wait()
    )

    def quantized() -> None:
        send, recv = node_collectives.quantized_buffers(numel, world, BLOCK, shard.device)
        out = torch.empty(world, numel, dtype=torch.bfloat16)
        node_collectives.quantized_all_gather(
            out, shard, send, recv, dist.group.WORLD, "t", BLOCK, torch.int8
        ).wait()

    q = _counted(quantized)
    assert bf16.inter == 2 * numel * 2 and bf16.intra == numel * 2
    assert 1 / 2 <= q.inter / bf16.inter <= 1 / 2 * 1.07, q.inter / bf16.inter
    assert q.by_kind[("all_gather", "inter")] == q.inter


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 48), nn.Tanh(), nn.Linear(48, 24))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model


def _states(model: nn.Module) -> list:
    return [m._shardwise_state for m in model.modules() if hasattr(m, "_shardwise_state")]


def check_reduce_job_reduces_through_nodes(rank: int, world: int) -> None:
    """A module's reduction with ``quantize_reduce`` (settings.comm_policy, as fully_shard
    will set it): the gradients match the flat reduction's within the quantization error,
    and the inter-node step is an all-to-all of bytes."""
    torch.manual_seed(1 + rank)
    x = torch.randn(6, 40)
    grads = []
    for policy in (None, CommPolicy(quantize_reduce=True, node_size=L, block_size=BLOCK)):
        model = _model()
        for state in _states(model):
            state.change_settings(comm_policy=policy)
        kinds: list[tuple[str, torch.dtype, int]] = []
        remove = observe.add_collective_observer(
            lambda rec, _, seen=kinds: seen.append((rec.kind, rec.dtype, rec.group_size))
        )
        model(x).square().sum().backward()
        remove()
        grads.append([p.grad.to_local().clone() for p in model.parameters()])
        if policy is None:
            assert ("reduce_scatter", torch.float32, W) in kinds
        else:
            assert ("reduce_scatter", torch.float32, W) not in kinds
            assert ("reduce_scatter", torch.float32, L) in kinds
            assert ("all_to_all", torch.uint8, W // L) in kinds
    for flat, hier in zip(*grads):
        scale = flat.abs().max() if flat.numel() else 0
        torch.testing.assert_close(hier, flat, atol=float(scale) / 100 + 1e-6, rtol=0)
    assert any(not torch.equal(a, b) for a, b in zip(*grads))  # it did quantize


def check_quantized_gather_strategy(rank: int, world: int) -> None:
    """``gather.Quantized`` on a real layout: its rank-major buffer within the per-block
    bound of every rank's flat shard, the parameters laid out as the plain gather lays
    them, and backward's gathers at full precision under ``"forward"``."""
    model = _model()
    layout = next(s.group for s in _states(model) if s.group is not None).layout
    group = dist.group.WORLD
    shards = torch.stack(collectives.all_gather_objects(layout.flat.clone()))
    _, scales = quantize.quantize(shards, BLOCK)
    per_block = quantize.error_bound(scales)

    def gathered(policy: CommPolicy | None, backward: bool = False) -> torch.Tensor:
        comm = gather.GatherComm(group, None, None, None, False, policy)
        way = gather.choose(layout, comm, None)
        pending = way.issue(None, backward)
        assert pending is not None
        pending.wait()
        if (
            isinstance(way, gather.Quantized)
            and policy is not None
            and policy.quantizes_gather(backward)
        ):
            rank_major = way.buffers[-1].view(world, layout.shard_numel)
            assert torch.all(_per_block_error(shards, rank_major, BLOCK) <= per_block)
        way.finish()
        return layout.unsharded_flat.clone()

    plain = gathered(None)
    forward = CommPolicy(quantize_gather="forward", block_size=BLOCK)
    q = gathered(forward)
    assert not torch.equal(q, plain)
    assert (q - plain).abs().max() <= per_block.max()  # placed where the plain gather puts it
    assert torch.equal(gathered(forward, backward=True), plain)
    assert torch.equal(gathered(CommPolicy(quantize_gather="always", block_size=BLOCK), True), q)


CHECKS = {
    "node_groups": check_node_groups,
    "quantized_gather": check_quantized_gather,
    "hierarchical_reduce_scatter_within_the_bound": check_hierarchical_reduce_scatter_within_the_bound,
    "hierarchical_reduce_scatter_is_exact_without_quantization": check_hierarchical_reduce_scatter_is_exact_without_quantization,
    "bytes_per_link": check_bytes_per_link,
    "reduce_job_reduces_through_nodes": check_reduce_job_reduces_through_nodes,
    "quantized_gather_strategy": check_quantized_gather_strategy,
}

test_on_two_nodes_of_two = named_check_test(__name__, CHECKS, W)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_gpu_kernels_pack_and_unpack_as_the_torch_ops() -> None:
    """On a GPU, pack and unpack run one Triton kernel each (quantize_gpu.py): the same
    bytes and values as quantize.py's torch ops on finite data (an uneven last block, a
    block of zeros), NaN for a block with a NaN, into bf16 and fp32."""
    from shardwise.comm import quantize, quantize_gpu

    block, rows, n = 256, 3, 5 * 256 + 77
    if not quantize_gpu.usable(torch.empty(0, device="cuda"), block, torch.int8):
        pytest.skip("no Triton here")
    x = torch.randn(rows, n, device="cuda") * torch.logspace(-3, 3, rows, device="cuda")[:, None]
    x[1, 256:512] = 0
    nb, rb = quantize.blocks(n, block), quantize.row_bytes(n, block)
    fused = torch.zeros(rows, rb, dtype=torch.uint8, device="cuda")
    quantize.pack(x, block, torch.int8, fused)
    q, s = quantize.quantize(x, block)
    torch.testing.assert_close(fused[:, : nb * 4].view(torch.float32), s, rtol=0, atol=0)
    got = fused[:, nb * 4 : nb * 4 + nb * block].view(torch.int8).view(rows, nb, block)
    assert torch.equal(got, q)
    for dtype in (torch.bfloat16, torch.float32):
        out = torch.empty(rows, n, dtype=dtype, device="cuda")
        quantize.unpack_into(out, fused, n, block, torch.int8)
        assert torch.equal(out, quantize.dequantize(q, s, n, dtype))
        assert torch.equal(quantize.unpack(fused, n, block, torch.int8, dtype), out)
    x[2, 3] = float("nan")
    quantize.pack(x, block, torch.int8, fused)
    out = quantize.unpack(fused, n, block, torch.int8, torch.float32)
    assert out[2, :block].isnan().all() and out[2, block:].isfinite().all()
