"""The settings of a ``shardwise train`` run: its flags, the resumed run's, and their checks.

A run is described by one ``RunConfig`` (run_config.py), resolved once (by
our launcher, or by rank 0 under ``torchrun``) before anything is written:
the flags given, else the resumed run's, else ``TrainingFlags``' defaults;
then checked, each bad value refused in one line (``UsageError``).
``train.py`` hands the result to its workers and writes it to the run
folder as ``config.json``.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from .common import OneLineParser, UsageError, add_launch_arguments, check_writable
from .fits import Shape, check_seq_len, memory_per_process, memory_warning
from .launcher import add_fault_arguments
from .run_config import RunConfig, TrainingFlags
from .run_folder import find_checkpoint, holds_only_the_lock, is_checkpoint

_STEP = re.compile(r"step_(\d+)")  # a checkpoint folder's name
# Smaller models take larger steps; 2e-3 makes the 1B model spike early on.
PEAK_LR = {"tiny": 2e-3, "small": 1e-3, "base": 6e-4, "medium": 3e-4, "large": 1.5e-4}
_D = TrainingFlags()
OPTIMIZERS = ["adamw", "muon"]
# The numeric flags, by argparse group: (flag, type, help). Their defaults are
# TrainingFlags' (None here: with --resume, "not given" takes the resumed run's).
_NUMBERS: dict[str, list[tuple[str, type, str]]] = {
    "training": [
        ("--steps", int, f"optimizer steps in all (default: {_D.steps})"),
        (
            "--batch-size",
            int,
            f"sequences per optimizer step, over all processes (default: {_D.batch_size})",
        ),
        ("--seq-len", int, "tokens (bytes) per sequence (default: the model's)"),
        (
            "--lr",
            float,
            "peak learning rate of AdamW, and of Muon's updates scaled to AdamW's size "
            "(default: tiny 2e-3, small 1e-3, base 6e-4, "
            "medium 3e-4, large 1.5e-4)",
        ),
        ("--warmup", int, "linear warmup steps (default: steps/10, at most 100)"),
        ("--grad-clip", float, f"max gradient norm, 0 for none (default: {_D.grad_clip})"),
        ("--grad-accum", int, f"microbatches per optimizer step (default: {_D.grad_accum})"),
    ],
    "data and output": [
        ("--eval-every", int, f"validate every N steps (default: {_D.eval_every})"),
        ("--eval-batches", int, f"validation size in batches (default: {_D.eval_batches})"),
        (
            "--save-every",
            int,
            f"also checkpoint every N steps (default: {_D.save_every}, only at the end or "
            "when stopped)",
        ),
    ],
}


def build_parser() -> argparse.ArgumentParser:
    from ..models.gpt import CHECKPOINTING, SIZES
    from . import finetune

    p = OneLineParser(
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
    t.add_argument(
        "--comm-policy",
        metavar="NAME",
        help="collectives across nodes: none, qwz (int8 weight gathers in forward), "
        "qwz-always (and in backward), hpz (backward gathers inside the node), qgz "
        "(gradients reduced inside the node, then int8 across), zeropp (qwz + hpz + qgz) "
        "(default: none; docs/communication.md)",
    )
    t.add_argument(
        "--node-size",
        type=int,
        metavar="N",
        help="processes per node for --comm-policy (default: --nproc, the processes here)",
    )
    t.add_argument(
        "--optimizer",
        metavar="NAME",
        help="adamw, or muon: shardwise.optim.Muon for the blocks' matrices (each "
        "orthogonalized by one process), AdamW for embeddings, norms and biases "
        "(default: adamw; docs/optimizers.md)",
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


def resolve(args: argparse.Namespace, world: int, local: int | None = None) -> RunConfig:
    """Every setting of the run, checked. Raises ``UsageError``; writes nothing.

    ``local``: the processes on this node, who share its memory (default:
    ``world``). Notes and warnings are printed once every check has passed,
    so that a refusal is one line.
    """
    import torch

    from shardwise import __version__

    from ..data import DataError, check_data_path
    from . import finetune

    if args.out is not None:  # before a resume's checkpoint is verified: minutes for a large one
        check_writable(Path(args.out).resolve(), f"--out {args.out}")
    given = {k: getattr(args, k) for k in TrainingFlags.names() if getattr(args, k) is not None}
    resumed: RunConfig | None = None
    ckpt: Path | None = None
    if args.resume:
        ckpt, resumed = find_checkpoint(args.resume, "--resume")
    ckpt_step = _step_of(ckpt) if ckpt else 0
    if resumed:
        for k in ("model", "seq_len"):
            if k in given and given[k] != getattr(resumed, k):
                raise UsageError(
                    f"--resume {args.resume}: the checkpoint is of model {resumed.model!r} "
                    f"with seq_len {resumed.seq_len}; --{k.replace('_', '-')} {given[k]} "
                    "does not match it"
                )
        if "optimizer" in given and given["optimizer"] != resumed.optimizer:
            raise UsageError(
                f"--resume {args.resume}: the run trained with --optimizer {resumed.optimizer}, "
                f"whose state the checkpoint holds; --optimizer {given['optimizer']} cannot "
                "continue it"
            )
    c = replace(resumed.flags() if resumed else TrainingFlags(), **given)
    _check_optimizer(c)
    fine_tune = finetune.resolve(c, given, resumed, args.resume)
    if fine_tune is None:
        model_config, hf_weights = _gpt_shape(c, resumed, args.resume), None
    else:
        model_config, hf_weights = fine_tune
    if c.lr is None:
        c.lr = PEAK_LR[c.model]
    if c.warmup is None:
        c.warmup = min(100, c.steps // 10)
    _check_numbers(c, world)
    _check_comm_policy(c, world, world if local is None else local)
    if ckpt_step >= c.steps:
        raise UsageError(_nothing_left(args.resume, ckpt_step, c.steps, "steps" in given))
    try:  # (tokenized under the run's lock: cli/corpus.py)
        check_data_path(c.data)
    except DataError as e:
        raise UsageError(str(e)) from None
    if c.data is not None:
        c.data = str(Path(c.data).resolve())

    run = ckpt.parent.parent if ckpt else None
    out = _out_folder(args, resumed_run=run)
    config = RunConfig(
        **vars(c),
        hf_weights=hf_weights,
        model_config=model_config,
        world_size=world,
        device="cuda" if torch.cuda.is_available() else "cpu",
        out=str(out),
        resume=str(ckpt.resolve()) if ckpt else None,
        resume_step=ckpt_step,
        resumed_metrics=str(run.resolve() / "metrics.jsonl") if run else None,
        corpus=None,  # prepare_corpus fills it in, under the lock
        torch_version=torch.__version__,
        shardwise_version=__version__,
    )
    said = _differences(given, resumed, ckpt_step) if resumed else []
    warning = _memory_warning(config, world if local is None else local)
    for line in [*said, warning] if warning else said:
        print(line, file=sys.stderr)
    return config


def _gpt_shape(c: TrainingFlags, resumed: RunConfig | None, resume_arg: str | None) -> dict:
    """The built-in GPT's shape for the run (``c.seq_len`` completed); refuses a new run's
    sequence longer than the size's context, and a resume of another shape."""
    from ..models.gpt import SIZES

    size = SIZES[c.model]
    if resumed is None and c.seq_len is not None:
        check_seq_len(c.seq_len, size.seq_len, "bytes", f" for --model {c.model}")
    shape = size.with_seq_len(c.seq_len)
    c.seq_len = shape.seq_len
    model_config = asdict(shape)
    if resumed and resumed.model_config != model_config:
        raise UsageError(
            f"--resume {resume_arg}: the checkpoint's model shape "
            f"{resumed.model_config} differs from {c.model!r} here"
        )
    return model_config


