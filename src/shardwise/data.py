"""Byte-level text data: a corpus in memory and a batch sampler that resumes exactly.

The default corpus needs no download and is real text on every machine: the
Python standard library's own ``.py`` sources, read in sorted order and capped
to a few MB. Generated tables (``encodings``) and test suites are skipped, so
what the model sees is ordinary, varied code.

Batches are a pure function of ``(seed, step)``: resuming at step N draws
exactly what an uninterrupted run would have drawn, with no sampler state to
save. Every rank draws the same global batch of window offsets and reads only
its own slice of them.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_MAX_BYTES = 4 * 1024 * 1024
VAL_FRACTION = 0.05
_SKIP_DIRS = {
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idle_test",
    "encodings",
    "__pycache__",
}


class DataError(ValueError):
    """The data cannot be used (missing, empty, too short); the message says why."""


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # uint8 bytes
    val: torch.Tensor
    source: str  # where it came from, for humans and config.json
    n_files: int
    sha256: str  # of the whole corpus, to notice a resume on different data

    def describe(self) -> dict[str, object]:
        return {
            "source": self.source,
            "files": self.n_files,
            "sha256": self.sha256,
            "train_bytes": self.train.numel(),
            "val_bytes": self.val.numel(),
        }


def stdlib_sources() -> list[Path]:
    """The standard library's ``.py`` files, sorted by path relative to the stdlib root."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place: the stdlib folder often holds a large site-packages.
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        found += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def text_files(folder: Path) -> list[Path]:
    """Every non-hidden regular file under ``folder`` that does not look binary, sorted."""
    found = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for f in filenames:
            p = Path(dirpath, f)
            if not f.startswith(".") and p.is_file() and not _looks_binary(p):
                found.append(p)
    return sorted(found, key=lambda p: p.relative_to(folder).as_posix())


def _looks_binary(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" in f.read(8192)


def check_data_path(path: str | None) -> None:
    """Raise ``DataError`` unless ``path`` is None (default corpus), a file, or a folder."""
    if path is None:
        return
    p = Path(path)
    if not p.exists():
        raise DataError(f"--data {path}: no such file or folder")
    if not (p.is_file() or p.is_dir()):
        raise DataError(f"--data {path}: not a regular file or a folder")
    # The same test a folder applies to each of its files, so a binary file
    # given by name is not read as text either.
    try:
        binary = p.is_file() and _looks_binary(p)
    except OSError as e:
        raise DataError(f"--data {path}: cannot read it ({e.strerror})") from None
    if binary:
        raise DataError(f"--data {path}: looks binary (it holds NUL bytes); give a text file")


def load_corpus(
    path: str | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES, min_split_bytes: int = 2
) -> Corpus:
    """Read the corpus and split it: the last ``VAL_FRACTION`` of the bytes is validation.

    ``path``: None for the standard library, a text file, or a folder of text
    files. ``max_bytes`` caps only the default corpus. Both splits must hold
    at least ``min_split_bytes`` (one window plus its next-byte target).
    """
    check_data_path(path)
    if path is None:
        files, source, cap = stdlib_sources(), "python-stdlib", max_bytes
    else:
        p = Path(path)
        files = [p] if p.is_file() else text_files(p)
        source, cap = str(p.resolve()), None
        if not files:
            raise DataError(f"--data {path}: the folder holds no text files")
    chunks, total = [], 0
    for f in files:
        try:
            chunks.append(f.read_bytes())
        except OSError as e:
            raise DataError(f"--data {f}: cannot read it ({e.strerror})") from None
        total += len(chunks[-1]) + 2
        if cap is not None and total >= cap:
            break
    # A blank line between files, so one file's end does not run into the next's start.
    raw = b"\n\n".join(chunks)[:cap]
    n_val = max(min_split_bytes, int(len(raw) * VAL_FRACTION))
    if len(raw) - n_val < min_split_bytes:
        raise DataError(
            f"--data {path or source}: {len(raw)} bytes is too little text; it needs at least "
            f"{min_split_bytes + n_val} bytes for windows of this --seq-len and a validation split"
        )
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return Corpus(
        data[:-n_val], data[-n_val:], source, len(chunks), hashlib.sha256(raw).hexdigest()
    )


class BatchSampler:
    """This rank's share of each global batch of ``seq_len`` windows, from ``(seed, step)``.

    A global batch of ``batch_size`` windows is split into ``grad_accum``
    microbatches, and each microbatch into ``world`` equal slices, one per
    rank. The union over ranks and microbatches is the same global batch for
    any world size, so the loss curve does not depend on how many ranks ran it.
    """

    def __init__(
        self,
        data: torch.Tensor,
        *,
        seq_len: int,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world: int = 1,
        grad_accum: int = 1,
    ) -> None:
        if batch_size % (world * grad_accum):
            raise ValueError(
                f"batch size {batch_size} is not divisible by world {world} "
                f"x grad accum {grad_accum}"
            )
        if data.numel() < seq_len + 1:
            raise ValueError(f"{data.numel()} bytes cannot hold one window of {seq_len + 1}")
        self.data, self.seq_len, self.batch_size, self.seed = data, seq_len, batch_size, seed
        self.rank, self.world, self.grad_accum = rank, world, grad_accum
        self.micro = batch_size // (world * grad_accum)

    def offsets(self, step: int) -> torch.Tensor:
        """Window starts of the whole global batch of ``step`` (the same on every rank)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return torch.randint(0, self.data.numel() - self.seq_len, (self.batch_size,), generator=g)

    def batch(self, step: int, micro_step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-byte targets ``[micro, seq_len]`` (int64) for this rank."""
        start = (micro_step * self.world + self.rank) * self.micro
        return windows(self.data, self.offsets(step)[start : start + self.micro], self.seq_len)


def windows(
    data: torch.Tensor, offsets: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.stack([data[o : o + seq_len + 1] for o in offsets.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]


def eval_offsets(
    data: torch.Tensor, *, seq_len: int, n: int, rank: int = 0, world: int = 1
) -> torch.Tensor:
    """This rank's share of ``n`` evenly spaced validation windows (fixed: no randomness)."""
    last = data.numel() - seq_len - 1
    every = torch.linspace(0, max(last, 0), n).round().long()
    return every[rank::world]
