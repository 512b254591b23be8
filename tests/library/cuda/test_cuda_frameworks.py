"""HF ``Trainer``'s FSDP2 path on a GPU, with shardwise after ``patch_fsdp2()``.

accelerate (and so ``Trainer``) takes its FSDP2 path only on GPUs: on the
CPU it falls back to DDP silently, even with ``fsdp_version: 2``
(docs/frameworks.md). So this runs where there is a GPU: the same small
random Llama trained by ``Trainer(fsdp="full_shard", fsdp_config={"fsdp_version": 2})``
under torch's FSDP2, under shardwise, and without FSDP, each in its own
torchrun; its decoder layers must be shardwise's, and the losses and
gradient norms equal FSDP2's and the plain run's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SCRIPT = Path(__file__).with_name("hf_trainer_run.py")


def run(impl: str, out: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1"]
    cmd += ["--master-port", str(29500 + len(impl)), str(SCRIPT), "--impl", impl, "--out", str(out)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, (
        f"{impl}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    )
    return json.loads(out.read_text())


def test_cuda_hf_trainer_fsdp2_path_runs_shardwise(tmp_path: Path) -> None:
    ours = run("shardwise", tmp_path / "shardwise.json")
    torch_fsdp2 = run("fsdp2", tmp_path / "fsdp2.json")
    plain = run("none", tmp_path / "none.json")
    assert ours["layers"] == 4 and ours["shardwise"] == 4 and ours["torch_fsdpmodule"] == 4, ours
    assert torch_fsdp2["shardwise"] == 0 and torch_fsdp2["torch_fsdpmodule"] == 4, torch_fsdp2
    assert len(ours["losses"]) == len(torch_fsdp2["losses"]) > 0
    for ref in (torch_fsdp2, plain):
        torch.testing.assert_close(ours["losses"], ref["losses"], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ours["grad_norms"], ref["grad_norms"], rtol=1e-3, atol=1e-5)
