"""``shardwise bench``: memory breakdown, size sweeps, ``--compile`` and ``hf:PATH``.

Kept fast (the whole file is budgeted at a minute on two cores): the tiny
model and a tiny Llama on CPU, one step, one round; what needs no worker
process (attribution of an allocator record, tensor accounting, bad input)
runs in this process.
"""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from shardwise_app.bench import command, memory
from shardwise_app.bench.models import build, resolve
from shardwise_app.bench.tables import add_ratios
from shardwise_app.models.gpt import GPT, SIZES

FAST = ["--device", "cpu", "--nproc", "1", "--seq-len", "16", "--batch-size", "2"]
FAST += ["--steps", "1", "--warmup", "0", "--rounds", "1"]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("llama")
    LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        dtype="bfloat16",  # saved as bf16: the benchmark must still train fp32 weights
    ).save_pretrained(folder)
    return folder


def _expected_bytes(model: torch.nn.Module) -> dict[str, int]:
    """fp32 AdamW on CPU: weights, gradients, two moments and a 4-byte step per tensor."""
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    return {"parameters": 4 * n, "gradients": 4 * n, "optimizer_state": 8 * n + 4 * len(params)}


# ---- memory accounting, in process -----------------------------------------------------------


def test_held_tensors_count_each_storage_once() -> None:
    torch.manual_seed(0)
    model = GPT(SIZES["tiny"].with_seq_len(16))  # tied head: one storage for two names
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 256, (2, 16))).sum().backward()
    opt.step()
    held = memory.held_tensors(model, opt, torch.device("cpu"))
    assert memory.exact_bytes(held) == _expected_bytes(model)
    assert memory.exact_bytes(memory.held_tensors(model, opt, torch.device("meta"))) == {
        "parameters": 0,
        "gradients": 0,
        "optimizer_state": 0,
    }


SW = "/src/shardwise/runtime/param_group.py"  # a frame of shardwise's that carries no meaning now
FSDP_PARAM = "/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_param.py"
FSDP_COLL = "/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py"
GPT_FWD = ("/src/shardwise_app/models/gpt.py", "forward")


def _alloc(addr: int, size: int, *frames: tuple[str, str], label: str = "") -> dict[str, Any]:
    return {
        "action": "alloc",
        "addr": addr,
        "size": size,
        "frames": [{"filename": f, "name": n, "line": 1} for f, n in frames],
        "user_metadata": label,  # the scope of a shardwise.observe label
    }


def _free(addr: int, size: int) -> dict[str, Any]:
    return {"action": "free_requested", "addr": addr, "size": size}


def _mark(addr: int) -> list[dict[str, Any]]:
    return [_alloc(addr, 4, ("/src/shardwise_app/bench/memory.py", memory.MARK)), _free(addr, 4)]


def test_allocator_record_is_attributed_at_its_peak() -> None:
    held = {
        "parameters": {0x100: 4096},
        "gradients": {0x900: 4096},
        "optimizer_state": {0x200: 8192},
    }
    baseline = 4096 + 8192 + 1024  # and a 1 KiB workspace from an earlier step
    trace = [
        # forward
        _alloc(0x300, 1000, (SW, "issue"), label="shardwise::gather"),  # an all-gather output
        _alloc(0x400, 2048, (SW, "finish"), label="shardwise::unsharded"),
        _free(0x300, 1000),
        _alloc(0xA00, 512, (FSDP_COLL, "foreach_all_gather")),
        _alloc(0x500, 3000, GPT_FWD),
        *_mark(0xF00),
        # backward
        _alloc(0x600, 512),  # autograd's engine thread: no Python frames
        _alloc(0xB00, 512, GPT_FWD, ("/torch/utils/checkpoint.py", "unpack_hook")),
        _alloc(0x900, 4096, (FSDP_COLL, "foreach_reduce")),  # survives: the gradient
        _alloc(0x700, 1024, (FSDP_PARAM, "alloc_storage"), (FSDP_PARAM, "init_unsharded_param")),
        _free(0x700, 1024),
        _free(0x600, 512),
        _free(0x500, 3000),
        _free(0x400, 2048),
        *_mark(0xF00),
        # optimizer step
        _alloc(0x800, 100, ("/torch/optim/adamw.py", "_fused_adamw")),
        _free(0x800, 100),
        *_mark(0xF00),
    ]
    got = memory.attribute_peak(trace, baseline, held)
    parts = {
        "parameters": 4096,
        "gradients": 4096,
        "optimizer_state": 8192,
        "gathered_params": 2048 + 1024,
        "comm_buffers": 512,
        "activations": 3072 + 512,  # 3000 rounded to a 512-byte block, and a recomputation
        "backward_temporaries": 512,
        "other": 1024,
    }
    assert got == {"peak_bytes": sum(parts.values()), "parts": parts, "peak_during": "backward"}


