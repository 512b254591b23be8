"""``shardwise train --hf``: a real transformers model from disk, fine-tuned on 2 gloo ranks.

Two tiny models built from random configs (a Llama with its own head, a
Qwen2 with the head tied to the embedding) and a small BPE tokenizer trained
here, offline, are saved with ``save_pretrained`` into a temporary folder.
Each is fine-tuned once through the command line, as a person runs it (full
fine-tune with non-reentrant checkpointing and ``--compile``; LoRA with
reentrant checkpointing and ``--adapter-only``); several tests read each
run. What does not need workers (bad input, ``export``, ``sample``,
single-process references) runs in this process: every worker pays seconds
to import transformers.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from cli_helpers import rows, shardwise

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

STEPS = 16
RUN = [
    *("--steps", str(STEPS), "--batch-size", "8", "--seq-len", "32"),
    *("--warmup", "2", "--eval-every", "8", "--save-every", "8", "--nproc", "2"),
]
TARGETS = ["q_proj", "v_proj", "down_proj"]


def corpus_docs() -> dict[str, str]:
    """Real prose and code that needs no download: two standard library modules."""
    import inspect
    import textwrap

    return {
        "a_textwrap.py": Path(textwrap.__file__).read_text(),
        "b_inspect.py": Path(inspect.__file__).read_text()[:40_000],
    }


def make_tokenizer(text: str, folder: Path) -> Any:
    """A byte-level BPE of 320 tokens trained on ``text`` in this process (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.save_pretrained(folder)
    return fast


def make_model(arch: str, folder: Path, vocab: int) -> None:
    import transformers as tf

    torch.manual_seed(0)
    shape = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=64,
        eos_token_id=0,
        bos_token_id=None,
        pad_token_id=None,
    )
    if arch == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(tie_word_embeddings=False, **shape))
    else:
        # Larger initial weights: adapters on a near-zero random model (head
        # tied to a near-zero embedding) cannot move its logits far.
        model = tf.Qwen2ForCausalLM(
            tf.Qwen2Config(tie_word_embeddings=True, initializer_range=0.2, **shape)
        )
    model.save_pretrained(folder)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    root = tmp_path_factory.mktemp("hf")
    data = root / "corpus"
    data.mkdir()
    docs = corpus_docs()
    for name, text in docs.items():
        (data / name).write_text(text)
    out = {"root": root, "data": data}
    for arch in ("llama", "qwen2"):
        tok = make_tokenizer("\n\n".join(docs.values()), root / arch)
        make_model(arch, root / arch, len(tok))
        out[arch] = root / arch
    return out


