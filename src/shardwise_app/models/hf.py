"""transformers causal LMs from a local folder: built on meta, sharded per layer, loaded per shard.

What ``shardwise train --hf PATH``, ``shardwise export`` and ``shardwise
sample`` run on. transformers, peft and safetensors are imported only inside
these functions, so the command line and the built-in GPT never need them
(``pip install 'shardwise[hf]'``).

No rank ever holds the whole model:

1. ``build_meta``: the model (and its LoRA adapters) is built on the meta
   device: shapes only. The non-persistent buffers no file holds (rotary
   frequencies) are computed right then by the model's own ``_init_weights``,
   on CPU, while every parameter is still on meta.
2. ``shard``: ``fully_shard`` each decoder layer, then the root.
3. ``materialize``: ``to_empty`` allocates only each rank's rows; each rank
   then reads only its rows of each tensor from the memory-mapped safetensors
   files (``safe_open(...).get_slice(name)[start:stop]``).

``hf_export.export`` writes a trained model back as a folder transformers loads.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..extras import first_missing

EXTRA = ("transformers", "peft", "safetensors")
INSTALL = "pip install 'shardwise[hf]'"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class HFError(ValueError):
    """A model folder or an option that cannot be used; the message is one line saying why."""


# ---- checks that import nothing heavy (the launcher runs them) -----------------------------


def missing_extra() -> str | None:
    """The first of transformers, peft, safetensors that is not installed; None if all are."""
    return first_missing(EXTRA)


def require_extra(flag: str = "--hf") -> None:
    name = missing_extra()
    if name is not None:
        raise HFError(
            f"{flag} needs the optional packages transformers, peft and safetensors "
            f"({name} is not installed): {INSTALL}"
        )
    from importlib.metadata import version

    major = version("transformers").split(".")[0]
    if not major.isdigit() or int(major) < 5:
        # Loading relies on transformers 5's meta-device initialisation of buffers.
        raise HFError(
            f"{flag} needs transformers 5 or later (this has {version('transformers')}): {INSTALL}"
        )


def check_folder(path: str | os.PathLike[str], flag: str = "--hf") -> dict[str, Any]:
    """The folder's ``config.json`` as a dict, once the folder holds what loading needs."""
    p = Path(path)
    where = f"{flag} {path}"
    if not p.exists():
        raise HFError(f"{where}: no such folder")
    if not p.is_dir():
        raise HFError(f"{where}: is a file; give the folder that save_pretrained wrote")
    if not (p / "config.json").is_file():
        raise HFError(f"{where}: no config.json (not a folder written by save_pretrained)")
    try:
        config = json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise HFError(f"{where}: config.json is unreadable ({type(e).__name__})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise HFError(f"{where}: config.json names no model_type")
    if (p / INDEX).is_file():
        try:
            files = set(json.loads((p / INDEX).read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError):
            raise HFError(f"{where}: {INDEX} is unreadable") from None
        lost = sorted(f for f in files if not (p / f).is_file())
        if lost:
            raise HFError(f"{where}: {INDEX} lists {lost[0]}, which is missing")
    elif not (p / SINGLE).is_file():
        other = next((f.name for f in sorted(p.glob("*.bin"))), None)
        hint = (
            f" (only {other}: save with safe_serialization=True)"
            if other
            else " (the weights were not saved?)"
        )
        raise HFError(f"{where}: no {SINGLE} nor {INDEX}{hint}")
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        raise HFError(
            f"{where}: no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}); save the "
            "tokenizer into the same folder"
        )
    return config


def weight_files(folder: Path) -> list[str]:
    """The names of the folder's safetensors weight files, sorted."""
    if (folder / INDEX).is_file():
        return sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))
    return [SINGLE]


_SAMPLES, _BLOCK = 16, 64 * 1024


