"""Models that ship with shardwise: what ``shardwise train`` and ``shardwise bench`` run."""

from .gpt import (
    GPT,
    SIZES,
    GPTConfig,
    compile_blocks,
    generate,
    num_params,
    set_activation_checkpointing,
    shard_model,
)

__all__ = [
    "GPT",
    "SIZES",
    "GPTConfig",
    "compile_blocks",
    "generate",
    "num_params",
    "set_activation_checkpointing",
    "shard_model",
]
