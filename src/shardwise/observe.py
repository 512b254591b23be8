"""Watching the runtime from outside: what it communicates, waits for, copies, labels.

    from shardwise import observe

    remove = observe.add_collective_observer(lambda record, pending: print(record))
    ...
    remove()

Every ``add_*`` returns a function that removes what it added. Observers run
on the thread that issues the work (the autograd thread in backward) and
should be quick: they run once per module per step.

- ``add_collective_observer(fn)``: ``fn(record, pending)`` for every collective
  issued (``CollectiveRecord``: kind, dtype, elements, bytes, group size, label);
  ``pending.on_done`` takes callbacks run once it is waited for.
- ``add_wait_observer(fn)``: ``fn(pending, False)`` just before a ``Pending``
  (a collective, a cast or an upload in flight; ``.label``, ``.kind``) is
  waited for, ``fn(pending, True)`` right after: the time compute waited.
- ``add_transfer_observer(fn)``: ``fn(transfer)`` after each host<->device copy
  of CPU offload is issued (``Transfer``: kind "upload" or "download", the
  group's label, what was read, the copy made, bytes), and with kind
  "release" when the device tensor a download read is let go. Under an
  offload policy every upload and download makes a tensor with its own
  storage, also on a CPU run.
- ``LinkBytes(node_size)``: a collective observer that sums the bytes this
  rank sends inside its node and to other nodes (``.intra``, ``.inter``,
  ``.by_kind``), under a stated model of each collective (direct or ring;
  its docstring). ``CollectiveRecord.ranks`` names the group's world ranks.
- ``LABELS``, ``PREFIX``, ``memory_labels()``: the scopes the runtime names its
  work by in torch's profiler (``record_function("shardwise::gather")``)
  and, inside ``memory_labels()``, in the CUDA allocator's record.

shardwise's own timeline (``shardwise.trace``) is built on the first two.
"""

from __future__ import annotations

from .comm.collectives import CollectiveRecord, Pending, add_wait_observer
from .comm.collectives import add_observer as add_collective_observer
from .comm.node_collectives import LinkBytes
from .layout.labels import LABELS, PREFIX, memory_labels
from .layout.offload import Transfer, add_transfer_observer

__all__ = [
    "LABELS",
    "PREFIX",
    "CollectiveRecord",
    "LinkBytes",
    "Pending",
    "Transfer",
    "add_collective_observer",
    "add_transfer_observer",
    "add_wait_observer",
    "memory_labels",
]
