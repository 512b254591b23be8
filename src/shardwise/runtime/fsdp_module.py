"""``FSDPModule``: the public face ``fully_shard`` mixes into a module's class.

torch's ``FSDPModule`` methods with FSDP2's meaning (the README has the table
of every FSDP2 name and its status here). The class derives from torch's
``FSDPModule``: frameworks decide on ``isinstance(m, FSDPModule)`` (torchtitan
turns gradient division off on such modules, Lightning's ``no_backward_sync``
looks for them), and a shardwise module must be found by those checks. Every
method torch's class has is defined here, so none of FSDP2's internals is
ever reached: a method of a torch release newer than this file raises,
naming itself (``_refuse_the_rest``). Each method only records a setting
on the module's ``ModuleState``, its ``ParamGroup`` or the root's context;
the hooks (module.py) and the reduction (param_group.py) read it. Settings
that cannot apply on a backend say so naming it, and change nothing.
"""

from __future__ import annotations

import warnings
from typing import Any, cast

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule as _TorchFSDPModule
from torch.distributed.fsdp import UnshardHandle as _TorchUnshardHandle

from ..comm import collectives, comm_policy, node_collectives
from ..comm.comm_policy import CommPolicy
from . import root
from .context import FSDPContext, Phase, RootSettings
from .module import ModuleState
from .param_group import ParamGroup


