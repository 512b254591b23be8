"""The suite's shared helpers (dist_utils, models, cli_helpers) live here, beside
the folders by concern (library/, planner/, app/): put this folder on the path
so that every test, and every rank a test spawns, imports them by name."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
