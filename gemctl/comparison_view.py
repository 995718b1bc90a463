"""How a comparison of sweep arms is shown: quality, efficiency and gate tables (rich), the
runs-by-commit and runs-by-device lines, and its charts, for `gemctl compare` and the closing
comparison of `gemctl sweep`."""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from gem_platform.sweep.gates import effective, settle_words
from gem_platform.sweep.results import cross_device_seeds
from gem_platform.sweep.stats import delta_text, mean_sd
from gemctl import render

# Tables of many numeric columns: full width in a terminal, 160 columns in logs (CI, files),
# where rich would otherwise fold every cell to 80.
console = render.console if render.console.is_terminal else Console(width=160)


def _styled_delta(d, worse_if_positive: bool, unit: str, digits: int) -> str:
    text = delta_text(d, unit, digits, sep=",")
    if not text or not math.isfinite(d.low):
        return text
    significant = d.low > 0 or d.high < 0
    worse = (d.value > 0) == worse_if_positive
    if not significant:
        return text
    return f"[{'red' if worse else 'green'}]{text}[/]"


def comparison_tables(cmp) -> list[Table]:
    """Quality per arm and task (delta to the baseline with its 95% interval), then efficiency."""
    methods = {d.method for arm in cmp.arms for d in arm.deltas.values()}
    labels = {"paired": "paired over seeds", "welch": "Welch"}
    how = " / ".join(labels[m] for m in sorted(methods))
    q = Table(title=f"quality per arm: mean±std over seeds; Δ vs baseline "
                    f"'{render.esc(cmp.baseline)}' "
                    f"(*) [95% CI{', ' + how if how else ''}]", title_justify="left")
    for col in ("arm", "task", "seeds"):
        q.add_column(col)
    for col in ("NE", "NE per seed", "ΔNE %", "AUC", "ΔAUC", "calibration"):
        q.add_column(col, justify="right")
    for arm in cmp.arms:
        for task in cmp.tasks:
            ne, auc = arm.metrics[f"eval/ne_{task}"], arm.metrics[f"eval/auc_{task}"]
            cal = arm.metrics.get(f"eval/calibration_{task}")
            per_seed = zip(arm.seeds, arm.per_seed.get(f"eval/ne_{task}", []), strict=False)
            q.add_row(render.esc(arm.arm) + ("*" if arm.arm == cmp.baseline else ""),
                      render.esc(task),
                      str(ne.n), mean_sd(ne.mean, ne.std),
                      " ".join(f"{s}:{v:.4f}" for s, v in per_seed if v is not None),
                      _styled_delta(arm.deltas.get(f"eval/ne_{task}"), True, "%", 3),
                      mean_sd(auc.mean, auc.std),
                      _styled_delta(arm.deltas.get(f"eval/auc_{task}"), False, "", 4),
                      mean_sd(cal.mean, cal.std, 3) if cal else "-")
    return [q, efficiency_table(cmp)]


def efficiency_table(cmp) -> Table:
    """QPS, MFU, padding and straggler overhead per arm; arms whose trials shared a machine
    (an in-process sweep's --parallel) are marked, their speed being a share of it."""
    from gem_platform.sweep.gates import sharing

    e = Table(title="efficiency per arm: mean±std over seeds", title_justify="left")
    e.add_column("arm")
    for col in ("QPS", "ΔQPS %", "MFU E2E", "padding", "straggler"):
        e.add_column(col, justify="right")
    shared = {arm.arm: n for arm in cmp.arms if (n := sharing(arm)) > 1}
    if shared:
        e.caption = ("‡ trained up to " + str(max(shared.values())) + " trials at a time on "
                     "one machine (--parallel): QPS and MFU are shares of it, not speed figures")
    for arm in cmp.arms:
        m = arm.metrics
        qps = m["perf/qps"]
        e.add_row(render.esc(arm.arm) + ("‡" if arm.arm in shared else ""),
                  mean_sd(qps.mean, qps.std, 0),
                  _styled_delta(arm.deltas.get("perf/qps"), False, "%", 1),
                  mean_sd(m["perf/mfu_e2e"].mean, m["perf/mfu_e2e"].std),
                  mean_sd(m["balance/padding_waste_mean"].mean,
                      m["balance/padding_waste_mean"].std, 3),
                  mean_sd(m["balance/straggler_overhead_mean"].mean,
                      m["balance/straggler_overhead_mean"].std, 3))
    return e


