"""``fully_shard``: the one public call. Validates, decides ownership, installs hooks.

Every check runs before anything is changed, so bad input leaves the module
exactly as it was.
"""

from __future__ import annotations

import contextlib
import os
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from . import pipeline
from .comm import collectives, comm_policy
from .comm.comm_policy import CommPolicy
from .layout import placement
from .layout.extensions import Extension, has_hooks
from .layout.offload import OffloadPolicy, check_offload_policy
from .layout.precision import MixedPrecisionPolicy
from .layout.sharded_param import rows_per_rank
from .layout.tensor_parallel import TPLayout, compose_spmd, compose_tp, spmd_mesh
from .runtime.fsdp_module import FSDPModule, apply_comm_policy
from .runtime.module import ModuleState, outside_compile
from .runtime.param_group import ParamGroup
from .runtime.settings import GroupSettings

# Original parameter objects already taken by some fully_shard call: a second
# owner would silently untie them.
# Keyed by id with a weak reference to tell a live object from a reused id
# (tensors cannot go in a WeakSet: membership would compare them with ==).
_taken: dict[int, weakref.ref[nn.Parameter]] = {}
# Live groups: their sharded DTensors are taken too. Those are looked up through
# the groups, not weakly referenced: module.to_empty() swaps a DTensor parameter
# in place (torch.utils.swap_tensors), which refuses weakly referenced tensors.
_groups: weakref.WeakSet[ParamGroup] = weakref.WeakSet()


def live_groups() -> list[ParamGroup]:
    """Every parameter group alive in this process (a module ``fully_shard`` sharded that
    still exists): how a feature finds the groups of parameters it was handed."""
    return list(_groups)


def _is_taken(p: nn.Parameter) -> bool:
    ref = _taken.get(id(p))
    return ref is not None and ref() is p


_subclass_cache: dict[type, type] = {}
_default_meshes: dict[tuple[str, int], DeviceMesh] = {}


