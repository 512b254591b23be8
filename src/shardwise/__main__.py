"""``python -m shardwise``: the same as the ``shardwise`` console script."""

import sys

from shardwise.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
