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
from typing import Any

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
    train: torch.Tensor  # uint8 bytes, or int32 token ids
    val: torch.Tensor
    source: str  # where it came from, for humans and config.json
    n_files: int
    sha256: str  # of the whole corpus, to notice a resume on different data
    unit: str = "bytes"  # or "tokens": what train and val hold

    def describe(self) -> dict[str, object]:
        return {
            "source": self.source,
            "files": self.n_files,
            "sha256": self.sha256,
            f"train_{self.unit}": self.train.numel(),
            f"val_{self.unit}": self.val.numel(),
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
    path: str | None = None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    min_split_bytes: int = 2,
    tokenizer: Any = None,
) -> Corpus:
    """Read the corpus and split it: the last ``VAL_FRACTION`` of it is validation.

    ``path``: None for the standard library, a text file, or a folder of text
    files. ``max_bytes`` caps only the default corpus. Both splits must hold
    at least ``min_split_bytes`` (one window plus its next-byte target).

    With a ``tokenizer`` (a transformers one), each file is one document,
    tokenized on its own, and the documents are packed into one stream with
    the tokenizer's EOS token after each; the splits and ``min_split_bytes``
    then count tokens.
    """
    chunks, source = _read(path, max_bytes)
    # A blank line between files, so one file's end does not run into the next's start.
    raw = b"\n\n".join(chunks)[: max_bytes if path is None else None]
    sha = hashlib.sha256(raw).hexdigest()
    if tokenizer is None:
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        unit = "bytes"
    else:
        # The default corpus's cap may cut its last file short: so are its documents.
        data = _tokens(_cap(chunks, len(raw)) if path is None else chunks, tokenizer)
        unit = "tokens"
    n_val = max(min_split_bytes, int(data.numel() * VAL_FRACTION))
    if data.numel() - n_val < min_split_bytes:
        raise DataError(
            f"--data {path or source}: {data.numel()} {unit} is too little text; it needs at "
            f"least {min_split_bytes + n_val} {unit} for windows of this --seq-len and a "
            "validation split"
        )
    return Corpus(data[:-n_val], data[-n_val:], source, len(chunks), sha, unit)


def _read(path: str | None, max_bytes: int) -> tuple[list[bytes], str]:
    """The files' contents in order (the default corpus up to ``max_bytes``), and where from."""
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
    return chunks, source


def _cap(chunks: list[bytes], n: int) -> list[bytes]:
    """The documents within the first ``n`` bytes of their blank-line-joined text."""
    out, used = [], 0
    for c in chunks:
        if used >= n:
            break
        out.append(c[: n - used])
        used += len(c) + 2
    return out


def _tokens(docs: list[bytes], tokenizer: Any, batch: int = 64) -> torch.Tensor:
    """Each document tokenized on its own, then packed, with EOS after each (int32 ids).

    A tokenizer without an EOS token packs the documents back to back.
    """
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    parts = []
    for i in range(0, len(docs), batch):
        texts = [d.decode("utf-8", errors="replace") for d in docs[i : i + batch]]
        # verbose=False: documents longer than the model's context are expected here
        ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
        for doc in ids:
            parts.append(torch.tensor([*doc, *eos], dtype=torch.int32))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)


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