def default_mesh() -> DeviceMesh:
    """A 1-D mesh over the default process group on this machine's device type."""
    if not collectives.initialized():
        raise RuntimeError(
            "fully_shard needs torch.distributed to be initialized: call "
            "torch.distributed.init_process_group() first (or launch with torchrun), "
            "or pass mesh=..."
        )
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    key = (device_type, collectives.world_size())
    if key not in _default_meshes:
        _default_meshes[key] = collectives.device_mesh(device_type, (key[1],))
    return _default_meshes[key]


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    mp_policy: Any = None,
    offload_policy: OffloadPolicy | None = None,
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: Any = None,
    prefetch: int = 1,
    check: bool | None = None,
    comm_policy: CommPolicy | None = None,
) -> Any:
    """Shard ``module``'s parameters over ``mesh``, gathering them only while it runs.

    Apply bottom-up: the layers first, then the root. The call owns the
    module's parameters that no sharded descendant owns already; each becomes
    an ``nn.Parameter`` holding a ``DTensor`` with ``Shard(0)`` (or
    ``(Replicate(), Shard(0))`` on a 2-D mesh: HSDP). The module's class
    becomes a subclass of ``FSDPModule``; the same object is returned.

    ``module`` may be a list of modules: their parameters form one group (one
    all-gather, one reduce-scatter), gathered before the first of them runs
    and resharded after the last; each module becomes an ``FSDPModule``.

    Tensor parallel x FSDP: parameters already made DTensors by torch's
    ``parallelize_module`` on ``mesh2d["tp"]`` are sharded over
    ``mesh=mesh2d["dp"]`` (their TP-local pieces, over dp only) and become
    DTensors on the 2-D mesh; in forward the TP modules see their usual
    tp-mesh DTensors. docs/design.md says how the placements compose.

    ``dp_mesh_dims`` (torch's ``DataParallelMeshDims``): ``mesh`` is the full
    SPMD mesh and every parameter a DTensor on it, ``Replicate()`` on the
    named data-parallel dims; shardwise shards over the ``shard`` dims
    (several are flattened) and, given ``replicate``, all-reduces over those
    (HSDP). As in FSDP2, the gradient each rank holds on the dp dims (a
    ``Partial`` contribution, or a replicated value) is averaged over them.

    ``reshard_after_forward``: as FSDP2's, ``None`` (the default) reshards
    after forward every module but the root, whose backward runs first;
    ``True`` reshards the root too; ``False`` keeps a module gathered until its
    backward; an int ``n`` (a divisor of the shard group's size, e.g. the GPUs
    of one node) keeps 1/n of the parameters after forward, so that backward
    gathers over n ranks only. Forwards without a backward following
    (no_grad, eval) leave every module sharded, the root included.

    ``shard_placement_fn(param)`` may return ``Shard(dim)`` to split that
    parameter along ``dim`` (evenly) instead of dim 0, None for dim 0, or a
    ``ShardPlacementResult(placement, mesh)`` (shardwise's, or torch's with a
    ``mesh_info``) to shard it over a mesh of its own: each mesh's parameters
    are gathered and reduced over their own process groups, in one module's
    lifecycle (expert parallelism: placement.py).
    ``offload_policy=CPUOffloadPolicy()`` keeps the sharded parameters, their
    gradients and the optimizer state in CPU memory (offload.py).

    ``comm_policy`` (``CommPolicy``, comm_policy.py) says how the collectives treat
    the node boundary: weights gathered as int8 blocks, backward's gathers kept
    inside the node, gradients reduced inside the node and then across nodes as
    int8 blocks. Off by default; docs/design.md has the numbers.

    ``prefetch`` is how many modules ahead (in forward, then backward order)
    are gathered while this one computes. ``check=True`` (or ``SHARDWISE_CHECK=1``
    when this is called) verifies the lifecycle at every forward entry and
    backward end and raises ``LifecycleError`` on a violation (check.py).
    """
    modules = _as_modules(module)
    if not (reshard_after_forward is None or isinstance(reshard_after_forward, (bool, int))):
        raise TypeError(
            "reshard_after_forward must be True, False, None or an int (the group size to "
            f"reshard to), got {reshard_after_forward!r}"
        )
    mesh = mesh if mesh is not None else default_mesh()
    spmd = None
    if dp_mesh_dims is not None:
        # Checked before anything changes, except that flattening names creates groups.
        spmd = spmd_mesh(mesh, dp_mesh_dims)
        mesh = spmd.dp_mesh
    if not isinstance(mesh, DeviceMesh) or mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard supports a 1-D mesh (FSDP) or a 2-D (replicate, shard) mesh (HSDP); "
            f"got a {getattr(mesh, 'ndim', '?')}-D mesh. For tensor parallelism pass the "
            "data-parallel sub-mesh, e.g. mesh['dp']"
        )
    if not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an int >= 0 (modules gathered ahead), got {prefetch!r}")
    raf, raf_size = _resolve_reshard(reshard_after_forward, mesh)
    policy_set, post_forward_size = _comm_policy(comm_policy, mesh, raf_size)
    policy = _as_policy(mp_policy)
    offload = check_offload_policy(offload_policy, mesh)
    ignored = {id(p) for p in ignored_params or ()}
    named = _owned_params(modules, ignored)
    _check_params(modules[0], named, mesh.device_type)
    label = type(modules[0]).__name__
    meshes: list[DeviceMesh] | None = None
    if spmd is None:
        # A DTensor parameter (tensor parallel; expert parallel's experts) composes
        # with the mesh it is sharded over: its own, if the placement function names one.
        is_dt = [isinstance(p, DTensor) for _, p, _ in named]
        dims, meshes = placement.resolve(named, mesh, shard_placement_fn, label, is_dt)
        tp = _tp_layouts(named, meshes or [mesh] * len(named))
    else:
        dims, meshes = placement.resolve(named, mesh, shard_placement_fn, label)
        tp = [
            compose_spmd(fqn, p, spmd, dims[i] if dims else 0)
            for i, (fqn, p, _) in enumerate(named)
        ]
    _check_self_gathering(named, dims or [0] * len(named), offload, post_forward_size, mesh)
    if meshes is not None:
        _check_mesh_parts(label, spmd is not None, post_forward_size, named)

    if check is None:
        check = os.environ.get("SHARDWISE_CHECK", "0") not in ("", "0")
    # Made before anything changes: new_group can fail (a timeout, a backend). A
    # node-local backward's group is the policy's (apply_comm_policy).
    smaller = post_forward_group(mesh, raf_size) if named and raf_size else None
    settings = GroupSettings(
        mp_policy=policy or MixedPrecisionPolicy(),
        offload_policy=offload,
        prefetch=prefetch,
        reshard_after_forward_setting=raf,
        reshard_after_forward=raf is not False,
        post_forward_group=smaller,
    )
    state = ModuleState(modules, settings, label, bool(check))
    if named:
        state.group = ParamGroup(named, mesh, settings, label, tp, dims, meshes)
        if policy_set is not None:
            apply_comm_policy([state], policy_set, f"fully_shard({label})")
        _groups.add(state.group)
    for _, p, _ in named:
        _taken[id(p)] = weakref.ref(p)
    for m in modules:
        m._shardwise_state = state  # type: ignore[assignment]
        pipeline.register(m)  # torch's fully_shard.state(m) finds it (pipeline.py)
        m.register_forward_pre_hook(
            outside_compile(state.pre_forward), prepend=True, with_kwargs=True
        )
        m.register_forward_hook(outside_compile(state.post_forward))
        # State dicts always see the sharded DTensors, also while a module is kept
        # gathered (reshard_after_forward/backward=False): reshard first.
        m.register_state_dict_pre_hook(lambda m, prefix, keep_vars: state.reshard_now())
        m._register_load_state_dict_pre_hook(_before_load, with_module=True)
        cls = type(m)
        if cls not in _subclass_cache:
            _subclass_cache[cls] = type(
                f"FSDP{cls.__name__}", (FSDPModule, cls), {"_shardwise_orig_cls": cls}
            )
        m.__class__ = _subclass_cache[cls]
    return module


