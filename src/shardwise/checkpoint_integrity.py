"""Is a checkpoint folder whole? Bytes that went bad are named, never loaded.

DCP records where each tensor lies in its files but nothing about the bytes,
so bit rot or a bad copy of the same length loads quietly (and a model
trained on from it diverges later, far from the cause). Every save records,
next to the data, ``shardwise_checksums.json``: each file's length and CRC-32.

Why CRC-32: it catches every burst of flipped bits shorter than 32 and all
but 1 in 4 billion others, which is what disks and copies do. It is no seal:
whoever crafts a checkpoint writes matching sums, or none. What keeps a
crafted checkpoint from running code is how its files are read
(``safe_load.py``), and ``verify`` reads every one of them that way, so it
refuses such a folder (``UnsafeCheckpoint``) before any load touches a model.
``zlib.crc32`` runs at a few GB/s, read in large chunks, so the checksum is a
small part of a save that writes (and fsyncs) the same bytes.

``verify`` also checks what a crash, a full disk or a partial copy leaves
(unreadable metadata, a missing or short file), which old checkpoints,
saved without checksums, get alone.

Each rank checksums the files it has just written, while they are likely
still in its page cache; at load, ranks split the files between them.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.futures import Future

from . import safe_load
from .comm import collectives
from .safe_load import UnsafeCheckpoint

CHECKSUM_FILE = "shardwise_checksums.json"
EXTRA_FILE = "shardwise_extra.pt"
_CHUNK = 16 * 1024 * 1024  # large reads: the CRC, not the syscalls, sets the pace

# name -> {"bytes": length, "crc32": value}
Sums = dict[str, dict[str, int]]


class DamagedCheckpoint(ValueError):
    """A checkpoint folder some file of which cannot be read back; the message names it."""


def file_sum(path: Path) -> dict[str, int]:
    """The length and CRC-32 of one file, read in large chunks into one buffer."""
    crc, n = 0, 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            got = f.readinto(buf)
            if not got:
                break
            crc = zlib.crc32(view[:got], crc)
            n += got
    return {"bytes": n, "crc32": crc}


def sums_of(folder: Path, names: Iterable[str]) -> Sums:
    return {name: file_sum(folder / name) for name in sorted(set(names))}


def write(folder: Path, sums: Mapping[str, Mapping[str, int]]) -> None:
    """Write the checksum file durably (it is part of what makes the checkpoint whole)."""
    with open(folder / CHECKSUM_FILE, "w") as f:
        json.dump({"format": 1, "algorithm": "crc32", "files": dict(sorted(sums.items()))}, f)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def read(folder: Path) -> Sums | None:
    """The recorded checksums; None for a checkpoint saved without them."""
    path = folder / CHECKSUM_FILE
    if not path.exists():
        return None
    try:
        files = json.loads(path.read_text())["files"]
        return {
            str(k): {"bytes": int(v["bytes"]), "crc32": int(v["crc32"])} for k, v in files.items()
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise DamagedCheckpoint(f"{path} is unreadable ({type(e).__name__})") from None


def check(folder: Path, sums: Mapping[str, Mapping[str, int]], names: Iterable[str]) -> None:
    """Compare the files ``names`` with their recorded sums; raise for the first that differs."""
    for name in names:
        path, want = folder / name, sums[name]
        try:
            size = path.stat().st_size
        except OSError:
            raise DamagedCheckpoint(f"{path} is missing") from None
        if size < want["bytes"]:
            raise DamagedCheckpoint(f"{path} is truncated ({size} of {want['bytes']} bytes)")
        if size > want["bytes"]:
            raise DamagedCheckpoint(
                f"{path} is damaged: {size} bytes, {want['bytes']} when it was saved"
            )
        got = file_sum(path)["crc32"]
        if got != want["crc32"]:
            raise DamagedCheckpoint(
                f"{path} is damaged: its bytes are not those saved (crc32 {got:08x}, "
                f"{want['crc32']:08x} at save)"
            )


class ChecksummingWriter(dcp.FileSystemWriter):
    """DCP's file writer that checksums, on each rank, the files that rank wrote.

    The sums are left in ``sums`` for the save to collect; the files are named
    by DCP's own write results, not by guessing its naming scheme.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self.sums: Sums = {}

    def write_data(self, plan: Any, planner: Any) -> Future[Any]:
        results = super().write_data(plan, planner).wait()
        names = {r.storage_data.relative_path for r in results}
        self.sums = sums_of(Path(self.path), names)
        done: Future[Any] = Future()
        done.set_result(results)
        return done


