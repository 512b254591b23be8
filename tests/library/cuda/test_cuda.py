"""The CUDA variant of the core suite: NCCL, one rank per GPU (one GPU is enough).

Skipped where there is no GPU (CI). Run on a GPU machine with
``python -m pytest tests/library/cuda/test_cuda.py`` (where shardwise is not installed,
``PYTHONPATH=$PWD/src:$PWD/tests``: absolute, since the CLI's tests run it
from a folder of their own).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

from cli_helpers import shardwise
from dist_utils import run_distributed
from test_parity_and_prefetch import PARITY, parity_worker, recompute_prefetch_worker

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
NCCL = "cpu:gloo,cuda:nccl"


def world() -> int:
    return min(torch.cuda.device_count(), 2) if torch.cuda.is_available() else 0


@pytest.mark.parametrize("case", list(PARITY))
def test_cuda_parity(case: str) -> None:
    _, cfg = PARITY[case]
    run_distributed(parity_worker, world(), {**cfg, "device": "cuda"}, backend=NCCL)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_cuda_recompute_prefetch_regression(reentrant: bool) -> None:
    run_distributed(recompute_prefetch_worker, world(), reentrant, "cuda", backend=NCCL)


def bf16_cuda_worker(rank: int, world: int, reduce_dtype: torch.dtype | None) -> None:
    """One GPU still gathers under bf16 (the cast): storage must come and go.
    Gradients land in fp32 whatever the reduce dtype (the default: bf16)."""
    import copy

    from models import Net, batches, loss_fn
    from shardwise import MixedPrecisionPolicy
    from test_parity_and_prefetch import assert_between_steps, reference_step, shard_net

    torch.manual_seed(0)
    ref = Net(d=32, ac="none").cuda()
    model = copy.deepcopy(ref)
    model.ac = "non-reentrant"
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    shard_net(model, {"mp_policy": policy})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    base = None
    for step, idx in enumerate(batches(4)):
        idx = idx.cuda()
        loss = loss_fn(model, idx.chunk(world)[rank])
        loss.backward()
        assert_between_steps(model)
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
        opt.step()
        opt.zero_grad()
        ref_loss = reference_step(ref, ref_opt, idx)
        torch.cuda.synchronize()
        if step == 1:
            base = torch.cuda.memory_allocated()
        elif step > 1:
            assert torch.cuda.memory_allocated() == base, "memory grows step over step"
        if world == 1:
            torch.testing.assert_close(loss.float(), ref_loss, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("reduce_dtype", [torch.float32, None], ids=["fp32-reduce", "bf16-reduce"])
def test_cuda_bf16_no_leak(reduce_dtype: torch.dtype | None) -> None:
    run_distributed(bf16_cuda_worker, world(), reduce_dtype, backend=NCCL)


def backward_cast_worker(rank: int, world: int) -> list[str]:
    """One GPU, bf16: the gathers (casts) of one backward, in order, as the timeline saw them."""
    import shardwise
    from shardwise import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]).cuda()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in model:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    x = torch.randn(8, 64, device="cuda")
    model(x).sum().backward()  # the first step records the orders
    loss = model(x).sum()
    with shardwise.trace() as t:
        loss.backward()
    torch.cuda.synchronize()
    needs = ("first_gather", "prefetch_hit", "prefetch_miss")
    return [ev.name for ev in sorted(t.local_events, key=lambda e: e.start) if ev.name in needs]


def test_cuda_one_rank_casts_ahead_in_backward_after_the_first_block() -> None:
    """The first block's backward (the peak) casts on demand, as FSDP2 does; once a
    block's backward is over, the next cast is issued one block ahead (prefetched)."""
    needs = run_distributed(backward_cast_worker, 1, backend=NCCL)[0]
    assert needs == ["first_gather", "prefetch_miss", "prefetch_hit", "prefetch_hit"], needs


# ---- real clients on GPUs (tests/library/integrations/test_clients.py) ---------------------------

CLIENT_CASES = ["llama:reentrant", "llama:non-reentrant", "lora:non-reentrant", "lora:reentrant"]


def test_cuda_transformers_llama_with_its_checkpointing() -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    if world() < 2:
        pytest.skip("counts each module's all-gathers; one rank runs none (needs 2 GPUs)")
    from test_clients import run_cases

    outcomes = run_cases(world(), CLIENT_CASES, "cuda", backend=NCCL)
    failed = {c: o.error for c, o in outcomes.items() if o.error}
    assert not failed, "\n".join(f"{c}:\n{e}" for c, e in failed.items())


