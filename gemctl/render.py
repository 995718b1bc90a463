"""Rendering with rich: tables for results, one paragraph per error, JSON for scripts.

Every string that came from the user or the store (paths, run names, recipe values, error
texts) goes through :func:`esc` before rich sees it, so it is shown as written and never read
as markup; credentials in any URI are masked on the way.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any, TextIO

from rich.console import Console
from rich.table import Table

from gem_platform.markup import escape_text
from gem_platform.net import redact

console = Console()
err_console = Console(stderr=True)
# Where machine-readable results go; gemctl.quiet points it at the terminal while library
# output is routed to a log file.
result_stream: TextIO | None = None


def esc(value: Any) -> str:
    """``value`` as text safe inside rich markup: credentials masked, brackets escaped."""
    return escape_text(redact(str(value)))


def fmt(value: Any) -> str:
    """A metric for a table cell: 4 decimals, thousands separators from 1000, '-' for NaN."""
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.4f}"
    return esc(value)


def error(problem: str, fix: str | None = None) -> None:
    """One paragraph on stderr: ``error: PROBLEM FIX``; both are shown literally."""
    text = f"[bold red]error:[/] {esc(problem)}"
    if fix:
        text += f" {esc(fix)}"
    err_console.print(text, highlight=False, soft_wrap=True)


def wide(target: Console | None = None) -> Console:
    """``target`` (default the stdout console) in a terminal; a 160-column console writing to
    the same stream elsewhere, where rich would fold every table cell to 80 columns."""
    target = target or console
    if target.is_terminal:
        return target
    return Console(file=target.file, width=160)


def progress_console(as_json: bool) -> Console:
    """Where progress goes: stderr when stdout carries a JSON result, else stdout."""
    return err_console if as_json else console


def print_json(obj: Any) -> None:
    """A machine-readable result on stdout (credentials masked), one JSON document."""
    stream = result_stream or sys.stdout
    stream.write(redact(json.dumps(obj, indent=2, default=str)) + "\n")
    stream.flush()


def epochs_by_arm(epochs: dict[str, float]) -> str:
    """Arms with the epochs they train(ed), escaped for markup: "full 2.0, block64 2.0"."""
    return esc(", ".join(f"{arm} {n:.1f}" for arm, n in epochs.items()))


def epochs_warning(plan, in_process: bool) -> str | None:
    """A warning before any trial of a sweep (``gemctl sweep``, ``gemctl validate``) when arms
    train past one epoch: their held-out NE then measures memorization as much as the ablated
    choice, so a gate can pass or fail on it. A trial in this process trains on one rank; on
    Ray, on parallel.workers."""
    past = plan.past_one_epoch(1 if in_process else None)
    if not past:
        return None
    return (f"warning: arms past one epoch of their training split (epochs: "
            f"{epochs_by_arm(past)}; train.steps x loader.local_batch_size x "
            + ("one rank here" if in_process else "parallel.workers")
            + " over the generated training samples). Recommendation models often memorize "
            "from their second epoch, and the gate would compare memorized arms. Lower "
            "train.steps or the global batch, or generate more samples "
            "(data.synthetic.num_samples).")


def duration(seconds: float) -> str:
    """``1:02:03`` / ``2:03`` style wall time."""
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


CURVE_ROWS = 12  # learning-curve rows shown; longer curves are thinned evenly (last kept)


def _quality_table(summary: dict[str, Any]) -> Table:
    """Held-out NE, AUC, calibration per task beside the planted ceiling, the share of its
    AUC lift reached and the linear reference, the train NE of the last steps and the time to
    the recipe's target."""
    nan = float("nan")
    table = Table(title="quality (held-out)", title_justify="left")
    table.add_column("metric")
    table.add_column("ctr", justify="right")
    table.add_column("cvr", justify="right")
    for name in ("ne", "auc", "logloss", "base_rate", "calibration"):
        table.add_row(f"eval {name}", fmt(summary.get(f"eval/{name}_ctr", nan)),
                      fmt(summary.get(f"eval/{name}_cvr", nan)))
    if "train/ne_ctr_since_eval" in summary:
        table.add_row("train ne (since the last eval)", fmt(summary["train/ne_ctr_since_eval"]),
                      "-")
    if "planted/auc_ctr" in summary:
        table.add_row("planted auc (ceiling)", fmt(summary["planted/auc_ctr"]),
                      fmt(summary.get("planted/auc_cvr", nan)))
    for name in ("ne", "auc") if "reference/linear/ne_ctr" in summary else ():
        table.add_row(f"linear reference {name}", fmt(summary[f"reference/linear/{name}_ctr"]),
                      fmt(summary.get(f"reference/linear/{name}_cvr", nan)))
    if "eval/auc_lift_share_ctr" in summary:
        table.add_row("share of the ceiling's auc lift",
                      fmt(summary["eval/auc_lift_share_ctr"]),
                      fmt(summary.get("eval/auc_lift_share_cvr", nan)))
    if "quality/target_ne" in summary:
        table.add_row(f"time to ne <= {fmt(summary['quality/target_ne'])}", _to_target(summary),
                      "-")
    return table


