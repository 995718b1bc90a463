"""The learning checks on fed curves (each warning fires where it should and stays quiet where
it should not), the share of the planted ceiling's AUC lift, and time to a target NE."""

from __future__ import annotations

import math
import pickle

import pytest

from gem_platform.train.learning import (
    EvalPoint,
    LearningCurve,
    TaskQuality,
    check,
    curve_for,
    lift_share,
    time_to_target,
)
from gem_platform.train.learning_report import (
    epochs_line,
    eval_point,
    eval_progress,
    precision_line,
    summary_entries,
)
from gem_platform.train.state import LoopState


def point(step: int, ne: float, train_ne: float = 0.9, calibration: float = 1.0,
          auc: float = 0.7, ne_cvr: float = 0.9) -> EvalPoint:
    return EvalPoint(step, step * 100.0, step * 2.0, train_ne,
                     {"ctr": TaskQuality(ne, auc, calibration),
                      "cvr": TaskQuality(ne_cvr, 0.6, 1.0)}, 4096)


def codes(points: list[EvalPoint]) -> set[str]:
    return {w.key for w in check(points)}


# -- held-out NE >= 1 --------------------------------------------------------------------------

def test_ne_at_or_above_one_warns_per_task():
    assert codes([point(10, 1.0)]) == {"warn/ne_above_one_ctr"}
    assert codes([point(10, 0.95, ne_cvr=1.3)]) == {"warn/ne_above_one_cvr"}
    (warning,) = check([point(10, 1.47)])
    assert "1.470 >= 1 at step 10" in warning.message and "base rate" in warning.message
    assert "train.lr" in warning.message  # what to try


def test_ne_below_one_or_nan_is_quiet():
    assert codes([point(10, 0.999)]) == set()
    assert codes([point(10, math.nan)]) == set()
    assert check([]) == []


# -- memorization ------------------------------------------------------------------------------

# held-out NE down then up twice, train NE falling: the second-epoch picture
MEMORIZING = [point(100, 0.99, 0.99), point(200, 0.98, 0.98), point(300, 1.05, 0.77),
              point(400, 1.20, 0.45)]


def test_memorization_fires_on_two_rises_while_train_falls():
    warnings = check(MEMORIZING)
    assert "warn/memorization_ctr" in {w.key for w in warnings}
    (memo,) = [w for w in warnings if w.code == "memorization"]
    assert memo.step == 400
    assert "0.980 -> 1.200" in memo.message and "0.980 -> 0.450" in memo.message
    assert "memorizes" in memo.message and "data.synthetic.num_samples" in memo.message


def test_memorization_fires_on_a_small_steady_rise():
    curve = [point(100, 0.95, 0.99), point(200, 0.96, 0.97), point(300, 0.97, 0.95)]
    assert "warn/memorization_ctr" in codes(curve)


@pytest.mark.parametrize("curve", [
    MEMORIZING[:3],  # one rise only
    [point(100, 0.98, 0.99), point(200, 1.05, 0.77), point(300, 1.04, 0.45)],  # rise, fall
    [point(100, 0.950, 0.99), point(200, 0.952, 0.90), point(300, 0.955, 0.80)],  # noise
    [point(100, 0.98, 0.80), point(200, 1.05, 0.85), point(300, 1.20, 0.90)],  # train rises
    [point(100, 0.98, 0.90), point(200, 1.05, 0.90), point(300, 1.20, 0.895)],  # train flat
    [point(100, 0.98, math.nan), point(200, 1.05, 0.7), point(300, 1.2, 0.5)],  # no train NE
], ids=["one-rise", "rise-fall", "noise", "train-rises", "train-flat", "no-train-ne"])
def test_memorization_quiet(curve):
    assert "warn/memorization_ctr" not in codes(curve)


