"""The settings of one ``shardwise train`` run: ``RunConfig``, what ``config.json`` holds.

Resolved once, before anything is written (``train_config.resolve``, by our
launcher or by rank 0 under ``torchrun``), handed to the workers, written
to the run folder by rank 0 once the resume has loaded
(``run_folder.commit``), and read back by a later ``--resume``, ``sample``
and ``export``. The JSON is the fields in their order, so that a run folder
written before this class existed reads as it is, and one written now reads
as it did then.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

# How our launcher hands the resolved config to its workers (train.py's main).
CONFIG_ENV = "SHARDWISE_RUN_CONFIG"

# --comm-policy NAME: the shardwise.CommPolicy keywords it stands for (ZeRO++'s qwZ, hpZ,
# qgZ; zeropp: all three), the names of ``shardwise plan --comm-policy`` where they meet.
COMM_POLICIES: dict[str, dict[str, Any]] = {
    "none": {},
    "qwz": {"quantize_gather": "forward"},
    "qwz-always": {"quantize_gather": "always"},
    "hpz": {"node_local_backward": True},
    "qgz": {"quantize_reduce": True},
    "zeropp": {"quantize_gather": "forward", "node_local_backward": True, "quantize_reduce": True},
}


@dataclass(kw_only=True)
class TrainingFlags:
    """The flags that describe the training itself, with their defaults.

    With ``--resume``, each one not given on the command line is the resumed
    run's, so that a bare ``shardwise train --resume DIR`` continues exactly
    where the run stopped. ``None`` where the default depends on the model or
    on other flags: ``train_config.resolve`` works it out.
    """

    model: str = "tiny"  # a built-in GPT size; for an --hf run, its model_type
    steps: int = 200
    batch_size: int = 16  # sequences per optimizer step, over all ranks and microbatches
    seq_len: int | None = None  # the model's own context
    lr: float | None = None  # the model size's peak (train_config.PEAK_LR, finetune.PEAK_LR)
    warmup: int | None = None  # steps // 10, at most 100
    grad_clip: float = 1.0  # 0: no clipping
    grad_accum: int = 1
    hsdp: int = 1
    activation_checkpointing: str = "none"
    mixed_precision: str = "none"
    data: str | None = None  # the Python standard library's sources
    seed: int = 1337
    eval_every: int = 20
    eval_batches: int = 4
    save_every: int = 0  # 0: only at the end or when stopped
    compile: bool = False
    # Fine-tuning a transformers model from disk (finetune.py).
    hf: str | None = None
    lora: int | None = None
    lora_alpha: float | None = None  # 2 x the rank
    lora_targets: str | None = None  # "all-linear": every linear layer but the output head
    adapter_only: bool | None = None  # a bool in an --hf run
    # How the collectives treat the node boundary (COMM_POLICIES; docs/communication.md).
    # Written to config.json only when set, so that older runs' files read as they were.
    comm_policy: str = "none"
    node_size: int | None = None  # processes per node: this launch's --nproc
    # "muon": shardwise.optim.Muon for the blocks' matrices, AdamW for the rest
    # (docs/optimizers.md). Written to config.json only when not AdamW, as comm_policy.
    optimizer: str = "adamw"

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(TrainingFlags)]

    def flags(self) -> TrainingFlags:
        """Only the flags (of a resumed run's config, say)."""
        return TrainingFlags(**{name: getattr(self, name) for name in self.names()})


@dataclass(kw_only=True)
class RunConfig(TrainingFlags):
    """Every setting of one run: its training flags resolved, and what the run is."""

    seq_len: int
    lr: float
    warmup: int
    # An --hf run's base weights, fingerprinted at its start and compared on
    # resume (finetune.resolve). Runs of the built-in GPT have none, and
    # their config.json no such key.
    hf_weights: dict[str, Any] | None = None
    model_config: dict[str, Any]  # the GPT's shape (GPTConfig), or the --hf model's config.json
    world_size: int
    device: str  # "cuda" or "cpu"
    out: str  # the run folder, absolute
    resume: str | None = None  # the checkpoint this launch starts from
    resume_step: int = 0
    resumed_metrics: str | None = None  # the resumed run's metrics.jsonl
    corpus: dict[str, Any] | None = None  # corpus.prepare fills it in, under the run's lock
    torch_version: str = ""
    shardwise_version: str = ""
    launch_id: str | None = None  # the launch that wrote config.json (run_folder.commit)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        if d["hf_weights"] is None:
            del d["hf_weights"]
        if d["comm_policy"] == "none" and d["node_size"] is None:
            del d["comm_policy"], d["node_size"]
        if d["optimizer"] == "adamw":
            del d["optimizer"]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RunConfig:
        """A config as ``to_json`` wrote it; keys it does not know (of another version) are
        left out. Raises ``TypeError`` or ``ValueError`` for one that is not a run's."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def read(cls, path: Path) -> RunConfig:
        """A run folder's ``config.json``. Raises ``OSError``, ``ValueError`` or ``TypeError``."""
        d = json.loads(path.read_text())
        if not isinstance(d, dict):
            raise ValueError(f"{path} does not hold a run's settings")
        return cls.from_json(d)

    @property
    def micro_batch(self) -> int:
        """Sequences in one forward and backward of one rank."""
        return self.batch_size // (self.world_size * self.grad_accum)

    def lr_at(self, step: int) -> float:
        """Linear warmup, then cosine decay to a tenth of the peak at the last step."""
        if step <= self.warmup:
            return self.lr * step / max(1, self.warmup)
        frac = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
