"""The models the shardwise command ships: what ``shardwise train`` and ``bench`` run."""

from .gpt import (
    GPT,
    SIZES,
    GPTConfig,
    build_sharded,
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
    "build_sharded",
    "compile_blocks",
    "generate",
    "num_params",
    "set_activation_checkpointing",
    "shard_model",
]
