"""A communication policy (ZeRO++'s qwZ, hpZ, qgZ) in a plan: bytes per link, time, memory.

Why modelled here and not run: the simulation (simulate.py) runs the runtime's
own collectives, unquantized, and the runtime's ``shardwise.CommPolicy`` may
not be there to run (the planner does not import it). ``CommPolicy`` below has
its field names, and ``CommModel`` rewrites each collective the simulation
recorded as the policy would run it:

- **qwZ** (``quantize_gather``): a gather sends each rank's shard as int8
  blocks of ``block_size`` elements and one fp32 scale a block, then
  dequantizes into the parameters' dtype. "forward" (``qwz``, as ``shardwise
  train --comm-policy`` names it): the forward's gathers,
  and, when every block is checkpointed, the recomputation's in backward (it
  must see the weights the forward saw) unless hpZ serves it, followed by the
  backward's own gather at full precision (the gradients are computed with
  the backward's values, as without checkpointing); "always": every gather
  (``qwz-always``).
- **hpZ** (``node_local_backward``): after forward the weights stay sharded
  over the node's ranks, so backward's gathers never leave it. This one the
  simulation runs for real: it is the runtime's ``reshard_after_forward=node
  size`` (plan.py), so its kept shards and node-local gathers are the runtime's.
- **qgZ** (``quantize_reduce``): a reduce-scatter that spans nodes becomes a
  reduce-scatter inside the node at the reduce dtype, then an all-to-all
  across nodes of int8 blocks and scales between the ranks of the same local
  index, dequantized and summed in fp32 into the same sharded gradient.

Bytes are what one rank receives, by where they came from: a group of ``g``
ranks over nodes of ``ns`` sends each rank ``(g-1)/g`` of the whole, of which
``(g-ns)/g`` from other nodes (``inter``) and ``(ns-1)/g`` from its own
(``intra``); a group inside one node is all intra. Time is the timeline's
rule for each leg: ``latency + bytes / bus bandwidth``, inter-node bandwidth
when the leg's group spans nodes (a ring is as fast as its slowest link).

The quantize and dequantize kernels are memory bound: each is charged its
bytes read and written at the device's memory bandwidth plus one operator's
fixed cost, on the collective's stream before or after the transfer, and the
same time again on the compute stream, whose SMs and memory bandwidth they
take (an upper bound: the two may overlap). Their buffers (the int8 blocks
sent and received, qgZ's node-level partial sum and its fp32 sum) are live
from the collective's issue to its wait.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .tracker import Event

QUANTIZE_GATHER = ("none", "forward", "always")
QUANT_DTYPES = ("int8", "float8_e4m3fn", "float8_e5m2")  # one byte an element each
SCALE_BYTES = 4  # one fp32 scale a block
# The names --comm-policy takes (shardwise train's), each a technique; joined by "+"
# they combine. qwz quantizes the forward's gathers, qwz-always backward's too.
TECHNIQUES = ("qwz", "hpz", "qgz")
COMM_NAMES = ("none", "qwz", "qwz-always", "hpz", "qgz", "zeropp")
# What a budget search tries: each technique, and all three.
SEARCHED = ("none", *TECHNIQUES, "zeropp")


@dataclass(frozen=True)
class CommPolicy:
    """The runtime's ``shardwise.CommPolicy``, as far as a plan needs it (same fields)."""

    quantize_gather: str = "none"  # "none" | "forward" | "always"
    node_local_backward: bool = False  # hpZ
    quantize_reduce: bool = False  # qgZ
    node_size: int | None = None  # ranks a node; None: the hardware's ranks_per_node
    block_size: int = 256  # elements a quantization block
    quant_dtype: str = "int8"

    @property
    def active(self) -> bool:
        return self.quantize_gather != "none" or self.node_local_backward or self.quantize_reduce

    def check(self) -> None:
        if self.quantize_gather not in QUANTIZE_GATHER:
            raise ValueError(
                f"quantize_gather must be one of {QUANTIZE_GATHER}, got {self.quantize_gather!r}"
            )
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {self.block_size!r}")
        if self.node_size is not None and (
            not isinstance(self.node_size, int) or self.node_size < 1
        ):
            raise ValueError(f"node_size must be an int >= 1, got {self.node_size!r}")
        if self.quant_dtype not in QUANT_DTYPES:
            raise ValueError(f"quant_dtype must be one of {QUANT_DTYPES}, got {self.quant_dtype!r}")

    def name(self) -> str:
        """The ``--comm-policy`` name that gives this policy (``describe`` its fields)."""
        parts = {"none": [], "forward": ["qwz"], "always": ["qwz-always"]}[self.quantize_gather]
        parts += ["hpz"] * self.node_local_backward + ["qgz"] * self.quantize_reduce
        if parts == list(TECHNIQUES):
            return "zeropp"
        return "+".join(parts) or "none"

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name(), **asdict(self)}


