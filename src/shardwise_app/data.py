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
import json
import os
import sysconfig
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

DEFAULT_MAX_BYTES = 4 * 1024 * 1024
VAL_FRACTION = 0.05
TOKENS, TOKENS_META = "tokens.bin", "tokens.json"  # in the cache folder
_CHUNK = 16 * 1024 * 1024  # bytes copied at a time
_TOKENIZE_BATCH, _TOKENIZE_BYTES = 64, 16 * 1024 * 1024  # documents a tokenizer sees at once
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
    cache: Path | None = None,
) -> Corpus:
    """Tokenize the corpus into a token file and split it: the last ``VAL_FRACTION`` is validation.

    ``path``: None for the standard library, a text file, or a folder of text
    files. ``max_bytes`` caps only the default corpus. Both splits must hold
    at least ``min_split_bytes`` (one window plus its next-byte target).

    With a ``tokenizer`` (a transformers one), each file is one document,
    tokenized on its own, and the documents are packed into one stream with
    the tokenizer's EOS token after each; the splits and ``min_split_bytes``
    then count tokens. Without one, the tokens are the bytes, files joined by
    a blank line.

    The tokens are written, streaming, to ``cache/tokens.bin`` (and what they
    were made from to ``cache/tokens.json``) and returned memory-mapped, so a
    corpus of many GB costs each reader only the pages its windows touch. A
    cache made from the same files (sizes, modification times) and tokenizer
    is used as it is. Without ``cache``, a temporary file is used.
    """
    if cache is None:
        with tempfile.TemporaryDirectory(prefix="shardwise-corpus-") as tmp:
            # The mapping outlives the removed file (POSIX); the disk space goes with it.
            return load_corpus(
                path,
                max_bytes=max_bytes,
                min_split_bytes=min_split_bytes,
                tokenizer=tokenizer,
                cache=Path(tmp),
            )
    files, source, cap = _files(path, max_bytes)
    key = {
        "format": 1,
        "source": source,
        "cap": cap,
        "files": [[str(f), *_stamp(f)] for f in files],
        "tokenizer": _tokenizer_key(tokenizer),
    }
    meta = _read_meta(cache, key)
    if meta is None:
        meta = _write_tokens(cache, key, files, cap, tokenizer)
    return _open(cache, meta, path or source, min_split_bytes)


def open_tokens(cache: Path, *, min_split_bytes: int = 2) -> Corpus:
    """The corpus a ``load_corpus(..., cache=cache)`` wrote, memory-mapped; nothing is rewritten.

    For readers that must not race its writer: the ranks of a run, once the
    launcher has written it.
    """
    try:
        meta = json.loads((cache / TOKENS_META).read_text())
    except (OSError, ValueError):
        raise DataError(f"{cache / TOKENS_META}: missing or unreadable (tokenize again)") from None
    return _open(cache, meta, str(cache), min_split_bytes)


def _files(path: str | None, max_bytes: int) -> tuple[list[Path], str, int | None]:
    """The corpus's files in order, where they are from, and the byte cap (default corpus)."""
    check_data_path(path)
    if path is None:
        return stdlib_sources(), "python-stdlib", max_bytes
    p = Path(path)
    files = [p] if p.is_file() else text_files(p)
    if not files:
        raise DataError(f"--data {path}: the folder holds no text files")
    return files, str(p.resolve()), None


def _stamp(f: Path) -> tuple[int, int]:
    try:
        st = f.stat()
    except OSError as e:
        raise DataError(f"--data {f}: cannot read it ({e.strerror})") from None
    return st.st_size, st.st_mtime_ns


def _tokenizer_key(tokenizer: Any) -> Any:
    """What makes two tokenizers give the same ids, as far as can be seen cheaply."""
    if tokenizer is None:
        return "bytes"
    folder = Path(str(getattr(tokenizer, "name_or_path", "")))
    files = sorted(folder.iterdir()) if folder.is_dir() else []
    return {
        "class": type(tokenizer).__name__,
        "name": str(folder),
        "vocab": len(tokenizer),
        "eos": tokenizer.eos_token_id,
        "files": [
            [f.name, *_stamp(f)] for f in files if f.is_file() and f.suffix != ".safetensors"
        ],
    }


