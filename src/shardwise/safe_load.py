"""Reading a checkpoint folder without running code from it.

A pickle is a program: unpickling calls whatever callables it names, with the
arguments it chooses (``os.system``, ``pathlib.Path.unlink``). Checkpoints
travel between people and clusters, so nothing shardwise reads from one may
name a callable beyond the few that rebuild plain data:

- ``shardwise_extra.pt`` and DCP's non-tensor items (the optimizer's param
  groups) are ``torch.save`` files: read with ``torch.load(weights_only=True)``,
  which admits containers, numbers, strings and tensors only. ``check_plain``
  refuses at save time an ``extra`` that such a load could not give back.
- DCP's ``.metadata`` is a plain pickle of DCP's own dataclasses, which torch
  reads with ``pickle.load``: read here by an unpickler that admits those
  classes alone (``METADATA_GLOBALS``), through ``SafeFileSystemReader``,
  which DCP's load uses in place of its own reader.

Anything else is refused with ``UnsafeCheckpoint``, one line naming the file
and the callable, before it is built. The checksums and a run's config are
JSON, which builds no objects.
"""

from __future__ import annotations

import _compat_pickle
import io
import pickle
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

METADATA_FILE = ".metadata"


class UnsafeCheckpoint(ValueError):
    """A checkpoint file that would call code when loaded; the message names the file and what
    it calls. Nothing of it was built, and nothing was loaded."""


def _python3_name(module: str, name: str) -> str:
    """``module.name`` as Python 3 spells it (protocol 2 pickles say ``__builtin__``)."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    else:
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
    return f"{module}.{name}"


def _refusal(what: str, name: str) -> UnsafeCheckpoint:
    return UnsafeCheckpoint(
        f"{what} would run code when loaded: it calls {name}, which no checkpoint needs; "
        "refusing to load it (nothing was loaded)"
    )


# ---- DCP metadata ---------------------------------------------------------------------------

_DCP = "torch.distributed.checkpoint.metadata"
# What the .metadata of shardwise.checkpoint.save, of torch FSDP2 with plain dcp.save and of
# `shardwise train` holds (torch 2.6 to 2.13): DCP's dataclasses, the file offsets of
# FileSystemWriter, torch.Size, dtypes, the layout (by name) and the checkpoint_id path.
METADATA_GLOBALS = frozenset(
    [
        (_DCP, "Metadata"),
        (_DCP, "StorageMeta"),
        (_DCP, "TensorStorageMetadata"),
        (_DCP, "BytesStorageMetadata"),
        (_DCP, "ChunkStorageMetadata"),
        (_DCP, "TensorProperties"),
        (_DCP, "MetadataIndex"),
        (_DCP, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
    ]
    # Python 3.13 moved the path classes to pathlib._local, and pickles say so.
    + [
        (module, cls)
        for module in ("pathlib", "pathlib._local")
        for cls in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath")
        + ("PureWindowsPath",)
    ]
)
# Objects of these types, found in the torch module under their own name (torch.float32).
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that looks up only ``METADATA_GLOBALS`` and torch's dtypes.

    ``find_class`` is the one way a pickle reaches a callable (the GLOBAL,
    STACK_GLOBAL, INST, OBJ and EXT opcodes all go through it), so refusing
    there refuses before anything is called.
    """

    def __init__(self, file: IO[bytes], name: str) -> None:
        super().__init__(file)
        self.name = name

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(vars(torch).get(name), _TORCH_CONSTANTS):
            return vars(torch)[name]
        raise _refusal(self.name, _python3_name(module, name))

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("a DCP .metadata holds no persistent references")


