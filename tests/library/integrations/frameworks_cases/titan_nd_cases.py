"""torchtitan 0.3.0 beyond FSDP alone: pipeline, tensor, expert and context parallel.

Each case is a torchtitan training step built from torchtitan's components,
as its trainer wires them: its debug-model configs (two layers, SDPA, fp32),
``ParallelDims`` meshes, the model's ``pipelining_fn`` (``pipeline_llm``:
stage split, ``PipelineStage``, the schedule, each stage parallelized by the
model's ``parallelize_fn``) or its ``parallelize_fn`` alone, its loss
divided by the *global* count of valid tokens, its ``clip_grad_norm_``
(``pp_mesh``, ``ep_enabled``) and AdamW container. Every case is compared,
in the workers, with one process training the whole batch from the same
initial weights: each step's loss and gradient norm, every final parameter.

Case names (``run`` parses them):

- ``pp:<schedule>``: llama3, ``pipeline_parallel_degree`` 2 x dp_shard 2 (4
  ranks), 4 microbatches, for every schedule name torchtitan's config takes
  (torch's ``get_schedule_class``; its two abstract bases excepted). Also
  checks one reduce-scatter per sharded group per step: the pipeline's
  microbatches are accumulated locally and reduced once.
- ``pptp:<schedule>``: llama3, pp 2 x tp 2 x dp_shard 2 (8 ranks).
- ``ep2:<model>``: deepseek_v3 / qwen3 MoE, dp_shard 4 with
  ``expert_parallel_degree`` 2 (experts on the ``efsdp`` mesh of 2, the rest
  on ``fsdp`` of 4: one ``fully_shard`` per block with a per-parameter mesh).
- ``ep1:<model>``: the same models at EP 1 with fewer experts than FSDP
  ranks, so torchtitan shards the experts on dim 1 (``shard_placement_fn``).
- ``cp:llama3``: dp_shard 2 x cp 2, FSDP over the flattened ``fsdp``
  (dp_shard x cp) mesh, torchtitan's SDPA context parallel.
- ``control:<what>``: a sabotage of what a group checks, which the
  comparison must catch (``expect_failure``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .common import (
    check_sharded_by,
    close,
    count_reduce_scatters,
    fsdp_modules,
    full,
    patched,
    stub_triton,
)

STEPS, SEQ, LAYERS, VOCAB = 2, 32, 2, 2048
MICRO = 4  # pipeline microbatches per step (of one sequence each) per data-parallel rank
LOCAL = 2  # sequences per data-parallel rank per step without pipeline
SCHEDULES = [
    "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
    "DualPipeV",
]  # fmt: skip
MOE_MODELS = ["deepseek_v3", "qwen3_moe"]
_refs: dict[tuple, dict[str, Any]] = {}
_dims: dict[tuple, Any] = {}


def setup(rank: int, world: int, impl: str) -> None:
    stub_triton()
    import torchtitan.distributed.parallel_dims as parallel_dims

    # torchtitan builds its meshes on the accelerator it finds ("cuda" when none).
    parallel_dims.device_type = "cpu"
    from torchtitan.models.common.moe import GroupedExperts

    GroupedExperts.forward = fp32_experts  # type: ignore[method-assign]


def fp32_experts(self: Any, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """torchtitan's GroupedExperts.forward in the parameters' dtype.

    Its own casts the tokens and weights to bf16 for ``torch._grouped_mm`` (a
    GPU kernel's dtype) whatever the model's dtype; bf16 rounding (about 1e-2
    relative) would swamp a comparison at rtol 1e-4, and CPU's fp32
    ``_grouped_mm`` has no backward. The same SwiGLU per expert, on each
    expert's contiguous run of tokens; dispatch, sharding and the weights'
    DTensor-to-local step are torchtitan's."""
    from torch.distributed.tensor import DTensor

    w1, w2, w3 = (
        w.to_local() if isinstance(w, DTensor) else w
        for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD)
    )
    counts = [int(n) for n in tokens_per_expert.tolist()]
    out = [
        (F.silu(xs @ w1[e].T) * (xs @ w3[e].T)) @ w2[e].T
        for e, xs in enumerate(x[: sum(counts)].split(counts))
    ]
    rest = x.new_zeros(x.shape[0] - sum(counts), w2.shape[1])  # padding rows, as grouped_mm's
    return torch.cat([*out, rest])


