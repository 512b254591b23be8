"""Frameworks that call torch's FSDP2, routed to shardwise by ``shardwise.patch_fsdp2()``.

Issue #26. Each framework is driven the way its users drive it (its own
parallelize function, strategy, plugin or recipe helper), on tiny models at
2 gloo ranks on CPU in fp32, and every case is compared inside the workers
with ONE process on the whole batch from the same seed (losses, gradient
norms, final parameters at rtol 1e-4). The same cases also run under torch's
FSDP2 (unpatched) as a second reference: that the harness passes there too
shows a failure under shardwise is shardwise's, and the histories of the two
are compared here as well.

In the shardwise workers ``patch_fsdp2()`` runs before the framework is
imported, and every case checks that the framework's sharded modules are
shardwise's (so a patch that stopped routing fails every case). Controls
sabotage what a case claims to check (gradients averaged twice, gradient
sync left on during accumulation) and assert the comparison notices.

All cases of one framework run in one set of processes (imports cost
seconds); each test reads its own case's result. The case code lives in
tests/library/integrations/frameworks_cases/, one module per framework; the CPU set-up each needs
is documented in docs/frameworks.md.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import pytest

from dist_utils import Outcome, run_tasks
from frameworks_cases.common import prepare, run_case

pytestmark = [pytest.mark.frameworks, pytest.mark.timeout(900)]

WORLD = 2
IMPLS = ["shardwise", "fsdp2"]

# Each list ends with its controls (a sabotage the comparison must notice).
TITAN_CASES = [
    *(
        f"{backend}:{loss}:{ac}"
        for backend in ("partial_dtensor", "full_dtensor")
        for loss in ("ce", "chunked")
        for ac in ("none", "full", "selective")
    ),
    "partial_dtensor:chunked:none:accum",
    "control",
    "unpatch",  # last: it unpatches this process
]
LIGHTNING_CASES = [
    "fabric", "accum", "save-load", "empty-init", "trainer", "trainer-accum", "trainer-resume",
    "auto-mesh", "accum-control",
]  # fmt: skip
ACCELERATE_CASES = [
    "fallback", "train", "tied", "accum-clip", "ac", "state-dict", "save-load", "accum-control",
]  # fmt: skip
TORCHTUNE_CASES = ["full", "full-ac", "lora", "lora-ac", "resume", "lora-resume"]
DCP_CASES = ["sharded", "full", "broadcast", "frozen"]

Results = dict[str, dict[str, Outcome]]  # by implementation, then case


def need(package: str) -> None:
    """Skip without the package; not imported here (the workers import it, patched first)."""
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed")


def run_framework(
    module: str, cases: list[str], timeout: float, *args: Any, world: int = WORLD
) -> Results:
    """Both implementations' outcomes, by case: each implementation's cases in one set of
    processes; one failing case does not stop the others, and a crashed set fails every
    case."""
    return {
        impl: run_tasks(
            [(case, run_case, (impl, module, case)) for case in cases],
            world,
            timeout=timeout,
            setup=(prepare, (impl, module, *args)),
            agree=True,
            quiet=(Warning,),
        )
        for impl in IMPLS
    }


def outcome(results: Results, impl: str, case: str) -> Any:
    error = results[impl][case].error
    assert error is None, f"{case} under {impl}:\n{error}"
    return results[impl][case].value


def same_history(results: Results, case: str) -> None:
    """shardwise's losses and gradient norms beside FSDP2's, step by step."""
    a, b = results["shardwise"][case].value, results["fsdp2"][case].value
    if a is None or b is None:
        pytest.skip("one side failed (its own test says why)")
    # Equal, non-empty histories first: zip alone would pass a short or empty one.
    assert a and a.keys() == b.keys(), f"{case}: shardwise records {sorted(a)}, FSDP2 {sorted(b)}"
    for key in a:
        assert len(a[key]) == len(b[key]) > 0, (
            f"{case}: {key} has {len(a[key])} steps under shardwise, {len(b[key])} under FSDP2"
        )
        for step, (x, y) in enumerate(zip(a[key], b[key], strict=True)):
            assert math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-6), (
                f"{case}: {key} at step {step}: shardwise {x}, FSDP2 {y}"
            )


# ---- torchtitan ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def titan() -> Results:
    need("torchtitan")
    return run_framework("titan_cases", TITAN_CASES, 300)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", [c for c in TITAN_CASES if c != "unpatch"])
def test_torchtitan(titan: Results, case: str, impl: str) -> None:
    outcome(titan, impl, case)


@pytest.mark.parametrize("case", [c for c in TITAN_CASES if ":" in c])
def test_torchtitan_shardwise_beside_fsdp2(titan: Results, case: str) -> None:
    same_history(titan, case)


def test_torchtitan_unpatch_restores_torchs_fully_shard(titan: Results) -> None:
    outcome(titan, "shardwise", "unpatch")


# ---- Lightning ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lightning(tmp_path_factory: pytest.TempPathFactory) -> Results:
    need("lightning")
    folder = str(tmp_path_factory.mktemp("lightning"))
    return run_framework("lightning_cases", LIGHTNING_CASES, 240, folder)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", LIGHTNING_CASES)
def test_lightning(lightning: Results, case: str, impl: str) -> None:
    outcome(lightning, impl, case)


@pytest.mark.parametrize(
    "case", [c for c in LIGHTNING_CASES if c not in ("auto-mesh", "accum-control")]
)
def test_lightning_shardwise_beside_fsdp2(lightning: Results, case: str) -> None:
    same_history(lightning, case)


# ---- accelerate -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def accelerate(tmp_path_factory: pytest.TempPathFactory) -> Results:
    need("accelerate")
    need("transformers")
    folder = str(tmp_path_factory.mktemp("accelerate"))
    return run_framework("accelerate_cases", ACCELERATE_CASES, 240, folder)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", ACCELERATE_CASES)
def test_accelerate(accelerate: Results, case: str, impl: str) -> None:
    outcome(accelerate, impl, case)


@pytest.mark.parametrize(
    "case", [c for c in ACCELERATE_CASES if c not in ("fallback", "accum-control")]
)
def test_accelerate_shardwise_beside_fsdp2(accelerate: Results, case: str) -> None:
    same_history(accelerate, case)


# ---- torchtune ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def torchtune(tmp_path_factory: pytest.TempPathFactory) -> Results:
    need("torchtune")
    need("torchao")
    folder = str(tmp_path_factory.mktemp("torchtune"))
    return run_framework("torchtune_cases", TORCHTUNE_CASES, 240, folder)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", TORCHTUNE_CASES)
def test_torchtune(torchtune: Results, case: str, impl: str) -> None:
    outcome(torchtune, impl, case)


@pytest.mark.parametrize("case", TORCHTUNE_CASES)
def test_torchtune_shardwise_beside_fsdp2(torchtune: Results, case: str) -> None:
    same_history(torchtune, case)


# ---- torch.distributed.checkpoint.state_dict ------------------------------------------------


@pytest.fixture(scope="module")
def dcp(tmp_path_factory: pytest.TempPathFactory) -> Results:
    folder = str(tmp_path_factory.mktemp("dcp"))
    return run_framework("dcp_cases", DCP_CASES, 120, folder)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", DCP_CASES)
def test_dcp_state_dict_helpers(dcp: Results, case: str, impl: str) -> None:
    outcome(dcp, impl, case)