def lora_peak_worker(rank: int, world: int, impl: str) -> int:
    """Peak GPU memory of LoRA fine-tuning a ~0.4B Llama with checkpointing, per implementation."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    from test_clients import enable_checkpointing

    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=6,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=1024,
    )
    with torch.device("cuda"):
        model = tf.LlamaForCausalLM(cfg)
    enable_checkpointing(model, reentrant=False)
    model = get_peft_model(model, LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
    if impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard as shard
    else:
        from shardwise import fully_shard as shard
    for layer in model.base_model.model.model.layers:
        shard(layer)
    shard(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, cfg.vocab_size, (4, 1024), device="cuda")
    for step in range(3):
        if step == 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def test_cuda_lora_peak_memory_not_above_fsdp2() -> None:
    pytest.importorskip("peft")
    peaks = {
        impl: max(run_distributed(lora_peak_worker, world(), impl, backend=NCCL, timeout=280))
        for impl in ("fsdp2", "shardwise")
    }
    print(f"LoRA peak memory at {world()} GPUs: {peaks}")
    assert peaks["shardwise"] <= peaks["fsdp2"], peaks


# ---- FSDP2's training semantics on GPUs (tests/library/api/test_training_semantics.py) -----------

SEMANTICS = {
    "dataclass-fp32": ("dataclass_worker", (False,)),
    "dataclass-bf16": ("dataclass_worker", (True,)),
    "requires-grad-changes": ("requires_grad_worker", ()),
    "reset-iter-state": ("reset_worker", ()),
    "assign-sharded": ("assign_worker", ("sharded",)),
    "assign-broadcast-from-rank0": ("assign_worker", ("broadcast-from-rank0",)),
    "frozen-modules": ("frozen_worker", ()),
    "slicing": ("slicing_worker", ()),
    "reshard-after-forward-defaults": ("raf_worker", ()),
}


@pytest.mark.parametrize("case", list(SEMANTICS))
def test_cuda_semantics(case: str) -> None:
    import test_training_semantics

    if case.startswith("dataclass") and world() < 2:
        pytest.skip("checks which modules hold gathered memory; one rank holds none (2 GPUs)")
    name, args = SEMANTICS[case]
    out = run_distributed(
        getattr(test_training_semantics, name), world(), *args, "cuda", backend=NCCL
    )
    if case == "frozen-modules":
        assert out[0] <= 2, f"{out[0]} frozen blocks gathered at once in backward"
    if case == "reshard-after-forward-defaults":
        seen = out[0]
        assert seen["shardwise/default"] == seen["fsdp2/default"] == (False, [True, True])
        assert seen["shardwise/True"] == seen["fsdp2/True"] == (True, [True, True])


def test_cuda_cpu_offload_matches_one_process() -> None:
    """Shards pinned in host memory, uploaded for each gather, CPU gradients and AdamW."""
    from test_fully_shard_keywords import offload_worker

    run_distributed(offload_worker, world(), "cuda", backend=NCCL)


def test_cuda_optimizer_in_backward_with_offload_matches_one_process() -> None:
    """Offloaded AdamW stepped on a CPU thread as each module's gradients land in host memory."""
    from test_optimizer_in_backward import check_offload

    run_distributed(check_offload, world(), "cuda", backend=NCCL)


# Four blocks whose fp32 shards (192 MiB each) outweigh their activations: the
# offloaded step's device peak is what its copies hold (docs/scaling.md).
OFFLOAD_GPT = {"seq_len": 1024, "n_layer": 4, "n_head": 16, "d_model": 2048}
OFFLOAD_BATCH = 2


def offload_peak_worker(rank: int, world: int) -> dict[str, Any]:
    """One offloaded GPU measured as ``shardwise plan --measure`` does (planner/setup.py's
    model, policy and optimizer): each step's ``max_memory_allocated`` after the first
    (which makes the optimizer state), and what the device holds before the model."""
    from shardwise.api import default_mesh
    from shardwise.layout import offload
    from shardwise_app.models.gpt import GPT, GPTConfig
    from shardwise_plan import Policy
    from shardwise_plan.setup import apply_policy, lm_loss, make_optimizer, token_batch

    dev = torch.device("cuda", torch.cuda.current_device())
    # cuBLAS's workspaces, one per thread that multiplies (this one in forward,
    # autograd's in backward), are made at the first matmul and kept: measured
    # first, as what the planner adds for them (Hardware.blas_workspace).
    w = torch.randn(64, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    (w @ w).sum().backward()
    del w
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    with dev:
        model = GPT(GPTConfig(**OFFLOAD_GPT))
    apply_policy(model, Policy(mp="bf16", ac="non-reentrant", offload=True), default_mesh())
    opt = make_optimizer(model, "cuda", offload=True)
    with dev:
        data = token_batch(model, OFFLOAD_BATCH, OFFLOAD_GPT["seq_len"])
    peaks, after_backward, between = [], [], []
    for _ in range(4):
        torch.cuda.synchronize()
        between.append(torch.cuda.memory_allocated())
        torch.cuda.reset_peak_memory_stats()
        lm_loss(model, data).backward()
        assert not offload._reading  # the end of backward let the last one go
        torch.cuda.synchronize()
        after_backward.append(torch.cuda.memory_allocated())
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated())
    return {"base": base, "peaks": peaks[1:], "after": after_backward[1:], "between": between[1:]}


