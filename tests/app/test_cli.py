"""The ``shardwise`` command line, end to end, as a person runs it: in subprocesses.

Every training run here uses 2 CPU processes (gloo) and a shrunken batch so
the whole file stays within a few minutes on a 2-core machine. One reference
run (the module fixture) serves the file checks, the resume comparison, the
wrong-model-size check, ``sample`` and the damaged-checkpoint tests. What
users do to a running job (signals, kill -9, a full disk, two writers) is in
test_cli_failures.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_helpers import FAST, checkpoints, env, rows, shardwise

_env = env


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted run; several tests read it, none writes to it."""
    cwd = tmp_path_factory.mktemp("reference")
    # Three checkpoints: the damaged-checkpoint tests fall back from one to the next.
    r = shardwise("train", *FAST, "--nproc", "2", "--save-every", "8", "--out", "run", cwd=cwd)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "done: 24 steps in " in r.stdout  # a run from the start: no "from -> to"
    return cwd / "run"


# ---- the happy path -------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_train_writes_the_run_folder_and_learns(reference: Path) -> None:
    written = {p.name for p in reference.iterdir()}
    assert {"config.json", "metrics.jsonl", "loss.png", "throughput.png", "summary.json"} <= written
    assert {"timeline.json", "timeline.png", "checkpoints"} <= written
    config = json.loads((reference / "config.json").read_text())
    assert config["world_size"] == 2 and config["model"] == "tiny" and config["seq_len"] == 64
    metrics = rows(reference)
    assert [r["step"] for r in metrics] == list(range(1, 25))
    for r in metrics:
        assert {"step", "loss", "tokens_per_s", "peak_mem_bytes"} <= r.keys()
        assert r["tokens_per_s"] > 0 and r["peak_mem_bytes"] > 0
    assert [r["step"] for r in metrics if "val_loss" in r] == [8, 16, 24]
    first, last = metrics[0]["loss"], sum(r["loss"] for r in metrics[-4:]) / 4
    assert last < first - 1.0, f"loss did not decrease: {first:.3f} -> {last:.3f}"
    vals = [r["val_loss"] for r in metrics if "val_loss" in r]
    assert vals[-1] < vals[0]
    assert checkpoints(reference) == ["step_000008", "step_000016", "step_000024"]
    assert (reference / "checkpoints" / "step_000024" / ".metadata").is_file()
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["steps_done"] == 24 and not summary["stopped_early"]
    assert summary["timeline"]["step"] == 2 and summary["timeline"]["collectives"]["all_gather"]
    assert json.loads((reference / "timeline.json").read_text())["traceEvents"]


@pytest.mark.timeout(180)
def test_interrupt_saves_and_resume_repeats_the_losses(reference: Path, tmp_path: Path) -> None:
    """Ctrl-C mid-run: exit 0 with a checkpoint; --resume then gives the very same losses."""
    cmd = [sys.executable, "-m", "shardwise", "train", *FAST, "--nproc", "2", "--out", "run"]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "stopped by SIGINT" in out
    stopped = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert stopped["stopped_early"] and stopped["steps_done"] < 24, out
    assert checkpoints(tmp_path / "run") == [f"step_{stopped['steps_done']:06d}"]

    r = shardwise("train", "--resume", "run", "--nproc", "2", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"resumed at step {stopped['steps_done']}" in r.stdout
    # The steps this launch took, and where the run stands.
    at = stopped["steps_done"]
    assert f"done: {24 - at} steps ({at} -> 24) in " in r.stdout
    resumed, expected = rows(tmp_path / "run"), rows(reference)
    assert [r["step"] for r in resumed] == list(range(1, 25))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in expected]
    assert [r.get("val_loss") for r in resumed] == [r.get("val_loss") for r in expected]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nproc", ["1", "2"])
