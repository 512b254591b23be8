"""Tensor subclasses that gather themselves (FSDP2's ``fsdp_pre_all_gather`` /
``fsdp_post_all_gather``), as torchao's float8 weights do.

``Bf16Gather`` is a minimal such subclass, built like float8's: its piece,
divided by a scale agreed over the mesh (the largest magnitude), goes over
the wire in bf16 (half the bytes of fp32); the module computes with the
gathered values times the scale, in fp32. The scale changes as the weights
train, so a stale one shows. Its one-process reference rounds the same
weights the same way in forward with a straight-through gradient; FSDP2,
given the same subclass, runs beside shardwise. All checks share one set of
processes.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.utils.parametrize as parametrize
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils import _pytree as pytree

import shardwise
from dist_utils import named_check_test
from models import VOCAB, Tiny, batches
from shardwise import fully_shard
from shardwise.comm import collectives
from test_parity_and_prefetch import global_mean

pytestmark = pytest.mark.timeout(300)
aten = torch.ops.aten

# Ops whose results stay wrapped (views, copies, new tensors like it); others return plain tensors.
_WRAP = {
    aten.detach.default,
    aten.alias.default,
    aten.view.default,
    aten.slice.Tensor,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.clone.default,
    aten._to_copy.default,
    aten.empty_like.default,
    aten.zeros_like.default,
    aten.new_zeros.default,
    aten.new_empty.default,
    aten.as_strided.default,
}


class Bf16Gather(torch.Tensor):
    """An fp32 weight gathered in bf16."""

    calls: ClassVar[Counter[str]] = Counter()

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> Bf16Gather:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, data.shape, strides=data.stride(), dtype=data.dtype, device=data.device
        )

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data

    def __repr__(self) -> str:
        return f"Bf16Gather({self._data!r})"

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict, ctx: Any, size: Any, stride: Any) -> Bf16Gather:
        return Bf16Gather(inner["_data"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        unwrap = lambda t: t._data  # noqa: E731
        out = func(
            *pytree.tree_map_only(cls, unwrap, args),
            **pytree.tree_map_only(cls, unwrap, kwargs or {}),
        )
        if func.overloadpacket.__name__.endswith("_"):  # in place: the wrapper is the result
            return args[0] if isinstance(out, torch.Tensor) else out
        if func in _WRAP:
            return pytree.tree_map_only(torch.Tensor, cls, out)
        return out

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):  # type: ignore[no-untyped-def]
        Bf16Gather.calls["pre"] += 1
        assert isinstance(module, nn.Module) and tuple(outer_size)[1:] == tuple(self.shape)[1:]
        scale = self._data.abs().amax()
        dist.all_reduce(scale, dist.ReduceOp.MAX, group=mesh.get_group())
        return ((self._data / scale).to(torch.bfloat16),), (scale,)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):  # type: ignore[no-untyped-def]
        (data,), (scale,) = outputs, metadata
        if out is not None:  # ``data`` was refilled in place: only the scale is new
            assert isinstance(out, Bf16Weight) and out._bf16.data_ptr() == data.data_ptr()
            Bf16Gather.calls["post(out=)"] += 1
            out._scale = scale
            return None
        Bf16Gather.calls["post"] += 1
        return Bf16Weight(data, param_dtype, scale), (data,)


class Bf16Weight(torch.Tensor):
    """The gathered weight: bf16 data and its scale, computed with in ``dtype`` (as
    float8's weight is fp8 data and a scale, read by its matmul)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> Bf16Weight:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, data.shape, strides=data.stride(), dtype=dtype, device=data.device
        )

    def __init__(self, data: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> None:
        self._bf16, self._scale = data, scale

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in (aten.detach.default, aten.alias.default, aten.as_strided.default):
            w = args[0]
            return cls(func(w._bf16, *args[1:], **(kwargs or {})), w.dtype, w._scale)
        upcast = lambda t: t._bf16.to(t.dtype) * t._scale  # noqa: E731
        return func(
            *pytree.tree_map_only(cls, upcast, args),
            **pytree.tree_map_only(cls, upcast, kwargs or {}),
        )


class PreOnly(Bf16Gather):
    fsdp_post_all_gather = None  # type: ignore[assignment]

    def __getattribute__(self, name: str) -> Any:
        if name == "fsdp_post_all_gather":
            raise AttributeError(name)
        return super().__getattribute__(name)


def linears(model: Tiny) -> list[nn.Linear]:
    return [m for b in model.blocks for m in (b.fc1, b.fc2)]


def convert(model: Tiny, cls: type = Bf16Gather) -> Tiny:
    """Swap the blocks' Linear weights for the subclass (as torchao's conversion does)."""
    for m in linears(model):
        m.weight = nn.Parameter(cls(m.weight.detach()))
    return model


class RoundToBf16(nn.Module):
    """The reference's view of a gathered weight: scaled bf16 values, gradient passed straight."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        scale = w.detach().abs().amax()
        return w + ((w / scale).to(torch.bfloat16).to(w.dtype) * scale - w).detach()


def loss_of(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), idx[:, 1:].reshape(-1))


def shard(model: Tiny, fsdp: Any = fully_shard) -> Tiny:
    for b in model.blocks:
        fsdp(b)
    fsdp(model)
    return model


def train(model: nn.Module, steps: list[torch.Tensor], shard_batch: bool) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    rank, world = dist.get_rank(), dist.get_world_size()
    for idx in steps:
        loss = loss_of(model, idx.chunk(world)[rank] if shard_batch else idx)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(loss) if shard_batch else loss.detach())
    return losses


def gathered_bytes(model: Tiny, idx: torch.Tensor) -> int:
    """Bytes the blocks' all-gathers move in one forward."""
    seen: list[int] = []
    remove = collectives.add_observer(
        lambda rec, _: (
            seen.append(rec.nbytes)
            if rec.kind == "all_gather" and rec.label.startswith("blocks.")
            else None
        )
    )
    try:
        with torch.no_grad():
            model(idx)
    finally:
        remove()
    return sum(seen)


def check_parity(rank: int, world: int) -> None:
    """Gathered through the hooks, training matches one process, uneven pieces
    included, and FSDP2's run (which needs even pieces from such hooks)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    for hidden in (13, 16):  # 13 rows over 2 ranks: pieces of 7 and 6 rows
        torch.manual_seed(0)
        base = Tiny(hidden=hidden)
        ref = copy.deepcopy(base)
        for m in linears(ref):
            parametrize.register_parametrization(m, "weight", RoundToBf16())
        model = shard(convert(copy.deepcopy(base)))
        local = model.blocks[0].fc1.weight._local_tensor
        assert type(local) is Bf16Gather, type(local)
        assert local.shape == (hidden // 2 + (1 - rank) * (hidden % 2), 8)  # torch.chunk's rows

        Bf16Gather.calls.clear()
        steps = batches(3)
        ours = train(model, steps, shard_batch=True)
        # Two blocks, two weights each, three steps; a gather in forward and one in
        # backward: post() the first time, post(out=) refills after that.
        assert Bf16Gather.calls["pre"] == 2 * 2 * 3 * 2, Bf16Gather.calls
        assert Bf16Gather.calls["post"] == 2 * 2, Bf16Gather.calls
        assert Bf16Gather.calls["post(out=)"] == 2 * 2 * (3 * 2 - 1), Bf16Gather.calls
        want = train(ref, steps, shard_batch=False)
        for a, b in zip(ours, want):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        for m, r in zip(linears(model), linears(ref)):
            original = r.parametrizations.weight.original
            torch.testing.assert_close(m.weight.full_tensor(), original, atol=1e-5, rtol=1e-5)
        # Nothing stays gathered: the hooks' outputs are freed with the rest.
        for b in model.blocks:
            assert b._shardwise_state.group.unsharded_bytes == 0
        if hidden % 2 == 0:
            theirs = shard(convert(copy.deepcopy(base)), torch_fully_shard)
            for a, c in zip(ours, train(theirs, steps, shard_batch=True)):
                torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)


def check_bytes_halved(rank: int, world: int) -> None:
    """The wire carries bf16 for the converted weights: about half of fp32's bytes."""
    torch.manual_seed(0)
    base = Tiny(d=16, hidden=64)
    plain = shard(copy.deepcopy(base))
    converted = shard(convert(copy.deepcopy(base)))
    idx = batches(1)[0]
    ratio = gathered_bytes(converted, idx) / gathered_bytes(plain, idx)
    # fc1, fc2: 2 x 1024 elements go bf16; the norm's 32 fp32 elements stay: (2048*2 + 128) / (2048*4 + 128)
    assert 0.5 < ratio < 0.53, ratio
    with torch.no_grad():
        torch.testing.assert_close(
            converted(idx), plain(idx).detach(), atol=0.05, rtol=0.05
        )  # the same model, in bf16-rounded weights


def check_refused(rank: int, world: int) -> None:
    """What the hooks do not combine with is refused before anything changes."""
    torch.manual_seed(0)
    model = convert(Tiny(), PreOnly)
    before = model.blocks[0].fc1.weight
    with pytest.raises(ValueError, match="needs both"):
        fully_shard(model.blocks[0])
    assert model.blocks[0].fc1.weight is before
    model = convert(Tiny(hidden=16))
    mixed = Tiny(hidden=16)  # fc1 hooked, fc2 plain
    mixed.blocks[0].fc1.weight = nn.Parameter(Bf16Gather(mixed.blocks[0].fc1.weight.detach()))

    def plain_on_dim_1(p: nn.Parameter) -> Shard:  # the hooked weight itself stays on dim 0
        return Shard(0) if isinstance(p, Bf16Gather) or p.dim() == 1 else Shard(1)

    for m, kw, what in (
        (model, {"offload_policy": shardwise.CPUOffloadPolicy(pin_memory=False)}, "CPU offload"),
        (model, {"shard_placement_fn": lambda p: Shard(1)}, r"Shard\(1\)"),
        (mixed, {"shard_placement_fn": plain_on_dim_1}, r"Shard\(1\) from shard_placement_fn in"),
    ):
        block = m.blocks[0]
        before = block.fc1.weight
        with pytest.raises(ValueError, match=what):
            fully_shard(block, **kw)
        assert block.fc1.weight is before and not isinstance(block.fc2.weight, DTensor)
        assert not isinstance(block, shardwise.FSDPModule)
    # One row over two ranks: the last rank would call the hooks on an empty piece.
    one_row = nn.Linear(8, 1, bias=False)
    one_row.weight = nn.Parameter(Bf16Gather(one_row.weight.detach()))
    with pytest.raises(ValueError, match="1 rows over 2 ranks"):
        fully_shard(one_row)
    assert not isinstance(one_row.weight, DTensor)
    # A tensor parallel weight whose local piece has the hooks.
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))
    tp = nn.Linear(8, 4, bias=False)
    local = Bf16Gather(tp.weight.detach())
    tp.weight = nn.Parameter(DTensor.from_local(local, mesh["tp"], [Replicate()], run_check=False))
    with pytest.raises(ValueError, match="tensor parallelism"):
        fully_shard(tp, mesh=mesh["dp"])
    assert tp.weight.device_mesh == mesh["tp"]


CHECKS = {
    "parity with one process and FSDP2": check_parity,
    "all-gather bytes halved": check_bytes_halved,
    "refused combinations": check_refused,
}


test_subclass_gather_hooks = named_check_test(__name__, CHECKS, {2: sorted(CHECKS)}, timeout=250)