# ---- verifying a folder ----------------------------------------------------------------


def verify(path: str | os.PathLike[str]) -> None:
    """Check that every file of a checkpoint is present and holds the bytes saved.

    Reads every file once: each is compared with the length and CRC-32
    recorded at save. Then the metadata, ``extra`` and DCP's non-tensor items
    must load without running code (``safe_load.py``) and each shard file be
    as long as the metadata says. A checkpoint saved without checksums gets
    only the second part: bytes damaged in place go unnoticed there. Raises
    ``DamagedCheckpoint`` naming the file, or ``UnsafeCheckpoint`` naming the
    file and the code it would run; loads no tensor and runs nothing.
    """
    path = Path(path)
    sums = read(path)
    if sums is not None:
        check(path, sums, sorted(sums))
    _check_structure(path, sums is not None)


def verify_shared(path: Path) -> Any:
    """``verify`` for ``load``: each rank reads its share of the files, all learn the outcome.

    Returns what ``shardwise_extra.pt`` holds (None without one), read on the way."""
    rank, world = collectives.rank(), collectives.world_size()
    problem: tuple[bool, str] | None = None  # (unsafe, message)
    payload = None
    try:
        sums = read(path)
        if sums is not None:
            check(path, sums, sorted(sums)[rank::world])
        payload = _check_structure(path, sums is not None)
    except (DamagedCheckpoint, UnsafeCheckpoint) as e:
        problem = (isinstance(e, UnsafeCheckpoint), str(e))
    if world > 1:
        problem = next((p for p in collectives.all_gather_objects(problem) if p), None)
    if problem is not None:
        unsafe, message = problem
        raise (UnsafeCheckpoint if unsafe else DamagedCheckpoint)(message)
    return payload


def _check_structure(path: Path, with_sums: bool) -> Any:
    """What a crash, a full disk or a partial copy leaves: unreadable metadata or
    ``extra``, a missing or short shard file, a lost checksum file; and any file that
    would run code when loaded (``UnsafeCheckpoint``, raised as it is). Returns what
    ``extra`` holds (None without one)."""
    try:
        metadata = safe_load.read_metadata(path / safe_load.METADATA_FILE)
        needed: dict[str, int] = {}
        for info in dict(metadata.storage_data).values():
            end = int(info.offset) + int(info.length)
            needed[str(info.relative_path)] = max(needed.get(str(info.relative_path), 0), end)
    except UnsafeCheckpoint:
        raise
    except Exception as e:  # noqa: BLE001 - junk unpickles into any error type
        raise DamagedCheckpoint(
            f"{path / safe_load.METADATA_FILE} is unreadable ({type(e).__name__})"
        ) from None
    for name, size in sorted(needed.items()):
        if Path(name).name != name or name in (".", ".."):  # DCP writes plain file names
            raise DamagedCheckpoint(
                f"{path / safe_load.METADATA_FILE} names a data file outside the folder: {name!r}"
            )
        try:
            have = (path / name).stat().st_size
        except OSError:
            raise DamagedCheckpoint(f"{path / name} is missing") from None
        if have < size:
            raise DamagedCheckpoint(f"{path / name} is truncated ({have} of {size} bytes)")
    try:
        safe_load.check_bytes_items(path, metadata)
    except UnsafeCheckpoint:
        raise
    except Exception as e:  # noqa: BLE001
        raise DamagedCheckpoint(
            f"a non-tensor item of {path} is unreadable ({type(e).__name__})"
        ) from None
    extra = path / EXTRA_FILE
    if not extra.exists():
        return None
    payload = read_extra(extra)
    saved_with_sums = isinstance(payload, dict) and payload.get("format", 1) >= 2
    if saved_with_sums and not with_sums:
        raise DamagedCheckpoint(
            f"{path / CHECKSUM_FILE} is missing (the checkpoint was saved with it)"
        )
    return payload


def read_extra(file: Path) -> Any:
    """``shardwise_extra.pt``, read without running code; ``DamagedCheckpoint`` if it is junk,
    ``UnsafeCheckpoint`` if it would run code."""
    try:
        return safe_load.read_extra(file)
    except UnsafeCheckpoint:
        raise
    except Exception as e:  # noqa: BLE001
        raise DamagedCheckpoint(f"{file} is unreadable ({type(e).__name__})") from None
