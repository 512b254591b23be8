"""accelerate 1.15's FSDP2 plugin path (``FullyShardedDataParallelPlugin(fsdp_version=2)``).

On CPU accelerate never takes the FSDP path: ``AcceleratorState`` sets
``DistributedType.FSDP`` only for GPU-like distributed types, so with
``cpu=True`` (or no accelerator) the plugin is dropped silently and
``prepare`` wraps the model in DDP (``MULTI_CPU``), or in nothing (``NO``,
and then every rank believes it is the only process). Each case therefore
builds ``Accelerator(cpu=True, fsdp_plugin=plugin)`` (the ``fallback`` case
checks that this is ``MULTI_CPU``, as documented) and then sets
``accelerator.state.distributed_type = DistributedType.FSDP`` and
``accelerator.state.fsdp_plugin = plugin``; from there on it is accelerate's
own FSDP2 path: ``prepare`` runs ``fsdp2_prepare_model`` (decoder layers by
``transformer_based_wrap``, the embedding, the ``[norm, lm_head]`` tail group
with ``reshard_after_forward=False``, the root), ``accumulate`` toggles
``set_requires_gradient_sync``, ``clip_grad_norm_`` is DTensor-aware,
``get_state_dict`` and ``save_state``/``load_state`` use DCP.

Cases (a transformers Llama of two layers): ``train``, ``tied`` (tied
embedding and head: one tail group of embedding, norm and head), ``accum-clip``
(two microbatches under ``accelerator.accumulate``: one reduce-scatter per
module per optimizer step; clipped), ``accum-control`` (sync that cannot be
turned off: the count notices), ``ac`` (the plugin's activation checkpointing),
``state-dict`` (``get_state_dict`` on rank 0 is the one-process model's),
``save-load`` (``save_state`` after two steps, a third step, ``load_state``,
the third step again: the same), ``fallback``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .common import (
    check_sharded_by,
    close,
    count_reduce_scatters,
    expect_failure,
    full,
    global_mean,
    groups_of,
    patched,
    same_params,
)

VOCAB, SEQ, LOCAL, STEPS, LR, MAX_NORM = 64, 8, 2, 3, 1e-2, 0.5
_dir: dict[str, str] = {}


def setup(rank: int, world: int, impl: str, folder: str) -> None:
    os.environ.update(
        LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29401",
    )  # fmt: skip
    _dir["root"] = os.path.join(folder, impl)
    import accelerate  # noqa: F401  (after patch_fsdp2)
    import transformers

    transformers.logging.set_verbosity_error()


def llama(tied: bool) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=tied, use_cache=False,
    )  # fmt: skip
    return tf.LlamaForCausalLM(cfg)


def accelerator_of(accum: int = 1, **plugin_kwargs: Any) -> Any:
    """An Accelerator on accelerate's FSDP2 path, on CPU (see the module docstring)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    AcceleratorState._reset_state(True)  # a fresh Accelerator per case
    GradientState._reset_state()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        **plugin_kwargs,
    )
    acc = Accelerator(cpu=True, fsdp_plugin=plugin, gradient_accumulation_steps=accum)
    assert acc.distributed_type == DistributedType.MULTI_CPU, acc.distributed_type
    assert acc.num_processes == 2
    acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin
    # Every AcceleratorState() made later (accelerate makes them inside its own
    # calls) copies PartialState's distributed_type over its own: set it there too.
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    assert acc.is_fsdp2
    return acc


def data(world: int, micro: int = 1) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        [torch.randint(0, VOCAB, (world * LOCAL, SEQ), generator=g) for _ in range(micro)]
        for _ in range(STEPS)
    ]