def _comm_policy(
    policy: CommPolicy | None, mesh: DeviceMesh, post_forward_size: int
) -> tuple[CommPolicy | None, int]:
    """The communication policy checked (None where it changes nothing), and the
    post-forward group size its node-local backward asks for. The node size, when
    the policy names none, is the launcher's ``LOCAL_WORLD_SIZE`` if it divides the
    shard group (torchrun sets it: the processes of one machine)."""
    if policy is None:
        return None, post_forward_size
    world = mesh.size(mesh.ndim - 1)
    derived = comm_policy.launcher_node_size(world)
    policy = comm_policy.check(policy, world, torch.device(mesh.device_type), derived)
    if not policy.enabled:
        return None, post_forward_size
    node = policy.node_size
    if policy.node_local_backward and node is not None and node < world:
        if post_forward_size not in (0, node):
            raise ValueError(
                f"reshard_after_forward={post_forward_size} and CommPolicy(node_local_backward="
                f"True, node_size={node}) ask for different post-forward groups; give one"
            )
        post_forward_size = node
    return policy, post_forward_size


def _check_mesh_parts(label: str, spmd: bool, post_forward_size: int, named: list[Any]) -> None:
    """Refuse, before anything changes, what parameters on meshes of their own
    (``shard_placement_fn`` returning a mesh) are not combined with."""
    why = (
        "dp_mesh_dims (every parameter a DTensor on one SPMD mesh)"
        if spmd
        else "reshard_after_forward=<int> or CommPolicy(node_local_backward=True) (a "
        "post-forward group is one mesh's)"
        if post_forward_size
        else "parameters that gather themselves (float8)"
        if any(has_hooks(p._local_tensor if isinstance(p, DTensor) else p) for _, p, _ in named)
        else None
    )
    if why is not None:
        raise ValueError(
            f"fully_shard({label}): shard_placement_fn puts parameters on meshes of their own, "
            f"which shardwise does not combine with {why}"
        )


def _check_self_gathering(
    named: list[Any], dims: list[int], offload: Any, post_forward_size: int, mesh: Any
) -> None:
    """Refuse, before anything changes, what parameters that gather themselves
    (extensions.py) cannot be combined with yet."""
    world = mesh.size(mesh.ndim - 1)
    hooked = []
    for fqn, p, _ in named:
        local = p._local_tensor if isinstance(p, DTensor) else p
        if has_hooks(local):
            hooked.append((fqn, p))
    for fqn, p in hooked:
        rows = p.shape[0]
        chunk = rows_per_rank(rows, world)
        split = next((d for d in dims if d != 0), 0)  # any parameter of the group
        why = (
            "tensor parallelism"
            if isinstance(p, DTensor)
            else "CPU offload"
            if offload is not None
            else "reshard_after_forward=<int>"
            if post_forward_size
            else f"Shard({split}) from shard_placement_fn in the same fully_shard call"
            if split
            else "an HSDP mesh without mesh_dim_names"
            if mesh.ndim == 2 and not mesh.mesh_dim_names
            else f"{rows} rows over {world} ranks, which leaves the last rank(s) no rows"
            if (world - 1) * chunk >= rows and world > 1
            else None
        )
        if why is None:
            Extension(fqn, p)  # checks that it can be rebuilt around a shard
        else:
            raise ValueError(
                f"parameter {fqn!r} is a {type(p).__name__} that gathers itself "
                f"(fsdp_pre_all_gather); shardwise does not combine that with {why} yet"
            )