def _offload_plan(compute: str = "rates") -> dict[str, Any]:
    """The planner on the offloaded GPT the tests below run: its peak and how it timed."""
    from shardwise_app.models.gpt import GPT, GPTConfig
    from shardwise_plan import H200, Policy, plan

    p = plan(
        lambda: GPT(GPTConfig(**OFFLOAD_GPT)),  # type: ignore[arg-type]
        1,
        batch_size=OFFLOAD_BATCH,
        seq_len=OFFLOAD_GPT["seq_len"],
        policy=Policy(mp="bf16", ac="non-reentrant", offload=True),
        hardware=H200,
        compute=compute,
    )
    return {"peak_bytes": p.peak_bytes, "compute": p.compute}


@pytest.mark.timeout(900)
def test_cuda_offloaded_peak_is_repeatable_and_predicted() -> None:
    """The offloaded step's device peak depends on the program, not on how far the
    copies lag the compute: the same in every step and in two processes, and within
    3% of the planner's, cuBLAS's workspaces included (the planner's figure for
    them is what the first product here allocates). A backward leaves the device
    memory as it found it: the last download's device tensor goes at its end."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    from shardwise_plan import H200
    from shardwise_plan.hardware import BLAS_THREADS

    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        predicted = pool.submit(_offload_plan).result(timeout=300)["peak_bytes"]
    runs = [run_distributed(offload_peak_worker, 1, backend=NCCL, timeout=280)[0] for _ in range(2)]
    peaks = [p for r in runs for p in r["peaks"]]
    assert len(set(peaks)) == 1, runs
    for r in runs:
        assert r["after"] == r["between"], r
    workspaces = H200.blas_workspace * BLAS_THREADS  # torch's default on Hopper
    assert runs[0]["base"] == workspaces, runs[0]["base"]
    measured = peaks[0]
    mib = {"predicted": predicted / 2**20, "measured": measured / 2**20, "runs": runs}
    assert abs(predicted - measured) <= 0.03 * measured, mib
    # and the step's own memory, the workspaces taken off both sides
    own = measured - runs[0]["base"]
    assert abs(predicted - workspaces - own) <= 0.03 * own, mib


@pytest.mark.timeout(300)
def test_cuda_measured_offload_plan_charges_the_host_optimizer_step_run_for_real() -> None:
    """A GPU target's offloaded optimizer runs on the host: the plan times its whole
    step there for real (DTensor's dispatch included, which a GPU target's rates
    hide), and its host operators, timed one by one, share exactly that time."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        c = pool.submit(_offload_plan, "measured").result(timeout=280)["compute"]
    assert c["host_distinct_calls"] > 0, c
    assert c["host_step_sampled"] == 1.0 and c["host_step_ms"] > 0, c
    assert c["host_operators_one_by_one_ms"] > 0, c
    assert abs(c["host_operators_ms"] - c["host_step_ms"]) <= 1e-6 * c["host_step_ms"], c


