"""Scheduled held-out evaluation in a real (tiny) run: by default a run evaluates the fixed
held-out sample several times, and each evaluation lands in MLflow (eval/*, the train NE beside
it, warnings), in the run summary (the curve, time to target) and on the progress display."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from rich.console import Console

from gem_platform.errors import RecipeError
from gem_platform.launch import submit
from gem_platform.recipe import recipe_from_dict
from gem_platform.train.loop import train
from gemctl.progress import TrainingProgress
from gemctl.render import summary_tables
from tests.resume import crash_and_resume, losses_of
from tests.tiny_training import tiny_tree


def _history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_default_schedule_records_the_learning_curve(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # 6 steps, a progress line every 2: the default schedule evaluates at steps 2 and 4 on the
    # first 64 held-out samples, and the final evaluation at 6 on eval_max_samples (128)
    tree = tiny_tree(tmp_path / "data", seq_layers=1, steps=6, log_every=2, eval_sample=64,
                     target_ne=5.0)
    tree["tracking"] = {"uri": uri, "experiment": "learning"}
    events: list = []  # what the loop sent: typed events, text for the rest
    outcome = submit(recipe_from_dict(tree), local=True, echo=events.append)
    lines = [str(event) for event in events]
    summary = outcome.summary

    curve = summary["quality/eval_curve"]
    assert [p["step"] for p in curve] == [2, 4, 6]
    assert [p["eval_samples"] for p in curve] == [64, 64, 128]
    assert curve[0]["samples"] < curve[1]["samples"] < curve[2]["samples"]
    assert 0 < curve[0]["train_s"] < curve[1]["train_s"] < curve[2]["train_s"]
    assert summary["perf/train_s"] == pytest.approx(curve[-1]["train_s"])
    assert summary["eval/ne_ctr"] == pytest.approx(curve[-1]["ne_ctr"])
    # a target every evaluation meets: reached at the first one
    assert summary["quality/reached_target"] == 1.0
    assert summary["quality/train_s_to_target"] == pytest.approx(curve[0]["train_s"])
    share = (summary["eval/auc_ctr"] - 0.5) / (summary["planted/auc_ctr"] - 0.5)
    assert summary["eval/auc_lift_share_ctr"] == pytest.approx(share)

    client = MlflowClient(uri)
    run_id = outcome.run_id
    assert [s for s, _ in _history(client, run_id, "eval/ne_ctr")] == [2, 4, 6]
    assert [s for s, _ in _history(client, run_id, "train/ne_ctr_since_eval")] == [2, 4, 6]
    assert [s for s, _ in _history(client, run_id, "warn/memorization_ctr")] == [2, 4, 6]
    assert [s for s, _ in _history(client, run_id, "eval/auc_lift_share_ctr")] == [2, 4, 6]
    # the same samples at each scheduled evaluation: the same count and base rate
    counts = _history(client, run_id, "eval/count_ctr")
    rates = _history(client, run_id, "eval/base_rate_ctr")
    assert counts[0][1] == counts[1][1] == 64 and rates[0][1] == rates[1][1]
    seconds = _history(client, run_id, "perf/train_s")
    assert [v for _, v in seconds] == pytest.approx([p["train_s"] for p in curve])
    fired = [k.removeprefix("warn/") for k, v in summary.items()
             if k.startswith("warn/") and v == 1.0]
    tag = client.get_run(run_id).data.tags["gem.learning_warnings"]
    assert tag == (",".join(sorted(fired)) or "none")
    stored = json.loads(Path(client.download_artifacts(run_id, "summary.json")).read_text())
    assert [(p["step"], p["ne_ctr"], p["train_s"]) for p in stored["quality/eval_curve"]] == \
        [(p["step"], p["ne_ctr"], p["train_s"]) for p in curve]

    # the progress display: held-out NE beside train NE, evaluation and warning lines shown
    out = io.StringIO()
    with TrainingProgress(Console(file=out, width=200), "run") as progress:
        for event in events:
            progress.echo(event)
    shown = out.getvalue()
    assert "eval step     2/6  held-out ne_ctr" in shown
    held_out_2 = f"held-out ne {curve[0]['ne_ctr']:.4f}"
    assert any(row.startswith("step 4/6") and held_out_2 in row and "train ne " in row
               for row in shown.splitlines())
    warnings = [line for line in lines if line.startswith("warning: ")]
    assert all(line in shown for line in warnings)  # printed as they come
    # each score with its interval; 64 samples are too few to tell small changes: said once
    assert all(p["se_ne_ctr"] > 0 and p["se_auc_ctr"] > 0 for p in curve)
    assert [s for s, _ in _history(client, run_id, "eval_se/auc_ctr")] == [2, 4, 6]
    notes = [line for line in lines if line.startswith("note: scheduled evaluations")]
    assert len(notes) == 1 and "same 64 held-out samples" in notes[0] and notes[0] in shown
    assert f"auc_ctr {curve[0]['auc_ctr']:.4f}±{1.96 * curve[0]['se_auc_ctr']:.3f}" in shown

    # the summary tables: the curve and, if any, the warnings
    text = io.StringIO()
    for table in summary_tables(run_id, summary, uri):
        Console(file=text, width=160).print(table)
    rendered = text.getvalue()
    assert "learning curve" in rendered and "held-out ne ctr" in rendered
    assert "share of the ceiling's auc lift" in rendered and "time to ne <= 5.0000" in rendered
    assert ("learning warnings" in rendered) == bool(summary["quality/warnings"])


def test_eval_every_zero_evaluates_only_at_the_end(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tree = tiny_tree(tmp_path / "data", seq_layers=1, steps=3, eval_every=0)
    published: list[tuple[int, str]] = []
    summary = train(recipe_from_dict(tree), echo=lambda _: None,
                    sink=lambda m, s: published.extend((s, k) for k in m if k == "eval/ne_ctr"))
    assert [p["step"] for p in summary["quality/eval_curve"]] == [3]
    assert published == [(3, "eval/ne_ctr")]
    assert "quality/target_ne" not in summary  # no target set


def test_a_resumed_run_continues_its_learning_curve(tmp_path, monkeypatch):
    """The curve is part of the checkpoint: after a crash at step 5 and a resume from step 4,
    the summary's curve is the uninterrupted run's (evaluations at every step here)."""
    monkeypatch.chdir(tmp_path)
    recipe = recipe_from_dict(tiny_tree(tmp_path / "data", seq_layers=1, steps=6))
    _, straight = losses_of(recipe)
    _, resumed = crash_and_resume(recipe, tmp_path / "ckpts", every=2, keep=2, crash_after=5,
                                  expect_checkpoint=4)

    def untimed(summary: dict) -> list[tuple]:
        return [(p["step"], p["samples"], p["ne_ctr"], p["auc_ctr"], p["train_ne_ctr"])
                for p in summary["quality/eval_curve"]]

    assert [p[0] for p in untimed(resumed)] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(untimed(resumed), untimed(straight), strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    # training seconds keep counting from the checkpoint's
    seconds = [p["train_s"] for p in resumed["quality/eval_curve"]]
    assert seconds == sorted(seconds) and seconds[0] > 0


def test_stop_at_target_ends_training_at_the_first_evaluation_that_reaches_it(tmp_path):
    # every evaluation meets NE 5: the run stops at the first scheduled one (step 2 of 8), then
    # makes its final evaluation and summary with the steps it took
    tree = tiny_tree(tmp_path / "data", seq_layers=1, steps=8, log_every=2, eval_every=2,
                     eval_sample=64, target_ne=5.0, stop_at_target=True)
    lines: list[str] = []
    losses: list[int] = []
    summary = train(recipe_from_dict(tree), echo=lambda event: lines.append(str(event)),
                    sink=lambda m, s: losses.append(s) if "train/loss" in m else None)
    assert summary["train/steps"] == 2.0
    recipe = recipe_from_dict(tree)  # one rank: an epoch is its train split in local batches
    per_epoch = recipe.data.synthetic.num_train // recipe.loader.local_batch_size
    assert summary["train/epochs"] == pytest.approx(2 / per_epoch)
    # the final evaluation (on eval_max_samples) takes the stopping step's place in the curve
    assert [p["step"] for p in summary["quality/eval_curve"]] == [2]
    assert summary["quality/reached_target"] == 1.0
    assert max(losses) == 2
    assert any("reached train.target_ne 5.0: training stops here" in line for line in lines)
    # a target no evaluation meets trains every step
    tree["train"]["target_ne"] = 1e-6
    assert train(recipe_from_dict(tree), echo=lambda _: None)["train/steps"] == 8.0


@pytest.mark.parametrize("settings", [{"stop_at_target": True},
                                      {"stop_at_target": True, "target_ne": 0.9,
                                       "eval_every": 0}])
def test_stop_at_target_without_a_target_or_evaluations_is_refused(tmp_path, settings):
    tree = tiny_tree(tmp_path / "data", **settings)
    with pytest.raises(RecipeError, match="stop_at_target needs train.target_ne"):
        recipe_from_dict(tree)
