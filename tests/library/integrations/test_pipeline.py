"""Pipeline parallel around sharded stages: torch.distributed.pipelining's schedules.

4 gloo ranks on a ``("pp", "dp")`` mesh of 2 x 2. The model is split into
stages as torchtitan splits it (a copy of the whole model per stage, the other
stages' parts removed); each stage's blocks and the stage root are sharded over
``dp`` with ``reshard_after_forward=False``, as torchtitan does under PP. Every
schedule the installed torch ships runs 2 optimizer steps of 4 microbatches
each, sharded three ways: torch's FSDP2 (the control), shardwise through
``patch_fsdp2()`` (torch's ``fully_shard`` call sites) and shardwise directly.
Each run is compared with the same model in one process on the whole batch:
every microbatch's loss and every parameter after the steps (rtol 1e-4), and the
reduce-scatters of each step, one per sharded module that owns parameters
(the pipelining runtime reduces once, after the last microbatch's weight
gradients; reducing per microbatch would be four), and under shardwise one
all-gather per such module in the second step (kept gathered from its first
forward to the reduction: nothing regathered between microbatches).

All cases of the world run in one launch of 4 processes. A crashed rank leaves
its peers waiting on a pipeline receive: each case builds its own mesh, whose
groups time out in seconds (``PG_TIMEOUT``), so a failing case costs seconds
and the cases after it start on fresh groups.
"""

from __future__ import annotations

import copy
import datetime
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.distributed.pipelining as pipelining
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

import shardwise
from dist_utils import check_results
from models import VOCAB, Block

pytestmark = pytest.mark.timeout(240)

WORLD = 4
PP = 2
MICROBATCHES = 4
STEPS = 2
BATCH = 16  # 8 rows per dp rank: 4 microbatches of 2
SEQ = 6
D = 8
LAYERS = 8  # 1 to 4 stages on each of the 2 pp ranks: 2 to 8 stages
LR = 0.2
RTOL = 1e-4
ATOL = 1e-6
PG_TIMEOUT = datetime.timedelta(seconds=5)

# Schedule -> how its stages sit on the pp ranks: "single" (one stage per rank),
# "loop" (stage s on rank s % PP) or "v" (rank r holds stages r and 2 * PP - 1 - r).
_SCHEDULES = {
    "GPipe": "single",
    "1F1B": "single",
    "Interleaved1F1B": "loop",
    "LoopedBFS": "loop",
    "InterleavedZeroBubble": "loop",
    "ZBVZeroBubble": "v",
    "DualPipeV": "v",
}
SCHEDULES = {n: s for n, s in _SCHEDULES.items() if hasattr(pipelining, f"Schedule{n}")}
MODES = ("fsdp2", "patched", "direct")


