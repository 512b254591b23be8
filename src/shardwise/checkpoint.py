"""Checkpoints of sharded models: resume exactly, reshard, export.

Three workflows (docs/checkpointing.md walks through each):

- Resume: ``save(path, model, optimizer, extra)`` / ``load(path, model, optimizer)``
  write and read a ``torch.distributed.checkpoint`` (DCP) folder. Every rank
  writes only its own shards, so saving never gathers the model.
- Reshard: DCP stores global shapes and each shard's offset, so a checkpoint
  saved at N ranks loads at M ranks (or into a plain single-process model).
- Export: ``full_state_dict(model)`` gathers plain tensors for ``torch.save``
  or safetensors; ``load_full_state_dict(model, sd)`` shards one back in.

Why a helper at all, when ``dcp.save(model.state_dict())`` already works:

- Crash safety. A save writes into ``<path>.partial`` and rank 0 renames it to
  ``<path>`` only once every rank's data, the DCP metadata and ``extra`` are on
  disk. The previous checkpoint is moved aside to ``<path>.previous`` first and
  deleted last, so at every instant one complete checkpoint exists; ``load``
  falls back to ``<path>.previous`` in the one window where ``<path>`` is gone.
- Damaged bytes are named, never loaded. Every file's length and CRC-32 are
  recorded at save (``checkpoint_integrity.py``) and compared at load and by
  ``verify(path)``; checkpoints saved without them still load, unverified.
- Exact resume needs more than weights: the step, the data position (``extra``)
  and each rank's random number generator states (dropout masks).
- Clear errors. DCP silently skips unexpected keys, silently casts dtypes and
  wraps errors in a per-rank ``CheckpointException``. We compare the model with
  the checkpoint's metadata first and raise one ``ValueError`` naming each key
  and both shapes, before anything in the model is touched.
- Loading runs no code from the folder. Checkpoints travel, and a pickle can
  call anything: ``extra`` and the RNG states are saved as plain data that
  ``torch.load(weights_only=True)`` reads (an ``extra`` it could not is
  refused at save), and DCP's metadata and non-tensor items are read by
  unpicklers that admit only what DCP writes (``safe_load.py``). A file that
  names anything else raises ``UnsafeCheckpoint`` before any tensor is loaded.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import random
import shutil
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from . import checkpoint_integrity as integrity
from . import safe_load
from .checkpoint_integrity import EXTRA_FILE, DamagedCheckpoint, verify
from .comm import collectives
from .layout.flat_shard import local_of
from .runtime.fsdp_module import FSDPModule
from .safe_load import UnsafeCheckpoint

__all__ = [
    "DamagedCheckpoint",
    "UnsafeCheckpoint",
    "full_state_dict",
    "load",
    "load_full_state_dict",
    "save",
    "verify",
]

# 2: with shardwise_checksums.json; 3: the RNG states as tensors and numbers, so that the
# whole file loads with torch.load(weights_only=True) and nothing else.
_FORMAT = 3


# ---- ranks ------------------------------------------------------------------------------


def _distributed() -> bool:
    return collectives.initialized()


def _rank() -> int:
    return collectives.rank()


def _world() -> int:
    return collectives.world_size()


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every call without a process group; here that mode is intended."""
    with warnings.catch_warnings():
        if not _distributed():
            warnings.filterwarnings("ignore", message="torch.distributed is .*unavailable")
        yield


def _on_rank0(what: str, fn: Callable[[], None]) -> None:
    """Run ``fn`` on rank 0 only; if it fails, every rank raises.

    File operations (clean-up, rename) must happen once, but no rank may carry
    on believing they worked when they did not; the broadcast of the outcome is
    also the barrier that orders them with what every rank does next.
    """
    error: BaseException | None = None
    message: str | None = None
    if _rank() == 0:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            error, message = e, f"{type(e).__name__}: {e}"
    if _world() > 1:
        message = collectives.broadcast_object(message)
    if error is not None:
        raise error
    if message is not None:
        raise RuntimeError(f"{what} failed on rank 0: {message}")


# ---- sharded state ------------------------------------------------------------------------


