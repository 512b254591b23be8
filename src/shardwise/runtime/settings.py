"""One ``fully_shard`` call's settings, in one place: ``GroupSettings``.

Why one object: ``fully_shard``'s keywords and the public setters
(``FSDPModule.set_*``, fsdp_module.py) decide them, and the hooks (module.py),
the group (param_group.py), its gather (gather.py) and its reduction
(reduce.py) read them. The module's state and its group hold the same object,
so a setting has one home whoever reads it. Settings of a whole root
(``set_is_last_backward``, ``set_post_optim_event``) are ``RootSettings`` in
context.py.

Why frozen, with one writer: what ``fully_shard`` fixes (``FIXED``: the
mixed-precision and offload policies, the prefetch depth) never changes; the
rest changes only through ``change``, which ``ModuleState.change_settings``
(module.py) alone calls (tests/library/test_layers.py checks it), so that a
change that decides how the group gathers re-chooses the gather every time.
A reduction reads ``reduce``, a snapshot made when a setting changes, not the
object: a reduction in flight keeps the settings it started with.

Alternatives considered: a mutable dataclass written field by field (what
this was: 14 writers in three files, and a job in flight read a divide factor
or a hook changed after it started); a new object per change (every holder
would have to be told).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from torch.distributed import ProcessGroup

from ..comm.collectives import Allocator
from ..comm.comm_policy import CommPolicy
from ..comm.reduce import ReduceSettings
from ..layout.offload import CPUOffloadPolicy
from ..layout.precision import MixedPrecisionPolicy

# What ``fully_shard`` fixes: ``change`` refuses these.
FIXED = frozenset({"mp_policy", "offload_policy", "prefetch"})
# What decides how a group gathers and reduce-scatters: a change re-chooses both
# (``ParamGroup.settings_changed``).
COMM_SETTINGS = frozenset(
    {
        "custom_all_gather",
        "custom_reduce_scatter",
        "comm_alloc",
        "post_forward_group",
        "reduce_scatter_group",
        "comm_policy",
    }
)


@dataclass(frozen=True, eq=False)
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
    # called on the reduced shard, before assignment
    all_reduce_hook: Callable[[Any], None] | None = None
    custom_reduce_scatter: Callable[..., Any] | None = None
    reduce_scatter_group: ProcessGroup | None = None  # None: the shard group; or one of its own
    # The gather's (``COMM_SETTINGS``: a change re-chooses how the group communicates).
    custom_all_gather: Callable[..., Any] | None = None
    comm_alloc: Allocator | None = None  # where gather outputs and reduction buffers come from
    # reshard_after_forward=int: backward gathers over n ranks
    post_forward_group: ProcessGroup | None = None
    # Quantized and node-local collectives (comm_policy.py; checked by ``comm_policy.check``
    # before it is written here). The reduction reads ``quantize_reduce`` as it runs; the
    # gather is re-chosen when it changes (pass it in ``GatherComm.policy``).
    comm_policy: CommPolicy | None = None
    # What a reduction reads (a snapshot, remade by ``change``).
    reduce: ReduceSettings = field(init=False)

    def __post_init__(self) -> None:
        self._snapshot()

    def change(self, **changes: Any) -> None:
        """Set the named settings (``ModuleState.change_settings`` is the one caller)."""
        for name in changes:
            if name not in _NAMES:
                raise AttributeError(f"GroupSettings has no setting {name!r}")
            if name in FIXED:
                raise AttributeError(f"GroupSettings.{name} cannot change after fully_shard")
        for name, value in changes.items():
            object.__setattr__(self, name, value)
        self._snapshot()

    def _snapshot(self) -> None:
        object.__setattr__(
            self,
            "reduce",
            ReduceSettings(
                divide_factor=self.divide_factor,
                all_reduce_hook=self.all_reduce_hook,
                force_sum=self.force_sum,
                requires_all_reduce=self.requires_all_reduce,
                reduce_scatter_unused=self.reduce_scatter_unused,
                offload_policy=self.offload_policy,
            ),
        )


_NAMES = frozenset(f.name for f in fields(GroupSettings)) - {"reduce"}
