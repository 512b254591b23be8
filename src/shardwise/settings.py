"""One ``fully_shard`` call's settings, in one place: ``GroupSettings``.

Why one object: the public setters (``FSDPModule.set_*``, fsdp_module.py) and
``fully_shard``'s keywords write these, and the hooks (module.py), the group
(param_group.py), its gather (gather.py) and its reduction (reduce.py) read
them. The module's state and its group hold the same object, so a setting has
one home whoever reads it. Settings of a whole root (``set_is_last_backward``,
``set_post_optim_event``) are ``RootSettings`` in context.py.

What the layout derives from these (the dtypes a group computes and reduces
in, which also follow ``model.to(dtype)``) stays with the layout, and how the
group gathers is re-chosen when a setting that decides it changes
(``ParamGroup.use_comm_alloc``, ``use_custom_all_gather``,
``use_post_forward_group``: so those three are written only there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .comm_policy import CommPolicy
from .offload import CPUOffloadPolicy
from .precision import MixedPrecisionPolicy


@dataclass
class GroupSettings:
    """Everything one ``fully_shard`` call was told, and every setter since."""

    # fully_shard's keywords.
    mp_policy: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    offload_policy: CPUOffloadPolicy | None = None
    prefetch: int = 1  # modules gathered ahead, in forward and in backward
    # None is FSDP2's default: True, except for the root (its backward comes
    # first), resolved into ``reshard_after_forward`` when the root is known.
    reshard_after_forward_setting: bool | None = None
    reshard_after_forward: bool = True
    # The hooks' (set_reshard_after_backward, set_unshard_in_backward,
    # set_reduce_scatter_max_input_buffers).
    reshard_after_backward: bool = True
    unshard_in_backward: bool = True
    max_reduces_in_flight: int = 1
    # The reduction's (FSDP2's names; docs/design.md).
    requires_gradient_sync: bool = True  # False: sum locally, communicate nothing
    divide_factor: float | None = None  # None: the mean over every data-parallel rank
    requires_all_reduce: bool = True  # HSDP: False holds reduce-scattered sums back
    reduce_scatter_unused: bool = False  # give every trainable parameter a gradient
    force_sum: bool = False  # reduce with SUM only, never the backend's AVG
    all_reduce_hook: Any = None  # called on the reduced shard, before assignment
    custom_reduce_scatter: Any = None
    reduce_scatter_group: Any = None  # None: the shard group; or one of its own
    # The gather's (written through ParamGroup.use_*, which re-choose the way).
    custom_all_gather: Any = None
    comm_alloc: Any = None  # where gather outputs and reduction buffers come from
    post_forward_group: Any = None  # reshard_after_forward=int: backward gathers over n ranks
    # Quantized and node-local collectives (comm_policy.py; checked by ``comm_policy.check``
    # before it is written here). The reduction reads ``quantize_reduce`` as it runs; the
    # gather is re-chosen when it changes (pass it in ``GatherComm.policy``).
    comm_policy: CommPolicy | None = None
