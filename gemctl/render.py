"""Rendering of results and errors with rich: tables for summaries, one paragraph per error."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.table import Table

console = Console()
err_console = Console(stderr=True)


def fmt(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.4f}"
    return str(value)


def error(problem: str, fix: str | None = None) -> None:
    text = f"[bold red]error:[/] {problem}"
    if fix:
        text += f" {fix}"
    err_console.print(text, highlight=False, soft_wrap=True)


def summary_tables(run_id: str, summary: dict[str, Any], tracking_uri: str) -> list[Table]:
    """NE and AUC per task with the planted ceiling; then throughput, MFU and balance."""
    table = Table(title="quality (held-out)", title_justify="left")
    table.add_column("metric")
    table.add_column("ctr", justify="right")
    table.add_column("cvr", justify="right")
    for name in ("ne", "auc", "logloss", "base_rate"):
        table.add_row(f"eval {name}", fmt(summary.get(f"eval/{name}_ctr", float("nan"))),
                      fmt(summary.get(f"eval/{name}_cvr", float("nan"))))
    if "planted/auc_ctr" in summary:
        table.add_row("planted auc (ceiling)", fmt(summary["planted/auc_ctr"]),
                      fmt(summary.get("planted/auc_cvr", float("nan"))))
    perf = Table(show_header=True)
    perf.add_column("efficiency")
    perf.add_column("value", justify="right")
    rows = [
        ("QPS (samples/s)", "perf/qps"),
        ("MFU E2E", "perf/mfu_e2e"),
        ("MFU local", "perf/mfu_local"),
        ("scaling ratio", "perf/scaling_ratio"),
        ("peak TFLOP/s", "perf/peak_tflops"),
        ("padding waste (mean)", "balance/padding_waste_mean"),
        ("straggler overhead (mean)", "balance/straggler_overhead_mean"),
    ]
    for label, key in rows:
        if key in summary:
            perf.add_row(label, fmt(summary[key]))
    if "perf/world_size" in summary:
        perf.add_row("workers", str(int(summary["perf/world_size"])))
    if "peak_source" in summary:
        perf.add_row("peak source", str(summary["peak_source"]))
    perf.add_row("MLflow run", run_id)
    perf.add_row("MLflow store", tracking_uri)
    return [table, perf]