def test_sample_prints_a_continuation(reference: Path, nproc: str) -> None:
    r = shardwise(
        "sample",
        "--ckpt",
        str(reference),
        "--prompt",
        "def ",
        "--tokens",
        "16",
        "--nproc",
        nproc,
        cwd=reference.parent,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    # What sample must print: the prompt and the 16 bytes the run's latest checkpoint
    # samples after it at the defaults (seed 0, temperature 0.8, top-k 40), decoded as
    # sample decodes them, then a newline; computed here in one process from the
    # checkpoint itself. At 2 ranks every rank samples the same tokens (same seed).
    assert r.stdout == _expected_sample(reference / "checkpoints" / "step_000024") + "\n"
    source = [line for line in r.stderr.splitlines() if line.startswith("# ")]
    assert source == [f"# tiny at step 24, from {reference / 'checkpoints' / 'step_000024'}"], (
        r.stderr
    )


def _expected_sample(ckpt: Path) -> str:
    import warnings

    import torch

    from shardwise import checkpoint
    from shardwise_app.models.gpt import GPT, GPTConfig, generate

    config = json.loads((ckpt.parent.parent / "config.json").read_text())
    cfg = GPTConfig(**config["model_config"])
    model = GPT(cfg)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        checkpoint.load(str(ckpt), model)
    model.eval()
    prompt = torch.tensor([list(b"def ")])
    with torch.no_grad():
        out = generate(
            model,
            prompt,
            16,
            seq_len=cfg.seq_len,
            temperature=0.8,
            top_k=40,
            generator=torch.Generator().manual_seed(0),
        )
    assert out.shape == (1, 4 + 16)
    return bytes(out[0].tolist()).decode("utf-8", errors="replace")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("status", "code", "stderr"), [(0, 0, "err"), (3, 3, "err"), (None, 0, "err"), ("no", 1, "no")]
)
def test_a_worker_ends_with_its_output_and_without_finalization(
    status: object, code: int, stderr: str
) -> None:
    """A finished worker skips interpreter finalization, the stage whose race with
    gloo's threads aborted successful runs (cli/worker.py ``end``), and loses no output."""
    script = (
        "import atexit, sys\n"
        "from shardwise_app.cli.worker import end\n"
        "atexit.register(lambda: print('finalized', flush=True))\n"
        "print('out', end='')\n"
        "sys.stderr.write('err')\n"
        f"end({status!r})\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=50)
    assert r.returncode == code
    assert r.stdout == "out"  # flushed, and no atexit handler ran
    assert stderr in r.stderr


@pytest.mark.timeout(150)
def test_compile_gives_the_uncompiled_losses(reference: Path, tmp_path: Path) -> None:
    """--compile (aot_eager on CPU): the reference run's first steps, with compiled blocks.

    With --steps 3 and the reference's warmup of 2, steps 1-3 see the same
    learning rates (each loss is taken before its step's update).
    """
    short = ["--steps", "3", "--warmup", "2", *FAST[2:]]
    r = shardwise("train", *short, "--compile", "--nproc", "2", "--out", "run", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((tmp_path / "run" / "config.json").read_text())["compile"] is True
    got = [row["loss"] for row in rows(tmp_path / "run")]
    want = [row["loss"] for row in rows(reference)][:3]
    assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.timeout(150)
def test_torchrun_direct_with_hsdp_accumulation_checkpointing_bf16(tmp_path: Path) -> None:
    """The same entry under torchrun itself, with the flags a plain run does not touch."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        "-m",
        "shardwise",
        "train",
        "--steps",
        "3",
        "--batch-size",
        "8",
        "--seq-len",
        "32",
        "--hsdp",
        "2",
        "--grad-accum",
        "2",
        "--activation-checkpointing",
        "reentrant",
        "--mixed-precision",
        "bf16",
        "--out",
        "run",
    ]
    env = _env() | {"OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=140)
    assert r.returncode == 0, r.stdout + r.stderr
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["world_size"] == 4 and config["hsdp"] == 2
    assert [r["step"] for r in rows(tmp_path / "run")] == [1, 2, 3]
    assert checkpoints(tmp_path / "run") == ["step_000003"]


@pytest.mark.timeout(90)
def test_torchrun_direct_bad_input_is_one_line(tmp_path: Path) -> None:
    """Under torchrun, rank 0 checks the flags (cli/main.py's ``from_rank0``): one
    error line from it, the other ranks quiet, nothing written."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "shardwise", "train", "--hsdp", "3", "--out", "run"]
    env = _env() | {"OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=80)
    assert r.returncode != 0  # torchrun's own report of the failed ranks follows
    errors = [line for line in r.stderr.splitlines() if line.startswith("shardwise train")]
    assert errors == ["shardwise train: error: --hsdp 3 does not divide the 2 processes"], r.stderr
    assert "exitcode  : 2" in r.stderr and "ValueError" not in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(180)
def test_help_and_bench_side_by_side(tmp_path: Path) -> None:
    r = shardwise("--help", cwd=tmp_path)
    assert r.returncode == 0 and "train" in r.stdout and "sample" in r.stdout
    r = shardwise(
        "bench",
        "--device",
        "cpu",
        "--model",
        "tiny",
        "--nproc",
        "2",
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--rounds",
        "1",
        "--json",
        "bench.json",
        "--plot",
        "bench.png",
        cwd=tmp_path,
        timeout=170,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads((tmp_path / "bench.json").read_text())
    by_config = {row["config"]: row for row in result["rows"]}
    assert set(by_config) == {"fsdp2", "shardwise"}  # no bare model at 2 ranks
    ours = by_config["shardwise"]
    assert ours["step_ms"] > 0 and ours["peak_gib"] > 0 and ours["tokens_per_s"] > 0
    assert ours["step_vs_fsdp2"] == pytest.approx(ours["step_ms"] / by_config["fsdp2"]["step_ms"])
    assert "step_vs_fsdp2" in r.stdout  # the table
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    r = shardwise("bench", "--model", "huge", cwd=tmp_path)
    assert r.returncode == 2 and "unknown --model 'huge'" in r.stderr


# ---- bad input: one line on stderr, exit code 2, nothing written ----------------------------


def _bad(args: list[str], cwd: Path) -> str:
    r = shardwise(*args, cwd=cwd, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stdout + r.stderr
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "args, message",
    [
        (["--data", "no/such/file.txt"], "--data no/such/file.txt: no such file or folder"),
        (["--nproc", "10000"], "--nproc 10000 is more than"),
        (["--nproc", "2", "--hsdp", "3"], "--hsdp 3 does not divide the 2 processes"),
        (["--resume", "."], "not a checkpoint"),
        (["--hf", "no/such/model"], "--hf no/such/model: no such folder"),
    ],
)
def test_bad_input(args: list[str], message: str, tmp_path: Path) -> None:
    line = _bad(["train", *args, "--out", "never"], tmp_path)
    assert message in line
    assert not (tmp_path / "never").exists()


@pytest.mark.timeout(60)
def test_resume_of_another_model_size(reference: Path, tmp_path: Path) -> None:
    before = {p: p.stat().st_mtime_ns for p in reference.rglob("*")}
    line = _bad(["train", "--resume", str(reference), "--model", "small"], tmp_path)
    assert "the checkpoint is of model 'tiny'" in line and "--model small" in line
    assert {p: p.stat().st_mtime_ns for p in reference.rglob("*")} == before


@pytest.mark.timeout(60)
def test_sample_of_a_folder_that_is_no_checkpoint(tmp_path: Path) -> None:
    line = _bad(["sample", "--ckpt", str(tmp_path)], tmp_path)
    assert "not a checkpoint" in line


@pytest.mark.timeout(60)
def test_resume_with_no_step_left_says_where_the_run_is(reference: Path, capsys) -> None:
    """--steps at or below the run's step: one true line, exit 2, no schedule note
    before it, the run folder untouched."""
    from shardwise_app.cli.main import main

    before = {p: p.stat().st_mtime_ns for p in reference.rglob("*")}
    assert main(["train", "--resume", str(reference), "--steps", "10", "--nproc", "2"]) == 2
    assert capsys.readouterr().err == (
        f"shardwise train: error: --resume {reference}: the run is already at step 24, "
        "past --steps 10; pass a larger --steps to train further\n"
    )
    assert main(["train", "--resume", str(reference), "--nproc", "2"]) == 2
    assert capsys.readouterr().err == (
        f"shardwise train: error: --resume {reference}: the run is already at step 24, "
        "its last (--steps 24); pass a larger --steps to train further\n"
    )
    assert {p: p.stat().st_mtime_ns for p in reference.rglob("*")} == before


@pytest.mark.timeout(60)
def test_export_of_a_gpt_run_is_refused(reference: Path, tmp_path: Path, capsys) -> None:
    from shardwise_app.cli.main import main

    assert main(["export", "--ckpt", str(reference), "--out", str(tmp_path / "never")]) == 2
    err = capsys.readouterr().err
    assert "a run of the built-in GPT" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "never").exists()


# ---- the pieces the CLI is built from (in process, no subprocess needed) ---------------------


@pytest.mark.timeout(60)
def test_each_rank_reads_its_slice_of_the_same_global_batch() -> None:
    import torch

    from shardwise_app.data import BatchSampler

    data = torch.arange(1000, dtype=torch.int64).to(torch.uint8)

    def global_batch(world: int, accum: int, step: int) -> list[list[int]]:
        rows = []
        for rank in range(world):
            s = BatchSampler(
                data, seq_len=8, batch_size=8, seed=3, rank=rank, world=world, grad_accum=accum
            )
            for k in range(accum):
                rows += s.batch(step, k)[0].tolist()
        return sorted(rows)

    assert global_batch(1, 1, 5) == global_batch(2, 2, 5) == global_batch(4, 2, 5)
    assert global_batch(2, 1, 5) != global_batch(2, 1, 6)


def test_run_config_reads_and_writes_config_json_as_it_was() -> None:
    """config.json field for field, in its order, for a run of the built-in GPT (no
    hf_weights key) and of --hf; an older run's, without later keys, still reads."""
    from shardwise_app.cli.run_config import RunConfig

    gpt = {
        **{"model": "tiny", "steps": 3, "batch_size": 4, "seq_len": 32, "lr": 0.002},
        **{"warmup": 0, "grad_clip": 1.0, "grad_accum": 1, "hsdp": 1},
        **{"activation_checkpointing": "none", "mixed_precision": "none", "data": None},
        **{"seed": 1337, "eval_every": 20, "eval_batches": 4, "save_every": 0},
        **{"compile": False, "hf": None, "lora": None, "lora_alpha": None},
        **{"lora_targets": None, "adapter_only": None},
        "model_config": {"vocab_size": 256, "seq_len": 32, "n_layer": 4, "n_head": 4},
        **{"world_size": 2, "device": "cpu", "out": "/tmp/run", "resume": None},
        **{"resume_step": 0, "resumed_metrics": None, "corpus": {"sha256": "3e6f"}},
        **{"torch_version": "2.13.0+cpu", "shardwise_version": "0.1.0", "launch_id": "afcb"},
    }
    config = RunConfig.from_json(gpt)
    assert list(config.to_json().items()) == list(gpt.items())
    assert config.lr_at(3) == pytest.approx(0.0002) and config.micro_batch == 2
    hf: dict = {}
    for k, v in gpt.items():  # hf_weights comes just before model_config
        if k == "model_config":
            hf["hf_weights"], v = {"model.safetensors": [1, 2]}, {"model_type": "llama"}
        hf[k] = v
    hf.update(model="llama", hf="/m", adapter_only=False)
    assert list(RunConfig.from_json(hf).to_json().items()) == list(hf.items())
    older = {k: v for k, v in gpt.items() if k not in ("compile", "corpus", "launch_id")}
    assert RunConfig.from_json({**older, "gone": 1}).compile is False


@pytest.mark.timeout(60)
def test_default_corpus_and_model_sizes() -> None:
    import torch

    from shardwise_app.data import load_corpus
    from shardwise_app.models import GPT, SIZES, num_params

    a, b = load_corpus(), load_corpus()
    assert a.sha256 == b.sha256 and 1_000_000 < a.train.numel() + a.val.numel() <= 4 * 2**20
    assert a.val.numel() < a.train.numel() / 10
    with torch.device("meta"):
        assert 0.9e9 <= num_params(GPT(SIZES["medium"])) <= 1.1e9
    model = GPT(SIZES["tiny"])  # unsharded, no process group
    assert model(torch.zeros(2, 16, dtype=torch.long)).shape == (2, 16, 256)


# ---- damaged checkpoints: verified before anything changes (issue 15, item 5) ---------------


def _copy_run(reference: Path, tmp_path: Path) -> Path:
    import shutil

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    return run


def _snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in run.rglob("*") if p.is_file()}


def _truncate_a_shard(ckpt: Path) -> Path:
    shard = sorted(ckpt.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return shard


@pytest.mark.timeout(60)
def test_a_damaged_checkpoint_named_by_the_user_is_refused(reference: Path, tmp_path: Path):
    run = _copy_run(reference, tmp_path)
    shard = _truncate_a_shard(run / "checkpoints" / "step_000024")
    (run / "checkpoints" / "step_000016" / ".metadata").write_bytes(b"junk, not a pickle")
    before = _snapshot(run)
    line = _bad(["train", "--resume", str(run / "checkpoints" / "step_000024")], tmp_path)
    assert f"{shard.name} is truncated" in line and "the checkpoint is damaged" in line
    line = _bad(["sample", "--ckpt", str(run / "checkpoints" / "step_000016")], tmp_path)
    assert "step_000016/.metadata is truncated" in line  # its checksum's length, checked first
    assert _snapshot(run) == before  # config.json and metrics.jsonl untouched


@pytest.mark.timeout(150)
def test_resume_falls_back_past_a_damaged_checkpoint(reference: Path, tmp_path: Path) -> None:
    """A truncated latest shard: say so, resume from the one before, same losses as ever."""
    run = _copy_run(reference, tmp_path)
    shard = _truncate_a_shard(run / "checkpoints" / "step_000024")
    r = shardwise("train", "--resume", "run", "--nproc", "2", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    warning, *notes = r.stderr.strip().splitlines()
    assert f"{shard.name} is truncated" in warning and "using step_000016 instead" in warning
    assert notes == [
        "note: step_000024 is from the run this one replaces (resumed at step 16); "
        "kept as step_000024.replaced"
    ]
    assert "resumed at step 16" in r.stdout
    assert [row["loss"] for row in rows(run)] == [row["loss"] for row in rows(reference)]


def _flip_bytes_of_a_shard(ckpt: Path) -> Path:
    """Bit rot or a bad copy: a few bytes inverted, the length unchanged (DCP cannot tell)."""
    shard = sorted(ckpt.glob("*.distcp"))[-1]
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    shard.write_bytes(bytes(data))
    return shard


@pytest.mark.timeout(200)
def test_resume_passes_over_flipped_bytes_to_the_previous_checkpoint(
    reference: Path, tmp_path: Path
) -> None:
    """The checksums name the damaged shard; the run resumes from the one before, with
    the losses of the uninterrupted run; with every checkpoint damaged it refuses."""
    run = _copy_run(reference, tmp_path)
    shard = _flip_bytes_of_a_shard(run / "checkpoints" / "step_000024")
    line = _bad(["sample", "--ckpt", str(shard.parent), "--tokens", "4"], tmp_path)
    assert f"{shard} is damaged: its bytes are not those saved" in line
    r = shardwise("train", "--resume", "run", "--nproc", "2", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    warning = r.stderr.strip().splitlines()[0]
    named = f"warning: run/checkpoints/step_000024/{shard.name} is damaged: its bytes are not"
    assert warning.startswith(named), warning
    assert warning.endswith("; using step_000016 instead")
    assert "resumed at step 16" in r.stdout
    assert [row["loss"] for row in rows(run)] == [row["loss"] for row in rows(reference)]

    for step in ("000008", "000016", "000024"):
        _flip_bytes_of_a_shard(run / "checkpoints" / f"step_{step}")
    line = _bad(["train", "--resume", "run", "--steps", "30", "--nproc", "2"], tmp_path)
    assert line.startswith("shardwise train: error: --resume run: every checkpoint is damaged")
    assert "step_000024" in line and "its bytes are not those saved" in line


@pytest.mark.timeout(180)
def test_resume_from_an_older_checkpoint_replaces_the_later_ones(
    reference: Path, tmp_path: Path
) -> None:
    """Back to step 8 (after a divergence, say), run on to 12, stop: the next
    --resume of the run continues from step 12, not from the abandoned 24; the
    abandoned checkpoints are kept aside, never deleted."""
    run = _copy_run(reference, tmp_path)
    back = str(run / "checkpoints" / "step_000008")
    r = shardwise("train", "--resume", back, "--steps", "12", "--nproc", "2", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "kept as step_000016.replaced" in r.stderr and "kept as step_000024.replaced" in r.stderr
    assert "note: --steps 12 differs from the resumed run's 24: from step 8 on" in r.stderr
    assert checkpoints(run) == [
        "step_000008",
        "step_000012",
        "step_000016.replaced",
        "step_000024.replaced",
    ]
    assert (run / "checkpoints" / "step_000024.replaced" / ".metadata").is_file()
    assert "done: 4 steps (8 -> 12) in " in r.stdout
    r = shardwise("train", "--resume", "run", "--steps", "16", "--nproc", "2", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resumed at step 12" in r.stdout and "done: 4 steps (12 -> 16) in " in r.stdout
    assert [row["step"] for row in rows(run)] == list(range(1, 17))


@pytest.mark.timeout(150)
def test_training_goes_on_when_its_output_is_closed(tmp_path: Path) -> None:
    """``shardwise train ... | head -1``: the reader goes, the run finishes and saves."""
    cmd = [sys.executable, "-m", "shardwise", "train", *FAST, "--nproc", "2", "--out", "run"]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    proc.stdout.readline()
    proc.stdout.close()  # what head -1 does after its line
    _, err = proc.communicate(timeout=140)
    assert proc.returncode == 0, err
    assert checkpoints(tmp_path / "run") == ["step_000024"]
    assert [row["step"] for row in rows(tmp_path / "run")] == list(range(1, 25))
