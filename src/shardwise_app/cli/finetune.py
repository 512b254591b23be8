"""``shardwise train --hf PATH``: the flags, their checks and the model of a fine-tuning run.

``train.py`` runs the loop for both kinds of run; what differs for a
transformers model from disk lives here: the flags (``--hf``, ``--lora``,
``--lora-alpha``, ``--lora-targets``, ``--adapter-only``), checking them in
the launcher without importing transformers (a missing folder, weights or
extra is one line, exit 2), building the sharded model in a worker (the
built-in GPT's too, by ``models/gpt.py``, so the loop sees one kind of model),
and the export at the end of the run. The model side is ``models/hf.py``.
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path
from typing import Any

from .common import UsageError
from .fits import check_seq_len
from .run_config import RunConfig, TrainingFlags

EXPORT = "export"  # the run folder's subfolder the finished run exports to
DEFAULT_SEQ_LEN = 1024  # capped at the model's own context length
PEAK_LR = {"full": 2e-5, "lora": 2e-4}


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "fine-tuning a transformers model from disk (needs: pip install 'shardwise[hf]')"
    )
    g.add_argument(
        "--hf",
        metavar="PATH",
        help="fine-tune the causal LM in PATH, a folder written by save_pretrained "
        "(config.json, safetensors weights, tokenizer), instead of the built-in GPT",
    )
    g.add_argument(
        "--lora",
        type=int,
        metavar="R",
        help="train LoRA adapters of rank R on the frozen model (needs --hf)",
    )
    g.add_argument("--lora-alpha", type=float, metavar="A", help="LoRA alpha (default: 2 x R)")
    g.add_argument(
        "--lora-targets",
        metavar="LIST",
        help="comma-separated names of the modules LoRA adapts, e.g. q_proj,v_proj "
        "(default: all-linear, every linear layer but the output head)",
    )
    g.add_argument(
        "--adapter-only",
        action="store_true",
        default=None,
        help="with --lora, export the adapter alone (PEFT format) instead of the merged model",
    )


def resolve(
    c: TrainingFlags, given: dict[str, Any], resumed: RunConfig | None, resume_arg: str | None
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Check and complete the fine-tuning settings of ``c`` (in place): the model's
    config.json and its weights' fingerprint, or None for a run of the built-in GPT.

    Raises ``UsageError``.
    """
    from ..models.hf import (
        HFError,
        check_folder,
        context_length,
        require_extra,
        weights_fingerprint,
    )

    lora_flags = [k for k in ("lora", "lora_alpha", "lora_targets", "adapter_only") if k in given]
    if c.hf is None:
        if lora_flags:
            raise UsageError(
                f"--{lora_flags[0].replace('_', '-')} needs --hf PATH: LoRA fine-tunes a "
                "transformers model, not the built-in GPT"
            )
        return None
    if "model" in given and not resumed:
        raise UsageError("--model picks a built-in GPT and --hf a model folder: give only one")
    try:
        require_extra()
        config = check_folder(c.hf)
    except HFError as e:
        raise UsageError(str(e)) from None
    path = str(Path(c.hf).resolve())
    if resumed:
        if resumed.hf != path:
            raise UsageError(
                f"--resume {resume_arg}: the checkpoint is of model {resumed.model!r}"
                f"{' from ' + resumed.hf if resumed.hf else ''}, not of --hf {c.hf}"
            )
        if "lora_targets" in given and given["lora_targets"]:
            given = {**given, "lora_targets": _targets(given["lora_targets"])}
        for k in lora_flags:
            if given[k] != getattr(resumed, k) and k != "adapter_only":
                flag = f"--{k.replace('_', '-')}"
                raise UsageError(
                    f"--resume {resume_arg}: the checkpoint was trained with {flag} "
                    f"{getattr(resumed, k)}; {flag} {given[k]} does not match it"
                )
        if resumed.model_config != config:
            raise UsageError(
                f"--resume {resume_arg}: {path}/config.json changed since the run started; "
                "the checkpoint is of the model it described then"
            )
    # Recorded at the start, compared on resume: a fine-tune continued on other
    # base weights trains on quietly into nonsense. (Runs from before it: unchecked.)
    weights = weights_fingerprint(path)
    then = resumed.hf_weights if resumed else None
    if then is not None and then != weights:
        changed = sorted(set(then) ^ set(weights)) or sorted(
            f for f in then if then[f] != weights[f]
        )
        raise UsageError(
            f"--resume {resume_arg}: the base weights in {path} changed since the run started "
            f"({changed[0]} differs); the checkpoint fine-tunes the weights that were there then"
        )
    c.hf = path
    if c.lora is None:
        extra = [k for k in lora_flags if k != "lora"]
        if extra:
            raise UsageError(f"--{extra[0].replace('_', '-')} needs --lora R")
    else:
        if c.lora < 1:
            raise UsageError(f"--lora must be at least 1, got {c.lora}")
        if c.lora_alpha is None:
            c.lora_alpha = 2.0 * c.lora
        if not c.lora_alpha > 0:
            raise UsageError(f"--lora-alpha must be positive, got {c.lora_alpha}")
        targets = c.lora_targets or "all-linear"
        if not _targets(targets):
            raise UsageError(f"--lora-targets {targets!r} names no module")
        c.lora_targets = _targets(targets)
        tied = {"lm_head", "embed_tokens"} & set(c.lora_targets.split(","))
        if tied and config.get("tie_word_embeddings", False):
            # The merged export could not hold an adapted head and an unadapted
            # embedding (or the reverse) that share one weight.
            raise UsageError(
                f"--lora-targets {sorted(tied)[0]}: this model ties its output head to its "
                "input embedding, so an adapter there cannot be merged into both; adapt "
                "other modules"
            )
    c.adapter_only = bool(c.adapter_only)
    c.model = str(config["model_type"])
    context = context_length(config)
    if c.seq_len is None:
        c.seq_len = min(DEFAULT_SEQ_LEN, context or DEFAULT_SEQ_LEN)
    else:
        check_seq_len(c.seq_len, context, "tokens")
    if c.lr is None:
        c.lr = PEAK_LR["lora" if c.lora else "full"]
    return config, weights


