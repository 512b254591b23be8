"""The differential fuzzer's pipeline family: torch.distributed.pipelining around sharded stages.

4 ranks as a ``("pp", "dp")`` mesh of 2 x 2; the model split as torchtitan splits it (a
copy of the whole model per stage, the other stages' parts removed, as
tests/library/integrations/test_pipeline.py does), each stage's layers and the stage root sharded
over ``dp``. Drawn: the schedule (every one the installed torch ships), 1 to 4 stages
on each pipeline rank where the schedule's layout allows (one for GPipe and 1F1B,
exactly two for the V schedules), ``reshard_after_forward`` (True, False, 1), layers a
stage, non-reentrant checkpoint_wrapper around the layers, shardwise called
directly or through ``patch_fsdp2()``. Each rank compares the losses of its last stage's
microbatches, its stages' gradients after every step and their parameters with one
process on the whole batch (fuzz_runtime.compare, rtol 1e-4).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
import torch.distributed.fsdp as torch_fsdp
import torch.distributed.pipelining as pipelining
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import fuzz_runtime as fr
import shardwise
from fuzz_runtime import Config, Record, Refused

PP, DP, MICRO = 2, 2, 4
_STYLES = {
    "GPipe": "single",
    "1F1B": "single",
    "Interleaved1F1B": "loop",
    "LoopedBFS": "loop",
    "InterleavedZeroBubble": "loop",
    "ZBVZeroBubble": "v",
    "DualPipeV": "v",
}
STYLES = {n: s for n, s in _STYLES.items() if hasattr(pipelining, f"Schedule{n}")}


def generate_pipe(r: random.Random) -> Config:
    schedule = r.choice(sorted(STYLES))
    style = STYLES[schedule]
    spr = {"single": 1, "v": 2}.get(style) or r.choice((1, 2, 3, 4))
    # Non-reentrant only: torch's reentrant checkpoint refuses autograd.grad (zero-bubble
    # schedules' input-gradient pass) and stalls the stages' metadata inference under
    # FSDP2 as under shardwise (every schedule): torch's limits, not drawn.
    ac = r.choice(("none", "none", "wrapper"))
    return Config(
        family="pipe",
        world=4,
        schedule=schedule,
        stages_per_rank=spr,
        blocks=r.choice((1, 2)),
        raf=r.choice((True, False, 1)),
        ac=ac,
        patched=r.random() < 0.5,
        steps=2,
    )


def valid_pipe(cfg: Config) -> bool:
    style = STYLES.get(cfg.schedule)
    spr = {"single": 1, "v": 2}.get(style or "", cfg.stages_per_rank)
    ok_ac = cfg.ac in ("none", "wrapper") and not cfg.reentrant
    return style is not None and cfg.stages_per_rank == spr and ok_ac


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(fr.D, 2 * fr.D)
        self.fc2 = nn.Linear(2 * fr.D, fr.D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class PipeNet(nn.Module):
    """Embedding, layers, norm, head; a stage keeps its share (the rest ``None`` or gone)."""

    def __init__(self, n_layers: int) -> None:
        super().__init__()
        self.emb: nn.Module | None = nn.Embedding(fr.VOCAB, fr.D)
        self.layers = nn.ModuleDict({str(i): Layer() for i in range(n_layers)})
        self.norm: nn.Module | None = nn.LayerNorm(fr.D)
        self.head: nn.Module | None = nn.Linear(fr.D, fr.VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) if self.emb is not None else x
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.head(h) if self.head is not None else h


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, fr.VOCAB), target.reshape(-1))


def n_stages(cfg: Config) -> int:
    return PP * cfg.stages_per_rank


def whole(cfg: Config) -> PipeNet:
    torch.manual_seed(0)
    return PipeNet(n_stages(cfg) * cfg.blocks)


def stage_of(model: PipeNet, index: int, cfg: Config) -> PipeNet:
    stage = copy.deepcopy(model)
    keep = {str(i) for i in range(index * cfg.blocks, (index + 1) * cfg.blocks)}
    for name in [n for n in stage.layers if n not in keep]:
        del stage.layers[name]
    if index != 0:
        stage.emb = None
    if index != n_stages(cfg) - 1:
        stage.norm = stage.head = None
    return stage


def indices(cfg: Config, pp_rank: int) -> list[int]:
    style, k = STYLES[cfg.schedule], cfg.stages_per_rank
    if style == "v":
        return [pp_rank, 2 * PP - 1 - pp_rank]
    return [pp_rank + PP * j for j in range(k)]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, fr.VOCAB, (DP * MICRO * fr.ROWS, fr.SEQ + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def reference(cfg: Config) -> Record:
    model = whole(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=fr.LR, momentum=fr.MOMENTUM)
    rec = Record()
    for step in range(cfg.steps):
        x, y = batch(step)
        logits = model(x)
        chunks = [loss_fn(lc, yc) for lc, yc in zip(logits.chunk(DP * MICRO), y.chunk(DP * MICRO))]
        torch.stack(chunks).mean().backward()
        rec.losses.append([float(c) for c in chunks])
        rec.grads.append(
            {n: fr.full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        )
        rec.norms.append(None)
        opt.step()
        opt.zero_grad()
        rec.params.append({n: fr.full(p) for n, p in model.named_parameters()})
    return rec


@contextmanager
def sharding(impl: str, patched: bool) -> Iterator[Any]:
    if impl == "fsdp2":
        yield torch_fsdp.fully_shard
    elif not patched:
        yield shardwise.fully_shard
    else:
        shardwise.patch_fsdp2()
        try:
            yield torch_fsdp.fully_shard
        finally:
            shardwise.unpatch_fsdp2()


def train_pipe(cfg: Config, impl: str) -> tuple[Record, int, bool]:
    """The pipelined run; returns its record, this rank's dp rank and whether it holds
    the last stage."""
    opts = fr.dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = fr.PG_TIMEOUT
    over = {"pp": ("gloo", opts), "dp": ("gloo", opts)}
    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"), backend_override=over)
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    idx = indices(cfg, pp_rank)
    full_model = whole(cfg)
    modules = [stage_of(full_model, i, cfg) for i in idx]
    step = -1
    try:
        with sharding(impl, cfg.patched) as fully_shard:
            for m in modules:
                if cfg.ac == "wrapper":
                    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                        CheckpointImpl,
                        checkpoint_wrapper,
                    )

                    how = CheckpointImpl.REENTRANT if cfg.reentrant else CheckpointImpl.NO_REENTRANT
                    for name in list(m.layers):
                        m.layers[name] = checkpoint_wrapper(m.layers[name], checkpoint_impl=how)
                for layer in m.layers.values():
                    fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=cfg.raf)
                fully_shard(m, mesh=mesh["dp"], reshard_after_forward=cfg.raf)
            group = mesh["pp"].get_group()
            stages = [
                pipelining.PipelineStage(m, i, n_stages(cfg), torch.device("cpu"), group=group)
                for m, i in zip(modules, idx)
            ]
            cls = getattr(pipelining, f"Schedule{cfg.schedule}")
            single = STYLES[cfg.schedule] == "single"
            schedule = cls(stages[0] if single else stages, n_microbatches=MICRO, loss_fn=loss_fn)
            params = [p for m in modules for p in m.parameters()]
            opt = torch.optim.SGD(params, lr=fr.LR, momentum=fr.MOMENTUM)
            first, last = 0 in idx, n_stages(cfg) - 1 in idx
            rows = slice(dp_rank * MICRO * fr.ROWS, (dp_rank + 1) * MICRO * fr.ROWS)
            rec = Record()
            named = [(fr.norm_name(n), p) for m in modules for n, p in m.named_parameters()]
            for step in range(cfg.steps):
                x, y = (t[rows] for t in batch(step))
                losses: list[torch.Tensor] = []
                schedule.step(
                    *([x] if first else []),
                    target=y if last else None,
                    losses=losses if last else None,
                )
                rec.losses.append([float(v) for v in losses])
                rec.grads.append({n: None if p.grad is None else fr.full(p.grad) for n, p in named})
                rec.norms.append(None)
                opt.step()
                opt.zero_grad()
                rec.params.append({n: fr.full(p) for n, p in named})
            return rec, dp_rank, last
    except fr.REFUSALS as e:
        if step <= 0 and fr._raised_by_shardwise(e):
            raise Refused(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
        raise


def _local(want: Record, got: Record, dp_rank: int, last: bool) -> Record:
    """The reference cut to what this rank holds: its stages' parameters, and the losses
    of its dp rank's microbatches where it holds the last stage."""
    names = set(got.params[0]) if got.params else set()
    lo = dp_rank * MICRO
    return Record(
        [s[lo : lo + MICRO] if last else [] for s in want.losses],
        [
            {n: g for n, g in s.items() if n in names} | {n: None for n in names if n not in s}
            for s in want.grads
        ],
        want.norms,
        [{n: p for n, p in s.items() if n in names} for s in want.params],
    )


