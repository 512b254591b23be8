"""A timeline of every gather, reduction, phase change and prefetch, per rank.

    with shardwise.trace() as t:
        loss = model(x).sum(); loss.backward()
    t.save_chrome_trace("timeline.json")   # chrome://tracing or ui.perfetto.dev
    t.plot("timeline.png")
    t.summary()                            # counts, bytes, exposed_comm_s (and by module),
                                           # prefetch_hit_rate

Why our own timeline: torch's profiler shows kernels, not why a module was
gathered (its own need or a prefetch), whether that prefetch arrived in time,
or which forward was a recomputation. Recording costs nothing when no trace is
active: the hooks test one module-level variable.

Times come from ``time.perf_counter`` on CPU and from CUDA events on the
compute stream on GPU (resolved when the trace ends). ``exposed`` time is the
time the compute side waited for a collective: blocking time inside ``wait()``
on CPU, the gap a stream wait leaves between two events on GPU.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..comm import collectives

# The runtime's labels lived here first; labels.py is their home (below the collectives).
from ..layout.labels import _NO_LABEL, LABELS, PREFIX, label, memory_labels

__all__ = [
    "LABELS",
    "PREFIX",
    "_NO_LABEL",
    "Event",
    "Tracer",
    "active",
    "label",
    "memory_labels",
    "trace",
]

_active: Tracer | None = None


def active() -> Tracer | None:
    return _active


@dataclass
class Event:
    name: str  # e.g. "all_gather", "reshard", "forward", "recompute", "prefetch_hit"
    module: str
    start: float  # seconds since the trace began
    end: float
    track: str = "compute"  # "compute" | "comm" | "phase"
    nbytes: int = 0
    rank: int = 0
    args: dict[str, Any] = field(default_factory=dict)


class _Clock:
    """perf_counter on CPU; CUDA events on the current stream, resolved at the end."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.t0 = time.perf_counter()
        self._base = None
        if cuda:
            self._base = torch.cuda.Event(enable_timing=True)
            self._base.record()

    def now(self) -> Any:
        if not self.cuda:
            return time.perf_counter() - self.t0
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def resolve(self, t: Any) -> float:
        if not self.cuda:
            return float(t)
        return float(self._base.elapsed_time(t)) / 1e3  # type: ignore[union-attr]


