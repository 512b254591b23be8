"""Which runtime files one training step visits, and how often its calls cross between them.

    python benchmarks/step_files.py

One process (gloo, world 1), a root and two sharded Linears in bf16 (so the
gather is a cast, not an alias); one warm step, then one step profiled with
``sys.setprofile``: every Python call into a file of ``src/shardwise``.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import shardwise


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29611")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    bf16 = shardwise.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    for layer in model:
        shardwise.fully_shard(layer, mp_policy=bf16)
    shardwise.fully_shard(model, mp_policy=bf16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    model(x).sum().backward()  # warm: the orders are recorded
    opt.step()
    opt.zero_grad()

    root = os.path.dirname(shardwise.__file__)
    seen: list[str] = []
    crossings = 0
    last = None

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        nonlocal crossings, last
        if event != "call" or not frame.f_code.co_filename.startswith(root):
            return
        name = os.path.basename(frame.f_code.co_filename)
        if name != last:
            crossings, last = crossings + 1, name
        if name not in seen:
            seen.append(name)

    sys.setprofile(profile)
    model(x).sum().backward()
    sys.setprofile(None)
    print(f"{len(seen)} files: {', '.join(seen)}; {crossings} crossings between them")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
