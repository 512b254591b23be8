"""Export a trained ``HFModel`` as a folder ``from_pretrained`` loads, one parameter at a time.

Every rank gathers each parameter in the same order (``DTensor.full_tensor``);
rank 0 keeps at most one output file's worth of tensors in host memory before
writing it (files of at most ``MAX_SHARD_BYTES``, with an index when there
are several, named as ``save_pretrained`` names them).
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .hf import INDEX, HFModel, _is_adapter, _named_state, saved_dtype

# Not copied into an export: the export writes its own weights.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_WEIGHT_NAMES = (INDEX, "pytorch_model.bin.index.json", "adapter_config.json")
MAX_SHARD_BYTES = 2 * 2**30


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for a DTensor: every rank calls it, in the same order).

    In float32 on rank 0's host, which writes it; the other ranks only take part.
    """
    full = t.full_tensor() if isinstance(t, DTensor) else t.detach()
    return full.cpu().float() if _rank() == 0 else full


def _merged_items(hf: HFModel) -> list[tuple[str, torch.Size, Any]]:
    """(name in the transformers model, shape, how to gather it) for the merged export."""
    items: list[tuple[str, torch.Size, Any]] = []
    for name, p in _named_state(hf.inner):
        if _is_adapter(name):
            continue
        key = name.replace(".base_layer.", ".")
        if key == name or not name.endswith(".base_layer.weight"):
            items.append((key, p.shape, lambda p=p: _full(p)))
            continue
        layer = hf.inner.get_submodule(name[: -len(".base_layer.weight")])
        items.append((key, p.shape, lambda p=p, layer=layer: _merge(_full(p), layer)))
    return items


def _merge(weight: torch.Tensor, layer: Any) -> torch.Tensor:
    """W + scaling * B @ A for each active adapter: PEFT's merge, on the gathered tensors."""
    for name in layer.active_adapters:
        if name in getattr(layer, "lora_A", {}):
            a, b = _full(layer.lora_A[name].weight), _full(layer.lora_B[name].weight)
            delta = b @ a
            if getattr(layer, "fan_in_fan_out", False):
                delta = delta.T
        elif name in getattr(layer, "lora_embedding_A", {}):
            a, b = _full(layer.lora_embedding_A[name]), _full(layer.lora_embedding_B[name])
            delta = (b @ a).T
        else:
            continue
        weight = weight + delta * layer.scaling[name]
    return weight


def _adapter_items(hf: HFModel) -> list[tuple[str, torch.Size, Any]]:
    """PEFT's saved names: the model's, without the adapter's name."""
    return [
        (name.replace(".default.", ".").removesuffix(".default"), p.shape, lambda p=p: _full(p))
        for name, p in hf.model.named_parameters()
        if _is_adapter(name)
    ]


@torch.no_grad()
def export(
    hf: HFModel,
    out: str | os.PathLike[str],
    *,
    adapter_only: bool = False,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> None:
    """Write ``out``: a folder ``from_pretrained`` loads; call on every rank.

    The merged model (LoRA folded in: W + scaling * B @ A) in the dtype the
    source folder was saved in, with its config and tokenizer files; or, with
    ``adapter_only``, a PEFT adapter folder (``PeftModel.from_pretrained``).
    Rank 0 writes into ``<out>.partial`` and renames it to ``out`` (replacing
    an older export) once complete; a failure there is raised on every rank.
    """
    from safetensors.torch import save_file

    if adapter_only and not hf.lora:
        raise ValueError("adapter_only needs a model with LoRA adapters")
    out = Path(out)
    partial = out.with_name(out.name + ".partial")
    config = json.loads((hf.folder / "config.json").read_text())
    dtype = torch.float32 if adapter_only else saved_dtype(config)
    items = _adapter_items(hf) if adapter_only else _merged_items(hf)
    stem = "adapter_model" if adapter_only else "model"
    files = _plan(items, dtype.itemsize, max_shard_bytes, stem)
    error: BaseException | None = None
    if _rank() == 0:
        try:
            if partial.exists():
                shutil.rmtree(partial)
            partial.mkdir(parents=True)
        except OSError as e:
            error = e
    weight_of: dict[str, str] = {}
    pending: dict[str, torch.Tensor] = {}
    for i, ((key, _, gather), file) in enumerate(zip(items, files)):
        tensor = gather()  # every rank gathers; only rank 0 keeps
        if _rank() != 0 or error is not None:
            continue
        pending[key] = tensor.to(dtype).contiguous()
        weight_of[key] = file
        if i + 1 == len(items) or files[i + 1] != file:
            try:
                save_file(pending, str(partial / file), metadata={"format": "pt"})
            except Exception as e:  # noqa: BLE001 - said on every rank below
                error = e
            pending = {}
    if _rank() == 0 and error is None:
        try:
            total = sum(math.prod(shape) for _, shape, _ in items) * dtype.itemsize
            _finish(hf, out, partial, weight_of, total, adapter_only)
        except Exception as e:  # noqa: BLE001
            error = e
    if _rank() == 0 and error is not None and partial.exists():
        shutil.rmtree(partial, ignore_errors=True)  # a failed export leaves nothing behind
    _share_outcome(error, out)


def _plan(
    items: list[tuple[str, torch.Size, Any]], itemsize: int, limit: int, stem: str
) -> list[str]:
    """The file each tensor goes to, in order, each file at most ``limit`` bytes (as HF names them)."""
    groups: list[int] = []
    size = 0
    for _, shape, _ in items:
        nbytes = math.prod(shape) * itemsize
        if not groups or (size + nbytes > limit and size > 0):
            groups.append(0)
            size = 0
        groups[-1] += 1
        size += nbytes
    if len(groups) <= 1:
        return [f"{stem}.safetensors"] * len(items)
    n = len(groups)
    return [
        f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors"
        for i, count in enumerate(groups)
        for _ in range(count)
    ]


def _finish(
    hf: HFModel,
    out: Path,
    partial: Path,
    weight_of: dict[str, str],
    total: int,
    adapter_only: bool,
) -> None:
    if len(set(weight_of.values())) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_of}
        name = "adapter_model.safetensors.index.json" if adapter_only else INDEX
        (partial / name).write_text(json.dumps(index, indent=2) + "\n")
    if adapter_only:
        peft_model: Any = hf.model
        peft_config = copy.deepcopy(peft_model.peft_config["default"])
        peft_config.base_model_name_or_path = str(hf.folder)
        peft_config.inference_mode = True
        peft_config.save_pretrained(str(partial))
    else:  # config, generation config, tokenizer: every file that is not weights
        for f in sorted(hf.folder.iterdir()):
            if f.is_file() and not f.name.startswith(".") and not _is_weights(f.name):
                shutil.copy2(f, partial / f.name)
    old = out.with_name(out.name + ".old")
    if out.exists():
        if old.exists():
            shutil.rmtree(old)
        out.rename(old)
    partial.rename(out)
    if old.exists():
        shutil.rmtree(old)


def _is_weights(name: str) -> bool:
    return name.endswith(_WEIGHT_SUFFIXES) or name in _WEIGHT_NAMES


def _share_outcome(error: BaseException | None, out: Path) -> None:
    """Rank 0's writing failed: every rank raises, so none reports a success."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(box, src=0)
        message = box[0]
    else:
        message = None if error is None else f"{type(error).__name__}: {error}"
    if error is not None:
        raise error
    if message is not None:
        raise RuntimeError(f"writing the export {out} failed on rank 0: {message}")