VERDICT_STYLE = {"pass": "green", "fail": "red", "inconclusive": "yellow"}


def verdict_table(cmp) -> Table:
    """One row per gate: the regression with its interval, the limit, the verdict in words
    and, when inconclusive, the seeds per arm that would settle it."""
    t = Table(title="gates: regression vs baseline (positive = worse) [95% CI]",
              title_justify="left")
    for col in ("arm", "metric", "regression", "limit", "verdict", "seeds", "to settle"):
        t.add_column(col, justify="right" if col in ("regression", "limit", "seeds") else
                     "left")
    for v in cmp.verdicts:
        digits = 4 if v.unit == "" else 3
        reg = f"{v.regression:+.{digits}f}{v.unit}" if math.isfinite(v.regression) else "-"
        if not math.isnan(v.low):
            reg += f" [{v.low:+.{digits}f},{v.high:+.{digits}f}]"
        settle = "" if v.verdict != "inconclusive" else (
            "trials trained alone" if v.shared else
            "finished runs to judge" if v.unjudged else
            "a baseline that learned the term" + (
                f" (~{v.seeds_needed} seeds for a FAIL)" if v.seeds_needed else "")
            if v.unlearned else
            "a finite value in every run" if v.unmeasured else
            settle_words(v) if v.seeds_needed else
            "needs 2+ seeds" if math.isnan(v.low) else "unknown")
        t.add_row(render.esc(v.arm), render.esc(v.metric.removeprefix("eval/")), reg,
                  f"{v.limit:g}{v.unit}" if math.isfinite(v.limit) else "-",
                  _verdict_cell(v), str(v.seeds), settle)
    return t


def _verdict_cell(v) -> str:
    """The verdict in its colour; a control's says what it expects, coloured by whether it
    holds."""
    if v.expected is None:
        return f"[{VERDICT_STYLE[v.verdict]}]{v.verdict.upper()}[/]"
    shown = "as expected" if v.verdict == v.expected else f"expected {v.expected.upper()}"
    return f"[{VERDICT_STYLE[effective(v)]}]{v.verdict.upper()} ({shown})[/]"


def write_plots(cmp, uri: str, plot: Path | None, ids: list[str] | None, gates
                 ) -> list[Path]:
    """The comparison's charts at ``plot`` (none when None), logged to the parent runs of a
    tracked sweep; a folder that can't be written costs the charts, never the verdicts."""
    from gem_platform.sweep.plot import log_plot, plot_comparison

    if plot is None:
        return []
    plot_paths: list[Path] = []
    try:
        plot_paths = plot_comparison(uri, cmp, ids or [], plot, gates)
    except OSError as err:
        render.error(f"The plots were not written: {err.strerror or err} "
                     f"({err.filename or plot}).", "Pass --plot PATH in a writable "
                     "folder, or --no-plot.")
    if uri:
        for path in plot_paths:
            log_plot(uri, cmp.parent_run_ids, path)
    return plot_paths


