"""The library stands apart from its application, and its own layers only call down.

``import shardwise`` needs torch alone.
``src/shardwise`` is the library, ``src/shardwise_app`` the ``shardwise``
command built on it (``pip install 'shardwise[cli]'``). The dependency runs
one way: the application imports the library, never the reverse.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import shardwise

LIBRARY = Path(shardwise.__file__).parent
# ``python -m shardwise`` runs the command; ``import shardwise`` never imports it.
RUN_ONLY = {"__main__.py"}


def test_import_shardwise_loads_no_application() -> None:
    script = "import json, sys, shardwise; print(json.dumps(sorted(sys.modules)))"
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    loaded = json.loads(r.stdout)
    app = [m for m in loaded if m.split(".")[0] in ("shardwise_app", "rich", "matplotlib")]
    assert not app, app


def _imported(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def test_no_library_module_imports_the_application() -> None:
    files = sorted(p for p in LIBRARY.rglob("*.py") if p.name not in RUN_ONLY)
    assert len(files) > 10, files  # the scan found the library
    wrong = [
        f"{p.relative_to(LIBRARY)}: {name}"
        for p in files
        for name in _imported(ast.parse(p.read_text(), str(p)))
        if name.split(".")[0] == "shardwise_app"
    ]
    assert not wrong, wrong


def test_the_command_without_its_extra_says_how_to_install(tmp_path: Path) -> None:
    """rich (or matplotlib) absent: one line naming ``pip install 'shardwise[cli]'``, exit 2."""
    for hidden in ("rich", "matplotlib"):
        script = (
            f"import sys; sys.modules[{hidden!r}] = None\n"
            "from shardwise_app.cli.main import main\n"
            "sys.exit(main(['train', '--out', 'never']))\n"
        )
        r = subprocess.run(
            [sys.executable, "-c", script],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert f"{hidden} is not installed" in lines[0]
        assert "pip install 'shardwise[cli]'" in lines[0]
        assert r.stdout == "" and not (tmp_path / "never").exists()


# ---- the runtime's own layers ---------------------------------------------------------------

RUNTIME = LIBRARY
# The layers a step goes down through (docs/design.md): what sits below never
# imports what sits above, so it cannot call up into it.
BELOW_THE_HOOKS = [
    "param_group",
    "flat_shard",
    "sharded_param",
    "gather",
    "reduce",
    "settings",
    "collectives",
]
ABOVE = {"module", "context", "fsdp_module", "api", "optimizer_in_backward"}


def _imports(path: Path) -> set[str]:
    """The modules ``path`` imports, relative ones by their name in the package."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from .x import y / from . import x
                names.update([base] if base else [a.name for a in node.names])
            else:
                names.add(base)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


@pytest.mark.parametrize("name", BELOW_THE_HOOKS)
def test_lower_layers_never_import_the_layers_above(name: str) -> None:
    up = _imports(RUNTIME / f"{name}.py") & ABOVE
    assert not up, f"{name}.py imports {sorted(up)}, a layer above it"


def test_torch_distributed_is_called_only_in_the_collectives_layer() -> None:
    """Every process-group call goes through collectives.py, where observers (tests,
    the timeline) see it. Types (meshes, DTensors, placements, torch's FSDPModule)
    and DCP's storage calls in checkpoint.py are not calls to a process group."""
    offenders = []
    for path in sorted(RUNTIME.glob("*.py")):
        if path.name == "collectives.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import) and any(
                a.name == "torch.distributed" for a in node.names
            ):
                offenders.append(f"{path.name}:{node.lineno} imports torch.distributed")
            if (
                isinstance(node, ast.ImportFrom)
                and node.module == "torch"
                and any(a.name == "distributed" for a in node.names)
            ):
                offenders.append(f"{path.name}:{node.lineno} imports torch.distributed")
            if isinstance(node, ast.Call):
                text = ast.unparse(node.func)
                if text.startswith(("dist.", "torch.distributed.")):
                    offenders.append(f"{path.name}:{node.lineno} calls {text}")
    assert not offenders, offenders


def test_no_optimizer_hook_at_import() -> None:
    """Importing shardwise registers no global optimizer hook (the first group does)."""
    code = (
        "import torch.optim.optimizer as o\n"
        "before = len(o._global_optimizer_post_hooks)\n"
        "import shardwise\n"
        "assert len(o._global_optimizer_post_hooks) == before, 'a hook at import'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_reduce_job_is_told_everything_it_needs() -> None:
    """A reduction's caller decides whether this backward is the last and where
    offloaded downloads are listed: no default stands in for either."""
    import inspect

    from shardwise.reduce import ReduceJob

    params = list(inspect.signature(ReduceJob).parameters.values())
    defaulted = [p.name for p in params if p.default is not inspect.Parameter.empty]
    assert not defaulted, f"ReduceJob's {defaulted} have defaults that no caller relies on"
