"""Core runtime: parity with a single process, the recompute-prefetch regression, collective counts.

Every multi-process test runs real gloo ranks through ``run_distributed``,
which fails (never hangs) after a timeout.
"""

from __future__ import annotations

import copy
import math
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import shardwise
from dist_utils import run_distributed
from models import Deep, Net, TwoLinears, batches, loss_fn
from shardwise import FSDPModule, Phase, fully_shard
from shardwise.comm import collectives
from shardwise.runtime.param_group import GroupState

pytestmark = pytest.mark.timeout(240)


def sharded_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def assert_between_steps(model: nn.Module) -> None:
    """The lifecycle's promise after every backward."""
    for name, p in model.named_parameters():
        assert isinstance(p, nn.Parameter) and isinstance(p, DTensor), f"{name} left unsharded"
        assert p.placements[-1] == Shard(0), name
    for m in sharded_modules(model):
        assert m.phase is Phase.IDLE, (m, m.phase)
        group = m._shardwise_state.group
        assert group is None or group.unsharded_bytes == 0, (
            f"{m._shardwise_state.label} still holds storage"
        )
    ctx = model.fsdp_context  # type: ignore[attr-defined]
    assert ctx is not None and ctx.phase is Phase.IDLE


def shard_net(model: Net, cfg: dict) -> None:
    """Every block, then the root; cfg may set raf, shard_stage, mesh, mp_policy, check."""
    kw = {
        "mesh": cfg.get("mesh"),
        "mp_policy": cfg.get("mp_policy"),
        "check": cfg.get("check", False),
    }
    raf = cfg.get("raf", True)
    for stage in model.stages:
        fully_shard(stage.a, reshard_after_forward=raf, **kw)
        fully_shard(stage.b, reshard_after_forward=raf, **kw)
        if cfg.get("shard_stage", False):
            fully_shard(stage, **kw)  # a sharded parent with no parameters of its own
    fully_shard(model.extra, reshard_after_forward=raf, **kw)
    fully_shard(model, **kw)


def make_opt(kind: str, params) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def reference_step(
    ref: nn.Module, ref_opt: torch.optim.Optimizer, idx: torch.Tensor
) -> torch.Tensor:
    """One step of the single-process reference on the whole batch; returns its loss."""
    loss = loss_fn(ref, idx)
    loss.backward()
    ref_opt.step()
    ref_opt.zero_grad()
    return loss.detach()


def step_and_compare(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    ref: nn.Module,
    ref_opt: torch.optim.Optimizer,
    idx: torch.Tensor,
    after_backward=None,
) -> None:
    """One sharded step on this rank's slice beside one reference step on the whole
    batch; the lifecycle holds after backward and the losses match."""
    rank, world = dist.get_rank(), dist.get_world_size()
    loss = loss_fn(model, idx.chunk(world)[rank])
    loss.backward()
    assert_between_steps(model)
    if after_backward is not None:
        after_backward()
    opt.step()
    opt.zero_grad()
    ref_loss = reference_step(ref, ref_opt, idx)
    torch.testing.assert_close(global_mean(loss), ref_loss, atol=1e-5, rtol=1e-5)


def global_mean(loss: torch.Tensor) -> torch.Tensor:
    """The sharded run's loss over the whole batch: the mean of the ranks' slice losses."""
    t = loss.detach().float().clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