def test_memorization_is_kept_in_the_summary_after_held_out_levels_off():
    curve = LearningCurve()
    for p in [*MEMORIZING, point(500, 1.19, 0.40)]:
        curve.add(p)
    assert "warn/memorization_ctr" not in codes(curve.points)  # not at the last eval
    entries = summary_entries(curve, 1000.0, None, None)
    assert entries["warn/memorization_ctr"] == 1.0
    assert entries["warn/ne_above_one_ctr"] == 1.0 and entries["warn/miscalibrated_ctr"] == 0.0
    assert any("memorizes" in m for m in entries["quality/warnings"])


# -- calibration -------------------------------------------------------------------------------

@pytest.mark.parametrize(("calibration", "fires"), [
    (1.0, False), (0.8, False), (1.25, False), (0.79, True), (1.26, True), (1.45, True),
    (math.nan, False)])
def test_calibration_far_from_one(calibration, fires):
    warnings = [w for w in check([point(10, 0.9, calibration=calibration)])
                if w.code == "miscalibrated"]
    assert bool(warnings) == fires
    if fires:
        many = "too many" if calibration > 1 else "too few"
        assert many in warnings[0].message and "predicted / observed" in warnings[0].message


def test_a_warning_is_announced_once():
    curve = LearningCurve()
    _, new = curve.add(point(10, 1.1))
    assert [w.key for w in new] == ["warn/ne_above_one_ctr"]
    curve.add(point(20, 0.9))
    firing, new = curve.add(point(30, 1.05))
    assert [w.key for w in firing] == ["warn/ne_above_one_ctr"] and new == []


# -- ceiling share -----------------------------------------------------------------------------

def test_lift_share():
    assert lift_share(0.81, 0.81) == pytest.approx(1.0)
    assert lift_share(0.5, 0.81) == pytest.approx(0.0)
    assert lift_share(0.553, 0.810) == pytest.approx(0.053 / 0.31)
    assert lift_share(0.45, 0.8) == pytest.approx(-0.05 / 0.3)  # worse than random
    assert math.isnan(lift_share(0.7, 0.5)) and math.isnan(lift_share(math.nan, 0.8))


# -- time to quality ---------------------------------------------------------------------------

CURVE = [(100, 1000.0, 10.0, 0.99), (200, 2000.0, 20.0, 0.95), (300, 3000.0, 30.0, 0.91),
         (400, 4000.0, 40.0, 0.89)]


def test_time_to_target_interpolates_between_evaluations():
    got = time_to_target(CURVE, 0.90)
    assert got is not None
    # 0.91 at 30 s and 0.89 at 40 s: 0.90 halfway
    assert (got.step, got.samples, got.train_s) == pytest.approx((350, 3500.0, 35.0))
    exact = time_to_target(CURVE, 0.95)
    assert (exact.step, exact.samples, exact.train_s) == pytest.approx((200, 2000.0, 20.0))


def test_time_to_target_first_crossing_edges_and_order():
    first = time_to_target(CURVE, 1.2)  # already met at the first evaluation
    assert (first.samples, first.train_s) == (1000.0, 10.0)
    assert time_to_target(CURVE, 0.5) is None
    assert time_to_target([], 0.9) is None
    # a later dip back above the target does not move the first crossing; order and NaN
    wobbly = [CURVE[3], (500, 5000.0, 50.0, 0.93), (150, 1500.0, 15.0, math.nan), *CURVE[:3]]
    got = time_to_target(wobbly, 0.90)
    assert got.train_s == pytest.approx(35.0)


def test_time_to_target_reads_the_summary_curve():
    curve = LearningCurve()
    for p in (point(100, 0.99), point(200, 0.95), point(300, 0.91)):
        curve.add(p)
    entries = summary_entries(curve, 600.0, 0.93, {"ctr": 0.81, "cvr": 0.7})
    assert entries["quality/reached_target"] == 1.0
    assert entries["quality/train_s_to_target"] == pytest.approx(500.0)  # 400 s + half of 200
    assert entries["quality/samples_to_target"] == pytest.approx(25000.0)
    assert entries["eval/auc_lift_share_ctr"] == pytest.approx(0.2 / 0.31)
    # a benchmark recomputes it for another target from the summary JSON alone
    back = [EvalPoint.from_json(p) for p in entries["quality/eval_curve"]]
    assert back == curve.points
    assert time_to_target(curve_for(back), 0.95).train_s == pytest.approx(400.0)
    missed = summary_entries(curve, 600.0, 0.5, None)
    assert missed["quality/reached_target"] == 0.0
    assert math.isnan(missed["quality/train_s_to_target"])


