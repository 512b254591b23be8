"""``shardwise train``: train a small GPT, or fine-tune a transformers model, fully sharded.

Started by a person, this checks the flags, prepares the run folder and starts
the workers (``launcher.py``, which restarts them with ``--max-restarts``);
started as a worker (by us or by ``torchrun`` directly) it trains. The worker half reads top to bottom:
process group, run config, model, data, optimizer, resume, the loop, the end.
The flags and their checks are ``train_config.py``'s; what is particular to
``--hf PATH`` (a model from disk, LoRA, the export) lives in ``finetune.py``.

Every run folder holds ``config.json``, ``metrics.jsonl`` (one row per step),
``loss.png``, ``throughput.png``, ``summary.json`` and ``checkpoints/step_N``;
a finished ``--hf`` run also ``export/``.
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
from pathlib import Path
from typing import Any, cast

from .common import LAUNCH_ID_ENV, in_worker, launch_from_args
from .corpus import open_corpus
from .corpus import prepare as prepare_corpus
from .failures import (
    RunFailure,
    diverged,
    kept,
    passes_through,
    peer_lost,
    peer_timeout,
    report_worker_failure,
    save_failure,
)
from .launcher import check_fault_arguments, launch
from .process_group import Worker, from_rank0, init_worker
from .report import Reporter, read_json, read_jsonl
from .run_folder import (
    commit,
    create_and_lock,
    remove_if_unused,
    remove_unfinished_saves,
)
from .signals import STOP_SIGNALS, StopRequest, stop_when_orphaned
from .train_config import build_parser, for_restart, is_new_run, newest_saved, resolve

# How our launcher hands the resolved config to its workers (see main()).
CONFIG_ENV = "SHARDWISE_RUN_CONFIG"
# Keeps the run folder's lock alive in a worker that took it (torchrun direct).
_held: list[Any] = []


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if in_worker():
        return train(args)
    where = launch_from_args(args)
    check_fault_arguments(args)
    config = resolve(args, world=where.world)
    out = Path(config["out"])
    if where.node_rank:
        # Another node's launcher: node 0's holds the run folder and its lock,
        # and its config is the run's (the workers take rank 0's). This one
        # only checked the flags, and writes nothing.
        os.environ[CONFIG_ENV] = json.dumps(config)
        return launch(
            "train",
            {"out": out, "timeout": args.timeout},
            where,
            on_signal=lambda _, signum: 128 + signum,
        )
    _lock, created = create_and_lock(out, "--out", new_run=is_new_run(config))
    try:
        for name in remove_unfinished_saves(out):
            print(f"removed checkpoints/{name}: a save that never finished", file=sys.stderr)
        config["corpus"] = prepare_corpus(config, out)  # once, for every rank to map
        # Workers get the config from us and write it to the run folder
        # themselves, once the checkpoint has loaded: nothing changes before.
        os.environ[CONFIG_ENV] = json.dumps(config)

        def on_signal(launch_id: str, signum: int) -> int:
            if read_json(out / "summary.json").get("launch_id") == launch_id:
                return 0  # stopped at a step boundary and saved
            if read_json(out / "config.json").get("launch_id") != launch_id:
                # The workers never got to write: one line for all of them.
                # (Otherwise the stop's save failed, and a worker said why.)
                print(_stopped_early(signum, config), file=sys.stderr)
            return 128 + signum

        def on_restart(what: str) -> str:
            remove_unfinished_saves(out)  # the failed launch's save, if it was saving
            rows = read_jsonl(out / "metrics.jsonl")
            started = read_json(out / "config.json").get("launch_id") == os.environ[LAUNCH_ID_ENV]
            at = f"at step {rows[-1]['step'] + 1 if rows else 1}" if started else "while starting"
            restart, ckpt = for_restart(config, out)
            os.environ[CONFIG_ENV] = json.dumps(restart)
            start = ckpt.relative_to(out) if ckpt else "the start (nothing was saved yet)"
            return f"shardwise train: {what} {at}; restarting every worker from {start}"

        return launch(
            "train",
            {"out": out, "timeout": args.timeout},
            where,
            on_signal=on_signal,
            then=lambda: kept(newest_saved(out)),
            max_restarts=args.max_restarts,
            on_restart=on_restart,
        )
    finally:
        remove_if_unused(out, created)


# ---- the worker -----------------------------------------------------------------------------


def train(args: argparse.Namespace) -> int:
    # Signals only raise a flag from here on; until the process group is
    # joined, the entry module still ends the worker at once (cli/worker.py).
    stop = StopRequest()
    stop_when_orphaned()
    check_fault_arguments(args)
    w = init_worker(timeout_s=args.timeout)
    try:
        return _train(args, w, stop)
    except BaseException as e:  # one line, said by the one rank that should
        if passes_through(e):
            raise
        return report_worker_failure("train", e, w.rank)


def _train(args: argparse.Namespace, w: Worker, stop: StopRequest) -> int:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from shardwise import FSDPModule, checkpoint, trace

    from ..data import BatchSampler, eval_offsets, windows
    from ..models.gpt import num_params
    from . import finetune

    if CONFIG_ENV in os.environ:
        # Our launcher resolved it and holds the lock; with several nodes, node
        # 0's (rank 0's) is the run's: one run folder, one seed, one data order.
        cfg = from_rank0(lambda: json.loads(os.environ[CONFIG_ENV]), "train")
    else:  # started by torchrun directly: rank 0 does what our launcher would have done

        def resolve_and_lock() -> dict[str, Any]:
            c = resolve(args, world=w.world)
            out = Path(c["out"])
            _held.append(create_and_lock(out, "--out", new_run=is_new_run(c))[0])
            remove_unfinished_saves(out)
            c["corpus"] = prepare_corpus(c, out)  # once, for every rank to map
            return c

        cfg = from_rank0(resolve_and_lock, "train")
    out = Path(cfg["out"])

    # Model: the same initial weights on every rank, then each keeps its shards.
    torch.manual_seed(cfg["seed"])
    model, forward, hf, _ = finetune.build_model(cfg, w.device, w.world)

    # Data: the corpus file the launcher wrote, mapped; each rank reads its own windows.
    corpus = open_corpus(cfg)
    seq_len, micro_steps = cfg["seq_len"], cfg["grad_accum"]
    sampler = BatchSampler(
        corpus.train,
        seq_len=seq_len,
        batch_size=cfg["batch_size"],
        seed=cfg["seed"],
        rank=w.rank,
        world=w.world,
        grad_accum=micro_steps,
    )
    val_offsets = eval_offsets(
        corpus.val,
        seq_len=seq_len,
        rank=w.rank,
        world=w.world,
        n=cfg["eval_batches"] * cfg["batch_size"],
    )

    # AdamW, nanoGPT's recipe: no weight decay on gains and biases. With LoRA
    # only the adapters train, and only they (and their moments) are saved.
    params = [p for p in model.parameters() if p.requires_grad]
    trainable_only = bool(cfg["lora"])
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=cfg["lr"],
        betas=(0.9, 0.95),
        eps=1e-8,
    )

    step = 0
    if cfg["resume"]:
        # Also puts back each rank's RNG states (torch, CUDA, Python, NumPy).
        extra = checkpoint.load(cfg["resume"], model, optimizer, trainable_only=trainable_only)
        extra = extra or {}
        step = int(extra.get("step", cfg["resume_step"]))

    # Ctrl-C in the first seconds (a mistyped flag): leave before the run
    # folder changes at all. All ranks decide together, as at every step.
    asked = torch.tensor(float(stop.signum is not None), device=w.device)
    dist.all_reduce(asked)
    if asked.item() > 0:
        if w.is_main and CONFIG_ENV not in os.environ:  # else our launcher says it
            print(_stopped_early(stop.signum or signal.SIGINT, cfg), file=sys.stderr, flush=True)
        dist.destroy_process_group()
        return 0
    if w.is_main:
        commit({**cfg, "launch_id": os.environ.get(LAUNCH_ID_ENV)})

    def loss_of(x: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        logits = forward(x.to(w.device, non_blocking=True))
        return F.cross_entropy(
            logits.float().flatten(0, 1), y.to(w.device).flatten(), reduction=reduction
        )

    def evaluate() -> float:
        total = torch.zeros(2, dtype=torch.float64, device=w.device)
        model.eval()  # no dropout (transformers models may have some)
        with torch.no_grad():
            for chunk in val_offsets.split(sampler.micro):
                x, y = windows(corpus.val, chunk, seq_len)
                total += torch.stack(
                    [loss_of(x, y, "sum").double(), torch.tensor(y.numel(), device=w.device)]
                )
        model.train()
        dist.all_reduce(total)
        return (total[0] / total[1]).item()

    def save(at: int) -> Path:
        # The batch of a step is a function of (seed, step): the data position
        # is the step. Each rank's RNG states are saved by the checkpoint itself.
        path = out / "checkpoints" / f"step_{at:06d}"
        extra = {
            "step": at,
            "model": cfg["model"],
            "model_config": cfg["model_config"],
            "data": {"seed": cfg["seed"], "next_step": at + 1, "corpus_sha256": corpus.sha256},
        }
        try:
            checkpoint.save(path, model, optimizer, extra=extra, trainable_only=trainable_only)
        except BaseException as e:
            if passes_through(e) or peer_lost(e) or peer_timeout(e):
                raise
            # Every rank gets a failed save (DCP shares the outcome): one line.
            # Measured before the half-written folder goes: a full disk shows.
            why = save_failure(e, out, need=12 * n_trained)  # fp32 weights, AdamW's 2 moments
            if w.is_main:  # of no use, and on a full disk it holds what a resume needs
                remove_unfinished_saves(out)
            raise RunFailure(
                f"saving {path.relative_to(out)} failed: {why}; {kept(last_good)}"
            ) from e
        return path

    # The loop. One row of metrics per optimizer step; every rank stops at
    # the same step boundary when any of them was asked to (Ctrl-C, SIGTERM).
    n_params, n_trained = num_params(model), sum(p.numel() for p in params)
    report = Reporter(cfg, n_params, step, trained=n_trained) if w.is_main else None
    tokens_per_step = cfg["batch_size"] * seq_len
    saved_at, stopped, t_start = -1, False, time.perf_counter()
    last_good: Path | None = Path(cfg["resume"]) if cfg["resume"] else None
    # One step of each launch is traced into timeline.json/png: the second, warmed up.
    traced_step = min(step + 2, cfg["steps"])
    if w.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        while step < cfg["steps"] and not stopped:
            step += 1
            t0 = time.perf_counter()
            with trace() if step == traced_step else contextlib.nullcontext() as timeline:
                for group in optimizer.param_groups:
                    group["lr"] = lr_at(cfg, step)
                loss_sum = torch.zeros((), device=w.device)
                for k in range(micro_steps):
                    # Reduce gradients once per step, after the last microbatch.
                    cast(FSDPModule, model).set_requires_gradient_sync(k == micro_steps - 1)
                    loss = loss_of(*sampler.batch(step, k))
                    (loss / micro_steps).backward()
                    loss_sum += loss.detach()
                grad_norm = _clip(model, cfg["grad_clip"])
                # Checked before the update: a non-finite norm (the same on every
                # rank) would write nan into every weight. So is the loss after it.
                if not math.isfinite(grad_norm):
                    raise diverged("gradient norm", grad_norm, step, last_good)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                # The loss and which stop signal each rank got, in one reduction:
                # the summary names the signal even when another rank got it first.
                signalled = [float(stop.signum == sig) for sig in STOP_SIGNALS]
                shared = torch.tensor([0.0, *signalled], device=w.device)
                shared[0] = loss_sum / micro_steps
                dist.all_reduce(shared)
                loss_val = shared[0].item() / w.world
                got = [sig for sig, n in zip(STOP_SIGNALS, shared[1:].tolist()) if n > 0]
                stopped = bool(got)
                if got and stop.signum is None:
                    stop.signum = got[0]
                if not math.isfinite(loss_val):
                    raise diverged("loss", loss_val, step, last_good)
                dt = time.perf_counter() - t0
            if timeline is not None and report:
                report.timeline(timeline, step)
            row = {
                "step": step,
                "loss": loss_val,
                "lr": lr_at(cfg, step),
                "grad_norm": grad_norm,
                "tokens_per_s": tokens_per_step / dt,
                "peak_mem_bytes": _peak_memory(w),
                "time_s": time.perf_counter() - t_start,
            }
            if step % cfg["eval_every"] == 0 or step == cfg["steps"]:
                row["val_loss"] = evaluate()
            if cfg["save_every"] and step % cfg["save_every"] == 0:
                last_good = save(step)
                saved_at = step
            if report:
                report.row(row)

        path = save(step) if saved_at != step else out / "checkpoints" / f"step_{step:06d}"
        # A finished fine-tune also leaves a folder transformers loads.
        exported = finetune.export_at_end(hf, out, cfg, path) if hf and not stopped else None
        if report:
            report.finish(step, stopped, stop.signum, path, exported=exported)
    except BaseException:
        if report:
            report.abort()  # the terminal gets its cursor back; the rows so far stay
        raise
    # Leave together: a rank tearing down its connections while rank 0 still
    # plots was once seen to abort on exit.
    dist.barrier()
    dist.destroy_process_group()
    return 0


def lr_at(cfg: dict[str, Any], s: int) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak at the last step."""
    if s <= cfg["warmup"]:
        return cfg["lr"] * s / max(1, cfg["warmup"])
    frac = (s - cfg["warmup"]) / max(1, cfg["steps"] - cfg["warmup"])
    return cfg["lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def _stopped_early(signum: int, config: dict[str, Any]) -> str:
    kept = "the run folder is unchanged" if config["resume"] else "nothing was saved"
    return (
        f"shardwise train: stopped by {signal.Signals(signum).name} before the first step; {kept}"
    )


def _clip(model: Any, max_norm: float) -> float:
    """Clip to ``max_norm`` (0: no clipping) and return the total gradient norm."""
    from shardwise import clip_grad_norm_  # one all-reduce for all shards

    return float(clip_grad_norm_(model.parameters(), max_norm or float("inf")))


def _peak_memory(w: Worker) -> int:
    """Peak GPU memory allocated by tensors; on CPU, the process's peak resident size."""
    import torch

    if w.device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(w.device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
