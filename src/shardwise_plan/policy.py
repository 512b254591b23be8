"""What a plan is asked about: the sharding policy, and the machine it is predicted for.

Why the machine is a value with stated defaults: a predicted step time is only
as good as the rates behind it, so every rate is a field the caller can read
in the result and override, and each default says where it came from.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

AC_MODES = ("none", "non-reentrant", "reentrant")
MP_MODES = ("none", "bf16")


@dataclass(frozen=True)
class Policy:
    """One way to run the step: what ``fully_shard`` and checkpointing are given."""

    mp: str = "none"  # "bf16": bf16 parameters in compute, fp32 gradient reduction
    ac: str = "none"  # activation checkpointing of every block
    reshard_after_forward: bool | int = True
    offload: bool = False  # CPUOffloadPolicy: shards, gradients, optimizer state on the host
    prefetch: int = 1  # modules gathered ahead

    def check(self) -> None:
        if self.mp not in MP_MODES:
            raise ValueError(f"mixed precision must be one of {MP_MODES}, got {self.mp!r}")
        if self.ac not in AC_MODES:
            raise ValueError(f"activation checkpointing must be one of {AC_MODES}, got {self.ac!r}")
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0, got {self.prefetch!r}")

    def label(self) -> str:
        raf = self.reshard_after_forward
        parts = [f"mp={self.mp}", f"ac={self.ac}", f"raf={str(raf).lower()}"]
        parts += [f"prefetch={self.prefetch}"] + (["offload"] if self.offload else [])
        return " ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


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
    device: str = "cuda"  # what the optimizer defaults to there (foreach on CUDA)
    source: str = ""

    def with_overrides(self, **kw: Any) -> Hardware:
        return replace(self, **{k: v for k, v in kw.items() if v is not None})

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# One H200 SXM (torch 2.11), measured by calibrate("cuda") on 2026-12-02
# (docs/bench/h200_rates_20261202.json): a bf16 linear layer's forward and
# backward at (8192, 2048 -> 8192) 742 TFLOP/s, fp32 50.6, an add 4.30 TB/s, one
# tiny operator 8.0 us, the host's AdamW 32.6 GB/s and its pinned copies 49 GB/s.
# Communication is not measured there (one GPU): NVLink 4's 450 GB/s a direction
# and 400 Gb/s InfiniBand (50 GB/s a GPU) derated to 80%, what NCCL rings
# typically reach. Override them with a measured all-gather (--calibrate on a
# node of several GPUs, then --rates FILE; or --intra-bw / --inter-bw).
H200 = Hardware(
    name="h200",
    matmul_flops=742e12,
    matmul_flops_fp32=50.6e12,
    mem_bw=4.30e12,
    op_overhead=8.0e-6,
    view_overhead=1.0e-6,
    dtensor_overhead=0.0,  # hidden behind the GPU's work
    intra_bw=360e9,
    inter_bw=40e9,
    latency=15e-6,
    ranks_per_node=8,
    host_mem_bw=26.8e9,
    h2d_bw=49.2e9,
    alloc_round=512,
    host_adamw_bw=32.6e9,
    # torch's default cuBLAS workspace on a Hopper GPU (CUBLAS_WORKSPACE_CONFIG unset):
    # 32 MiB, measured there as the growth of the allocated bytes at a first product.
    blas_workspace=32 << 20,
    source="calibrate('cuda') on one H200, 2026-12-02; NVLink and InfiniBand from the "
    "datasheets, derated (not measured)",
)

# The 2-core development machine the CPU rows of docs/scaling.md were measured
# on: calibrate("cpu") by 2 gloo ranks of 1 thread at once on a quiet machine
# (2026-12-02, docs/bench/cpu_rates_20261202.json). bf16 products are slow here
# (no native bf16): 2.1 GFLOP/s against 33 in fp32. Its gloo latency and bus are a
# back-to-back loop's and one flat gather's; calibrate() since cc88ed5 takes them
# beside compute and from per-tensor gathers (docs/scaling.md, "CPU time").
THIS_CPU = Hardware(
    name="cpu",
    matmul_flops=2.15e9,
    matmul_flops_fp32=33.0e9,
    mem_bw=5.16e9,
    op_overhead=3.2e-6,
    view_overhead=2.5e-6,
    dtensor_overhead=98e-6,
    intra_bw=0.59e9,
    inter_bw=0.59e9,
    latency=324e-6,
    ranks_per_node=64,
    host_mem_bw=5.16e9,
    h2d_bw=5e9,
    alloc_round=1,
    host_adamw_bw=4.4e9,
    comm_overlaps=False,
    device="cpu",
    source="calibrate('cpu') on the 2-core development machine, 2 gloo ranks of 1 thread "
    "at once (2026-12-02)",
)

HARDWARE = {"h200": H200, "cpu": THIS_CPU}

# Threads that run matrix products in a training step on a GPU: the one that calls
# forward, and autograd's thread for the device, which runs backward (with its
# own cuBLAS handle, hence its own workspace).
BLAS_THREADS = 2
