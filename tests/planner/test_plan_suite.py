"""benchmarks/plan_suite.py: the planner's tables, predicted and measured row by row.

What the suite does with its rows is checked with the prediction and the
measurement stood in for (a row of the real suite takes minutes): the JSON
after every row, the pairs with compute timed here, and bad flags.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from cli_helpers import env

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "plan_suite.py"


def _suite() -> ModuleType:
    spec = importlib.util.spec_from_file_location("plan_suite", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "args, message",
    [
        (["--suite", "scaling", "--rows", "0,12"], "give distinct indexes 0 to 11 of suite"),
        (["--suite", "cpu", "--rows", "two"], "--rows 'two': give distinct indexes 0 to 11"),
        (["--rows", "0"], "the following arguments are required: --suite"),
        (["--suite", "cpu", "--launches", "0"], "--launches must be at least 1, got 0"),
        (["--suite", "scaling", "--launches", "3"], "the scaling suite measures none"),
        (["--suite", "cpu", "--compute", "measured"], "the cpu suite checks memory"),
        (["--suite", "scaling", "--json", "/no/such/dir/s.json"], "there is no folder"),
    ],
)
def test_bad_suite_flags_are_one_line_and_run_nothing(
    tmp_path: Path, args: list[str], message: str
) -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=tmp_path,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr
    assert out.stdout == "" and list(tmp_path.iterdir()) == []


def _plan(step: float, peak: int = 2**30) -> SimpleNamespace:
    d = {
        "step_ms": step,
        "peak_bytes": peak,
        "peak_bytes_in_step": peak,
        "peak_bytes_drifting": peak,
        "peak_where": {"phase": "backward", "module": "blocks.0"},
        "peak_by_kind": {"grads": peak // 2},
        "time": {"compute_ms": step - 10, "comm_ms": 10.0, "exposed_comm_ms": 1.0},
        "compute": {"mode": "measured"},
        "collectives": {"bytes_per_rank": {"all_gather": 2**30}},
    }
    return SimpleNamespace(as_dict=lambda: dict(d), policy=None, optimizer="adamw")


def test_suite_writes_its_json_after_every_row(tmp_path: Path, monkeypatch: Any) -> None:
    """A suite cut short (a machine's limit on one command) keeps the rows it had."""
    suite = _suite()
    rows = [["--model", "tiny", "--world-size", str(w), "--hsdp", "1"] for w in (8, 64)]
    monkeypatch.setitem(suite.SUITES, "scaling", rows)
    calls: list[list[str]] = []

    def predict(argv: list[str], compute: str) -> tuple[Any, Any, int]:
        calls.append(argv)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the second configuration never finishes
        return _plan(12.5), None, 128

    monkeypatch.setattr(suite, "predict", predict)
    out = tmp_path / "suite.json"
    with pytest.raises(KeyboardInterrupt):
        suite.run_suite("scaling", str(out))
    doc = json.loads(out.read_text())
    assert doc["complete"] is False and "only" not in doc
    assert [r["argv"] for r in doc["rows"]] == [" ".join(rows[0])]
    assert doc["rows"][0]["predicted_step_ms"] == 12.5
    assert "| tiny | 8 | FSDP | 1.00 |" in out.with_suffix(".md").read_text()


def test_a_suite_timing_on_this_machine_pairs_each_prediction_with_a_launch_after_it(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """With compute timed here each row is predicted and measured in pairs (predict, then
    one launch), so that both sides sample the same minutes of the machine; the row
    compares the median prediction (and that plan's breakdown) with the median launch,
    each rank's peak the median of the runs'. --rows runs only the rows named."""
    suite = _suite()
    configs = [["--model", "tiny", "--world-size", str(w)] for w in (2, 4, 8)]
    monkeypatch.setitem(suite.SUITES, "h200", configs)
    calls: list[tuple[str, Any]] = []
    steps = iter([100.0, 130.0, 90.0, 140.0, 80.0])  # the median: the first draw
    launched = iter([95.0, 120.0, 99.0, 150.0, 70.0])  # the median: 99
    peaks = iter([30, 31, 29, 40, 30])  # MiB on rank 0; the median 30

    def predict(argv: list[str], compute: str) -> tuple[Any, Any, int]:
        calls.append(("predict", (argv, compute)))
        return _plan(next(steps), 2**25), None, 128

    def measure_row(args: Any, p: Any, seq: int, launches: int | None) -> dict[str, Any]:
        calls.append(("measure", launches))
        launch = next(launched)
        return {
            "peak_bytes": [next(peaks) * 2**20, 2**25],
            "frees_unrecorded": [0, 1],
            "step_ms": launch,
            "step_ms_per_launch": [launch],
            "step_ms_per_rank": [launch, launch - 1],
            "step_ms_per_rank_per_launch": [[launch, launch - 1]],
            "device": "cpu",
        }

    monkeypatch.setattr(suite, "predict", predict)
    monkeypatch.setattr(suite, "measure_row", measure_row)
    out = tmp_path / "suite.json"
    extra = ["--rates", "r.json"]
    only = suite.suite_rows("h200", "1")
    suite.run_suite("h200", str(out), extra, only=only, launches=5, compute="measured")
    # predict, then one launch, five times: every prediction of row 1 with the extra flags
    assert [c[0] for c in calls] == ["predict", "measure"] * 5
    assert all(c[1] == 1 for c in calls if c[0] == "measure")
    assert all(c[1] == ([*configs[1], *extra], "measured") for c in calls if c[0] == "predict")
    doc = json.loads(out.read_text())
    assert doc["complete"] is True and doc["only"] == [1] and len(doc["rows"]) == 1
    row = doc["rows"][0]
    assert row["predicted_step_ms_per_draw"] == [100.0, 130.0, 90.0, 140.0, 80.0]
    assert row["predicted_step_ms"] == 100.0 and row["predicted_compute_ms"] == 90.0
    assert row["measured_step_ms_per_launch"] == [95.0, 120.0, 99.0, 150.0, 70.0]
    assert row["measured_step_ms"] == 99.0
    assert row["step_error_pct"] == pytest.approx(100 * 1 / 99)
    assert row["step_error_pct_per_pair"][0] == pytest.approx(100 * 5 / 95)
    assert row["measured_peak_bytes"] == 30 * 2**20
    assert row["measured_peak_bytes_per_run"] == [m * 2**20 for m in (30, 31, 29, 40, 30)]
    assert row["measured_frees_unrecorded"] == [0, 5]
    # By default PAIRS pairs; a suite timed from rates measures once, with N launches
    calls.clear()
    steps, launched = iter([100.0] * suite.PAIRS), iter([95.0] * suite.PAIRS)
    peaks = iter([30] * suite.PAIRS)
    suite.run_suite("h200", str(out), extra, only=[0], compute="measured")
    assert [c[1] for c in calls if c[0] == "measure"] == [1] * suite.PAIRS
    calls.clear()
    steps, launched, peaks = iter([100.0]), iter([95.0]), iter([30])
    suite.run_suite("h200", str(out), extra, only=[0], launches=4)
    assert [c[0] for c in calls] == ["predict", "measure"] and calls[1][1] == 4
