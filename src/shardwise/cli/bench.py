"""``shardwise bench``: the bare model, torch's FSDP2 and shardwise side by side.

The benchmark itself lives in ``shardwise.benchmark`` (also runnable as
``python -m shardwise.benchmark``); see docs/benchmarks.md for results.
"""

from __future__ import annotations


def main(argv: list[str]) -> int:
    from ..benchmark import main as bench_main

    return bench_main(argv)
