"""The library stands apart from its application, and its own layers only call down.

``import shardwise`` needs torch alone and loads neither the application nor
the planner. ``src/shardwise`` is the library, ``src/shardwise_app`` the
``shardwise`` command built on it (``pip install 'shardwise[cli]'``). The
dependency runs one way: the application imports the library, never the
reverse.

Inside the library every file has a place in ``LAYERS`` (docs/design.md draws
it), and every import a file makes (at the top, under ``TYPE_CHECKING``, inside
a function: each is a reference the reader follows) goes to a file of a layer
below its own, so no file can call up into one above it and there is no
import cycle (``python ../shared/tools/import_cycles.py src/shardwise`` agrees).
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
    # Nor the planner: it is a package of its own, beside the runtime.
    planner = [m for m in loaded if m.startswith(("shardwise_plan", "shardwise.planner"))]
    assert not planner, planner


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


# ---- the library's folders and layers -----------------------------------------------------

RUNTIME = LIBRARY
# The folders, top to bottom: the public face (what users import by name: the
# top-level modules and ``optim``), then the runtime, communication, and the
# vocabulary of where a parameter lives. A file imports its own folder's files
# (by LAYERS, below) or a lower folder's, never a higher one's.
FOLDERS: dict[str, set[str]] = {
    "": {
        "_moved", "api", "checkpoint", "checkpoint_integrity", "clip", "materialize",
        "observe", "optimizer_in_backward", "patch", "pipeline", "safe_load",
    },
    "optim": {"muon"},
    "runtime": {
        "check", "context", "fsdp_module", "lifecycle", "mesh_part", "module", "param_group",
        "pipeline_stage", "root", "settings", "step_in_backward", "trace",
    },
    "comm": {
        "collectives", "comm_policy", "gather", "node_collectives", "quantize", "quantize_gpu",
        "reduce",
    },
    "layout": {
        "containers", "extensions", "flat_shard", "labels", "offload", "placement", "precision",
        "sharded_param", "tensor_parallel",
    },
}  # fmt: skip
LEVEL = {"": 0, "optim": 0, "runtime": 1, "comm": 2, "layout": 3}
FOLDER = {name: folder for folder, names in FOLDERS.items() for name in names}
# Top to bottom, over every file. A file may import the files of any layer below its
# own, none of its own layer or above. The path of one step is
# module -> root -> context -> param_group -> mesh_part -> gather/reduce -> collectives.
LAYERS: list[tuple[str, ...]] = [
    ("__init__",),
    # The public face: the calls and what they are built from.
    ("patch", "checkpoint", "optimizer_in_backward", "observe", "clip", "materialize", "muon"),
    ("api",),
    ("pipeline",),  # fully_shard.state for torch.distributed.pipelining (an adapter)
    ("checkpoint_integrity",),
    ("safe_load",),  # reading checkpoint files without running code (torch only)
    ("_moved",),  # the old flat paths of moved modules (imports nothing of ours)
    # runtime/
    ("fsdp_module",),
    ("module",),  # one module's hooks (ModuleState)
    ("pipeline_stage",),  # a root's first forward inside a pipeline stage: refusals
    ("root",),  # the root's boundaries: every module at a forward's start and end, a backward's end
    ("check",),  # lifecycle checks: read the context and the modules' lifecycles
    ("context",),  # the root's shared state and each module's lifecycle (its stage)
    ("param_group",),  # one group's gather/reshard/reduce lifecycle
    ("mesh_part",),  # a group's parameters on one mesh, and its parts' reductions as one
    ("settings",),  # one call's settings, frozen but for change(); the reduction's snapshot
    ("step_in_backward",),  # the stepper
    ("trace",),  # the timeline
    ("lifecycle",),  # the states, events and transition tables (imports nothing)
    # comm/
    ("gather", "reduce"),  # strategies, given the layout
    ("node_collectives",),  # collectives that know the node boundary
    ("collectives", "comm_policy"),
    ("quantize",),
    ("quantize_gpu",),  # quantize.py's int8 pack and unpack fused on CUDA (Triton, lazily)
    # layout/
    ("flat_shard",),  # the layout
    ("sharded_param",),
    ("extensions",),
    ("precision", "tensor_parallel", "offload"),
    ("containers", "labels", "placement"),
]
LAYER = {name: i for i, layer in enumerate(LAYERS) for name in layer}
PACKAGE_INITS = {f"{folder}/__init__.py" for folder in FOLDERS if folder}
LIBRARY_FILES = sorted(
    p
    for p in RUNTIME.rglob("*.py")
    if p.name not in RUN_ONLY and str(p.relative_to(RUNTIME)) not in PACKAGE_INITS
)
RUNTIME_FILES = sorted(p.stem for p in LIBRARY_FILES)
PATH = {p.stem: p for p in LIBRARY_FILES}
BELOW_THE_HOOKS = [name for name in RUNTIME_FILES if LAYER.get(name, -1) > LAYER["module"]]


def _imports(path: Path) -> set[str]:
    """The library files ``path`` imports, by name: every import in it, at the top,
    under ``TYPE_CHECKING`` or inside a function, relative or absolute."""
    names: set[str] = set()
    here = path.relative_to(RUNTIME).parent.parts
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parent = list(here[: len(here) - node.level + 1])
                dotted = [*parent, *(node.module.split(".") if node.module else [])]
            elif node.module and node.module.split(".")[0] == "shardwise":
                dotted = node.module.split(".")[1:]
            else:
                continue
            # ``from ..comm import collectives`` and ``from . import x`` import modules;
            # ``from .x import y`` and ``from ..comm.x import y`` import from the module x.
            if not dotted or dotted[-1] in FOLDERS:
                names.update(a.name for a in node.names)
            else:
                names.add(dotted[-1])
        elif isinstance(node, ast.Import):
            names.update(
                a.name.split(".")[-1] for a in node.names if a.name.startswith("shardwise.")
            )
    return names & set(RUNTIME_FILES)


def test_every_library_file_is_in_its_folder_and_has_a_layer() -> None:
    """A new file is placed in ``FOLDERS`` and ``LAYERS`` (and so in docs/design.md)."""
    assert len(RUNTIME_FILES) > 30, RUNTIME_FILES  # the scan found the library
    assert len(set(RUNTIME_FILES)) == len(LIBRARY_FILES), "a file name used twice"
    placed = {
        name: str(PATH[name].relative_to(RUNTIME).parent).replace(".", "")
        for name in RUNTIME_FILES
        if name != "__init__"
    }
    assert placed == FOLDER, {
        n: (placed.get(n), FOLDER.get(n))
        for n in set(placed) ^ set(FOLDER) | {n for n in placed if placed[n] != FOLDER.get(n)}
    }
    missing = [name for name in RUNTIME_FILES if name not in LAYER]
    assert not missing, f"add {missing} to LAYERS"
    gone = [name for name in LAYER if name not in RUNTIME_FILES]
    assert not gone, f"{gone} are in LAYERS but not in the library"


@pytest.mark.parametrize("name", RUNTIME_FILES)
def test_every_import_goes_to_a_layer_below(name: str) -> None:
    """No import goes to a file of the same layer or above: nothing calls up."""
    up = sorted(n for n in _imports(PATH[name]) if LAYER[n] <= LAYER[name])
    assert not up, f"{name}.py imports {up}, of its own layer or above it"


@pytest.mark.parametrize("name", [n for n in RUNTIME_FILES if n != "__init__"])
def test_no_import_goes_to_a_higher_folder(name: str) -> None:
    """layout/ imports only itself, comm/ layout/, runtime/ both; the face anything."""
    level = LEVEL[FOLDER[name]]
    up = sorted(n for n in _imports(PATH[name]) if n != "__init__" and LEVEL[FOLDER[n]] < level)
    assert not up, f"{FOLDER[name]}/{name}.py imports {up}, from a folder above its own"


@pytest.mark.parametrize("name", BELOW_THE_HOOKS)
def test_lower_layers_never_import_the_layers_above(name: str) -> None:
    above = {n for n in RUNTIME_FILES if LAYER[n] <= LAYER["module"]}
    up = _imports(PATH[name]) & above
    assert not up, f"{name}.py imports {sorted(up)}, a layer above it"


def test_the_library_imports_moved_modules_by_their_new_paths() -> None:
    """The old flat paths (``shardwise.collectives``) are for users' code; the library
    names the folders, so the folders are what a reader follows."""
    from shardwise import _moved

    old = {name.split(".")[-1] for name in _moved.MOVED}
    wrong = []
    for path in LIBRARY_FILES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                top = path.parent == RUNTIME
                flat = (node.level == 1 and top) or base == "shardwise"
                if flat and not base and any(a.name in old for a in node.names):
                    wrong.append(f"{path.relative_to(RUNTIME)}:{node.lineno}")
                elif flat and base.split(".")[0] in old:
                    wrong.append(f"{path.relative_to(RUNTIME)}:{node.lineno}")
    assert not wrong, wrong


def test_old_flat_paths_still_import_the_moved_modules() -> None:
    """Code written against the flat layout keeps working: ``import shardwise.reduce``,
    ``from shardwise import collectives`` and ``from shardwise.lifecycle import ...``
    give the moved modules themselves, which keep their own names."""
    script = (
        "import importlib, shardwise\n"
        "from shardwise import _moved, collectives\n"
        "import shardwise.reduce as r\n"
        "from shardwise.lifecycle import LifecycleError\n"
        "import shardwise.trace\n"
        "from shardwise.trace import Tracer\n"
        # the public function, not the module it lives in
        "assert shardwise.trace is shardwise.runtime.trace.trace\n"
        "assert collectives is importlib.import_module('shardwise.comm.collectives')\n"
        "assert r.__name__ == r.__spec__.name == 'shardwise.comm.reduce'\n"
        "assert LifecycleError is shardwise.LifecycleError\n"
        "for old, new in _moved.MOVED.items():\n"
        "    assert importlib.import_module(old) is importlib.import_module(new), old\n"
        "print(len(_moved.MOVED))\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) == len(FOLDERS["runtime"] | FOLDERS["comm"] | FOLDERS["layout"])


def test_settings_are_written_only_through_change_settings() -> None:
    """``GroupSettings`` is frozen; ``ModuleState.change_settings`` (runtime/module.py) is
    the one caller of its ``change``, and no code assigns a setting's field."""
    from dataclasses import fields

    from shardwise.runtime.settings import GroupSettings

    names = {f.name for f in fields(GroupSettings)}
    calls, writes = [], []
    for path in LIBRARY_FILES + sorted((RUNTIME.parent / "shardwise_app").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "change"
                and ast.unparse(node.func.value).endswith("settings")
            ):
                calls.append((path.name, ast.unparse(node.func)))
        for attr in names:
            writes += [(path.name, w, t) for w, t in _assignments(path, attr) if "settings" in t]
    assert calls == [("module.py", "self.settings.change")], calls
    assert not writes, writes


