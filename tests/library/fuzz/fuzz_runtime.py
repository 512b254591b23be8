"""The differential fuzzer's compositions and one rank's run of one (issue 56, item 6).

A ``Config`` names one composition of the runtime's features; ``generate(seed)`` draws
one. ``run_config(rank, cfg)`` runs it on this rank of a process group of ``cfg.world``
ranks: the model from seed 0 sharded by shardwise, trained ``cfg.steps`` steps on this
rank's slice of each batch, beside the same model unsharded in this process on the
whole batch (the reference; every rank computes it). After every step the losses,
every parameter's gradient (as the full tensor), the clipped norm and every parameter
are compared; the first difference is the result. Where torch's FSDP2 runs the same
composition, ``fsdp2=True`` runs it too, so that a divergence shardwise shares with
FSDP2 is told apart from one only shardwise has.

Tolerances (``Tol``): fp32 without quantization, 1e-4 of the tensor's largest
reference value (summation order alone moves fp32 gradients by about 1e-6 of it). bf16
compute (8 significant bits, about 4e-3 a rounding, a dozen roundings deep here) and
int8 quantized collectives (a block's rounding is 1/254 of its largest value) are held
to 5e-2 of the largest value: every real bug the control injects (a microbatch lost, a
loss divided twice) moves gradients by 30% or more. Since a loose bound would hide a
recomputation that uses other weights than the forward (issue 56's qwZ case), a loose
composition with activation checkpointing is also compared with its own twin without
checkpointing, to 1e-5: a recomputation must reproduce the forward exactly.

The pipeline family (``cfg.family == "pipe"``) is fuzz_pipe.py's.
"""

from __future__ import annotations

import dataclasses
import datetime
import random
import traceback
from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

import shardwise

VOCAB, D, SEQ, ROWS = 11, 8, 5, 2  # ROWS: rows per rank per microbatch
LR, MOMENTUM, MAX_NORM = 0.1, 0.9, 0.3
PG_TIMEOUT = datetime.timedelta(seconds=20)
REFUSALS = (ValueError, TypeError, RuntimeError, NotImplementedError)
AC_MODES = ("none", "around", "parent", "inside", "wrapper", "sub", "selective")
MP_MODES = ("none", "bf16", "bf16-all", "reduce-bf16")
# CommPolicy: "none" or techniques joined by "+" (qwz: quantize_gather="forward",
# qwz-always: "always", hpz: node_local_backward, qgz: quantize_reduce), node size 2.
COMM_MODES = (
    "none",
    "qwz",
    "qwz-always",
    "hpz",
    "qgz",
    "qwz+hpz",
    "qwz+qgz",
    "hpz+qgz",
    "qwz+hpz+qgz",
    "qwz-always+hpz+qgz",
)
# Never drawn: a wrong reference (the fuzzer must see it) and a rank that hangs (the pool
# must recover).
CONTROLS = ("none", "skip-microbatch", "divide-twice", "hang")
WRAPPED = "_checkpoint_wrapped_module."


@dataclass(frozen=True)
class Config:
    """One composition. Defaults are the plainest run; ``shrink`` moves fields back to them."""

    family: str = "fsdp"  # "fsdp" or "pipe" (fuzz_pipe.py)
    world: int = 2
    blocks: int = 2
    ac: str = "none"  # AC_MODES: around / parent (two blocks) / inside / wrapper / sub / selective
    reentrant: bool = False
    raf: bool | int = True  # the blocks' reshard_after_forward
    root_raf: bool | None = None
    mp: str = "none"
    accum: int = 1  # microbatches per step
    no_sync: bool = False  # set_requires_gradient_sync(False) on all but the last
    frozen: bool = False  # the last block's norm frozen before sharding
    tied: bool = False  # head.weight is emb.weight
    unused: bool = False  # a Linear in block 0 that no forward uses
    freeze_mid: str = "none"  # "freeze" / "unfreeze" block 0's fc2.weight after microbatch 0
    tail_group: bool = False  # fully_shard([norm, head]): one group for two modules
    hsdp: bool = False  # a 2 x 2 (replicate, shard) mesh
    comm: str = "none"  # COMM_MODES, node size 2
    opt_in_bwd: bool = False
    offload: bool = False
    clip: str = "none"  # "none" / "shardwise" / "torch"
    prefetch: int = 1
    steps: int = 2
    schedule: str = ""  # pipe family: a torch.distributed.pipelining schedule name
    stages_per_rank: int = 1
    patched: bool = False  # pipe family: torch's fully_shard routed by patch_fsdp2
    control: str = "none"  # CONTROLS: a deliberately wrong reference, to prove detection

    def changed(self) -> dict[str, Any]:
        """The fields that differ from the defaults, in declaration order."""
        base = Config()
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if getattr(self, f.name) != getattr(base, f.name)
        }

    def describe(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.changed().items()) or "plain"

    def to_code(self) -> str:
        """A runnable script (from the repository root) that runs this composition."""
        args = ", ".join(f"{k}={v!r}" for k, v in self.changed().items())
        return (
            "# run from the repository root: python repro.py\n"
            "import sys\n\n"
            'sys.path[:0] = ["tests", "tests/library/fuzz"]\n'
            "from fuzz_pool import run_one  # noqa: E402\n"
            "from fuzz_runtime import Config  # noqa: E402\n\n"
            'if __name__ == "__main__":\n'
            f"    print(run_one(Config({args}), fsdp2=True))\n"
        )

    @property
    def loose(self) -> bool:
        return self.mp != "none" or self.quantized

    @property
    def quantized(self) -> bool:
        return "qwz" in self.comm or "qgz" in self.comm

    def fsdp2_supported(self) -> bool:
        """Whether torch's FSDP2 has every feature drawn (clipping: torch's, on its DTensors)."""
        return self.comm == "none" and not self.opt_in_bwd and self.prefetch == 1


def generate(seed: int) -> Config:
    """A composition drawn from ``seed`` (the same seed, the same composition)."""
    r = random.Random(seed)
    if r.random() < 0.2:
        from fuzz_pipe import generate_pipe

        return generate_pipe(r)
    hsdp = r.random() < 0.2
    comm = r.choice(COMM_MODES) if r.random() < 0.3 else "none"
    world = 4 if hsdp or comm != "none" or r.random() < 0.3 else 2
    shard = 2 if hsdp else world
    accum = r.choice((1, 2, 2, 3))
    ac = r.choice(AC_MODES)
    return Config(
        world=world,
        blocks=r.choice((1, 2, 3)),
        ac=ac,
        reentrant=ac not in ("none", "selective") and r.random() < 0.5,
        raf=r.choice((True, True, False, *[n for n in (1, 2) if shard % n == 0 and n < shard])),
        root_raf=r.choice((None, None, True, False)),
        mp=r.choice(MP_MODES) if r.random() < 0.4 else "none",
        accum=accum,
        no_sync=accum > 1 and r.random() < 0.5,
        frozen=r.random() < 0.3,
        tied=r.random() < 0.4,
        unused=r.random() < 0.3,
        freeze_mid=r.choice(("freeze", "unfreeze")) if accum > 1 and r.random() < 0.3 else "none",
        tail_group=r.random() < 0.2,
        hsdp=hsdp,
        comm=comm,
        opt_in_bwd=r.random() < 0.15,
        offload=r.random() < 0.15,
        clip=r.choice(("shardwise", "torch")) if r.random() < 0.3 else "none",
        prefetch=r.choice((1, 1, 1, 0, 2)),
        steps=r.choice((2, 3)),
    )


# ---- the model ------------------------------------------------------------------------------


