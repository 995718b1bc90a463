"""Rendering of `gemctl data reference`: the linear reference's held-out scores per task
beside the dataset's planted ceiling, as a table or one JSON document."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from gemctl import render


def reference_json(data_path: str, outcome: Any, planted: dict[str, float] | None
                   ) -> dict[str, Any]:
    """What --json prints: the reference record plus where it came from."""
    ref = outcome.reference
    return {"data_path": data_path, "cached": outcome.cached, "cache_file": outcome.cache_file,
            "version": ref.version, "dataset_digest": ref.dataset_digest, "tasks": ref.tasks,
            "metrics": ref.metrics(), "planted_auc": planted, "train_samples":
            ref.train_samples, "num_features": ref.num_features, "fit_s": ref.fit_s,
            "config": ref.config}


def reference_table(outcome: Any, planted: dict[str, float] | None) -> Table:
    """One row per task: NE, AUC, calibration, base rate, eval samples (and the planted AUC
    on synthetic data)."""
    ref = outcome.reference
    table = Table(title="linear reference (held-out)", title_justify="left")
    for name in ("task", "NE", "AUC", "calibration", "base rate", "eval samples"):
        table.add_column(name, justify="left" if name == "task" else "right")
    if planted:
        table.add_column("planted AUC", justify="right")
    for task, scores in ref.tasks.items():
        row = [task, render.fmt(scores["ne"]), render.fmt(scores["auc"]),
               render.fmt(scores["calibration"]), render.fmt(scores["base_rate"]),
               f"{int(scores['count']):,}"]
        if planted:
            row.append(render.fmt(float(planted.get(task, float("nan")))))
        table.add_row(*row)
    return table


def reference_origin(data_path: str, outcome: Any) -> str:
    """Where the figures came from: the cache, or a training just now (and where it is
    cached)."""
    ref = outcome.reference
    epochs = int(ref.config.get("epochs", 1)) or 1
    how = ("read from the cache" if outcome.cached else
           f"trained in {render.duration(ref.fit_s)} ({epochs} epoch{'s' * (epochs > 1)} of "
           f"{ref.train_samples // epochs:,} samples)")
    where = (f"; cached in {render.esc(outcome.cache_file)}" if outcome.cache_file
             else "; not cached (not a local dataset directory the platform wrote)")
    return f"{render.esc(data_path)}: {how}{where}"
