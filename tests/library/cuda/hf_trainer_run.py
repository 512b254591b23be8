"""HF ``Trainer`` with its FSDP2 path on a small random Llama: one run, losses to JSON.

Run under torchrun (one process per GPU) by tests/library/cuda/test_cuda_frameworks.py:

    torchrun --nproc-per-node 1 tests/library/cuda/hf_trainer_run.py --impl shardwise --out losses.json

``--impl fsdp2`` is torch's FSDP2 through the same Trainer arguments,
``--impl none`` the same Trainer without FSDP (one process, the reference).
With ``shardwise``, ``shardwise.patch_fsdp2()`` runs before transformers is
imported, and the run checks that the decoder layers are shardwise's.
"""

from __future__ import annotations

import argparse
import json
import os


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["shardwise", "fsdp2", "none"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    if args.impl == "shardwise":
        import shardwise

        shardwise.patch_fsdp2()  # before transformers and accelerate are imported

    import torch
    import transformers as tf

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    tf.set_seed(0)
    config = tf.LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    model = tf.LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, config.vocab_size, (64, 32), generator=g)
    data = [{"input_ids": r, "labels": r.clone()} for r in rows]

    seen: dict[str, object] = {}

    class Inspect(tf.TrainerCallback):
        def on_step_begin(self, targs, state, control, model=None, **kw):  # type: ignore[no-untyped-def]
            if "layers" in seen or model is None:
                return
            from torch.distributed.fsdp import FSDPModule

            layers = [m for m in model.modules() if type(m).__name__.endswith("LlamaDecoderLayer")]
            seen["layers"] = len(layers)
            seen["torch_fsdpmodule"] = sum(isinstance(m, FSDPModule) for m in layers)
            seen["shardwise"] = sum(hasattr(m, "_shardwise_state") for m in layers)

    fsdp = (
        {}
        if args.impl == "none"
        else {
            "fsdp": "full_shard",
            "fsdp_config": {
                "fsdp_version": 2,
                "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                "reshard_after_forward": True,
            },
        }
    )
    targs = tf.TrainingArguments(
        output_dir=os.path.join(os.path.dirname(os.path.abspath(args.out)), f"trainer-{args.impl}"),
        per_device_train_batch_size=8,
        max_steps=args.steps,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        **fsdp,
    )
    trainer = tf.Trainer(model=model, args=targs, train_dataset=data, callbacks=[Inspect()])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    if int(os.environ.get("RANK", "0")) == 0:
        with open(args.out, "w") as f:
            json.dump({"impl": args.impl, "losses": losses, "grad_norms": norms, **seen}, f)


if __name__ == "__main__":
    main()
