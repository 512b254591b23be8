"""Models the planner's tests name as ``--model plan_models:NAME`` (this folder on the
ranks' path): shapes the built-in sizes do not have."""

from __future__ import annotations

import torch.nn as nn

from shardwise_app.models.gpt import GPT, GPTConfig


def deep_narrow() -> nn.Module:
    """12 narrow blocks at a short context: the parameters and their optimizer state, not
    the activations, decide where a step peaks."""
    return GPT(GPTConfig(seq_len=16, n_layer=12, n_head=4, d_model=256))


def comm_bound() -> nn.Module:
    """Two wide blocks at a tiny batch: at 16 ranks on a GPU's rates the step is mostly
    communication across nodes, which a communication policy cuts."""
    return GPT(GPTConfig(seq_len=16, n_layer=2, n_head=4, d_model=512))
