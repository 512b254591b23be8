"""The differential fuzzer: N distinct compositions of the runtime's features against one process.

    python benchmarks/fuzz.py --configs 1000 --seed 0

Each composition (tests/library/fuzz/fuzz_runtime.py's ``Config``, drawn by ``generate``
from seeds S, S+1, ...; a seed that draws a composition already run is skipped) trains
2 or 3 steps on gloo ranks beside one process on the whole batch; losses, every
gradient, the clipped norm and every parameter are compared after each step. The
outcome of each is one of: ok, refused (shardwise said no with a clear error at setup
or in the first step), diverged only under shardwise, diverged under torch's FSDP2 as
well (FSDP2 runs the composition where it has every feature drawn), crashed (an error
that is not a refusal, a hang, a dead rank). Every divergence and crash is shrunk to
the smallest composition that still shows it (one feature dropped at a time); a
finding whose composition contains an earlier reproducer's is counted under it, not
shrunk again. The summary prints the counts and each reproducer as a runnable script.

``--fsdp2 always`` also runs FSDP2 on every composition it supports (about twice the
time; FSDP2-only divergences are then listed too); the default runs it only to
classify a divergence or a crash. ``--report PATH`` keeps a markdown file of the
findings, rewritten after each one; ``--jsonl PATH`` one line per composition.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:  # imported in main, after the arguments are checked (torch takes seconds)
    from fuzz_runtime import Config

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "library" / "fuzz")]

OUTCOMES = ("ok", "refused", "diverged-shardwise-only", "diverged-shared-with-fsdp2", "crashed")

FINDINGS = ("diverged-shardwise-only", "diverged-shared-with-fsdp2", "crashed")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2
        sys.stderr.write(f"fuzz.py: {message}\n")
        sys.exit(2)


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", type=_positive, default=100, help="distinct compositions to run")
    p.add_argument("--seed", type=_int, default=0, help="first seed")
    p.add_argument("--fsdp2", choices=("on-divergence", "always", "never"), default="on-divergence")
    p.add_argument("--family", choices=("all", "fsdp", "pipe"), default="all")
    p.add_argument("--no-shrink", action="store_true", help="report findings as drawn")
    p.add_argument("--report", type=Path, default=None, help="markdown file of the findings")
    p.add_argument("--jsonl", type=Path, default=None, help="one JSON line per composition")
    return p.parse_args(argv)


def distinct(n: int, seed: int, family: str) -> list[tuple[int, Config]]:
    from fuzz_runtime import generate

    """The first ``n`` distinct compositions from seeds ``seed``, ``seed + 1``, ...
    (of ``family`` only, unless "all")."""
    seen: set[Config] = set()
    out: list[tuple[int, Config]] = []
    s = seed
    while len(out) < n:
        cfg = generate(s)
        if cfg not in seen and family in ("all", cfg.family):
            seen.add(cfg)
            out.append((s, cfg))
        s += 1
    return out


def _finding_md(i: int, seed: int, drawn: Any, small: Any, also: int) -> str:
    return (
        f"### {i}. {small.kind}: {small.cfg.describe()}\n\n"
        f"- first drawn at seed {seed}: `{drawn.cfg.describe()}`\n"
        f"- drawn compositions it explains: {also + 1}\n"
        f"- shardwise: {small.detail.strip().splitlines()[-1] if small.detail else ''}\n"
        f"- FSDP2: {small.fsdp2} {small.fsdp2_detail.strip()[:300]}\n\n"
        f"```python\n{small.cfg.to_code()}```\n"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from fuzz_pool import Pool, run_in, shrink
    from fuzz_pool import contains as explained_by

    todo = distinct(args.configs, args.seed, args.family)
    counts: Counter[str] = Counter()
    found: list[dict[str, Any]] = []  # per reproducer: seed, drawn, small, also
    fsdp2_only: list[Any] = []
    refusals: Counter[str] = Counter()
    t0 = time.monotonic()
    pool = Pool()
    log = args.jsonl.open("a") if args.jsonl else None
    try:
        for n, (seed, cfg) in enumerate(todo, 1):
            out = run_in(pool, cfg, args.fsdp2)
            counts[out.kind] += 1
            if out.kind == "refused":
                refusals[out.detail[:160]] += 1
            if out.kind == "ok" and out.fsdp2 == "diverged":
                fsdp2_only.append(out)
            if log:
                row = {
                    "seed": seed,
                    "config": cfg.changed(),
                    "kind": out.kind,
                    "detail": out.detail[-2000:],
                }
                row.update(
                    fsdp2=out.fsdp2,
                    fsdp2_detail=out.fsdp2_detail[-500:],
                    seconds=round(out.seconds, 2),
                )
                log.write(json.dumps(row, default=str) + "\n")
                log.flush()
            if out.kind in FINDINGS:
                known = next(
                    (
                        f
                        for f in found
                        if f["small"].kind == out.kind and explained_by(cfg, f["small"].cfg)
                    ),
                    None,
                )
                if known is not None:
                    known["also"] += 1
                else:
                    small = out if args.no_shrink else shrink(pool, out, args.fsdp2)
                    same = next((f for f in found if f["small"].cfg == small.cfg), None)
                    if same is not None:  # shrunk to a reproducer already listed
                        same["also"] += 1
                    else:
                        found.append({"seed": seed, "drawn": out, "small": small, "also": 0})
                        print(f"[{n}/{len(todo)}] NEW {small.line()}", flush=True)
                if args.report:
                    write_report(args, found, counts, n, time.monotonic() - t0)
            if n % 25 == 0 or n == len(todo):
                summary = " ".join(f"{k}={counts[k]}" for k in OUTCOMES)
                print(f"[{n}/{len(todo)}] {summary} ({time.monotonic() - t0:.0f} s)", flush=True)
    finally:
        pool.close()
        if log:
            log.close()
    print(
        f"\n{len(todo)} distinct compositions from seed {args.seed} in {time.monotonic() - t0:.0f} s:"
    )
    for k in OUTCOMES:
        print(f"  {k}: {counts[k]}")
    print(
        f"  (worker relaunches: {pool.relaunches}; ok under shardwise but diverged under FSDP2: {len(fsdp2_only)})"
    )
    for reason, times in refusals.most_common(8):
        print(f"  refused x{times}: {reason}")
    for i, f in enumerate(found, 1):
        print(
            f"\n--- finding {i} ({f['also'] + 1} compositions): {f['small'].line()}\n{f['small'].cfg.to_code()}"
        )
    if args.report:
        write_report(args, found, counts, len(todo), time.monotonic() - t0)
    return 1 if found else 0


def write_report(
    args: argparse.Namespace, found: list[dict[str, Any]], counts: Counter[str], n: int, secs: float
) -> None:
    head = f"# Differential fuzzer findings\n\n`python benchmarks/fuzz.py --configs {args.configs} --seed {args.seed}`: "
    head += (
        f"{n} compositions run in {secs:.0f} s: "
        + ", ".join(f"{k} {counts[k]}" for k in OUTCOMES)
        + "\n\n"
    )
    body = "".join(
        _finding_md(i, f["seed"], f["drawn"], f["small"], f["also"]) for i, f in enumerate(found, 1)
    )
    args.report.write_text(head + body)


if __name__ == "__main__":
    sys.exit(main())