def _reshard_all(model: nn.Module) -> None:
    """Put every shardwise module back in its sharded form before state dict work.

    A module left gathered (``reshard_after_forward=False`` or
    ``set_reshard_after_backward(False)``) has its full, compute-dtype tensors
    registered as parameters, so ``state_dict()`` would return those instead of
    the sharded DTensors, and loading would write into memory about to be freed.
    """
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _model_state(model: nn.Module, trainable_only: bool = False) -> dict[str, Any]:
    """The model's state dict under canonical names (no ``_orig_mod.``/DDP prefixes).

    ``trainable_only``: parameters that require grad (LoRA adapters), no frozen
    ones and no buffers.
    """
    _reshard_all(model)
    if not trainable_only:
        return get_model_state_dict(model)
    sd = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in sd.items() if k in trainable}


# ---- random number generators -----------------------------------------------------------


def _rng_state() -> dict[str, Any]:
    """This rank's generators, as plain data: tensors, numbers, tuples and strings only."""
    kind, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    version, words, gauss_next = random.getstate()
    # The Mersenne Twister states (uint32 words) as int64 tensors, exact: a tuple of 625
    # ints takes weights_only's unpickler, written in Python, milliseconds to read.
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "words": torch.tensor(words), "gauss": gauss_next},
        "numpy": {
            "kind": str(kind),
            "key": torch.from_numpy(np.asarray(key, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    python = state["python"]
    if isinstance(python, dict):  # format 3; before, getstate()'s own tuple
        python = (python["version"], tuple(python["words"].tolist()), python["gauss"])
    random.setstate(python)
    saved = state["numpy"]
    if isinstance(saved, dict):  # format 3
        key = saved["key"].numpy().astype(np.uint32)
        saved = (saved["kind"], key, saved["pos"], saved["has_gauss"], saved["gauss"])
    np.random.set_state(saved)  # format 2 and before: get_state()'s own tuple
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _gather(mine: Any) -> list[Any]:
    """Every rank's ``mine``, on rank 0 (an empty list elsewhere)."""
    if _world() == 1:
        return [mine]
    return collectives.gather_objects(mine)


# ---- paths ------------------------------------------------------------------------------


def _partial(path: Path) -> Path:
    return path.with_name(path.name + ".partial")


def _previous(path: Path) -> Path:
    return path.with_name(path.name + ".previous")


def _is_checkpoint(path: Path) -> bool:
    return (path / ".metadata").is_file()


def _fsync_dir(path: Path) -> None:
    """Make a rename durable (best effort: not every platform or filesystem allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _begin(path: Path, extra: Any) -> None:
    """Rank 0, before a save: refuse an ``extra`` that would not load back without
    pickle's code, then make the folder ready."""
    safe_load.check_plain(extra)
    _prepare(path)


def _prepare(path: Path) -> None:
    """Rank 0, before a save: repair an interrupted commit, clear a stale partial save."""
    partial, previous = _partial(path), _previous(path)
    if not path.exists() and _is_checkpoint(previous):
        previous.rename(path)  # the last save died between its two renames
    if path.exists() and not (_is_checkpoint(path) or (path.is_dir() and not any(path.iterdir()))):
        raise FileExistsError(
            f"{path} exists and is not a checkpoint; refusing to replace it (choose another path "
            "or remove it)"
        )
    if partial.exists():
        shutil.rmtree(partial)
    if previous.exists():
        shutil.rmtree(previous)
    partial.mkdir(parents=True)


def _commit(path: Path, payload: dict[str, Any], sums: integrity.Sums) -> None:
    """Rank 0, after every rank wrote: add ``extra`` and the checksums, then swap the new
    folder in. ``sums``: every rank's data files'."""
    partial, previous = _partial(path), _previous(path)
    with open(partial / EXTRA_FILE, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    integrity.write(partial, {**sums, **integrity.sums_of(partial, [".metadata", EXTRA_FILE])})
    if path.exists():
        path.rename(previous)
    partial.rename(path)
    _fsync_dir(path.parent)
    if previous.exists():
        shutil.rmtree(previous)


def _resolve(path: Path) -> Path:
    if _is_checkpoint(path):
        return path
    if not path.exists() and _is_checkpoint(_previous(path)):
        warnings.warn(
            f"{path} is missing but {_previous(path)} is complete: a save was interrupted while "
            "replacing it; loading the previous checkpoint",
            stacklevel=3,
        )
        return _previous(path)
    raise FileNotFoundError(f"no checkpoint at {path} (no {path / '.metadata'})")


# ---- save / load ------------------------------------------------------------------------


def save(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Any = None,
    *,
    trainable_only: bool = False,
) -> None:
    """Save a checkpoint to the folder ``path``; call on every rank.

    Each rank writes its own shards of the model (and of the optimizer state)
    with DCP. ``extra`` (step, data position, scheduler state) is plain data:
    dicts, lists, tuples, sets, numbers, strings, bytes, None and plain tensors,
    what loads without running code; anything else raises ``TypeError``
    naming where it is, before anything is written. Rank 0's is kept. Each
    rank's RNG states (torch, CUDA, Python, NumPy) are stored too. Any existing
    checkpoint at ``path`` is replaced only once the new one is complete. All
    ranks must see the same filesystem.

    ``trainable_only`` saves only the parameters that require grad (LoRA
    adapters over a frozen base the run can load again); load it with
    ``trainable_only=True`` into a model whose frozen part is already loaded.
    """
    path = Path(path)
    # Rank 0's extra is the one kept: it is checked there, and every rank learns the outcome.
    _on_rank0("preparing the checkpoint", lambda: _begin(path, extra))
    state: dict[str, Any] = {"model": _model_state(model, trainable_only)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    writer = integrity.ChecksummingWriter(_partial(path))
    with _single_process_quiet():
        dcp.save(state, storage_writer=writer, **_no_dist(dcp.save))
    # One gather for both: each rank's RNG states and the sums of the files it wrote.
    ranks = _gather((_rng_state(), writer.sums))
    payload = {
        "format": _FORMAT,
        "world_size": _world(),
        "extra": extra,
        "rng": [rng for rng, _ in ranks],
    }
    sums = {name: s for _, mine in ranks for name, s in mine.items()}
    _on_rank0("committing the checkpoint", lambda: _commit(path, payload, sums))


def load(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    restore_rng: bool = True,
    trainable_only: bool = False,
) -> Any:
    """Load a checkpoint into ``model`` (and ``optimizer``) in place; return ``extra``.

    Works at any world size: shards are cut from the saved global tensors. The
    model is checked against the checkpoint first (names, shapes, dtypes), so
    a mismatch raises ``ValueError`` and changes nothing. With ``restore_rng``
    each rank gets back the RNG states that rank saved; at a different world
    size, rank ``r`` gets those of saved rank ``r % saved_world_size``.

    Also reads plain DCP checkpoints, e.g. ``dcp.save({"model": sd, "optim": osd})``
    or ``dcp.save(model.state_dict())`` from torch FSDP2; those have no
    ``extra`` and ``None`` is returned.

    ``trainable_only``: the checkpoint was saved with it; the frozen
    parameters and the buffers are left as they are.

    Every file is compared with the checksums recorded at save first (the
    ranks share the reading); a damaged one raises ``DamagedCheckpoint``
    naming it, on every rank, and nothing is loaded. Checkpoints saved
    without checksums load unverified.

    Nothing in the folder runs code: the metadata, ``extra`` and DCP's
    non-tensor items are read by unpicklers that build plain data and DCP's
    own descriptors only, all of them before any tensor is loaded. A file
    that names anything else raises ``UnsafeCheckpoint`` (a ``ValueError``)
    naming the file and what it calls, on every rank, and nothing is loaded.
    """
    path = _resolve(Path(path))
    # Reads every file but the tensors without running code; extra is read there once,
    # before any tensor, and kept.
    payload = integrity.verify_shared(path)
    metadata = safe_load.read_metadata(path / safe_load.METADATA_FILE).state_dict_metadata
    model_sd = _model_state(model, trainable_only)
    prefix = _layout(metadata, model_sd)
    _check_model(path, metadata, model_sd, prefix)
    state: dict[str, Any] = {"model": model_sd} if prefix else dict(model_sd)
    if optimizer is not None:
        if not prefix or not any(k.startswith("optim.") for k in metadata):
            raise ValueError(
                f"checkpoint {path} holds no optimizer state; pass optimizer=None to load the "
                "model only"
            )
        state["optim"] = get_optimizer_state_dict(model, optimizer)
        _check_optimizer(path, metadata, state["optim"])
    with _single_process_quiet():
        dcp.load(
            state,
            storage_reader=safe_load.SafeFileSystemReader(str(path)),
            planner=safe_load.SafeLoadPlanner(),
            **_no_dist(dcp.load),
        )
    loaded = state["model"] if prefix else state
    if trainable_only:
        set_model_state_dict(model, loaded, options=StateDictOptions(strict=False))
    else:
        set_model_state_dict(model, loaded)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])
    if not isinstance(payload, dict):
        return None
    rng = payload.get("rng") or []
    if restore_rng and rng:
        _set_rng_state(rng[_rank() % len(rng)])
    return payload.get("extra")


def _layout(metadata: Mapping[str, Any], model_sd: Mapping[str, Any]) -> str:
    """``"model."`` for our layout (and DCP's usual ``{"model": ...}``), ``""`` for a flat one."""
    nested = sum(f"model.{k}" in metadata for k in model_sd)
    flat = sum(k in metadata for k in model_sd)
    if nested > flat or (nested == flat and any(k.startswith("model.") for k in metadata)):
        return "model."
    return ""


def _shape(size: Any) -> list[int]:
    return list(size)


def _check_model(
    path: Path, metadata: Mapping[str, Any], model_sd: Mapping[str, Any], prefix: str
) -> None:
    """Raise one ValueError listing every key that does not match; change nothing."""
    problems = []
    for key, value in model_sd.items():
        meta = metadata.get(prefix + key)
        if not isinstance(value, torch.Tensor):
            continue  # extra state objects: DCP checks those itself
        if meta is None:
            problems.append(
                f"{key!r} is missing from the checkpoint (model shape {_shape(value.shape)})"
            )
        elif not isinstance(meta, TensorStorageMetadata):
            problems.append(f"{key!r} is not a tensor in the checkpoint")
        elif _shape(meta.size) != _shape(value.shape):
            problems.append(
                f"{key!r} has shape {_shape(meta.size)} in the checkpoint but "
                f"{_shape(value.shape)} in the model"
            )
        elif meta.properties.dtype != value.dtype:
            problems.append(
                f"{key!r} has dtype {meta.properties.dtype} in the checkpoint but "
                f"{value.dtype} in the model"
            )
    # Keys of the model's non-tensor extra state may be flattened by DCP ("x._extra_state.a").
    objects = tuple(
        prefix + k + "." for k, v in model_sd.items() if not isinstance(v, torch.Tensor)
    )
    # A flat checkpoint may hold other state too (optimizer, data loader): only
    # keys under one of the model's top-level names are the model's.
    roots = {k.split(".")[0] for k in model_sd}
    for skey, meta in metadata.items():
        if not skey.startswith(prefix) or (not prefix and skey.split(".")[0] not in roots):
            continue
        if skey[len(prefix) :] in model_sd or (objects and skey.startswith(objects)):
            continue
        shape = _shape(meta.size) if isinstance(meta, TensorStorageMetadata) else "object"
        problems.append(f"{skey[len(prefix) :]!r} (checkpoint shape {shape}) is not in the model")
    if problems:
        raise ValueError(_mismatch(f"checkpoint {path}", problems))


def _check_optimizer(path: Path, metadata: Mapping[str, Any], osd: Mapping[str, Any]) -> None:
    problems = []
    for fqn, entries in osd.get("state", {}).items():
        for name, value in entries.items():
            key = f"optim.state.{fqn}.{name}"
            meta = metadata.get(key)
            if not isinstance(value, torch.Tensor):
                continue
            if not isinstance(meta, TensorStorageMetadata):
                problems.append(
                    f"optimizer state {key[6:]!r} is missing from the checkpoint "
                    "(saved with another optimizer?)"
                )
            elif _shape(meta.size) != _shape(value.shape):
                problems.append(
                    f"optimizer state {key[6:]!r} has shape {_shape(meta.size)} in "
                    f"the checkpoint but {_shape(value.shape)} here"
                )
    groups = len(osd.get("param_groups", []))
    saved = sum(k.startswith("optim.param_groups.") and k.endswith(".params") for k in metadata)
    if saved != groups:
        problems.append(f"the optimizer has {groups} param groups, the checkpoint {saved}")
    if problems:
        raise ValueError(_mismatch(f"checkpoint {path}", problems))


def _mismatch(what: str, problems: list[str]) -> str:
    shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
    return (
        f"{what} does not match the model (another architecture?); nothing was loaded:\n  "
        + "\n  ".join(shown)
    )


# ---- full (plain) state dicts -----------------------------------------------------------


def full_state_dict(
    model: nn.Module, cpu_offload: bool = True, rank0_only: bool = True
) -> dict[str, torch.Tensor]:
    """Gather the model into plain tensors, as a single-process model's ``state_dict()``.

    Call on every rank (it all-gathers). Tensors are gathered one at a time
    and moved off the device before the next, so no rank ever holds more than
    one full parameter beyond what it returns. With ``rank0_only`` the other
    ranks return ``{}``. The result never aliases the model's memory.
    """
    keep = not rank0_only or _rank() == 0
    out: dict[str, torch.Tensor] = {}
    for key, value in _model_state(model).items():
        if not isinstance(value, torch.Tensor):
            continue
        full = value.full_tensor() if isinstance(value, DTensor) else value.detach()
        if not keep:
            continue
        moved = full.cpu() if cpu_offload else full
        if moved.untyped_storage().data_ptr() == local_of(value).untyped_storage().data_ptr():
            moved = moved.clone()  # one rank, or replicated: it is the model's own memory
        out[key] = moved
    return out


def load_full_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor] | None) -> None:
    """Shard a plain (single-process) state dict into ``model`` in place; call on every rank.

    Either every rank passes the same state dict (each cuts its own shards,
    no communication), or only rank 0 does and the others pass ``None`` (rank
    0 broadcasts one tensor at a time). Names, shapes and dtypes are checked
    first; a mismatch raises ``ValueError`` on every rank and changes nothing.
    """
    targets = _model_state(model)
    spec = {k: (_shape(v.shape), v.dtype) for k, v in state_dict.items()} if state_dict else None
    everyone = spec is not None
    if _world() > 1:
        everyone = all(collectives.all_gather_objects(everyone))
        if not everyone:  # rank 0 says what it will send
            spec = collectives.broadcast_object(spec)
    if spec is None:
        raise ValueError("load_full_state_dict: rank 0 passed no state dict (None or empty)")
    _check_full(spec, targets)

    sharded: dict[str, Any] = {}
    for key, target in targets.items():
        if not isinstance(target, torch.Tensor):
            continue
        device = local_of(target).device
        if everyone or _rank() == 0:
            assert state_dict is not None
            full = state_dict[key].detach().to(device).contiguous()
        else:
            full = torch.empty(spec[key][0], dtype=spec[key][1], device=device)
        if not everyone:
            collectives.broadcast(full, key)  # one tensor at a time bounds the memory
        if isinstance(target, DTensor):
            mesh, placements = target.device_mesh, target.placements
            # Cut our rows locally, and copy them: the cut is a view that would
            # keep the whole tensor alive until the end.
            rows = _cut(full, mesh, placements)
            sharded[key] = DTensor.from_local(
                rows.clone(),
                mesh,
                placements,
                run_check=False,
                shape=target.shape,
                stride=target.stride(),
            )
        else:
            sharded[key] = full
    set_model_state_dict(model, sharded)


def _check_full(
    spec: Mapping[str, tuple[list[int], torch.dtype]], targets: Mapping[str, Any]
) -> None:
    problems = []
    for key, target in targets.items():
        if not isinstance(target, torch.Tensor):
            continue
        if key not in spec:
            problems.append(
                f"{key!r} is missing from the state dict (model shape {_shape(target.shape)})"
            )
            continue
        shape, dtype = spec[key]
        if shape != _shape(target.shape):
            problems.append(
                f"{key!r} has shape {shape} in the state dict but "
                f"{_shape(target.shape)} in the model"
            )
        elif dtype != target.dtype:
            problems.append(
                f"{key!r} has dtype {dtype} in the state dict but {target.dtype} in "
                "the model (cast the state dict first)"
            )
    for key, (shape, _) in spec.items():
        if key not in targets:
            problems.append(f"{key!r} (state dict shape {shape}) is not in the model")
    if problems:
        raise ValueError(_mismatch("state dict", problems))


def _no_dist(fn: Any) -> dict[str, Any]:
    """``no_dist=`` where this torch's DCP has it (torch 2.6 detects it by itself)."""
    if "no_dist" in inspect.signature(fn).parameters:
        return {"no_dist": not _distributed()}
    return {}


def _cut(full: torch.Tensor, mesh: Any, placements: Any) -> torch.Tensor:
    """This rank's piece of a tensor every rank holds, without communication where torch can."""
    if "src_data_rank" in inspect.signature(distribute_tensor).parameters:
        return distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()
    # torch 2.6: scatters from rank 0; the same values, since every rank holds ``full``
    return distribute_tensor(full, mesh, placements).to_local()