def weights_fingerprint(path: str | os.PathLike[str]) -> dict[str, str]:
    """A fingerprint of each weight file that costs the same at 1 MB as at 100 GB.

    Per file: its size, and a sha256 of its safetensors header (every
    tensor's name, dtype, shape and offsets) and of 16 blocks of 64 KiB
    spread evenly over the data, the last block included. Weights that were
    trained further, re-saved in another dtype or swapped for another
    checkpoint change every block; an edit confined to a few bytes between
    the samples would go unseen (a full hash of many GB takes minutes).
    """
    import hashlib

    folder = Path(path)
    out = {}
    for name in weight_files(folder):
        h = hashlib.sha256()
        with open(folder / name, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            header_len = int.from_bytes(head, "little") if len(head) == 8 else 0
            h.update(head + f.read(min(header_len, size)))
            start = f.tell()
            span = max(0, size - start - _BLOCK)
            for i in range(_SAMPLES):
                f.seek(start + span * i // (_SAMPLES - 1))
                h.update(f.read(_BLOCK))
        out[name] = f"{size}:{h.hexdigest()}"
    return out


def context_length(config: dict[str, Any]) -> int | None:
    """The longest sequence the model's position scheme is configured for, if it says."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    text = config.get("text_config")
    return context_length(text) if isinstance(text, dict) else None


def saved_dtype(config: dict[str, Any]) -> torch.dtype:
    """The dtype the folder's weights are stored in (what an export writes)."""
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name).replace("torch.", ""), None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


# ---- building ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoraSpec:
    r: int
    alpha: float
    targets: str | list[str]  # "all-linear" or module names


@dataclass
class HFModel:
    model: nn.Module  # what trains: the transformers model, or the PeftModel around it
    inner: nn.Module  # the transformers model (inside the PeftModel with LoRA)
    layers: list[nn.Module]
    folder: Path
    lora: bool
    # Non-persistent buffers by name in ``model``, computed on CPU: no file holds them.
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)


def quiet_transformers() -> None:
    """transformers' warnings that say nothing to a shardwise user (use_cache, deprecations)."""
    import transformers

    transformers.logging.set_verbosity_error()


def load_tokenizer(folder: str | os.PathLike[str]) -> Any:
    """The folder's tokenizer; its EOS token taken from config.json if it names none itself."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if tokenizer.eos_token_id is None:
        eos = json.loads((Path(folder) / "config.json").read_text()).get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos
        if isinstance(eos, int) and 0 <= eos < len(tokenizer):
            tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
    return tokenizer


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: modules of a class the model never splits, held in a ModuleList.

    Only those in a list: some models also name their embeddings in
    ``_no_split_modules``, and sharding those apart would split a head tied to them.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    found: list[nn.Module] = []

    def walk(m: nn.Module) -> None:
        for child in m.children():
            if isinstance(m, nn.ModuleList) and type(child).__name__ in names:
                found.append(child)
            else:
                walk(child)

    walk(model)
    if not found:
        raise HFError(
            f"cannot tell the decoder layers of {type(model).__name__} (no layer of a class "
            "in its _no_split_modules in a ModuleList); shardwise shards each decoder layer"
        )
    return found


def build_meta(
    folder: str | os.PathLike[str], *, lora: LoraSpec | None = None, checkpointing: str = "none"
) -> HFModel:
    """The model of ``folder`` on the meta device in float32, with LoRA adapters if asked."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    config.use_cache = False
    with torch.device("meta"):
        # float32 whatever the folder holds: the sharded weights are what AdamW
        # updates; --mixed-precision decides the compute dtype.
        inner = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    buffers = _nonpersistent_buffers(inner)
    layers = decoder_layers(inner)
    if checkpointing != "none":
        _enable_checkpointing(inner, layers, checkpointing)
    model = inner
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        lora_config = LoraConfig(
            r=lora.r,
            lora_alpha=int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha,  # type: ignore[arg-type]
            target_modules=lora.targets,
            lora_dropout=0.0,
            task_type="CAUSAL_LM",
        )
        with torch.device("meta"):
            model = get_peft_model(inner, lora_config)
        prefix = _prefix_of(model, inner)
        buffers = {prefix + k: v for k, v in buffers.items()}
    return HFModel(model, inner, layers, folder, lora is not None, buffers)


