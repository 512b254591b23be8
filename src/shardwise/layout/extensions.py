"""Parameters that decide how they are gathered: FSDP2's tensor-subclass hooks.

A parameter whose data is a tensor subclass defining ``fsdp_pre_all_gather``
and ``fsdp_post_all_gather`` (torchao's float8 training weights) chooses what
goes over the wire and what the module computes with: before the gather,
``pre`` turns this rank's piece into one or more tensors to send plus some
metadata (float8: the piece cast to fp8, and its scale); after it, ``post``
builds the unsharded parameter from the gathered tensors (float8: an fp8
tensor that the float8 matmul consumes directly). The same contract as
FSDP2's, so the same subclasses work under both.

This file is one parameter's side of that contract (``Extension``, held by its
``ShardedParam``); the group's byte-packed all-gather of such parameters is
``PackedGather`` in gather.py, and what they cannot be combined with yet is
refused by ``fully_shard`` (api.py). ``pre`` and ``post`` are told what they
need (the mesh, the parameter's shape, its module, the dtypes): nothing here
knows a group.

Why the subclass keeps our storage: the sharded local tensor is the subclass
rebuilt (``__tensor_flatten__``/``__tensor_unflatten__``) around the view of
the group's flat shard, so the optimizer's in-place updates land in the flat
shard as for any parameter. Subclasses with more than one inner tensor are
refused rather than guessed at.

Why persistent outputs: autograd saves the unsharded parameters (the fp8
weight) for backward, so as for plain parameters the gathered tensors keep
their identity across gathers and only their storage is freed and refilled;
``post`` is told to refill in place with ``out=`` after the first time.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .tensor_parallel import contiguous_stride


def has_hooks(t: torch.Tensor) -> bool:
    """Whether ``t`` gathers itself; ValueError if it defines only one of the two hooks."""
    pre, post = hasattr(t, "fsdp_pre_all_gather"), hasattr(t, "fsdp_post_all_gather")
    if pre != post:
        raise ValueError(
            f"{type(t).__name__} defines only {'fsdp_pre_all_gather' if pre else 'fsdp_post_all_gather'}:"
            " a tensor subclass gathered by shardwise (as by FSDP2) needs both"
        )
    return pre


class Extension:
    """One parameter's subclass: how to rebuild it around a shard, and its gathers."""

    def __init__(self, fqn: str, data: torch.Tensor) -> None:
        names, ctx = data.__tensor_flatten__()  # type: ignore[attr-defined]
        if len(names) != 1:
            raise ValueError(
                f"parameter {fqn!r} is a {type(data).__name__} with inner tensors {names}; "
                "shardwise shards tensor subclasses that wrap exactly one tensor"
            )
        self.cls, self.inner, self.ctx = type(data), names[0], ctx
        self.metadata: Any = None
        self.outputs: list[torch.Tensor] = []  # gathered inputs, one per pre() output
        self.storages: list[tuple[torch.UntypedStorage, int]] = []  # freed at reshard
        self.made = False  # post() built the unsharded form; later gathers refill it
        self._old_signature: bool | None = None

    def wrap(self, view: torch.Tensor) -> torch.Tensor:
        """The subclass around ``view`` (this rank's piece in the flat shard)."""
        return self.cls.__tensor_unflatten__(  # type: ignore[attr-defined]
            {self.inner: view}, self.ctx, view.shape, view.stride()
        )

    def reset(self) -> None:
        """Forget gathered tensors (the flat shard was rebuilt)."""
        self.outputs, self.storages, self.made = [], [], False

    def pre(
        self,
        local: torch.Tensor,
        mesh: DeviceMesh,
        shape: torch.Size,
        module: nn.Module,
        mp_policy: Any,
    ) -> list[torch.Tensor]:
        """The tensors to send for this rank's piece ``local`` of a parameter of
        ``shape``, split over ``mesh`` (HSDP: its shard dimension), registered in
        ``module``, computing under ``mp_policy``."""
        if self._old_signature is None:
            params = inspect.signature(local.fsdp_pre_all_gather).parameters  # type: ignore[attr-defined]
            if len(params) not in (1, 5):
                raise TypeError(
                    f"{self.cls.__name__}.fsdp_pre_all_gather takes {len(params)} arguments; "
                    "expected (mesh) or (mesh, outer_size, outer_stride, module, mp_policy)"
                )
            self._old_signature = len(params) == 1
        if mesh.ndim == 2:
            mesh = mesh[mesh.mesh_dim_names[-1]]  # type: ignore[index]
        if self._old_signature:
            inputs, self.metadata = local.fsdp_pre_all_gather(mesh)  # type: ignore[attr-defined]
        else:
            inputs, self.metadata = local.fsdp_pre_all_gather(  # type: ignore[attr-defined]
                mesh, shape, contiguous_stride(shape), module, mp_policy
            )
        return list(inputs)

    def post(
        self,
        local: torch.Tensor,
        dtype: torch.dtype,
        unsharded: torch.Tensor | None,
        shape: torch.Size,
    ) -> torch.Tensor:
        """The unsharded parameter (of ``shape``, computing in ``dtype``) from the
        gathered ``outputs``: made the first time, refilled into ``unsharded`` (what
        the first time made) after."""
        outs = tuple(self.outputs)
        if self.made:
            # The installed tensor, as FSDP2 passes it: with uneven pieces it is a
            # view of what post() first made, and metadata (a float8 scale) set on
            # that would not reach it.
            assert unsharded is not None
            local.fsdp_post_all_gather(outs, self.metadata, dtype, out=unsharded)  # type: ignore[attr-defined]
            return unsharded
        made, inners = local.fsdp_post_all_gather(outs, self.metadata, dtype)  # type: ignore[attr-defined]
        self.made = True
        if tuple(made.shape) != tuple(shape):  # padding rows of an uneven split
            made = torch.as_strided(made, shape, contiguous_stride(shape), 0)
        seen: set[int] = set()
        for t in [*self.outputs, *inners]:
            s = t.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                self.storages.append((s, s.nbytes()))
        return made

    def free(self) -> None:
        for s, _ in self.storages:
            s.resize_(0)

    def refill(self) -> None:
        for s, n in self.storages:
            if s.nbytes() != n:
                s.resize_(n)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes() for s, _ in self.storages)
