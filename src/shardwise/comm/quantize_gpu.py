"""quantize.py's int8 pack and unpack as one fused Triton kernel each, on CUDA.

Why: eager, a pack is about ten kernels over the shard (abs, amax, a divide, a
round, a clamp, a cast, the copies) and an unpack writes an fp32 copy of every
gathered element, reads it back to cast it and copies it out: for a 0.94B GPT
block's gather at 8 ranks on one H100, 0.11-0.19 ms and 0.44-0.51 ms, 10-13%
of the block's forward + backward (docs/communication.md). One kernel each
reads its input once and writes its output once. ``torch.compile`` fuses the
unpack as well for one shape, but compiled for every module's shard size
(dynamic shapes) it ran slower than eager.

The same numbers as the eager path: the scale is ``absmax / 127`` in fp32, the
value ``x / scale`` (an IEEE division) rounded half to even, clamped to
``[-127, 127]``; a block of zeros has scale 0 and unpacks to zeros
(benchmarks/quantize_cost.py and tests/library/comm/test_comm_policy.py compare the
bytes with torch's on a GPU). A block with a
NaN or an infinity gets a NaN scale and unpacks to NaN (eager: a NaN or
infinite scale, non-finite values): a gradient overflow stays visible.

Used where it can be (``usable``): int8, a CUDA tensor, a power-of-two block
of at most 4096 elements, Triton importable. Everything else, the CPU
included, runs quantize.py's torch ops; Triton is imported on first use only.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


@functools.cache
def _kernels() -> Any:
    """The two kernels (Triton imported and compiled here, once)."""
    import triton
    import triton.language as tl

    @triton.jit
    def pack_kernel(
        x_ptr, x_row, scale_ptr, scale_row, q_ptr, q_row, n, nb,
        BLOCK: tl.constexpr, GROUP: tl.constexpr,
    ):  # fmt: skip
        # GROUP blocks per program: one block of 256 is too little work for one.
        row = tl.program_id(0)
        b = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
        offs = b[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        x = tl.load(x_ptr + row * x_row + offs, mask=offs < n, other=0.0).to(tl.float32)
        bad = tl.sum((x != x).to(tl.int32) + (tl.abs(x) == float("inf")).to(tl.int32), 1)
        # As torch on CUDA: a tensor over a scalar is a product with its reciprocal,
        # a tensor over a tensor an IEEE division.
        scale = tl.max(tl.abs(x), 1) * (1.0 / 127.0)
        scale = tl.where(bad > 0, float("nan"), scale)
        y = tl.math.div_rn(x, tl.maximum(scale, 1.1754943508222875e-38)[:, None])
        q = tl.minimum(tl.maximum(tl.extra.cuda.libdevice.rint(y), -127.0), 127.0)
        tl.store(scale_ptr + row * scale_row + b, scale, mask=b < nb)
        # The padding of the last block as zeros.
        tl.store(q_ptr + row * q_row + offs, q.to(tl.int8), mask=b[:, None] < nb)

    @triton.jit
    def unpack_kernel(
        q_ptr, q_row, scale_ptr, scale_row, out_ptr, out_row, n, nb,
        BLOCK: tl.constexpr, GROUP: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        b = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
        offs = b[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        mask = offs < n
        q = tl.load(q_ptr + row * q_row + offs, mask=mask, other=0).to(tl.float32)
        scale = tl.load(scale_ptr + row * scale_row + b, mask=b < nb, other=0.0)
        out = q * scale[:, None]
        tl.store(out_ptr + row * out_row + offs, out.to(out_ptr.dtype.element_ty), mask=mask)

    return pack_kernel, unpack_kernel


@functools.cache
def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def usable(t: torch.Tensor, block: int, qdtype: torch.dtype) -> bool:
    """Whether the fused kernels serve this call (the module docstring says when)."""
    return (
        t.device.type == "cuda"
        and qdtype == torch.int8
        and block & (block - 1) == 0
        and block <= 4096
        and _has_triton()
    )


def pack(
    x: torch.Tensor, block: int, scales: torch.Tensor, values: torch.Tensor
) -> None:  # fmt: skip
    """Quantize each row of ``x`` (``[rows, n]``, unit stride along n): the scales into
    ``scales`` (fp32 ``[rows, blocks]``), the values into ``values`` (int8
    ``[rows, blocks * block]``; the padding written as zeros)."""
    rows, n = x.shape
    nb = scales.shape[1]
    pack_kernel, _ = _kernels()
    group = _group(block)
    pack_kernel[(rows, -(-nb // group))](
        x, x.stride(0), scales, scales.stride(0), values, values.stride(0), n, nb,
        BLOCK=block, GROUP=group,
    )  # fmt: skip


def unpack(
    values: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block: int
) -> None:  # fmt: skip
    """Dequantize ``values`` (int8 ``[rows, >= n]``) with ``scales`` into ``out``
    (``[rows, n]``, unit stride along n, its dtype)."""
    rows, n = out.shape
    nb = scales.shape[1]
    _, unpack_kernel = _kernels()
    group = _group(block)
    unpack_kernel[(rows, -(-nb // group))](
        values, values.stride(0), scales, scales.stride(0), out, out.stride(0), n, nb,
        BLOCK=block, GROUP=group,
    )  # fmt: skip


def _group(block: int) -> int:
    """Blocks per program: about 4096 elements each."""
    return max(1, 4096 // block)