def _nonpersistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Compute the buffers no checkpoint holds, as ``from_pretrained`` does: ``_init_weights``.

    Run while every parameter is on meta, where the init functions cost
    nothing; a buffer still NaN afterwards is one the model cannot recompute.
    """
    out: dict[str, torch.Tensor] = {}
    init = getattr(model, "_init_weights", None)
    for mname, module in model.named_modules():
        names = [
            n for n in module._non_persistent_buffers_set if module._buffers.get(n) is not None
        ]
        if not names:
            continue
        for n in names:
            buf = module._buffers[n]
            assert buf is not None
            fill = float("nan") if buf.is_floating_point() else 0
            module._buffers[n] = torch.full(buf.shape, fill, dtype=buf.dtype, device="cpu")
        if callable(init):
            with torch.no_grad():
                init(module)
        for n in names:
            buf = module._buffers[n]
            assert buf is not None
            if buf.is_floating_point() and bool(buf.isnan().any()):
                raise HFError(
                    f"{type(model).__name__}: cannot compute the buffer {mname}.{n}, which "
                    "the weights files do not hold"
                )
            out[f"{mname}.{n}" if mname else n] = buf
    return out


def _enable_checkpointing(model: Any, layers: list[Any], mode: str) -> None:
    """The model's own activation checkpointing (it checkpoints ``forward``: hooks stay outside)."""
    kwargs = {"use_reentrant": mode == "reentrant"}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers before 5.x
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if mode == "selective":  # every other layer, as for the built-in GPT
        for i, layer in enumerate(layers):
            if i % 2:
                layer.gradient_checkpointing = False


def _prefix_of(outer: nn.Module, inner: nn.Module) -> str:
    for name, m in outer.named_modules():
        if m is inner:
            return name + "." if name else ""
    raise AssertionError("the transformers model is not inside the PEFT model")


def shard(hf: HFModel, *, mesh: Any = None, mp_policy: Any = None) -> None:
    """``fully_shard`` each decoder layer, then the root (embeddings, final norm, head)."""
    from shardwise import fully_shard

    for layer in hf.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    # The root owns the embedding and the head: tied, they stay one parameter.
    fully_shard(hf.model, mesh=mesh, mp_policy=mp_policy)


# ---- loading -------------------------------------------------------------------------------