def parse_comm(text: str, node_size: int | None = None, block_size: int = 256) -> CommPolicy:
    """``--comm-policy``: none, qwz, qwz-always, hpz, qgz, zeropp (all three), or
    techniques joined by "+" (qwz+qgz). ValueError, one line, for anything else."""
    names = [t.strip().lower() for t in text.split("+")]
    known = set(COMM_NAMES)
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise ValueError(
            f"unknown communication policy {text!r}: choose from {', '.join(COMM_NAMES)}, "
            "or techniques joined by + (e.g. qwz+qgz)"
        )
    chosen = set(TECHNIQUES) if "zeropp" in names else set(names) - {"none"}
    if {"qwz", "qwz-always"} <= chosen:
        raise ValueError(f"communication policy {text!r}: give qwz or qwz-always, not both")
    gather = "always" if "qwz-always" in chosen else "forward" if "qwz" in chosen else "none"
    return CommPolicy(gather, "hpz" in chosen, "qgz" in chosen, node_size, block_size)


def quantized_bytes(n: int, block: int) -> int:
    """``n`` elements as one-byte blocks of ``block`` and an fp32 scale each."""
    return n + SCALE_BYTES * -(-n // block)


@dataclass(frozen=True)
class Leg:
    """One transfer of a collective as the policy runs it: what one rank receives."""

    coll: str  # "all_gather" | "reduce_scatter" | "all_to_all" | "all_reduce"
    group: int
    nbytes: int
    intra: int  # of nbytes, from ranks of this rank's node
    inter: int  # of nbytes, from other nodes
    crosses: bool  # priced at the inter-node bandwidth


def split(share: int, group: int, node: int) -> tuple[int, int]:
    """``share`` bytes received in a group of ``group`` consecutive ranks: (intra, inter)."""
    if group <= node:
        return share, 0
    inter = share * (group - node) // (group - 1)
    return share - inter, inter


@dataclass(frozen=True)
class CommModel:
    """A policy applied at one world: ``node`` ranks a node; ``recompute``: every block
    is checkpointed (its backward gather is the recomputation's); ``round_to``: the
    allocator's block (buffers' sizes rounded up to it)."""

    policy: CommPolicy
    node: int
    world: int
    recompute: bool = False
    round_to: int = 1

    def _round(self, n: int) -> int:
        r = max(1, self.round_to)
        return -(-n // r) * r if n else 0

    def quantizes_gather(self, e: Event) -> bool:
        mode = self.policy.quantize_gather
        if mode == "always":
            return True
        if mode != "forward":
            return False
        # A recomputed forward gathers what the forward gathered; under hpZ it gathers
        # the kept node copy, which holds the forward's dequantized weights already.
        served = self.policy.node_local_backward and self.world > self.node  # hpZ's copy
        return e.phase == "forward" or (self.recompute and not served)

    def regathers_for_backward(self, e: Event) -> bool:
        """Whether a backward gather is the recomputation's quantized one followed by
        the backward's at full precision ("forward" with checkpointing, no hpZ copy):
        the runtime recomputes with the forward's values, then computes the gradients
        with the backward's, as without checkpointing (module.py's post-forward)."""
        served = self.policy.node_local_backward and self.world > self.node
        return (
            self.policy.quantize_gather == "forward"
            and self.recompute
            and not served
            and e.phase != "forward"
        )

    def quantizes_reduce(self, e: Event) -> bool:
        return self.policy.quantize_reduce and e.group > self.node

    def legs(self, e: Event) -> list[Leg]:
        """An issued collective, as the policy runs it."""
        g, ns, block = e.group, self.node, self.policy.block_size
        if e.coll == "all_reduce":  # HSDP's, over the replicas: across nodes once the world is
            crosses = self.world > ns
            return [
                Leg(e.coll, g, e.nbytes, 0 if crosses else e.nbytes, e.nbytes * crosses, crosses)
            ]
        if e.coll == "all_gather" and g > 1 and self.quantizes_gather(e):
            q = quantized_bytes(e.numel, block)  # one rank's shard, quantized
            inter = max(0, g - ns) * q
            legs = [Leg(e.coll, g, (g - 1) * q, (g - 1) * q - inter, inter, g > ns)]
            if self.regathers_for_backward(e):
                intra, inter = split(e.nbytes, g, ns)
                legs.append(Leg(e.coll, g, e.nbytes, intra, inter, g > ns))
            return legs
        if e.coll == "reduce_scatter" and self.quantizes_reduce(e):
            nodes = g // ns
            part = e.full_numel // ns  # one rank's slice of its node's sum
            inside = (ns - 1) * part * e.itemsize
            across = (nodes - 1) * quantized_bytes(e.numel, block)
            return [
                Leg("reduce_scatter", ns, inside, inside, 0, False),
                Leg("all_to_all", nodes, across, 0, across, True),
            ]
        intra, inter = split(e.nbytes, g, ns)
        return [Leg(e.coll, g, e.nbytes, intra, inter, g > ns)]

    def kernel_bytes(self, e: Event) -> list[int]:
        """Bytes each quantize or dequantize kernel of the collective reads and writes."""
        block = self.policy.block_size
        if e.coll == "all_gather" and e.group > 1 and self.quantizes_gather(e):
            s, g = e.numel, e.group
            return [
                s * e.itemsize + quantized_bytes(s, block),  # this rank's shard, quantized
                g * quantized_bytes(s, block) + g * s * e.itemsize,  # every shard, dequantized
            ]
        if e.coll == "reduce_scatter" and self.quantizes_reduce(e):
            s, nodes = e.numel, e.group // self.node
            q = nodes * quantized_bytes(s, block)
            part = e.full_numel // self.node
            return [part * e.itemsize + q, q + s * 4]  # quantize the slice; dequantize + sum
        return []

    def extra_bytes(self, e: Event) -> int:
        """Device bytes the policy holds beside the runtime's own buffers, issue to wait."""
        block = self.policy.block_size
        if e.coll == "all_gather" and e.group > 1 and self.quantizes_gather(e):
            q = quantized_bytes(e.numel, block)
            return self._round(q) + self._round(e.group * q)  # sent, received
        if e.coll == "reduce_scatter" and self.quantizes_reduce(e):
            nodes = e.group // self.node
            part = e.full_numel // self.node
            q = self._round(nodes * quantized_bytes(e.numel, block))
            # the node's partial sum, the blocks sent and received, the fp32 sum
            return self._round(part * e.itemsize) + 2 * q + self._round(e.numel * 4)
        return 0


def comm_live(events: list[Event], model: CommModel) -> list[int]:
    """Per event, the bytes of the policy's own buffers live then (issue to wait)."""
    extra = [0] * len(events)
    waited: dict[int, int] = {}
    for i, e in enumerate(events):
        if e.kind == "wait":
            waited.setdefault(e.key, i)
    for i, e in enumerate(events):
        if e.kind != "issue":
            continue
        n = model.extra_bytes(e)
        if n:
            for j in range(i, max(i + 1, waited.get(e.key, len(events)))):
                extra[j] += n
    return extra


def traffic(events: list[Event], model: CommModel) -> dict[str, Any]:
    """What one rank receives in the step: by collective, and by link kind."""
    by_kind: dict[str, int] = {}
    link = {"intra": 0, "inter": 0}
    link_by_kind: dict[str, dict[str, int]] = {}
    for e in events:
        if e.kind != "issue":
            continue
        for leg in model.legs(e):
            by_kind[leg.coll] = by_kind.get(leg.coll, 0) + leg.nbytes
            link["intra"] += leg.intra
            link["inter"] += leg.inter
            k = link_by_kind.setdefault(leg.coll, {"intra": 0, "inter": 0})
            k["intra"] += leg.intra
            k["inter"] += leg.inter
    return {
        "bytes_per_rank": by_kind,
        "bytes_per_link": link,
        "bytes_per_link_by_kind": link_by_kind,
    }
