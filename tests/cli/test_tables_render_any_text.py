"""Every table and message gemctl renders takes arbitrary text (run and experiment names, arm
names, paths, job commands, kernel names, error texts) without a traceback, and shows plain
text as written: user strings are escaped, never read as rich markup."""

from __future__ import annotations

import io
from datetime import datetime

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from rich.console import Console

from gem_platform.net import redact
from gem_platform.progress import StepProgress, TrialProgress
from gem_platform.remote import JobView
from gem_platform.sweep.compare import compare_trials
from gem_platform.sweep.gates import Gates, check_gates
from gem_platform.sweep.results import TrialRun
from gem_platform.sweep.runs import RunRow
from gem_profile.profile import KernelRow, StepProfile, render_profile
from gemctl import render
from gemctl.comparison_view import comparison_tables, verdict_table
from gemctl.inspect import profile_table
from gemctl.jobs import jobs_table
from gemctl.progress import TrainingProgress
from gemctl.runs import runs_table

TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
# Text whose literal appearance in the output can be checked: printable ASCII, one line.
PLAIN = st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=30)
SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
METRICS = {"eval/ne_ctr": 0.9, "eval/auc_ctr": 0.7, "eval/ne_cvr": 0.95, "eval/auc_cvr": 0.6,
           "perf/qps": 1000.0, "perf/mfu_e2e": 0.1, "balance/padding_waste_mean": 0.3,
           "balance/straggler_overhead_mean": 0.05}


def rendered(*items) -> str:
    """Render to a colour terminal (markup is parsed there) and return the plain text."""
    out = io.StringIO()
    con = Console(file=out, force_terminal=True, width=400, color_system="truecolor")
    for item in items:
        con.print(item)
    plain = io.StringIO()
    Console(file=plain, width=400).print(*items)
    return plain.getvalue()


def shown(text: str) -> str:
    """What the user should see of ``text``: itself, credentials masked."""
    return redact(text)


@SETTINGS
@given(TEXT, TEXT, TEXT, PLAIN)
@example("[/bold]", "http://alice:secret@h:1", "[red]", "a[red]b")
def test_summary_tables(run_id, uri, peak_source, plain):
    out = rendered(*render.summary_tables(run_id, {"eval/ne_ctr": 0.9, "peak_source":
                                                   peak_source}, uri, 12.0),
                   *render.summary_tables(plain, {}, "sqlite:///x.db"))
    assert shown(plain) in out


@SETTINGS
@given(TEXT, PLAIN)
@example("[/bold]", "a[red]b")
def test_summary_learning_tables(message, plain):
    """The learning curve and warnings of a summary, whatever they hold (a summary JSON read
    back, edited): no traceback, warnings shown as written."""
    summary = {"quality/warnings": [message, plain],
               "quality/eval_curve": [{"step": 1, "ne_ctr": message, "train_s": float("nan")},
                                      message, {}],
               "quality/target_ne": 0.9, "quality/reached_target": 1.0,
               "quality/train_s_to_target": message}
    out = rendered(*render.summary_tables("run", summary, "sqlite:///x.db"))
    assert shown(plain) in out and "learning curve" in out


@SETTINGS
@given(st.lists(st.tuples(TEXT, TEXT, TEXT, TEXT), min_size=1, max_size=4), TEXT, PLAIN)
@example([("evil[/bold]", "[/]", "[red]", "x\\")], "[/bold]", "evil[/bold]")
def test_runs_table(fields, uri, plain):
    rows = [RunRow(run_id=a, name=b, experiment=c, status=d, start_ms=0, duration_s=None,
                   role=role, sweep_id=b, arm=c, seed=d, ne_ctr=0.5, auc_ctr=None)
            for (a, b, c, d), role in zip(fields, ["run", "sweep", "trial", "run"],
                                          strict=False)]
    rows.append(RunRow(run_id="r", name=plain, experiment="e", status="FINISHED", start_ms=0,
                       duration_s=1.0, role="run", sweep_id="", arm="", seed="", ne_ctr=None,
                       auc_ctr=None))
    assert shown(plain) in rendered(runs_table(rows, uri))


