"""The differential fuzzer's ranks: one launch of worker processes runs many compositions.

Spawning gloo ranks costs seconds, a composition a fraction of one; so ``Pool`` starts
``WORLD`` workers once, each connected to one TCP store that this process hosts, and
streams compositions to them. Each composition gets a process group of its own (a
prefix of the store, ``cfg.world`` ranks; the others sit it out), made with short
timeouts (fuzz_runtime.PG_TIMEOUT, for every group made inside it too), and destroyed
after it. A rank stuck past a composition's deadline (a hang no collective timeout
breaks) is the composition's crash: every worker is killed and a fresh set launched,
and the stream goes on.

``classify`` turns the ranks' results into one outcome: ok, refused, diverged (only
shardwise, or shared with FSDP2), crashed. ``shrink`` drops one feature at a time while
the outcome stays, and returns the smallest composition, which ``Config.to_code``
prints as a script.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import queue
import time
import traceback
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fuzz_runtime
from fuzz_runtime import Config

WORLD = 4
DEADLINE = 120.0  # seconds a composition may take, every rank; past it the workers are relaunched
STARTUP = 600.0  # seconds a fresh set of workers may take to import and connect
OUTCOMES = ("ok", "refused", "diverged-shardwise-only", "diverged-shared-with-fsdp2", "crashed")


def _worker(rank: int, port: int, inbox: Any, outbox: Any) -> None:
    import warnings

    warnings.simplefilter("ignore")
    import logging

    logging.getLogger("torch.distributed").setLevel(logging.ERROR)  # FSDP2's raf=1 note
    # FSDP2's asserts print stacks and pipelining logs whole schedules on every error, from
    # C++ and from handlers made at import: the results carry the errors, so the
    # workers' stderr goes to a file, not the fuzzer's output.
    err = os.open("/tmp/fuzz_workers_stderr.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(err, 2)
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Groups made without a timeout (shardwise's node and post-forward groups, DeviceMesh's)
    # take this one: a mismatched collective fails a composition in seconds, not 30 minutes.
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = fuzz_runtime.PG_TIMEOUT
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60)
    )
    import fuzz_pipe  # noqa: F401 - imported before the first deadline starts

    outbox.put((0, rank, "ready"))  # index 0: no composition's
    while True:
        job = inbox.get()
        if job is None:
            return
        index, cfg, fsdp2 = job
        if rank >= cfg.world:
            continue
        t0 = time.monotonic()
        try:
            dist.init_process_group(
                "gloo",
                store=dist.PrefixStore(f"c{index}/", store),
                rank=rank,
                world_size=cfg.world,
                timeout=fuzz_runtime.PG_TIMEOUT,
            )
            result = fuzz_runtime.run_config(rank, cfg, fsdp2)
        except BaseException:  # noqa: BLE001 - reported as this composition's crash
            result = {
                "status": "crashed",
                "detail": traceback.format_exc(limit=-8),
                "fsdp2": "n/a",
                "fsdp2_detail": "",
            }
        finally:
            if dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception:  # noqa: BLE001 - a broken group is dropped anyway
                    pass
        result["seconds"] = time.monotonic() - t0
        outbox.put((index, rank, result))


class Pool:
    """``WORLD`` ranks kept alive; ``run(cfg)`` runs one composition on the first
    ``cfg.world`` of them and returns every participating rank's result."""

    def __init__(self, deadline: float = DEADLINE) -> None:
        self.deadline = deadline
        self.ctx = mp.get_context("spawn")
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.index = 0
        self.relaunches = 0
        self.procs: list[Any] = []
        self._launch()

    def _launch(self) -> None:
        self.outbox = self.ctx.Queue()
        self.inboxes = [self.ctx.Queue() for _ in range(WORLD)]
        self.procs = [
            self.ctx.Process(
                target=_worker, args=(r, self.store.port, self.inboxes[r], self.outbox), daemon=True
            )
            for r in range(WORLD)
        ]
        for p in self.procs:
            p.start()
        # The deadline is a composition's: wait until every worker has imported
        # (seconds each on a busy machine) before the first one starts its clock.
        ready: set[int] = set()
        end = time.monotonic() + STARTUP
        while len(ready) < WORLD and time.monotonic() < end:
            try:
                index, rank, what = self.outbox.get(timeout=1.0)
            except queue.Empty:
                if any(not p.is_alive() for p in self.procs):
                    raise RuntimeError("a fuzz worker died while starting") from None
                continue
            if index == 0 and what == "ready":
                ready.add(rank)

    def _kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)

    def relaunch(self) -> None:
        self._kill()
        self.relaunches += 1
        self._launch()

    def close(self) -> None:
        for box in self.inboxes:
            box.put(None)
        for p in self.procs:
            p.join(timeout=5)
        self._kill()

    def run(self, cfg: Config, fsdp2: str = "on-divergence") -> list[dict[str, Any]]:
        self.index += 1
        for box in self.inboxes:
            box.put((self.index, cfg, fsdp2))
        got: dict[int, dict[str, Any]] = {}
        end = time.monotonic() + self.deadline
        while len(got) < cfg.world:
            try:
                index, rank, result = self.outbox.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                if time.monotonic() > end or dead:
                    why = (
                        f"rank(s) {dead} died"
                        if dead
                        else f"no result within {self.deadline:.0f} s (a hang)"
                    )
                    self.relaunch()
                    missing = {
                        "status": "crashed",
                        "detail": why,
                        "fsdp2": "n/a",
                        "fsdp2_detail": "",
                    }
                    return [got.get(r, missing) for r in range(cfg.world)]
                continue
            if index == self.index:
                got[rank] = result
        return [got[r] for r in range(cfg.world)]


