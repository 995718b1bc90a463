"""gemctl sweep commands: run an ablation sweep (on Ray Tune, or on this machine without Ray),
and compare its arms (with regression gates for scheduled pipelines)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from gemctl import render
from gemctl.comparison_view import (
    default_plot,
    print_gate_outcome,
    render_comparison,
    write_plots,
)
from gemctl.errors import run_failed, user_errors
from gemctl.jobs import submit_remote
from gemctl.options import JsonOpt, TrackingOpt, VerboseOpt, epilog
from gemctl.progress import TrainingProgress
from gemctl.quiet import LibraryOutput
from gemctl.runs import store_uri as _uri

if TYPE_CHECKING:
    from gem_platform.sweep.compare import Comparison
    from gem_platform.sweep.gates import Gates

SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", "-s", help="Override a field of the base recipe for every arm (repeatable).")]


def _narrowed(plan, arms: list[str] | None, seeds: list[int] | None):
    from gem_platform.sweep.inprocess import narrowed

    unique = list(dict.fromkeys(seeds)) if seeds else None  # --seeds 0 --seeds 0 runs once
    return narrowed(plan, unique, arms)


def _sweep_in_process(plan, out: Path, new: bool, as_json: bool, verbose: bool,
                      allow_code_change: bool = False, parallel: int = 1,
                      allow_device_change: bool = False) -> None:
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
                              allow_code_change=allow_code_change, parallel=parallel,
                              allow_device_change=allow_device_change)
    baseline = plan.baseline_among({t.arm for t in done})
    cmp = compare_runs("", [str(out)], baseline, plan.gates) if done else None
    if as_json:
        render.print_json({"results": str(out), "trials": len(done), "wall_s": progress.wall_s,
                           "log": str(lib.path) if lib.path else None,
                           "comparison": cmp.to_dict() if cmp else None})
        return
    if cmp is not None:
        render_comparison(cmp, "", None, False, [str(out)])
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
    allow_device_change: Annotated[bool, typer.Option(
        "--allow-device-change", help="Resume an --in-process sweep although its trials so far "
        "trained on another device (each trial records its device).")] = False,
    address: Annotated[str | None, typer.Option(
        "--address", help="Existing Ray cluster (ray://HEAD:10001); default RAY_ADDRESS or an "
        "embedded local Ray. http://HEAD:8265 submits the sweep as a Ray job there.")] = None,
    tracking_uri: TrackingOpt = None,
    as_json: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Run an ablation sweep (arms x seeds) on Ray Tune; one MLflow parent run, one child run
    per trial. Running the same spec again resumes an interrupted sweep."""
    from gem_platform.remote import jobs_address_for_submit

    _refuse_options_of_the_other_mode(in_process, address or tracking_uri, parallel,
                                      allow_device_change)
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
    if line := render.epochs_warning(plan, in_process):
        con.print(line, style="yellow", highlight=False, soft_wrap=True)
    if in_process:
        _sweep_in_process(plan, out or Path("gem_runs/sweeps") / f"{plan.name}.json", new,
                          as_json, verbose, allow_code_change, parallel, allow_device_change)
        return
    outcome, cmp, wall_s, log_path = _sweep_on_ray(plan, con, new=new, address=address,
                                                    allow_code_change=allow_code_change,
                                                    verbose=verbose)
    _report_sweep(plan, outcome, cmp, wall_s, log_path, con, as_json)


def _refuse_options_of_the_other_mode(in_process: bool, cluster: str | None, parallel: int,
                                      allow_device_change: bool) -> None:
    """Options of a sweep on Ray (``cluster``: an address or tracking URI) and of one in this
    process (``parallel``, ``allow_device_change``) are refused in the other mode."""
    from gem_platform.errors import GemError

    if in_process and cluster:
        raise GemError("--in-process trains here without Ray or MLflow; --address and "
                       "--tracking-uri don't apply.", "Drop them, or drop --in-process.")
    if allow_device_change and not in_process:
        raise GemError("--allow-device-change applies to --in-process sweeps (their results "
                       "file records each trial's device).", "Add --in-process, or drop it.")
    if parallel > 1 and not in_process:
        raise GemError(f"--parallel {parallel} applies to --in-process sweeps.",
                       "Add --in-process, or set max_concurrent in the spec for a sweep on "
                       "Ray.")


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
            render_comparison(cmp, outcome.tracking_uri, default_plot([outcome.sweep_id]),
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
    expect: Annotated[list[str] | None, typer.Option(
        "--expect", help="A control's expected verdict, ARM:METRIC=pass|fail (repeatable): "
        "block64:ne_ctr=fail on data that plants what block64 can't see. It counts as a pass "
        "when it holds and as a fail when the opposite verdict comes.")] = None,
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
    from gem_platform.sweep.compare import compare as compare_runs
    from gem_platform.sweep.gates import EXIT_PASS, exit_code
    from gem_platform.sweep.report import quality_markdown
    from gem_platform.sweep.results import is_results_file

    if as_json and as_markdown:
        raise GemError("--json and --markdown each print the whole comparison.",
                       "Pass one of them.")
    gates = _gates(max_ne_regression, max_auc_drop, max_qps_drop, expect or [])
    files = [i for i in ids if is_results_file(i)]
    uri = _uri(tracking_uri) if len(files) < len(ids) else ""  # files need no MLflow store
    cmp = compare_runs(uri, ids, baseline, gates, arms)
    _refuse_unknown_expected_arms(cmp, gates)
    if as_markdown:  # stdout holds the report alone
        write_plots(cmp, uri, None if no_plot else plot, ids, gates)
        typer.echo(quality_markdown(cmp), nl=False)
    else:
        render_comparison(cmp, uri, None if no_plot else (plot or default_plot(ids, arms)),
                           as_json, ids, gates)
    if not gates.any():
        return
    code = exit_code(cmp.verdicts)
    if not (as_json or as_markdown):
        print_gate_outcome(cmp.verdicts, code)
    if code != EXIT_PASS:
        raise typer.Exit(code)


def _gates(max_ne_regression: str | None, max_auc_drop: float | None,
           max_qps_drop: str | None, expect: list[str]) -> Gates:
    """The gates the options ask for; expectations need a gate to give their verdict."""
    from gem_platform.errors import GemError
    from gem_platform.sweep.compare import Gates, parse_percent
    from gem_platform.sweep.gates import Expectation

    gates = Gates(max_ne_regression_pct=parse_percent(max_ne_regression) if max_ne_regression
                  else None, max_auc_drop=max_auc_drop,
                  max_qps_drop_pct=parse_percent(max_qps_drop) if max_qps_drop else None,
                  expect=tuple(Expectation.parse(e) for e in expect))
    if gates.expect and not gates.any():
        raise GemError("--expect names a verdict, but no gate is set to give it.",
                       "Add the gate it speaks of, e.g. --max-ne-regression 0.2%.")
    return gates


def _refuse_unknown_expected_arms(cmp: Comparison, gates: Gates) -> None:
    """An --expect naming an arm the comparison lacks is a typo, not a control to skip."""
    from gem_platform.errors import GemError

    named = {res.arm for res in cmp.arms} | set(cmp.unfinished)
    unknown = sorted({e.arm for e in gates.expect} - named)
    if unknown:
        raise GemError(f"--expect names arm '{unknown[0]}', which the compared runs do not "
                       f"hold (arms: {', '.join(sorted(named))}).",
                       "Name an arm of the comparison, e.g. --expect block64:ne_ctr=fail.")


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
