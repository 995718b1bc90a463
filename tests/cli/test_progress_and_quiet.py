"""The progress display (bars in a terminal, plain lines with elapsed and ETA elsewhere) and the
routing of library output to a log file while gemctl's own output keeps the terminal."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import textwrap
from dataclasses import replace

from rich.console import Console

from gem_platform.progress import (
    EvalProgress,
    StepProgress,
    TaskScores,
    TrialDone,
    TrialProgress,
)
from gemctl.progress import TrainingProgress
from tests.cli.conftest import REPO

LINE = "step     4/10  loss 0.6931  ne_ctr 0.9876  samples/s 1234  straggler 3.0%"
STEP = StepProgress(4, 10, 0.6931, 0.9876, 1234.0, 0.03)
ANSI = re.compile(r"\x1b\[")


def step(n: int) -> StepProgress:
    return replace(STEP, step=n)


def test_a_step_event_is_the_loops_line_in_a_log():
    assert str(STEP) == LINE


def test_plain_lines_when_not_a_terminal():
    out = io.StringIO()
    with TrainingProgress(Console(file=out, width=120), "run") as progress:
        progress.echo(STEP)
        progress.echo("resumed from step 4")
        progress.echo(step(6))
    text = out.getvalue()
    assert not ANSI.search(text)
    lines = text.splitlines()
    assert lines[0].startswith(
        "step  4/10  loss 0.6931  train ne 0.9876  1,234 samples/s  elapsed ")
    assert " eta " in lines[0] and lines[1] == "resumed from step 4"
    assert lines[2].startswith("step  6/10")


EVAL_LINE = ("eval step     4/10  held-out ne_ctr 1.4700  train ne_ctr 0.3820  "
             "held-out ne_cvr 1.3300  auc_ctr 0.5530 (17% of planted lift)  auc_cvr 0.5690  "
             "calibration_ctr 1.45  calibration_cvr 1.20")
EVAL = EvalProgress(4, 10, 0.382, {"ctr": TaskScores(1.47, 0.553, 1.45, 0.17),
                                   "cvr": TaskScores(1.33, 0.569, 1.2)})


def test_held_out_ne_beside_train_ne_in_plain_lines():
    assert str(EVAL) == EVAL_LINE and EVAL.held_out_ne == 1.47
    out = io.StringIO()
    with TrainingProgress(Console(file=out, width=300), "run") as progress:
        progress.echo(EVAL)
        progress.echo("warning: held-out NE ctr 1.470 >= 1 at step 4: ...")
        progress.echo(step(6))
    lines = out.getvalue().splitlines()
    assert lines[:2] == [EVAL_LINE, "warning: held-out NE ctr 1.470 >= 1 at step 4: ..."]
    assert lines[2].startswith("step  6/10  loss 0.6931  train ne 0.9876  held-out ne 1.4700  ")


def test_held_out_ne_on_the_bars_and_per_trial():
    out = io.StringIO()
    with TrainingProgress(Console(file=out, force_terminal=True, width=200), "run") as progress:
        progress.echo(EVAL)
        progress.echo(step(6))
    text = ANSI.sub("", out.getvalue())
    assert "held-out ne_ctr 1.4700" in text and "held-out ne 1.4700" in text
    out = io.StringIO()
    with TrainingProgress(Console(file=out, width=300), "sweep", trials=2) as progress:
        progress.echo(TrialProgress("bf16 seed 0", EVAL))
        progress.echo(TrialProgress("bf16 seed 0", STEP))
        progress.echo(TrialProgress("fp8 seed 0", STEP))
    text = out.getvalue()
    assert f"[bf16 seed 0] {EVAL_LINE}" in text
    assert "[bf16 seed 0] step  4/10  loss 0.6931  train ne 0.9876  held-out ne 1.4700" in text
    assert "[fp8 seed 0] step  4/10  loss 0.6931  train ne 0.9876  1,234" in text


def test_bars_in_a_terminal():
    out = io.StringIO()
    con = Console(file=out, force_terminal=True, width=160)
    with TrainingProgress(con, "run") as progress:
        progress.echo(STEP)
    text = ANSI.sub("", out.getvalue())
    assert "4/10" in text and "loss 0.6931" in text and "eta" in text and "elapsed" in text


def test_sweep_trials_and_overall():
    out = io.StringIO()
    with TrainingProgress(Console(file=out, width=160), "sweep", trials=2) as progress:
        progress.echo(TrialProgress("bf16 seed 0", STEP))
        progress.echo(TrialDone("bf16 seed 0", "finished", 0.9, 0.7, "run x"))
        progress.echo(TrialDone("fp8 seed 0", "kept", where="out.json"))
    text = out.getvalue()
    assert "[bf16 seed 0] step  4/10" in text
    assert "trial bf16 seed 0 finished: NE ctr 0.9000, AUC ctr 0.7000 (run x)" in text
    assert "trial fp8 seed 0 already in out.json, kept" in text
    assert "trials 1/2 done" in text and "trials 2/2 done" in text


def test_a_trial_trained_again_restarts_its_clock(monkeypatch):
    """A trial that trains again (out of memory beside others) reports step 1 after step 5:
    its elapsed time and ETA count from the new attempt, not the first one's start."""
    now = [0.0]
    monkeypatch.setattr("gemctl.progress.time.monotonic", lambda: now[0])
    out = io.StringIO()
    with TrainingProgress(Console(file=out, width=200), "sweep", trials=1, plain=True) as progress:
        for t, n in ((0, 1), (100, 5), (200, 1), (204, 5)):  # 25 s a step, then 1 s a step
            now[0] = t
            progress.echo(TrialProgress("fp8 seed 3", step(n)))
    last = out.getvalue().strip().splitlines()[-1]
    assert last.startswith("[fp8 seed 3] step  5/10") and last.endswith("elapsed 0:04  eta 0:05")
    bars = TrainingProgress(Console(file=io.StringIO(), width=200), "sweep", trials=1,
                            plain=False)
    with bars:
        for n in (1, 5, 1):
            bars.echo(TrialProgress("fp8 seed 3", step(n)))
        task = bars._bars.tasks[-1]  # the trial's bar starts again too
        assert task.completed == 1 and len(task._progress) == 1  # one sample: its own