@dataclass
class Outcome:
    cfg: Config
    kind: str  # one of OUTCOMES
    detail: str
    fsdp2: str = "n/a"
    fsdp2_detail: str = ""
    seconds: float = 0.0

    def line(self) -> str:
        first = self.detail.strip().splitlines()[-1] if self.kind == "crashed" else self.detail
        extra = f" | fsdp2: {self.fsdp2} {self.fsdp2_detail[:200]}" if self.fsdp2 != "n/a" else ""
        return f"{self.kind}: {self.cfg.describe()} -> {first[:300]}{extra}"


def classify(cfg: Config, results: list[dict[str, Any]]) -> Outcome:
    """One outcome from the ranks' results. A refusal counts only if every rank refused
    (one rank refusing while its peers wait in a collective is a hang, a crash), but for
    a pipeline stage refused before any collective while its peers wait on a receive."""
    seconds = max(r.get("seconds", 0.0) for r in results)
    statuses = [r["status"] for r in results]
    first = results[0]
    fs = next((r for r in results if r["fsdp2"] not in ("ok", "n/a")), first)
    if set(statuses) == {"ok", "diverged"}:  # a pipeline rank's own stages differ
        first = next(r for r in results if r["status"] == "diverged")
        statuses = ["diverged"] * len(results)
    if (
        cfg.family == "pipe"
        and "refused" in statuses
        and all(r["status"] == "refused" or "timed out" in r["detail"].lower() for r in results)
    ):
        # A pipeline stage refused at its first forward, before any collective of ours:
        # its pipeline peers, waiting on that stage's first message, time out in torch's
        # receive (what a launcher then stops). The refusal is the outcome.
        refused = next(r for r in results if r["status"] == "refused")
        return Outcome(cfg, "refused", refused["detail"], fs["fsdp2"], fs["fsdp2_detail"], seconds)
    if "crashed" in statuses or len(set(statuses)) > 1:
        crashed = [r for r in results if r["status"] == "crashed"] or [first]
        # A rank that failed leaves its peers timing out in a collective: its error is the one.
        bad = next((r for r in crashed if "timed out" not in r["detail"].lower()), crashed[0])
        detail = bad["detail"]
        if len(set(statuses)) > 1:
            detail = f"ranks disagree ({statuses}): {detail}"
        return Outcome(cfg, "crashed", detail, fs["fsdp2"], fs["fsdp2_detail"], seconds)
    if first["status"] == "diverged":
        kind = (
            "diverged-shared-with-fsdp2" if fs["fsdp2"] == "diverged" else "diverged-shardwise-only"
        )
        return Outcome(cfg, kind, first["detail"], fs["fsdp2"], fs["fsdp2_detail"], seconds)
    return Outcome(cfg, first["status"], first["detail"], fs["fsdp2"], fs["fsdp2_detail"], seconds)