def test_the_code_attributed_by_stack_still_exists() -> None:
    """A rename in torch would silently move FSDP2's memory to another part
    (shardwise's is attributed by its labels: the test below)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param

    fsdp2 = (_fsdp_param.FSDPParam, _fsdp_param, _fsdp_collectives)
    assert all(any(hasattr(m, n) for m in fsdp2) for n in memory._FSDP2_GATHERED)
    for module in (_fsdp_param, _fsdp_collectives):
        assert module.__file__ and module.__file__.replace("\\", "/").endswith(
            tuple(f"torch/distributed/fsdp/_fully_shard/{f}" for f in memory._FSDP2_COMM_FILES)
        )


# ---- runs ------------------------------------------------------------------------------------


def _run(args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Any, str]:
    out = tmp_path / "bench.json"
    assert command.main([*args, *FAST, "--json", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def test_ratios_are_taken_within_each_size_and_setting() -> None:
    rows = [
        {
            "config": c,
            "model": m,
            "ac": "none",
            "mp": "bf16",
            "compiled": k,
            "step_ms": t,
            "peak_gib": g,
        }
        for c, m, k, t, g in [
            ("fsdp2", "small", False, 10.0, 2.0),
            ("shardwise", "small", False, 9.0, 1.0),
            ("fsdp2", "large", False, 100.0, 40.0),
            ("shardwise", "large", False, 110.0, 50.0),
            ("bare", "large", True, 50.0, 25.0),
            ("shardwise", "large", True, 40.0, 20.0),
        ]
    ]
    add_ratios(rows)
    small, large, compiled = rows[1], rows[3], rows[5]
    assert (small["step_vs_fsdp2"], small["mem_vs_fsdp2"]) == (0.9, 0.5)
    assert (large["step_vs_fsdp2"], large["mem_vs_fsdp2"]) == (1.1, 1.25)
    assert "step_vs_bare" not in large  # the bare row is compiled: another comparison
    assert (compiled["step_vs_bare"], compiled["mem_vs_bare"]) == (0.8, 0.8)
    assert "step_vs_fsdp2" not in compiled


@pytest.mark.timeout(120)
def test_sweep_of_a_size_and_an_hf_model_compiled_with_their_checkpointing(
    llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    llama, layers = build(resolve(f"hf:{llama_dir}", 16, False), torch.device("cpu"), "reentrant")
    on = getattr(llama, "is_activation_checkpointing", None) or llama.is_gradient_checkpointing
    assert on and layers == list(llama.model.layers)  # the model's own checkpointing
    models = f"tiny,hf:{llama_dir}"
    args = ["--model", models, "--configs", "shardwise", "--compile", "--ac", "non-reentrant"]
    result, stdout = _run(args, tmp_path, capsys)
    rows = result["rows"]
    assert [r["model"] for r in rows] == models.split(",")
    assert result["meta"]["models"] == models.split(",")
    assert [r["model_type"] for r in rows] == ["gpt", "llama"]
    for r, model in zip(rows, (GPT(SIZES["tiny"].with_seq_len(16)), llama)):
        assert r["compiled"] and r["dynamo_graphs"] >= 1 and r["ac"] == "non-reentrant"
        assert r["step_ms"] > 0 and math.isfinite(r["loss"])
        # shardwise's timeline of one more step: compute waited less than a step.
        assert 0 <= r["exposed_comm_ms"] < r["step_ms"] and 0 <= r["prefetch_hit_rate"] <= 1
        # One rank communicates nothing: no wait to split by collective and module
        # (tests/test_debug.py checks the split at two ranks).
        assert r["exposed_by_ms"] == {} and r["exposed_comm_ms"] == 0
        assert r["params"] == sum(p.numel() for p in model.parameters())
        m = r["memory"]
        # One rank, fp32 (the Llama too, though its config says bf16): the flat
        # shards hold exactly the unsharded model's bytes.
        expected = _expected_bytes(model)
        assert m["exact"] == expected
        assert {k: m["parts"][k] for k in expected} == expected
        assert set(m["parts"]) == set(memory.CPU_PARTS)
        assert all(v > 0 for v in m["parts"].values()), m["parts"]
        assert sum(m["parts"].values()) == m["peak_bytes"]
        assert set(m["stages"]) == {"start", "forward", "backward", "step"}
    assert stdout.index("model tiny:") < stdout.index(f"model hf:{llama_dir}:")  # grouped
    assert "memory at the peak (GiB): cpu peak RSS (coarse" in stdout


# ---- bad input: one line, exit 2, nothing written --------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "tiny,huge"], "unknown --model 'huge'"),
        (["--model", "tiny,tiny"], "--model tiny,tiny: a model is listed twice"),
        (["--model", "hf:/no/such/folder"], "--model hf:/no/such/folder: no such folder"),
        (["--model", "hf:{empty}"], "no config.json in that folder"),
        (["--model", "hf:{broken}"], "config.json cannot be read"),
        (["--model", "tiny,hf:{llama}", "--ac", "none,selective"], "--ac selective: an hf:"),
        (["--model", "hf:{llama}", "--seq-len", "100"], "max_position_embeddings 64"),
        (["--compile", "sometimes"], "unknown --compile value 'sometimes'"),
    ],
)
def test_bad_input(
    args: list[str],
    message: str,
    llama_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    folders = {"empty": tmp_path / "empty", "broken": tmp_path / "broken", "llama": llama_dir}
    args = [a.format(**folders) for a in args]
    out = tmp_path / "never.json"
    assert command.main(["--device", "cpu", *args, "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()


def test_float8_needs_torchao_and_a_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    out = tmp_path / "never.json"
    args = ["--device", "cpu", "--float8", "--json", str(out)]
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao now fails
    assert command.main(args) == 2
    assert "--float8 needs torchao" in capsys.readouterr().err
    fake = types.ModuleType("torchao")
    monkeypatch.setitem(sys.modules, "torchao", fake)
    monkeypatch.setitem(sys.modules, "torchao.float8", types.ModuleType("torchao.float8"))
    fake.float8 = sys.modules["torchao.float8"]  # type: ignore[attr-defined]
    assert command.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "need a CUDA GPU" in err[0], err
    assert not out.exists()


def test_hf_without_transformers(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now fails
    out = tmp_path / "never.json"
    args = ["--device", "cpu", "--model", f"hf:{llama_dir}", "--json", str(out)]
    assert command.main(args) == 2
    assert "needs the transformers package" in capsys.readouterr().err
    assert not out.exists()


def test_cuda_memory_step_plumbing_with_a_fake_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path cannot run here: drive it with a fake allocator that keeps a record."""
    trace: list[dict[str, Any]] = []
    state = {"allocated": 1024, "peak": 1024, "recording": False}

    def alloc(addr: int, size: int, *frames: tuple[str, str], label: str = "") -> None:
        trace.append(_alloc(addr, size, *frames, label=label))
        state["allocated"] += size
        state["peak"] = max(state["peak"], state["allocated"])

    def free(addr: int, size: int) -> None:
        trace.append(_free(addr, size))
        state["allocated"] -= size

    fake_memory = type(sys)("fake_cuda_memory")
    fake_memory._record_memory_history = lambda enabled, **kw: state.update(recording=enabled)  # type: ignore[attr-defined]
    fake_memory._snapshot = lambda: {"device_traces": [list(trace)]}  # type: ignore[attr-defined]
    monkeypatch.setattr(torch.cuda, "memory", fake_memory)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: state["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: state["peak"])
    monkeypatch.setattr(
        torch.cuda, "reset_peak_memory_stats", lambda: state.update(peak=state["allocated"])
    )
    monkeypatch.setattr(memory, "memory_mark", lambda device: trace.extend(_mark(0xF00)))

    def run_step(mark: Any) -> None:
        assert state["recording"] == "all"
        alloc(0x100, 4096, GPT_FWD)
        mark("forward")
        alloc(0x200, 2048, label="shardwise::unsharded")
        alloc(0x300, 1024)  # the gradient
        free(0x200, 2048)
        free(0x100, 4096)
        mark("backward")
        mark("step")

    held = {"parameters": {0x10: 1024}, "gradients": {0x300: 1024}, "optimizer_state": {}}
    got = memory.cuda_memory_step(run_step, torch.device("cuda"), lambda: held)
    assert state["recording"] is None  # switched off again
    assert got["peak_bytes"] == 1024 + 4096 + 2048 + 1024
    assert got["unattributed_bytes"] == 0 and got["peak_during"] == "backward"
    assert got["parts"]["activations"] == 4096 and got["parts"]["gathered_params"] == 2048
    assert got["parts"]["gradients"] == 1024 and got["parts"]["parameters"] == 1024
    assert got["exact"] == {"parameters": 1024, "gradients": 1024, "optimizer_state": 0}
    assert got["stages"]["forward"] == {"allocated": 1024 + 4096, "peak": 1024 + 4096}
    assert got["stages"]["backward"]["peak"] == 1024 + 4096 + 2048 + 1024


@pytest.mark.parametrize("failing", ["recording", "snapshot"])
def test_a_failed_record_costs_the_attribution_not_the_row(
    failing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    recording: list[Any] = []

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("no history on this build")

    fake_memory = type(sys)("fake_cuda_memory")
    fake_memory._record_memory_history = (  # type: ignore[attr-defined]
        refuse if failing == "recording" else lambda enabled, **kw: recording.append(enabled)
    )
    fake_memory._snapshot = refuse  # type: ignore[attr-defined]
    monkeypatch.setattr(torch.cuda, "memory", fake_memory)
    for name, value in (
        ("synchronize", None),
        ("memory_allocated", 100),
        ("max_memory_allocated", 900),
    ):
        monkeypatch.setattr(torch.cuda, name, lambda value=value: value)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    monkeypatch.setattr(memory, "memory_mark", lambda device: None)
    phases: list[str] = []

    def run_step(mark: Any) -> None:
        for phase in memory.PHASES:
            phases.append(phase)
            mark(phase)

    held = {"parameters": {1: 300}, "gradients": {2: 300}, "optimizer_state": {}}
    got = memory.cuda_memory_step(run_step, torch.device("cuda"), lambda: held)
    assert phases == list(memory.PHASES)  # the step ran all the same
    assert got["stages"]["backward"] == {"allocated": 100, "peak": 900}
    assert f"attribution failed: {failing}: RuntimeError: no history" in got["method"]
    assert recording == ([] if failing == "recording" else ["all", None])  # off again
    assert got["parts"]["parameters"] == 300 and got["parts"]["other"] == 900 - 600
    assert set(got["parts"]) == set(memory.CUDA_PARTS)


def test_pure_bf16_keeps_no_fp32_master_weights(tmp_path: Path) -> None:
    """``--mp bf16-pure``: the floor issue 14 compares against; every parameter (hence
    gradient and AdamW state) in bf16, in the bare model and the sharded one."""
    import torch.distributed as dist

    from shardwise_app.bench.jobs import Job, build_job

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        for config in ("bare", "shardwise"):
            job = Job(config, "tiny", 1, "none", "bf16-pure", 2, 16, 1, 0, "cpu")
            model, _ = build_job(job)
            assert {p.dtype for p in model.parameters()} == {torch.bfloat16}, config
    finally:
        dist.destroy_process_group()


def test_optimizer_in_backward_steps_inside_the_benchmarked_backward(tmp_path: Path) -> None:
    """``--optimizer-in-backward``: shardwise's AdamW has stepped when backward returns."""
    import torch.distributed as dist

    from shardwise_app.bench.jobs import Job, build_job
    from shardwise_app.bench.models import logits

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        job = Job("shardwise", "tiny", 1, "none", "none", 2, 16, 1, 0, "cpu")
        job.optimizer_in_backward = True
        model, _ = build_job(job)
        before = [p.detach().clone() for p in model.parameters()]
        idx = torch.randint(0, 64, (2, 16))
        logits(model, resolve("tiny", 16, False), idx).float().mean().backward()
        assert all(p.grad is None for p in model.parameters())
        assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    finally:
        dist.destroy_process_group()


def labelled_step_worker(rank: int, world: int) -> dict[str, list[int]]:
    """One training step of two sharded layers under the CPU profiler with memory:
    per runtime label, how many scopes ran and the bytes allocated inside them."""
    import torch.nn as nn
    from torch.distributed.tensor import Shard

    from shardwise import fully_shard
    from shardwise.observe import PREFIX

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    fully_shard(model[0], reshard_after_forward=2)  # backward gathers a kept part over 2
    # Split along dim 1: a rank-major gather, copied out.
    fully_shard(model[1], shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)
    fully_shard(model)
    model(torch.randn(4, 8)).sum().backward()  # the first step builds what later ones reuse
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        model(torch.randn(4, 8)).sum().backward()
    found: dict[str, list[int]] = {}
    for e in prof.events():
        if e.name.startswith(PREFIX):
            counts = found.setdefault(e.name, [0, 0])
            counts[0] += 1
            counts[1] += e.cpu_memory_usage
    return found


@pytest.mark.timeout(180)
def test_runtime_labels_attribute_memory_by_what_it_does() -> None:
    """The runtime labels its scopes for the profiler (``shardwise.observe.LABELS``), and
    memory.py attributes what they allocate by those labels, not by file names."""
    from dist_utils import run_distributed
    from shardwise.observe import PREFIX

    per_rank = run_distributed(labelled_step_worker, 4, timeout=150)
    for found in per_rank:
        for name in ("unsharded", "gather", "copy-out", "post-forward part", "reduce"):
            assert PREFIX + name in found, f"no {name!r} scope in the profile: {sorted(found)}"
        want = {
            "unsharded": "gathered_params",
            "post-forward part": "gathered_params",
            "gather": "comm_buffers",
            "reduce": "comm_buffers",
        }
        for name, part in want.items():
            count, nbytes = found[PREFIX + name]
            assert nbytes > 0, f"{name}: {count} scopes allocated nothing"
            assert memory.classify([], "forward", PREFIX + name) == part, name
    # Outside a profiler the scopes are not opened at all.
    from shardwise.layout.labels import _NO_LABEL, label

    assert label("gather") is _NO_LABEL
