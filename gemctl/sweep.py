"""gemctl sweep commands: run an ablation sweep (on Ray Tune, or on this machine without Ray),
and compare its arms (with regression gates for scheduled pipelines)."""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from gemctl import render
from gemctl.errors import run_failed, user_errors
from gemctl.jobs import submit_remote
from gemctl.options import JsonOpt, TrackingOpt, VerboseOpt, epilog
from gemctl.progress import TrainingProgress
from gemctl.quiet import LibraryOutput
from gemctl.runs import store_uri as _uri

# Tables of many numeric columns: full width in a terminal, 160 columns in logs (CI, files),
# where rich would otherwise fold every cell to 80.
console = render.console if render.console.is_terminal else Console(width=160)

SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", "-s", help="Override a field of the base recipe for every arm (repeatable).")]


def _pm(mean: float, std: float, digits: int = 4) -> str:
    if math.isnan(mean):
        return "-"
    return f"{mean:.{digits}f}" + ("" if math.isnan(std) else f"±{std:.{digits}f}")


def _delta(d, unit: str = "", digits: int = 4) -> str:
    if d is None or math.isnan(d.value):
        return ""
    text = f"{d.value:+.{digits}f}{unit}"
    if not math.isnan(d.low):
        text += f" [{d.low:+.{digits}f},{d.high:+.{digits}f}]"
    return text


def _styled_delta(d, worse_if_positive: bool, unit: str, digits: int) -> str:
    text = _delta(d, unit, digits)
    if not text or math.isnan(d.low):
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
                      str(ne.n), _pm(ne.mean, ne.std),
                      " ".join(f"{s}:{v:.4f}" for s, v in per_seed if v is not None),
                      _styled_delta(arm.deltas.get(f"eval/ne_{task}"), True, "%", 3),
                      _pm(auc.mean, auc.std),
                      _styled_delta(arm.deltas.get(f"eval/auc_{task}"), False, "", 4),
                      _pm(cal.mean, cal.std, 3) if cal else "-")
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
                  _pm(qps.mean, qps.std, 0),
                  _styled_delta(arm.deltas.get("perf/qps"), False, "%", 1),
                  _pm(m["perf/mfu_e2e"].mean, m["perf/mfu_e2e"].std),
                  _pm(m["balance/padding_waste_mean"].mean,
                      m["balance/padding_waste_mean"].std, 3),
                  _pm(m["balance/straggler_overhead_mean"].mean,
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
            "a baseline that learned the term" if v.unlearned else
            "a finite value in every run" if v.unmeasured else
            f"~{v.seeds_needed} seeds" if v.seeds_needed else
            "needs 2+ seeds" if math.isnan(v.low) else "unknown")
        t.add_row(render.esc(v.arm), render.esc(v.metric.removeprefix("eval/")), reg,
                  f"{v.limit:g}{v.unit}" if math.isfinite(v.limit) else "-",
                  f"[{VERDICT_STYLE[v.verdict]}]{v.verdict.upper()}[/]", str(v.seeds), settle)
    return t


