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


# ---- the runtime's own layers ---------------------------------------------------------------

RUNTIME = LIBRARY
# Top to bottom. A file may import the files of any layer below its own, none
# of its own layer or above. The runtime's path through one step is
# module -> root -> context -> param_group -> gather/reduce -> collectives.
LAYERS: list[tuple[str, ...]] = [
    ("__init__",),
    # The public calls and what they are built from.
    ("patch", "checkpoint", "optimizer_in_backward", "observe", "clip", "materialize"),
    ("api",),
    ("pipeline",),  # fully_shard.state for torch.distributed.pipelining (an adapter)
    ("fsdp_module",),
    # The runtime.
    ("module",),  # one module's hooks (ModuleState)
    ("pipeline_stage",),  # a root's first forward inside a pipeline stage: refusals
    ("root",),  # the root's boundaries: every module at a forward's start and end, a backward's end
    ("check",),  # lifecycle checks: read the context and the modules' lifecycles
    ("context",),  # the root's shared state and each module's lifecycle (its stage)
    ("param_group",),  # one group's gather/reshard/reduce lifecycle
    ("mesh_part",),  # a group's parameters on one mesh, and its parts' reductions as one
    ("gather", "reduce", "step_in_backward"),  # strategies, given the layout; the stepper
    ("flat_shard",),  # the layout
    ("sharded_param",),
    ("extensions",),
    # Below everything: the timeline, settings, the copies, the collectives, the labels.
    ("trace",),
    ("settings", "checkpoint_integrity"),
    ("lifecycle",),  # the states, events and transition tables (imports nothing)
    # Collectives that know the node boundary, composed of collectives.py's calls.
    ("node_collectives",),
    ("precision", "tensor_parallel", "collectives", "offload", "comm_policy"),
    ("containers", "labels", "quantize", "placement"),
    ("safe_load",),  # reading checkpoint files without running code (torch only)
    ("quantize_gpu",),  # quantize.py's int8 pack and unpack fused on CUDA (Triton, lazily)
]
LAYER = {name: i for i, layer in enumerate(LAYERS) for name in layer}
RUNTIME_FILES = sorted(p.stem for p in RUNTIME.glob("*.py") if p.name not in RUN_ONLY)
BELOW_THE_HOOKS = [name for name in RUNTIME_FILES if LAYER.get(name, -1) > LAYER["module"]]


def _imports(path: Path) -> set[str]:
    """The library files ``path`` imports, by name: every import in it, at the top,
    under ``TYPE_CHECKING`` or inside a function."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from .x import y / from . import x
                names.update([base.split(".")[0]] if base else [a.name for a in node.names])
            elif base == "shardwise":
                names.update(a.name for a in node.names)
            elif base.startswith("shardwise."):
                names.add(base.split(".")[1])
        elif isinstance(node, ast.Import):
            names.update(
                a.name.split(".")[1] for a in node.names if a.name.startswith("shardwise.")
            )
    return names & set(RUNTIME_FILES)


def test_every_library_file_has_a_layer() -> None:
    """A new file is placed in ``LAYERS`` (and so in the picture in docs/design.md)."""
    assert len(RUNTIME_FILES) > 20, RUNTIME_FILES  # the scan found the library
    missing = [name for name in RUNTIME_FILES if name not in LAYER]
    assert not missing, f"add {missing} to LAYERS"
    gone = [name for name in LAYER if name not in RUNTIME_FILES]
    assert not gone, f"{gone} are in LAYERS but not in the library"


@pytest.mark.parametrize("name", RUNTIME_FILES)
def test_every_import_goes_to_a_layer_below(name: str) -> None:
    """No import goes to a file of the same layer or above: nothing calls up."""
    up = sorted(n for n in _imports(RUNTIME / f"{name}.py") if LAYER[n] <= LAYER[name])
    assert not up, f"{name}.py imports {up}, of its own layer or above it"


@pytest.mark.parametrize("name", BELOW_THE_HOOKS)
def test_lower_layers_never_import_the_layers_above(name: str) -> None:
    above = {n for n in RUNTIME_FILES if LAYER[n] <= LAYER["module"]}
    up = _imports(RUNTIME / f"{name}.py") & above
    assert not up, f"{name}.py imports {sorted(up)}, a layer above it"


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
        for p in sorted(RUNTIME.glob("*.py"))
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
    tree = ast.parse((RUNTIME / "param_group.py").read_text())
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
