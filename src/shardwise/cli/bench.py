"""``shardwise bench``: throughput and memory of the GPT sizes (not implemented yet)."""

from __future__ import annotations

import sys

EXIT_NOT_IMPLEMENTED = 2


def main(argv: list[str]) -> int:
    print("shardwise bench: the benchmark is not implemented yet", file=sys.stderr)
    return EXIT_NOT_IMPLEMENTED
