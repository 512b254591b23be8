"""The CUDA variant of the core suite: NCCL, one rank per GPU (one GPU is enough).

Skipped where there is no GPU (CI). Run on a GPU machine with
``python -m pytest tests/test_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from test_core import PARITY, parity_worker, seed_regression_worker

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
NCCL = "cpu:gloo,cuda:nccl"


def world() -> int:
    return min(torch.cuda.device_count(), 2) if torch.cuda.is_available() else 0


@pytest.mark.parametrize("case", list(PARITY))
def test_cuda_parity(case: str) -> None:
    _, cfg = PARITY[case]
    run_distributed(parity_worker, world(), {**cfg, "device": "cuda"}, backend=NCCL)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_cuda_seed_regression(reentrant: bool) -> None:
    run_distributed(seed_regression_worker, world(), reentrant, "cuda", backend=NCCL)


def bf16_cuda_worker(rank: int, world: int) -> None:
    """One GPU still gathers under bf16 (the cast): storage must come and go."""
    import copy

    from models import Net, batches, loss_fn
    from shardwise import MixedPrecisionPolicy
    from test_core import assert_between_steps, reference_step, shard_net

    torch.manual_seed(0)
    ref = Net(d=32, ac="none").cuda()
    model = copy.deepcopy(ref)
    model.ac = "non-reentrant"
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard_net(model, {"mp_policy": policy})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    base = None
    for step, idx in enumerate(batches(4)):
        idx = idx.cuda()
        loss = loss_fn(model, idx.chunk(world)[rank])
        loss.backward()
        assert_between_steps(model)
        opt.step()
        opt.zero_grad()
        ref_loss = reference_step(ref, ref_opt, idx)
        torch.cuda.synchronize()
        if step == 1:
            base = torch.cuda.memory_allocated()
        elif step > 1:
            assert torch.cuda.memory_allocated() == base, "memory grows step over step"
        if world == 1:
            torch.testing.assert_close(loss.float(), ref_loss, atol=3e-2, rtol=3e-2)


def test_cuda_bf16_no_leak() -> None:
    run_distributed(bf16_cuda_worker, world(), backend=NCCL)
