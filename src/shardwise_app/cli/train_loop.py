"""One worker of ``shardwise train``: set-up, then steps, evaluations, checkpoints and reports.

Reads top to bottom: ``run_worker`` strings the parts together; ``set_up``
builds what a run needs (the run's config, the sharded model, the data,
AdamW (and Muon with ``--optimizer muon``), the resumed state); ``train_step`` is one optimizer step, on one
screen, as nanoGPT writes it; ``evaluate`` and ``save`` are the validation
loss and a checkpoint; ``train_loop`` runs the steps and reports each;
``finish`` saves and exports the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import signal
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise import checkpoint, clip_grad_norm_, trace
from shardwise.optim import Muon

from ..data import BatchSampler, eval_offsets, windows
from ..models.gpt import num_params
from . import finetune
from .common import LAUNCH_ID_ENV
from .corpus import open_corpus
from .corpus import prepare as prepare_corpus
from .failures import (
    RunFailure,
    diverged,
    kept,
    passes_through,
    peer_lost,
    peer_timeout,
    save_failure,
)
from .process_group import Worker, from_rank0
from .report import Reporter, stopped_before_the_first_step
from .run_config import CONFIG_ENV, RunConfig
from .run_folder import commit, create_and_lock, remove_unfinished_saves
from .signals import STOP_SIGNALS, StopRequest
from .train_config import is_new_run, resolve

# Keeps the run folder's lock alive in a worker that took it (torchrun direct).
_held: list[Any] = []


@dataclass
class Run:
    """What one worker trains with, and where the run stands."""

    cfg: RunConfig
    w: Worker
    model: Any  # the sharded model (an FSDPModule)
    forward: Any  # token ids -> logits
    hf: Any  # the HFModel of an --hf run, else None
    corpus: Any  # the memory-mapped token file
    sampler: BatchSampler
    val_offsets: torch.Tensor  # this rank's validation windows
    optimizer: torch.optim.Optimizer  # AdamW: every parameter, or with Muon the rest
    n_trained: int  # parameters that train (with LoRA: the adapters')
    step: int  # the last step taken (the resumed checkpoint's, before the first)
    last_good: Path | None  # the newest checkpoint of this run known complete
    saved_at: int = -1  # the step of this launch's newest save
    muon: torch.optim.Optimizer | None = None  # --optimizer muon: the blocks' matrices

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.optimizer] if self.muon is None else [self.muon, self.optimizer]

    @property
    def state_of(self) -> Any:
        """What checkpoints save and load: AdamW, or both optimizers (DCP's state dict
        takes a list and keys each parameter's state by its name, as for one)."""
        return self.optimizer if self.muon is None else self.optimizers

    @property
    def out(self) -> Path:
        return Path(self.cfg.out)


def run_worker(args: argparse.Namespace, w: Worker, stop: StopRequest) -> int:
    """A worker's run: set up, leave if a stop came first, then train and finish together."""
    run = set_up(run_config(args, w), w)
    # Ctrl-C in the first seconds (a mistyped flag): leave before the run
    # folder changes at all. All ranks decide together, as at every step.
    asked = torch.tensor(float(stop.signum is not None), device=w.device)
    dist.all_reduce(asked)
    if asked.item() > 0:
        if w.is_main and CONFIG_ENV not in os.environ:  # else our launcher says it
            line = stopped_before_the_first_step(stop.signum or signal.SIGINT, run.cfg)
            print(line, file=sys.stderr, flush=True)
        dist.destroy_process_group()
        return 0
    if w.is_main:
        commit(replace(run.cfg, launch_id=os.environ.get(LAUNCH_ID_ENV)))
    report = (
        Reporter(run.cfg, num_params(run.model), run.step, trained=run.n_trained)
        if w.is_main
        else None
    )
    try:
        stopped = train_loop(run, stop, report)
        finish(run, stopped, stop, report)
    except BaseException:
        if report:
            report.abort()  # the terminal gets its cursor back; the rows so far stay
        raise
    # Leave together: a rank tearing down its connections while rank 0 still
    # plots was once seen to abort on exit.
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ---- set-up ---------------------------------------------------------------------------------


def run_config(args: argparse.Namespace, w: Worker) -> RunConfig:
    """The run's config, the same on every rank: our launcher's, or, started by torchrun
    directly, what rank 0 resolves (taking the run folder's lock) as our launcher would."""
    if CONFIG_ENV in os.environ:
        # Our launcher resolved it and holds the lock; with several nodes, node
        # 0's (rank 0's) is the run's: one run folder, one seed, one data order.
        return from_rank0(lambda: RunConfig.from_json(json.loads(os.environ[CONFIG_ENV])), "train")

    def resolve_and_lock() -> RunConfig:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", w.world))
        c = resolve(args, world=w.world, local=local)
        out = Path(c.out)
        _held.append(create_and_lock(out, "--out", new_run=is_new_run(c))[0])
        remove_unfinished_saves(out)
        c.corpus = prepare_corpus(c, out)  # once, for every rank to map
        return c

    return from_rank0(resolve_and_lock, "train")


def set_up(cfg: RunConfig, w: Worker) -> Run:
    """The sharded model, this rank's data, AdamW, and the resumed checkpoint's state."""
    # Model: the same initial weights on every rank, then each keeps its shards.
    torch.manual_seed(cfg.seed)
    model, forward, hf, _ = finetune.build_model(cfg, w.device, w.world)

    # Data: the corpus file the launcher wrote, mapped; each rank reads its own windows.
    corpus = open_corpus(cfg)
    sampler = BatchSampler(
        corpus.train,
        seq_len=cfg.seq_len,
        batch_size=cfg.batch_size,
        seed=cfg.seed,
        rank=w.rank,
        world=w.world,
        grad_accum=cfg.grad_accum,
    )
    n_val = cfg.eval_batches * cfg.batch_size
    val = eval_offsets(corpus.val, seq_len=cfg.seq_len, rank=w.rank, world=w.world, n=n_val)

    # AdamW, nanoGPT's recipe: no weight decay on gains and biases. With LoRA
    # only the adapters train, and only they (and their moments) are saved.
    params = [p for p in model.parameters() if p.requires_grad]
    matrices = muon_matrices(model) if cfg.optimizer == "muon" else []
    rest = [p for p in params if all(p is not m for m in matrices)]
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in rest if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    # Muon with Moonshot's scaling ("match_rms_adamw"): its updates have AdamW's size,
    # so it takes AdamW's learning rate, schedule and weight decay.
    muon = (
        Muon(matrices, lr=cfg.lr, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
        if matrices
        else None
    )

    step = 0
    run = Run(cfg, w, model, forward, hf, corpus, sampler, val, optimizer, 0, 0, None, muon=muon)
    if cfg.resume:
        # Also puts back each rank's RNG states (torch, CUDA, Python, NumPy).
        extra = checkpoint.load(cfg.resume, model, run.state_of, trainable_only=bool(cfg.lora))
        step = int((extra or {}).get("step", cfg.resume_step))
    run.last_good = Path(cfg.resume) if cfg.resume else None
    run.n_trained = sum(p.numel() for p in params)
    run.step = step
    return run


def muon_matrices(model: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters Muon steps: the weights of the blocks' linear layers. Embeddings,
    the output head (tied to the embedding here), norms and biases stay with AdamW,
    as torch's Muon documentation splits them."""
    skip = {
        id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()
    }
    found: dict[int, torch.Tensor] = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and not name.endswith("lm_head"):
            w = m.weight
            if w.requires_grad and w.dim() == 2 and id(w) not in skip:
                found.setdefault(id(w), w)
    return list(found.values())


# ---- one step, the validation loss, a checkpoint --------------------------------------------


def train_step(run: Run, step: int) -> tuple[torch.Tensor, float]:
    """One optimizer step: forward and backward of each microbatch, clip, update.

    Returns this rank's mean loss (a tensor, not yet shared) and the gradient norm.
    """
    cfg, model = run.cfg, run.model
    for optimizer in run.optimizers:
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr_at(step)
    micro_steps = cfg.grad_accum
    loss_sum = torch.zeros((), device=run.w.device)
    for k in range(micro_steps):
        # Reduce gradients once per step, after the last microbatch.
        model.set_requires_gradient_sync(k == micro_steps - 1)
        x, y = run.sampler.batch(step, k)
        loss = loss_of(run, x, y)
        (loss / micro_steps).backward()
        loss_sum += loss.detach()
    grad_norm = _clip(model, cfg.grad_clip)
    # Checked before the update: a non-finite norm (the same on every rank)
    # would write nan into every weight.
    if not math.isfinite(grad_norm):
        raise diverged("gradient norm", grad_norm, step, run.last_good)
    for optimizer in run.optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss_sum / micro_steps, grad_norm


def loss_of(run: Run, x: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    logits = run.forward(x.to(run.w.device, non_blocking=True))
    return F.cross_entropy(
        logits.float().flatten(0, 1), y.to(run.w.device).flatten(), reduction=reduction
    )


def evaluate(run: Run) -> float:
    """The validation loss per token, over every rank's windows."""
    device = run.w.device
    total = torch.zeros(2, dtype=torch.float64, device=device)
    run.model.eval()  # no dropout (transformers models may have some)
    with torch.no_grad():
        for chunk in run.val_offsets.split(run.sampler.micro):
            x, y = windows(run.corpus.val, chunk, run.cfg.seq_len)
            total += torch.stack(
                [loss_of(run, x, y, "sum").double(), torch.tensor(y.numel(), device=device)]
            )
    run.model.train()
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def save(run: Run, at: int) -> Path:
    """Checkpoint step ``at`` (every rank); a failure ends the run in one line."""
    cfg, out = run.cfg, run.out
    # The batch of a step is a function of (seed, step): the data position
    # is the step. Each rank's RNG states are saved by the checkpoint itself.
    path = checkpoint_path(run, at)
    extra = {
        "step": at,
        "model": cfg.model,
        "model_config": cfg.model_config,
        "data": {"seed": cfg.seed, "next_step": at + 1, "corpus_sha256": run.corpus.sha256},
    }
    try:
        checkpoint.save(path, run.model, run.state_of, extra=extra, trainable_only=bool(cfg.lora))
    except BaseException as e:
        if passes_through(e) or peer_lost(e) or peer_timeout(e):
            raise
        # Every rank gets a failed save (DCP shares the outcome): one line.
        # Measured before the half-written folder goes: a full disk shows.
        why = save_failure(e, out, need=12 * run.n_trained)  # fp32 weights, AdamW's 2 moments
        if run.w.is_main:  # of no use, and on a full disk it holds what a resume needs
            remove_unfinished_saves(out)
        raise RunFailure(
            f"saving {path.relative_to(out)} failed: {why}; {kept(run.last_good)}"
        ) from e
    run.last_good, run.saved_at = path, at
    return path


def checkpoint_path(run: Run, step: int) -> Path:
    return run.out / "checkpoints" / f"step_{step:06d}"


# ---- the loop and its end -------------------------------------------------------------------


def train_loop(run: Run, stop: StopRequest, report: Reporter | None) -> bool:
    """Steps to the last one, or to a stop any rank was asked for (Ctrl-C, SIGTERM), every
    rank at the same step boundary; one row of metrics per step. Whether it stopped."""
    cfg, w = run.cfg, run.w
    tokens_per_step = cfg.batch_size * cfg.seq_len
    # One step of each launch is traced into timeline.json/png: the second, warmed up.
    traced_step = min(run.step + 2, cfg.steps)
    if w.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    stopped, t_start = False, time.perf_counter()
    while run.step < cfg.steps and not stopped:
        step = run.step = run.step + 1
        t0 = time.perf_counter()
        with trace() if step == traced_step else contextlib.nullcontext() as timeline:
            loss, grad_norm = train_step(run, step)
            loss_val, stopped = _share_loss_and_stop(loss, stop, w)
            if not math.isfinite(loss_val):
                raise diverged("loss", loss_val, step, run.last_good)
            dt = time.perf_counter() - t0
        if timeline is not None and report:
            report.timeline(timeline, step)
        row = {
            "step": step,
            "loss": loss_val,
            "lr": cfg.lr_at(step),
            "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_step / dt,
            "peak_mem_bytes": _peak_memory(w),
            "time_s": time.perf_counter() - t_start,
        }
        if step % cfg.eval_every == 0 or step == cfg.steps:
            row["val_loss"] = evaluate(run)
        if cfg.save_every and step % cfg.save_every == 0:
            save(run, step)
        if report:
            report.row(row)
    return stopped


def _share_loss_and_stop(loss: torch.Tensor, stop: StopRequest, w: Worker) -> tuple[float, bool]:
    """The loss averaged over ranks, and whether any rank was asked to stop, in one
    reduction: the summary names the signal even when another rank got it first."""
    signalled = [float(stop.signum == sig) for sig in STOP_SIGNALS]
    shared = torch.tensor([0.0, *signalled], device=w.device)
    shared[0] = loss
    dist.all_reduce(shared)
    got = [sig for sig, n in zip(STOP_SIGNALS, shared[1:].tolist()) if n > 0]
    if got and stop.signum is None:
        stop.signum = got[0]
    return shared[0].item() / w.world, bool(got)


def finish(run: Run, stopped: bool, stop: StopRequest, report: Reporter | None) -> None:
    """The last checkpoint (unless the last step saved one), a finished fine-tune's export,
    and the summary."""
    path = checkpoint_path(run, run.step) if run.saved_at == run.step else save(run, run.step)
    # A finished fine-tune also leaves a folder transformers loads.
    exported = None
    if run.hf and not stopped:
        exported = finetune.export_at_end(run.hf, run.out, run.cfg, path)
    if report:
        report.finish(run.step, stopped, stop.signum, path, exported=exported)


def _clip(model: Any, max_norm: float) -> float:
    """Clip to ``max_norm`` (0: no clipping) and return the total gradient norm."""
    # One all-reduce for all shards.
    return float(clip_grad_norm_(model.parameters(), max_norm or float("inf")))


def _peak_memory(w: Worker) -> int:
    """Peak GPU memory allocated by tensors; on CPU, the process's peak resident size."""
    if w.device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(w.device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
