"""The benchmarked model, built the same way in every configuration.

Why one builder for the bare model, FSDP2 and shardwise: any difference in
construction (seed, dtype, checkpointing, what is compiled, the order of
sharding) would be measured as a difference between the libraries. The
parent process resolves each ``--model`` entry into a ``ModelSpec`` before
anything runs, so a bad size or a missing ``hf:`` folder is one error line,
not a traceback in a worker.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

HF_PREFIX = "hf:"


def bench_sizes() -> dict[str, Any]:
    """The built-in GPT sizes, and one the benchmark alone runs: ``deep``, 48 blocks of
    width 1024 (0.6B parameters), whose kernels at a batch of 1 x 512 tokens are short
    enough that the host bounds the step (``--model deep --batch-size 1 --seq-len 512``):
    where a runtime's own host time shows on a GPU."""
    from ..models.gpt import SIZES, GPTConfig

    return {**SIZES, "deep": GPTConfig(seq_len=512, n_layer=48, n_head=16, d_model=1024)}


HF_AC = ("none", "reentrant", "non-reentrant")  # what the model's own checkpointing offers


class BenchUsageError(Exception):
    """Bad input: one line on stderr, exit code 2, before anything runs or is written."""


@dataclass(frozen=True)
class ModelSpec:
    name: str  # as given on the command line: "medium" or "hf:PATH"
    seq_len: int
    vocab_size: int
    n_layer: int
    d_model: int
    model_type: str  # "gpt", or the transformers config's model_type

    @property
    def hf_path(self) -> str | None:
        return self.name[len(HF_PREFIX) :] if self.name.startswith(HF_PREFIX) else None


def resolve(name: str, seq_len: int | None, cuda: bool) -> ModelSpec:
    """A ``--model`` entry checked and described, without building anything big."""
    if name.startswith(HF_PREFIX):
        cfg = hf_config(name[len(HF_PREFIX) :])
        longest = getattr(cfg, "max_position_embeddings", None) or 2048
        if seq_len is not None and seq_len > longest:
            raise BenchUsageError(
                f"--seq-len {seq_len} is more than {name}'s max_position_embeddings {longest}"
            )
        return ModelSpec(
            name,
            seq_len or min(longest, 2048 if cuda else 128),
            cfg.vocab_size,
            cfg.num_hidden_layers,
            cfg.hidden_size,
            cfg.model_type,
        )
    sizes = bench_sizes()
    if name not in sizes:
        raise BenchUsageError(f"unknown --model {name!r}; choose from {sorted(sizes)} or hf:PATH")
    g = sizes[name]
    return ModelSpec(name, seq_len or g.seq_len, g.vocab_size, g.n_layer, g.d_model, "gpt")


def hf_config(path: str) -> Any:
    """The transformers config in ``path``, checked to build a causal LM with decoder layers."""
    flag = f"--model {HF_PREFIX}{path}"
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise BenchUsageError(f"{flag}: no such folder")
    if not (folder / "config.json").is_file():
        raise BenchUsageError(f"{flag}: no config.json in that folder")
    try:
        json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise BenchUsageError(f"{flag}: config.json cannot be read ({e})") from None
    try:
        import transformers
    except ImportError:
        raise BenchUsageError(
            f"{flag}: needs the transformers package (pip install transformers)"
        ) from None
    try:
        cfg = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
        with torch.device("meta"):  # no memory: only to see the module tree
            model = transformers.AutoModelForCausalLM.from_config(cfg)
    except (ValueError, KeyError, OSError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise BenchUsageError(
            f"{flag}: not a causal LM config transformers can build ({first})"
        ) from None
    if not isinstance(_decoder_layers(model), torch.nn.ModuleList):
        raise BenchUsageError(
            f"{flag}: {type(model).__name__} has no decoder layers at model.model.layers"
        )
    return cfg


def short_name(name: str) -> str:
    """``hf:/long/path/llama-1b`` as ``hf:llama-1b``, for tables."""
    if name.startswith(HF_PREFIX):
        return HF_PREFIX + (Path(name[len(HF_PREFIX) :]).name or name[len(HF_PREFIX) :])
    return name


def _decoder_layers(model: Any) -> Any:
    return getattr(getattr(model, "model", None), "layers", None)


def build(
    spec: ModelSpec, device: torch.device, ac: str
) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    """The model on ``device`` from seed 0, checkpointing set, and its blocks (shard units)."""
    torch.manual_seed(0)
    if spec.hf_path is None:
        from ..models.gpt import GPT, set_activation_checkpointing

        with device:
            model = GPT(bench_sizes()[spec.name].with_seq_len(spec.seq_len))
        set_activation_checkpointing(model, ac)
        return model, list(model.blocks)
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(spec.hf_path, local_files_only=True)
    cfg.use_cache = False  # training: no KV cache (and checkpointing refuses one)
    # fp32 weights like the GPT (the optimizer's master copy; bf16 is the
    # policy's business), whatever dtype the config was saved with.
    kw: dict[str, Any] = {"attn_implementation": "sdpa"}
    with device:
        try:
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, **kw)
        except TypeError:  # transformers before 4.56 calls it torch_dtype
            model = transformers.AutoModelForCausalLM.from_config(
                cfg, torch_dtype=torch.float32, **kw
            )
    if any(p.dtype != torch.float32 for p in model.parameters()):
        model.float()
    model.to(device)  # a no-op where the device context was honoured
    model.train()
    if ac != "none":
        kwargs = {"use_reentrant": ac == "reentrant"}
        if hasattr(model, "activation_checkpointing_enable"):  # the name from transformers 5 on
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model, list(_decoder_layers(model))


def logits(model: torch.nn.Module, spec: ModelSpec, idx: torch.Tensor) -> torch.Tensor:
    if spec.hf_path is None:
        return model(idx)
    return model(input_ids=idx).logits


def flops_per_token(n_params: int, spec: ModelSpec) -> float:
    """6N for the matmuls plus causal attention (PaLM appendix B style); no recompute."""
    return 6 * n_params + 6 * spec.n_layer * spec.d_model * spec.seq_len
