"""The planner's rates: measured compute (op_costs.py), ``shardwise calibrate`` and ``--rates FILE``.

Speed is never asserted here: what is checked is that a measured plan times
the operators it recorded (and falls back to the rates for a call it cannot
rebuild), that the replay uses those times, that calibrated rates round-trip
through a file into a plan, and that bad input is one line.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from cli_helpers import shardwise
from shardwise_app.cli.common import UsageError
from shardwise_app.cli.plan_rates import load_rates
from shardwise_plan import CPU, Policy, plan
from shardwise_plan.op_costs import Call, TensorSpec, call_spec, measure
from shardwise_plan.timeline import op_seconds
from shardwise_plan.tracker import Event

pytestmark = pytest.mark.timeout(240)

TINY = ["--model", "tiny", "--batch-size", "1", "--seq-len", "32"]


def _tiny() -> torch.nn.Module:
    from shardwise_app.models.gpt import GPT, SIZES

    return GPT(dataclasses.replace(SIZES["tiny"], seq_len=32))


def test_call_spec_rebuilds_layouts_and_measure_times_each_distinct_call_once() -> None:
    a = torch.randn(4, 8)
    expanded = torch.randn(8).expand(4, 8)  # stride 0: one storage row
    spec = call_spec(torch.ops.aten.add.Tensor, (a, expanded), {})
    assert spec is not None
    assert spec.leaves == (
        TensorSpec((4, 8), (8, 1), torch.float32),
        TensorSpec((4, 8), (0, 1), torch.float32),
    )
    # Something that cannot be rebuilt is not a call.
    assert call_spec(torch.ops.aten.add.Tensor, (a, object()), {}) is None
    # The same call twice is one distinct call; a call that raises is left to the rates.
    bad = Call(torch.ops.aten.mm.default, spec.tree, spec.leaves)  # (4, 8) @ (4, 8) raises
    costs = measure([spec, spec, None, bad], "cpu", repeats=1)
    assert costs.measured == 1 and costs.failed == 1
    assert set(costs.seconds) == {spec.key} and costs.seconds[spec.key] > 0


def test_sample_layouts_keeps_all_that_fit_and_else_a_share_of_each_layout() -> None:
    from shardwise_plan.local_step import sample_layouts

    f32 = torch.float32
    layouts = [((4, 8), f32)] * 10 + [((100,), f32)]
    whole = 4 * 4 * (10 * 32 + 100)  # parameter, gradient, two moments, 4 bytes each
    assert sample_layouts(layouts, whole) == (layouts, 1.0)
    sample, share = sample_layouts(layouts, whole // 2)
    # half of the ten matrices, and the lone vector still once: the mix stays
    assert sorted(sample, key=str) == sorted([((4, 8), f32)] * 5 + [((100,), f32)], key=str)
    assert share == (5 * 32 + 100) / (10 * 32 + 100)


def test_host_optimizer_step_is_run_for_real_under_a_group_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import statistics

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from shardwise_plan import local_step
    from shardwise_plan.local_step import HOST_TIMED_STEPS, host_optimizer_seconds

    stepped: list[torch.Tensor] = []

    def spy(
        model: torch.nn.Module, device: str, offload: bool = False, optimizer: str = "adamw"
    ) -> torch.optim.Optimizer:
        stepped.extend(model.parameters())
        return make_optimizer(model, device, offload, optimizer)

    make_optimizer = local_step.make_optimizer
    monkeypatch.setattr(local_step, "make_optimizer", spy)
    f32 = torch.float32
    layouts = [((64, 32), f32)] * 8 + [((32,), f32)] * 8 + [((), f32)]
    assert not dist.is_initialized()
    whole = host_optimizer_seconds(layouts)
    assert not dist.is_initialized()  # its one-rank fake group is gone again
    # the offloaded run's optimizer on DTensors of exactly these layouts: dispatch included
    assert [(tuple(p.shape), p.dtype) for p in stepped] == layouts
    assert all(isinstance(p, DTensor) and p.grad is not None for p in stepped)
    assert whole.sampled == 1.0 and len(whole.steps_ms) == HOST_TIMED_STEPS
    assert whole.seconds > 0
    assert abs(whole.seconds - statistics.median(whole.steps_ms) / 1e3) < 1e-12
    # Over the memory it may take, a share is stepped and its time scaled up.
    part = host_optimizer_seconds(layouts, max_bytes=4 * 4 * (4 * 64 * 32 + 4 * 32 + 1))
    assert part.sampled < 1.0
    assert abs(part.seconds - statistics.median(part.steps_ms) / 1e3 / part.sampled) < 1e-12


def test_replay_uses_a_measured_time_instead_of_the_roofline() -> None:
    e = Event(kind="op", live=0, phase="forward", module="", flops=1e12, nbytes=8, matmul=True)
    roofline = op_seconds(e, CPU)
    assert roofline > 1.0  # a TFLOP at the CPU's tens of GFLOP/s
    e.seconds = 1e-3
    assert op_seconds(e, CPU) == 1e-3
    e.dtensor = True  # DTensor's dispatch comes on top of what the local op costs
    assert op_seconds(e, CPU) == pytest.approx(1e-3 + CPU.dtensor_overhead)


def test_measured_plan_times_the_recorded_operators() -> None:
    kw = dict(batch_size=1, seq_len=32, policy=Policy(), hardware=CPU)
    measured = plan(_tiny, 2, compute="measured", **kw)  # type: ignore[arg-type]
    c = measured.compute
    assert c["mode"] == "measured" and c["failed"] == 0 and c["distinct_calls"] > 10
    # Identical blocks share their calls: far fewer distinct calls than operators.
    assert c["distinct_calls"] < c["ops_measured"] <= c["ops"]
    rates = plan(_tiny, 2, **kw)  # type: ignore[arg-type]
    assert rates.compute == {"mode": "rates"}
    # Memory does not depend on how time is predicted.
    assert measured.peak_bytes == rates.peak_bytes
    assert measured.time.compute_s > 0 and measured.time.compute_s != rates.time.compute_s


def test_measured_compute_for_a_device_not_here_is_refused() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the CUDA target is measurable")
    with pytest.raises(ValueError, match="CUDA target with no GPU here"):
        plan(_tiny, 2, batch_size=1, seq_len=32, compute="measured")
    with pytest.raises(ValueError, match="compute must be one of"):
        plan(_tiny, 2, batch_size=1, seq_len=32, compute="guessed")


def _one_line(out: object, message: str) -> None:
    assert out.returncode == 2, out.stderr  # type: ignore[attr-defined]
    lines = out.stderr.strip().splitlines()  # type: ignore[attr-defined]
    assert len(lines) == 1 and message in lines[0], lines


def test_rates_file_round_trips_into_the_plan(tmp_path: Path) -> None:
    rates = dataclasses.replace(CPU, name="mine", matmul_flops_fp32=1e9, source="test")
    (tmp_path / "r.json").write_text(json.dumps(dataclasses.asdict(rates)))
    out = shardwise(
        "plan", *TINY, "--world-size", "4", "--rates", "r.json", "--json", "p.json", cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    hw = json.loads((tmp_path / "p.json").read_text())["hardware"]
    assert hw == dataclasses.asdict(rates)


def test_a_gpu_rates_file_from_before_the_workspace_keeps_the_default(tmp_path: Path) -> None:
    """Files calibrate wrote before it measured cuBLAS's workspace get torch's Hopper
    default for a GPU (not none at all), and none for a CPU."""
    from shardwise_plan import H200

    for hw, expect in ((H200, 32 << 20), (CPU, 0)):
        d = dataclasses.asdict(hw)
        del d["blas_workspace"]
        (tmp_path / "r.json").write_text(json.dumps(d))
        assert load_rates(str(tmp_path / "r.json")).blas_workspace == expect
    d = dataclasses.asdict(dataclasses.replace(H200, blas_workspace=1 << 20))
    (tmp_path / "r.json").write_text(json.dumps(d))
    assert load_rates(str(tmp_path / "r.json")).blas_workspace == 1 << 20


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "cannot read it"),
        ("{not json", "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"name": "x", "warp_speed": 1}', "unknown warp_speed"),
        ('{"name": "x"}', "missing alloc_round, dtensor_overhead"),
    ],
)
def test_bad_rates_file_is_refused(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "r.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UsageError, match=f"--rates {path}: {message}"):
        load_rates(str(path))


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("mem_bw", 0, "mem_bw must be a number > 0"),
        ("latency", -1, "latency must be a number >= 0"),
        ("ranks_per_node", 2.5, "ranks_per_node must be a whole number"),
        ("matmul_flops", True, "matmul_flops must be a number > 0"),
        ("comm_overlaps", 1, "comm_overlaps must be true or false"),
    ],
)
def test_bad_rate_is_refused(tmp_path: Path, field: str, value: object, message: str) -> None:
    d = dataclasses.asdict(CPU)
    d[field] = value
    (tmp_path / "r.json").write_text(json.dumps(d))
    with pytest.raises(UsageError, match=message):
        load_rates(str(tmp_path / "r.json"))


def test_bad_rates_file_is_one_line_on_the_command_line(tmp_path: Path) -> None:
    (tmp_path / "r.json").write_text('{"name": "x", "warp_speed": 1}')
    out = shardwise("plan", *TINY, "--world-size", "4", "--rates", "r.json", cwd=tmp_path)
    _one_line(out, "--rates r.json: unknown warp_speed")
    assert "shardwise calibrate --out FILE" in out.stderr


def test_rates_and_hardware_together_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "r.json").write_text(json.dumps(dataclasses.asdict(CPU)))
    out = shardwise(
        "plan", *TINY, "--rates", "r.json", "--hardware", "cpu", "--world-size", "4", cwd=tmp_path
    )
    _one_line(out, "--rates and --hardware both say which rates to use")


def test_calibrate_writes_rates_that_plan_accepts(tmp_path: Path) -> None:
    """``shardwise calibrate`` measures compute with every rank at once; on a CPU it
    leaves gloo's latency and bus the CPU preset's (a CPU plan's step is indicative)."""
    out = shardwise("calibrate", "--nproc", "2", "--out", "r.json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    d = json.loads((tmp_path / "r.json").read_text())
    for name in ("matmul_flops", "matmul_flops_fp32", "mem_bw", "intra_bw", "host_adamw_bw"):
        assert math.isfinite(d[name]) and d[name] > 0, (name, d[name])
    assert "2 ranks at once" in d["source"]
    if not torch.cuda.is_available():
        assert (d["intra_bw"], d["latency"]) == (CPU.intra_bw, CPU.latency)
        assert d["matmul_flops_fp32"] != CPU.matmul_flops_fp32  # measured here
    again = shardwise("plan", *TINY, "--world-size", "4", "--rates", "r.json", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