def _rows(p: torch.Tensor) -> tuple[int, int]:
    """Which rows of the full tensor this rank holds (all of them for a plain tensor)."""
    if not isinstance(p, DTensor):
        return 0, p.shape[0]
    mesh, placements = p.device_mesh, tuple(p.placements)
    if placements[-1] != Shard(0) or any(pl != Replicate() for pl in placements[:-1]):
        raise NotImplementedError(f"loading a parameter placed {placements} (tensor parallel?)")
    world, rank = mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1)
    # Shard(0) splits as torch.chunk does: ceil(rows / world) rows for each
    # rank, the last ones shorter or empty.
    chunk = -(-p.shape[0] // world)
    start = min(rank * chunk, p.shape[0])
    return start, start + p.to_local().shape[0]


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def weight_map(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    from safetensors import safe_open

    if (folder / INDEX).is_file():
        index = json.loads((folder / INDEX).read_text())["weight_map"]
        return {k: folder / v for k, v in index.items()}
    with safe_open(str(folder / SINGLE), framework="pt") as f:
        return {k: folder / SINGLE for k in f.keys()}  # noqa: SIM118 - not a dict


def _file_name(model_name: str, prefix: str) -> str:
    """A parameter's name in the weights files: no PEFT prefix, no ``base_layer``."""
    name = model_name[len(prefix) :] if model_name.startswith(prefix) else model_name
    return name.replace(".base_layer.", ".")


def _is_adapter(name: str) -> bool:
    return ".lora_" in name


@torch.no_grad()
def materialize(hf: HFModel, device: torch.device | str, *, seed: int = 0) -> None:
    """Allocate this rank's rows on ``device`` and fill them from the folder's weights.

    LoRA adapters start as PEFT starts them (A Kaiming-uniform, B zero), drawn
    from ``seed`` the same way on every rank. Works sharded (every rank calls
    it) and on a plain one-process model.
    """
    from safetensors import safe_open

    ties = _ties(hf.model)
    hf.model.to_empty(device=device)
    for places in ties:  # a plain model's to_empty makes a new parameter per place
        first = places[0][0]._parameters[places[0][1]]
        for module, attr in places[1:]:
            module._parameters[attr] = first
    for name, value in hf.buffers.items():
        owner, _, attr = name.rpartition(".")
        hf.model.get_submodule(owner)._buffers[attr] = value.to(device)
    prefix = _prefix_of(hf.model, hf.inner)
    files = weight_map(hf.folder)
    gen = torch.Generator().manual_seed(seed)
    todo: dict[Path, list[tuple[str, str, torch.Tensor]]] = {}
    for pname, p in _named_state(hf.model):
        if _is_adapter(pname):
            _init_adapter(pname, p, gen)
            continue
        key = _file_name(pname, prefix)
        aliases = [key, *_aliases(hf.model, p, pname, prefix)]
        found = next((k for k in aliases if k in files), None)
        if found is None:
            raise HFError(
                f"--hf {hf.folder}: the weights hold no {key!r} (shape {list(p.shape)}); "
                "saved from another model or another transformers version?"
            )
        todo.setdefault(files[found], []).append((found, pname, p))
    for path, entries in todo.items():
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key, _, p in entries:
                sl = f.get_slice(key)
                if list(sl.get_shape()) != list(p.shape):
                    raise HFError(
                        f"--hf {hf.folder}: {key!r} has shape {list(sl.get_shape())} in "
                        f"{path.name} but {list(p.shape)} in the model its config.json describes"
                    )
                local = _local(p)
                if p.dim() == 0:
                    local.copy_(f.get_tensor(key))
                    continue
                start, stop = _rows(p)
                if stop > start:
                    local.copy_(sl[start:stop])


def _ties(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Where each parameter registered in several places (tied weights) is registered."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is not None:
                places.setdefault(id(p), []).append((module, attr))
    return [found for found in places.values() if len(found) > 1]


def _named_state(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters (each once: a tied weight under its first name) and persistent buffers."""
    out: list[tuple[str, torch.Tensor]] = list(model.named_parameters())
    for mname, module in model.named_modules():
        for n, b in module._buffers.items():
            if b is not None and n not in module._non_persistent_buffers_set:
                out.append((f"{mname}.{n}" if mname else n, b))
    return out


def _aliases(model: nn.Module, p: torch.Tensor, pname: str, prefix: str) -> list[str]:
    """The other names of a tied parameter: the file may hold it under any one of them."""
    return [
        _file_name(n, prefix)
        for n, q in model.named_parameters(remove_duplicate=False)
        if q is p and n != pname
    ]


def _init_adapter(name: str, p: torch.Tensor, gen: torch.Generator) -> None:
    local = _local(p)
    if ".lora_B." in name or ".lora_embedding_A." in name:
        local.zero_()
        return
    full = torch.empty(p.shape, dtype=p.dtype)
    if ".lora_A." in name:
        nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=gen)
    elif ".lora_embedding_B." in name:
        nn.init.normal_(full, generator=gen)
    else:
        raise NotImplementedError(f"initialising the adapter parameter {name}")
    start, stop = _rows(p)
    local.copy_(full[start:stop])


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits
