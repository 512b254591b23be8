"""``shardwise plan --measure``: the predicted configuration run for real, side by side.

The run itself is the planner's (``shardwise_plan.measure``: the same model,
policy and optimizer on real ranks here, the peak from the allocator, the
step time from launches that never profile); here it is asked for and the
two are printed together.
"""

from __future__ import annotations

from typing import Any


def measured_run(args: Any, predicted: Any, seq: int) -> Any:
    """The run that measures ``predicted``'s configuration (``shardwise_plan.measure.Run``)
    at ``--world-size`` ranks here: the flags' model, batch and mesh, the plan's policy."""
    from shardwise_plan.measure import Run

    return Run(
        build="shardwise_app.cli.plan:build_model",
        build_args=(args.model, seq),
        world_size=args.world_size,
        batch_size=args.batch_size,
        seq_len=seq,
        policy=predicted.policy,
        hsdp=args.hsdp,
        optimizer=predicted.optimizer,
    )


def measure_and_compare(args: Any, predicted: Any, seq: int) -> dict[str, Any]:
    """Run ``predicted``'s configuration at ``--world-size`` ranks here, print predicted
    vs measured, return the measured figures."""
    from shardwise_plan.measure import RunFailed, measure

    run = measured_run(args, predicted, seq)
    try:
        measured = measure(run, args.launches)
    except RunFailed as e:
        raise SystemExit(f"shardwise plan: --measure: {e}") from None
    print_comparison(predicted, measured)
    return measured


def error_pct(pred: float, meas: float) -> float:
    return 100.0 * (pred - meas) / meas if meas else float("nan")


def print_comparison(p: Any, m: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"predicted vs measured ({m['device']}, {m['world_size']} ranks)")
    for c in ("", "predicted", "measured", "error"):
        t.add_column(c, justify="right")
    peak = m["peak_bytes"][0]
    t.add_row(
        "peak MiB (rank 0)",
        f"{p.peak_bytes / 2**20:.2f}",
        f"{peak / 2**20:.2f}",
        f"{error_pct(p.peak_bytes, peak):+.1f}%",
    )
    if p.peak_is_a_range:  # gloo: the ranks' timing, between
        for label, end in (("in step", p.peak_bytes_in_step), ("drifting", p.peak_bytes_drifting)):
            t.add_row(
                f"peak MiB, ranks {label}",
                f"{end / 2**20:.2f}",
                f"{peak / 2**20:.2f}",
                f"{error_pct(end, peak):+.1f}%",
            )
    indicative = " (indicative)" if p.hardware.device == "cpu" else ""
    t.add_row(
        f"step ms{indicative}",
        f"{p.step_ms:.1f}",
        f"{m['step_ms']:.1f}",
        f"{error_pct(p.step_ms, m['step_ms']):+.1f}%",
    )
    Console().print(t)