def read_metadata(file: Path) -> Metadata:
    """DCP's metadata from the file ``file`` (a folder's ``.metadata``), or ``UnsafeCheckpoint``.

    Any other failure (junk, a pickle of something else) raises another
    exception, for the caller to report as damage.
    """
    with open(file, "rb") as f:
        metadata = _MetadataUnpickler(f, str(file)).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader, with ``read_metadata`` through ``read_metadata`` above: what
    ``dcp.load`` itself reads (torch's own reader calls ``pickle.load``)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        metadata = read_metadata(Path(self.path) / name)
        # As torch's read_metadata does.
        meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        meta.load_id = self.load_id
        metadata.storage_meta = meta
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, whose non-tensor items (``torch.save`` bytes) must pass
    ``load_torch`` first; torch's own reads them with ``weights_only=False``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        load_torch(value, f"checkpoint item {read_item.dest_index.fqn!r}")
        # The same bytes, in memory, now known to name nothing but plain data: DCP's own
        # load_bytes puts them where its flattening of the state dict says.
        value.seek(0)
        super().load_bytes(read_item, value)


_NO_ITEM: Any = None  # transform_load_stream takes a ReadItem it does not use


def check_bytes_items(folder: Path, metadata: Metadata) -> None:
    """Read every non-tensor item of a DCP checkpoint through ``load_torch``: before a load
    copies any tensor into the model, so that a refused item leaves the model as it was."""
    reader = SafeFileSystemReader(str(folder))
    names = {
        k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)
    }
    for index, info in metadata.storage_data.items():
        if index.fqn not in names:
            continue
        with open(folder / info.relative_path, "rb") as f:
            f.seek(int(info.offset))
            raw = io.BytesIO(f.read(int(info.length)))
        # Compression and other stream transforms (torch >= 2.7), applied as DCP applies them.
        descriptors = list(getattr(info, "transform_descriptors", None) or ())
        if descriptors:
            raw = io.BytesIO(
                reader.transforms.transform_load_stream(_NO_ITEM, descriptors, raw).read()
            )
        load_torch(raw, f"{folder / info.relative_path} (item {index.fqn!r})")


# ---- torch.save files -----------------------------------------------------------------------


def load_torch(
    source: str | Path | IO[bytes], what: str, also: Iterable[tuple[Any, str]] = ()
) -> Any:
    """``torch.load(source, weights_only=True)``, with the pairs ``also`` (object,
    "module.name") admitted besides torch's own list; a file it refuses for naming a
    callable raises ``UnsafeCheckpoint`` naming it. Other failures (junk) raise as torch
    raised them."""
    if isinstance(source, (str, Path)):
        with open(source, "rb") as f:
            data = io.BytesIO(f.read())
    else:
        data = io.BytesIO(source.read())
    try:
        with torch.serialization.safe_globals(list(also)):
            return torch.load(data, weights_only=True)
    except Exception:
        called = _refused_global(data.getvalue(), {name for _, name in also})
        if called is not None:
            raise _refusal(what, called) from None
        raise


def _refused_global(data: bytes, also: set[str]) -> str | None:
    """The first callable the pickle(s) in ``data`` name that ``weights_only`` does not admit.

    Found by a dry run: an unpickler that builds a stand-in for every callable
    it is asked for, so nothing named is imported or called. Torch's own message
    names it only for some opcodes, and in a paragraph.
    """
    allowed = _weights_only_globals() | also
    for name in _globals_named(data):
        if name not in allowed:
            return name
    return None


def _weights_only_globals() -> set[str]:
    import torch._weights_only_unpickler as wo

    names: set[str] = set()
    for getter in ("_get_allowed_globals", "_get_user_allowed_globals"):
        fn: Callable[[], dict[str, Any]] | None = getattr(wo, getter, None)
        if fn is not None:
            names |= set(fn())
    return names


