"""``shardwise export``: a fine-tuned run (``shardwise train --hf``) as a folder transformers loads.

``--out DIR`` gets the merged model (LoRA folded into the weights) with the
source folder's config and tokenizer files, which
``AutoModelForCausalLM.from_pretrained(DIR)`` loads; with ``--adapter-only``,
the LoRA adapter alone, which ``PeftModel.from_pretrained(base, DIR)`` loads.

One process by default: the checkpoint's shards are stitched into a plain
model (the frozen base read from the run's ``--hf`` folder). With ``--nproc
N`` every rank loads only its shards and the export gathers one parameter at
a time, as at the end of a run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from . import checkpoint_command
from .checkpoint_command import say_source
from .common import UsageError, check_writable, in_worker
from .process_group import init_worker
from .run_config import RunConfig


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, metavar="DIR", help="the folder to write; new or empty")
    p.add_argument(
        "--adapter-only",
        action="store_true",
        help="write the LoRA adapter alone (PEFT format) instead of the merged model",
    )


def build_parser() -> argparse.ArgumentParser:
    return checkpoint_command.parser(
        "shardwise export",
        "Write a run of `shardwise train --hf` as a folder that "
        "AutoModelForCausalLM.from_pretrained (or, for an adapter, PeftModel) loads.",
        _add_arguments,
        ckpt_metavar="RUN",
    )


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if not in_worker():  # before the checkpoint is verified: minutes for a large one
        _check_out(Path(args.out), args.out)

    def check(ckpt: Path, config: RunConfig) -> None:
        if not config.hf:
            raise UsageError(
                f"--ckpt {args.ckpt}: a run of the built-in GPT; export writes runs of "
                "`shardwise train --hf` (its checkpoints load with shardwise.checkpoint)"
            )
        if args.adapter_only and not config.lora:
            raise UsageError(
                f"--adapter-only: the run at {args.ckpt} trained every weight, not LoRA adapters"
            )

    return checkpoint_command.run(
        "export",
        args,
        ("ckpt", "out", "adapter_only"),
        lambda ckpt, config, dist: _export(args, ckpt, config, dist),
        check,
    )


def _check_out(out: Path, given: str) -> None:
    """A new or empty folder, whose parent can be written in: the export is written beside
    it (``<out>.partial``) and renamed into place; missing folders above are made."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {given}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        raise UsageError(f"--out {given}: the folder already holds files; choose a new one")
    check_writable(out.resolve().parent, f"--out {given}")


def _export(args: argparse.Namespace, ckpt: Path, config: RunConfig, distributed: bool) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ..models.hf_export import export
    from .finetune import load_run

    if distributed:
        w = init_worker()
        device, is_main = w.device, w.is_main
        mesh = init_device_mesh(device.type, (w.world,))
    else:  # host memory holds the whole model anyway: no GPU needed
        device, is_main, mesh = torch.device("cpu"), True, None
    hf, _, extra = load_run(config, ckpt, device, mesh)
    out = Path(args.out)
    export(hf, out, adapter_only=args.adapter_only)
    if is_main:
        what = "PeftModel" if args.adapter_only else "AutoModelForCausalLM"
        say_source(config, extra, ckpt)
        print(f"export: {out} (loads with {what}.from_pretrained)", flush=True)
    if distributed:
        dist.destroy_process_group()
    return 0