def _write_plots(cmp, uri: str, plot: Path | None, ids: list[str] | None, gates
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


def _render_comparison(cmp, uri: str, plot: Path | None, as_json: bool,
                       ids: list[str] | None = None, gates=None) -> None:
    plot_paths = _write_plots(cmp, uri, plot, ids, gates)
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
    commits = {c for arm in cmp.arms for c in arm.commits.values()}
    if len(commits) > 1:
        console.print(f"[yellow]runs from {len(commits)} commits[/]: "
                      + render.esc(_runs_by_commit(cmp)), highlight=False)
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


def _runs_by_commit(cmp) -> str:
    """Which arm's seeds trained at which commit: one entry per commit, not per run."""
    by_commit: dict[str, dict[str, list[str]]] = {}
    for arm in cmp.arms:
        for seed, commit in arm.commits.items():
            by_commit.setdefault(commit, {}).setdefault(arm.arm, []).append(seed)

    def entry(arm: str, seeds: list[str]) -> str:
        return f"{arm} {'seeds' if len(seeds) > 1 else 'seed'} {seed_spans(seeds)}"

    return "; ".join(f"{commit[:10]}: " + ", ".join(entry(*item) for item in arms.items())
                     for commit, arms in by_commit.items())


def _default_plot(ids: list[str], arms: list[str] | None = None) -> Path:
    """gem_runs/compare/<sweep id or file name>[-<arms>]-ne.png: a comparison narrowed with
    --arms keeps the whole comparison's plot."""
    label = ids[0] if len(ids) == 1 else f"compare-{time.strftime('%Y%m%d-%H%M%S')}"
    label = Path(label).stem if label.endswith(".json") else label  # a results file's name
    narrowed = "".join(f"-{a}" for a in arms or [])
    if len(narrowed) > 100:  # long arm names: keep the file name within the system's limit
        narrowed = f"-{len(arms or [])}-arms-{hashlib.sha256(narrowed.encode()).hexdigest()[:8]}"
    return Path("gem_runs/compare") / f"{label}{narrowed}-ne.png"


def _narrowed(plan, arms: list[str] | None, seeds: list[int] | None):
    from gem_platform.sweep.inprocess import narrowed

    unique = list(dict.fromkeys(seeds)) if seeds else None  # --seeds 0 --seeds 0 runs once
    return narrowed(plan, unique, arms)


def _sweep_in_process(plan, out: Path, new: bool, as_json: bool, verbose: bool,
                      allow_code_change: bool = False, parallel: int = 1) -> None:
    """The sweep's trials on this machine, ``parallel`` at a time, each in a fresh process (no
    Ray, no MLflow); results go to ``out``, rewritten after every trial, and the comparison
    is printed at the end."""
    from gem_platform.sweep.compare import compare as compare_runs
    from gem_platform.sweep.inprocess import run_in_process

    con = render.progress_console(as_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    with LibraryOutput(f"sweep-{plan.name}", verbose) as lib, \
            TrainingProgress(con, plan.name, trials=len(plan.trials())) as progress:
        done = run_in_process(plan, out, echo=progress.echo, resume=not new,
                              allow_code_change=allow_code_change, parallel=parallel)
    baseline = plan.baseline_among({t.arm for t in done})
    cmp = compare_runs("", [str(out)], baseline, plan.gates) if done else None
    if as_json:
        render.print_json({"results": str(out), "trials": len(done), "wall_s": progress.wall_s,
                           "log": str(lib.path) if lib.path else None,
                           "comparison": cmp.to_dict() if cmp else None})
        return
    if cmp is not None:
        _render_comparison(cmp, "", None, False, [str(out)])
    con.print(f"sweep {render.esc(plan.name)}: {len(done)}/{len(plan.trials())} trials in "
              f"{render.esc(out)} (compare: gemctl compare {render.esc(out)}); wall time "
              f"{render.duration(progress.wall_s)}", highlight=False, soft_wrap=True)


def sweep(
    spec: Annotated[Path, typer.Argument(help="Sweep spec YAML, e.g. "
                                         "recipes/ablations/attention.yaml.",
                                         show_default=False)],
    set_: SetOpt = None,
    arms: Annotated[list[str] | None, typer.Option(
        "--arms", help="Run only these arms (repeatable: --arms full --arms block64).")] = None,
    seeds: Annotated[list[int] | None, typer.Option(
        "--seeds", help="Run these seeds instead of the spec's (repeatable).")] = None,
    in_process: Annotated[bool, typer.Option(
        "--in-process", help="Train the trials on this machine, each in a fresh process (one "
        "after another, or --parallel N at once): no Ray, no MLflow; results go to --out (a "
        "lone GPU box).")] = False,
    parallel: Annotated[int, typer.Option(
        "--parallel", min=1, help="With --in-process: train N trials at once, each in its own "
        "process, sharing this machine's GPU (QPS and MFU are then shares "
        "of the machine). N is bounded by GPU memory.")] = 1,
    out: Annotated[Path | None, typer.Option(
        help="Results file of an --in-process sweep; default gem_runs/sweeps/<name>.json. "
        "Running again resumes it.")] = None,
    new: Annotated[bool, typer.Option(
        "--new", help="Start a fresh sweep even if this spec already ran.")] = False,
    allow_code_change: Annotated[bool, typer.Option(
        "--allow-code-change", help="Resume a sweep although its trials so far trained with "
        "another git commit (each trial records its commit).")] = False,
    address: Annotated[str | None, typer.Option(
        "--address", help="Existing Ray cluster (ray://HEAD:10001); default RAY_ADDRESS or an "
        "embedded local Ray. http://HEAD:8265 submits the sweep as a Ray job there.")] = None,
    tracking_uri: TrackingOpt = None,
    as_json: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Run an ablation sweep (arms x seeds) on Ray Tune; one MLflow parent run, one child run
    per trial. Running the same spec again resumes an interrupted sweep."""
    from gem_platform.errors import GemError
    from gem_platform.remote import jobs_address_for_submit

    if in_process and (address or tracking_uri):
        raise GemError("--in-process trains here without Ray or MLflow; --address and "
                       "--tracking-uri don't apply.", "Drop them, or drop --in-process.")
    if parallel > 1 and not in_process:
        raise GemError(f"--parallel {parallel} applies to --in-process sweeps.",
                       "Add --in-process, or set max_concurrent in the spec for a sweep on "
                       "Ray.")
    jobs_address = None if in_process else jobs_address_for_submit(address, local=False)
    if jobs_address:  # http(s)://HEAD:8265: the whole sweep runs as a Ray job there
        extra = (["--new"] if new else []) + (
            ["--allow-code-change"] if allow_code_change else []) \
            + [a for arm in arms or [] for a in ("--arms", arm)] \
            + [a for seed in seeds or [] for a in ("--seeds", str(seed))] + (
            ["--tracking-uri", tracking_uri] if tracking_uri else [])
        _sweep_as_ray_job(spec, set_ or [], jobs_address, extra, as_json)
        return

    from gem_platform.sweep.config import load_sweep

    plan = _narrowed(load_sweep(spec, set_ or [], tracking_uri), arms, seeds)
    con = render.progress_console(as_json)
    names = ", ".join(a.name for a in plan.arms)
    con.print(f"[bold]gemctl sweep[/] {render.esc(spec)}: {len(plan.arms)} arms "
              f"({render.esc(names)}) x seeds {plan.seeds}, "
              + (f"{'one' if parallel == 1 else parallel} at a time here" if in_process
                 else f"{plan.max_concurrent} at a time")
              + f", baseline '{render.esc(plan.baseline)}'"
              + ("" if plan.own_baseline == plan.baseline else
                 f" (not among --arms: compared against it where the results hold it, else "
                 f"against '{render.esc(plan.own_baseline)}')"), highlight=False, soft_wrap=True)
    if in_process:
        _sweep_in_process(plan, out or Path("gem_runs/sweeps") / f"{plan.name}.json", new,
                          as_json, verbose, allow_code_change, parallel)
        return
    outcome, cmp, wall_s, log_path = _sweep_on_ray(plan, con, new=new, address=address,
                                                    allow_code_change=allow_code_change,
                                                    verbose=verbose)
    _report_sweep(plan, outcome, cmp, wall_s, log_path, con, as_json)


def _sweep_as_ray_job(spec: Path, overrides: list[str], jobs_address: str, extra: list[str],
                      as_json: bool) -> None:
    """Submit the whole sweep as one Ray job at ``jobs_address`` (the Jobs API)."""
    job_id = submit_remote(spec, overrides, jobs_address, command="sweep",
                           extra_args=extra or None, quiet=as_json)
    if as_json:
        render.print_json({"job_id": job_id, "address": jobs_address})


def _sweep_on_ray(plan, con, *, new: bool, address: str | None, allow_code_change: bool,
                  verbose: bool):
    """Run the sweep on Ray Tune under the progress display, library output routed to a log;
    returns (outcome, comparison or None, wall seconds, log path or None)."""
    with LibraryOutput(f"sweep-{plan.name}", verbose) as lib:
        # Ray, torch and MLflow load only once the spec and every arm's recipe are valid, so a
        # bad spec is reported in a second.
        from gem_platform.sweep.compare import compare as compare_runs
        from gem_platform.sweep.runner import run_sweep

        with TrainingProgress(con, plan.name, trials=len(plan.trials())) as progress:
            try:
                outcome = run_sweep(plan, new=new, address=address, echo=progress.echo,
                                    allow_code_change=allow_code_change)
            except KeyboardInterrupt:
                render.error("Sweep interrupted.", "Run the same command again to resume it: "
                             "finished trials are kept, unfinished ones rerun.")
                raise typer.Exit(130) from None
            except RuntimeError as err:
                where = f" Library output: {lib.path}." if lib.path else ""
                raise run_failed(str(err).splitlines()[0], "The parent run is marked FAILED "
                                 "with the reason; run the same command again to resume once "
                                 f"it is fixed.{where}") from None
            cmp = (compare_runs(outcome.tracking_uri, [outcome.sweep_id], plan.own_baseline,
                                plan.gates) if outcome.child_run_ids else None)
    return outcome, cmp, progress.wall_s, lib.path


def _report_sweep(plan, outcome, cmp, wall_s: float, log_path, con, as_json: bool) -> None:
    """The finished sweep as JSON on stdout or as tables; a failed or killed one exits
    non-zero after saying how to resume it."""
    if as_json:
        render.print_json({
            "sweep_id": outcome.sweep_id, "status": outcome.status,
            "parent_run_id": outcome.parent_run_id, "tracking_uri": outcome.tracking_uri,
            "wall_s": wall_s, "log": str(log_path) if log_path else None,
            "trials": [{"arm": a, "seed": s, "run_id": outcome.child_run_ids.get((a, s)),
                        "error": outcome.errors.get((a, s))} for a, s in plan.trials()],
            "comparison": cmp.to_dict() if cmp else None})
    else:
        if cmp is not None:
            _render_comparison(cmp, outcome.tracking_uri, _default_plot([outcome.sweep_id]),
                               False)
        con.print(f"sweep [bold]{render.esc(outcome.sweep_id)}[/] {outcome.status}: "
                  f"{len(outcome.child_run_ids)}/{len(plan.trials())} trials recorded; parent "
                  f"run {render.esc(outcome.parent_run_id)}; wall time "
                  f"{render.duration(wall_s)}", highlight=False, soft_wrap=True)
        if log_path:
            con.print(f"library output: {render.esc(log_path)}", highlight=False, soft_wrap=True)
    if outcome.status == "FAILED":
        for (arm, seed), err in outcome.errors.items():
            render.error(f"trial {arm} seed {seed} failed: {err}")
        raise run_failed("Some trials failed.", "Fix the cause and run the same command "
                         "again: finished trials are kept, failed ones rerun.")
    if outcome.status == "KILLED":
        render.error("Sweep interrupted.", "Run the same command again to resume it.")
        raise typer.Exit(130)


def compare(
    ids: Annotated[list[str], typer.Argument(
        help="Sweep ids, parent run ids, run ids, results files (*.json) of in-process "
        "sweeps, or comparisons saved from `gemctl compare --json`.")],
    baseline: Annotated[str | None, typer.Option(
        help="Arm the others are compared with; default the sweep's baseline.")] = None,
    arms: Annotated[list[str] | None, typer.Option(
        "--arms", help="Compare and gate only these arms against the baseline (repeatable: "
        "--arms block64 --arms sliding); default every arm.")] = None,
    max_ne_regression: Annotated[str | None, typer.Option(
        "--max-ne-regression", help="Gate on NE per task, in percent of the baseline: 0.1%. "
        "Passes when the whole 95% interval of the arm's NE increase lies at or below it, "
        "fails when the whole interval lies above it.")] = None,
    max_auc_drop: Annotated[float | None, typer.Option(
        "--max-auc-drop", min=0, help="Gate on AUC per task (absolute drop): 0.005, "
        "judged on the interval like NE.")] = None,
    max_qps_drop: Annotated[str | None, typer.Option(
        "--max-qps-drop", help="Gate on QPS, in percent: 5%, judged on the interval like "
        "NE.")] = None,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print JSON (verdicts and every run's values included) instead of "
        "tables; `gemctl compare FILE.json` reads it back.")] = False,
    as_markdown: Annotated[bool, typer.Option(
        "--markdown", help="Print the quality report in Markdown instead of tables: per arm "
        "and task NE and AUC, their deltas with 95% intervals, the NE gate's verdict; plots "
        "only with --plot.")] = False,
    plot: Annotated[Path | None, typer.Option(
        help="Where to write the NE-vs-step PNG (mean and seed range per arm); the delta "
        "chart goes beside it as <name>-deltas.png. Default "
        "gem_runs/compare/<id>-ne.png.")] = None,
    no_plot: Annotated[bool, typer.Option("--no-plot", help="Skip the plots.")] = False,
    tracking_uri: TrackingOpt = None,
) -> None:
    """Compare arms: NE/AUC/calibration per task (mean ± std and each seed's value, Δ to the
    baseline with a 95% CI), QPS, MFU, padding waste, straggler overhead; gates judged on the
    interval: PASS, FAIL or INCONCLUSIVE (with the seeds that would settle it; one seed is
    always inconclusive).

    Exit codes: 0 every gate passed (or none set); 1 a gate failed; 2 bad input; 3 no gate
    failed but one is inconclusive.
    """
    from gem_platform.errors import GemError
    from gem_platform.sweep.compare import Gates, parse_percent
    from gem_platform.sweep.compare import compare as compare_runs
    from gem_platform.sweep.gates import EXIT_PASS, exit_code
    from gem_platform.sweep.report import quality_markdown
    from gem_platform.sweep.results import is_results_file

    if as_json and as_markdown:
        raise GemError("--json and --markdown each print the whole comparison.",
                       "Pass one of them.")
    gates = Gates(
        max_ne_regression_pct=parse_percent(max_ne_regression) if max_ne_regression else None,
        max_auc_drop=max_auc_drop,
        max_qps_drop_pct=parse_percent(max_qps_drop) if max_qps_drop else None,
    )
    files = [i for i in ids if is_results_file(i)]
    uri = _uri(tracking_uri) if len(files) < len(ids) else ""  # files need no MLflow store
    cmp = compare_runs(uri, ids, baseline, gates, arms)
    if as_markdown:  # stdout holds the report alone
        _write_plots(cmp, uri, None if no_plot else plot, ids, gates)
        typer.echo(quality_markdown(cmp), nl=False)
    else:
        _render_comparison(cmp, uri, None if no_plot else (plot or _default_plot(ids, arms)),
                           as_json, ids, gates)
    if not gates.any():
        return
    code = exit_code(cmp.verdicts)
    if not (as_json or as_markdown):
        for v in cmp.verdicts:
            if v.verdict != "pass":
                if v.verdict == "fail":
                    render.error(f"gate FAIL: {v.message}")
                else:
                    console.print(f"gate {v.verdict.upper()}: {render.esc(v.message)}",
                                  highlight=False, soft_wrap=True)
        summary = {0: "[green]gates passed[/]", 1: "[red]gates FAILED[/]",
                   3: "[yellow]gates INCONCLUSIVE[/] (no gate failed)"}[code]
        console.print(summary, highlight=False)
    if code != EXIT_PASS:
        raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    """Add this module's commands to the gemctl app."""
    app.command("sweep", epilog=epilog(
        "gemctl sweep recipes/ablations/attention.yaml",
        "gemctl sweep recipes/ablations/precision.yaml --arms bf16 --arms fp8_b32 --seeds 0 "
        "--in-process",
        "gemctl sweep recipes/ablations/attention.yaml --json > sweep.json"))(user_errors(sweep))
    app.command("compare", epilog=epilog(
        "gemctl compare attention-20250101-120000 --max-ne-regression 0.1%",
        "gemctl compare gem_runs/sweeps/precision.json --json",
        codes="Exit codes: 0 every gate passed (or none set); 1 a gate failed; 2 bad input; "
        "3 no gate failed but one is inconclusive; 130 interrupted."))(user_errors(compare))