def test_a_checkpoint_written_before_the_curve_existed_still_loads():
    state = LoopState(step=7)
    saved = pickle.dumps(state)
    state.__dict__.pop("curve")
    state.__dict__.pop("since_eval")
    old = pickle.loads(pickle.dumps(state))
    assert old.step == 7 and old.curve.points == [] and old.since_eval.count == 0
    assert pickle.loads(saved).curve.points == []


def test_a_run_past_one_epoch_is_warned_before_it_starts():
    assert epochs_line(350, 351) is None and epochs_line(351, 351) is None
    line = epochs_line(700, 390)
    assert line.startswith("warning: train.steps=700 covers 1.8 epochs")
    assert "(390 steps each)" in line and "data.synthetic.num_samples" in line


def test_the_training_loop_says_it_before_the_first_step(tmp_path, monkeypatch):
    from gem_platform.recipe import recipe_from_dict
    from gem_platform.train.loop import train
    from tests.tiny_training import tiny_tree

    monkeypatch.chdir(tmp_path)
    lines: list[str] = []
    tree = tiny_tree(tmp_path / "data", seq_layers=1, steps=20, eval_every=0, log_every=20)
    train(recipe_from_dict(tree), echo=lambda line: lines.append(str(line)))
    warned = [i for i, line in enumerate(lines) if "epochs of the training split" in line]
    steps = [i for i, line in enumerate(lines) if line.lstrip().startswith("step")]
    assert len(warned) == 1 and steps and warned[0] < steps[0]
    assert "train.steps=20 covers 1.2 epochs" in lines[warned[0]]


# -- the precision of an evaluation ------------------------------------------------------------

def test_standard_errors_ride_the_curve_and_its_json():
    scores = {"eval/ne_ctr": 0.9, "eval/auc_ctr": 0.7, "eval/calibration_ctr": 1.0,
              "eval_se/ne_ctr": 0.004, "eval_se/auc_ctr": 0.015, "eval/count_ctr": 2048.0}
    p = eval_point(scores, ["ctr"], 10, 1000.0, 5.0, 0.95)
    assert p.tasks["ctr"] == TaskQuality(0.9, 0.7, 1.0, 0.004, 0.015)
    assert EvalPoint.from_json(p.to_json()) == p
    # a curve written before the errors were recorded reads back with them unknown
    old = {k: v for k, v in p.to_json().items() if not k.startswith("se_")}
    back = EvalPoint.from_json(old).tasks["ctr"]
    assert (back.ne, back.auc) == (0.9, 0.7) and math.isnan(back.se_ne)
    shown = str(eval_progress(p, 20, None))
    assert "held-out ne_ctr 0.9000±0.0078" in shown and "auc_ctr 0.7000±0.029" in shown
    assert "±" not in str(eval_progress(EvalPoint.from_json(old), 20, None))


def test_a_small_scheduled_sample_is_noted_with_its_intervals():
    coarse = EvalPoint(10, 1e3, 5.0, 0.95, {"ctr": TaskQuality(0.9, 0.7, 1.0, 0.004, 0.015),
                                            "cvr": TaskQuality(0.95, 0.6, 1.0, 0.01, 0.036)},
                       2048)
    note = precision_line(coarse)
    assert note.startswith("note: scheduled evaluations score the same 2,048 held-out samples")
    assert "ctr AUC ±0.029 NE ±0.0078, cvr AUC ±0.071 NE ±0.0196" in note
    assert "train.eval_sample" in note
    fine = EvalPoint(10, 1e3, 5.0, 0.95, {"ctr": TaskQuality(0.9, 0.7, 1.0, 0.001, 0.004)}, 40000)
    assert precision_line(fine) is None
    assert precision_line(point(10, 0.9)) is None  # errors not known: nothing to say