class _StandIn:
    """What the dry run builds for any callable: takes anything, does nothing."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _StandIn:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _StandIn:
        return _StandIn()

    def __setstate__(self, state: Any) -> None:
        pass

    def append(self, item: Any) -> None:
        pass

    def extend(self, items: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass


class _DryRun(pickle.Unpickler):
    def __init__(self, file: IO[bytes]) -> None:
        super().__init__(file)
        self.named: list[str] = []

    def find_class(self, module: str, name: str) -> Any:
        self.named.append(_python3_name(module, name))
        return _StandIn

    def persistent_load(self, pid: Any) -> Any:
        return None


def _globals_named(data: bytes) -> list[str]:
    """Every callable named, in order: in ``data.pkl`` of a ``torch.save`` zip file, else in
    each pickle of the legacy format (a raw pickle is one)."""
    if zipfile.is_zipfile(io.BytesIO(data)):
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as z:
                pkl = [n for n in z.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
                data = z.read(pkl[0]) if pkl else b""
        except (zipfile.BadZipFile, OSError):
            return []
    stream = io.BytesIO(data)
    run = _DryRun(stream)
    while stream.tell() < len(data):
        try:
            run.load()
        except Exception:  # noqa: BLE001 - junk or the raw storage bytes after the pickles
            break
    return run.named


def read_extra(file: Path) -> Any:
    """``shardwise_extra.pt`` through ``load_torch``. Checkpoints saved before format 3
    hold NumPy's RNG state as an array: its three constructors are admitted too (they
    build an array of numbers and call nothing else)."""
    return load_torch(file, str(file), also=_numpy_array_globals())


def _numpy_array_globals() -> list[tuple[Any, str]]:
    import numpy as np  # only here: the library needs NumPy for checkpoints alone

    core = getattr(np, "_core", None) or np.core  # NumPy 2 renamed it; pickles name either
    rebuild = core.multiarray._reconstruct
    return [
        (np.ndarray, "numpy.ndarray"),
        (np.dtype, "numpy.dtype"),
        (type(np.dtype(np.uint32)), "numpy.dtypes.UInt32DType"),
        (rebuild, "numpy.core.multiarray._reconstruct"),
        (rebuild, "numpy._core.multiarray._reconstruct"),
    ]


# ---- what a checkpoint may hold besides tensors ---------------------------------------------

_ATOMS = (type(None), bool, int, float, complex, str, bytes, bytearray)
_TORCH_VALUES = (torch.dtype, torch.device, torch.Size, torch.layout)
_TENSORS = (torch.Tensor, torch.nn.Parameter)


def check_plain(value: Any, where: str = "extra") -> None:
    """Raise ``TypeError`` naming the first part of ``value`` that ``torch.load(weights_only=
    True)`` would not give back: anything but dicts, lists, tuples, sets, numbers, strings,
    bytes, None, plain tensors, dtypes, devices and sizes."""
    _check(value, where, set())


def _check(value: Any, where: str, open_: set[int]) -> None:
    kind = type(value)
    if kind in _ATOMS or isinstance(value, _TORCH_VALUES):
        return
    if kind in _TENSORS:
        return
    if kind in (dict, OrderedDict, list, tuple, set):
        if id(value) in open_:
            raise TypeError(f"{where} contains itself; a checkpoint holds trees, not cycles")
        open_.add(id(value))
        if kind in (dict, OrderedDict):
            for k, v in value.items():
                _check(k, f"{where} key {k!r}", open_)
                _check(v, f"{where}[{k!r}]", open_)
        else:
            for i, v in enumerate(value):
                _check(v, f"{where}[{i}]" if kind is not set else f"{where} item {v!r}", open_)
        open_.discard(id(value))
        return
    hint = ""
    if isinstance(value, torch.Tensor):
        hint = "; save a plain tensor instead (.full_tensor(), .to_local())"
    elif kind.__module__ == "numpy":
        hint = "; save .item(), .tolist() or torch.from_numpy(...) instead"
    raise TypeError(
        f"{where} is a {kind.__module__}.{kind.__qualname__}: a checkpoint holds only what "
        "loads without running code (dicts, lists, tuples, sets, numbers, strings, bytes, "
        f"None, plain tensors){hint}"
    )