def _to_target(summary: dict[str, Any]) -> str:
    if not summary.get("quality/reached_target"):
        return "not reached"
    seconds = summary.get("quality/train_s_to_target", float("nan"))
    samples = summary.get("quality/samples_to_target", float("nan"))
    if not all(isinstance(v, float | int) and math.isfinite(v) for v in (seconds, samples)):
        return "-"
    return f"{duration(seconds)} training, {samples:,.0f} samples"


def _curve_table(summary: dict[str, Any]) -> Table | None:
    """The held-out learning curve (summary quality/eval_curve): train beside held-out NE."""
    curve = summary.get("quality/eval_curve")
    if not isinstance(curve, list) or not curve:
        return None
    step = max(1, math.ceil(len(curve) / CURVE_ROWS))
    shown = curve[::step] if (len(curve) - 1) % step == 0 else [*curve[::step], curve[-1]]
    table = Table(title="learning curve (training time excludes evaluation)",
                  title_justify="left")
    columns = [("step", "step"), ("samples", "samples"), ("training time", "train_s"),
               ("train ne ctr", "train_ne_ctr"), ("held-out ne ctr", "ne_ctr"),
               ("auc ctr", "auc_ctr"), ("held-out ne cvr", "ne_cvr")]
    for label, _ in columns:
        table.add_column(label, justify="right")
    for point in shown:
        if not isinstance(point, dict):
            continue
        cells = []
        for _, key in columns:
            value = point.get(key, float("nan"))
            finite = isinstance(value, float | int) and math.isfinite(value)
            if key == "train_s" and finite:
                cells.append(duration(value))
            elif key in ("step", "samples") and finite:
                cells.append(f"{value:,.0f}")
            else:
                cells.append(fmt(value))
        table.add_row(*cells)
    return table


def _warnings_table(summary: dict[str, Any]) -> Table | None:
    """The learning warnings of the finished run (summary quality/warnings)."""
    warnings = summary.get("quality/warnings")
    if not isinstance(warnings, list) or not warnings:
        return None
    table = Table(title="learning warnings", title_justify="left", show_header=False)
    table.add_column("warning", overflow="fold")
    for message in warnings:
        table.add_row(esc(message))
    return table


def summary_tables(run_id: str, summary: dict[str, Any], tracking_uri: str,
                   wall_s: float | None = None) -> list[Table]:
    """NE and AUC per task with the planted ceiling and the linear reference, the learning
    curve and its warnings; then throughput, MFU, balance, wall time and where the run is
    recorded."""
    tables = [_quality_table(summary)]
    tables += [t for t in (_curve_table(summary), _warnings_table(summary)) if t is not None]
    perf = Table(show_header=True)
    perf.add_column("efficiency")
    perf.add_column("value", justify="right")
    rows = [
        ("QPS (samples/s)", "perf/qps"),
        ("MFU E2E", "perf/mfu_e2e"),
        ("MFU local", "perf/mfu_local"),
        ("scaling ratio", "perf/scaling_ratio"),
        ("peak TFLOP/s", "perf/peak_tflops"),
        ("peak memory (GB)", "perf/peak_memory_gb"),
        ("padding waste (mean)", "balance/padding_waste_mean"),
        ("straggler overhead (mean)", "balance/straggler_overhead_mean"),
    ]
    for label, key in rows:
        if key in summary:
            perf.add_row(label, fmt(summary[key]))
    if "perf/world_size" in summary:
        perf.add_row("workers", str(int(summary["perf/world_size"])))
    if "peak_source" in summary:
        perf.add_row("peak source", esc(summary["peak_source"]))
    if wall_s is not None:
        perf.add_row("wall time", duration(wall_s))
    perf.add_row("MLflow run", esc(run_id))
    perf.add_row("MLflow store", esc(tracking_uri))
    return [*tables, perf]
