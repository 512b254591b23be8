"""The plan models ``--optimizer muon`` (shardwise.optim.Muon on the blocks' matrices,
AdamW on the rest) against ``muon-torch`` (torch.optim.Muon there): one momentum buffer
a matrix, and each matrix's Newton-Schulz run once across the shard group instead of on
every rank. The simulated step runs the real optimizers, so their matmuls are counted."""

from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pytest
import torch.nn as nn

pytestmark = pytest.mark.timeout(300)
W = 4


def small() -> nn.Module:
    from shardwise_app.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(seq_len=16, n_layer=3, n_head=4, d_model=96))


def _plans() -> dict[str, Any]:
    from shardwise.optim.muon import newton_schulz_flops
    from shardwise_plan import H200, plan

    out: dict[str, Any] = {}
    for opt in ("adamw", "muon", "muon-torch"):
        p = plan(small, W, batch_size=1, seq_len=16, hardware=H200, optimizer=opt)
        step = [e for e in p.events if e.kind == "op" and e.phase == "optimizer"]
        out[opt] = {
            "state": p.peak_by_kind["optimizer_state"],
            "params": p.peak_by_kind["sharded_params"],
            "step_s": p.time.step_s,
            "optimizer_s": p.time.by_phase.get("optimizer", 0.0),
            "matmul_flops": sum(e.flops for e in step if e.matmul),
            "alltoall": sum(1 for e in p.events if e.kind == "issue" and e.coll == "all_to_all"),
            "optimizer": p.optimizer,
        }
    model = small()
    blocks = [p for b in model.blocks for p in b.parameters() if p.ndim == 2]  # type: ignore[union-attr]
    out["ns_flops"] = sum(newton_schulz_flops(p.shape) for p in blocks)
    out["block_matrix_numel"] = sum(p.numel() for p in blocks)
    return out


def test_muon_plan_holds_one_buffer_and_orthogonalizes_each_matrix_once() -> None:
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        out = pool.submit(_plans).result(timeout=280)
    muon, torch_muon, adamw = out["muon"], out["muon-torch"], out["adamw"]
    assert (muon["optimizer"], torch_muon["optimizer"]) == ("muon", "muon-torch")
    # State: one fp32 buffer for each matrix's shard where AdamW holds two moments (the
    # rest keeps AdamW's): one fp32 shard of the matrices less than AdamW's.
    saved = adamw["state"] - muon["state"]
    assert saved == pytest.approx(4 * out["block_matrix_numel"] / W, rel=0.05), (muon, adamw)
    assert torch_muon["state"] == muon["state"]
    # torch's Muon: every rank runs every matrix's Newton-Schulz (5 iterations) ...
    assert torch_muon["matmul_flops"] == pytest.approx(out["ns_flops"], rel=1e-6)
    # ... shardwise's: this rank its owned matrices only, about a quarter at 4 ranks.
    assert muon["matmul_flops"] <= 0.35 * out["ns_flops"], (muon, out["ns_flops"])
    assert muon["matmul_flops"] >= 0.2 * out["ns_flops"]
    assert muon["alltoall"] == 2  # one gather and one scatter a step
    assert muon["optimizer_s"] < torch_muon["optimizer_s"]
    assert muon["step_s"] < torch_muon["step_s"]


def test_the_command_offers_the_planners_optimizers() -> None:
    from shardwise_app.cli.plan import OPTIMIZER_NAMES
    from shardwise_plan import OPTIMIZERS

    assert tuple(OPTIMIZERS) == OPTIMIZER_NAMES
