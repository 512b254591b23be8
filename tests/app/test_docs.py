"""The docs say what the code does: README's ``fully_shard`` signature and command
list match the source, no doc prints a path of the machine it was written on, and
every test file a doc cites exists.

Read from the source with ``ast`` rather than by importing it: these checks need
no torch and take well under a second.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))


def _fully_shard_keywords() -> list[str]:
    tree = ast.parse((ROOT / "src/shardwise/api.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "fully_shard":
            return [a.arg for a in node.args.kwonlyargs]
    raise AssertionError("src/shardwise/api.py defines no fully_shard")


def _commands() -> list[str]:
    tree = ast.parse((ROOT / "src/shardwise_app/cli/main.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "COMMANDS" for t in node.targets
        ):
            assert isinstance(node.value, ast.Dict)
            return [ast.literal_eval(k) for k in node.value.keys if k is not None]
    raise AssertionError("src/shardwise_app/cli/main.py has no COMMANDS table")


def test_readme_signature_lists_every_keyword_of_fully_shard() -> None:
    keywords = _fully_shard_keywords()
    assert {"shard_placement_fn", "offload_policy", "dp_mesh_dims", "comm_policy"} <= set(
        keywords
    ), keywords
    lines = [ln for ln in README.read_text().splitlines() if "`fully_shard(module, *, " in ln]
    # The Features list spells the signature with defaults ("name=..."): that one
    # must name every keyword, in the function's order.
    with_defaults = [ln for ln in lines if "mesh=None" in ln]
    assert len(with_defaults) == 1, with_defaults
    listed = re.findall(r"(\w+)=", with_defaults[0])
    assert listed == keywords, (listed, keywords)


@pytest.mark.parametrize("doc", [README, ROOT / "docs/cli.md"], ids=lambda p: p.name)
def test_every_command_is_listed(doc: Path) -> None:
    text = doc.read_text()
    commands = _commands()
    assert {"plan", "calibrate"} <= set(commands), commands
    missing = [c for c in commands if f"shardwise {c}" not in text]
    assert not missing, f"{doc.name} never names: {missing}"


# A path that exists only on the machine a doc was written on (a checkout, a
# temporary folder, a home directory); a reader's runs land under ``runs/``.
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|tmp|root|home|Users)/")


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.name)
def test_no_path_of_the_development_machine(doc: Path) -> None:
    hits = [
        f"{doc.name}:{i}: {line.strip()}"
        for i, line in enumerate(doc.read_text().splitlines(), 1)
        if MACHINE_PATH.search(line)
    ]
    assert not hits, "\n".join(hits)


def test_every_cited_test_file_exists() -> None:
    cited: set[str] = set()
    for doc in [README, *DOCS, ROOT / "pyproject.toml"]:
        cited |= set(re.findall(r"\btests/[\w/]+\.py\b", doc.read_text()))
    assert cited, "no doc cites a test file: the pattern is wrong"
    missing = sorted(p for p in cited if not (ROOT / p).exists())
    assert not missing, missing
