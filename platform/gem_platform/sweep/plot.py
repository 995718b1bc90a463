"""NE vs step per arm (mean over seeds), as a PNG: the curve shows whether an arm's gap to
the baseline is a constant offset, a slower start or a divergence."""

from __future__ import annotations

from pathlib import Path

from gem_platform.sweep import store
from gem_platform.sweep.compare import Comparison

CURVES = (("train/ne_ctr", "train NE (ctr)"), ("eval/ne_ctr", "eval NE (ctr)"))


def _mean_curve(c, run_ids: list[str], metric: str) -> tuple[list[int], list[float]]:
    by_step: dict[int, list[float]] = {}
    for run_id in run_ids:
        for m in c.get_metric_history(run_id, metric):
            by_step.setdefault(int(m.step), []).append(float(m.value))
    steps = sorted(by_step)
    return steps, [sum(by_step[s]) / len(by_step[s]) for s in steps]


def plot_ne_vs_step(uri: str, cmp: Comparison, path: str | Path) -> Path:
    """Write the PNG (one panel per curve that has more than one point) and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = store.client(uri)
    curves = {metric: {arm.arm: _mean_curve(c, arm.run_ids, metric) for arm in cmp.arms}
              for metric, _ in CURVES}
    panels = [(m, label) for m, label in CURVES
              if any(len(steps) > 1 for steps, _ in curves[m].values())] or [CURVES[0]]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (metric, label) in zip(axes[0], panels, strict=True):
        for arm, (steps, values) in curves[metric].items():
            n = len(cmp.arms[[a.arm for a in cmp.arms].index(arm)].run_ids)
            style = "-" if arm == cmp.baseline else "--"
            ax.plot(steps, values, style, marker="o", markersize=3,
                    label=f"{arm} (n={n}){' baseline' if arm == cmp.baseline else ''}")
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"NE vs step per arm ({', '.join(cmp.sweep_ids) or 'selected runs'})",
                 fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def log_plot(uri: str, parent_run_ids: list[str], path: Path) -> None:
    """Attach the plot to each compared sweep's parent run (artifact folder 'compare')."""
    c = store.client(uri)
    for run_id in parent_run_ids:
        c.log_artifact(run_id, str(path), artifact_path="compare")