def test_no_import_cycle_in_the_library() -> None:
    """The tool the issue counts cycles with, over the library (0 cycles, exit 0)."""
    tool = Path(__file__).resolve().parents[3] / "shared" / "tools" / "import_cycles.py"
    if not tool.exists():
        pytest.skip(f"{tool} is not in this checkout")
    r = subprocess.run(
        [sys.executable, str(tool), str(RUNTIME)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and r.stdout.startswith("0 import cycles"), r.stdout + r.stderr


def _package_graph(package: Path) -> dict[str, set[str]]:
    """Each module of ``package`` and the modules of the same package it imports: every
    import (top level, under ``TYPE_CHECKING``, inside functions), relative ones resolved,
    ``from pkg import name`` counted as the submodule ``pkg.name`` where one exists."""
    top = package.name
    files = {
        ".".join((top, *p.relative_to(package).with_suffix("").parts)).removesuffix(".__init__"): p
        for p in package.rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        here = mod.split(".") if is_pkg else mod.split(".")[:-1]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = here[: len(here) - node.level + 1]
                    base = ".".join([*parent, base] if base else parent)
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in files]
                names = subs or [base]  # ``from . import x`` imports the submodule x
            else:
                continue
            deps |= {n for n in names if n in files and n != mod}
        graph[mod] = deps
    return graph


@pytest.mark.parametrize("package", ["shardwise", "shardwise_app", "shardwise_plan"])
def test_no_import_cycle_in_any_package(package: str) -> None:
    """No import cycle inside the library, the application or the planner, checked
    here without the counting tool (CI's clone has no ../shared)."""
    root = RUNTIME.parent / package
    graph = _package_graph(root)
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(mod: str, path: list[str]) -> None:
        state[mod] = 1
        for dep in sorted(graph[mod]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep) :] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, [*path, dep])
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [mod])