def parity_worker(rank: int, world: int, cfg: dict) -> None:
    torch.manual_seed(0)
    device = torch.device(cfg.get("device", "cpu"))
    ref = Net(ac="none", unused=cfg.get("unused", False)).to(device)
    if cfg.get("frozen"):
        for p in ref.stages[0].a.norm.parameters():
            p.requires_grad_(False)
    model = copy.deepcopy(ref)
    model.ac = cfg.get("ac", "none")
    shard_net(model, cfg)
    opt = make_opt(cfg["opt"], model.parameters())
    ref_opt = make_opt(cfg["opt"], ref.parameters())
    for idx in batches(cfg.get("steps", 4)):
        idx = idx.to(device)
        loss = loss_fn(model, idx.chunk(world)[rank])
        loss.backward()
        assert_between_steps(model)
        if cfg.get("unused"):
            assert model.extra.unused.weight.grad is None
        if cfg.get("frozen"):
            assert model.stages[0].a.norm.weight.grad is None
        opt.step()
        opt.zero_grad(set_to_none=cfg.get("set_to_none", True))
        ref_loss = reference_step(ref, ref_opt, idx)
        torch.testing.assert_close(global_mean(loss), ref_loss, atol=1e-5, rtol=1e-5)
    for (name, p), (rname, rp) in zip(model.named_parameters(), ref.named_parameters()):
        assert name == rname
        torch.testing.assert_close(p.full_tensor(), rp.detach(), atol=1e-5, rtol=1e-5, msg=name)


PARITY = {
    "plain-adamw-w2": (2, {"opt": "adamw", "shard_stage": True}),
    "reentrant-sgd-w3": (3, {"opt": "sgd", "ac": "reentrant"}),
    "nonreentrant-frozen-zero-w4": (
        4,
        {"opt": "adamw", "ac": "non-reentrant", "frozen": True, "set_to_none": False},
    ),
    "parent-reentrant-keep-w2": (
        2,
        {"opt": "adamw", "ac": "parent-reentrant", "raf": False, "shard_stage": True},
    ),
    "parent-unused-w3": (3, {"opt": "sgd", "ac": "parent", "unused": True}),
    "selective-unused-frozen-w4": (
        4,
        {"opt": "sgd", "ac": "selective", "unused": True, "frozen": True},
    ),
    "keep-after-forward-w2": (2, {"opt": "sgd", "raf": False, "set_to_none": False}),
}


@pytest.mark.parametrize("case", list(PARITY))
def test_parity_with_single_process(case: str) -> None:
    world, cfg = PARITY[case]
    run_distributed(parity_worker, world, cfg, timeout=200)


# ---- the recompute-prefetch regression -----------------------------------------------------------


def recompute_prefetch_worker(rank: int, world: int, reentrant: bool, device: str = "cpu") -> None:
    torch.manual_seed(0)
    model = TwoLinears(reentrant).to(device)
    fully_shard(model.l1, prefetch=1)
    fully_shard(model.l2, prefetch=1)
    fully_shard(model, prefetch=1)
    seen: Counter[tuple[str, str]] = Counter()
    remove = collectives.add_observer(lambda rec, _: seen.update([(rec.kind, rec.label)]))
    x = torch.randn(4, 4, device=device, requires_grad=True)
    counts = world > 1  # one rank in fp32 gathers nothing: the shards are the parameters
    for step in range(2):
        seen.clear()
        model(x).sum().backward()
        for lin in (model.l1, model.l2):
            assert isinstance(lin.weight, DTensor), f"step {step}: a linear was left unsharded"
            assert lin.phase is Phase.IDLE
        assert model.fsdp_context.phase is Phase.IDLE
        assert_between_steps(model)
        # forward: one gather each; backward: the recompute gathers l1 and l2
        # once more and keeps them for their backward. A forward-order prefetch
        # from l1's recompute would gather l2 a third time (the recompute-prefetch bug).
        if counts:
            assert seen[("all_gather", "l1")] == 2, seen
            assert seen[("all_gather", "l2")] == 2, seen
            assert seen[("all_gather", "TwoLinears")] == 1, seen
            for label in ("l1", "l2", "TwoLinears"):
                assert seen[("reduce_scatter", label)] == 1, seen
        model.zero_grad()
    remove()


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_recompute_prefetch_regression_never_leaves_modules_unsharded(reentrant: bool) -> None:
    run_distributed(recompute_prefetch_worker, 2, reentrant)


# ---- phases, no_grad, accumulation across backward ---------------------------------------------