class Block(nn.Module):
    """A pre-norm residual MLP; ``inside``: its body runs under checkpoint (in the sharded
    module's own forward); ``unused``: a Linear no forward touches."""

    def __init__(self, unused: bool, inside: bool, reentrant: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)
        self.unused = nn.Linear(D, 1) if unused else None
        self.inside, self.reentrant = inside, reentrant

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inside:
            return checkpoint(self.body, x, use_reentrant=self.reentrant)
        return self.body(x)


def _sac_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Selective checkpointing: keep the matmuls, recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    keep = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


class FuzzNet(nn.Module):
    """Embedding, ``cfg.blocks`` blocks, norm, head; checkpointed as ``cfg.ac`` says when
    ``ac`` is on (the reference runs with it off: torch's checkpoint in one process is
    what is trusted, not assumed)."""

    def __init__(self, cfg: Config, ac: bool) -> None:
        super().__init__()
        mode = cfg.ac if ac else "none"
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(
            Block(cfg.unused and i == 0, mode == "inside", cfg.reentrant) for i in range(cfg.blocks)
        )
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        if cfg.tied:
            self.head.weight = self.emb.weight
        if cfg.frozen:
            for p in self.blocks[-1].norm.parameters():
                p.requires_grad_(False)
        self.mode, self.reentrant = mode, cfg.reentrant
        if mode in ("wrapper", "sub"):
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                CheckpointImpl,
                checkpoint_wrapper,
            )

            impl = CheckpointImpl.REENTRANT if cfg.reentrant else CheckpointImpl.NO_REENTRANT
            for i, block in enumerate(self.blocks):
                if mode == "wrapper":  # torchtitan's: the wrapper is what gets sharded
                    self.blocks[i] = checkpoint_wrapper(block, checkpoint_impl=impl)
                else:  # a sub-part of a sharded module
                    block.fc1 = checkpoint_wrapper(block.fc1, checkpoint_impl=impl)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        blocks = list(self.blocks)
        i = 0
        while i < len(blocks):
            if self.mode == "parent" and i + 1 < len(blocks):  # around two sharded modules
                a, b = blocks[i], blocks[i + 1]
                x = checkpoint(partial(_pair, a, b), x, use_reentrant=self.reentrant)
                i += 2
                continue
            if self.mode == "around" or (self.mode == "parent" and i + 1 == len(blocks)):
                x = checkpoint(blocks[i], x, use_reentrant=self.reentrant)
            elif self.mode == "selective":
                from torch.utils.checkpoint import create_selective_checkpoint_contexts

                ctx = partial(create_selective_checkpoint_contexts, _sac_policy)
                x = checkpoint(blocks[i], x, use_reentrant=False, context_fn=ctx)
            else:
                x = blocks[i](x)
            i += 1
        return self.head(self.norm(x))


def _pair(a: nn.Module, b: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return b(a(h))


def make_model(cfg: Config, ac: bool) -> FuzzNet:
    torch.manual_seed(0)
    return FuzzNet(cfg, ac)


def data(cfg: Config, step: int) -> torch.Tensor:
    """Step ``step``'s batch: ``world * accum * ROWS`` sequences of ``SEQ + 1`` tokens."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (cfg.world * cfg.accum * ROWS, SEQ + 1), generator=g)


def micro(cfg: Config, batch: torch.Tensor, rank: int | None) -> list[torch.Tensor]:
    """Microbatches of ``rank``'s slice; for ``rank=None`` (the reference) microbatch k
    is every rank's k-th microbatch, in rank order."""
    per_rank = [s.chunk(cfg.accum) for s in batch.chunk(cfg.world)]
    if rank is not None:
        return list(per_rank[rank])
    return [torch.cat([pr[k] for pr in per_rank]) for k in range(cfg.accum)]


def loss_of(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), idx[:, 1:].reshape(-1))


def norm_name(name: str) -> str:
    return name.replace(WRAPPED, "")


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu().clone()


# ---- one training run ------------------------------------------------------------------------