def _assignments(path: Path, attr: str) -> list[tuple[str, str]]:
    """Where ``path`` assigns an attribute ``attr``: (the enclosing class.function, the target)."""
    found = []

    def visit(node: ast.AST, where: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, [*where, child.name])
                continue
            targets: list[ast.expr] = []
            if isinstance(child, ast.Assign):
                targets = list(child.targets)
            elif isinstance(child, (ast.AugAssign, ast.AnnAssign)):
                targets = [child.target]
            for t in targets:
                for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if isinstance(el, ast.Attribute) and el.attr == attr:
                        found.append((".".join(where), ast.unparse(el)))
            visit(child, where)

    visit(ast.parse(path.read_text()), [])
    return found


def test_a_module_stage_and_a_group_state_are_written_only_through_their_tables() -> None:
    """``ModuleLifecycle.on`` (context.py) moves a module's stage through lifecycle.py's
    ``TRANSITIONS``, ``ParamGroup._to`` a group's memory state through
    ``GROUP_TRANSITIONS``; no other code writes either. The context writes its own
    phase only."""
    writes = [
        (p.stem, where, target)
        for p in LIBRARY_FILES
        for attr in ("phase", "stage", "state")
        for where, target in _assignments(p, attr)
    ]
    allowed = {
        ("context", "ModuleLifecycle.__init__", "self.stage"),
        ("context", "ModuleLifecycle.on", "self.stage"),
        ("param_group", "ParamGroup.__init__", "self.state"),
        ("param_group", "ParamGroup._to", "self.state"),
        # other things called state: torch's fully_shard.state, an autograd
        # function's context, an optimizer's state
        ("api", "", "fully_shard.state"),
        ("module", "_Unsharded.forward", "ctx.state"),
        ("module", "_AfterInputGrads.forward", "ctx.state"),
        ("step_in_backward", "_shadow", "shadow.state"),
    }
    wrong = [
        w
        for w in writes
        if w not in allowed
        and not (w[0] == "context" and w[1].startswith("FSDPContext.") and w[2] == "self.phase")
    ]
    assert not wrong, wrong


