"""torchtitan 0.3.0: the llama3 debug model through torchtitan's own ``parallelize_llama``.

What a torchtitan training step does, with torchtitan's components: its
debug-model config (two of its six layers, SDPA attention: flex attention
has no CPU backward), ``ParallelDims`` meshes, ``parallelize_llama`` (AC,
then FSDP on the decoder: each block, ``[norm, lm_head]`` as one group, the
root; then ``disable_fsdp_gradient_division``), its loss (``CrossEntropyLoss``
or the default ``ChunkedLossWrapper``, which calls ``lm_head`` outside the
root's forward, chunk by chunk, one backward each), the loss divided by the
*global* count of valid tokens (the ranks hold different counts: some labels
are ignored), gradient accumulation over microbatches, torchtitan's
``clip_grad_norm_`` (it clips: the norm is above ``max_norm``) and its AdamW
container.

Under that normalisation the ranks' gradients must be *summed*: torchtitan
calls ``set_gradient_divide_factor(1.0)`` on every ``FSDPModule``. An FSDP
that ignores it averages on top (gradient norm 0.79 instead of 1.58): the
``control`` case sabotages exactly that and checks the comparison notices.

Case names: ``<spmd backend>:<loss>:<ac>`` with backend ``partial_dtensor``
(DTensor only for model-parallel axes; plain tensors in and out) or
``full_dtensor`` (every parameter, input and the loss a DTensor on the full
mesh; ``fully_shard`` gets ``dp_mesh_dims``), loss ``ce`` or ``chunked``, ac
``none``/``full``/``selective``; ``...:accum`` adds two microbatches a step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .common import (
    check_sharded_by,
    close,
    expect_failure,
    fsdp_modules,
    patched,
    same_params,
    stub_triton,
)

STEPS, LOCAL, SEQ, LAYERS, VOCAB = 3, 2, 32, 2, 2048
_refs: dict[int, dict[str, Any]] = {}
_dims: dict[str, Any] = {}


def setup(rank: int, world: int, impl: str) -> None:
    stub_triton()
    import torchtitan.distributed.parallel_dims as parallel_dims

    # torchtitan builds its meshes on the accelerator it finds ("cuda" when none).
    parallel_dims.device_type = "cpu"
    from torchtitan.models.llama3.config_registry import llama3_debugmodel  # noqa: F401


def make_config(backend: str, dp: int, loss: str, ac: str) -> Any:
    """torchtitan's own llama3 debug-model trainer config, made small and CPU-ready."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    cfg = llama3_debugmodel()  # loss: ChunkedLossWrapper(CrossEntropyLoss), 8 chunks
    cfg.parallelism.spmd_backend = backend
    cfg.parallelism.data_parallel_shard_degree = dp
    cfg.training.seq_len = SEQ
    cfg.training.mixed_precision_param = "float32"
    cfg.training.max_norm = 1.0
    cfg.activation_checkpoint = {
        "none": None,
        "full": FullAC.Config(),
        "selective": SelectiveAC.Config(),
    }[ac]
    if loss == "ce":
        cfg.loss = CrossEntropyLoss.Config(global_vocab_size=VOCAB)
    model_cfg = cfg.model_spec.model
    model_cfg.layers = model_cfg.layers[:LAYERS]
    for layer in model_cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    model_cfg.update_from_config(config=cfg)  # RoPE cache sized to seq_len, as the trainer does
    return cfg


def batches(world: int, micro: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per step, per microbatch: the whole batch's (inputs, labels); some labels ignored."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        step = []
        for m in range(micro):
            tokens = torch.randint(0, VOCAB, (world * LOCAL, SEQ + 1), generator=g)
            inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
            labels[0, : 12 + 4 * m] = -100  # rank 0 holds fewer valid tokens than rank 1
            step.append((inputs, labels))
        out.append(step)
    return out


def reference(world: int, micro: int) -> dict[str, Any]:
    """One process, the whole batch: sum of token losses / all valid tokens, clipped AdamW."""
    if micro in _refs:
        return _refs[micro]
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.distributed import utils as dist_utils

    cfg = make_config("partial_dtensor", 1, "ce", "none")
    torch.manual_seed(0)
    model = cfg.model_spec.model.build()
    model.init_weights()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = cfg.optimizer.build(model_parts=[model])
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config())
    losses, norms = [], []
    for step in batches(world, micro):
        opt.zero_grad()
        tokens = sum(int((labels != -100).sum()) for _, labels in step)
        total = 0.0
        for inputs, labels in step:
            loss, _ = loss_fn(model(inputs), labels, torch.tensor(tokens))
            loss.backward()
            total += loss.item()
        norms.append(
            dist_utils.clip_grad_norm_(list(model.parameters()), cfg.training.max_norm).item()
        )
        opt.step()
        losses.append(total)
    _refs[micro] = {"init": init, "model": model, "loss": losses, "grad_norm": norms}
    return _refs[micro]


