"""The planner: one rank of any world size simulated, to predict memory and step time.

``shardwise.plan(build, world_size, batch_size=..., seq_len=..., policy=...)``
runs the real runtime under torch's fake process group and fake tensors
(simulate.py), watches every storage and operator (tracker.py) and replays
the step against a machine's rates (timeline.py). ``fastest_within`` searches
the policies for one that fits a memory budget.
"""

from .plan import GIB, NothingFits, Plan, candidate_policies, fastest_within, plan
from .policy import H200, HARDWARE, THIS_CPU, Hardware, Policy

__all__ = [
    "GIB",
    "H200",
    "HARDWARE",
    "THIS_CPU",
    "Hardware",
    "NothingFits",
    "Plan",
    "Policy",
    "candidate_policies",
    "fastest_within",
    "plan",
]
