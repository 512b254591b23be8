"""The machine a plan is predicted for: its rates, each a field with a stated source.

Why the machine is a value with stated defaults: a predicted step time is only
as good as the rates behind it, so every rate is a field the caller can read
in the result and override, and each preset says where its figures come from.

The GPU presets are datasheets: each GPU's peak dense bf16 and fp32 FLOP/s
and memory bandwidth, times the share of the peak a training step's kernels
reach (``MATMUL_EFFICIENCY``, ``MEMORY_EFFICIENCY``: measured once by
``shardwise calibrate`` on a Hopper GPU, docs/scaling.md "Rates"), and the
NVLink and InfiniBand links at ``LINK_EFFICIENCY`` of their rate (what NCCL
rings typically reach). What the datasheets do not give (a kernel's launch
cost, the host's AdamW, pinned copies) is one measured server's, the same
for every preset. A machine unlike these: ``shardwise calibrate --out FILE``,
then ``shardwise plan --rates FILE``.

The CPU preset (gloo ranks) is there to run a plan on a CPU target, whose
memory is exact (the same runtime, gloo's buffers counted); its rates are
round figures of no particular machine and its step time is indicative only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any


@dataclass(frozen=True)
class Hardware:
    """Rates a step's time is predicted from (per rank). Units: FLOP/s, bytes/s, seconds.

    ``matmul_flops``: matrix products in the compute dtype; ``matmul_flops_fp32``
    without mixed precision. ``mem_bw``: what element-wise kernels stream.
    ``op_overhead``: the fixed cost of one operator (launch, dispatch).
    ``intra_bw``/``inter_bw``: a collective's bus bandwidth inside one node of
    ``ranks_per_node`` ranks / across nodes; ``latency`` per collective.
    ``host_*``: the CPU, for an offloaded optimizer step: ``host_adamw_bw`` what
    torch's AdamW reaches on host fp32 parameters, counted as 32 bytes a
    parameter (timeline.ADAMW_BYTES_PER_PARAM; ``host_mem_bw`` for other host
    operators); ``h2d_bw`` the copies between host and device.
    ``alloc_round``: the device allocator's block size (allocated bytes are
    multiples of it). ``blas_workspace``: the bytes cuBLAS takes from the
    allocator for each thread that runs a matrix product (``BLAS_THREADS`` of
    them in a step), made at its first product and kept.
    """

    name: str
    matmul_flops: float
    matmul_flops_fp32: float
    mem_bw: float
    op_overhead: float
    view_overhead: float  # a view launches no kernel: host time only
    dtensor_overhead: float  # DTensor's Python dispatch, per operator on DTensors
    intra_bw: float
    inter_bw: float
    latency: float
    ranks_per_node: int
    host_mem_bw: float
    h2d_bw: float
    alloc_round: int
    host_adamw_bw: float = 0.0  # 0: host_mem_bw
    blas_workspace: int = 0
    # False where the collectives' work runs on the cores compute needs (gloo ranks
    # filling a CPU's cores): a collective then adds its time to the compute stream.
    comm_overlaps: bool = True
    device: str = "cuda"
    source: str = ""

    def with_overrides(self, **kw: Any) -> Hardware:
        return replace(self, **{k: v for k, v in kw.items() if v is not None})

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# The share of a datasheet's peak that a training step's kernels reach: a bf16
# linear layer's forward and backward at (8192, 2048 -> 8192) against the dense
# peak (the fp32 one likewise, without TF32), and a large add against the
# memory's rate; measured by ``shardwise calibrate`` (docs/scaling.md, "Rates").
MATMUL_EFFICIENCY = 0.75
MEMORY_EFFICIENCY = 0.90
# NCCL's bus bandwidth as a share of a link's rate, for rings over NVLink and
# InfiniBand: the usual figure, not measured here (one GPU).
LINK_EFFICIENCY = 0.80
INFINIBAND_400G = 50e9  # bytes/s a GPU: one 400 Gb/s ConnectX-7 port each

# What no datasheet gives, the same for each GPU preset: a CUDA operator's launch and
# dispatch, a view's Python, the host's memory and AdamW on fp32 parameters, pinned
# copies over PCIe Gen5 x16; measured by ``shardwise calibrate`` on one GPU server.
_SERVER: dict[str, Any] = dict(
    op_overhead=8.0e-6,
    view_overhead=1.0e-6,
    dtensor_overhead=0.0,  # hidden behind the GPU's work
    latency=15e-6,
    ranks_per_node=8,
    host_mem_bw=26.8e9,
    h2d_bw=49.2e9,
    host_adamw_bw=32.6e9,
    alloc_round=512,
    # torch's default cuBLAS workspace on Hopper and Blackwell (CUBLAS_WORKSPACE_CONFIG
    # unset): 32 MiB a thread that multiplies.
    blas_workspace=32 << 20,
)


def _datasheet(
    name: str, bf16: float, fp32: float, hbm: float, nvlink: float, source: str
) -> Hardware:
    """A GPU from its datasheet: dense bf16 and fp32 FLOP/s, memory bytes/s, NVLink
    bytes/s a direction."""
    return Hardware(
        name=name,
        matmul_flops=bf16 * MATMUL_EFFICIENCY,
        matmul_flops_fp32=fp32 * MATMUL_EFFICIENCY,
        mem_bw=hbm * MEMORY_EFFICIENCY,
        intra_bw=nvlink * LINK_EFFICIENCY,
        inter_bw=INFINIBAND_400G * LINK_EFFICIENCY,
        source=f"{source}; x{MATMUL_EFFICIENCY} compute, x{MEMORY_EFFICIENCY} memory, "
        f"x{LINK_EFFICIENCY} links; launch, host and PCIe figures of one measured server",
        **_SERVER,
    )


# NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense bf16, 67 fp32, 3.35 TB/s HBM3, NVLink 4
# 900 GB/s (450 a direction).
H100 = _datasheet("h100", 989e12, 67e12, 3.35e12, 450e9, "NVIDIA H100 SXM5 datasheet")
# NVIDIA H200 SXM datasheet: the H100's compute, 4.8 TB/s HBM3e, NVLink 4.
H200 = _datasheet("h200", 989e12, 67e12, 4.8e12, 450e9, "NVIDIA H200 SXM datasheet")
# NVIDIA HGX B200 datasheet (1000 W): 2250 TFLOP/s dense bf16, 80 fp32, 8 TB/s HBM3e,
# NVLink 5 1.8 TB/s (900 GB/s a direction).
B200 = _datasheet("b200", 2250e12, 80e12, 8.0e12, 900e9, "NVIDIA HGX B200 datasheet")

# gloo ranks on a CPU: round figures a core of a current x86 server reaches, to replay
# a step with; not calibrated. A CPU plan's memory is what it is for.
CPU = Hardware(
    name="cpu",
    matmul_flops=5e9,  # bf16 products without native bf16 are slow
    matmul_flops_fp32=30e9,
    mem_bw=5e9,
    op_overhead=5e-6,
    view_overhead=2.5e-6,
    dtensor_overhead=100e-6,
    intra_bw=1e9,
    inter_bw=1e9,
    latency=500e-6,
    ranks_per_node=64,
    host_mem_bw=5e9,
    h2d_bw=5e9,
    alloc_round=1,
    host_adamw_bw=4e9,
    comm_overlaps=False,
    device="cpu",
    source="round figures of one CPU core, not calibrated: memory exact, step time indicative",
)

HARDWARE = {"h100": H100, "h200": H200, "b200": B200, "cpu": CPU}

# Threads that run matrix products in a training step on a GPU: the one that calls
# forward, and autograd's thread for the device, which runs backward (with its
# own cuBLAS handle, hence its own workspace).
BLAS_THREADS = 2
