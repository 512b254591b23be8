"""torchtitan with pipeline, tensor, expert and context parallel around FSDP (issue #50).

The cases (tests/library/integrations/frameworks_cases/titan_nd_cases.py) build each
layout from torchtitan 0.3.0's own pieces: its configs, ``ParallelDims``,
``pipeline_llm`` and the models' ``parallelize_*``. Each is compared inside
the workers with one process on the whole batch (each step's loss and
gradient norm at rtol 1e-4, every final parameter), under shardwise
(``patch_fsdp2()`` before torchtitan is imported) and under torch's FSDP2;
the two histories are then set beside each other here. Pipeline cases also
count reduce-scatters: one per sharded group per step.

Each world size's cases share one set of processes per implementation (4
ranks: pipeline, EP, CP; 8 ranks: PP x TP x FSDP), as test_frameworks.py
does at 2.
"""

from __future__ import annotations

from typing import Any

import pytest

from frameworks_cases.titan_nd_cases import MOE_MODELS, SCHEDULES
from test_frameworks import IMPLS, Results, need, outcome, run_framework, same_history

pytestmark = [pytest.mark.frameworks, pytest.mark.timeout(900)]


# Each list ends with its controls (a sabotage the comparison must notice).
PP_CASES = [f"pp:{s}" for s in SCHEDULES] + [
    "control:pp-sync-every-microbatch", "control:pp-averaged",
]  # fmt: skip
EP_CASES = [f"ep2:{m}" for m in MOE_MODELS] + [f"ep1:{m}" for m in MOE_MODELS] + [
    "control:ep-averaged", "control:ep1-averaged",
]  # fmt: skip
CP_CASES = ["cp:llama3", "cp-attention:llama3", "control:cp-averaged"]
PPTP_CASES = ["pptp:1F1B", "pptp:Interleaved1F1B", "control:pptp-averaged"]
WORLD4 = PP_CASES + EP_CASES + CP_CASES


def params(cases: list[str]) -> list[Any]:
    """(case, impl) for every case under both implementations."""
    return [pytest.param(case, impl, id=f"{case}-{impl}") for case in cases for impl in IMPLS]


def run_nd(world: int, cases: list[str], timeout: float) -> Results:
    """Both implementations' results, by case, at ``world`` ranks."""
    return run_framework("titan_nd_cases", cases, timeout, world=world)


@pytest.fixture(scope="module")
def titan4() -> Results:
    need("torchtitan")
    return run_nd(4, WORLD4, 600)


@pytest.fixture(scope="module")
def titan8() -> Results:
    need("torchtitan")
    return run_nd(8, PPTP_CASES, 600)


@pytest.mark.parametrize(("case", "impl"), params(PP_CASES))
def test_pipeline_parallel(titan4: Results, case: str, impl: str) -> None:
    outcome(titan4, impl, case)


@pytest.mark.parametrize(("case", "impl"), params(EP_CASES))
def test_expert_parallel(titan4: Results, case: str, impl: str) -> None:
    outcome(titan4, impl, case)


@pytest.mark.parametrize(("case", "impl"), params(CP_CASES))
def test_context_parallel_mesh(titan4: Results, case: str, impl: str) -> None:
    outcome(titan4, impl, case)


@pytest.mark.parametrize(("case", "impl"), params(PPTP_CASES))
def test_pipeline_tensor_fsdp(titan8: Results, case: str, impl: str) -> None:
    outcome(titan8, impl, case)


@pytest.mark.parametrize(
    "case",
    [c for c in WORLD4 if not c.startswith(("control", "cp-attention"))],
)
def test_shardwise_beside_fsdp2(titan4: Results, case: str) -> None:
    same_history(titan4, case)


@pytest.mark.parametrize(
    "case",
    [c for c in PPTP_CASES if not c.startswith("control")],
)
def test_shardwise_beside_fsdp2_8_ranks(titan8: Results, case: str) -> None:
    same_history(titan8, case)