def _as_modules(module: Any) -> list[nn.Module]:
    """``module`` as a list of distinct, unsharded modules with a forward (or TypeError/ValueError)."""
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise ValueError("fully_shard got an empty list of modules; pass at least one")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard expects an nn.Module, got {type(m).__name__}")
        if isinstance(m, FSDPModule):
            raise ValueError(
                f"{type(m).__name__} is already sharded by fully_shard; call it once per module"
            )
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            # (Another module without forward may still be called through a
            # method given to register_fsdp_forward_method, as under FSDP2.)
            raise ValueError(
                f"fully_shard needs a module with a forward, got a {type(m).__name__} "
                "(a container: its hooks would never run); shard the modules inside it, e.g. "
                "for layer in model.layers: fully_shard(layer), then the module that calls them"
            )
    if len({id(m) for m in modules}) < len(modules):
        raise ValueError("fully_shard got the same module twice in its list; list each once")
    for m in modules:
        inner = [type(o).__name__ for o in modules if o is not m and _contains(m, o)]
        if inner:
            raise ValueError(
                f"fully_shard's list holds {type(m).__name__} and {inner[0]} inside it; list "
                "modules that run one after another (shard the inner one on its own first)"
            )
    return modules


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def _resolve_reshard(raf: bool | int | None, mesh: DeviceMesh) -> tuple[bool | None, int]:
    """``reshard_after_forward`` as (the bool or None the hooks use, the post-forward
    group size, 0 for none). An int n is checked against the shard group size."""
    if raf is None or isinstance(raf, bool):
        return raf, 0
    world = mesh.size(mesh.ndim - 1)
    if raf < 1 or world % raf:
        raise ValueError(
            f"reshard_after_forward={raf} must divide the shard group size {world} (the "
            "number of ranks each parameter is split over), e.g. the GPUs of one node"
        )
    if raf == 1:
        warnings.warn(
            "reshard_after_forward=1 (int) keeps whole parameters after forward: the same as "
            "reshard_after_forward=False",
            stacklevel=3,
        )
        return False, 0
    if raf == world:
        return True, 0
    return True, raf


def post_forward_group(mesh: DeviceMesh, n: int) -> Any:
    """This rank's group of n consecutive ranks of its shard group, shared between modules.

    Only its members create it (``use_local_synchronization``): on a sliced
    mesh (``mesh["dp"]`` of a (dp, tp) mesh) a rank cannot see the other
    slices' shard groups, so a world-wide creation of every group would not
    run in the same order everywhere.
    """
    row = collectives.group_ranks(mesh.get_group(mesh.ndim - 1))  # this shard group
    start = mesh.get_local_rank(mesh.ndim - 1) // n * n
    ranks = tuple(row[start : start + n])
    return collectives.subgroup(list(ranks))


def _as_policy(mp_policy: Any) -> MixedPrecisionPolicy | None:
    """Accept ours, torch's FSDP2 policy (same fields), or None."""
    if mp_policy is None or isinstance(mp_policy, MixedPrecisionPolicy):
        return mp_policy
    fields = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
    if all(hasattr(mp_policy, f) for f in fields):
        return MixedPrecisionPolicy(**{f: getattr(mp_policy, f) for f in fields})
    raise TypeError(
        f"mp_policy must be a shardwise.MixedPrecisionPolicy, got {type(mp_policy).__name__}"
    )


def _owned_params(
    modules: list[nn.Module], ignored: set[int]
) -> list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]]:
    """Parameters of ``modules`` outside sharded descendants, with every place each is registered.

    A loop over an explicit stack, not a recursive inner function: such a
    function refers to itself through its closure, a reference cycle that
    would keep ``found`` (every original parameter, on the GPU the whole
    unsharded module) alive after ``fully_shard`` until the garbage collector
    happens to run, so the device memory of later steps would depend on when
    that is (tests/library/runtime/test_no_cycles.py).
    """
    found: dict[int, tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]] = {}
    sharded: set[int] | None = None  # ids of live sharded DTensors, once a DTensor shows up
    # Pre-order (a module's own parameters, then each child's in turn): the
    # flat layout's order.
    stack = [
        (m, f"{i}." if len(modules) > 1 else "") for i, m in reversed(list(enumerate(modules)))
    ]
    while stack:
        m, prefix = stack.pop()
        for name, p in m._parameters.items():
            if p is None or id(p) in ignored:
                continue
            fqn = prefix + name
            taken = _is_taken(p)
            if isinstance(p, DTensor):  # tensor parallel, or already sharded by us
                if sharded is None:
                    sharded = {id(sp.sharded) for g in list(_groups) for sp in g.params}
                taken = taken or id(p) in sharded
            if taken:
                raise ValueError(
                    f"parameter {fqn!r} of {type(modules[0]).__name__} is already owned by another "
                    "fully_shard call (a weight tied across separately sharded modules?). Shard "
                    "the common parent of every module that uses it instead, or pass it in "
                    "ignored_params"
                )
            if id(p) in found:
                found[id(p)][2].append((m, name))
            else:
                found[id(p)] = (fqn, p, [(m, name)])
        children = [
            (child, f"{prefix}{cname}.")
            for cname, child in m._modules.items()
            if child is not None and not isinstance(child, FSDPModule)
        ]
        stack.extend(reversed(children))
    return list(found.values())