# ---- configs ------------------------------------------------------------------------------


def set_experts(moe: Any, experts: int, top_k: int) -> None:
    """Fewer experts than the debug models' (8 and 64): every field that counts them."""
    moe.num_experts = experts
    moe.routed_experts.inner_experts.num_experts = experts
    moe.routed_experts.token_dispatcher.num_experts = experts
    moe.routed_experts.token_dispatcher.top_k = top_k
    moe.router.num_experts = experts
    moe.router.top_k = top_k
    moe.router.gate.out_features = experts


def make_config(model: str, experts: int = 4, **parallel: Any) -> Any:
    """torchtitan's own debug-model trainer config, two layers, CPU-ready, fp32."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.models.common.attention import ScaledDotProductAttention

    if model == "llama3":
        from torchtitan.models.llama3.config_registry import llama3_debugmodel as make
    elif model == "deepseek_v3":
        from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel as make
    elif model == "qwen3_moe":
        from torchtitan.models.qwen3.config_registry import qwen3_moe_debug as make
    else:
        raise ValueError(model)
    cfg = make()
    cfg.parallelism.spmd_backend = "partial_dtensor"
    for name, value in parallel.items():
        setattr(cfg.parallelism, name, value)
    cfg.training.seq_len = SEQ
    cfg.training.mixed_precision_param = "float32"
    cfg.training.max_norm = 1.0
    cfg.activation_checkpoint = None
    cfg.loss = CrossEntropyLoss.Config(global_vocab_size=VOCAB)
    model_cfg = cfg.model_spec.model
    model_cfg.layers = model_cfg.layers[:LAYERS]
    for layer in model_cfg.layers:
        # flex attention has no CPU backward; torchtitan's own tests use SDPA too
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        if getattr(layer, "moe", None) is not None:
            set_experts(layer.moe, experts, min(2, experts))
    model_cfg.update_from_config(config=cfg)  # RoPE cache sized to seq_len, as the trainer does
    return cfg


def batches(rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step, the whole batch's (inputs, labels); some labels ignored, unevenly by row."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
        inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
        for r in range(0, rows, 2):
            labels[r, : 4 + 3 * r] = -100  # data-parallel ranks hold different token counts
        out.append((inputs, labels))
    return out


def reference(model: str, experts: int, rows: int) -> dict[str, Any]:
    """One process, the whole batch: sum of token losses / all valid tokens, clipped AdamW."""
    key = (model, experts, rows)
    if key in _refs:
        return _refs[key]
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.distributed import utils as dist_utils

    cfg = make_config(model, experts)
    torch.manual_seed(0)
    ref = cfg.model_spec.model.build()
    with torch.no_grad():
        ref.init_weights()
    init = {n: p.detach().clone() for n, p in ref.named_parameters()}
    opt = cfg.optimizer.build(model_parts=[ref])
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config())
    losses, norms = [], []
    for inputs, labels in batches(rows):
        opt.zero_grad()
        loss, _ = loss_fn(ref(inputs), labels, (labels != -100).sum())
        loss.backward()
        norms.append(dist_utils.clip_grad_norm_(list(ref.parameters()), 1.0).item())
        opt.step()
        losses.append(loss.item())
    _refs[key] = {"init": init, "model": ref, "loss": losses, "grad_norm": norms}
    return _refs[key]


def parallel_dims(cfg: Any, world: int) -> Any:
    """One ParallelDims (and its meshes) per layout and process, as in one trainer run."""
    from torchtitan.distributed import ParallelDims

    p = cfg.parallelism
    key = (
        p.pipeline_parallel_degree, p.data_parallel_shard_degree, p.tensor_parallel_degree,
        p.context_parallel_degree, p.expert_parallel_degree,
    )  # fmt: skip
    if key not in _dims:
        _dims[key] = ParallelDims.from_config(p, world)
        _dims[key].build_mesh()
    return _dims[key]


# ---- one training run ---------------------------------------------------------------------


def train(
    rank: int, world: int, impl: str, model: str, experts: int = 4, count: bool = False,
    cp_attention: bool = False, shard1_experts: bool = False, **parallel: Any,
) -> dict[str, list[float]]:  # fmt: skip
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.context_parallel import prepare_context_parallel_input

    cfg = make_config(model, experts, **parallel)
    dist_utils.set_spmd_backend("partial_dtensor")  # a process-wide switch the model reads
    dims = parallel_dims(cfg, world)
    micro = MICRO if dims.pp_enabled else 1
    per_rank = micro if dims.pp_enabled else LOCAL
    batch_degree = dims.dp_replicate * dims.dp_shard
    ref = reference(model, experts, batch_degree * per_rank)
    loss_fn = cfg.loss.build()
    cfg.training.local_batch_size = per_rank

    # As torchtitan's trainer: build on meta, pipeline and/or parallelize, materialize.
    with torch.device("meta"):
        whole = cfg.model_spec.model.build()
    kwargs = dict(
        parallel_dims=dims, training=cfg.training, parallelism=cfg.parallelism,
        compile_config=cfg.compile, ac_config=cfg.activation_checkpoint, dump_folder="",
    )  # fmt: skip
    if dims.pp_enabled:
        schedule, parts, first, last = cfg.model_spec.pipelining_fn(
            whole, **kwargs, device=torch.device("cpu"), model_config=cfg.model_spec.model,
            parallelize_fn=cfg.model_spec.parallelize_fn, loss_fn=loss_fn,
        )  # fmt: skip
    else:
        if dims.cp_enabled and not cp_attention:  # see cp_positions
            import torchtitan.models.llama3.parallelize as titan_llama

            with patched(titan_llama, "apply_cp_to_forward", lambda *a, **k: None):
                whole = cfg.model_spec.parallelize_fn(whole, **kwargs)
        else:
            whole = cfg.model_spec.parallelize_fn(whole, **kwargs)
        parts, first, last = [whole], True, True
    for part in parts:
        check_sharded_by(part, impl, at_least=2)
        if impl == "fsdp2":
            for m in fsdp_modules(part):
                m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        part.to_empty(device="cpu")
        with torch.no_grad():
            part.init_weights()
        part.train()
        # The reference's initial weights, each shard copied in (by name: a stage
        # keeps the whole model's names).
        with torch.no_grad():
            for name, p in part.named_parameters():
                want = ref["init"][name]
                local = p.to_local() if hasattr(p, "to_local") else p
                local.copy_(redistributed(want, p))
    if shard1_experts:  # what the ep1 cases are for: torchtitan chose Shard(1) for them
        from torch.distributed.tensor import Shard

        experts = [p for n, p in parts[0].named_parameters() if "inner_experts" in n]
        assert experts and all(p.placements == (Shard(1),) for p in experts), [
            p.placements for p in experts
        ]
    opt = cfg.optimizer.build(model_parts=parts)
    groups = sum(reduced_groups(part, impl) for part in parts)

    batch_rank = dims.get_mesh("batch").get_local_rank() if batch_degree > 1 else 0
    losses, norms, reduced = [], [], []
    for inputs, labels in batches(batch_degree * per_rank):
        opt.zero_grad()
        inputs = inputs.chunk(batch_degree)[batch_rank]
        labels = labels.chunk(batch_degree)[batch_rank]
        gvt = dist_utils.dist_sum_tensor((labels != -100).sum(), dims.get_mesh("batch")) \
            if batch_degree > 1 else (labels != -100).sum()  # fmt: skip
        total = torch.zeros(())
        with count_reduce_scatters(impl) as seen:
            if dims.pp_enabled:
                step_losses: list[torch.Tensor] = []
                # torch 2.13's whole-batch form: torchtitan 0.3.0's trainer passes
                # arg_mbs=/kwarg_mbs=/target_mbs=, which this torch's step() takes
                # for model keyword arguments (docs/frameworks.md).
                schedule.step(
                    *((inputs,) if first else ()),
                    target=labels if last else None,
                    losses=step_losses if last else None,
                    loss_kwargs={"global_valid_tokens": gvt},
                    return_outputs=False,
                )
                if last:
                    total = torch.stack(step_losses).sum().detach()
            else:
                extra: dict[str, Any] = {}
                if dims.cp_enabled and cp_attention:
                    extra["positions"] = torch.arange(SEQ).expand(inputs.shape[0], SEQ)
                    inputs, labels, extra = prepare_context_parallel_input(
                        inputs, labels, extra, dims.get_mesh("cp"), torch.device("cpu"),
                        cfg.parallelism.context_parallel_load_balancer,
                    )  # fmt: skip
                elif dims.cp_enabled:
                    # CP's split of the work without its attention: every CP rank runs
                    # the whole sequence and takes the loss of its share of the
                    # positions (torchtitan's head-tail chunks), so each holds part of
                    # every gradient and only the sum over the cp ranks (FSDP's
                    # dp_shard_cp mesh) is the whole batch's.
                    labels = labels.clone()
                    labels[:, ~cp_positions(dims.get_mesh("cp"))] = -100
                out, _ = loss_fn(parts[0](inputs, **extra), labels, gvt)
                out.backward()
                total = out.detach()
        reduced.append(sum(seen.values()))
        norms.append(
            dist_utils.clip_grad_norm_(
                [p for part in parts for p in part.parameters()], 1.0, foreach=True,
                pp_mesh=dims.get_mesh("pp") if dims.pp_enabled else None,
                ep_enabled=dims.ep_enabled,
            ).item()
        )  # fmt: skip
        opt.step()
        # Every rank that computed a loss holds its share of the global mean; the
        # other ranks (not the last stage, a TP peer's copy) add zero.
        holds = last and (not dims.tp_enabled or dims.get_mesh("tp").get_local_rank() == 0)
        if dims.cp_enabled:  # each CP rank's loss is its half of the sequence's tokens
            holds = last
        total = total if holds else torch.zeros(())
        dist.all_reduce(total)
        losses.append(total.item())
    assert len(norms) == len(ref["grad_norm"]) == STEPS, (len(norms), len(ref["grad_norm"]))
    for i, (got, want) in enumerate(zip(norms, ref["grad_norm"], strict=True)):
        close(got, want, f"step {i} grad norm (one process: {want:.4f})")
    assert min(norms) > 1.0, "the norm never exceeded max_norm: no clipping"
    close(losses, ref["loss"], "losses")
    want = dict(ref["model"].named_parameters())
    # AdamW moves an element whose gradient is below its eps (1e-8) by lr * g / eps:
    # the MoE models have a few such elements, where fp32's summation order (1e-10)
    # shows as 1e-5 in the weight. Their losses and gradient norms are held to rtol 1e-4.
    atol = 5e-5 if model in MOE_MODELS else 1e-5
    for part in parts:  # a stage holds some of the whole model's parameters, by its names
        for name, p in part.named_parameters():
            close(full(p.detach()), want[name].detach(), f"after training: {name}", atol=atol)
    if count:  # one reduction per group per step, after the last microbatch
        assert reduced == [groups] * STEPS, (
            f"reduce-scatters per step {reduced}, expected {groups} (one per sharded group)"
        )
    return {"loss": losses, "grad_norm": norms}


def cp_positions(cp_mesh: Any) -> torch.Tensor:
    """The positions this CP rank's loss covers: chunks i and 2*cp-1-i of 2*cp (the
    head-tail load balancing torchtitan's SDPA context parallel shards by)."""
    cp, i = cp_mesh.size(), cp_mesh.get_local_rank()
    chunk = torch.arange(SEQ) // (SEQ // (2 * cp))
    return (chunk == i) | (chunk == 2 * cp - 1 - i)