def _check_numbers(c: TrainingFlags, world: int) -> None:
    for k in ("steps", "batch_size", "seq_len", "grad_accum", "hsdp", "eval_every", "eval_batches"):
        if getattr(c, k) < 1:
            raise UsageError(f"--{k.replace('_', '-')} must be at least 1, got {getattr(c, k)}")
    for k in ("warmup", "save_every"):
        if getattr(c, k) < 0:
            raise UsageError(f"--{k.replace('_', '-')} must be at least 0, got {getattr(c, k)}")
    # A negative clip reverses the gradients and nan or inf poison every
    # weight: each trains quietly into garbage, so refuse them here.
    if not (c.lr is not None and math.isfinite(c.lr) and c.lr > 0):
        raise UsageError(f"--lr must be a positive number, got {c.lr}")
    if not (math.isfinite(c.grad_clip) and c.grad_clip >= 0):
        raise UsageError(
            f"--grad-clip must be a number at least 0 (0: no clipping), got {c.grad_clip}"
        )
    if world % c.hsdp:
        raise UsageError(f"--hsdp {c.hsdp} does not divide the {world} processes")
    if c.batch_size % (world * c.grad_accum):
        raise UsageError(
            f"--batch-size {c.batch_size} is not divisible by {world} processes "
            f"x --grad-accum {c.grad_accum}"
        )


def _check_optimizer(c: TrainingFlags) -> None:
    if c.optimizer not in OPTIMIZERS:
        raise UsageError(f"--optimizer {c.optimizer!r}: use one of {', '.join(OPTIMIZERS)}")
    if c.optimizer == "muon" and c.hf:
        raise UsageError("--optimizer muon is for the built-in GPT; --hf runs do not take it yet")