def render_comparison(cmp, uri: str, plot: Path | None, as_json: bool,
                       ids: list[str] | None = None, gates=None) -> None:
    plot_paths = write_plots(cmp, uri, plot, ids, gates)
    if as_json:
        body = cmp.to_dict()
        body["plot"] = str(plot_paths[0]) if plot_paths else None
        body["plots"] = [str(p) for p in plot_paths]
        typer.echo(json.dumps(body, indent=2))
        return
    for table in comparison_tables(cmp):
        console.print(table)
    if cmp.verdicts:
        console.print(verdict_table(cmp))
    for what, shown in (("commits", 10), ("devices", 40)):
        origins = {v for arm in cmp.arms for v in getattr(arm, what).values()}
        if len(origins) > 1:
            console.print(f"[yellow]runs from {len(origins)} {what}[/]: "
                          + render.esc(_runs_by(cmp, what, shown)), highlight=False)
    base = next(arm for arm in cmp.arms if arm.arm == cmp.baseline)
    apart = [_arm_seeds(arm.arm, seeds) for arm in cmp.arms if arm is not base
             and (seeds := cross_device_seeds(arm.devices, base.devices))]
    if apart:
        console.print(f"[yellow]not paired with {cmp.baseline}'s run of the seed, which trained "
                      "on another device[/]: " + render.esc("; ".join(apart)), highlight=False)
    if past := cmp.past_one_epoch:
        console.print("[yellow]trained past one epoch of the training split[/] (most epochs "
                      f"of a run): {render.epochs_by_arm(past)}. From a second pass, per-id rows "
                      "recall the labels they saw: these NEs can measure memorization as much "
                      "as the arms' difference.",
                      highlight=False, soft_wrap=True)
    if cmp.skipped:
        console.print(f"[yellow]left out {len(cmp.skipped)} unfinished run(s)[/]: "
                      + render.esc(", ".join(cmp.skipped)), highlight=False)
    if plot_paths:
        where = " (logged to the parent run)" if cmp.parent_run_ids and uri else ""
        console.print(f"plots: {render.esc(', '.join(map(str, plot_paths)))}{where}",
                      highlight=False)


def seed_spans(seeds: list[str]) -> str:
    """'0-4, 6, 7-9' style: runs of consecutive numeric seeds joined, in the given order
    (other seeds as they are)."""
    spans: list[list[str]] = []
    for seed in seeds:
        last = spans[-1][-1] if spans else None
        if (last is not None and last.isdigit() and seed.isdigit()
                and int(seed) == int(last) + 1):
            spans[-1].append(seed)
        else:
            spans.append([seed])
    return ", ".join(s[0] if len(s) == 1 else f"{s[0]}-{s[-1]}" for s in spans)


def _runs_by(cmp, what: str, shown: int) -> str:
    """Which arm's seeds trained at which commit (``what`` "commits") or on which device
    ("devices"): one entry per commit or device, not per run, its first ``shown``
    characters."""
    by_origin: dict[str, dict[str, list[str]]] = {}
    for arm in cmp.arms:
        for seed, origin in getattr(arm, what).items():
            by_origin.setdefault(origin, {}).setdefault(arm.arm, []).append(seed)

    return "; ".join(f"{origin[:shown]}: " + ", ".join(_arm_seeds(*item)
                                                       for item in arms.items())
                     for origin, arms in by_origin.items())


def _arm_seeds(arm: str, seeds: list[str]) -> str:
    """'ARM seed 3' or 'ARM seeds 0-4, 6'."""
    return f"{arm} {'seeds' if len(seeds) > 1 else 'seed'} {seed_spans(seeds)}"


def default_plot(ids: list[str], arms: list[str] | None = None) -> Path:
    """gem_runs/compare/<sweep id or file name>[-<arms>]-ne.png: a comparison narrowed with
    --arms keeps the whole comparison's plot."""
    label = ids[0] if len(ids) == 1 else f"compare-{time.strftime('%Y%m%d-%H%M%S')}"
    label = Path(label).stem if label.endswith(".json") else label  # a results file's name
    narrowed = "".join(f"-{a}" for a in arms or [])
    if len(narrowed) > 100:  # long arm names: keep the file name within the system's limit
        narrowed = f"-{len(arms or [])}-arms-{hashlib.sha256(narrowed.encode()).hexdigest()[:8]}"
    return Path("gem_runs/compare") / f"{label}{narrowed}-ne.png"


def print_gate_outcome(verdicts, code: int) -> None:
    """Each gate that did not pass and each control's verdict, in words (one that counts as a
    fail as an error), then the overall outcome of exit ``code``."""
    for v in verdicts:
        word = effective(v)
        if word == "fail":
            render.error(f"gate {v.verdict.upper()}: {v.message}")
        elif word != "pass" or v.expected is not None:
            console.print(f"gate {v.verdict.upper()}: {render.esc(v.message)}",
                          highlight=False, soft_wrap=True)
    summary = {0: "[green]gates passed[/]", 1: "[red]gates FAILED[/]",
               3: "[yellow]gates INCONCLUSIVE[/] (no gate failed)"}[code]
    console.print(summary, highlight=False)
