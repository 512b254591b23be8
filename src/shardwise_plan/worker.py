"""One rank started by ranks.py: ``python -m shardwise_plan.worker MODE ARGS``.

    measure RUN_JSON peak|time|both OUT   a measured run's rank (measure.py)
    calibrate OUT                          a calibrating rank (calibrate.py)

Internal: the ``shardwise plan --measure`` and ``shardwise calibrate`` commands
start these; nobody types them. Each joins the process group (NCCL with a GPU
per rank if there are GPUs, else gloo), does its part, leaves the group and
ends with ``os._exit``: interpreter finalization races gloo's worker threads
(a thread still releasing a finished collective's tensors needs the GIL, and
ends in ``std::terminate`` once finalization has begun).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any


def _join() -> Any:
    import torch
    import torch.distributed as dist

    from .ranks import usable_cpus

    local_rank = int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    torch.set_num_threads(max(1, usable_cpus() // local_world))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def _calibrate(out: Path, device: Any) -> None:
    import torch.distributed as dist

    from .calibrate import calibrate

    dist.barrier()  # every rank measures at the same time
    hw = calibrate(str(device))
    dist.barrier()
    if dist.get_rank() == 0:
        source = f"{hw.source}, {dist.get_world_size()} ranks at once"
        out.write_text(json.dumps(dataclasses.asdict(dataclasses.replace(hw, source=source))))


def main(argv: list[str]) -> int:
    import torch.distributed as dist

    from .measure import Run, run_rank

    mode, *rest = argv
    device = _join()
    if mode == "measure":
        spec, timing, out = rest
        run_rank(Run.from_dict(json.loads(Path(spec).read_text())), timing, Path(out), device)
    elif mode == "calibrate":
        _calibrate(Path(rest[0]), device)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    try:
        code: int | str | None = main(sys.argv[1:])
    except SystemExit as e:
        code = e.code
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if not isinstance(code, int):
        if code is not None:
            print(code, file=sys.stderr, flush=True)
        code = 1 if code is not None else 0
    os._exit(code)