class Tracer:
    def __init__(self) -> None:
        self.rank = collectives.rank()
        self._clock = _Clock(torch.cuda.is_available() and torch.cuda.is_initialized())
        self._raw: list[tuple[str, str, Any, Any, str, int, dict[str, Any]]] = []
        self._open: dict[tuple[str, str], tuple[Any, int, dict[str, Any]]] = {}
        self.events: list[Event] = []  # filled when the trace ends (all ranks on rank 0)
        self.local_events: list[Event] = []
        self._first_need = True

    # ---- recording (called from the runtime) ----------------------------------------------

    def now(self) -> Any:
        return self._clock.now()

    def span(
        self,
        name: str,
        module: str,
        start: Any,
        end: Any,
        track: str = "compute",
        nbytes: int = 0,
        **args: Any,
    ) -> None:
        self._raw.append((name, module, start, end, track, nbytes, args))

    def instant(self, name: str, module: str, **args: Any) -> None:
        t = self.now()
        self._raw.append((name, module, t, t, "compute", 0, args))

    def begin(self, name: str, module: str, nbytes: int = 0, **args: Any) -> None:
        if name in ("forward", "backward"):
            self._first_need = True
        self._open[(name, module)] = (self.now(), nbytes, args)

    def need(self, module: str, prefetched: bool) -> None:
        """A module needed its gather: was it already issued by a prefetch?

        The first gather of each forward and of each backward cannot have been
        prefetched; it is recorded as ``first_gather`` and left out of the rate.
        """
        if self._first_need:
            self._first_need = False
            self.instant("first_gather", module)
        else:
            self.instant("prefetch_hit" if prefetched else "prefetch_miss", module)

    def end(self, name: str, module: str, track: str = "phase") -> None:
        opened = self._open.pop((name, module), None)
        if opened is not None:
            start, nbytes, args = opened
            self._raw.append((name, module, start, self.now(), track, nbytes, args))

    # ---- results --------------------------------------------------------------------------

    def _finish(self) -> None:
        if self._clock.cuda:
            torch.cuda.synchronize()
        for name, module in list(self._open):
            self.end(name, module)
        self.local_events = sorted(
            (
                Event(n, m, self._clock.resolve(s), self._clock.resolve(e), tr, b, self.rank, a)
                for n, m, s, e, tr, b, a in self._raw
            ),
            key=lambda ev: ev.start,
        )
        self.events = list(self.local_events)
        if collectives.world_size() > 1:
            everyone = collectives.all_gather_objects(self.local_events)
            self.events = [ev for evs in everyone for ev in evs]

    def summary(self) -> dict[str, Any]:
        """This rank's counts and bytes per collective, exposed comm, prefetch hit rate."""
        evs = self.local_events
        counts: Counter[str] = Counter()
        nbytes: Counter[str] = Counter()
        for ev in evs:
            if ev.track == "comm":
                counts[ev.name] += 1
                nbytes[ev.name] += ev.nbytes
        waits = [ev for ev in evs if ev.name == "wait"]
        exposed = sum(ev.end - ev.start for ev in waits)
        # Where the exposed time went: which collective of which module.
        by: dict[str, float] = {}
        for ev in waits:
            key = f"{ev.args.get('kind') or 'wait'} {ev.module}"
            by[key] = by.get(key, 0.0) + ev.end - ev.start
        hits = sum(1 for ev in evs if ev.name == "prefetch_hit")
        misses = sum(1 for ev in evs if ev.name == "prefetch_miss")
        span = (max(ev.end for ev in evs) - min(ev.start for ev in evs)) if evs else 0.0
        return {
            "collectives": dict(counts),
            "bytes": dict(nbytes),
            "exposed_comm_s": exposed,
            # "<collective> <module>": seconds, largest first
            "exposed_by": dict(sorted(by.items(), key=lambda kv: -kv[1])),
            "wall_s": span,
            "prefetch_hits": hits,
            "prefetch_misses": misses,
            "prefetch_hit_rate": hits / (hits + misses) if hits + misses else 1.0,
        }

    def save_chrome_trace(self, path: str) -> None:
        """Chrome/Perfetto JSON: one process per rank, one thread per track."""
        tids = {"phase": 0, "compute": 1, "comm": 2}
        out: list[dict[str, Any]] = []
        for rank in sorted({ev.rank for ev in self.events}):
            out.append(
                {
                    "name": "process_name",
                    "ph": "M",
                    "pid": rank,
                    "tid": 0,
                    "args": {"name": f"rank {rank}"},
                }
            )
            for track, tid in tids.items():
                out.append(
                    {
                        "name": "thread_name",
                        "ph": "M",
                        "pid": rank,
                        "tid": tid,
                        "args": {"name": track},
                    }
                )
        for ev in self.events:
            base = {
                "name": f"{ev.name} {ev.module}".strip(),
                "cat": ev.name,
                "pid": ev.rank,
                "tid": tids[ev.track],
                "ts": ev.start * 1e6,
                "args": {"module": ev.module, "bytes": ev.nbytes, **ev.args},
            }
            if ev.end > ev.start:
                out.append({**base, "ph": "X", "dur": (ev.end - ev.start) * 1e6})
            else:
                out.append({**base, "ph": "i", "s": "t"})
        with open(path, "w") as f:
            json.dump({"traceEvents": out, "displayTimeUnit": "ms"}, f)

    def plot(self, path: str) -> None:
        """A Gantt chart per rank: forward, backward and recompute shaded, collectives as bars."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        ranks = sorted({ev.rank for ev in self.events}) or [self.rank]
        fig, axes = plt.subplots(
            len(ranks), 1, figsize=(12, 1.8 + 1.6 * len(ranks)), squeeze=False, sharex=True
        )
        shade = {"forward": "#cfe8ff", "backward": "#ffe0c2", "recompute": "#e6d3ff"}
        rows = {"all_gather": 2.0, "reduce_scatter": 1.0, "all_reduce": 1.0, "wait": 0.0}
        colors = {
            "all_gather": "tab:blue",
            "reduce_scatter": "tab:orange",
            "all_reduce": "tab:green",
            "wait": "tab:red",
        }
        for ax, rank in zip(axes[:, 0], ranks):
            for ev in (e for e in self.events if e.rank == rank):
                if ev.name in shade:
                    ax.axvspan(ev.start * 1e3, ev.end * 1e3, color=shade[ev.name], zorder=0)
                elif ev.name in rows and ev.end > ev.start:
                    ax.barh(
                        rows[ev.name],
                        (ev.end - ev.start) * 1e3,
                        left=ev.start * 1e3,
                        height=0.6,
                        color=colors[ev.name],
                        edgecolor="black",
                        linewidth=0.3,
                    )
            ax.set_yticks([0, 1, 2], ["exposed wait", "reduce", "gather"])
            ax.set_title(f"rank {rank}", fontsize=9, loc="left")
        axes[-1, 0].set_xlabel("ms (shaded: forward blue, backward orange, recompute purple)")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


@contextmanager
def trace() -> Iterator[Tracer]:
    """Record the runtime's lifecycle on every rank; gathered to all ranks at exit."""
    global _active
    if _active is not None:
        raise RuntimeError("shardwise.trace() is already active; traces do not nest")
    tracer = Tracer()

    def on_collective(rec: collectives.CollectiveRecord, pending: collectives.Pending) -> None:
        start = tracer.now()

        def done(_: collectives.Pending) -> None:
            tracer.span(
                rec.kind,
                rec.label,
                start,
                tracer.now(),
                track="comm",
                nbytes=rec.nbytes,
                dtype=str(rec.dtype).replace("torch.", ""),
                group_size=rec.group_size,
            )

        pending.on_done.append(done)

    waiting: dict[int, Any] = {}  # id(pending) -> when compute started waiting for it

    def on_wait(pending: collectives.Pending, waited: bool) -> None:
        # How long compute waited for a collective (a cast, an upload): exposed time.
        if not waited:
            waiting[id(pending)] = tracer.now()
            return
        start = waiting.pop(id(pending), None)
        if start is not None:
            tracer.span("wait", pending.label, start, tracer.now(), kind=pending.kind)

    removers = [collectives.add_observer(on_collective), collectives.add_wait_observer(on_wait)]
    _active = tracer
    try:
        yield tracer
    finally:
        _active = None
        for remove in removers:
            remove()
        tracer._finish()