@SETTINGS
@given(st.lists(st.tuples(TEXT, TEXT, TEXT), max_size=4), PLAIN)
def test_jobs_table(fields, plain):
    views = [JobView(job_id=a, status=b, entrypoint=c, message=None, start_time=datetime.now(),
                     end_time=None, metadata={}) for a, b, c in fields]
    views.append(JobView(job_id="j", status="RUNNING", entrypoint="x", message=plain,
                         start_time=None, end_time=None, metadata={"gem.command": plain}))
    assert shown(plain) in rendered(jobs_table(views))


@SETTINGS
@given(st.lists(TEXT, min_size=1, max_size=3, unique=True), TEXT, PLAIN)
def test_profile_data_table(methods, title, plain):
    rows = [{"method": m, "padding_waste": 0.5, "straggler_p95": 0.1} for m in methods]
    rows.append({"method": plain, "padding_waste": 0.1, "straggler_p95": 0.0})
    assert shown(plain) in rendered(profile_table({"rows": rows}, title))


@SETTINGS
@given(st.lists(TEXT, min_size=2, max_size=3, unique=True))
@example(["[/bold]", "a[red]b", "\\"])
def test_comparison_and_verdict_tables(arms):
    trials = [TrialRun(run_id=f"{arm}-{seed}", arm=arm, seed=str(seed),
                       metrics={k: v * (1 + 0.01 * i + 0.001 * seed) for k, v in METRICS.items()})
              for i, arm in enumerate(arms) for seed in range(2)]
    cmp = compare_trials(trials, arms[0])
    cmp.verdicts = check_gates(cmp, Gates(max_ne_regression_pct=0.1, max_auc_drop=0.01,
                                          max_qps_drop_pct=5.0))
    out = rendered(*comparison_tables(cmp), verdict_table(cmp))
    for arm in arms:
        if arm.isascii() and arm.isprintable() and arm.strip() == arm and arm:
            assert shown(arm) in out


@SETTINGS
@given(st.lists(TEXT, min_size=1, max_size=3), TEXT, PLAIN)
def test_step_profile(kernels, recipe, plain):
    top = [KernelRow(name=k, kind=k, ms_per_step=1.0, calls_per_step=2.0, share=0.5)
           for k in [*kernels, plain]]
    result = StepProfile(recipe=recipe, precision="bf16", device="cpu", environment={},
                         active_steps=2, step_ms=10.0, busy_ms=5.0, busy_fraction=0.5,
                         by_kind={k: 1.0 for k in kernels}, top=top)
    out = io.StringIO()
    render_profile(result, Console(file=out, width=400))
    if len(plain) <= 70:
        assert plain in out.getvalue()


@SETTINGS
@given(TEXT, TEXT)
@example("closing tag [/bold] here", "[red]fix")
def test_error_paragraph(problem, fix):
    out = io.StringIO()
    saved = render.err_console
    render.err_console = Console(file=out, width=400)
    try:
        render.error(problem, fix)
    finally:
        render.err_console = saved
    if problem.isascii() and problem.isprintable():
        assert shown(problem).strip() in out.getvalue().replace("\n", "")


@SETTINGS
@given(st.lists(TEXT, max_size=5), st.booleans())
@example(["[/bold]", "step 1/2 loss [/] ne_ctr x"], True)
def test_progress_lines(lines, terminal):
    out = io.StringIO()
    con = Console(file=out, force_terminal=terminal, width=120)
    with TrainingProgress(con, "run", trials=2 if terminal else None) as progress:
        for line in lines:
            progress.echo(line)
            progress.echo(TrialProgress(f"{line.split(']')[0] or 'a'} seed 0",
                                        StepProgress(1, 2, 0.5, 0.9, 10.0)))