def run_in(pool: Pool, cfg: Config, fsdp2: str = "on-divergence") -> Outcome:
    return classify(cfg, pool.run(cfg, fsdp2))


def run_one(cfg: Config, fsdp2: bool = True) -> str:
    """One composition in a pool of its own (a reproducer's entry point): its outcome line."""
    pool = Pool()
    try:
        return run_in(pool, cfg, "always" if fsdp2 else "never").line()
    finally:
        pool.close()


SIZES = ("world", "blocks", "accum", "steps", "stages_per_rank")  # "at least", when matching


def contains(cfg: Config, small: Config) -> bool:
    """Whether ``cfg`` has every feature that ``small`` changes from the defaults, and is
    at least as large (a shrunk reproducer has fewer blocks, steps, ... than those it
    explains)."""
    for k, v in small.changed().items():
        have = getattr(cfg, k)
        if not (have >= v if k in SIZES else have == v):
            return False
    return True


def _simpler(cfg: Config) -> list[Config]:
    """Compositions one feature plainer than ``cfg`` (each a valid composition)."""
    base = Config(family=cfg.family)
    out = []
    for f in dataclasses.fields(cfg):
        if f.name in (
            "family",
            "schedule",
            "control",
            "world",
            "steps",
            "blocks",
            "accum",
            "stages_per_rank",
        ):
            continue
        value = getattr(base, f.name)
        if getattr(cfg, f.name) != value:
            out.append(replace(cfg, **{f.name: value}))
    if cfg.accum > 1 and cfg.freeze_mid == "none" and not cfg.no_sync and cfg.control == "none":
        out.append(replace(cfg, accum=cfg.accum - 1))
    if cfg.accum > 2:
        out.append(replace(cfg, accum=cfg.accum - 1))
    if cfg.steps > 1:
        out.append(replace(cfg, steps=cfg.steps - 1))
    if cfg.blocks > 1:
        out.append(replace(cfg, blocks=cfg.blocks - 1))
    if cfg.stages_per_rank > 1 and cfg.family == "pipe":
        out.append(replace(cfg, stages_per_rank=cfg.stages_per_rank - 1))
    if cfg.world == 4 and not cfg.hsdp and cfg.comm == "none" and cfg.family == "fsdp":
        out.append(replace(cfg, world=2))
    if cfg.ac == "none" and cfg.reentrant:
        out.append(replace(cfg, reentrant=False))
    return [c for c in out if _valid(c)]


def _valid(cfg: Config) -> bool:
    if cfg.family == "pipe":
        from fuzz_pipe import valid_pipe

        return valid_pipe(cfg)
    shard = 2 if cfg.hsdp else cfg.world
    if (
        isinstance(cfg.raf, int)
        and not isinstance(cfg.raf, bool)
        and (shard % cfg.raf or cfg.raf >= shard)
    ):
        return False
    if (cfg.hsdp or cfg.comm != "none") and cfg.world != 4:
        return False
    return (
        cfg.accum > 1 or (cfg.freeze_mid == "none" and not cfg.no_sync)
    ) and cfg.control in fuzz_runtime.CONTROLS


def shrink(pool: Pool, found: Outcome, fsdp2: str = "on-divergence", budget: int = 40) -> Outcome:
    """The smallest composition that still has ``found``'s outcome kind, dropping one
    feature at a time (at most ``budget`` runs)."""
    best = found
    runs = 0
    progress = True
    while progress and runs < budget:
        progress = False
        for cand in _simpler(best.cfg):
            runs += 1
            got = run_in(pool, cand, fsdp2)
            if got.kind == found.kind:
                best, progress = got, True
                break
            if runs >= budget:
                break
    return best
