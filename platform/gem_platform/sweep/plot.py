"""Two PNGs of a comparison, for tracked sweeps and results files alike:

- NE vs step per arm: the mean over seeds with a band from the lowest to the highest seed, so
  a gap between arms can be told from seed spread, and a constant offset from a slower start
  or a divergence;
- each arm's delta to the baseline per quality metric, with its 95% interval and the gate's
  limit, so the verdict can be seen.

Tracked runs keep their step histories in MLflow; in-process sweeps write them into the
results file (older files have none: the step chart then says so).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from gem_platform.sweep.compare import Comparison
from gem_platform.sweep.gates import DEFAULT_TASKS, Gates
from gem_platform.sweep.results import is_results_file, load_results

CURVES = (("train/ne_ctr", "train NE (ctr)"), ("eval/ne_ctr", "eval NE (ctr)"))
Points = list[tuple[int, float]]


def histories(uri: str, cmp: Comparison, ids: list[str]) -> dict[str, dict[str, Points]]:
    """run id -> metric -> [(step, value)] for every compared run and curve metric."""
    from_files: dict[str, dict[str, Points]] = {}
    for ident in filter(is_results_file, ids):
        for t in load_results(ident)[0]:
            from_files[t.run_id] = t.history or {}
    out: dict[str, dict[str, Points]] = {}
    tracked = [r for a in cmp.arms for r in a.run_ids if r not in from_files]
    c = None
    if tracked and uri:
        from gem_platform.sweep import store

        c = store.client(uri)
    for arm in cmp.arms:
        for run_id in arm.run_ids:
            if run_id in from_files:
                out[run_id] = from_files[run_id]
            elif c is not None:
                out[run_id] = {m: [(int(p.step), float(p.value))
                                   for p in c.get_metric_history(run_id, m)]
                               for m, _ in CURVES}
    return out


def _band(runs: list[Points]) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps every run logged, with the mean, lowest and highest value over runs there."""
    per_run = [dict(r) for r in runs if r]
    if not per_run:
        return [], [], [], []
    steps = sorted(set.intersection(*(set(r) for r in per_run)))
    vals = [[r[s] for r in per_run] for s in steps]
    return (steps, [sum(v) / len(v) for v in vals], [min(v) for v in vals],
            [max(v) for v in vals])


def _label(text: str) -> str:
    """``text`` as matplotlib shows it literally: a '$' would start mathtext (and a lone one
    fails to parse)."""
    return text.replace("$", r"\$")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_ne_vs_step(cmp: Comparison, runs: dict[str, dict[str, Points]], path: str | Path
                    ) -> Path:
    """Write the NE-vs-step PNG (one panel per curve with more than one step) to ``path``."""
    plt = _pyplot()
    bands = {m: {a.arm: _band([runs.get(r, {}).get(m, []) for r in a.run_ids])
                 for a in cmp.arms} for m, _ in CURVES}
    panels = [(m, label) for m, label in CURVES
              if any(len(b[0]) > 1 for b in bands[m].values())] or [CURVES[0]]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (metric, label) in zip(axes[0], panels, strict=True):
        drawn = False
        for arm in cmp.arms:
            steps, mean, low, high = bands[metric][arm.arm]
            if not steps:
                continue
            base = arm.arm == cmp.baseline
            line, = ax.plot(steps, mean, "-" if base else "--", marker="o", markersize=3,
                            label=f"{_label(arm.arm)} (n={len(arm.run_ids)})"
                                  f"{' baseline' if base else ''}")
            if len(arm.run_ids) > 1:
                ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.2,
                                linewidth=0)
            drawn = True
        if not drawn:
            ax.text(0.5, 0.5, "no step history recorded for these runs",
                    ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=8)
    fig.suptitle(f"NE vs step per arm, mean and seed range "
                 f"({_label(', '.join(cmp.sweep_ids)) or 'selected runs'})", fontsize=10)
    return _save(fig, path)


def plot_deltas(cmp: Comparison, path: str | Path, gates: Gates | None = None) -> Path:
    """Write the chart of each arm's delta to the baseline (NE in %, AUC absolute, one panel
    per metric) with its 95% interval and, where set, the gate's limit."""
    plt = _pyplot()
    tasks = cmp.tasks or DEFAULT_TASKS  # no task recorded anywhere: empty panels, no crash
    metrics = [(f"eval/ne_{t}", f"Δ NE {_label(t)} (% of baseline)") for t in tasks]
    metrics += [(f"eval/auc_{t}", f"Δ AUC {_label(t)}") for t in tasks]
    arms = [a for a in cmp.arms if a.arm != cmp.baseline]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 1.2 + 0.5 * len(arms)),
                             squeeze=False)
    for ax, (metric, label) in zip(axes[0], metrics, strict=True):
        for y, arm in enumerate(arms):
            d = arm.deltas.get(metric)
            if d is None or math.isnan(d.value):
                continue
            if math.isnan(d.low):
                ax.plot([d.value], [y], "x", color="gray")  # one seed: no interval
            else:
                ax.errorbar([d.value], [y], xerr=[[d.value - d.low], [d.high - d.value]],
                            fmt="o", capsize=3)
        ax.axvline(0, color="black", linewidth=0.8)
        limit = None
        if gates is not None:
            limit = (gates.max_ne_regression_pct if metric.startswith("eval/ne_")
                     else -gates.max_auc_drop if gates.max_auc_drop is not None else None)
        if limit is not None:
            ax.axvline(limit, color="red", linestyle=":", label="gate")
            ax.legend(fontsize=8)
        ax.set_yticks(range(len(arms)), [_label(a.arm) for a in arms])
        ax.set_ylim(-0.5, max(len(arms) - 0.5, 0.5))
        ax.set_xlabel(label)
        ax.grid(alpha=0.3, axis="x")
    fig.suptitle(f"Δ vs baseline '{_label(cmp.baseline)}' with 95% intervals (x: one seed, no "
                 "interval)", fontsize=10)
    return _save(fig, path)


def _save(fig: Any, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_comparison(uri: str, cmp: Comparison, ids: list[str], path: str | Path,
                    gates: Gates | None = None) -> list[Path]:
    """Both charts: NE vs step at ``path``, the deltas beside it (``<stem>-deltas.png``)."""
    path = Path(path)
    runs = histories(uri, cmp, ids)
    return [plot_ne_vs_step(cmp, runs, path),
            plot_deltas(cmp, path.with_name(f"{path.stem}-deltas{path.suffix or '.png'}"),
                        gates)]


def log_plot(uri: str, parent_run_ids: list[str], path: Path) -> None:
    """Attach a chart to each compared sweep's parent run (artifact folder 'compare')."""
    from gem_platform.sweep import store

    c = store.client(uri)
    for run_id in parent_run_ids:
        c.log_artifact(run_id, str(path), artifact_path="compare")