def test_the_loop_sends_typed_events(tmp_path):
    """A real in-process run: one StepProgress per logged step and an EvalProgress per
    evaluation reach the callback as objects, not text."""
    from tests.tiny_training import tiny_tree, train_losses

    events: list = []
    train_losses(tiny_tree(tmp_path / "data", steps=4, eval_every=2), echo=events.append)
    steps = [e for e in events if isinstance(e, StepProgress)]
    evals = [e for e in events if isinstance(e, EvalProgress)]
    assert [e.step for e in steps] == [1, 2, 3, 4] and {e.total for e in steps} == {4}
    assert all(e.samples_per_s > 0 and e.loss == e.loss for e in steps)
    assert [e.step for e in evals] == [2, 4] and evals[-1].held_out_ne is not None


ROUTED = textwrap.dedent("""
    import logging, os, sys, warnings
    sys.path[:0] = [{root!r}, {platform!r}]
    from gemctl import render
    from gemctl.quiet import LibraryOutput
    with LibraryOutput("t", verbose={verbose}) as lib:
        os.write(1, b"C-level banner\\n")
        os.write(2, b"C-level warning\\n")
        print("library print")
        warnings.warn("a deprecation")
        logging.getLogger("mlflow").warning("INFO-like line")
        render.console.print("[green]shown[/]")
        render.print_json({{"ok": 1}})
    print("after", lib.path)
""")


def _run(tmp_path, verbose: bool) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "routed.py"
    script.write_text(ROUTED.format(root=str(REPO), platform=str(REPO / "platform"),
                                    verbose=verbose))
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)


def test_library_output_goes_to_the_log(tmp_path):
    proc = _run(tmp_path, verbose=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[:2] == ["shown", "{"]
    assert '"ok": 1' in proc.stdout
    for noise in ("C-level", "library print", "deprecation", "INFO-like"):
        assert noise not in proc.stdout + proc.stderr
    log = next((tmp_path / "gem_runs" / "logs").glob("t-*.log")).read_text()
    for noise in ("C-level banner", "C-level warning", "library print", "a deprecation",
                  "INFO-like line"):
        assert noise in log
    assert "after gem_runs/logs/t-" in proc.stdout


def test_verbose_leaves_library_output_alone(tmp_path):
    proc = _run(tmp_path, verbose=True)
    assert proc.returncode == 0, proc.stderr
    assert "C-level banner" in proc.stdout and "library print" in proc.stdout
    assert "a deprecation" in proc.stderr and not (tmp_path / "gem_runs").exists()


def test_profile_data_headers_fit_in_120_columns():
    """Every column of the real profile keeps a whole, distinct header at 120 columns."""
    import numpy as np

    from gem_platform.balance.config import LoaderConfig
    from gem_platform.balance.profile import profile_lengths
    from gemctl.inspect import profile_table

    lengths = np.random.default_rng(0).lognormal(4, 1, 4000).clip(1, 2048).astype(np.int64)
    cfg = LoaderConfig(local_batch_size=64, base_batch_size=16, buffer_full_batches=4)
    summary = profile_lengths(lengths, world=4, local_batch=64, cfg=cfg).to_dict()
    out = io.StringIO()
    Console(file=out, width=120).print(profile_table(summary, "profile"))
    text = out.getvalue()
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 120
    header = text.split("┡")[0]
    for column in summary["rows"][0]:
        for word in column.split("_"):
            assert word in header, (word, header)