def train(folders: dict[str, Path], name: str, *args: str) -> Path:
    r = shardwise(
        "train", "--data", str(folders["data"]), *args, "--out", name, cwd=folders["root"]
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return folders["root"] / name


@pytest.fixture(scope="module")
def full_run(folders: dict[str, Path]) -> Path:
    return train(
        folders,
        "full",
        *("--hf", str(folders["llama"]), *RUN, "--lr", "1e-2"),
        *("--activation-checkpointing", "non-reentrant", "--compile"),
    )


@pytest.fixture(scope="module")
def lora_run(folders: dict[str, Path]) -> Path:
    """Its end-of-run export is the adapter alone, gathered from 2 ranks."""
    return train(
        folders,
        "lora",
        *("--hf", str(folders["qwen2"]), *RUN, "--lr", "5e-2"),
        *("--activation-checkpointing", "reentrant", "--adapter-only"),
        *("--lora", "4", "--lora-alpha", "8", "--lora-targets", ",".join(TARGETS)),
    )


@pytest.fixture(scope="module")
def lora_merged(lora_run: Path, folders: dict[str, Path]) -> Path:
    """``shardwise export`` of the LoRA run, merged, by one process (this one)."""
    from shardwise_app.cli.main import main

    out = folders["root"] / "lora_merged"
    assert main(["export", "--ckpt", str(lora_run), "--out", str(out)]) == 0
    return out


def checkpoint_tensors(ckpt: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """Everything a DCP checkpoint holds, read by torch itself (not by shardwise)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(ckpt, tmp_path / "ckpt.pt")
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}{k}.", v)
        elif isinstance(value, torch.Tensor):
            flat[prefix[:-1]] = value

    walk("", torch.load(tmp_path / "ckpt.pt", weights_only=False))
    return flat


def from_pretrained(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def losses(run: Path, key: str = "loss") -> list[float]:
    return [r[key] for r in rows(run) if key in r]


def cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``shardwise ARGS`` in this process (transformers is imported here already)."""
    from shardwise_app.cli.main import main

    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


# ---- the data: the model's tokenizer, documents packed with EOS between them ----------------


@pytest.mark.timeout(60)
def test_data_is_tokenized_and_packed_with_eos(folders: dict[str, Path]) -> None:
    from shardwise_app.data import load_corpus
    from shardwise_app.models.hf import load_tokenizer

    tok = load_tokenizer(folders["llama"])
    corpus = load_corpus(str(folders["data"]), min_split_bytes=33, tokenizer=tok)
    stream = torch.cat([corpus.train, corpus.val]).tolist()
    docs = [tok(t, add_special_tokens=False)["input_ids"] for t in corpus_docs().values()]
    assert stream == docs[0] + [tok.eos_token_id] + docs[1] + [tok.eos_token_id]
    assert corpus.unit == "tokens" and corpus.val.numel() == int(len(stream) * 0.05)


# ---- a full fine-tune: parity with one process, the export, sample ---------------------------


def one_process_reference(folders: dict[str, Path], run: Path) -> tuple[list[float], Any]:
    """The run's recipe on one process, from ``from_pretrained``, uncompiled, on the whole batch."""
    from shardwise_app.cli.run_config import RunConfig
    from shardwise_app.data import BatchSampler, load_corpus
    from shardwise_app.models.hf import load_tokenizer

    cfg = RunConfig.read(run / "config.json")
    model = from_pretrained(folders["llama"]).train()
    corpus = load_corpus(cfg.data, min_split_bytes=33, tokenizer=load_tokenizer(cfg.hf))
    sampler = BatchSampler(corpus.train, seq_len=32, batch_size=8, seed=cfg.seed)
    params = list(model.parameters())
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    out = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: intra-op threads only wait for each other
    try:
        for step in range(1, STEPS + 1):
            for group in opt.param_groups:
                group["lr"] = cfg.lr_at(step)
            x, y = sampler.batch(step)
            loss = F.cross_entropy(model(input_ids=x).logits.float().flatten(0, 1), y.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    return out, model


@pytest.mark.timeout(240)
def test_full_finetune_learns_and_matches_one_process(full_run: Path, folders) -> None:
    """2 ranks, sharded, loaded shard by shard, checkpointed and compiled: one process's losses."""
    written = {p.name for p in full_run.iterdir()}
    assert {"config.json", "metrics.jsonl", "loss.png", "throughput.png", "summary.json"} <= written
    assert {"timeline.json", "timeline.png", "checkpoints", "export"} <= written
    summary = json.loads((full_run / "summary.json").read_text())
    assert summary["tokens_per_s"] > 0 and summary["peak_mem_bytes"] > 0
    assert summary["export"] == str(full_run / "export")
    got = losses(full_run)
    assert [r["step"] for r in rows(full_run)] == list(range(1, STEPS + 1))
    assert sum(got[-4:]) / 4 < got[0] - 0.5, got
    want, _ = one_process_reference(folders, full_run)
    # The first loss is the loaded model's: the sharded load is exact.
    assert got[0] == pytest.approx(want[0], rel=1e-6)
    assert got == pytest.approx(want, rel=2e-4), (got, want)


@pytest.mark.timeout(120)
def test_full_finetune_export_is_the_checkpoint(full_run: Path, tmp_path: Path) -> None:
    exported = from_pretrained(full_run / "export")
    saved = checkpoint_tensors(full_run / "checkpoints" / f"step_{STEPS:06d}", tmp_path)
    weights = {k: v for k, v in exported.state_dict().items()}
    model_keys = {k[len("model.") :] for k in saved if k.startswith("model.")}
    assert model_keys == set(weights)
    for key, value in weights.items():
        assert torch.equal(value, saved["model." + key]), key
    assert (full_run / "export" / "tokenizer.json").is_file()


@pytest.mark.timeout(120)
def test_sample_uses_the_models_tokenizer(full_run: Path, capsys) -> None:
    code, out, err = cli(
        ["sample", "--ckpt", str(full_run), "--prompt", "def ", "--tokens", "12"], capsys
    )
    assert code == 0, err
    assert out.startswith("def ") and len(out.strip()) > len("def ")
    assert f"at step {STEPS}" in err


# ---- LoRA: only adapters train and are saved; merged and adapter exports; exact resume -------


@pytest.mark.timeout(240)
def test_lora_learns_and_saves_only_adapters(lora_run: Path, tmp_path: Path) -> None:
    got = losses(lora_run)
    assert sum(got[-4:]) / 4 < got[0] - 0.3, got
    saved = checkpoint_tensors(lora_run / "checkpoints" / f"step_{STEPS:06d}", tmp_path)
    model_keys = [k for k in saved if k.startswith("model.")]
    assert len(model_keys) == 2 * len(TARGETS) * 2  # A and B, per target, per layer
    assert all(".lora_A." in k or ".lora_B." in k for k in model_keys), model_keys
    moments = [k for k in saved if k.startswith("optim.state.")]
    assert moments and all(".lora_A." in k or ".lora_B." in k for k in moments), moments


@pytest.mark.timeout(120)
def test_lora_export_is_base_plus_adapters(lora_merged: Path, lora_run, folders, tmp_path) -> None:
    """Merged export = untouched base + scaling * B @ A for the targets; the base never moved."""
    base = from_pretrained(folders["qwen2"]).state_dict()
    merged = from_pretrained(lora_merged).state_dict()
    saved = checkpoint_tensors(lora_run / "checkpoints" / f"step_{STEPS:06d}", tmp_path)
    assert set(merged) == set(base)
    merged_targets = 0
    for key, w0 in base.items():
        module = key.removesuffix(".weight")
        if key.endswith(".weight") and module.rsplit(".", 1)[-1] in TARGETS:
            prefix = f"model.base_model.model.{module}"
            a = saved[f"{prefix}.lora_A.default.weight"]
            b = saved[f"{prefix}.lora_B.default.weight"]
            torch.testing.assert_close(merged[key], w0 + (8 / 4) * b @ a, rtol=1e-6, atol=1e-6)
            assert not torch.equal(merged[key], w0), f"{key}: the adapter did not train"
            merged_targets += 1
        else:
            assert torch.equal(merged[key], w0), f"frozen {key} changed"
    assert merged_targets == len(TARGETS) * 2


@pytest.mark.timeout(120)
def test_adapter_export_loads_in_peft(lora_run: Path, lora_merged: Path, folders, capsys) -> None:
    """The run's own export (--adapter-only, 2 ranks): PEFT's adapter = the merged model."""
    from peft import PeftModel

    adapter = lora_run / "export"
    assert {p.name for p in adapter.iterdir()} == {
        "adapter_config.json",
        "adapter_model.safetensors",
    }
    peft_model = PeftModel.from_pretrained(from_pretrained(folders["qwen2"]), adapter).eval()
    merged = from_pretrained(lora_merged).eval()
    ids = torch.arange(40).reshape(2, 20) * 7 % 320
    with torch.no_grad():
        torch.testing.assert_close(
            peft_model(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=1e-5, atol=1e-5
        )
    code, _, err = cli(["export", "--ckpt", str(lora_run), "--out", str(lora_merged)], capsys)
    assert code == 2 and "already holds files" in err and len(err.strip().splitlines()) == 1


@pytest.mark.timeout(240)
def test_lora_resume_repeats_the_losses(lora_run: Path, folders) -> None:
    copy = folders["root"] / "lora_resumed"
    shutil.copytree(lora_run, copy)
    r = shardwise(
        "train", "--resume", str(copy / "checkpoints" / "step_000008"), "--nproc", "2", cwd=copy
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resumed at step 8" in r.stdout
    assert losses(copy) == losses(lora_run)
    assert losses(copy, "val_loss") == losses(lora_run, "val_loss")


@pytest.mark.timeout(120)
def test_resume_refuses_base_weights_that_changed(full_run: Path, folders, tmp_path, capsys):
    """The base model's weights changed (trained on elsewhere), its config.json did not:
    one line, exit code 2, nothing written."""
    from safetensors.torch import load_file, save_file

    from shardwise_app.models.hf import weights_fingerprint

    base, run = tmp_path / "base", tmp_path / "run"
    shutil.copytree(folders["llama"], base)
    shutil.copytree(full_run, run)
    cfg = json.loads((run / "config.json").read_text())
    assert weights_fingerprint(base) == cfg["hf_weights"]  # a copy: the same weights
    (run / "config.json").write_text(json.dumps({**cfg, "hf": str(base.resolve())}))
    config_json = (base / "config.json").read_bytes()
    weights = load_file(base / "model.safetensors")
    save_file({k: v + 1e-3 for k, v in weights.items()}, base / "model.safetensors")
    assert (base / "config.json").read_bytes() == config_json
    before = {str(p): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    code, _, err = cli(["train", "--resume", str(run), "--nproc", "2"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert (
        f"the base weights in {base.resolve()} changed since the run started "
        "(model.safetensors differs)" in err
    )
    assert {str(p): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


# ---- bad input: one line, exit code 2, nothing written ---------------------------------------


def _no_weights(folders: dict[str, Path]) -> str:
    folder = folders["root"] / "no_weights"
    if not folder.exists():
        folder.mkdir()
        for f in folders["llama"].iterdir():
            if not f.name.endswith(".safetensors"):
                shutil.copy(f, folder / f.name)
    return str(folder)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "args, message",
    [
        (["--hf", "{root}/nowhere"], "--hf {root}/nowhere: no such folder"),
        (["--hf", "{root}/corpus"], "no config.json"),
        (["--hf", "{no_weights}"], "no model.safetensors nor model.safetensors.index.json"),
        (["--lora", "4"], "--lora needs --hf PATH"),
        (["--hf", "{llama}", "--adapter-only"], "--adapter-only needs --lora R"),
        (["--hf", "{llama}", "--model", "tiny"], "give only one"),
        (["--hf", "{llama}", "--seq-len", "65"], "longer than the model's context (64 tokens)"),
        (["--hf", "{llama}", "--lora", "0"], "--lora must be at least 1"),
        (
            ["--hf", "{qwen2}", "--lora", "4", "--lora-targets", "q_proj, lm_head"],
            "--lora-targets lm_head: this model ties its output head",
        ),
    ],
)
def test_bad_input(args: list[str], message: str, folders, tmp_path: Path, capsys) -> None:
    names = {k: str(v) for k, v in folders.items()} | {"no_weights": _no_weights(folders)}
    args = [a.format(**names) for a in args]
    code, out, err = cli(["train", *args, "--nproc", "2", "--out", str(tmp_path / "never")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert message.format(**names) in err
    assert not (tmp_path / "never").exists()


@pytest.mark.timeout(60)
def test_missing_extra_says_how_to_install(folders, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "peft", None)  # what an absent package looks like to import
    args = ["train", "--hf", str(folders["llama"]), "--out", str(tmp_path / "never")]
    code, _, err = cli(args, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "peft is not installed" in err and "pip install 'shardwise[hf]'" in err
    assert not (tmp_path / "never").exists()


@pytest.mark.timeout(60)
def test_transformers_before_5_says_how_to_install(folders, tmp_path, capsys, monkeypatch) -> None:
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata, "version", lambda n: "4.57.1" if n == "transformers" else real(n)
    )
    args = ["train", "--hf", str(folders["llama"]), "--out", str(tmp_path / "never")]
    code, _, err = cli(args, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "transformers 5 or later (this has 4.57.1)" in err and "shardwise[hf]" in err
    assert not (tmp_path / "never").exists()
