"""Where the modules of the flat layout went: ``shardwise.collectives`` is
``shardwise.comm.collectives`` now. An import by the old name gets the module
itself (one module object under two names), so code written against the old
paths keeps working; the library itself uses the new ones
(tests/library/test_layers.py)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

# Old name -> new name, for every module that moved.
MOVED = {
    f"shardwise.{name}": f"shardwise.{package}.{name}"
    for package, names in {
        "runtime": "check context fsdp_module lifecycle mesh_part module param_group "
        "pipeline_stage root settings step_in_backward trace",
        "comm": "collectives comm_policy gather node_collectives quantize quantize_gpu reduce",
        "layout": "containers extensions flat_shard labels offload placement precision "
        "sharded_param tensor_parallel",
    }.items()
    for name in names.split()
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name and loads it as the module under its new one."""

    def __init__(self) -> None:
        self._specs: dict[str, Any] = {}  # the moved module's own spec, by old name

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(MOVED[spec.name])
        # The import system sets the module's __spec__ to the old name's: put it back.
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        assert module.__spec__ is not None
        module.__spec__ = self._specs.pop(module.__spec__.name)


def install() -> None:
    """Old names of the modules already loaded are entered now: an import of one then
    finds it and leaves the package's attribute alone (``shardwise.trace`` is the
    function, not the module it lives in). The rest load through the finder."""
    for old, new in MOVED.items():
        if new in sys.modules:
            sys.modules.setdefault(old, sys.modules[new])
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())


def attribute(name: str) -> ModuleType | None:
    """``shardwise.<old name>`` as an attribute (``from shardwise import collectives``)."""
    new = MOVED.get(f"shardwise.{name}")
    return importlib.import_module(new) if new is not None else None
