"""What a plan is asked about: the sharding policy (the machine is hardware.py's)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .comm import CommPolicy

AC_MODES = ("none", "non-reentrant", "reentrant")
MP_MODES = ("none", "bf16")


@dataclass(frozen=True)
class Policy:
    """One way to run the step: what ``fully_shard`` and checkpointing are given."""

    mp: str = "none"  # "bf16": bf16 parameters in compute, fp32 gradient reduction
    ac: str = "none"  # activation checkpointing of every block
    reshard_after_forward: bool | int = True
    offload: bool = False  # CPUOffloadPolicy: shards, gradients, optimizer state on the host
    prefetch: int = 1  # modules gathered ahead
    comm: CommPolicy = CommPolicy()  # qwZ / hpZ / qgZ (comm.py); default: none

    def check(self) -> None:
        if self.mp not in MP_MODES:
            raise ValueError(f"mixed precision must be one of {MP_MODES}, got {self.mp!r}")
        if self.ac not in AC_MODES:
            raise ValueError(f"activation checkpointing must be one of {AC_MODES}, got {self.ac!r}")
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0, got {self.prefetch!r}")
        self.comm.check()

    def label(self) -> str:
        raf = self.reshard_after_forward
        parts = [f"mp={self.mp}", f"ac={self.ac}", f"raf={str(raf).lower()}"]
        parts += [f"prefetch={self.prefetch}"] + (["offload"] if self.offload else [])
        if self.comm.active:
            parts.append(f"comm={self.comm.name()}")
        return " ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "comm": self.comm.as_dict()}