def phase_worker(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = Net()
    shard_net(model, {})
    ctx_phases: list[tuple[str, Phase]] = []
    root = model

    def record(name: str):
        def hook(*_):
            ctx_phases.append((name, root.fsdp_context.phase))

        return hook

    idx = batches(1)[0].chunk(world)[rank]
    loss_fn(model, idx)  # creates the context
    model.zero_grad()
    model.extra.register_forward_pre_hook(record("forward"))
    out = model(idx[:, :-1])
    out.register_hook(
        lambda g: ctx_phases.append(("after-root-pre-backward", root.fsdp_context.phase))
    )
    assert model.phase is Phase.IDLE and model.fsdp_context.phase is Phase.IDLE
    out.float().pow(2).mean().backward()
    assert ctx_phases == [("forward", Phase.IDLE), ("after-root-pre-backward", Phase.BACKWARD)]
    assert_between_steps(model)

    # no_grad and eval forwards: nothing stays gathered, the root included.
    with torch.no_grad():
        model(idx)
    assert all(m._shardwise_state.group.unsharded_bytes == 0 for m in sharded_modules(model))
    model.eval()
    model(idx)
    assert all(m._shardwise_state.group.unsharded_bytes == 0 for m in sharded_modules(model))
    model.train()

    # Gradients accumulate across backward calls when not zeroed.
    torch.manual_seed(0)
    ref = Net()
    model2 = copy.deepcopy(ref)
    shard_net(model2, {})
    for b in batches(2):
        loss_fn(model2, b.chunk(world)[rank]).backward()
        loss_fn(ref, b).backward()
    for (n, p), (_, rp) in zip(model2.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), rp.grad, atol=1e-5, rtol=1e-5, msg=n)


def test_context_phase_and_no_grad_and_accumulation() -> None:
    run_distributed(phase_worker, 2)


# ---- what fully_shard makes of parameters --------------------------------------------------------


