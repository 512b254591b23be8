"""``shardwise sample``: load a trained checkpoint and print a continuation of a prompt.

One process by default: the checkpoint's shards are stitched into a plain,
unsharded model. With ``--nproc N`` (or under ``torchrun``) every rank loads
its own shards into a sharded model and all ranks generate in lockstep; rank
0 prints. A run of ``shardwise train --hf`` samples its transformers model
through the model's own tokenizer.
"""

from __future__ import annotations

import argparse
import math
import warnings
from typing import Any

from . import checkpoint_command
from .checkpoint_command import say_source
from .common import UsageError
from .process_group import init_worker
from .run_config import RunConfig


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default="def ", help="text to continue (default: 'def ')")
    p.add_argument(
        "--tokens",
        type=int,
        default=200,
        help="bytes (tokens for a --hf run) to generate (default: 200)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="sampling temperature; 0 picks the likeliest byte (default: 0.8)",
    )
    p.add_argument(
        "--top-k", type=int, default=40, help="sample among the k likeliest (default: 40)"
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")


def build_parser() -> argparse.ArgumentParser:
    return checkpoint_command.parser(
        "shardwise sample",
        "Print a continuation of a prompt from a model trained by `shardwise train`.",
        _add_arguments,
    )


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.tokens < 0:
        raise UsageError(f"--tokens must be at least 0, got {args.tokens}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UsageError(f"--temperature must be a number at least 0, got {args.temperature}")
    if args.top_k < 1:
        raise UsageError(f"--top-k must be at least 1, got {args.top_k}")
    keep = ("ckpt", "prompt", "tokens", "temperature", "top_k", "seed")
    return checkpoint_command.run(
        "sample", args, keep, lambda ckpt, config, dist: _sample(args, ckpt, config, dist)
    )


def _sample(args: argparse.Namespace, ckpt: Any, config: RunConfig, distributed: bool) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from shardwise import checkpoint

    from ..models.gpt import GPT, GPTConfig, shard_model

    if distributed:
        w = init_worker()
        device, is_main = w.device, w.is_main
    else:
        device, is_main = torch.device("cuda" if torch.cuda.is_available() else "cpu"), True
    if config.hf:
        _sample_hf(args, ckpt, config, device, is_main, distributed)
        if distributed:
            dist.destroy_process_group()
        return 0
    cfg = GPTConfig(**config.model_config)
    with torch.device(device):
        model = GPT(cfg)
    if distributed:
        shard_model(model, mesh=init_device_mesh(device.type, (w.world,)))
    with warnings.catch_warnings():
        # DCP warns that it loads "in a single process" when that is what we asked for.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        extra = checkpoint.load(ckpt, model) or {}
    model.eval()

    prompt = args.prompt.encode() or b"\n"
    idx = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    out = _generate(model, idx, cfg.seq_len, args)
    if is_main:
        _print(bytes(out[0].tolist()).decode("utf-8", errors="replace"), config, extra, ckpt)
    if distributed:
        dist.destroy_process_group()
    return 0


def _sample_hf(
    args: argparse.Namespace,
    ckpt: Any,
    config: RunConfig,
    device: Any,
    is_main: bool,
    distributed: bool,
) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from ..models.hf import context_length, logits
    from .finetune import load_run

    mesh = (
        init_device_mesh(device.type, (torch.distributed.get_world_size(),))
        if distributed
        else None
    )
    hf, tokenizer, extra = load_run(config, ckpt, device, mesh)
    # As training saw text: no BOS added; an empty prompt starts a new document.
    prompt = tokenizer(args.prompt, add_special_tokens=False)["input_ids"]
    if not prompt:
        start = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        prompt = [start]
    idx = torch.tensor([prompt], dtype=torch.long, device=device)
    seq_len = context_length(config.model_config) or config.seq_len
    out = _generate(lambda ids: logits(hf.model, ids), idx, seq_len, args)
    if is_main:
        text = tokenizer.decode(out[0, len(prompt) :].tolist(), skip_special_tokens=True)
        _print(args.prompt + text, config, extra, ckpt)


def _generate(forward: Any, idx: Any, seq_len: int, args: argparse.Namespace) -> Any:
    """``args.tokens`` more tokens after ``idx``. The same seed on every rank: every
    rank samples the same tokens, so sharded forwards stay in lockstep without
    sending tokens around."""
    import torch

    from ..models.gpt import generate

    gen = torch.Generator().manual_seed(args.seed)
    return generate(
        forward,
        idx,
        args.tokens,
        seq_len=seq_len,
        temperature=args.temperature,
        top_k=args.top_k,
        generator=gen,
    )


def _print(text: str, config: RunConfig, extra: dict[str, Any], ckpt: Any) -> None:
    say_source(config, extra, ckpt)
    print(text, flush=True)
