"""The library's tests, one folder per subsystem, as the library is laid out:

- ``api/``: the public face against FSDP2's contract and one process: ``fully_shard``'s
  keywords, ``FSDPModule``'s methods, training semantics and options, ``observe``;
- ``runtime/``: hooks, root, context, groups: parity and prefetch, the lifecycle, the
  debugging tools, host work per step, modules used outside forward, nothing left to
  the garbage collector;
- ``comm/``: collectives and the communication policy, bytes at any world size;
- ``layout/``: per-parameter meshes, tensor subclasses that gather themselves;
- ``checkpoint/``: save and load, checksums, loading without running code (its
  ``fixtures/``);
- ``optim/``: Muon, ``optimizer_in_backward``;
- ``integrations/``: the FSDP2 patch, frameworks (``frameworks_cases/``), real clients,
  pipeline and tensor parallel;
- ``cuda/``: what needs a GPU; ``fuzz/``: the differential fuzzer and its tests;
- here: ``test_layers.py``, the rules of the library's folders and layers, and
  ``test_run_tasks.py``, the suite's multi-rank harness (tests/dist_utils.py).

A test goes in the folder of the subsystem it checks. Tests import each other's
helpers (and the fuzzer's modules) by module name, so every folder is put on the path
here, for this process and every rank it spawns (spawned ranks inherit the path); a
file name is therefore unique across the folders.
"""

import sys
from pathlib import Path

_HERE = Path(__file__).parent
for _folder in sorted(_HERE.iterdir()):
    if _folder.is_dir() and not _folder.name.startswith(("_", ".")):
        if str(_folder) not in sys.path:
            sys.path.insert(0, str(_folder))
