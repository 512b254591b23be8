"""The settings of a ``shardwise train`` run: its flags, the resumed run's, and their checks.

A run is described by one dict, resolved once (by our launcher, or by rank 0
under ``torchrun``) before anything is written: the flags given, else the
resumed run's, else the defaults below; then checked, each bad value refused
in one line (``UsageError``). ``train.py`` hands the result to its workers and
writes it to the run folder as ``config.json``.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .common import UsageError, add_launch_arguments
from .finetune import DEFAULTS as FINETUNE_DEFAULTS
from .launcher import add_fault_arguments
from .run_folder import find_checkpoint, holds_only_the_lock, is_checkpoint

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

_STEP = re.compile(r"step_(\d+)")  # a checkpoint folder's name
# Smaller models take larger steps; 2e-3 makes the 1B model spike early on.
PEAK_LR = {"tiny": 2e-3, "small": 1e-3, "base": 6e-4, "medium": 3e-4, "large": 1.5e-4}
# The numeric flags, by argparse group: (flag, type, help). Their defaults are
# DEFAULTS' (None here: with --resume, "not given" takes the resumed run's).
_NUMBERS: dict[str, list[tuple[str, type, str]]] = {
    "training": [
        ("--steps", int, "optimizer steps in all (default: 200)"),
        ("--batch-size", int, "sequences per optimizer step, over all processes (default: 16)"),
        ("--seq-len", int, "tokens (bytes) per sequence (default: the model's)"),
        (
            "--lr",
            float,
            "peak learning rate of AdamW (default: tiny 2e-3, small 1e-3, base 6e-4, "
            "medium 3e-4, large 1.5e-4)",
        ),
        ("--warmup", int, "linear warmup steps (default: steps/10, at most 100)"),
        ("--grad-clip", float, "max gradient norm, 0 for none (default: 1.0)"),
        ("--grad-accum", int, "microbatches per optimizer step (default: 1)"),
    ],
    "data and output": [
        ("--eval-every", int, "validate every N steps (default: 20)"),
        ("--eval-batches", int, "validation size in batches (default: 4)"),
        (
            "--save-every",
            int,
            "also checkpoint every N steps (default: 0, only at the end or when stopped)",
        ),
    ],
}


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
    for flag, type_, help_ in _NUMBERS["training"]:
        t.add_argument(flag, type=type_, help=help_)
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
    for flag, type_, help_ in _NUMBERS["data and output"]:
        d.add_argument(flag, type=type_, help=help_)
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
    add_fault_arguments(p)
    return p


# ---- the run's config: flags, resumed run, checks -------------------------------------------


def resolve(args: argparse.Namespace, world: int) -> dict[str, Any]:
    """Every setting of the run, checked. Raises ``UsageError``; writes nothing."""
    import torch

    from shardwise import __version__

    from ..data import DataError, check_data_path
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
    try:  # (tokenized under the run's lock: cli/corpus.py)
        check_data_path(c["data"])
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
        "corpus": None,  # prepare_corpus fills it in, under the lock
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


def for_restart(config: dict[str, Any], out: Path) -> tuple[dict[str, Any], Path | None]:
    """The config that continues ``config``'s run from the newest good checkpoint in ``out``,
    and that checkpoint; with none there yet, the run as it began, and ``None``."""
    try:
        ckpt, _ = find_checkpoint(str(out), "--resume")
    except UsageError:
        return config, None
    resume = {
        "resume": str(ckpt.resolve()),
        "resume_step": _step_of(ckpt),
        "resumed_metrics": str(out / "metrics.jsonl"),
    }
    return {**config, **resume}, ckpt


def newest_saved(out: Path) -> Path | None:
    """The newest complete checkpoint in ``out``, for a message: not verified, which
    can take minutes for a large one (``--resume`` verifies it)."""
    complete = [c for c in (out / "checkpoints").glob("step_*") if is_checkpoint(c)]
    return max((c for c in complete if _STEP.fullmatch(c.name)), key=_step_of, default=None)


def is_new_run(config: dict[str, Any]) -> bool:
    """Whether ``--out`` is a new folder, not the resumed run's own."""
    resumed = config["resumed_metrics"]
    return resumed is None or Path(resumed).parent != Path(config["out"])


def _step_of(ckpt: Path) -> int:
    m = _STEP.fullmatch(ckpt.name)
    return int(m.group(1)) if m else 0
