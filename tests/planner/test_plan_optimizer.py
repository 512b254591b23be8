"""The plan models the optimizer the user names, and ``import shardwise`` loads no planner.

What an optimizer holds at the peak is its implementation's: foreach AdamW
computes each update over all of a rank's parameters at once, with a
temporary the size of all of them, where fused AdamW allocates none. On a
model whose parameters outweigh its activations that moves the peak; the
plan says so, and the fused plan's peak is the one gloo ranks measure.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from cli_helpers import env, shardwise

pytestmark = pytest.mark.timeout(300)

HERE = Path(__file__).resolve().parent
DEEP = ["--model", "plan_models:deep_narrow", "--seq-len", "16", "--batch-size", "1"]


def _plans() -> dict[str, Any]:
    from plan_models import deep_narrow
    from shardwise_plan import CPU, H200, Policy, plan

    out: dict[str, Any] = {}
    for hw in (CPU, H200):
        for opt in ("adamw", "adamw-foreach", "adamw-fused", "sgd", "lion"):
            p = plan(
                deep_narrow, 2, batch_size=1, seq_len=16, policy=Policy(ac="non-reentrant"),
                hardware=hw, optimizer=opt,
            )  # fmt: skip
            out[f"{hw.name} {opt}"] = {
                "peak": p.peak_bytes,
                "phase": p.peak_phase,
                "kinds": p.peak_by_kind,
                "optimizer": p.optimizer,
                "note": p.optimizer_note,
                "json": p.as_dict(),
            }
    return out


def test_fused_and_foreach_adamw_differ_by_foreachs_temporaries() -> None:
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        out = pool.submit(_plans).result(timeout=280)
    for hw in ("cpu", "h200"):
        foreach, fused = out[f"{hw} adamw-foreach"], out[f"{hw} adamw-fused"]
        # foreach peaks in its step, a temporary the size of the rank's fp32 parameters
        # beside the parameters, gradients and both moments; fused never reaches it
        assert foreach["phase"] == "optimizer", (hw, foreach)
        params = foreach["kinds"]["sharded_params"]
        assert foreach["kinds"]["temps"] >= params, (hw, foreach)
        assert fused["peak"] < foreach["peak"], (hw, fused, foreach)
        assert fused["phase"] != "optimizer", (hw, fused)
        # the moments are the same, whichever implementation steps them
        assert fused["kinds"]["optimizer_state"] == foreach["kinds"]["optimizer_state"]
        # two moments a parameter (and AdamW's step counts, a scalar each)
        assert fused["kinds"]["optimizer_state"] == pytest.approx(2 * params, rel=1e-2)
        # SGD with momentum: one state tensor a parameter
        assert out[f"{hw} sgd"]["kinds"]["optimizer_state"] == pytest.approx(params, rel=1e-2)
    # torch's own pick: foreach on a GPU, the for-loop on the CPU (no temporary of all)
    assert out["h200 adamw"]["peak"] == out["h200 adamw-foreach"]["peak"]
    assert out["cpu adamw"]["peak"] < out["cpu adamw-foreach"]["peak"]
    # a name the planner does not know: modelled as adamw, and the plan says so
    lion = out["h200 lion"]
    assert lion["optimizer"] == "adamw" and lion["peak"] == out["h200 adamw"]["peak"]
    assert "unknown optimizer 'lion': modelled as adamw" in lion["note"]
    assert lion["json"]["optimizer_note"] == lion["note"]
    assert "optimizer_note" not in out["h200 adamw-fused"]["json"]


@pytest.mark.timeout(600)
def test_a_fused_adamw_plan_is_the_peak_gloo_ranks_measure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused AdamW plan's peak within 3% of 2 gloo ranks' measured peak, with the
    optimizer the ranks make the one named (shardwise_plan.setup, as the plan's)."""
    # the ranks import plan_models too
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    out = shardwise(
        "plan", *DEEP, "--world-size", "2", "--ac", "non-reentrant", "--optimizer",
        "adamw-fused", "--measure", "--launches", "1", "--json", "m.json", cwd=tmp_path,
        timeout=500,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    d = json.loads((tmp_path / "m.json").read_text())
    assert d["optimizer"] == d["measured"]["optimizer"] == "adamw-fused"
    measured = d["measured"]["peak_bytes"][0]
    assert abs(d["peak_bytes"] - measured) <= 0.03 * measured, (d["peak_bytes"], measured)


def test_import_shardwise_loads_no_planner_or_application() -> None:
    code = (
        "import sys, shardwise; "
        "print(sorted(m for m in sys.modules if m.startswith(('shardwise_plan', 'shardwise_app'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env(), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_shardwise_plan_is_gone_and_says_where_the_planner_is() -> None:
    """The deprecated ``shardwise.plan`` shim is removed (it imported the planner from
    the library: the one import cycle between the packages). The old name fails with an
    AttributeError naming ``shardwise_plan``, and asking for it loads no planner."""
    code = """
import sys, shardwise
try:
    shardwise.plan
except AttributeError as e:
    message = str(e)
else:
    raise SystemExit("shardwise.plan still resolves")
assert "shardwise_plan.plan" in message, message
assert not hasattr(shardwise, "plan")
assert not [m for m in sys.modules if m.startswith("shardwise_plan")], "planner loaded"
print(message)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], env=env(), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "shardwise_plan" in out.stdout, out.stdout
