"""Rank 0's side of a training run: progress on the terminal, metrics.jsonl, plots, summary.

On a terminal the progress is a live rich bar; elsewhere (a log file, CI) it
is a plain line every twentieth of the run and at every validation.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import deque
from pathlib import Path
from typing import Any

from .common import LAUNCH_ID_ENV
from .run_config import RunConfig


class Reporter:
    """Progress bar (plain lines when not on a terminal), metrics rows, plots, the summary."""

    def __init__(
        self, cfg: RunConfig, n_params: int, start_step: int, trained: int | None = None
    ) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.cfg, self.out = cfg, Path(cfg.out)
        self.rows = read_jsonl(self.out / "metrics.jsonl")
        self.metrics = open(self.out / "metrics.jsonl", "a")  # kept open: one row per step
        self.recent: deque[float] = deque(maxlen=10)
        self.t0 = time.perf_counter()
        self.start_step = start_step
        self.traced: dict[str, Any] | None = None
        self.console = Console()
        self.live = self.console.is_terminal
        self.every = max(1, cfg.steps // 20)
        mp = "" if cfg.mixed_precision == "none" else f", {cfg.mixed_precision}"
        resumed = f", resumed at step {start_step}" if start_step else ""
        model = f"{cfg.model} from {cfg.hf}" if cfg.hf else cfg.model
        lora = f", LoRA r={cfg.lora}: {(trained or 0) / 1e6:.2f}M trained" if cfg.lora else ""
        self.unit = "tokens" if cfg.hf else "bytes"
        print(
            f"shardwise train: {model} ({n_params / 1e6:.2f}M parameters{lora}), "
            f"{cfg.world_size} x {cfg.device}{mp}, {cfg.steps} steps of "
            f"{cfg.batch_size} x {cfg.seq_len} {self.unit}{resumed} -> {self.out}",
            flush=True,
        )
        if self.live:
            self.progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self.console,
            )
            self.task = self.progress.add_task(
                "train", total=cfg.steps, completed=start_step, info=""
            )
            self.progress.start()

    def row(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        self.metrics.write(json.dumps(row) + "\n")
        self.metrics.flush()
        self.recent.append(row["tokens_per_s"])
        step = row["step"]
        info = (
            f"loss {row['loss']:.3f}  {_si(sum(self.recent) / len(self.recent))} tok/s  "
            f"mem {_bytes(row['peak_mem_bytes'])}"
        )
        val = f"  val loss {row['val_loss']:.3f}" if "val_loss" in row else ""
        if self.live:
            self.progress.update(self.task, completed=step, info=info)
            if val:
                self.progress.console.print(f"step {step:>5}: loss {row['loss']:.3f}{val}")
        elif step % self.every == 0 or val or step == self.cfg.steps:
            print(f"step {step:>5}/{self.cfg.steps}  {info}{val}", flush=True)

    def timeline(self, tracer: Any, step: int) -> None:
        """Save one traced step: a Chrome/Perfetto trace and a Gantt chart per rank."""
        tracer.save_chrome_trace(str(self.out / "timeline.json"))
        tracer.plot(str(self.out / "timeline.png"))
        self.traced = {"step": step, **tracer.summary()}

    def abort(self) -> None:
        """A failed run: stop the live bar and close the metrics; the rows so far stay."""
        if self.live:
            self.progress.stop()
        self.metrics.close()

    def finish(
        self,
        step: int,
        stopped: bool,
        signum: int | None,
        ckpt: Path,
        exported: Path | None = None,
    ) -> None:
        if self.live:
            self.progress.stop()
        self.metrics.close()
        plot(
            self.out,
            self.rows,
            title=f"{self.cfg.model}, {self.cfg.world_size} x {self.cfg.device}",
            unit=self.unit[:-1],
        )
        new = [r for r in self.rows if r["step"] > self.start_step]
        # The run's last ten steps, resumed ones included: a resumed or restarted
        # run sums up as the uninterrupted one would. Speed and memory are this launch's.
        last = self.rows[-10:]
        vals = [r["val_loss"] for r in self.rows if "val_loss" in r]
        steady = new[1:] or new  # the first step pays for warm-up work
        summary = {
            "launch_id": os.environ.get(LAUNCH_ID_ENV),
            "steps_done": step,
            "stopped_early": stopped,
            "train_loss": sum(r["loss"] for r in last) / max(1, len(last)),
            "val_loss": vals[-1] if vals else None,
            "tokens_per_s": (
                sum(r["tokens_per_s"] for r in steady) / len(steady) if steady else None
            ),
            "peak_mem_bytes": max((r["peak_mem_bytes"] for r in new), default=None),
            "wall_s": time.perf_counter() - self.t0,
            "checkpoint": str(ckpt),
            "export": str(exported) if exported else None,
            "timeline": self.traced,  # rank 0's collectives and waits in the traced step
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        # A resumed launch says how many steps it took, and from where to where:
        # the run's total alone read as if every step ran now.
        ran = step - self.start_step
        how = (
            f"stopped by {signal.Signals(signum).name} at step {step}"
            if stopped and signum
            else f"stopped at step {step}"
            if stopped
            else f"done: {ran} steps ({self.start_step} -> {step})"
            if self.start_step
            else f"done: {step} steps"
        )
        val = f"{summary['val_loss']:.4f}" if vals else "-"
        print(
            f"{how} in {summary['wall_s']:.1f} s | train loss {summary['train_loss']:.4f} | "
            f"val loss {val} | {_si(summary['tokens_per_s'] or 0)} tokens/s | "
            f"peak mem {_bytes(summary['peak_mem_bytes'] or 0)}",
            flush=True,
        )
        print(f"checkpoint: {ckpt}", flush=True)
        if exported:
            what = "PeftModel" if self.cfg.adapter_only else "AutoModelForCausalLM"
            print(f"export: {exported} (loads with {what}.from_pretrained)", flush=True)
        if stopped:
            print(f"resume with: shardwise train --resume {self.out}", flush=True)


def stopped_before_the_first_step(signum: int, config: RunConfig) -> str:
    """The line for a stop that came before any step (said by the launcher, or by rank 0
    under torchrun): nothing of the run folder changed."""
    kept = "the run folder is unchanged" if config.resume else "nothing was saved"
    return (
        f"shardwise train: stopped by {signal.Signals(signum).name} before the first step; {kept}"
    )


def plot(out: Path, rows: list[dict[str, Any]], title: str, unit: str = "byte") -> None:
    """loss.png (train and validation loss) and throughput.png (tokens/s and peak memory)."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    steps = [r["step"] for r in rows]
    fig = Figure(figsize=(7, 4), layout="tight")
    ax = fig.add_subplot()
    ax.plot(steps, [r["loss"] for r in rows], lw=1, label="train")
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    if val:
        ax.plot(*zip(*val), "o-", ms=4, label="validation")
    ax.set(xlabel="step", ylabel=f"loss (nats per {unit})", title=f"loss: {title}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(out / "loss.png", dpi=120)

    fig = Figure(figsize=(7, 5), layout="tight")
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.plot(steps, [r["tokens_per_s"] for r in rows], lw=1)
    top.set(ylabel="tokens/s", title=f"throughput: {title}")
    bottom.plot(steps, [r["peak_mem_bytes"] / 2**20 for r in rows], lw=1, color="tab:red")
    bottom.set(xlabel="step", ylabel="peak memory (MiB)")
    for a in (top, bottom):
        a.grid(alpha=0.3)
    fig.savefig(out / "throughput.png", dpi=120)


def _si(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


def _bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []
