"""The public observation API (``shardwise.observe``): what a tool outside the runtime sees.

Collectives and their waits, and under CPU offload every copy between host and
device, each as it is issued; a CPU run of an offloaded model makes the same
copies, each with storage of its own, that a GPU run makes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from dist_utils import run_distributed
from shardwise import CPUOffloadPolicy, fully_shard, observe

pytestmark = pytest.mark.timeout(240)


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, offload_policy=CPUOffloadPolicy(pin_memory=False))
    fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=False))
    return model


def observed_worker(rank: int, world: int) -> dict[str, list]:
    model = _model()
    seen: dict[str, list] = {"collective": [], "wait": [], "transfer": [], "ranks": []}
    removers = [
        observe.add_collective_observer(lambda rec, p: seen["collective"].append(rec.kind)),
        observe.add_collective_observer(lambda rec, p: seen["ranks"].append(rec.ranks)),
        observe.add_wait_observer(lambda p, done: seen["wait"].append((p.kind, p.label, done))),
        observe.add_transfer_observer(lambda t: seen["transfer"].append(t)),
    ]
    try:
        model(torch.randn(2, 8)).sum().backward()
    finally:
        for remove in removers:
            remove()
    model(torch.randn(2, 8)).sum().backward()  # removed: nothing more is seen
    transfers = seen["transfer"]
    for t in transfers:
        assert isinstance(t, observe.Transfer)
        if t.kind == "release":
            assert t.out is None
        else:  # its own storage, also on a CPU run
            assert t.out is not None
            assert t.out.untyped_storage().data_ptr() != t.src.untyped_storage().data_ptr()
        assert t.nbytes > 0
    labels = {t.label for t in transfers}
    return {
        "collective": sorted(set(seen["collective"])),
        "wait": seen["wait"],
        "transfer": [t.kind for t in transfers],
        "labels": sorted(labels),
        "ranks": sorted(set(seen["ranks"])),
    }


def test_link_bytes_is_public() -> None:
    """``observe.LinkBytes`` counts a record's bytes by link (tests/library/comm/test_comm_policy.py
    checks it on 2 nodes x 2 ranks)."""
    counter = observe.LinkBytes(1, rank=0)
    counter(observe.CollectiveRecord("all_gather", torch.float32, 4, 16, 2, "", ranks=(0, 1)))
    assert (counter.intra, counter.inter) == (0, 8)


@pytest.mark.parametrize("world", [1, 2])
def test_observers_see_collectives_waits_and_offload_copies(world: int) -> None:
    for got in run_distributed(observed_worker, world):
        kinds = got["transfer"]
        # Two groups (the root holds no parameter): an upload each in forward and
        # in backward, a download each, every download's device tensor let go
        # (the last at the end of backward).
        assert kinds.count("upload") == 4, kinds
        assert kinds.count("download") == 2, kinds
        assert kinds.count("release") == 2, kinds
        assert kinds.index("release") > kinds.index("download"), kinds
        assert got["labels"] == ["0", "2"]
        waits = got["wait"]
        assert waits, "a wait observer saw no wait"
        # Each wait is announced before and after, in order.
        assert [done for *_, done in waits] == [False, True] * (len(waits) // 2)
        if world > 1:
            assert {"all_gather", "reduce_scatter"} <= set(got["collective"])
            # Every record names its group's world ranks (LinkBytes reads them).
            assert got["ranks"] == [tuple(range(world))], got["ranks"]
        else:
            assert {kind for kind, _, _ in waits} >= {"upload"}