def lora_spec(cfg: RunConfig) -> Any:
    from ..models.hf import LoraSpec

    if not cfg.lora:
        return None
    targets = cfg.lora_targets or "all-linear"
    alpha = 2.0 * cfg.lora if cfg.lora_alpha is None else cfg.lora_alpha
    return LoraSpec(
        cfg.lora, alpha, "all-linear" if targets == "all-linear" else targets.split(",")
    )


def build_model(cfg: RunConfig, device: Any, world: int) -> tuple[Any, Any, Any, Any]:
    """Any run's sharded model: (model, its token ids -> logits, the HFModel, the tokenizer).

    The last two are None for the built-in GPT. Call on every rank.
    """
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from shardwise import CommPolicy, MixedPrecisionPolicy

    from ..models.gpt import build_sharded
    from ..models.hf import logits
    from .run_config import COMM_POLICIES

    if cfg.hsdp > 1:
        mesh = init_device_mesh(
            device.type, (cfg.hsdp, world // cfg.hsdp), mesh_dim_names=("replicate", "shard")
        )
    else:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if cfg.mixed_precision == "bf16"
        else None
    )
    if cfg.hf:
        # Built on meta, sharded, then each rank reads only its rows from disk.
        hf, tokenizer = build(cfg, device, mesh, mp)
        return hf.model, partial(logits, hf.model), hf, tokenizer
    model = build_sharded(
        cfg.model_config,
        device,
        mesh=mesh,
        mp_policy=mp,
        activation_checkpointing=cfg.activation_checkpointing,
        compile=cfg.compile,
        comm_policy=(
            None
            if cfg.comm_policy == "none"
            else CommPolicy(node_size=cfg.node_size, **COMM_POLICIES[cfg.comm_policy])
        ),
    )
    return model, model, None, None