def _check_comm_policy(c: TrainingFlags, world: int, local: int) -> None:
    """--comm-policy and --node-size, the node size filled in (this launch's processes)
    where a policy is set and none is given."""
    from .run_config import COMM_POLICIES

    if c.comm_policy not in COMM_POLICIES:
        raise UsageError(f"--comm-policy {c.comm_policy!r}: use one of {', '.join(COMM_POLICIES)}")
    if c.node_size is not None and c.node_size < 1:
        raise UsageError(f"--node-size must be at least 1, got {c.node_size}")
    if c.comm_policy == "none":
        return
    if c.hf:
        raise UsageError("--comm-policy is for the built-in GPT; --hf runs do not take it yet")
    shard = world // c.hsdp  # the processes each parameter is split over
    node = local if c.node_size is None else c.node_size
    if shard % node:
        flag = f"--node-size {node}" if c.node_size is not None else f"the {node} processes here"
        raise UsageError(
            f"--comm-policy {c.comm_policy}: {flag} does not divide the {shard} processes "
            "each parameter is sharded over; give --node-size"
        )
    c.node_size = node


def _nothing_left(resume_arg: str, at: int, steps: int, given: bool) -> str:
    """A resume with no step to take: where the run is, and what would train on."""
    where = f"past --steps {steps}" if given else f"past its --steps {steps}"
    if at == steps:
        where = f"its last (--steps {steps})"
    return (
        f"--resume {resume_arg}: the run is already at step {at}, {where}; "
        "pass a larger --steps to train further"
    )


def _differences(given: dict[str, Any], resumed: RunConfig, at: int) -> list[str]:
    """A note for each schedule flag given that differs from the resumed run's: allowed
    (a longer run, say), but the curve is no longer the uninterrupted run's."""
    notes = []
    for k in ("steps", "batch_size", "grad_accum", "lr", "warmup"):
        then = getattr(resumed, k)
        if k in given and then is not None and given[k] != then:
            notes.append(
                f"note: --{k.replace('_', '-')} {given[k]} differs from the resumed run's "
                f"{then}: from step {at} on the run follows {given[k]}"
                + (" (the learning-rate schedule too)" if k in ("steps", "warmup") else "")
            )
    return notes


def _memory_warning(config: RunConfig, local: int) -> str | None:
    shape = Shape.of(config.model_config, hf=config.hf is not None)
    if shape is None:
        return None
    return memory_warning(
        shape,
        config.micro_batch,
        config.seq_len,
        config.activation_checkpointing,
        bf16=config.mixed_precision == "bf16",
        memory=memory_per_process(config.device, local),
        device=config.device,
        local_processes=local,
        unit="tokens" if config.hf else "bytes",
    )


def _out_folder(args: argparse.Namespace, resumed_run: Path | None) -> Path:
    if args.out is None and resumed_run is not None:
        out = resumed_run.resolve()
        check_writable(out, f"--resume {args.resume}: the run folder {out}")
        return out
    if args.out is None:
        base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
        out, n = base, 1
        while out.exists():
            out, n = base.with_name(f"{base.name}-{n}"), n + 1
        check_writable(out.resolve(), f"the run folder {out} (the default; or give --out DIR)")
        return out.resolve()
    out = Path(args.out).resolve()
    check_writable(out, f"--out {args.out}")
    continuing = resumed_run is not None and out == resumed_run.resolve()
    if out.is_dir() and not holds_only_the_lock(out) and not continuing:
        raise UsageError(
            f"--out {args.out}: the folder already holds files; choose a new "
            "one (or --resume the run in it)"
        )
    return out


def for_restart(config: RunConfig, out: Path) -> tuple[RunConfig, Path | None]:
    """The config that continues ``config``'s run from the newest good checkpoint in ``out``,
    and that checkpoint; with none there yet, the run as it began, and ``None``."""
    try:
        ckpt, _ = find_checkpoint(str(out), "--resume")
    except UsageError:
        return config, None
    restart = replace(
        config,
        resume=str(ckpt.resolve()),
        resume_step=_step_of(ckpt),
        resumed_metrics=str(out / "metrics.jsonl"),
    )
    return restart, ckpt


def newest_saved(out: Path) -> Path | None:
    """The newest complete checkpoint in ``out``, for a message: not verified, which
    can take minutes for a large one (``--resume`` verifies it)."""
    complete = [c for c in (out / "checkpoints").glob("step_*") if is_checkpoint(c)]
    return max((c for c in complete if _STEP.fullmatch(c.name)), key=_step_of, default=None)


def is_new_run(config: RunConfig) -> bool:
    """Whether ``--out`` is a new folder, not the resumed run's own."""
    resumed = config.resumed_metrics
    return resumed is None or Path(resumed).parent != Path(config.out)


def _step_of(ckpt: Path) -> int:
    m = _STEP.fullmatch(ckpt.name)
    return int(m.group(1)) if m else 0