def reduced_groups(model: torch.nn.Module, impl: str) -> int:
    """Parameter groups with trainable parameters: a reduce-scatter each per step
    (FSDP2 keeps one group per mesh of a module: ``_fsdp_param_groups``). By id: the
    modules of one ``fully_shard([norm, lm_head])`` share their group."""
    seen: set[int] = set()
    for m in fsdp_modules(model):
        if impl == "shardwise":
            groups = [m._shardwise_state.group]
            params = lambda g: [sp.sharded for sp in g.params]  # noqa: E731
        else:
            groups = m._get_fsdp_state()._fsdp_param_groups
            params = lambda g: [fp.sharded_param for fp in g.fsdp_params]  # noqa: E731
        seen.update(
            id(g) for g in groups if g is not None and any(p.requires_grad for p in params(g))
        )
    return len(seen)


def redistributed(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This rank's local piece of ``full`` laid out as ``p`` (a DTensor or not)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(p, DTensor):
        return full
    return distribute_tensor(full, p.device_mesh, p.placements).to_local()


# ---- cases ----------------------------------------------------------------------------------


def _fsdp_module_class(impl: str) -> Any:
    if impl == "shardwise":
        from shardwise.runtime.fsdp_module import FSDPModule
    else:
        from torch.distributed.fsdp import FSDPModule
    return FSDPModule


def run(rank: int, world: int, impl: str, case: str) -> Any:
    kind, _, arg = case.partition(":")
    if kind == "pp":
        return train(
            rank, world, impl, "llama3", count=True, pipeline_parallel_degree=2,
            data_parallel_shard_degree=2, pipeline_parallel_schedule=arg,
        )  # fmt: skip
    if kind == "pptp":
        return train(
            rank, world, impl, "llama3", count=True, pipeline_parallel_degree=2,
            tensor_parallel_degree=2, data_parallel_shard_degree=2,
            pipeline_parallel_schedule=arg,
        )  # fmt: skip
    if kind == "ep2":
        return train(
            rank, world, impl, arg, experts=4, data_parallel_shard_degree=world,
            expert_parallel_degree=2,
        )  # fmt: skip
    if kind == "ep1":  # fewer experts than FSDP ranks: torchtitan shards them on dim 1
        return train(
            rank, world, impl, arg, experts=2, shard1_experts=True,
            data_parallel_shard_degree=world,
        )  # fmt: skip
    if kind == "cp":  # FSDP over dp_shard x cp, CP's attention left out (no CPU path)
        return train(
            rank, world, impl, arg, data_parallel_shard_degree=world // 2,
            context_parallel_degree=2,
        )  # fmt: skip
    if kind == "cp-attention":
        # torch's context parallel SDPA has no CPU path: the DTensor dispatch knows no
        # sharding of the CPU flash-attention op. If this stops raising, the cp case
        # can run CP's attention (cp_attention=True) and docs/frameworks.md changes.
        try:
            train(
                rank, world, impl, arg, cp_attention=True,
                data_parallel_shard_degree=world // 2, context_parallel_degree=2,
            )  # fmt: skip
        except NotImplementedError as e:
            assert "_scaled_dot_product_flash_attention_for_cpu" in str(e), e
            return None
        raise AssertionError("torch's context parallel attention ran on CPU")
    if kind == "control":
        return control(rank, world, impl, arg)
    raise ValueError(case)


def caught(fn: Any, what: str, check: str) -> None:
    """``expect_failure``, and by the check that names what was broken."""
    try:
        fn()
    except AssertionError as e:
        assert check in str(e), f"control {what} failed another check:\n{e}"
        return
    raise AssertionError(f"control: {what} went unnoticed by the comparison")


def control(rank: int, world: int, impl: str, what: str) -> None:
    fsdp_module = _fsdp_module_class(impl)
    if what == "pp-sync-every-microbatch":
        # The FSDP reduces after every microbatch (it ignores the schedule's
        # set_requires_gradient_sync(False)): the sum is the same, the count is not.
        def always_sync(self: Any, requires: bool, *, recurse: bool = True) -> None:
            original(self, True, recurse=recurse)

        original = fsdp_module.set_requires_gradient_sync
        with patched(fsdp_module, "set_requires_gradient_sync", always_sync):
            caught(lambda: run(rank, world, impl, "pp:1F1B"), what, "reduce-scatters per step")
        return None
    # The FSDP ignores torchtitan's set_gradient_divide_factor(1.0) and averages on
    # top of the global-token normalisation, in the layout the group checks.
    case = {"pp-averaged": "pp:1F1B", "ep-averaged": "ep2:deepseek_v3",
            "ep1-averaged": "ep1:qwen3_moe", "cp-averaged": "cp:llama3",
            "pptp-averaged": "pptp:1F1B"}[what]  # fmt: skip
    with patched(fsdp_module, "set_gradient_divide_factor", lambda self, factor: None):
        caught(lambda: run(rank, world, impl, case), what, "grad norm")
    return None