@dataclass
class Record:
    """Per step: the microbatch losses, gradients by name (None: no gradient), the
    clipped total norm, the parameters after the step."""

    losses: list[list[float]] = dataclasses.field(default_factory=list)
    grads: list[dict[str, torch.Tensor | None]] = dataclasses.field(default_factory=list)
    norms: list[float | None] = dataclasses.field(default_factory=list)
    params: list[dict[str, torch.Tensor]] = dataclasses.field(default_factory=list)


class Refused(Exception):
    """The composition was refused with a clear error at setup or in its first step."""


def _mesh(cfg: Config) -> DeviceMesh:
    """A fresh mesh over the group (its own groups, with ``PG_TIMEOUT``)."""
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = PG_TIMEOUT
    if cfg.hsdp:
        names = ("replicate", "shard")
        return init_device_mesh(
            "cpu",
            (2, cfg.world // 2),
            mesh_dim_names=names,
            backend_override={0: ("gloo", opts), 1: ("gloo", opts)},
        )
    return init_device_mesh("cpu", (cfg.world,), backend_override={0: ("gloo", opts)})


def _policies(cfg: Config, impl: str) -> dict[str, Any]:
    if impl == "fsdp2":
        from torch.distributed import fsdp as mod
    else:
        mod = shardwise  # type: ignore[assignment]
    kw: dict[str, Any] = {}
    bf = torch.bfloat16
    if cfg.mp != "none":
        param = bf if cfg.mp in ("bf16", "bf16-all") else None
        reduce = torch.float32 if cfg.mp == "bf16" else bf
        kw["mp_policy"] = mod.MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)
    if cfg.offload:
        kw["offload_policy"] = mod.CPUOffloadPolicy(pin_memory=False)
    if impl == "shardwise":
        if cfg.prefetch != 1:
            kw["prefetch"] = cfg.prefetch
        if cfg.comm != "none":
            parts = cfg.comm.split("+")
            gather = "always" if "qwz-always" in parts else "forward" if "qwz" in parts else "none"
            kw["comm_policy"] = shardwise.CommPolicy(
                quantize_gather=gather,
                node_local_backward="hpz" in parts,
                quantize_reduce="qgz" in parts,
                node_size=2,
            )
    return kw


def shard(model: FuzzNet, cfg: Config, impl: str, mesh: DeviceMesh) -> None:
    if impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        fully_shard = shardwise.fully_shard  # type: ignore[assignment]
    kw = {"mesh": mesh, **_policies(cfg, impl)}
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=cfg.raf, **kw)
    if cfg.tail_group and not cfg.tied:
        fully_shard([model.norm, model.head], reshard_after_forward=cfg.raf, **kw)
    fully_shard(model, reshard_after_forward=cfg.root_raf, **kw)


def _clip(cfg: Config, impl: str, params: list[nn.Parameter]) -> float | None:
    if cfg.clip == "none":
        return None
    if cfg.clip == "shardwise" and impl == "shardwise":
        total = shardwise.clip_grad_norm_(params, MAX_NORM)
    else:
        total = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
    return float(full(total))