def layout_worker(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = Net()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    shard_net(model, {})
    assert type(model).__name__ == "FSDPNet" and isinstance(model, Net)
    assert model.head.weight is model.emb.weight, "tied weights stay tied"
    for name, p in model.named_parameters():
        local = p.to_local()
        expected = list(torch.chunk(full[name], world, dim=0))
        expected += [full[name][:0]] * (world - len(expected))
        torch.testing.assert_close(local, expected[rank], msg=name)
    assert model.pos.to_local().shape[0] == (1 if rank == 0 else 0)
    # one gather per module per unshard, coalesced over its parameters
    seen: Counter[str] = Counter()
    remove = collectives.add_observer(lambda rec, _: seen.update([rec.kind]))
    model.extra.unshard()
    assert seen["all_gather"] == 1
    assert isinstance(model.extra.fc1.weight, torch.Tensor) and not isinstance(
        model.extra.fc1.weight, DTensor
    )
    torch.testing.assert_close(model.extra.fc1.weight, full["extra.fc1.weight"])
    model.extra.reshard()
    assert isinstance(model.extra.fc1.weight, DTensor)
    handle = model.extra.unshard(async_op=True)
    handle.wait()
    model.extra.reshard()
    remove()
    odd_shapes_gather_exactly()


class OddShapes(nn.Module):
    """Rows that split unevenly, ranks owning none, an empty and a 1-D parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.uneven = nn.Parameter(torch.randn(5, 3))
        self.one_row = nn.Parameter(torch.randn(1, 4))
        self.empty = nn.Parameter(torch.randn(0, 2))
        self.vector = nn.Parameter(torch.randn(7))
        self.cube = nn.Parameter(torch.randn(3, 2, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * sum(p.sum() for p in self.parameters())


def odd_shapes_gather_exactly() -> None:
    """Each parameter gathered in place lands whole and exact, cast or not, with
    an observer watching, and its gradient reduces exactly; a module holding
    only an empty parameter gathers too."""
    remove = collectives.add_observer(lambda rec, _: None)
    for dtype in (None, torch.bfloat16):
        torch.manual_seed(0)
        model = OddShapes()
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
        fully_shard(model, mp_policy=shardwise.MixedPrecisionPolicy(param_dtype=dtype))
        for _ in range(2):
            model.unshard()
            for name, want in full.items():
                got = getattr(model, name)
                assert not isinstance(got, DTensor), name
                torch.testing.assert_close(got, want.to(dtype or want.dtype), msg=name)
            model.reshard()
            with torch.no_grad():  # the next gather must see updated shards
                for name, p in model.named_parameters():
                    p.add_(1.0)
                    full[name] += 1.0
    # Their gradients (expanded ones, an empty one beside uneven splits) reduce
    # to the reference's: every rank sees the same input, so the mean is it.
    torch.manual_seed(0)
    ref = OddShapes()
    model = copy.deepcopy(ref)
    fully_shard(model)
    x = torch.randn(3)
    model(x).sum().backward()
    ref(x).sum().backward()
    for (name, p), rp in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), rp.grad, msg=name)
    empty = nn.Linear(0, 3, bias=False)
    fully_shard(empty)
    empty.unshard()
    assert empty.weight.shape == (3, 0) and not isinstance(empty.weight, DTensor)
    empty.reshard()
    remove()


def test_parameters_are_chunked_dtensors() -> None:
    run_distributed(layout_worker, 4)


# ---- bad input -----------------------------------------------------------------------------------


def bad_input_worker(rank: int, world: int) -> dict[str, str]:
    from torch.distributed.device_mesh import init_device_mesh

    from shardwise.api import check_device

    msgs: dict[str, str] = {}

    def expect(name: str, exc: type, fn) -> None:
        with pytest.raises(exc) as info:
            fn()
        msgs[name] = str(info.value)

    lin = nn.Linear(2, 2)
    fully_shard(lin)
    expect("twice", ValueError, lambda: fully_shard(lin))

    tied = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    tied[1].weight = tied[0].weight
    fully_shard(tied[0])
    expect("owned", ValueError, lambda: fully_shard(tied[1]))
    assert not isinstance(tied[1], FSDPModule) and not isinstance(tied[1].bias, DTensor)

    mesh3 = init_device_mesh("cpu", (1, 1, world))
    m = nn.Linear(2, 2)
    expect("mesh3d", ValueError, lambda: fully_shard(m, mesh=mesh3))
    assert not isinstance(m, FSDPModule) and not isinstance(m.weight, DTensor)

    expect("device", ValueError, lambda: check_device("w", torch.device("cuda", 0), "cpu"))

    ints = nn.Linear(2, 2)
    ints.register_parameter(
        "count", nn.Parameter(torch.ones(3, dtype=torch.long), requires_grad=False)
    )
    expect("int", ValueError, lambda: fully_shard(ints))
    assert not isinstance(ints, FSDPModule) and not isinstance(ints.weight, DTensor)

    expect("prefetch", ValueError, lambda: fully_shard(nn.Linear(2, 2), prefetch=-1))
    expect("policy", TypeError, lambda: fully_shard(nn.Linear(2, 2), mp_policy="bf16"))

    # assign=True is supported (tests/library/api/test_training_semantics.py); a value that does not
    # fit the parameter is refused before anything changes.
    sd = {"weight": torch.zeros(3, 2), "bias": torch.zeros(2)}
    weight, before = lin.weight, lin.weight.to_local().clone()
    expect("assign", ValueError, lambda: lin.load_state_dict(sd, assign=True))
    parent = nn.Sequential(lin)
    psd = {f"0.{k}": v for k, v in sd.items()}
    expect("assign-nested", ValueError, lambda: parent.load_state_dict(psd, assign=True))
    assert lin.weight is weight
    torch.testing.assert_close(lin.weight.to_local(), before)

    for container in (nn.ModuleList([nn.Linear(2, 2)]), nn.ModuleDict({"a": nn.Linear(2, 2)})):
        expect(type(container).__name__, ValueError, lambda c=container: fully_shard(c))
        assert not isinstance(container, FSDPModule)
        assert not any(isinstance(p, DTensor) for p in container.parameters())
    expect("raf", TypeError, lambda: fully_shard(nn.Linear(2, 2), reshard_after_forward="yes"))
    untouched = nn.Linear(3, 3)
    expect("raf-int", ValueError, lambda: fully_shard(untouched, reshard_after_forward=3))
    one = nn.Linear(2, 2)
    expect("list-twice", ValueError, lambda: fully_shard([one, one]))
    expect("list-empty", ValueError, lambda: fully_shard([]))
    expect("list-type", TypeError, lambda: fully_shard([one, "layer"]))
    outer = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    expect("list-nested", ValueError, lambda: fully_shard([outer, outer[0]]))
    assert not isinstance(outer, FSDPModule) and not isinstance(outer[0].weight, DTensor)
    expect(
        "placement-type",
        ValueError,
        lambda: fully_shard(untouched, shard_placement_fn=lambda p: Replicate()),
    )
    expect(
        "placement-dim",
        ValueError,
        lambda: fully_shard(untouched, shard_placement_fn=lambda p: Shard(2)),
    )
    # 3 columns over 2 ranks: dims other than 0 must split evenly.
    expect(
        "placement-uneven",
        ValueError,
        lambda: fully_shard(untouched, shard_placement_fn=lambda p: Shard(p.dim() - 1)),
    )
    expect("offload", TypeError, lambda: fully_shard(untouched, offload_policy="cpu"))
    expect("dp_mesh_dims", TypeError, lambda: fully_shard(untouched, dp_mesh_dims=("dp",)))
    expect("share_comm_ctx", ValueError, lambda: shardwise.share_comm_ctx([untouched]))
    for m in (untouched, one):
        assert not isinstance(m, FSDPModule) and not any(
            isinstance(p, DTensor) for p in m.parameters()
        )
    return msgs


def test_bad_input_gets_one_clear_error_and_changes_nothing() -> None:
    msgs = run_distributed(bad_input_worker, 2)[0]
    assert "already sharded" in msgs["twice"]
    assert "already owned" in msgs["owned"] and "weight" in msgs["owned"]
    assert "3-D mesh" in msgs["mesh3d"]
    assert "cuda:0" in msgs["device"] and "mesh" in msgs["device"]
    assert "count" in msgs["int"] and "floating-point" in msgs["int"]
    assert "prefetch" in msgs["prefetch"]
    assert "MixedPrecisionPolicy" in msgs["policy"]
    assert "'weight'" in msgs["assign"] and "(3, 2)" in msgs["assign"]
    assert "'0.weight'" in msgs["assign-nested"]
    assert "ModuleList" in msgs["ModuleList"] and "forward" in msgs["ModuleList"]
    assert "ModuleDict" in msgs["ModuleDict"]
    assert "reshard_after_forward" in msgs["raf"]
    assert "reshard_after_forward=3" in msgs["raf-int"] and "divide" in msgs["raf-int"]
    assert "same module twice" in msgs["list-twice"]
    assert "empty list" in msgs["list-empty"]
    assert "Sequential and Linear inside it" in msgs["list-nested"]
    assert "nn.Module" in msgs["list-type"] and "str" in msgs["list-type"]
    assert "Replicate()" in msgs["placement-type"] and "Shard(dim)" in msgs["placement-type"]
    assert "Shard(2)" in msgs["placement-dim"] and "(3, 3)" in msgs["placement-dim"]
    assert "evenly over 2 ranks" in msgs["placement-uneven"]
    assert "CPUOffloadPolicy" in msgs["offload"] and "str" in msgs["offload"]
    assert "DataParallelMeshDims" in msgs["dp_mesh_dims"] and "tuple" in msgs["dp_mesh_dims"]
    assert "Linear" in msgs["share_comm_ctx"]


def test_fully_shard_without_process_group_says_how_to_fix() -> None:
    assert not dist.is_initialized()
    m = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="init_process_group"):
        fully_shard(m)
    assert not isinstance(m, FSDPModule)


def test_public_api_names() -> None:
    for name in ("fully_shard", "FSDPModule", "Phase", "MixedPrecisionPolicy", "LifecycleError"):
        assert hasattr(shardwise, name)
    assert {p.name for p in Phase} == {"IDLE", "FORWARD", "BACKWARD"}


# ---- exceptions inside forward or backward ------------------------------------------------------


class Boom(RuntimeError):
    pass


def exception_worker(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    shard_net(model, {})
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # on the sharded parameters
    idx = batches(1)[0].chunk(world)[rank]

    def explode_forward(module, args):
        raise Boom("in forward")

    handle = model.stages[1].a.register_forward_pre_hook(explode_forward)
    with pytest.raises(Boom):
        loss_fn(model, idx)
    handle.remove()
    out = model(idx[:, :-1])

    def explode_backward(grad):
        raise Boom("in backward")

    out.register_hook(explode_backward)
    with pytest.raises(Boom):
        out.float().pow(2).mean().backward()
    model.zero_grad()
    # Both failures are behind us: a normal step works and matches the reference.
    loss = loss_fn(model, idx)
    loss.backward()
    assert_between_steps(model)
    loss_fn(ref, batches(1)[0]).backward()
    for (n, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), rp.grad, atol=1e-5, rtol=1e-5, msg=n)

    # A backward that raises half-way (modules left gathered, a reduction in
    # flight), then zero_grad, the model's or the optimizer's, and the next batch
    # (how a step is skipped): nothing of the earlier steps or the failed pass leaks in.
    def explode_below(module, args, out):
        out.register_hook(explode_backward)

    for clear in (model.zero_grad, opt.zero_grad):
        handle = model.stages[0].register_forward_hook(explode_below)
        with pytest.raises(Boom):
            loss_fn(model, idx).backward()
        handle.remove()
        clear()
        ref.zero_grad()
        loss_fn(model, idx).backward()
        assert_between_steps(model)
        loss_fn(ref, batches(1)[0]).backward()
        for (n, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), rp.grad, atol=1e-5, rtol=1e-5, msg=n)

    # The same backward again (retain_graph), with nothing in between: the retry
    # is a backward of its own, with its end (the last module's reduction
    # finished, every module resharded) before the optimizer reads .grad. The
    # first attempt raised before any module's backward, so it left no gradients.
    raised: list[bool] = []

    def explode_once(grad):
        if not raised:
            raised.append(True)
            raise Boom("in backward, once")

    model.zero_grad()
    ref.zero_grad()
    out = model(idx[:, :-1])
    out.register_hook(explode_once)  # after the root's pre-backward hook
    loss = out.float().pow(2).mean()
    with pytest.raises(Boom):
        loss.backward(retain_graph=True)
    loss.backward()
    assert_between_steps(model)
    ref_out = ref(batches(1)[0][:, :-1])
    ref_out.float().pow(2).mean().backward()
    for (n, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), rp.grad, atol=1e-5, rtol=1e-5, msg=n)


def test_model_recovers_after_an_exception_in_forward_or_backward() -> None:
    run_distributed(exception_worker, 2)


# ---- memory behaviour that a CPU can check ----------------------------------------------------


def gathered_at_once_worker(rank: int, world: int, prefetch: int) -> list[int]:
    torch.manual_seed(0)
    model = Deep()
    for b in model.blocks:
        fully_shard(b, prefetch=prefetch)
    fully_shard(model, prefetch=prefetch)
    peaks: list[int] = []

    def count(module, args):
        blocks = [b._shardwise_state.group for b in model.blocks]
        peaks.append(sum(g.state is not GroupState.SHARDED for g in blocks))

    for b in model.blocks:
        b.register_forward_pre_hook(count)  # runs after shardwise's own pre-forward
    x = torch.randn(4, 8)
    for _ in range(3):
        model(x).sum().backward()
        assert_between_steps(model)  # and no unsharded storage left after the step
    return peaks


def test_recorded_order_prefetches_the_next_distinct_gathering_modules() -> None:
    """Each position of a recorded order prefetches the next ``depth`` modules that
    gather, skipping itself, repeats and modules without parameters."""
    from types import SimpleNamespace

    from shardwise.runtime.context import ExecutionOrder

    root = SimpleNamespace(group=None)  # no parameters of its own
    a, b, c, d = (SimpleNamespace(group=object()) for _ in range(4))
    order = [root, a, b, a, c, d]  # ``a`` runs twice
    depth = {id(root): 1, id(a): 2, id(b): 2, id(c): 1, id(d): 3}
    targets = ExecutionOrder(order, depth).targets  # type: ignore[arg-type]
    assert [[id(t) for t in ts] for ts in targets] == [
        [id(a)],  # root
        [id(b), id(c)],  # a: not itself again
        [id(a), id(c)],  # b
        [id(c), id(d)],  # a, second use
        [id(d)],  # c
        [],  # d: nothing after it
    ]
    depth[id(root)] = 0
    assert ExecutionOrder(order, depth).targets[0] == []  # type: ignore[arg-type]


@pytest.mark.parametrize("world", [1, 2, 4, 16])  # 16: past PIECES_UP_TO
def test_gradient_copy_in_lays_out_rank_major_like_chunk_cat(world: int) -> None:
    """The copy-in before a reduce-scatter: each rank's rows of every gradient, in
    order, cast to the reduce dtype; the same bytes as ``torch._chunk_cat`` on
    every path (even contiguous splits, a transposed gradient, an uneven split, an
    empty parameter beside one), padding included."""
    from shardwise.comm.reduce import _copy_in

    g = torch.Generator().manual_seed(0)
    shapes = [(16, 3), (16,), (32, 2)]  # even at every world size here
    even = [torch.randn(s, generator=g, dtype=torch.bfloat16) for s in shapes]
    cases = {
        "even": even,
        "transposed": [*even[:2], torch.randn(2, 32, generator=g, dtype=torch.bfloat16).t()],
        "uneven": [*even, torch.randn(world * 2 + 1, 3, generator=g, dtype=torch.bfloat16)],
        # nn.Linear(0, 5).weight: nothing to send, beside an uneven split
        "empty": [
            torch.empty(5, 0, dtype=torch.bfloat16),
            *even,
            torch.randn(world + 1, 2, dtype=torch.bfloat16),
        ],
    }
    for name, filled in cases.items():
        slots = [-(-t.shape[0] // world) * math.prod(t.shape[1:]) for t in filled]
        nonempty = [t for t in filled if t.numel()]
        want = torch._chunk_cat(nonempty, dim=0, num_chunks=world).float()
        out = torch.full((world, sum(slots)), float("nan"))
        _copy_in(filled, slots, out)
        torch.testing.assert_close(out, want, rtol=0, atol=0, msg=name)  # padding: zeros


@pytest.mark.parametrize("world", [1, 2, 3, 8, 16])
def test_gradient_copy_in_without_a_cast_lays_out_each_ranks_rows(world: int) -> None:
    """The copy-in where no cast is needed (on the CPU, one ``_chunk_cat``): each rank's
    rows of every gradient in order, padding zero, built here row by row; a group of
    empty parameters copies nothing."""
    from shardwise.comm.reduce import _copy_in

    g = torch.Generator().manual_seed(0)
    cases = {
        "even": [torch.randn(16, 3, generator=g), torch.randn(16, generator=g)],
        "transposed": [torch.randn(16, generator=g), torch.randn(2, 32, generator=g).t()],
        "uneven": [torch.randn(16, generator=g), torch.randn(world * 2 + 1, 3, generator=g)],
        "empty": [torch.empty(5, 0), torch.randn(world + 1, 2, generator=g)],
    }
    for name, filled in cases.items():
        slots = [-(-t.shape[0] // world) * math.prod(t.shape[1:]) for t in filled]
        want = torch.zeros(world, sum(slots))
        col = 0
        for t, slot in zip(filled, slots):
            if t.numel():
                rows = -(-t.shape[0] // world)
                flat = t.reshape(t.shape[0], -1)
                for r in range(world):
                    piece = flat[r * rows : (r + 1) * rows].reshape(-1)
                    want[r, col : col + piece.numel()] = piece
            col += slot
        out = torch.full((world, sum(slots)), float("nan"))
        _copy_in(filled, slots, out)
        torch.testing.assert_close(out, want, rtol=0, atol=0, msg=name)
    _copy_in([torch.empty(5, 0)], [0], torch.empty(world, 0))  # nothing to copy, no error


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_blocks_gathered_at_once_in_forward_never_exceed_one_plus_prefetch(prefetch: int) -> None:
    peaks = run_distributed(gathered_at_once_worker, 2, prefetch)[0]
    assert max(peaks) == 1 + prefetch, peaks  # reached, never exceeded


# ---- one module, several uses --------------------------------------------------------------------


class Twice(nn.Module):
    """``a`` runs twice in one forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.a(x))
        x = torch.tanh(self.b(x))
        x = torch.tanh(self.a(x))
        return self.head(x)