def build(cfg: RunConfig, device: Any, mesh: Any, mp_policy: Any) -> tuple[Any, Any]:
    """The sharded model of a fine-tuning run, loaded shard by shard, and its tokenizer."""
    from ..models import hf
    from ..models.gpt import compile_blocks
    from .failures import RunFailure, first_line, passes_through, peer_lost

    try:
        hf.quiet_transformers()
        tokenizer = hf.load_tokenizer(_folder(cfg))
        model = hf.build_meta(
            _folder(cfg), lora=lora_spec(cfg), checkpointing=cfg.activation_checkpointing
        )
        hf.shard(model, mesh=mesh, mp_policy=mp_policy)
        hf.materialize(model, device, seed=cfg.seed)
    except BaseException as e:
        if passes_through(e) or peer_lost(e):
            raise
        # The same folder fails alike on every rank (an architecture transformers
        # does not know, weights saved under other names): rank 0 says it once.
        message = str(e) if isinstance(e, hf.HFError) else f"--hf {cfg.hf}: {first_line(e)}"
        raise RunFailure(message) from e
    if cfg.compile:
        compile_blocks(model.layers, device.type)
    model.model.train()
    return model, tokenizer


def load_run(
    cfg: RunConfig, ckpt: Path, device: Any, mesh: Any = None
) -> tuple[Any, Any, dict[str, Any]]:
    """A fine-tuning run's model at checkpoint ``ckpt``: sharded on ``mesh``, or plain without.

    The frozen base comes from the run's ``--hf`` folder, the trained weights
    from the checkpoint. Returns the model, its tokenizer and the checkpoint's extra.
    """
    import warnings

    from shardwise import checkpoint

    from ..models import hf

    try:
        hf.require_extra("this run")
        hf.check_folder(_folder(cfg), flag="the run's --hf")
    except hf.HFError as e:
        raise UsageError(str(e)) from None
    hf.quiet_transformers()
    tokenizer = hf.load_tokenizer(_folder(cfg))
    model = hf.build_meta(_folder(cfg), lora=lora_spec(cfg))
    if mesh is not None:
        hf.shard(model, mesh=mesh)
    hf.materialize(model, device, seed=cfg.seed)
    with warnings.catch_warnings():
        # DCP warns that it loads "in a single process" when that is what we asked for.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        extra = checkpoint.load(ckpt, model.model, trainable_only=bool(cfg.lora), restore_rng=False)
    model.model.eval()
    return model, tokenizer, extra or {}


def export_at_end(hf: Any, out: Path, cfg: RunConfig, ckpt: Path) -> Path:
    """Export a finished run into ``out/export`` (every rank); a failure keeps the checkpoint."""
    from ..models.hf_export import export
    from .failures import RunFailure, first_line, passes_through, peer_lost

    exported = out / EXPORT
    try:
        export(hf, exported, adapter_only=bool(cfg.adapter_only))
    except BaseException as e:
        if passes_through(e) or peer_lost(e):
            raise
        raise RunFailure(
            f"exporting {exported} failed: {first_line(e)}; the checkpoint "
            f"{ckpt.relative_to(out)} is kept (export it with: shardwise export "
            f"--ckpt {out} --out DIR)"
        ) from e
    return exported


def _folder(cfg: RunConfig) -> str:
    """The ``--hf`` folder of a fine-tuning run (its callers are only ever given one)."""
    if cfg.hf is None:
        raise ValueError("not a run of shardwise train --hf")
    return cfg.hf


def _targets(text: str) -> str:
    """``--lora-targets`` normalised: comma-separated names without spaces."""
    return ",".join(t.strip() for t in text.split(",") if t.strip())
