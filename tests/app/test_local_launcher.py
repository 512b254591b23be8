"""The one local launcher (shardwise_plan/ranks.py): what its ranks get, how they end, and
that the application, the planner and the benchmark start ranks through it alone.

The ranks here are a few lines of Python without torch (a module written to a
temporary folder), so each test takes about a second.
"""

from __future__ import annotations

import ast
import json
import os
import signal
from pathlib import Path

import pytest

from shardwise_plan.ranks import LocalRanks, exit_code

SRC = Path(__file__).resolve().parents[2] / "src"

PROBE = """
import json, os, sys, time
out, mode = sys.argv[1], sys.argv[2]
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "EXTRA", "SHARDWISE_LAUNCH_ID")
seen = {k: os.environ.get(k) for k in keys}
fd = os.environ.get("EXTRA_FD")
seen["from_fd"] = os.read(int(fd), 100).decode() if fd else None
with open(os.path.join(out, f"rank{seen['RANK']}.json"), "w") as f:
    json.dump(seen, f)
if mode == "fail-rank-1" and seen["RANK"] == "1":
    sys.exit(3)
if mode == "fail-rank-1":
    time.sleep(60)  # a peer that never notices
"""


@pytest.fixture
def probe_env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "probe_rank.py").write_text(PROBE)
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "SHARDWISE_LAUNCH_ID": "outer"}


@pytest.mark.timeout(60)
def test_each_rank_gets_torchruns_environment_and_its_own_extras(tmp_path, probe_env) -> None:
    handed: list[int] = []

    def per_rank(rank: int) -> tuple[dict[str, str], tuple[int, ...]]:
        read, write = os.pipe()
        os.write(write, f"hello {rank}".encode())
        os.close(write)
        handed.append(read)
        return {"EXTRA": f"x{rank}", "EXTRA_FD": str(read)}, (read,)

    ranks = LocalRanks(
        "probe_rank", [str(tmp_path), "ok"], 2, world=4, node_rank=1,
        endpoint="127.0.0.1:29999", env=probe_env, per_rank=per_rank,
    )  # fmt: skip
    # The descriptors handed to the ranks are closed here: only the ranks hold them.
    for fd in handed:
        with pytest.raises(OSError):
            os.fstat(fd)
    codes, killed = ranks.wait()
    assert codes == {2: 0, 3: 0} and killed == []
    for rank, local in ((2, 0), (3, 1)):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen == {
            "RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": "4",
            "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999",
            "EXTRA": f"x{rank}", "SHARDWISE_LAUNCH_ID": "outer", "from_fd": f"hello {rank}",
        }  # fmt: skip


@pytest.mark.timeout(60)
def test_a_failed_rank_ends_its_peers_after_the_grace(tmp_path, probe_env) -> None:
    ranks = LocalRanks("probe_rank", [str(tmp_path), "fail-rank-1"], 2, env=probe_env)
    try:
        codes, killed = ranks.wait(grace_s=0.5)
    finally:
        ranks.kill(ranks.running())
    assert killed == [0] and codes == {0: -signal.SIGKILL, 1: 3}
    assert exit_code(codes[0]) == 128 + signal.SIGKILL and exit_code(codes[1]) == 3


@pytest.mark.timeout(60)
def test_run_ranks_names_the_failure_not_the_peer_it_killed(monkeypatch, tmp_path) -> None:
    """The planner's ``run_ranks``: the failing rank's code, not 137 of a peer killed
    after the grace; and the application's launch id is not passed on."""
    import shardwise_plan.ranks as ranks_module

    started: list[LocalRanks] = []
    real = ranks_module.LocalRanks

    class Probe(real):  # type: ignore[misc, valid-type]
        def __init__(self, module: str, argv: list[str], nproc: int, **kw) -> None:
            assert module == "shardwise_plan.worker" and "SHARDWISE_LAUNCH_ID" not in kw["env"]
            env = {**kw["env"], "PYTHONPATH": str(tmp_path)}
            super().__init__("probe_rank", [str(tmp_path), "fail-rank-1"], nproc, env=env)
            started.append(self)

        def wait(self, grace_s: float = 0.5, poll_s: float = 0.05) -> tuple[dict, list]:
            return super().wait(0.5, poll_s)  # not the 5 s a real launch gives its peers

    (tmp_path / "probe_rank.py").write_text(PROBE)
    monkeypatch.setenv("SHARDWISE_LAUNCH_ID", "app")
    monkeypatch.setattr(ranks_module, "LocalRanks", Probe)
    assert ranks_module.run_ranks(["measure"], 2) == 3
    assert started and not started[0].running()


def test_only_the_local_launcher_starts_ranks() -> None:
    """No other file of the application or the planner starts processes for ranks or
    sets their rendezvous: the app's launcher, the planner and the benchmark share it."""
    found = []
    for path in sorted(
        [*(SRC / "shardwise_app").rglob("*.py"), *(SRC / "shardwise_plan").rglob("*.py")]
    ):
        tree = ast.parse(path.read_text(), str(path))
        names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)}
        if names & {"Popen", "Process", "get_context"} or strings & {"MASTER_PORT", "MASTER_ADDR"}:
            found.append(str(path.relative_to(SRC)))
    assert found == ["shardwise_plan/ranks.py"], found
    users = {
        p: "LocalRanks" in (SRC / p).read_text()
        for p in ("shardwise_app/cli/launcher.py", "shardwise_app/bench/jobs.py")
    }
    assert all(users.values()), users
    assert "run_ranks" in (SRC / "shardwise_plan/measure.py").read_text()
