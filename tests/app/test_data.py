"""The training corpus: tokenized once into a memory-mapped file, the same tokens and batches
as reading it into memory, and a corpus of 512 MB trains in the memory of one of 1 MB."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from cli_helpers import alive, children, start
from shardwise_app import data
from shardwise_app.data import BatchSampler, eval_offsets, load_corpus, windows


def _write_texts(folder: Path) -> list[Path]:
    folder.mkdir()
    rng = np.random.default_rng(0)
    files = []
    for i, n in enumerate((5_000, 17, 40_000)):
        text = bytes(rng.integers(32, 127, n, dtype=np.uint8)).replace(b"~", b"\n")
        files.append(folder / f"{i}.txt")
        files[-1].write_bytes(text)
    return files


def _in_memory(files: list[Path], cap: int | None, min_split: int) -> tuple[torch.Tensor, ...]:
    """What every rank held before the token file: the files joined by a blank line."""
    raw = b"\n\n".join(f.read_bytes() for f in files)[:cap]
    whole = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    n_val = max(min_split, int(whole.numel() * data.VAL_FRACTION))
    return whole[:-n_val], whole[-n_val:]


@pytest.mark.parametrize("which", ["folder", "file", "default"])
def test_the_token_file_gives_the_same_tokens_and_batches(which: str, tmp_path: Path) -> None:
    files = _write_texts(tmp_path / "texts")
    cap = None
    if which == "file":
        files = files[2:]
    if which == "default":
        cap = 300_001  # the standard library's sources, cut inside a file
        files = data.stdlib_sources()[:200]
    given = None if which == "default" else str(files[0] if which == "file" else tmp_path / "texts")
    corpus = load_corpus(
        given, max_bytes=cap or data.DEFAULT_MAX_BYTES, min_split_bytes=65, cache=tmp_path / "c"
    )
    train, val = _in_memory(files, cap, 65)
    assert torch.equal(corpus.train, train) and torch.equal(corpus.val, val)
    assert (tmp_path / "c" / data.TOKENS).stat().st_size == train.numel() + val.numel()
    for rank in (0, 1):
        kw = dict(seq_len=64, batch_size=8, seed=3, rank=rank, world=2, grad_accum=2)
        new, old = BatchSampler(corpus.train, **kw), BatchSampler(train, **kw)  # type: ignore[arg-type]
        for step in (1, 2, 7):
            for micro in (0, 1):
                for a, b in zip(new.batch(step, micro), old.batch(step, micro)):
                    assert torch.equal(a, b)
        offsets = eval_offsets(corpus.val, seq_len=64, n=6, rank=rank, world=2)
        assert torch.equal(offsets, eval_offsets(val, seq_len=64, n=6, rank=rank, world=2))
        for a, b in zip(windows(corpus.val, offsets, 64), windows(val, offsets, 64)):
            assert torch.equal(a, b)


def test_the_token_file_is_reused_until_a_file_changes(tmp_path: Path, monkeypatch) -> None:
    files = _write_texts(tmp_path / "texts")
    first = load_corpus(str(tmp_path / "texts"), cache=tmp_path / "c")
    written = data._write_tokens
    calls = []
    monkeypatch.setattr(data, "_write_tokens", lambda *a: calls.append(1) or written(*a))
    again = load_corpus(str(tmp_path / "texts"), cache=tmp_path / "c")
    assert calls == [] and again.sha256 == first.sha256
    with open(files[1], "ab") as f:
        f.write(b" and more")
    changed = load_corpus(str(tmp_path / "texts"), cache=tmp_path / "c")
    assert calls == [1] and changed.sha256 != first.sha256
    assert (
        changed.train.numel() + changed.val.numel() == first.train.numel() + first.val.numel() + 9
    )


# ---- bounded memory: each rank maps the corpus, it does not hold it ------------------------


def _peak_rss_of_workers(args: list[str], cwd: Path, timeout: float = 240) -> list[int]:
    """Run ``shardwise train ARGS``; each worker's peak resident memory (VmHWM), in bytes,
    read from /proc until it exits. Returned in rank order."""
    proc = start("train", *args, cwd=cwd)
    peaks: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        for pid in children(proc.pid) if alive(proc.pid) else []:
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue  # it just ended
            rank = next((int(v[5:]) for v in env if v.startswith(b"RANK=")), None)
            hwm = next((line for line in status.splitlines() if line.startswith("VmHWM:")), None)
            if rank is not None and hwm is not None:
                peaks[rank] = max(peaks.get(rank, 0), int(hwm.split()[1]) * 1024)
        time.sleep(0.02)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, out + err
    assert sorted(peaks) == [0, 1], peaks
    return [peaks[0], peaks[1]]


def _corpus_file(path: Path, mib: int) -> None:
    rng = np.random.default_rng(1)
    block = bytes(rng.integers(32, 127, 1 << 20, dtype=np.uint8))
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(block)


@pytest.mark.timeout(420)
def test_a_512_mb_corpus_trains_in_the_memory_of_a_1_mb_one(tmp_path: Path) -> None:
    run = ["--steps", "2", "--batch-size", "4", "--seq-len", "32", "--eval-every", "2"]
    run += ["--eval-batches", "1", "--nproc", "2"]
    try:
        _corpus_file(tmp_path / "small.txt", 1)
        _corpus_file(tmp_path / "big.txt", 512)
        small = _peak_rss_of_workers([*run, "--data", "small.txt", "--out", "s"], tmp_path)
        big = _peak_rss_of_workers([*run, "--data", "big.txt", "--out", "b"], tmp_path)
        for rank in (0, 1):
            grew = big[rank] - small[rank]
            assert grew < 100 << 20, f"rank {rank}: {small[rank] >> 20} -> {big[rank] >> 20} MiB"
        print(
            f"peak RSS per rank, MiB: 1 MB corpus {[m >> 20 for m in small]}, 512 MB {[m >> 20 for m in big]}"
        )
        assert (tmp_path / "b" / "corpus" / data.TOKENS).stat().st_size == 512 << 20
    finally:
        for name in ("big.txt", "small.txt", "b", "s"):
            path = tmp_path / name
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)


def test_a_failed_write_of_the_token_file_is_one_clear_error(tmp_path: Path, monkeypatch) -> None:
    import errno

    _write_texts(tmp_path / "texts")

    def full(cache: Path, *args: object) -> None:
        cache.mkdir()
        (cache / (data.TOKENS + ".partial")).write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(data, "_stream_tokens", full)
    with pytest.raises(data.DataError, match="No space left on device.*free space there"):
        load_corpus(str(tmp_path / "texts"), cache=tmp_path / "c")
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == []  # no half file left