class UnshardHandle(_TorchUnshardHandle):
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes it.

    It waits for the gather its ``unshard`` issued, and only that one: once a
    forward has used and resharded it, a late ``wait()`` does nothing (it must
    not gather again and leave the module's gathered copies installed as its
    parameters), as under FSDP2.
    """

    def __init__(self, group: ParamGroup | None) -> None:
        self._group = group
        self._gather = None if group is None else group.in_flight

    def wait(self) -> None:
        group, gather = self._group, self._gather
        self._group = self._gather = None
        if group is not None and gather is not None and group.in_flight is gather:
            group.wait_unsharded()


class FSDPModule(_TorchFSDPModule):
    """Mixed into a module's class by ``fully_shard``; torch's FSDPModule methods."""

    _shardwise_state: ModuleState
    _shardwise_orig_cls: type  # the class fully_shard mixed this into (api.py sets it)

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """Constructing the ``FSDP<Name>`` class directly builds a plain ``<Name>``.

        Containers make new instances of their own class: slicing a sharded
        ``nn.Sequential`` (``model[:2]``) calls ``type(model)(...)``. That new
        container was never sharded (its children are), so it gets the
        original class. Without arguments (copy, pickle) the class is kept.
        """
        if not args and not kwargs:
            return object.__new__(cls)
        orig = cls._shardwise_orig_cls
        obj = orig.__new__(orig, *args, **kwargs)
        obj.__init__(*args, **kwargs)
        return obj

    @property
    def phase(self) -> Phase:
        return self._shardwise_state.phase

    @property
    def fsdp_context(self) -> FSDPContext | None:
        """The shared root context (None until the first forward)."""
        return self._shardwise_state.context

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        state = self._shardwise_state
        group = state.group
        if state.context is not None and state.context.check:
            state.context.log(f"{state.label}: unshard() called directly")
        if group is not None:
            group.unshard()
        handle = UnshardHandle(group)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        self._shardwise_state.reshard_now()

    def set_modules_to_forward_prefetch(self, modules: list[_TorchFSDPModule]) -> None:
        self._shardwise_state.fwd_targets = [_state_of(m, "forward prefetch") for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[_TorchFSDPModule]) -> None:
        self._shardwise_state.bwd_targets = [_state_of(m, "backward prefetch") for m in modules]

    def _sharded_states(self, recurse: bool) -> list[ModuleState]:
        return sharded_states(self, recurse)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise TypeError(
                f"set_reshard_after_forward expects a bool, got {reshard_after_forward!r}"
            )
        for s in self._sharded_states(recurse):
            s.change_settings(
                reshard_after_forward=reshard_after_forward,
                reshard_after_forward_setting=reshard_after_forward,
                post_forward_group=None,  # as FSDP2: a bool replaces an int
            )

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """Keep parameters gathered after backward (e.g. between accumulation microbatches)."""
        for s in self._sharded_states(recurse):
            s.change_settings(reshard_after_backward=reshard_after_backward)

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """While False, backward sums gradients locally with no communication."""
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(
                f"set_requires_gradient_sync expects a bool, got {requires_gradient_sync!r}"
            )
        for s in self._sharded_states(recurse):
            if s.group is not None:
                s.change_settings(requires_gradient_sync=requires_gradient_sync)

    def _groups(self, recurse: bool) -> list[ParamGroup]:
        return [s.group for s in self._sharded_states(recurse) if s.group is not None]

    def _with_groups(self, recurse: bool) -> list[ModuleState]:
        """The sharded modules with parameters (a group), this one's or all under it."""
        return [s for s in self._sharded_states(recurse) if s.group is not None]

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: backward needs none of this module's parameters (an embedding);
        its pre-backward then gathers nothing."""
        self._shardwise_state.change_settings(
            unshard_in_backward=_bool("set_unshard_in_backward", unshard_in_backward)
        )

    def set_gradient_divide_factor(self, factor: float) -> None:
        """This module's reduced gradients are the sum over ranks divided by ``factor``
        (default: the number of data-parallel ranks, the mean). As in FSDP2 it
        applies to this module only: call it on each. Works on gloo too: we
        sum, then divide, where FSDP2 needs ``PREMUL_SUM``."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(f"set_gradient_divide_factor expects a number > 0, got {factor!r}")
        for s in self._with_groups(recurse=False):
            s.change_settings(divide_factor=float(factor))

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated in FSDP2 for ``set_gradient_divide_factor``; the same here."""
        warnings.warn(
            "set_reduce_scatter_divide_factor is deprecated; use set_gradient_divide_factor",
            FutureWarning,
            stacklevel=2,
        )
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """True: this module's reduce-scatters use SUM and divide afterwards, never
        NCCL's ReduceOp.AVG (NCCL's zero-copy transfers need SUM). gloo always sums."""
        flag = _bool("set_force_sum_reduction_for_comms", enable)
        for s in self._with_groups(recurse=False):
            s.change_settings(force_sum=flag)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """False: the next backward leaves its reductions in flight (more microbatches
        follow before the optimizer); the backward after finishes them."""
        flag = _bool("set_is_last_backward", is_last_backward)

        def apply(root: RootSettings) -> None:
            root.is_last_backward = flag

        self._shardwise_state.set_for_root(apply)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False reduce-scatters but holds the sums back from the replicate
        all-reduce (accumulating microbatches); the next backward with True
        all-reduces them together and only then sets ``.grad``."""
        flag = _bool("set_requires_all_reduce", requires_all_reduce)
        for s in self._with_groups(recurse):
            s.change_settings(requires_all_reduce=flag)

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """True: every trainable parameter gets a gradient on every rank, also where a
        rank did not use it (the mean over all ranks, zeros from those that did not)."""
        flag = _bool("set_reduce_scatter_unused_params", reduce_scatter_unused_params)
        for s in self._with_groups(recurse):
            s.change_settings(reduce_scatter_unused=flag)

    def set_all_reduce_hook(self, hook: Any, *, stream: Any = None) -> None:
        """``hook(reduced)`` runs on this module's reduced gradient shard (after the
        HSDP all-reduce, or after the reduce-scatter), in place, before ``.grad``
        is set. As in FSDP2 it applies to this module only."""
        if not callable(hook):
            raise TypeError(f"set_all_reduce_hook expects a callable, got {hook!r}")
        for s in self._with_groups(recurse=False):
            s.change_settings(all_reduce_hook=hook)

    def set_post_optim_event(self, event: Any) -> None:
        """An event recorded after the optimizer step: the next forward's gathers wait
        on it (once; set a new one each step)."""
        if not hasattr(event, "wait"):
            raise TypeError(f"set_post_optim_event expects a torch.Event, got {event!r}")

        def apply(root: RootSettings) -> None:
            root.post_optim_event = event

        self._shardwise_state.set_for_root(apply)

    def set_custom_all_gather(self, comm: Any) -> None:
        """``comm(output_tensor=, input_tensor=, group=, async_op=)`` gathers this
        module's flat shards instead of ``dist.all_gather_into_tensor``."""
        if not callable(comm):
            raise TypeError(f"set_custom_all_gather expects a callable, got {comm!r}")
        _no_comm_alloc(self._groups(recurse=False), "set_custom_all_gather")
        _one_mesh(self._groups(recurse=False), "set_custom_all_gather")
        for s in self._with_groups(recurse=False):
            s.change_settings(custom_all_gather=comm)

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """``comm(output_tensor=, input_tensor=, group=, op=, async_op=)`` sums this
        module's gradients instead of ``dist.reduce_scatter_tensor``."""
        if not callable(comm):
            raise TypeError(f"set_custom_reduce_scatter expects a callable, got {comm!r}")
        _no_comm_alloc(self._groups(recurse=False), "set_custom_reduce_scatter")
        _one_mesh(self._groups(recurse=False), "set_custom_reduce_scatter")
        for s in self._with_groups(recurse=False):
            s.change_settings(custom_reduce_scatter=comm)

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """How many of this module's reductions may be in flight when the next one
        starts (default 1): more hides a slow reduce-scatter, at their memory."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int >= 1, got {max_input_buffers!r}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be >= 1, got {max_input_buffers}")
        states = self._sharded_states(recurse)
        if max_input_buffers > 1 and any(
            getattr(s.settings.comm_alloc, "symmetric", False)
            for s in states
            if s.group is not None
        ):
            raise ValueError(
                f"set_reduce_scatter_max_input_buffers({max_input_buffers}): this module's "
                "reduction buffers are in symmetric memory (set_symm_mem_for_comm), whose pool "
                "more reductions in flight could exhaust; keep 1"
            )
        for s in states:
            s.change_settings(max_reduces_in_flight=max_input_buffers)

    def set_comm_policy(self, policy: CommPolicy | None, *, recurse: bool = True) -> None:
        """Gather and reduce by ``policy`` from the next gather and reduction on (None:
        plainly), as ``fully_shard(comm_policy=...)``. Every rank calls it: making the
        node groups is a collective over the shard group. Checked for every module
        before any changes; a node-local backward replaces an int
        ``reshard_after_forward`` (as a bool does). The node size, where the policy names
        none, is the launcher's, as for ``fully_shard``."""
        apply_comm_policy(self._with_groups(recurse), policy, "set_comm_policy")

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        """Reduce-scatters on a process group of their own (over the same ranks), so
        they need not queue behind gathers on one communicator."""
        flag = _bool("set_separate_reduce_scatter_group", enable)
        for s in self._with_groups(recurse):
            assert s.group is not None
            group = s.group.shard_group
            s.change_settings(reduce_scatter_group=_separate_group(group) if flag else None)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Gather outputs and reduction buffers from the process group's own allocator
        (NCCL: registered memory, zero-copy over NVLink SHARP). Refused, naming the
        backend, where it has none (gloo), and beside a custom all-gather/reduce-scatter.
        Enabling it is a collective over the shard group (NCCL's communicator is created)."""
        flag = _bool("set_allocate_memory_from_process_group_for_comm", enable)
        groups = self._groups(recurse=False)
        if flag:
            _no_custom_comm(groups, "set_allocate_memory_from_process_group_for_comm")
            allocators = [
                collectives.process_group_allocator(g.shard_group, g.device) for g in groups
            ]
        for i, s in enumerate(self._with_groups(recurse=False)):
            s.change_settings(comm_alloc=allocators[i] if flag else None)

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Gather outputs and reduction buffers in symmetric memory (NCCL only; refused
        elsewhere, naming the backend, and with more than one reduction in flight, as in
        FSDP2). Every rank calls it: it is a collective over the shard group."""
        if self._shardwise_state.settings.max_reduces_in_flight > 1:
            raise ValueError(
                "set_symm_mem_for_comm: set_reduce_scatter_max_input_buffers is "
                f"{self._shardwise_state.settings.max_reduces_in_flight}; symmetric memory allows one "
                "reduction in flight (its pool is not sized for more)"
            )
        actual = _backend(self._shardwise_state)
        if backend != "NCCL" or "nccl" not in actual.lower():
            raise ValueError(
                f"set_symm_mem_for_comm({backend!r}): symmetric memory needs NCCL, but this "
                f"module's process group uses {actual}"
            )
        _no_custom_comm(self._groups(recurse=False), "set_symm_mem_for_comm")
        for s in self._with_groups(recurse=False):
            assert s.group is not None
            g = s.group
            s.change_settings(comm_alloc=collectives.symmetric_allocator(g.shard_group, g.device))

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise RuntimeError(
            f"copy.deepcopy of {type(self).__name__}, a module sharded by fully_shard, is not "
            "supported (its parameters are views of per-rank buffers tied to a process group); "
            "copy the model before fully_shard, or build a new one and load "
            "model.state_dict() into it"
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``, after a backward that raised too.

        Such a backward leaves modules gathered, their gathered copies installed
        as the parameters, so clearing what ``parameters()`` yields would miss
        the sharded parameters' gradients, and those of earlier steps would
        leak into the next one (a skipped batch). Here the modules are first
        resharded: ``reset_iter_state``.
        """
        ctx = self._shardwise_state.context
        if ctx is not None and ctx.abandoned():
            self.reset_iter_state()
        super().zero_grad(set_to_none)  # type: ignore[misc]

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        """``.to()``, ``.cuda()``, ``to_empty()``: on the sharded parameters, as in
        FSDP2 (a module kept gathered is resharded first); the next gather
        notices the replaced shards and re-packs them (flat_shard.py)."""
        self._shardwise_state.reshard_now()
        return super(_TorchFSDPModule, self)._apply(*args, **kwargs)  # type: ignore[misc]

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """FSDP2's private switch for issuing pre-forward gathers with ``async_op``.
        shardwise's gathers are always issued asynchronously (on the process
        group's stream, waited for by the module that needs them), so this only
        checks its input."""
        _bool("_set_unshard_async_op", async_op)

    def _get_fsdp_state(self) -> Any:
        raise RuntimeError(
            f"{type(self).__name__} is sharded by shardwise, not by torch's FSDP2: torch's "
            "FSDP2 internals (_get_fsdp_state) do not apply to it. Code that reached them "
            "called a torch FSDP2 function on a shardwise module: call "
            "shardwise.patch_fsdp2() before importing that code, or call shardwise's "
            "function of the same name"
        )

    def reset_iter_state(self) -> None:
        """Recover after an exception in forward or backward (FSDP2's name).

        Drops a failed backward's reductions in flight (root.py's
        ``abandon_backward`` says why), reshards every module and returns all
        of them to ``IDLE``, so the parameters are the sharded leaves again
        (an optimizer can be built on them) before the next forward.
        """
        ctx = self._shardwise_state.context
        if ctx is not None:
            root.reset(ctx)


def _refuse_the_rest() -> None:
    """Give every method of torch's ``FSDPModule`` that this class lacks (one a
    newer torch added) a body that raises, so that FSDP2's own, which would
    read FSDP2's state, never runs on a shardwise module."""
    ours = set(vars(FSDPModule))
    for name, value in vars(_TorchFSDPModule).items():
        if name in ours or not callable(value) or name.startswith("__"):
            continue

        def refuse(self: Any, *args: Any, _name: str = name, **kwargs: Any) -> Any:
            raise NotImplementedError(
                f"FSDPModule.{_name} (torch's FSDP2) is not supported by shardwise yet; "
                "see the README's table of FSDP2 names"
            )

        refuse.__name__ = name
        setattr(FSDPModule, name, refuse)


_refuse_the_rest()


def _state_of(m: Any, what: str) -> ModuleState:
    if not isinstance(m, FSDPModule):
        raise TypeError(f"{what}: {type(m).__name__} is not sharded; call fully_shard on it first")
    return m._shardwise_state


def _bool(what: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{what} expects a bool, got {value!r}")
    return value


def _no_custom_comm(groups: list[ParamGroup], what: str) -> None:
    if any(g.settings.custom_all_gather or g.settings.custom_reduce_scatter for g in groups):
        raise ValueError(
            f"{what}: this module has a custom all-gather or reduce-scatter, which allocates "
            "its own buffers; use one or the other"
        )


def _one_mesh(groups: list[ParamGroup], what: str) -> None:
    """A custom collective is given one process group: refused where a module's
    parameters are on meshes of their own (placement.py)."""
    if any(not g.one_mesh for g in groups):
        raise ValueError(
            f"{what}: this module's parameters are sharded over several meshes "
            "(shard_placement_fn), and a custom collective serves one process group"
        )


def _no_comm_alloc(groups: list[ParamGroup], what: str) -> None:
    if any(g.settings.comm_alloc is not None for g in groups):
        raise ValueError(
            f"{what}: this module's communication buffers come from the process group or "
            "symmetric memory (set_allocate_memory_from_process_group_for_comm / "
            "set_symm_mem_for_comm); use one or the other"
        )


def _backend(state: ModuleState) -> str:
    group = state.group.shard_group if state.group is not None else None
    return collectives.backend(group)


def _separate_group(group: Any) -> Any:
    """One extra process group per set of ranks (created collectively, once)."""
    return collectives.subgroup(collectives.group_ranks(group))


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` (e.g. ``generate``) gather and reshard like forward.

    The method runs between the root's pre- and post-forward hooks, so every
    sharded submodule it calls is gathered as in forward. Unlike FSDP2, a call
    without grad (generation) leaves every module sharded afterwards, the
    root included.
    """
    if not isinstance(module, FSDPModule):
        raise TypeError(
            f"register_fsdp_forward_method expects a module sharded by fully_shard, got "
            f"{type(module).__name__}"
        )
    method = getattr(module, method_name, None)
    if not callable(method):
        raise ValueError(f"{type(module).__name__} has no method {method_name!r}")
    state = module._shardwise_state

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = state.pre_forward(module, args, kwargs)
        out = method(*args, **kwargs)
        return state.post_forward(module, args, out)

    setattr(module, method_name, wrapped)


def share_comm_ctx(modules: list[nn.Module]) -> None:
    """FSDP2's call to make several roots (pipeline stages) share communication streams.

    shardwise's collectives run on their process group's own streams and its
    offload copies on one stream per device, never on per-root streams: they
    are shared already, so this only checks its input.
    """
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(
                f"share_comm_ctx expects modules sharded by fully_shard, got {type(m).__name__}"
            )


def apply_comm_policy(states: list[ModuleState], policy: CommPolicy | None, what: str) -> None:
    """The one place a communication policy is applied: ``fully_shard(comm_policy=)``
    and ``set_comm_policy``. Checked for every module first; then the node groups
    (a collective over each shard group: a failure comes before any module changed,
    and none is made in the middle of a backward); then each module's settings.
    A node-local backward gathers for backward over the node group; a policy
    without one replaces the node-local backward of the one before."""
    checked: list[tuple[ModuleState, CommPolicy | None]] = []
    for s in states:
        g = s.group
        assert g is not None
        if policy is None:
            checked.append((s, None))
            continue
        derived = comm_policy.launcher_node_size(g.world)
        ok = comm_policy.check(policy, g.world, torch.device(g.device.type), derived)
        if ok.node_local_backward and not g.one_mesh:
            raise ValueError(
                f"{what}: module {g.label!r} has parameters on several meshes "
                "(shard_placement_fn); node_local_backward's post-forward group is one mesh's"
            )
        checked.append((s, ok if ok.enabled else None))
    for s, p in checked:
        assert s.group is not None
        if p is not None and p.node_size is not None and 1 < p.node_size < s.group.world:
            node_collectives.node_groups(s.group.shard_group, p.node_size)
    for s, p in checked:
        assert s.group is not None
        g, was = s.group, s.settings.comm_policy
        changes: dict[str, Any] = {"comm_policy": p}
        node = p.node_size if p is not None else None
        if p is not None and p.node_local_backward and node is not None and node < g.world:
            changes["post_forward_group"] = node_collectives.node_groups(g.shard_group, node).node
        elif was is not None and was.node_local_backward:
            changes["post_forward_group"] = None
        s.change_settings(**changes)


def sharded_states(module: nn.Module | FSDPModule, recurse: bool = True) -> list[ModuleState]:
    """The states of the sharded modules under ``module`` (itself only, unless
    ``recurse``), each once (a group of several modules has one): how the features
    above the runtime (optimizer_in_backward, checkpoint) reach modules and groups,
    rather than through ``FSDPModule``'s private methods."""
    if not recurse:
        state = getattr(module, "_shardwise_state", None)
        return [state] if state is not None else []
    modules = cast(nn.Module, module).modules()  # an FSDPModule is a module's class too
    found = [m._shardwise_state for m in modules if isinstance(m, FSDPModule)]
    return list({id(s): s for s in found}.values())


def param_groups(module: nn.Module | FSDPModule, recurse: bool = True) -> list[ParamGroup]:
    """The parameter groups of ``sharded_states(module, recurse)``."""
    return [s.group for s in sharded_states(module, recurse) if s.group is not None]