@pytest.mark.timeout(300)
def test_cuda_plan_measure_times_each_launch_the_first_taking_the_peak_too(
    tmp_path: Path,
) -> None:
    """``plan --measure --launches 2`` on a GPU: the first launch measures the peak and
    the step, the second the step only; the step is the median of both launches."""
    out = shardwise(
        "plan", "--model", "tiny", "--world-size", "1", "--batch-size", "4",
        "--seq-len", "128", "--measure", "--launches", "2", "--json", "m.json",
        cwd=tmp_path, timeout=280,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    m = json.loads((tmp_path / "m.json").read_text())["measured"]
    assert len(m["step_ms_per_launch"]) == len(m["step_ms_per_rank_per_launch"]) == 2, m
    assert m["step_ms"] == statistics.median(m["step_ms_per_launch"]), m
    assert m["peak_bytes"][0] > 0, m


def float8_worker(rank: int, world: int) -> None:
    """torchao's float8 training: shardwise gathers the fp8 weights and trains as FSDP2 does."""
    import copy

    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from shardwise import MixedPrecisionPolicy, fully_shard
    from shardwise.comm import collectives
    from shardwise_app.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=4, d_model=256)
    base = GPT(cfg).cuda()
    plain = copy.deepcopy(base)
    for block in base.blocks:
        convert_to_float8_training(
            block, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True)
        )
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    for model, shard, policy in (
        (ours, fully_shard, MixedPrecisionPolicy(torch.bfloat16, torch.float32)),
        (plain, fully_shard, MixedPrecisionPolicy(torch.bfloat16, torch.float32)),
        (theirs, torch_fully_shard, TorchMP(torch.bfloat16, torch.float32)),
    ):
        for block in model.blocks:
            shard(block, mp_policy=policy)
        shard(model, mp_policy=policy)

    def train(model: torch.nn.Module) -> tuple[list[float], int]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1 + rank)
        sent = [0]
        remove = collectives.add_observer(
            lambda rec, _: (
                sent.__setitem__(0, sent[0] + rec.nbytes)
                if rec.kind == "all_gather" and rec.label.startswith("blocks.")
                else None
            )
        )
        losses = []
        idx = torch.randint(0, 256, (4, 65), generator=g).cuda()  # one batch: learnable
        for _ in range(4):
            out = model(idx[:, :-1])
            loss = F.cross_entropy(out.float().reshape(-1, 256), idx[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses.append(float(t) / world)
        remove()
        return losses, sent[0]

    mine, fp8_bytes = train(ours)
    want, _ = train(theirs)
    _, bf16_bytes = train(plain)
    assert mine[-1] < mine[0], mine
    for a, b in zip(mine, want):
        assert abs(a - b) <= 2e-3 * abs(b), (mine, want)
    if world == 1:  # nothing goes over a wire: no all-gather runs at all
        assert fp8_bytes == bf16_bytes == 0, (fp8_bytes, bf16_bytes)
    else:  # the blocks' linears go over the wire in fp8 (1 byte), the rest in bf16 (2)
        assert fp8_bytes < 0.56 * bf16_bytes, (fp8_bytes, bf16_bytes)


def test_cuda_float8_all_gather_matches_fsdp2() -> None:
    pytest.importorskip("torchao.float8")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 matmuls need compute capability 8.9 or newer")
    run_distributed(float8_worker, world(), backend=NCCL)


def comm_alloc_worker(rank: int, world: int, mode: str) -> None:
    """Communication buffers from NCCL's allocator or symmetric memory: same training."""
    import copy

    from models import Net, batches
    from shardwise import FSDPModule, MixedPrecisionPolicy
    from test_parity_and_prefetch import make_opt, shard_net, step_and_compare

    torch.manual_seed(0)
    ref = Net(d=32, ac="none").cuda()
    model = copy.deepcopy(ref)
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    shard_net(model, {"mp_policy": policy})
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]

    def enable(m: FSDPModule) -> None:
        if mode == "process_group":
            m.set_allocate_memory_from_process_group_for_comm(True)
        else:
            m.set_symm_mem_for_comm()

    modules[0].set_custom_reduce_scatter(lambda **kw: None)
    with pytest.raises(ValueError, match="one or the other"):
        enable(modules[0])
    assert modules[0]._shardwise_state.settings.comm_alloc is None
    modules[0]._shardwise_state.change_settings(custom_reduce_scatter=None)
    for m in modules:
        enable(m)
    groups = [m._shardwise_state.group for m in modules if m._shardwise_state.group is not None]
    assert groups and all(g.settings.comm_alloc is not None for g in groups)
    with pytest.raises(ValueError, match="one or the other"):
        modules[0].set_custom_all_gather(lambda **kw: None)
    assert groups[0].settings.custom_all_gather is None
    opt, ref_opt = make_opt("adamw", model.parameters()), make_opt("adamw", ref.parameters())
    for idx in batches(3):
        step_and_compare(model, opt, ref, ref_opt, idx.cuda())
    if mode == "process_group":
        modules[0].set_allocate_memory_from_process_group_for_comm(False)
        assert modules[0]._shardwise_state.settings.comm_alloc is None


@pytest.mark.parametrize("mode", ["process_group", "symm_mem"])
def test_cuda_comm_buffers_from_allocator(mode: str) -> None:
    if world() < 2:
        pytest.skip("needs 2 GPUs")
    run_distributed(comm_alloc_worker, world(), mode, backend=NCCL)


def test_cuda_reduce_scatter_averages_in_nccl_unless_forced_to_sum() -> None:
    if world() < 2:
        pytest.skip("one rank reduce-scatters nothing")
    from test_fsdp_module_methods import force_sum_worker

    run_distributed(force_sum_worker, world(), "cuda", backend=NCCL)
