"""Block quantization for communication: int8 (or fp8 e4m3) values with one fp32 scale per block.

What it is for: the quantized weight all-gather and the inter-node step of the
hierarchical gradient reduction (node_collectives.py, ``CommPolicy``) send
one byte per element plus four per block instead of two (bf16) or four (fp32).

The scheme, per block of ``block`` consecutive elements of the last dim
(the last block zero-padded):

- int8, symmetric absmax: ``scale = absmax / 127``, ``q = round(x / scale)``
  in ``[-127, 127]``, ``deq = q * scale``. Error bound, per element of the
  block: ``|x - deq| <= scale / 2 = absmax / 254`` (exact arithmetic; fp32
  rounding adds at most a few ulps of ``absmax``: ``error_bound``).
- fp8 e4m3 (``torch.float8_e4m3fn``, max 448): ``scale = absmax / 448``,
  ``q = (x / scale)`` cast to e4m3 (round to nearest even), ``deq = q * scale``.
  Relative, with 3 mantissa bits: ``|x - deq| <= |x| / 16`` where ``x / scale``
  is normal (``>= 2**-6``), ``<= scale * 2**-10`` below it; so per block at
  most ``absmax / 16``.

A block of zeros has scale 0 and dequantizes to exact zeros. A non-finite
value makes its block's scale non-finite and the block dequantizes to NaN:
a gradient overflow stays visible to a loss scaler, never silently clipped.

Torch ops only, shapes fixed by the arguments (no data-dependent Python
control flow): ``torch.compile(fullgraph=True)`` traces it
(tests/library/comm/test_comm_policy.py).

Alternatives considered. (1) Asymmetric (min/max, zero point) int8: one more
value per block and a subtraction, for a gain only on blocks far from
symmetric; weights and gradients are near zero-mean. (2) One scale per
tensor or per rank: one outlier then costs a whole tensor its precision; the
per-block fp32 scale costs 4 bytes per ``block`` (1.6% at 256). (3) Stochastic
rounding: unbiased but not deterministic, and a recomputed forward must
gather exactly what the first forward gathered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import quantize_gpu

INT8_MAX = 127.0
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALE_BYTES = 4  # one fp32 scale per block
ALIGN = 16  # each packed row starts 16-byte aligned (the scales are read as fp32)


def fp8_dtype() -> torch.dtype | None:
    """``torch.float8_e4m3fn``, or None where this torch has no fp8."""
    return getattr(torch, "float8_e4m3fn", None)


def _qmax(dtype: torch.dtype) -> float:
    if dtype == torch.int8:
        return INT8_MAX
    if dtype == fp8_dtype():
        return FP8_MAX
    raise ValueError(f"block quantization to {dtype}: use torch.int8 or torch.float8_e4m3fn")


def blocks(numel: int, block: int) -> int:
    """Blocks of ``block`` elements that hold ``numel`` (the last one padded)."""
    return -(-numel // block)


def quantize(
    x: torch.Tensor, block: int, dtype: torch.dtype = torch.int8
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (``[..., n]``, any float dtype) in blocks along its last dim: ``(q, scales)``,
    ``q`` of shape ``[..., blocks, block]`` in ``dtype`` and ``scales`` ``[..., blocks]``
    in fp32. The math is fp32 whatever ``x`` is."""
    qmax = _qmax(dtype)
    n = x.shape[-1]
    nb = blocks(n, block)
    xf = x.float()
    if nb * block != n:
        xf = F.pad(xf, (0, nb * block - n))
    xf = xf.unflatten(-1, (nb, block))
    scales = xf.abs().amax(dim=-1) / qmax
    # A zero block: divide by the smallest normal instead (0 / tiny = 0); its
    # scale stays 0, so it dequantizes to exact zeros.
    y = xf / scales.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    if dtype == torch.int8:
        q = y.round_().clamp_(-qmax, qmax).to(torch.int8)
    else:
        q = y.clamp_(-qmax, qmax).to(dtype)  # rounds to nearest even
    return q, scales


