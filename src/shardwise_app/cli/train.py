"""``shardwise train``: train a small GPT, or fine-tune a transformers model, fully sharded.

Started by a person, this checks the flags, prepares the run folder and starts
the workers through ``torch.distributed.run``; started as a worker (by us or
by ``torchrun`` directly) it trains. The worker half reads top to bottom:
process group, run config, model, data, optimizer, resume, the loop, the end.
What is particular to ``--hf PATH`` (a model from disk, LoRA, the export)
lives in ``finetune.py``.

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
import re
import resource
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, cast

from .failures import (
    RunFailure,
    diverged,
    kept,
    passes_through,
    peer_lost,
    report_worker_failure,
    save_failure,
)
from .finetune import DEFAULTS as FINETUNE_DEFAULTS
from .main import (
    LAUNCH_ID_ENV,
    UsageError,
    Worker,
    add_launch_arguments,
    from_rank0,
    in_worker,
    init_worker,
    launch,
    launch_from_args,
)
from .report import Reporter, read_json
from .run_folder import (
    commit,
    create_and_lock,
    find_checkpoint,
    holds_only_the_lock,
    remove_if_unused,
    remove_unfinished_saves,
)
from .signals import STOP_SIGNALS, StopRequest, stop_when_orphaned

# Flags that describe the training itself. With --resume, each one not given
# on the command line is taken from the resumed run, so a bare
# `shardwise train --resume DIR` continues exactly where the run stopped.
DEFAULTS: dict[str, Any] = {
    "model": "tiny",
    "steps": 200,
    "batch_size": 16,  # sequences per optimizer step, over all ranks and microbatches
    "seq_len": None,  # the model size's own
    "lr": None,  # the model size's, from PEAK_LR
    "warmup": None,  # steps // 10, at most 100
    "grad_clip": 1.0,
    "grad_accum": 1,
    "hsdp": 1,
    "activation_checkpointing": "none",
    "mixed_precision": "none",
    "data": None,  # the Python standard library's sources
    "seed": 1337,
    "eval_every": 20,
    "eval_batches": 4,
    "save_every": 0,
    "compile": False,
    **FINETUNE_DEFAULTS,
}
# How our launcher hands the resolved config to its workers (see main()).
CONFIG_ENV = "SHARDWISE_RUN_CONFIG"
# Keeps the run folder's lock alive in a worker that took it (torchrun direct).
_held: list[Any] = []
# Smaller models take larger steps; 2e-3 makes the 1B model spike early on.
PEAK_LR = {"tiny": 2e-3, "small": 1e-3, "base": 6e-4, "medium": 3e-4, "large": 1.5e-4}


def build_parser() -> argparse.ArgumentParser:
    from ..models.gpt import CHECKPOINTING, SIZES
    from . import finetune

    p = argparse.ArgumentParser(
        prog="shardwise train",
        description="Train a small byte-level GPT, or fine-tune a transformers model from "
        "disk (--hf), with every block fully sharded.",
        epilog="With --resume, every training flag not given is taken from the resumed run.",
    )
    t = p.add_argument_group("training")
    t.add_argument("--model", choices=list(SIZES), help="model size (default: tiny)")
    t.add_argument("--steps", type=int, help="optimizer steps in all (default: 200)")
    t.add_argument(
        "--batch-size",
        type=int,
        help="sequences per optimizer step, over all processes (default: 16)",
    )
    t.add_argument("--seq-len", type=int, help="tokens (bytes) per sequence (default: the model's)")
    t.add_argument(
        "--lr",
        type=float,
        help="peak learning rate of AdamW (default: tiny 2e-3, small 1e-3, base 6e-4, medium 3e-4, large 1.5e-4)",
    )
    t.add_argument(
        "--warmup", type=int, help="linear warmup steps (default: steps/10, at most 100)"
    )
    t.add_argument("--grad-clip", type=float, help="max gradient norm, 0 for none (default: 1.0)")
    t.add_argument("--grad-accum", type=int, help="microbatches per optimizer step (default: 1)")
    t.add_argument(
        "--activation-checkpointing",
        choices=CHECKPOINTING,
        help="recompute block activations in backward (default: none)",
    )
    t.add_argument(
        "--mixed-precision",
        choices=["none", "bf16"],
        help="bf16: compute in bfloat16, reduce gradients in float32 (default: none)",
    )
    t.add_argument(
        "--hsdp",
        type=int,
        help="replicate degree R: shard within groups of "
        "world/R processes, replicate across R groups (default: 1, plain FSDP)",
    )
    t.add_argument("--seed", type=int, help="seed of the initial weights and the data order")
    t.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile each sharded block (block.compile()): inductor on CUDA, aot_eager on "
        "CPU (default: off)",
    )
    finetune.add_arguments(p)
    d = p.add_argument_group("data and output")
    d.add_argument(
        "--data",
        metavar="PATH",
        help="a text file or a folder of text files "
        "(default: the Python standard library's sources)",
    )
    d.add_argument("--eval-every", type=int, help="validate every N steps (default: 20)")
    d.add_argument("--eval-batches", type=int, help="validation size in batches (default: 4)")
    d.add_argument(
        "--save-every",
        type=int,
        help="also checkpoint every N steps (default: 0, only at the end or when stopped)",
    )
    d.add_argument(
        "--out",
        metavar="DIR",
        help="run folder (default: runs/<timestamp>; with --resume, the resumed run's folder)",
    )
    d.add_argument(
        "--resume",
        metavar="DIR",
        help="continue from a run folder (its latest checkpoint) or a checkpoint folder",
    )
    add_launch_arguments(p)
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if in_worker():
        return train(args)
    where = launch_from_args(args)
    config = resolve(args, world=where.world)
    out = Path(config["out"])
    if where.node_rank:
        # Another node's launcher: node 0's holds the run folder and its lock,
        # and its config is the run's (the workers take rank 0's). This one
        # only checked the flags, and writes nothing.
        os.environ[CONFIG_ENV] = json.dumps(config)
        return launch("train", {"out": out}, where, on_signal=lambda _, signum: 128 + signum)
    _lock, created = create_and_lock(out, "--out", new_run=_is_new_run(config))
    try:
        for name in remove_unfinished_saves(out):
            print(f"removed checkpoints/{name}: a save that never finished", file=sys.stderr)
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

        return launch("train", {"out": out}, where, on_signal=on_signal)
    finally:
        remove_if_unused(out, created)


# ---- the run's config: flags, resumed run, checks -------------------------------------------


def resolve(args: argparse.Namespace, world: int) -> dict[str, Any]:
    """Every setting of the run, checked. Raises ``UsageError``; writes nothing."""
    import torch

    from shardwise import __version__

    from ..data import DataError, load_corpus
    from ..models.gpt import SIZES
    from . import finetune

    given = {k: getattr(args, k) for k in DEFAULTS if getattr(args, k) is not None}
    resumed: dict[str, Any] = {}
    ckpt: Path | None = None
    if args.resume:
        ckpt, resumed = find_checkpoint(args.resume, "--resume")
    ckpt_step = _step_of(ckpt) if ckpt else 0
    if ckpt:
        for k in ("model", "seq_len"):
            if k in given and given[k] != resumed.get(k):
                raise UsageError(
                    f"--resume {args.resume}: the checkpoint is of model {resumed.get('model')!r} "
                    f"with seq_len {resumed.get('seq_len')}; --{k.replace('_', '-')} {given[k]} "
                    "does not match it"
                )
    c = {k: given.get(k, resumed.get(k, v)) for k, v in DEFAULTS.items()}
    if ckpt:  # (resolve runs once: in our launcher, or on rank 0 under torchrun)
        for k in ("steps", "batch_size", "grad_accum", "lr", "warmup"):
            if k in given and resumed.get(k) is not None and given[k] != resumed[k]:
                # Allowed (a longer run, say), but the curve is no longer the
                # uninterrupted run's: say so rather than change it quietly.
                print(
                    f"note: --{k.replace('_', '-')} {given[k]} differs from the resumed run's "
                    f"{resumed[k]}: from step {ckpt_step} on the run follows {given[k]}"
                    + (" (the learning-rate schedule too)" if k in ("steps", "warmup") else ""),
                    file=sys.stderr,
                )
    model_config = finetune.resolve(c, given, resumed, args.resume)
    if model_config is None:  # the built-in GPT
        model_cfg = SIZES[c["model"]].with_seq_len(c["seq_len"])
        c["seq_len"] = model_cfg.seq_len
        model_config = asdict(model_cfg)
        if resumed and resumed.get("model_config") != model_config:
            raise UsageError(
                f"--resume {args.resume}: the checkpoint's model shape "
                f"{resumed.get('model_config')} differs from {c['model']!r} here"
            )
    if c["lr"] is None:
        c["lr"] = PEAK_LR[c["model"]]
    if c["warmup"] is None:
        c["warmup"] = min(100, c["steps"] // 10)
    for k in ("steps", "batch_size", "seq_len", "grad_accum", "hsdp", "eval_every", "eval_batches"):
        if c[k] < 1:
            raise UsageError(f"--{k.replace('_', '-')} must be at least 1, got {c[k]}")
    for k in ("warmup", "save_every"):
        if c[k] < 0:
            raise UsageError(f"--{k.replace('_', '-')} must be at least 0, got {c[k]}")
    # A negative clip reverses the gradients and nan or inf poison every
    # weight: each trains quietly into garbage, so refuse them here.
    if not (math.isfinite(c["lr"]) and c["lr"] > 0):
        raise UsageError(f"--lr must be a positive number, got {c['lr']}")
    if not (math.isfinite(c["grad_clip"]) and c["grad_clip"] >= 0):
        raise UsageError(
            f"--grad-clip must be a number at least 0 (0: no clipping), got {c['grad_clip']}"
        )
    if world % c["hsdp"]:
        raise UsageError(f"--hsdp {c['hsdp']} does not divide the {world} processes")
    if c["batch_size"] % (world * c["grad_accum"]):
        raise UsageError(
            f"--batch-size {c['batch_size']} is not divisible by {world} processes "
            f"x --grad-accum {c['grad_accum']}"
        )
    if ckpt_step >= c["steps"]:
        raise UsageError(
            f"--resume {args.resume}: the checkpoint is at step {ckpt_step}, "
            f"--steps is {c['steps']}: nothing left to do (raise --steps)"
        )
    try:
        corpus = load_corpus(c["data"], min_split_bytes=c["seq_len"] + 1)
    except DataError as e:
        raise UsageError(str(e)) from None
    if c["data"] is not None:
        c["data"] = str(Path(c["data"]).resolve())

    run = ckpt.parent.parent if ckpt else None
    out = _out_folder(args, resumed_run=run)
    return {
        **c,
        "model_config": model_config,
        "world_size": world,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "out": str(out),
        "resume": str(ckpt.resolve()) if ckpt else None,
        "resume_step": ckpt_step,
        "resumed_metrics": str(run.resolve() / "metrics.jsonl") if run else None,
        "corpus": corpus.describe(),
        "torch_version": torch.__version__,
        "shardwise_version": __version__,
    }


def _out_folder(args: argparse.Namespace, resumed_run: Path | None) -> Path:
    if args.out is None and resumed_run is not None:
        return resumed_run.resolve()
    if args.out is None:
        base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
        out, n = base, 1
        while out.exists():
            out, n = base.with_name(f"{base.name}-{n}"), n + 1
        return out.resolve()
    out = Path(args.out).resolve()
    continuing = resumed_run is not None and out == resumed_run.resolve()
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {args.out}: exists and is not a folder")
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        raise UsageError(f"--out {args.out}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"--out {args.out}: cannot write in {existing} (permission denied)")
    if out.is_dir() and not holds_only_the_lock(out) and not continuing:
        raise UsageError(
            f"--out {args.out}: the folder already holds files; choose a new "
            "one (or --resume the run in it)"
        )
    return out


# ---- the worker -----------------------------------------------------------------------------


def train(args: argparse.Namespace) -> int:
    # Signals only raise a flag from here on; until the process group is
    # joined, the entry module still ends the worker at once (cli/worker.py).
    stop = StopRequest()
    stop_when_orphaned()
    w = init_worker()
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

    from ..data import BatchSampler, DataError, eval_offsets, load_corpus, windows
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
            _held.append(create_and_lock(out, "--out", new_run=_is_new_run(c))[0])
            remove_unfinished_saves(out)
            return c

        cfg = from_rank0(resolve_and_lock, "train")
    out = Path(cfg["out"])

    # Model: the same initial weights on every rank, then each keeps its shards.
    torch.manual_seed(cfg["seed"])
    model, forward, hf, tokenizer = finetune.build_model(cfg, w.device, w.world)

    # Data: the same corpus on every rank; each rank reads its own windows.
    try:
        corpus = load_corpus(cfg["data"], min_split_bytes=cfg["seq_len"] + 1, tokenizer=tokenizer)
    except DataError as e:  # tokens can be fewer than the bytes the launcher counted
        raise RunFailure(str(e)) from None
    if corpus.sha256 != cfg["corpus"]["sha256"] and w.is_main:
        print(
            "warning: the data changed since this run started; losses will differ", file=sys.stderr
        )
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
            if passes_through(e) or peer_lost(e):
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


def _is_new_run(config: dict[str, Any]) -> bool:
    """Whether ``--out`` is a new folder, not the resumed run's own."""
    resumed = config["resumed_metrics"]
    return resumed is None or Path(resumed).parent != Path(config["out"])


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


def _step_of(ckpt: Path) -> int:
    m = re.fullmatch(r"step_(\d+)", ckpt.name)
    return int(m.group(1)) if m else 0
