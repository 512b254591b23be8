"""The optional packages the application runs on, looked for without importing them.

``pip install 'shardwise[cli]'`` brings the command line's (rich for the
progress bar, matplotlib for the plots), ``pip install 'shardwise[hf]'`` what
``--hf`` needs (``models/hf.py``). The library, ``import shardwise``, needs
neither.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

CLI = ("rich", "matplotlib")
CLI_INSTALL = "pip install 'shardwise[cli]'"


def first_missing(names: Iterable[str]) -> str | None:
    """The first of ``names`` that is not installed (or set to None in ``sys.modules``,
    which is what an absent package looks like to import); None if all are there."""
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            return name
    return None