def loss_of(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def reference(
    ref: torch.nn.Module, steps: list[list[torch.Tensor]], world: int
) -> tuple[list[float], list[float]]:
    """One process on the whole batches: a microbatch's loss is the mean of the ranks'."""
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    losses, norms = [], []
    for micro in steps:
        total = 0.0
        for ids in micro:
            loss = sum(loss_of(ref, part) for part in ids.chunk(world)) / world
            (loss / len(micro)).backward()
            total += loss.item() / len(micro)
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, norms


def prepared(acc: Any, impl: str, tied: bool = False) -> tuple[Any, Any, torch.nn.Module]:
    import copy

    model = llama(tied)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = acc.prepare(model, opt)
    check_sharded_by(model, impl, at_least=4)
    if tied:
        inner = acc.unwrap_model(model)
        assert inner.lm_head.weight is inner.model.embed_tokens.weight, "untied by prepare"
    return model, opt, ref


def train(
    acc: Any, model: Any, opt: Any, steps: list[list[torch.Tensor]], rank: int, world: int,
    impl: str, counts: list[int] | None = None,
) -> tuple[list[float], list[float]]:  # fmt: skip
    losses, norms = [], []
    for micro in steps:
        total = torch.zeros(())
        with count_reduce_scatters(impl) as seen:
            for ids in micro:
                with acc.accumulate(model):
                    loss = loss_of(model, ids.chunk(world)[rank])
                    acc.backward(loss)  # divided by gradient_accumulation_steps inside
                    total += loss.detach() / len(micro)
                    if acc.sync_gradients:
                        norms.append(full(acc.clip_grad_norm_(model.parameters(), MAX_NORM)).item())
                    opt.step()  # a no-op until the last microbatch
                    opt.zero_grad()
        if counts is not None:
            counts.append(sum(seen.values()))
            if impl == "shardwise":
                assert all(n == 1 for n in seen.values()), f"reduce-scatters by module: {seen}"
        losses.append(global_mean(total).item())
    return losses, norms


def compare(model: Any, ref: torch.nn.Module, got: tuple, want: tuple) -> dict:
    close(got[0], want[0], "losses")
    close(got[1], want[1], "gradient norms")
    assert max(want[1]) > MAX_NORM, "nothing was clipped"
    same_params(model, ref, "after training")
    return {"loss": got[0], "grad_norm": got[1]}


def run(rank: int, world: int, impl: str, case: str) -> Any:
    if case == "fallback":
        return fallback()
    if case == "accum-control":
        if impl == "shardwise":
            from shardwise.runtime.fsdp_module import FSDPModule
        else:
            from torch.distributed.fsdp import FSDPModule
        with patched(FSDPModule, "set_requires_gradient_sync", lambda self, *a, **k: None):
            expect_failure(
                lambda: run(rank, world, impl, "accum-clip"), "a reduce-scatter per microbatch"
            )
        return None
    micro = 2 if case == "accum-clip" else 1
    acc = accelerator_of(micro, activation_checkpointing=case == "ac")
    model, opt, ref = prepared(acc, impl, tied=case == "tied")
    steps = data(world, micro)
    if case == "ac":
        wrapped = [n for n, _ in model.named_modules() if n.endswith("_checkpoint_wrapped_module")]
        assert len(wrapped) == 2, f"checkpoint wrappers: {wrapped}"
    if case == "save-load":
        first = train(acc, model, opt, steps[:2], rank, world, impl)
        path = os.path.join(_dir["root"], "acc-state")
        acc.save_state(path)
        third = train(acc, model, opt, steps[2:], rank, world, impl)
        after = {n: full(p.detach()).clone() for n, p in model.named_parameters()}
        acc.load_state(path)
        again = train(acc, model, opt, steps[2:], rank, world, impl)
        close(again[0], third[0], "the third step after load_state")
        for n, p in model.named_parameters():
            close(full(p.detach()), after[n], f"{n} after load_state and the third step")
        got = (first[0] + again[0], first[1] + again[1])
        return compare(model, ref, got, reference(ref, steps, world))
    counts: list[int] = []
    got = train(acc, model, opt, steps, rank, world, impl, counts)
    if case == "accum-clip":
        groups = len(groups_of(model, impl))
        assert counts == [groups] * STEPS, (
            f"reduce-scatters per optimizer step {counts}, expected one per module ({groups})"
        )
    history = compare(model, ref, got, reference(ref, steps, world))
    assert acc.is_fsdp2, "accelerate fell back from FSDP2 during the run"
    if case == "state-dict":
        sd = acc.get_state_dict(model)
        if rank == 0:
            want = ref.state_dict()
            assert set(sd) == set(want), set(sd) ^ set(want)
            for k, v in sd.items():
                assert not isinstance(v, torch.distributed.tensor.DTensor), k
                close(v, want[k], f"get_state_dict: {k}")
    return history


def fallback() -> None:
    """What the docs say: with an FSDP2 plugin on CPU, accelerate silently picks DDP."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    assert acc.distributed_type == DistributedType.MULTI_CPU and not acc.is_fsdp2
    model = acc.prepare(llama(False))
    assert type(model).__name__ == "DistributedDataParallel", type(model)
    return None