def test_step_in_backward_has_a_type() -> None:
    """A group's optimizer-in-backward stepper is a ``StepInBackward``, not ``Any``."""
    tree = ast.parse(PATH["param_group"].read_text())
    annotations = [
        ast.unparse(node.annotation)
        for node in ast.walk(tree)
        if isinstance(node, ast.AnnAssign) and ast.unparse(node.target) == "self.step_in_backward"
    ]
    assert annotations == ["StepInBackward | None"], annotations


def test_torch_distributed_is_called_only_in_the_collectives_layer() -> None:
    """Every process-group call goes through collectives.py, where observers (tests,
    the timeline) see it. Types (meshes, DTensors, placements, torch's FSDPModule)
    and DCP's storage calls in checkpoint.py are not calls to a process group."""
    offenders = []
    for path in LIBRARY_FILES:
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

    from shardwise.comm.reduce import ReduceJob

    params = list(inspect.signature(ReduceJob).parameters.values())
    defaulted = [p.name for p in params if p.default is not inspect.Parameter.empty]
    assert not defaulted, f"ReduceJob's {defaulted} have defaults that no caller relies on"


def test_features_reach_groups_through_functions_not_private_fields() -> None:
    """The face (optimizer_in_backward, optim/, checkpoint, ...) finds modules and groups
    through ``runtime.fsdp_module.sharded_states``/``param_groups`` and
    ``api.live_groups``, never through another object's private members."""
    private = ("_sharded_states", "_groups")
    wrong = []
    for path in LIBRARY_FILES:
        if FOLDER.get(path.stem) not in ("", "optim") or path.stem == "api":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in private:
                wrong.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert not wrong, wrong