def several_uses_worker(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ref = Twice()
    model = copy.deepcopy(ref)
    fully_shard(model.a)
    fully_shard(model.b)
    fully_shard(model)
    x = torch.randn(8, 6)
    xs = x.chunk(world)[rank]
    seen: Counter[tuple[str, str]] = Counter()
    remove = collectives.add_observer(lambda rec, _: seen.update([(rec.kind, rec.label)]))
    for _step in range(2):  # the second prefetches from the recorded order
        seen.clear()
        model(xs).sum().backward()
        assert_between_steps(model)
        assert seen[("reduce_scatter", "a")] == 1, seen  # one post-backward for two uses
    remove()
    ref(x).sum().backward()
    ref_grads = [p.grad.clone() for p in ref.parameters()]
    for (n, p), g in zip(model.named_parameters(), ref_grads):
        torch.testing.assert_close(p.grad.full_tensor(), g * 2 / world, msg=n)
    # Two forwards, one backward: each forward's graph gets what it needs.
    model.zero_grad()
    ref.zero_grad()
    x2 = torch.randn(8, 6)
    (model(xs).sum() + model(x2.chunk(world)[rank]).sum()).backward()
    assert_between_steps(model)
    (ref(x).sum() + ref(x2).sum()).backward()
    for (n, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), rp.grad / world, msg=n)
    # A sharded child called on its own after the orders were recorded.
    model.b(xs).sum().backward()
    assert_between_steps(model)
    # Double backward (a gradient penalty on the input) is refused with a clear message.
    inp = xs.clone().requires_grad_()
    out = model(inp).sum()
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(out, [inp], create_graph=True)


