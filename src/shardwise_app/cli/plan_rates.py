"""``shardwise calibrate`` and ``shardwise plan --rates FILE``: a machine's rates, measured once and stated.

Why a file: a predicted step is only as good as the rates behind it, and the
built-in ones (``shardwise_plan.hardware``) are datasheets. ``shardwise
calibrate`` measures the machine it runs on (``shardwise_plan.calibrate``)
and writes every rate as JSON; ``plan --rates FILE`` predicts with them, and
the plan's JSON says which rates it used.

Why every rank at once: ranks that share a machine share its memory
bandwidth and, on a CPU, its cores, so a rate measured by one process alone
is one no training rank sees. ``--nproc`` ranks (default: one per GPU, or
one per core on a CPU) calibrate together under one process group; rank 0
writes what it measured. On a CPU only compute is measured: a CPU target's
step time is indicative, its gloo latency and bus are the CPU preset's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

from .common import UsageError, check_nproc, usable_cpus
from .plan_args import DefaultsFormatter, OneLineParser, check_output


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="shardwise calibrate",
        description="Measure this machine's rates for `shardwise plan --rates FILE`: matrix "
        "products, memory bandwidth, an operator's fixed cost, the host's AdamW and copies, "
        "and with several GPUs their all-gather.",
        formatter_class=DefaultsFormatter,
    )
    p.add_argument(
        "--out", default=None, metavar="FILE", help="write the rates here (JSON); else print"
    )
    p.add_argument(
        "--nproc", type=int, default=None,
        help="ranks measuring at once (default: one per GPU, else one per core)",
    )  # fmt: skip
    return p


def main(argv: list[str]) -> int:
    """Measure with ``--nproc`` ranks at once; print the rates and write them to ``--out``."""
    import torch

    from shardwise_plan.ranks import run_ranks

    args = parser().parse_args(argv)
    if args.out:
        check_output(args.out, "--out")
    nproc = args.nproc or (
        torch.cuda.device_count() if torch.cuda.is_available() else usable_cpus()
    )
    check_nproc(nproc)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rates.json"
        code = run_ranks(["calibrate", str(out)], nproc)
        if code or not out.is_file():
            raise SystemExit(f"shardwise calibrate: a rank failed (exit code {code or 1})")
        rates = json.loads(out.read_text())
    text = json.dumps(rates, indent=2) + "\n"
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)
    return 0


def load_rates(path: str) -> Any:
    """A ``Hardware`` from a ``shardwise calibrate`` file; one clear error for a wrong one."""
    from shardwise_plan import Hardware

    fields = {f.name: f for f in dataclasses.fields(Hardware)}
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise UsageError(f"--rates {path}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"--rates {path}: not JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(data, dict):
        raise UsageError(f"--rates {path}: expected a JSON object of rates")
    unknown = sorted(set(data) - set(fields))
    missing = sorted(
        n
        for n, f in fields.items()
        if n not in data
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    )
    if unknown or missing:
        what = "; ".join(
            part
            for part in (
                f"unknown {', '.join(unknown)}" if unknown else "",
                f"missing {', '.join(missing)}" if missing else "",
            )
            if part
        )
        raise UsageError(
            f"--rates {path}: {what}. Write the file with `shardwise calibrate --out FILE`"
        )
    for name, value in data.items():
        if name in TEXT:
            if not isinstance(value, str):
                raise UsageError(f"--rates {path}: {name} must be a string, got {value!r}")
            continue
        if name in FLAGS:
            if not isinstance(value, bool):
                raise UsageError(f"--rates {path}: {name} must be true or false, got {value!r}")
            continue
        least = 0 if name in MAY_BE_ZERO else 1 if name in COUNTS else 1e-300
        if isinstance(value, bool) or not isinstance(value, int | float) or value < least:
            need = ">= 0" if least == 0 else ">= 1" if least == 1 else "> 0"
            raise UsageError(f"--rates {path}: {name} must be a number {need}, got {value!r}")
        if name in COUNTS and value != int(value):
            raise UsageError(f"--rates {path}: {name} must be a whole number, got {value!r}")
    values: dict[str, Any] = {k: int(v) if k in COUNTS else v for k, v in data.items()}
    if values.get("device", "cuda") == "cuda" and "blas_workspace" not in values:
        # Written before calibrate measured it: torch's default on the GPUs these
        # files came from (Hopper), rather than no workspaces at all.
        from shardwise_plan import H200

        values["blas_workspace"] = H200.blas_workspace
    return Hardware(**values)


TEXT = ("name", "device", "source")
FLAGS = ("comm_overlaps",)
COUNTS = ("ranks_per_node", "alloc_round", "blas_workspace")
# Fixed costs may be nothing; host_adamw_bw 0 means host_mem_bw. Every other rate divides.
MAY_BE_ZERO = (
    "op_overhead",
    "view_overhead",
    "dtensor_overhead",
    "latency",
    "host_adamw_bw",
    "blas_workspace",
)
