"""Whether a training run can work here, said before it starts.

Two things a flag can ask that no step will ever finish: a sequence longer
than the model's positions (refused, with the limit), and one step's
activations beyond the memory a process has here (warned, with the
figures: the estimate is rough, so it does not refuse). Both are told in
one line before the run folder exists, where otherwise the run would look
like a hang, or be killed by the kernel minutes later.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .common import UsageError

GIB = 2**30


def check_seq_len(seq_len: int, context: int | None, unit: str, which: str = "") -> None:
    """Refuse a ``--seq-len`` beyond the model's context (its positions); ``which``
    names the model where the flags chose it."""
    if context is not None and seq_len > context:
        raise UsageError(
            f"--seq-len {seq_len} is longer than the model's context ({context} {unit}{which})"
        )


@dataclass(frozen=True)
class Shape:
    """What one step's activations depend on: a decoder's width, depth and vocabulary."""

    d_model: int
    n_layer: int
    ffn: int  # the MLP's hidden width
    vocab: int
    gated: bool  # a gated MLP (Llama's SwiGLU) keeps two more of its tensors for backward

    @classmethod
    def of(cls, model_config: dict[str, Any], hf: bool) -> Shape | None:
        """The shape of a built-in GPT's config, or of a transformers config.json (None
        when it does not say its sizes in the usual names)."""
        c = model_config.get("text_config", model_config) if hf else model_config
        if not hf:
            d = int(c["d_model"])
            return cls(d, int(c["n_layer"]), 4 * d, int(c["vocab_size"]), gated=False)
        sizes = [c.get(k) for k in ("hidden_size", "num_hidden_layers", "vocab_size")]
        d, layers, vocab = (v if isinstance(v, int) else 0 for v in sizes)
        if not (d and layers and vocab):
            return None
        ffn = c.get("intermediate_size") or 4 * d
        return cls(d, layers, int(ffn), vocab, gated=True)


def activation_bytes(shape: Shape, tokens: int, checkpointing: str, bf16: bool) -> int:
    """About what one forward keeps for backward, at its peak, for ``tokens`` tokens.

    Per token and block: the inputs of the norms and linears, the query,
    key and value, attention's output (SDPA's fused kernels: linear in the
    sequence, no scores kept) and the MLP's hidden tensors, about
    ``9 d + 2 ffn`` values (``4 ffn`` gated). A checkpointed block keeps only
    its input, plus one block's whole set while it is recomputed. The loss
    adds the logits and their log-softmax in fp32.
    """
    width = 2 if bf16 else 4
    block = 9 * shape.d_model + (4 if shape.gated else 2) * shape.ffn
    n = shape.n_layer
    kept = {"none": 0, "selective": (n + 1) // 2}.get(checkpointing, n)
    per_token = (n - kept) * block + kept * shape.d_model + (block if kept else 0)
    logits = shape.vocab * (8 if not bf16 else 10)
    return tokens * (per_token * width + logits)


def memory_per_process(device: str, local_processes: int) -> int | None:
    """A GPU's memory, or this machine's (its cgroup's limit if lower) shared by the
    processes of this node; None where it cannot be told."""
    if device == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(0).total_memory)
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None
    try:  # cgroup v2: a container's limit, "max" when none
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total // max(1, local_processes)


def memory_warning(
    shape: Shape,
    micro_batch: int,
    seq_len: int,
    checkpointing: str,
    bf16: bool,
    memory: int | None,
    device: str,
    local_processes: int,
    unit: str,
) -> str | None:
    """The warning line when one step's activations exceed a process's memory, else None."""
    need = activation_bytes(shape, micro_batch * seq_len, checkpointing, bf16)
    if memory is None or need <= memory:
        return None
    if device == "cuda":
        each = "a GPU"
    else:
        each = f"each of the {local_processes} processes" if local_processes > 1 else "a process"
    ways = ["lower --batch-size or --seq-len", "raise --grad-accum"]
    if checkpointing not in ("non-reentrant", "reentrant"):
        ways.append("use --activation-checkpointing non-reentrant")
    return (
        f"warning: one step's activations need about {_size(need)} per process "
        f"({micro_batch} sequences of {seq_len} {unit} through {shape.n_layer} blocks), more "
        f"than the {_size(memory)} {each} has here: expect it to run out of memory "
        f"or crawl; {', '.join(ways[:-1])} or {ways[-1]}"
    )


def _size(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2**20:.0f} MiB"
