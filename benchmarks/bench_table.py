"""Regenerate the rows of docs/benchmarks.md's table that this machine can run.

    python benchmarks/bench_table.py [--machine cpu|gpu1|gpu2] [--out DIR] [--dry-run]

Each row of the table cites one JSON file of ``docs/bench/``; each file is one
``shardwise bench`` invocation, listed in ``ROWS`` under the machine it needs:
``gpu2`` (two GPUs of one host), ``gpu1`` (one GPU) or ``cpu`` (gloo ranks on
the CPU; the table's were taken on a 2-core machine). Without ``--machine``
the kind is this machine's: two or more GPUs, one, or none. The invocations
run one after the other, each writing ``DIR/<file>`` (default ``docs/bench``);
``--dry-run`` prints them instead. The transformers models are built from the
configs in ``HF_CONFIGS`` (random weights, nothing downloaded), written to a
temporary folder first.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# Shapes of the ``hf:`` rows. llama_1b: Llama-3.2-1B's (1,235,814,400 parameters,
# tied head); w1024_llama4: a 4-layer Llama of width 1024 (51.9M parameters).
HF_CONFIGS: dict[str, dict[str, object]] = {
    "llama_1b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    },
    "w1024_llama4": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "vocab_size": 256,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    },
}

BOTH = ["--configs", "fsdp2,shardwise"]
GPU = ["--device", "cuda", "--mp", "bf16", *BOTH]
LARGE_1 = [*GPU, "--nproc", "1", "--model", "large", "--batch-size", "2", "--ac", "non-reentrant"]
MEDIUM_2 = [*GPU, "--nproc", "2", "--model", "medium", "--rounds", "1"]
CPU = ["--device", "cpu", *BOTH]

# (machine, file under --out, the bench arguments; "hf:NAME" is a config above)
ROWS: list[tuple[str, str, list[str]]] = [
    ("gpu1", "h200x1_medium.json",
     [*GPU, "--nproc", "1", "--model", "medium", "--ac", "none,non-reentrant",
      "--steps", "8", "--warmup", "3", "--rounds", "1", "--overhead"]),
    ("gpu1", "h200x1_base.json",
     [*GPU, "--nproc", "1", "--model", "base", "--ac", "none,non-reentrant",
      "--steps", "8", "--warmup", "3", "--rounds", "2"]),
    ("gpu1", "h200x1_large_ac.json", [*LARGE_1, "--steps", "4", "--warmup", "2", "--rounds", "1"]),
    ("gpu1", "h200x1_large_ac_oib.json",
     [*LARGE_1, "--optimizer-in-backward", "--steps", "3", "--warmup", "1", "--rounds", "1"]),
    ("gpu1", "h200x1_large_ac_offload.json",
     [*LARGE_1, "--offload", "--steps", "2", "--warmup", "1", "--rounds", "1"]),
    ("gpu1", "h200x1_medium_pure_bf16.json",
     ["--device", "cuda", "--nproc", "1", "--model", "medium", "--configs", "bare,shardwise",
      "--mp", "bf16-pure,bf16", "--steps", "8", "--warmup", "3", "--rounds", "3"]),
    ("gpu2", "h200x2_large.json",
     [*GPU, "--nproc", "2", "--model", "large", "--steps", "5", "--warmup", "2", "--rounds", "1"]),
    ("gpu2", "h200x2_large_ac.json",
     [*GPU, "--nproc", "2", "--model", "large", "--ac", "non-reentrant",
      "--steps", "5", "--warmup", "2", "--rounds", "1"]),
    ("gpu2", "h200x2_base_medium.json",
     [*GPU, "--nproc", "2", "--model", "base,medium", "--ac", "none,non-reentrant",
      "--steps", "8", "--warmup", "3", "--rounds", "1"]),
    ("gpu2", "h200x2_medium_offload.json", [*MEDIUM_2, "--offload", "--steps", "5", "--warmup", "2"]),
    ("gpu2", "h200x2_medium_float8.json",
     [*MEDIUM_2, "--float8", "--compile", "off,on", "--steps", "8", "--warmup", "3"]),
    ("gpu2", "h200x2_medium_compile.json",
     [*MEDIUM_2, "--compile", "on", "--steps", "8", "--warmup", "3"]),
    ("gpu2", "h200x2_hf_llama1b.json",
     [*GPU, "--nproc", "2", "--model", "hf:llama_1b", "--ac", "none,non-reentrant",
      "--batch-size", "4", "--steps", "4", "--warmup", "2", "--rounds", "1"]),
    ("cpu", "cpu_small_2ranks.json",
     [*CPU, "--nproc", "2", "--model", "small", "--steps", "5", "--warmup", "2", "--rounds", "2",
      "--overhead"]),
    ("cpu", "cpu_w1024_2ranks.json",
     [*CPU, "--nproc", "2", "--model", "hf:w1024_llama4", "--steps", "5", "--warmup", "2",
      "--rounds", "2", "--overhead"]),
    ("cpu", "cpu_tiny_2ranks.json",
     [*CPU, "--nproc", "2", "--model", "tiny", "--steps", "8", "--warmup", "2", "--rounds", "3"]),
    ("cpu", "cpu_tiny_4ranks.json",
     [*CPU, "--nproc", "4", "--model", "tiny", "--steps", "8", "--warmup", "2", "--rounds", "3"]),
]  # fmt: skip


def this_machine() -> str:
    """``gpu2``, ``gpu1`` or ``cpu``, by the GPUs torch sees."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return "gpu2" if n >= 2 else "gpu1" if n == 1 else "cpu"


def bench_command() -> list[str]:
    """The installed ``shardwise`` command, else the package run as a module."""
    exe = shutil.which("shardwise")
    return [exe] if exe else [sys.executable, "-m", "shardwise"]


def commands(machine: str, out: Path, configs: Path) -> list[list[str]]:
    """One ``shardwise bench`` command line per row of ``machine``."""
    cmds = []
    for kind, name, args in ROWS:
        if kind != machine:
            continue
        args = [f"hf:{configs / a[3:]}" if a.startswith("hf:") else a for a in args]
        cmds.append([*bench_command(), "bench", *args, "--json", str(out / name)])
    return cmds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--machine", choices=["cpu", "gpu1", "gpu2"], help="default: this machine's")
    ap.add_argument("--out", type=Path, default=Path("docs/bench"), help="default: docs/bench")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = ap.parse_args()
    machine = args.machine or this_machine()
    with tempfile.TemporaryDirectory() as tmp:
        configs = Path(tmp)
        for name, config in HF_CONFIGS.items():
            (configs / name).mkdir()
            (configs / name / "config.json").write_text(json.dumps(config, indent=1))
        cmds = commands(machine, args.out, configs)
        if not args.dry_run:
            args.out.mkdir(parents=True, exist_ok=True)
        for cmd in cmds:
            print(" ".join(cmd), flush=True)
            if not args.dry_run:
                subprocess.run(cmd, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