def train(rank: int, world: int, impl: str, backend: str, loss: str, ac: str, micro: int) -> dict:
    from torch.distributed._composable.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.distributed import ParallelDims, full_dtensor
    from torchtitan.distributed import utils as dist_utils

    cfg = make_config(backend, world, loss, ac)
    dist_utils.set_spmd_backend(backend)
    if backend not in _dims:  # one set of meshes per backend and process (the model's
        # sharding configs resolve the meshes built first), as in one trainer run
        _dims[backend] = ParallelDims.from_config(cfg.parallelism, world)
        _dims[backend].build_mesh()
    dims = _dims[backend]
    # As torchtitan's trainer: build on meta, parallelize, materialize, init.
    with torch.device("meta"):
        model = cfg.model_spec.model.build()
    model = cfg.model_spec.parallelize_fn(
        model,
        parallel_dims=dims,
        training=cfg.training,
        parallelism=cfg.parallelism,
        compile_config=cfg.compile,
        ac_config=cfg.activation_checkpoint,
        dump_folder="",
    )
    check_sharded_by(model, impl, at_least=LAYERS + 2)
    if impl == "fsdp2":
        for m in fsdp_modules(model):
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    # The same initial weights as the reference (torchtitan's DCP load would
    # split wqkv through its state-dict hooks; copy each shard instead).
    ref = reference(world, micro)
    with torch.no_grad():
        for name, p in model.named_parameters():
            full = ref["init"][name.replace("_checkpoint_wrapped_module.", "")]
            p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements).to_local())
    loss_fn = cfg.loss.build()
    if isinstance(loss_fn, ChunkedLossWrapper):
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
        # The wrapper's FSDP branch (keep lm_head gathered, sync on the last chunk).
        assert isinstance(model.lm_head, FSDPModule)
    opt = cfg.optimizer.build(model_parts=[model])
    losses, norms = [], []
    for step in batches(world, micro):
        opt.zero_grad()
        mine = [(i.chunk(world)[rank], lab.chunk(world)[rank]) for i, lab in step]
        local_tokens = sum((lab != -100).sum() for _, lab in mine)
        gvt = dist_utils.dist_sum_tensor(local_tokens, dims.get_mesh("batch"))
        total = torch.zeros(())
        for inputs, labels in mine:
            if backend == "full_dtensor":
                inputs, labels, _ = full_dtensor.parallelize_inputs(dims, inputs, labels, {})
            out, _ = loss_fn(model(inputs), labels, gvt)
            out.backward()
            total += (out.full_tensor() if isinstance(out, DTensor) else out).detach()
        norms.append(
            dist_utils.clip_grad_norm_(
                list(model.parameters()), cfg.training.max_norm, foreach=True
            ).item()
        )
        opt.step()
        if backend != "full_dtensor":  # a full_dtensor loss is already the global sum
            dist.all_reduce(total)
        losses.append(total.item())
    assert len(norms) == len(ref["grad_norm"]) == STEPS, (len(norms), len(ref["grad_norm"]))
    for i, (got, want) in enumerate(zip(norms, ref["grad_norm"], strict=True)):
        close(got, want, f"step {i} grad norm (one process: {want:.4f})")
    assert min(norms) > cfg.training.max_norm, "the norm never exceeded max_norm: no clipping"
    close(losses, ref["loss"], "losses")
    same_params(model, ref["model"], "after training")
    return {"loss": losses, "grad_norm": norms}


def run(rank: int, world: int, impl: str, case: str) -> Any:
    if case == "control":
        # Sabotage: the FSDP ignores torchtitan's set_gradient_divide_factor(1.0)
        # and averages on top of the global-token normalisation.
        if impl == "shardwise":
            from shardwise.runtime.fsdp_module import FSDPModule
        else:
            from torch.distributed.fsdp import FSDPModule
        with patched(FSDPModule, "set_gradient_divide_factor", lambda self, factor: None):
            expect_failure(
                lambda: train(rank, world, impl, "partial_dtensor", "ce", "none", 1),
                "gradients averaged on top of torchtitan's global-token normalisation",
            )
        return None
    if case == "unpatch":
        return check_unpatch(impl)
    backend, loss, ac, *rest = case.split(":")
    return train(rank, world, impl, backend, loss, ac, 2 if rest == ["accum"] else 1)


def check_unpatch(impl: str) -> None:
    """unpatch_fsdp2() gives torchtitan torch's fully_shard back (imported after the patch)."""
    import torch.distributed.fsdp as torch_fsdp
    import torchtitan.distributed.fsdp as titan_fsdp
    from torch.distributed.fsdp._fully_shard._fully_shard import fully_shard as torch_fully_shard

    if impl != "shardwise":
        return None
    import shardwise

    routed = titan_fsdp.fully_shard
    assert getattr(routed, "_shardwise_routed", False), "the patch did not reach torchtitan"
    assert routed.__wrapped__ is shardwise.fully_shard  # the stand-in calls shardwise's
    shardwise.unpatch_fsdp2()
    assert torch_fsdp.fully_shard is torch_fully_shard, "torch's own name not restored"
    assert titan_fsdp.fully_shard is torch_fully_shard, (
        "unpatch_fsdp2() left shardwise's fully_shard in torchtitan.distributed.fsdp "
        "(bound by `from torch.distributed.fsdp import fully_shard` after patch_fsdp2())"
    )
    return None
