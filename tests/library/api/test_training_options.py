"""Training features: mixed precision, accumulation, HSDP, clipping, meta-device init.

Each test trains several steps against a single-process reference on the whole batch.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import shardwise
from dist_utils import run_distributed
from models import Net, TwoPaths, batches, loss_fn
from shardwise import MixedPrecisionPolicy
from shardwise.comm import collectives
from test_parity_and_prefetch import assert_between_steps, global_mean, reference_step, shard_net

pytestmark = pytest.mark.timeout(240)


def reference_and_sharded(hsdp: bool) -> tuple[Net, Net]:
    """The seeded single-process reference and a sharded copy (on a 2x2 HSDP mesh if asked)."""
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    shard_net(model, {"mesh": shardwise.hsdp_mesh(2) if hsdp else None})
    return ref, model


def bf16_worker(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ref = Net(d=16)
    model = copy.deepcopy(ref)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard_net(model, {"mp_policy": policy})
    gathers: list[collectives.CollectiveRecord] = []
    reduces: list[collectives.CollectiveRecord] = []
    remove = collectives.add_observer(
        lambda rec, _: (gathers if rec.kind == "all_gather" else reduces).append(rec)
    )
    # Each parameter is gathered (and cast) straight into its own storage: no
    # copy-out from a rank-major buffer after the gathers.
    copy_outs = []
    split_copy = torch.split_with_sizes_copy

    def counted(*args: Any, **kwargs: Any) -> Any:
        copy_outs.append(1)
        return split_copy(*args, **kwargs)

    torch.split_with_sizes_copy = counted
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for idx in batches(5):
        loss = loss_fn(model, idx.chunk(world)[rank])
        loss.backward()
        assert_between_steps(model)
        opt.step()
        opt.zero_grad()
        ref_loss = reference_step(ref, ref_opt, idx)
        torch.testing.assert_close(global_mean(loss), ref_loss, atol=3e-2, rtol=3e-2)
    remove()
    torch.split_with_sizes_copy = split_copy
    assert not copy_outs, f"{len(copy_outs)} copy-outs after in-place gathers"
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and p.to_local().dtype == torch.float32, name
        assert p.grad is None
    assert gathers and all(r.dtype == torch.bfloat16 for r in gathers)
    assert reduces and all(r.dtype == torch.float32 for r in reduces)
    # bytes on the wire: half of the fp32 parameters' bytes per gather
    n_fp32 = sum(p.numel() for p in model.extra.parameters()) * 4
    extra = [r for r in gathers if r.label == "extra"]
    padded = extra[0].numel  # gathered elements incl. per-rank padding
    assert extra[0].nbytes == padded * 2 and padded * 4 < n_fp32 * 1.5


def test_bf16_params_fp32_reduce_tracks_reference() -> None:
    run_distributed(bf16_worker, 2)


def accumulation_worker(rank: int, world: int, hsdp: bool) -> None:
    ref, model = reference_and_sharded(hsdp)
    if hsdp:
        assert model.extra.fc1.weight.placements == (Replicate(), Shard(0))
    seen: Counter[str] = Counter()
    order: list[tuple[str, str]] = []  # collectives issued and waited for, in turn

    def note(rec: collectives.CollectiveRecord, p: collectives.Pending) -> None:
        seen.update([rec.kind])
        order.append(("issue", rec.kind))
        p.on_done.append(lambda q: order.append(("done", q.kind)))

    remove = collectives.add_observer(note)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    n_reducing = 6  # (a, b) x 2 stages, extra, root
    for idx in batches(2, batch=16):
        micro = idx.chunk(world)[rank].chunk(4)
        for i, mb in enumerate(micro):
            seen.clear()
            if i < 3:
                with shardwise.no_sync(model):
                    (loss_fn(model, mb) / 4).backward()
                assert seen["reduce_scatter"] == 0 and seen["all_reduce"] == 0, seen
            else:
                order.clear()
                (loss_fn(model, mb) / 4).backward()
                assert seen["reduce_scatter"] == n_reducing, seen
                assert seen["all_reduce"] == (n_reducing if hsdp else 0), seen
                if hsdp:  # the first all-reduce runs beside the next module's backward
                    ar = order.index(("issue", "all_reduce"))
                    rs = order.index(("issue", "reduce_scatter"), ar)
                    assert ar < rs < order.index(("done", "all_reduce"), ar), order
        assert_between_steps(model)
        opt.step()
        opt.zero_grad()
        loss_fn(ref, idx).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    remove()
    for (n, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.full_tensor(), rp.detach(), atol=1e-5, rtol=1e-5, msg=n)


def test_accumulation_reduces_once_and_matches_whole_batch() -> None:
    run_distributed(accumulation_worker, 2, False)


def test_hsdp_2x2_parity_with_accumulation() -> None:
    run_distributed(accumulation_worker, 4, True)


def alternating_heads_worker(rank: int, world: int, hsdp: bool, hold: str) -> None:
    """Accumulation where the last (synced) microbatch does not run a module that
    an earlier one did (the decoder: a task that skips it): its local sum
    (``hold="sync"``: gradient sync off) or its held-back reduce-scatter
    (``"all_reduce"``: HSDP's all-reduce off) is reduced at the end of that
    backward, in time for the step, not at its next use."""
    torch.manual_seed(0)
    ref = TwoPaths()
    model = copy.deepcopy(ref)
    mesh = shardwise.hsdp_mesh(2) if hsdp else None
    for m in (model.enc, model.dec, model):
        shardwise.fully_shard(m, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(3)
    for step in range(3):
        x = torch.randn(2, 8, 8, generator=g)  # one microbatch per task
        for i, path in enumerate(["ed", "e"]):
            if hold == "sync":
                model.set_requires_gradient_sync(i == 1)
            else:
                model.set_requires_all_reduce(i == 1)
            model(x[i].chunk(world)[rank], path).backward()
            ref(x[i], path).backward()
        assert_between_steps(model)
        for (n, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
            assert p.grad is not None, f"step {step}: {n} has no gradient"
            torch.testing.assert_close(p.grad.full_tensor(), rp.grad, msg=f"{step}: {n}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for (n, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.full_tensor(), rp.detach(), msg=n)


@pytest.mark.parametrize(
    "world,hsdp,hold", [(2, False, "sync"), (4, True, "sync"), (4, True, "all_reduce")]
)
def test_accumulated_module_absent_from_the_synced_microbatch(
    world: int, hsdp: bool, hold: str
) -> None:
    run_distributed(alternating_heads_worker, world, hsdp, hold)


def keep_gathered_worker(rank: int, world: int) -> None:
    """set_reshard_after_backward(False): no re-gather between microbatches."""
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    shard_net(model, {})
    seen: Counter[str] = Counter()
    remove = collectives.add_observer(lambda rec, _: seen.update([rec.kind]))
    idx = batches(1)[0]
    micro = idx.chunk(world)[rank].chunk(2)
    model.set_reshard_after_backward(False)
    model.set_reshard_after_forward(False)
    with shardwise.no_sync(model):
        (loss_fn(model, micro[0]) / 2).backward()
    first = seen["all_gather"]
    model.set_reshard_after_backward(True)
    (loss_fn(model, micro[1]) / 2).backward()
    assert seen["all_gather"] == first, "a gathered module was gathered again"
    remove()
    assert_between_steps(model)
    loss_fn(ref, idx).backward()
    for (n, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), rp.grad, atol=1e-5, rtol=1e-5, msg=n)


def test_reshard_after_backward_false_keeps_parameters_between_microbatches() -> None:
    run_distributed(keep_gathered_worker, 2)


def clip_worker(rank: int, world: int, hsdp: bool) -> None:
    ref, model = reference_and_sharded(hsdp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step, idx in enumerate(batches(3)):
        loss_fn(model, idx.chunk(world)[rank]).backward()
        loss_fn(ref, idx).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        if step == 0 and not hsdp:
            # torch's own works on a single mesh; it returns a DTensor
            grads = [p.grad.full_tensor().clone() for p in model.parameters()]
            torch_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
            if isinstance(torch_norm, DTensor):
                torch_norm = torch_norm.full_tensor()
            torch.testing.assert_close(torch_norm, ref_norm, atol=1e-5, rtol=1e-5)
            for g, p in zip(grads, model.parameters()):
                torch.testing.assert_close(p.grad.full_tensor(), g)
        norm = shardwise.clip_grad_norm_(model.parameters(), 0.05)
        torch.testing.assert_close(norm, ref_norm, atol=1e-5, rtol=1e-5)
        for (n, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), rp.grad, atol=1e-6, rtol=1e-5, msg=n)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    for (n, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.full_tensor(), rp.detach(), atol=1e-5, rtol=1e-5, msg=n)


@pytest.mark.parametrize(
    ("world", "hsdp"), [(2, False), (4, False), (4, True)], ids=["w2", "w4", "hsdp-2x2"]
)
def test_clip_grad_norm_parity(world: int, hsdp: bool) -> None:
    run_distributed(clip_worker, world, hsdp)


def init_weights(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Embedding):
        nn.init.normal_(m.weight, std=0.5)
    elif isinstance(m, Net):
        nn.init.normal_(m.pos, std=0.1)


def meta_worker(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ref = Net()
    torch.manual_seed(1)
    shardwise.materialize(ref, None, init_weights)  # the single-process reference
    with torch.device("meta"):
        model = Net()
    shard_net(model, {})
    for p in model.parameters():
        assert p.to_local().is_meta
    torch.manual_seed(1)
    shardwise.materialize(model, "cpu", init_weights)
    for (n, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        assert isinstance(p, DTensor) and not p.to_local().is_meta
        torch.testing.assert_close(p.full_tensor(), rp.detach(), msg=n)
    # and it trains like the reference
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for idx in batches(3):
        loss = loss_fn(model, idx.chunk(world)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = reference_step(ref, ref_opt, idx)
        torch.testing.assert_close(global_mean(loss), ref_loss, atol=1e-5, rtol=1e-5)


def test_meta_device_init_matches_reference() -> None:
    run_distributed(meta_worker, 2)


def bad_training_input_worker(rank: int, world: int) -> dict[str, str]:
    msgs = {}
    with pytest.raises(ValueError) as e:
        shardwise.hsdp_mesh(3)
    msgs["hsdp"] = str(e.value)
    with pytest.raises(ValueError) as e:
        MixedPrecisionPolicy(param_dtype=torch.int32)
    msgs["dtype"] = str(e.value)
    plain = nn.Linear(2, 2)
    with pytest.raises(TypeError) as e:
        with shardwise.no_sync(plain):
            pass
    msgs["no_sync"] = str(e.value)
    with pytest.raises(AttributeError):
        plain.set_requires_gradient_sync(False)  # type: ignore[operator]
    return msgs


def test_bad_training_input() -> None:
    msgs = run_distributed(bad_training_input_worker, 2)[0]
    assert "divisor of the world size (2)" in msgs["hsdp"]
    assert "param_dtype" in msgs["dtype"] and "floating-point" in msgs["dtype"]
    assert "fully_shard" in msgs["no_sync"]