def dequantize(
    q: torch.Tensor, scales: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The values ``quantize`` encoded, ``[..., numel]`` in ``dtype`` (padding dropped)."""
    x = q.float() * scales.unsqueeze(-1)
    return x.flatten(-2)[..., :numel].to(dtype)


def error_bound(scales: torch.Tensor, dtype: torch.dtype = torch.int8) -> torch.Tensor:
    """Per block, the largest ``|x - dequantize(quantize(x))|`` the scheme allows, with
    room for fp32 rounding (a few ulps of the block's absmax)."""
    qmax = _qmax(dtype)
    absmax = scales * qmax
    rounding = absmax * 4 * torch.finfo(torch.float32).eps
    if dtype == torch.int8:
        return scales / 2 + rounding
    return absmax / 16 + rounding


# ---- packed rows: what goes on the wire ------------------------------------------------------
# One row per destination (an all-to-all) or per rank (an all-gather):
# [scales: blocks * 4 bytes][values: blocks * block bytes][zero padding to ALIGN].
# Scales first, so that they start aligned for their fp32 view.


def row_bytes(numel: int, block: int) -> int:
    """Bytes of one packed row of ``numel`` elements."""
    nb = blocks(numel, block)
    raw = nb * SCALE_BYTES + nb * block
    return -(-raw // ALIGN) * ALIGN


def pack(x: torch.Tensor, block: int, dtype: torch.dtype, out: torch.Tensor) -> None:
    """Quantize each row of ``x`` (``[rows, n]``) into ``out`` (uint8 ``[rows, row_bytes]``)."""
    rows, n = x.shape
    nb = blocks(n, block)
    if quantize_gpu.usable(x, block, dtype) and x.stride(-1) == 1:
        quantize_gpu.pack(
            x,
            block,
            out[:, : nb * SCALE_BYTES].view(torch.float32),
            out[:, nb * SCALE_BYTES : nb * SCALE_BYTES + nb * block].view(torch.int8),
        )
        return
    q, scales = quantize(x, block, dtype)
    out[:, : nb * SCALE_BYTES].view(torch.float32).copy_(scales)
    values = out[:, nb * SCALE_BYTES : nb * SCALE_BYTES + nb * block]
    values.copy_(q.view(torch.uint8).view(rows, nb * block))


def unpack(
    packed: torch.Tensor, numel: int, block: int, qdtype: torch.dtype, dtype: torch.dtype
) -> torch.Tensor:
    """The rows ``pack`` wrote (uint8 ``[rows, row_bytes]``), dequantized: ``[rows, numel]``."""
    rows = packed.shape[0]
    nb = blocks(numel, block)
    scales = packed[:, : nb * SCALE_BYTES].view(torch.float32)
    values = packed[:, nb * SCALE_BYTES : nb * SCALE_BYTES + nb * block]
    if quantize_gpu.usable(packed, block, qdtype):
        out = torch.empty(rows, numel, dtype=dtype, device=packed.device)
        quantize_gpu.unpack(values.view(torch.int8), scales, out, block)
        return out
    q = values.view(qdtype).view(rows, nb, block)
    return dequantize(q, scales, numel, dtype)


def unpack_into(
    out: torch.Tensor, packed: torch.Tensor, numel: int, block: int, qdtype: torch.dtype
) -> None:
    """``unpack`` written into ``out`` (``[rows, numel]``, its dtype): on a GPU straight
    from the packed rows, with no temporary (quantize_gpu.py)."""
    if quantize_gpu.usable(packed, block, qdtype) and out.stride(-1) == 1:
        nb = blocks(numel, block)
        scales = packed[:, : nb * SCALE_BYTES].view(torch.float32)
        values = packed[:, nb * SCALE_BYTES : nb * SCALE_BYTES + nb * block]
        quantize_gpu.unpack(values.view(torch.int8), scales, out, block)
        return
    out.copy_(unpack(packed, numel, block, qdtype, out.dtype))