class PipeModel(nn.Module):
    """Embedding, ``LAYERS`` blocks, norm, head; a stage is a copy with the other
    stages' parts removed (``None``, or gone from ``layers``), as torchtitan splits."""

    def __init__(self) -> None:
        super().__init__()
        self.emb: nn.Module | None = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleDict({str(i): Block(D) for i in range(LAYERS)})
        self.norm: nn.Module | None = nn.LayerNorm(D)
        self.head: nn.Module | None = nn.Linear(D, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) if self.emb is not None else x
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.head(h) if self.head is not None else h


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def make_model() -> PipeModel:
    torch.manual_seed(0)
    return PipeModel()


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def stage_module(whole: PipeModel, index: int, n_stages: int) -> PipeModel:
    """Stage ``index`` of ``n_stages``: its share of the layers (at least one: shares
    differ by one where ``n_stages`` does not divide ``LAYERS``), the embedding on the
    first, norm and head on the last."""
    stage = copy.deepcopy(whole)
    keep = {str(i) for i in range(index * LAYERS // n_stages, (index + 1) * LAYERS // n_stages)}
    for name in [n for n in stage.layers if n not in keep]:
        del stage.layers[name]
    if index != 0:
        stage.emb = None
    if index != n_stages - 1:
        stage.norm = stage.head = None
    return stage


def stage_indices(style: str, pp_rank: int, per_rank: int) -> tuple[list[int], int]:
    """This pp rank's stage indices and the number of stages: ``per_rank`` stages on
    each pp rank where the schedule loops (one or two where it does not)."""
    if style == "single":
        return [pp_rank], PP
    if style == "loop":
        return [pp_rank + k * PP for k in range(per_rank)], per_rank * PP
    return [pp_rank, 2 * PP - 1 - pp_rank], 2 * PP


def short_timeout() -> Any:
    """Gloo options whose groups time out after ``PG_TIMEOUT``."""
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = PG_TIMEOUT
    return opts


def make_mesh() -> DeviceMesh:
    """A fresh ("pp", "dp") mesh whose groups time out in seconds."""
    opts = short_timeout()
    return init_device_mesh(
        "cpu",
        (PP, WORLD // PP),
        mesh_dim_names=("pp", "dp"),
        backend_override={"pp": ("gloo", opts), "dp": ("gloo", opts)},
    )


@contextmanager
def sharding(mode: str) -> Iterator[Callable[..., Any]]:
    """The ``fully_shard`` a mode calls: torch's (FSDP2), torch's name routed to shardwise
    by ``patch_fsdp2()``, or shardwise's own."""
    if mode == "fsdp2":
        yield torch_fsdp.fully_shard
    elif mode == "direct":
        yield shardwise.fully_shard
    else:
        shardwise.patch_fsdp2()
        try:
            yield torch_fsdp.fully_shard  # looked up now: the routed name
        finally:
            shardwise.unpatch_fsdp2()


def shard_stage(
    stage: PipeModel, fully_shard: Callable[..., Any], dp: DeviceMesh, raf: bool | int
) -> list[str]:
    """Shard each block and the stage root over ``dp`` with ``reshard_after_forward=raf``;
    returns the names of the sharded modules that own parameters."""
    owners = []
    for name, block in stage.layers.items():
        fully_shard(block, mesh=dp, reshard_after_forward=raf)
        owners.append(f"layers.{name}")
    fully_shard(stage, mesh=dp, reshard_after_forward=raf)
    if any(m is not None for m in (stage.emb, stage.norm, stage.head)):
        owners.append("")  # the root's own: embedding, or norm and head
    return owners


@contextmanager
def counting_collectives(mode: str) -> Iterator[list[str]]:
    """Every reduce-scatter (and under shardwise every all-gather) issued while inside,
    as ``kind:label`` (shardwise's collective observer; for FSDP2, its calls of
    torch.distributed's reduce-scatter)."""
    seen: list[str] = []
    if mode == "fsdp2":
        name = (
            "reduce_scatter_single"
            if hasattr(dist, "reduce_scatter_single")
            else ("reduce_scatter_tensor")
        )
        original = getattr(dist, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            seen.append("reduce_scatter:?")
            return original(*args, **kwargs)

        setattr(dist, name, counted)
        try:
            yield seen
        finally:
            setattr(dist, name, original)
        return

    def observe(record: Any, pending: Any) -> None:
        if record.kind in ("reduce_scatter", "all_gather"):
            seen.append(f"{record.kind}:{record.label}")

    remove = shardwise.observe.add_collective_observer(observe)
    try:
        yield seen
    finally:
        remove()


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def reference() -> tuple[list[list[torch.Tensor]], dict[str, torch.Tensor]]:
    """One process on the whole batch: each step's loss of every microbatch of every dp
    rank (in that order), and the parameters after the steps."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for step in range(STEPS):
        x, y = data(step)
        logits = model(x)
        chunks = [
            loss_fn(lc, yc)
            for lc, yc in zip(logits.chunk(PP * MICROBATCHES), y.chunk(PP * MICROBATCHES))
        ]
        torch.stack(chunks).mean().backward()
        opt.step()
        opt.zero_grad()
        losses.append([c.detach() for c in chunks])
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def run_case(schedule_name: str, mode: str, raf: bool | int, per_rank: int) -> None:
    """One schedule's steps under one mode, checked against one process; then every
    rank waits for the others (the default group, whose timeout is long): a rank that
    failed early must not start the next case while a peer still waits on this one's
    receive, or their first messages would time out there too."""
    try:
        mesh = make_mesh()
        with sharding(mode) as fully_shard:  # patched for the whole run: stage.py calls it
            train_and_compare(schedule_name, mode, raf, per_rank, mesh, fully_shard)
    finally:
        dist.barrier()


def train_and_compare(
    schedule_name: str,
    mode: str,
    raf: bool | int,
    per_rank: int,
    mesh: DeviceMesh,
    fully_shard: Callable[..., Any],
) -> None:
    style = SCHEDULES[schedule_name]
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    indices, n_stages = stage_indices(style, pp_rank, per_rank)
    whole = make_model()
    modules = [stage_module(whole, i, n_stages) for i in indices]
    owners = [name for m in modules for name in shard_stage(m, fully_shard, mesh["dp"], raf)]
    group = mesh["pp"].get_group()
    stages = [
        pipelining.PipelineStage(m, i, n_stages, torch.device("cpu"), group=group)
        for m, i in zip(modules, indices)
    ]
    cls = getattr(pipelining, f"Schedule{schedule_name}")
    schedule = cls(
        stages[0] if style == "single" else stages, n_microbatches=MICROBATCHES, loss_fn=loss_fn
    )
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=LR, momentum=0.9)
    has_first, has_last = 0 in indices, n_stages - 1 in indices
    want_losses, want_params = reference()
    rows = slice(dp_rank * BATCH // 2, (dp_rank + 1) * BATCH // 2)
    for step in range(STEPS):
        x, y = (t[rows] for t in data(step))
        losses: list[torch.Tensor] = []
        with counting_collectives(mode) as seen:
            schedule.step(
                *([x] if has_first else []),
                target=y if has_last else None,
                losses=losses if has_last else None,
            )
        opt.step()
        opt.zero_grad()
        # One reduce-scatter per sharded module that owns parameters, once per step.
        reduced = [s for s in seen if s.startswith("reduce_scatter")]
        assert len(reduced) == len(owners), (step, reduced, owners)
        if mode != "fsdp2":  # by label: a block by its name, a stage root by its class
            labels = [name or PipeModel.__name__ for name in owners]
            assert Counter(reduced) == Counter(f"reduce_scatter:{n}" for n in labels), (
                step,
                reduced,
                owners,
            )
            # (The first step's metadata inference gathers too; with more than 3 stages
            # on a rank the runtime reshards some between microbatches, as under FSDP2.)
            if step > 0 and raf is not True and per_rank <= 3:
                # Kept gathered from the first forward to the reduction: one all-gather.
                gathered = Counter(s for s in seen if s.startswith("all_gather"))
                assert gathered == Counter(f"all_gather:{n}" for n in labels), (step, seen)
        if has_last:
            first = dp_rank * MICROBATCHES
            want = torch.stack(want_losses[step][first : first + MICROBATCHES])
            torch.testing.assert_close(torch.stack(losses).detach(), want, rtol=RTOL, atol=ATOL)
    for m in modules:
        for name, p in m.named_parameters():
            try:
                torch.testing.assert_close(full(p), want_params[name], rtol=RTOL, atol=ATOL)
            except AssertionError as e:
                raise AssertionError(f"{name} after {STEPS} steps: {e}") from None


# ---- bad input: one clear error naming the stage, nothing changed ----------------------


def bad_stage(kind: str, mode: str, schedule_name: str = "GPipe") -> None:
    """A stage sharded wrongly: ``unsharded`` (its blocks sharded, the stage root not:
    the runtime would treat it as a plain module and each block would reduce per
    microbatch), ``world-mesh`` (sharded over all 4 ranks, which hold different stages,
    instead of the stage's ``dp`` ranks), ``raf`` (resharded after forward under a
    schedule whose weight pass is apart from the input pass). The first step raises
    before any shardwise collective and before any parameter or gradient changes: on
    the rank whose stage runs first, shardwise's error naming the stage; its pipeline
    peers, waiting on that stage's first message, get torch's receive timeout."""
    mesh = make_mesh()
    world = init_device_mesh("cpu", (WORLD,), backend_override={0: ("gloo", short_timeout())})
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    style = SCHEDULES[schedule_name]
    indices, n_stages = stage_indices(style, pp_rank, 2)
    modules = [stage_module(make_model(), i, n_stages) for i in indices]
    with sharding(mode) as fully_shard, counting_collectives(mode) as seen:
        for module in modules:
            if kind == "raf":
                shard_stage(module, fully_shard, mesh["dp"], True)
                continue
            for block in module.layers.values():
                fully_shard(block, mesh=world if kind == "world-mesh" else mesh["dp"])
            if kind == "world-mesh":
                fully_shard(module, mesh=world)
        # Each rank's own shards: a gather here, after the refusal, would meet a peer
        # still waiting on the refused stage's first message.
        before = {n: local(p).clone() for m in modules for n, p in m.named_parameters()}
        stages = [
            pipelining.PipelineStage(
                m, i, n_stages, torch.device("cpu"), group=mesh["pp"].get_group()
            )
            for m, i in zip(modules, indices)
        ]
        cls = getattr(pipelining, f"Schedule{schedule_name}")
        schedule = cls(
            stages[0] if style == "single" else stages, n_microbatches=MICROBATCHES, loss_fn=loss_fn
        )
        rows = slice(dp_rank * BATCH // 2, (dp_rank + 1) * BATCH // 2)
        x, y = (t[rows] for t in data(0))
        try:
            if pp_rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=[])
        except (ValueError, RuntimeError) as e:
            if pp_rank == 0:  # stage 0 runs first
                assert isinstance(e, ValueError), e
                assert str(e).startswith("pipeline stage 0 (PipeModel): "), e
                want = {"unsharded": "not sharded", "world-mesh": "other stages", "raf": "reshards"}
                assert want[kind] in str(e), e
                assert not seen, seen  # before any all-gather
        else:
            raise AssertionError(f"a stage sharded {kind!r} trained without an error")
    for m in modules:
        for n, p in m.named_parameters():
            assert p.grad is None, n
            torch.testing.assert_close(local(p), before[n], rtol=0, atol=0)


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach()


def _bad(kind: str, mode: str, schedule_name: str = "GPipe") -> Callable[[int, int], None]:
    def check(rank: int, world: int) -> None:
        try:
            bad_stage(kind, mode, schedule_name)
        finally:
            dist.barrier()

    return check


def _check(
    schedule_name: str, mode: str, raf: bool | int = False, per_rank: int = 2
) -> Callable[[int, int], None]:
    def check(rank: int, world: int) -> None:
        run_case(schedule_name, mode, raf, per_rank)

    return check


RAFS: dict[str, bool | int] = {"rafF": False, "rafT": True, "raf1": 1}
PER_RANK = {"single": (1,), "loop": (1, 2, 3, 4), "v": (2,)}
SPLIT = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")  # weight pass apart
# Every schedule x reshard_after_forward x stages a rank x mode; resharding after
# forward under a split schedule is refused (bad_stage), so not trained. FSDP2, the
# control, runs where it is right: resharded after forward under those schedules it
# loses or miscomputes gradients.
MATRIX = {
    f"{s}-{m}-{r}-x{k}": _check(s, m, raf, k)
    for s, style in SCHEDULES.items()
    for m in MODES
    for r, raf in RAFS.items()
    for k in PER_RANK[style]
    if not (s in SPLIT and raf is True)
}
# The default suite: the zero-bubble schedules in every mode they train in, with 1 to
# 4 stages a rank (4: the runtime reshards and regathers stages between microbatches);
# the others resharded after forward and with 4 stages a rank, under shardwise.
DEFAULT = [
    n
    for n in MATRIX
    if (n.startswith(SPLIT) and "-fsdp2-" not in n and n.endswith(("-rafF-x4", "-raf1-x4")))
    or (n.startswith("InterleavedZeroBubble-direct-rafF-") and n.endswith(("-x1", "-x3")))
    or (n.startswith(("Interleaved1F1B-", "LoopedBFS-")) and n.endswith("-direct-rafT-x4"))
    or (n.startswith(("GPipe-", "1F1B-")) and "-patched-rafT" in n)
]
CHECKS = {f"{s}-{m}": _check(s, m) for s in SCHEDULES for m in MODES}
CHECKS.update({n: MATRIX[n] for n in DEFAULT})
# In a launch of their own: a refused stage leaves its peers on a receive that times out.
BAD_CHECKS = {f"bad-unsharded-{m}": _bad("unsharded", m) for m in MODES[1:]}
BAD_CHECKS.update({f"bad-world-mesh-{m}": _bad("world-mesh", m) for m in MODES[1:]})
BAD_CHECKS.update({f"bad-raf-{s}-{m}": _bad("raf", m, s) for s in SPLIT for m in MODES[1:]})
# The world-mesh cases in a launch of their own (their stages share no dp group).
MESH_CHECKS = {n: BAD_CHECKS.pop(n) for n in list(BAD_CHECKS) if "world-mesh" in n}
BAD = list(BAD_CHECKS) + list(MESH_CHECKS)
# The whole matrix (marker frameworks):
#   python -m pytest -q -m frameworks tests/library/integrations/test_pipeline.py
SWEEP = {n: c for n, c in MATRIX.items() if n not in CHECKS}

_FOUND: dict[str, Any] = {}


def _results() -> dict[str, str | None]:
    return _launch("all", CHECKS)


def _launch(
    key: str, checks: dict[str, Callable[[int, int], None]], timeout: float = 240
) -> dict[str, str | None]:
    """All of ``checks`` in one launch of ``WORLD`` ranks, once per session."""
    if key not in _FOUND:
        try:
            _FOUND[key] = check_results(__name__, checks, WORLD, timeout=timeout)
        except BaseException as e:  # every case reports the one failed launch
            _FOUND[key] = e
    found = _FOUND[key]
    if isinstance(found, BaseException):
        raise found
    return found


@pytest.mark.parametrize("case", list(CHECKS))
def test_schedule(case: str) -> None:
    results = _results()
    assert results[case] is None, f"{case}:\n{results[case]}"


@pytest.mark.parametrize("case", BAD)
def test_bad_stage(case: str) -> None:
    mesh = case in MESH_CHECKS
    results = _launch("mesh", MESH_CHECKS) if mesh else _launch("bad", BAD_CHECKS)
    assert results[case] is None, f"{case}:\n{results[case]}"


@pytest.mark.frameworks
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("case", list(SWEEP))
def test_schedule_sweep(case: str) -> None:
    results = _launch("sweep", SWEEP, timeout=1700)
    assert results[case] is None, f"{case}:\n{results[case]}"