def _read_meta(cache: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """The cache's description if it was made from exactly ``key`` and is whole."""
    try:
        meta = json.loads((cache / TOKENS_META).read_text())
        size = (cache / TOKENS).stat().st_size
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("key") != key:
        return None
    if size != meta.get("tokens", -1) * np.dtype(meta.get("dtype", "u1")).itemsize:
        return None
    return meta


class _Sink:
    """The token file being written, in order, with the sha256 of the text it came from."""

    def __init__(self, f: BinaryIO, cap: int | None) -> None:
        self.f, self.cap, self.sha = f, cap, hashlib.sha256()
        self.text_bytes, self.tokens = 0, 0

    def text(self, b: bytes) -> bytes:
        """Count ``b`` as corpus text (cut at the cap); return what was kept."""
        if self.cap is not None:
            b = b[: max(0, self.cap - self.text_bytes)]
        self.sha.update(b)
        self.text_bytes += len(b)
        return b

    def write(self, ids: np.ndarray) -> None:
        self.f.write(ids.tobytes())
        self.tokens += ids.size


def _write_tokens(
    cache: Path, key: dict[str, Any], files: list[Path], cap: int | None, tokenizer: Any
) -> dict[str, Any]:
    """``_stream_tokens``, with a failed write (a full disk) said in one line."""
    try:
        return _stream_tokens(cache, key, files, cap, tokenizer)
    except OSError as e:
        (cache / (TOKENS + ".partial")).unlink(missing_ok=True)
        raise DataError(
            f"--data: writing its tokens to {cache} failed ({e.strerror or e}); free space "
            "there or choose another --out"
        ) from None


def _stream_tokens(
    cache: Path, key: dict[str, Any], files: list[Path], cap: int | None, tokenizer: Any
) -> dict[str, Any]:
    """Stream the files into ``cache/tokens.bin``: bytes as they are, or token ids.

    Memory stays bounded: bytes are copied in chunks; a tokenizer sees one
    batch of documents at a time (so one file at most, whole).
    """
    cache.mkdir(parents=True, exist_ok=True)
    partial = cache / (TOKENS + ".partial")
    dtype = np.dtype(np.uint8 if tokenizer is None else np.int32)
    n_files, total = 0, 0
    with open(partial, "wb") as f:
        sink = _Sink(f, cap)
        batch: list[bytes] = []
        for i, path in enumerate(files):
            if cap is not None and total >= cap:
                break
            n_files += 1
            try:
                if tokenizer is None:
                    total += _copy_bytes(path, sink, first=i == 0) + 2
                else:
                    doc = path.read_bytes()
                    total += len(doc) + 2
                    if i > 0:
                        sink.text(b"\n\n")
                    # As the cap cuts the joined text, so it cuts its last document.
                    batch.append(sink.text(doc))
                    if len(batch) == _TOKENIZE_BATCH or sum(map(len, batch)) > _TOKENIZE_BYTES:
                        _tokenize(batch, tokenizer, sink)
                        batch = []
            except OSError as e:
                raise DataError(f"--data {path}: cannot read it ({e.strerror})") from None
        if batch:
            _tokenize(batch, tokenizer, sink)
        f.flush()
        os.fsync(f.fileno())
    meta = {
        "key": key,
        "dtype": dtype.str,
        "tokens": sink.tokens,
        "unit": "bytes" if tokenizer is None else "tokens",
        "files": n_files,
        "sha256": sink.sha.hexdigest(),
    }
    os.replace(partial, cache / TOKENS)
    tmp = cache / (TOKENS_META + ".partial")
    tmp.write_text(json.dumps(meta) + "\n")
    os.replace(tmp, cache / TOKENS_META)  # last: its presence says the tokens are whole
    return meta


def _copy_bytes(path: Path, sink: _Sink, first: bool) -> int:
    """Append one file's bytes (after a blank line unless ``first``); return its length."""
    n = 0
    if not first:
        sink.write(np.frombuffer(sink.text(b"\n\n"), dtype=np.uint8))
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            n += len(chunk)
            sink.write(np.frombuffer(sink.text(chunk), dtype=np.uint8))
    return n


def _tokenize(docs: list[bytes], tokenizer: Any, sink: _Sink) -> None:
    """Each document tokenized on its own, with EOS after each (none if the tokenizer has none)."""
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    texts = [d.decode("utf-8", errors="replace") for d in docs]
    # verbose=False: documents longer than the model's context are expected here
    for ids in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]:
        sink.write(np.asarray([*ids, *eos], dtype=np.int32))


def _open(cache: Path, meta: dict[str, Any], where: str, min_split: int) -> Corpus:
    """The token file memory-mapped read-only, split into train and validation."""
    n = int(meta["tokens"])
    if n:
        mapped = np.memmap(cache / TOKENS, dtype=np.dtype(meta["dtype"]), mode="r", shape=(n,))
        with warnings.catch_warnings():
            # Read-only on purpose: nothing writes into the corpus.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            data = torch.from_numpy(mapped)
    else:
        data = torch.zeros(0, dtype=torch.uint8 if meta["unit"] == "bytes" else torch.int32)
    unit = meta["unit"]
    n_val = max(min_split, int(n * VAL_FRACTION))
    if n - n_val < min_split:
        raise DataError(
            f"--data {where}: {n} {unit} is too little text; it needs at "
            f"least {min_split + n_val} {unit} for windows of this --seq-len and a "
            "validation split"
        )
    source = str(meta["key"]["source"])
    return Corpus(data[:-n_val], data[-n_val:], source, int(meta["files"]), meta["sha256"], unit)


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