def _tp_layouts(named: list[Any], meshes: list[DeviceMesh]) -> list[TPLayout | None] | None:
    """Tensor parallel (DTensor) parameters: how each composes with the mesh it is
    sharded over, ``meshes[i]`` (validated)."""
    if not any(isinstance(p, DTensor) for _, p, _ in named):
        return None
    return [
        compose_tp(fqn, p, m) if isinstance(p, DTensor) else None
        for (fqn, p, _), m in zip(named, meshes)
    ]


def _check_params(module: nn.Module, named: list[Any], mesh_device: str) -> None:
    dtypes = {p.dtype for _, p, _ in named}
    for fqn, p, _ in named:
        if not p.is_floating_point():
            raise ValueError(
                f"parameter {fqn!r} has dtype {p.dtype}; fully_shard shards floating-point "
                "parameters only (pass it in ignored_params to keep it replicated)"
            )
        if p.dim() == 0:
            raise ValueError(
                f"parameter {fqn!r} is a 0-dim scalar, which cannot be split along dim 0; "
                "reshape it to shape [1] or pass it in ignored_params"
            )
        check_device(fqn, p.device, mesh_device)
    if len(dtypes) > 1:
        raise ValueError(
            f"{type(module).__name__} owns parameters of several dtypes {sorted(map(str, dtypes))}; "
            "one fully_shard call gathers one flat buffer, so cast them to one dtype or shard "
            "the submodules holding each dtype separately"
        )


def check_device(fqn: str, device: torch.device, mesh_device: str) -> None:
    """Parameters may live on the mesh's device, on meta, or on CPU (moved to the mesh)."""
    if device.type in ("meta", mesh_device, "cpu"):
        return
    raise ValueError(
        f"parameter {fqn!r} is on {device} but the mesh is on {mesh_device!r}; build the mesh "
        f"on {device.type!r} (init_device_mesh({device.type!r}, ...)) or move the module to "
        f"{mesh_device!r} or 'cpu' first"
    )


def _before_load(
    module: nn.Module, state_dict: Any, prefix: str, local_metadata: dict, *args: Any
) -> None:
    state: ModuleState = module._shardwise_state  # type: ignore[assignment]
    state.reshard_now()  # load into the shards, not into gathered copies
    if state.group is None or not local_metadata.get("assign_to_params_buffers", False):
        return
    # assign=True would install the loaded tensors as parameters; the group
    # makes its own sharded parameters from them instead (load_assigned).
    paths = {id(m): p for p, m in module.named_modules(remove_duplicate=False)}
    # (A group of several modules: each one's state dict holds its own parameters.)
    keys = [
        [
            prefix + (f"{paths[id(m)]}." if paths[id(m)] else "") + name
            for m, name in sp.locations
            if id(m) in paths
        ]
        for sp in state.group.params
    ]
    state.group.load_assigned(state_dict, keys)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Backward inside accumulates gradients locally, with no communication.

    The first backward after the block (sync on again) reduces the sum once.
    """
    if not isinstance(model, FSDPModule):
        raise TypeError(
            f"no_sync expects a module sharded by fully_shard, got {type(model).__name__}"
        )
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def hsdp_mesh(replicate: int, device_type: str | None = None) -> DeviceMesh:
    """A ``(replicate, shard)`` mesh over the world for HSDP: ``replicate`` copies of the shards."""
    world = collectives.world_size() if collectives.initialized() else 0
    if not isinstance(replicate, int) or replicate < 1 or world % replicate:
        raise ValueError(
            f"HSDP replicate degree {replicate!r} must be a positive divisor of the world size "
            f"({world}); e.g. 2 on 4 ranks shards each replica over 2 ranks"
        )
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    return collectives.device_mesh(
        device_type, (replicate, world // replicate), ("replicate", "shard")
    )


# torch's pipelining runtime calls fully_shard.state(stage_module) (pipeline.py);
# patch_fsdp2's stand-in copies this attribute with the function's others.
fully_shard.state = pipeline.state  # type: ignore[attr-defined]