def outcome_pipe(cfg: Config, impl: str, want: Record) -> tuple[str, str]:
    try:
        got, dp_rank, last = train_pipe(cfg, impl)
    except Refused as e:
        return "refused", str(e)
    except Exception:  # noqa: BLE001 - a crash is a finding
        return "crashed", fr.traceback.format_exc(limit=-8)
    found = fr.compare(got, _local(want, got, dp_rank, last), fr.EXACT)
    return ("diverged", found) if found else ("ok", "")


def run_pipe(rank: int, cfg: Config, fsdp2: str) -> dict[str, Any]:
    want = reference(cfg)
    status, detail = outcome_pipe(cfg, "shardwise", want)
    out = {"status": status, "detail": detail, "fsdp2": "n/a", "fsdp2_detail": ""}
    if fsdp2 == "always" or (fsdp2 == "on-divergence" and status in ("diverged", "crashed")):
        out["fsdp2"], out["fsdp2_detail"] = outcome_pipe(replace(cfg, patched=False), "fsdp2", want)
    # A failed rank's peers wait on a pipeline receive until it times out: meet here so
    # that no rank starts tearing down while another is still inside this composition.
    try:
        fr.dist.barrier()
    except Exception:  # noqa: BLE001 - the group may be broken; the pool tears it down
        pass
    return out