def train(cfg: Config, impl: str, rank: int | None, ac: bool = True) -> Record:
    """``cfg.steps`` steps of ``impl`` ("shardwise", "fsdp2" or "reference": one process,
    the whole batch); raises ``Refused`` for a clear refusal at setup or in step 0."""
    model = make_model(cfg, ac=ac and impl != "reference")
    opt_kw = {"lr": LR, "momentum": MOMENTUM}
    step = -1
    try:
        if impl != "reference":
            shard(model, cfg, impl, _mesh(cfg))
        opt = torch.optim.SGD(model.parameters(), **opt_kw)  # type: ignore[arg-type]
        in_bwd = cfg.opt_in_bwd and impl == "shardwise"
        if in_bwd:
            shardwise.optimizer_in_backward(model, opt)
        rec = Record()
        target = model.blocks[0].fc2.weight if cfg.freeze_mid != "none" else None
        for step in range(cfg.steps):
            if target is not None:
                target.requires_grad_(cfg.freeze_mid == "freeze")
            mbs = micro(cfg, data(cfg, step), rank)
            losses = []
            for k, mb in enumerate(mbs):
                last = k == len(mbs) - 1
                if impl != "reference" and cfg.no_sync:
                    model.set_requires_gradient_sync(last)  # type: ignore[operator]
                elif in_bwd and cfg.accum > 1:
                    model.set_is_last_backward(last)  # type: ignore[operator]
                loss = loss_of(model, mb)
                div = cfg.accum * (
                    cfg.accum if impl == "reference" and cfg.control == "divide-twice" else 1
                )
                skip = (
                    impl == "reference" and cfg.control == "skip-microbatch" and last and step == 0
                )
                if not skip:
                    (loss / div).backward()
                losses.append(_mean(loss, impl))
                if target is not None and k == 0:
                    target.requires_grad_(cfg.freeze_mid != "freeze")
            rec.losses.append(losses)
            rec.grads.append(
                {
                    norm_name(n): None if p.grad is None else full(p.grad)
                    for n, p in model.named_parameters()
                }
            )
            rec.norms.append(_clip(cfg, impl, list(model.parameters())))
            opt.step()
            opt.zero_grad()
            rec.params.append({norm_name(n): full(p) for n, p in model.named_parameters()})
        return rec
    except REFUSALS as e:
        if step <= 0 and _raised_by_shardwise(e):
            raise Refused(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
        raise


def _mean(loss: torch.Tensor, impl: str) -> float:
    if impl == "reference":
        return float(loss)
    t = loss.detach().float().clone()
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _raised_by_shardwise(e: BaseException) -> bool:
    """Whether the innermost frame that raised is the library's own (a deliberate error,
    not one of torch's from deep inside a wrong run)."""
    frames = traceback.extract_tb(e.__traceback__)
    return bool(frames) and "/shardwise/" in frames[-1].filename.replace("\\", "/")


# ---- comparison ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tol:
    rtol: float
    atol: float = 1e-7
    # Relative to the largest value of the step's gradients (or parameters) rather than
    # the tensor's own: a quantization block spans a whole group's flat shard, so its
    # rounding is set by the group's largest value, not by this tensor's.
    per_step: bool = False


EXACT, LOOSE, TWIN = Tol(1e-4), Tol(5e-2, 1e-5), Tol(1e-5)
# A twin whose gradients pass through bf16 or int8 may differ by a rounding step where
# the two backwards summed the same fp32 terms in another order: one bf16 ulp is 2**-7
# of a value (the qwZ-recompute bug moves gradients by several times that).
TWIN_ROUNDED = Tol(2e-2, 1e-6)
# Two int8 roundings (the weights gathered, the gradients reduced), each up to 1/254 of
# its block's largest value, through bf16 compute: measured up to 5.0% of the step's
# largest gradient (qwz+qgz, bf16); a lost microbatch moves it by 30% or more.
QUANT = Tol(1e-1, 1e-5, per_step=True)


def _diff(a: torch.Tensor, b: torch.Tensor, tol: Tol, scale: float = 0.0) -> float | None:
    """The largest absolute difference if it is over ``tol`` (relative to b's largest
    value, or ``scale`` where larger)."""
    if a.shape != b.shape:
        return float("inf")
    d = (a - b).abs().max().item() if a.numel() else 0.0
    top = max(scale, b.abs().max().item() if b.numel() else 0.0)
    return d if not d <= tol.atol + tol.rtol * top else None  # NaN counts as over


def _scale(tensors: dict[str, torch.Tensor | None], tol: Tol) -> float:
    if not tol.per_step:
        return 0.0
    return max(
        (t.abs().max().item() for t in tensors.values() if t is not None and t.numel()), default=0.0
    )


def compare(got: Record, want: Record, tol: Tol) -> str | None:
    """The first difference, in the order losses, gradients, norm, parameters per step."""
    for step in range(len(want.params)):
        if len(got.losses[step]) != len(want.losses[step]):
            return f"step {step}: {len(got.losses[step])} losses, the reference {len(want.losses[step])}"
        for k, (a, b) in enumerate(zip(got.losses[step], want.losses[step])):
            d = _diff(torch.tensor(a), torch.tensor(b), tol)
            if d is not None:
                return f"step {step}: loss of microbatch {k}: {a:.6g} vs {b:.6g} (diff {d:.3g})"
        gscale = _scale(want.grads[step], tol)
        pscale = _scale(dict(want.params[step]), tol)
        for name, b in want.grads[step].items():
            a = got.grads[step].get(name)
            if (a is None) != (b is None):
                has = "has no gradient" if a is None else "has a gradient the reference lacks"
                return f"step {step}: grad of {name}: {has}"
            if a is not None and b is not None and (d := _diff(a, b, tol, gscale)) is not None:
                top = max(gscale, b.abs().max().item() if b.numel() else 0.0)
                return (
                    f"step {step}: grad of {name}: max abs diff {d:.3g} (largest value {top:.3g})"
                )
        na, nb = got.norms[step], want.norms[step]
        if na is not None and nb is not None and _diff(torch.tensor(na), torch.tensor(nb), tol):
            return f"step {step}: clipped total norm {na:.6g} vs {nb:.6g}"
        for name, b in want.params[step].items():
            a = got.params[step][name]
            if (d := _diff(a, b, tol, pscale)) is not None:
                return f"step {step}: parameter {name} after the step: max abs diff {d:.3g}"
    return None


def _in_bwd_view(rec: Record) -> Record:
    """Optimizer-in-backward leaves no gradients to compare: parameters and losses only."""
    return Record(rec.losses, [{} for _ in rec.grads], [None] * len(rec.norms), rec.params)


def outcome(
    cfg: Config, rank: int, impl: str, want: Record, twin: Callable[[], Record] | None
) -> tuple[str, str]:
    """(status, detail) of one implementation's run against the reference: "ok",
    "refused", "diverged" or "crashed"."""
    try:
        got = train(cfg, impl, rank)
    except Refused as e:
        return "refused", str(e)
    except Exception:  # noqa: BLE001 - a crash is a finding, reported with its traceback
        return "crashed", traceback.format_exc(limit=-8)
    if cfg.opt_in_bwd and impl == "shardwise":
        want = _in_bwd_view(want)
    found = compare(got, want, QUANT if cfg.quantized else LOOSE if cfg.loose else EXACT)
    if found is None and twin is not None:
        found = compare(
            got, twin(), TWIN_ROUNDED if cfg.mp != "none" or "qgz" in cfg.comm else TWIN
        )
        found = found and f"against the same run without checkpointing: {found}"
    return ("diverged", found) if found else ("ok", "")


def run_config(rank: int, cfg: Config, fsdp2: str = "on-divergence") -> dict[str, Any]:
    """This rank's result of ``cfg`` (the process group is ``cfg.world`` ranks).
    ``fsdp2``: "never", "on-divergence" (to classify a divergence or crash), "always"."""
    if cfg.control == "hang" and rank == 0:
        import time

        time.sleep(3600)  # the pool's deadline must end this
    if cfg.family == "pipe":
        from fuzz_pipe import run_pipe

        return run_pipe(rank, cfg, fsdp2)
    want = train(cfg, "reference", None)
    twin = None
    if cfg.loose and cfg.ac != "none":
        twin = partial(train, cfg, "shardwise", rank, False)
    status, detail = outcome(cfg, rank, "shardwise", want, twin)
    out = {"status": status, "detail": detail, "fsdp2": "n/a", "fsdp2_detail": ""}
    if cfg.fsdp2_supported() and (
        fsdp2 == "always" or (fsdp2 == "on-divergence" and status in ("diverged", "crashed"))
    ):
        out["fsdp2"], out["fsdp2_detail"] = outcome(cfg, rank, "fsdp2", want, None)
    return out
