"""shardwise_plan: one rank of any world size simulated, to predict memory and step time.

    from shardwise_plan import H100, Policy, plan

    p = plan(build, 512, batch_size=2, seq_len=2048, policy=Policy(mp="bf16"),
             hardware=H100, optimizer="adamw-fused")
    print(p.peak_bytes, p.step_ms)

``plan`` runs shardwise's real runtime under torch's fake process group and
fake tensors (simulate.py), watches every storage and operator (tracker.py,
through ``shardwise.observe``) and replays the step against a machine's rates
(timeline.py). ``fastest_within`` searches the policies for one that fits a
memory budget. The library never imports this package.
"""

from .comm import COMM_NAMES, CommPolicy, parse_comm
from .hardware import B200, CPU, H100, H200, HARDWARE, Hardware
from .optimizers import OPTIMIZERS
from .plan import GIB, NothingFits, Plan, candidate_policies, fastest_within, plan, replan
from .policy import Policy

__all__ = [
    "B200",
    "COMM_NAMES",
    "CPU",
    "CommPolicy",
    "GIB",
    "H100",
    "H200",
    "HARDWARE",
    "OPTIMIZERS",
    "Hardware",
    "NothingFits",
    "Plan",
    "Policy",
    "candidate_policies",
    "fastest_within",
    "parse_comm",
    "plan",
    "replan",
]
