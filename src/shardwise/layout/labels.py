"""The runtime's labels for profilers and memory records: the bottom of the runtime.

What the runtime labels, so that tools attribute time and memory by what the
runtime was doing rather than by its file and function names (which move):
"unsharded" (the gathered parameters' storage), "gather" (a gather's copy-in
and buffers), "copy-out" (laying a rank-major gather out), "post-forward part"
(what ``reshard_after_forward=int`` keeps), "reduce" (the gradients' copy-in and
reduction buffers), "offload" (copies to and from host memory).

Why a file of its own, below everything: every layer labels (the copies in
offload.py, the strategies in gather.py and reduce.py, the group), and the
timeline (trace.py) sits above the collectives it observes. A label imports
nothing of the runtime, so any file may use one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

LABELS = ("unsharded", "gather", "copy-out", "post-forward part", "reduce", "offload")
PREFIX = "shardwise::"

_memory_labels = False  # set by ``memory_labels()``


class _NoLabel:
    """What ``label`` returns when no profiler or memory record listens: no cost but a call."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NO_LABEL = _NoLabel()


class _Label:
    __slots__ = ("name", "scope", "before")

    def __init__(self, name: str) -> None:
        self.name = PREFIX + name
        self.scope: Any = None
        self.before: str | None = None

    def __enter__(self) -> None:
        if torch.autograd._profiler_enabled():
            self.scope = torch.profiler.record_function(self.name)
            self.scope.__enter__()
        if _memory_labels:
            self.before = torch.cuda.memory._get_memory_metadata()
            torch.cuda.memory._set_memory_metadata(self.name)

    def __exit__(self, *exc: object) -> None:
        if self.before is not None:
            torch.cuda.memory._set_memory_metadata(self.before)
        if self.scope is not None:
            self.scope.__exit__(None, None, None)


def label(name: str) -> Any:
    """A scope named ``shardwise::<name>`` (one of ``LABELS``) for torch's profiler
    (``record_function``) and, inside ``memory_labels()``, for the CUDA allocator's
    record (each allocation's ``user_metadata``). Outside both it does nothing:
    the hooks run once per module per step, and a ``record_function`` costs
    microseconds even with no profiler."""
    if _memory_labels or _profiler_enabled():
        return _Label(name)
    return _NO_LABEL


_profiler_enabled = torch.autograd._profiler_enabled  # one C call, looked up once


@contextmanager
def memory_labels() -> Iterator[None]:
    """Label the CUDA allocator's record with the runtime's scopes (a memory report
    attributes a peak by them)."""
    global _memory_labels
    before, _memory_labels = _memory_labels, True
    try:
        yield
    finally:
        _memory_labels = before
