"""One parameter of a group: where it is registered, how it is split, its two forms.

A parameter is split along one dimension (``Shard(dim)``, dim 0 unless
``fully_shard``'s ``shard_placement_fn`` says otherwise). Each rank's piece
is stored contiguously in its group's flat shard, in a slot of ``slot``
elements; all of a group's slots laid end to end are what one all-gather and
one reduce-scatter move.

Why dim 0 is special: the rows of a row-major tensor are contiguous, so the
piece of rank r is a plain slice, pieces may be uneven (``torch.chunk``:
ceil(rows / world) rows per rank, the last ones shorter or empty, padding
zero) and the gathered pieces laid rank after rank *are* the parameter. Any
other dim interleaves the ranks' pieces in the parameter (an expert weight
split along its columns), so the split must be even and the copy-out after a
gather, and the copy-in before a reduce-scatter, go through a strided view
``(before, world, piece, after)`` that puts each rank's piece in its place.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .extensions import Extension
from .tensor_parallel import TPLayout


def rows_per_rank(rows: int, world: int) -> int:
    """Dim 0's split, as ``torch.chunk``'s: ceil(rows / world) rows for each rank,
    the last ones shorter or empty. The one place the layout's rule is written."""
    return -(-rows // world)


@dataclass
class ShardedParam:
    """One parameter: where it is registered, how it is split, its two forms."""

    fqn: str
    locations: list[tuple[nn.Module, str]]
    shape: torch.Size  # of what is sharded: the parameter, or its TP-local piece
    requires_grad: bool  # at fully_shard; afterwards the sharded parameter's flag rules
    world: int
    rank: int
    offset: int  # start of this parameter's slot in the per-rank flat shard
    dim: int = 0  # the dimension split over the ranks
    tp: TPLayout | None = None
    index: int = 0  # position in its layout (its mesh's part of the group)
    pos: int = 0  # position in its group (= index, unless the group spans meshes)
    ext: Extension | None = None  # a tensor subclass that gathers itself (extensions.py)
    sharded: nn.Parameter = field(init=False)
    unsharded: torch.Tensor = field(init=False)
    plain: torch.Tensor = field(init=False)  # installed while gathered: unsharded, or its DTensor

    def __post_init__(self) -> None:
        size = self.shape[self.dim]
        # Dim 0 may split unevenly (torch.chunk); other dims split evenly (checked by api.py).
        self.chunk = rows_per_rank(size, self.world) if self.dim == 0 else size // self.world
        self.local_size = max(0, min(self.chunk, size - self.rank * self.chunk))
        self.before = math.prod(self.shape[: self.dim])  # elements before the split dim
        self.after = math.prod(self.shape[self.dim + 1 :])  # and after it
        # Computed once (the shape, world and rank never change): the reduction and
        # the layout read them per parameter per step.
        # Elements every rank reserves for this parameter (its piece, padded).
        self.slot = self.before * self.chunk * self.after
        self.local_numel = self.before * self.local_size * self.after
        shape = list(self.shape)
        shape[self.dim] = self.local_size
        self.local_shape = tuple(shape)

    def my_piece(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the whole (TP-local) parameter ``full``."""
        start = min(self.rank * self.chunk, self.shape[self.dim])  # empty pieces at the end
        return full.narrow(self.dim, start, self.local_size)

    def rank_major(self, gathered: torch.Tensor) -> torch.Tensor:
        """``gathered`` (``[world, slot]``, each rank's piece) seen in the parameter's
        layout: the view to copy into the unsharded parameter (dim != 0 only)."""
        pieces = gathered.view(self.world, self.before, self.chunk, self.after)
        return pieces.transpose(0, 1)

    def for_reduce(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` laid out so that splitting dim 0 into ``world`` chunks gives each
        rank its piece: itself for dim 0, else its pieces moved to the front."""
        if self.dim == 0:
            return grad
        pieces = grad.reshape(self.before, self.world, self.chunk, self.after)
        return pieces.transpose(0, 1).contiguous()

    def install(self, t: torch.Tensor) -> None:
        install_each((self,), (t,))


def install_each(params: Iterable[ShardedParam], tensors: Iterable[torch.Tensor]) -> None:
    """Install ``tensors[i]`` as ``params[i]`` wherever it is registered: one call for a
    group's parameters (the hooks install a group's several times a step)."""
    for sp, t in zip(params, tensors):
        # Direct dict writes: nn.Module.__setattr__ refuses non-Parameters, and
        # the unsharded forms are autograd outputs, not leaves.
        for module, name in sp.locations:
            module._parameters[name] = t  # type: ignore[assignment]
            if name in module._buffers:
                # A parametrization registered and removed inside forward (PEFT's
                # LoRA on fused MoE experts): torch puts back an original that is
                # not an nn.Parameter -- our unsharded form -- as a buffer. The
                # parameter is ours again; the stray buffer would shadow it in
                # state_dict and make the next registration fail.
                del module._buffers[name]