def test_a_module_used_several_times_reduces_once_and_matches() -> None:
    run_distributed(several_uses_worker, 2)


def kept_gathered_steps_worker(rank: int, world: int) -> None:
    """Modules kept gathered across optimizer steps must see the updated weights,
    also after foreach and fused steps, which bump no DTensor version counter."""
    makers = [
        lambda params: torch.optim.SGD(params, lr=0.5),
        lambda params: torch.optim.AdamW(params, lr=1e-2, foreach=True),
        lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True),
    ]
    for make in makers:
        torch.manual_seed(0)
        ref = Net()
        model = copy.deepcopy(ref)
        shard_net(model, {"raf": False})
        model.set_reshard_after_backward(False)
        opt, ref_opt = make(model.parameters()), make(ref.parameters())
        for step, idx in enumerate(batches(3)):
            loss = loss_fn(model, idx.chunk(world)[rank])
            loss.backward()
            if step == 0:
                assert model.extra._shardwise_state.group.state is GroupState.UNSHARDED
            opt.step()  # the optimizer holds the sharded parameters: it updates the shards
            opt.zero_grad()
            ref_loss = reference_step(ref, ref_opt, idx)
            torch.testing.assert_close(global_mean(loss), ref_loss, atol=1e-5, rtol=1e-5)


def test_kept_gathered_modules_see_optimizer_updates() -> None:
    run_distributed(kept_gathered_steps_worker, 2)
