"""gemctl bench quality-targets: a time-to-quality result read at several targets, and the run
length beyond which a build that starts slower but trains faster is ahead."""

from __future__ import annotations

import itertools
import json

import pytest
from typer.testing import CliRunner

from gem_bench.quality import QualityArm, load_result
from gem_bench.quality_targets import at_target, break_even_samples, default_targets
from gemctl.main import app
from tests.conftest import REPO

H100_RESULT = REPO / "docs/quality/quality_h200_gem_h100.json"
H200_RESULT = REPO / "docs/quality/quality_h200_gem.json"


def _arm(name: str, samples_per_s: float, startup_s: float) -> QualityArm:
    """An arm that trained 1,000 samples at ``samples_per_s`` after ``startup_s``."""
    arm = QualityArm(name=name, overrides=[], samples_per_s=samples_per_s,
                     train_s=startup_s + 1000 / samples_per_s)
    arm.curve = [{"step": 10, "samples": 1000.0, "train_s": arm.train_s, "ne_ctr": 0.9}]
    return arm


def test_break_even_is_the_start_up_difference_over_the_per_sample_gain():
    ours, theirs = _arm("ours", 200.0, 10.0), _arm("base", 100.0, 4.0)
    # 6 s more start-up, 1/100 - 1/200 = 0.005 s saved a sample: even after 1,200 samples
    assert break_even_samples(ours, theirs) == pytest.approx(1200)
    assert break_even_samples(ours, _arm("slow_start", 100.0, 20.0)) == 0.0
    assert break_even_samples(ours, _arm("faster", 400.0, 1.0)) is None


def test_the_committed_gem_width_result_turns_between_its_targets():
    """docs/quality/quality_h200_gem_h100.json (one H100, 880 steps): the compiled
    off-the-shelf build starts 55 s sooner, so it reaches NE 0.90 first; ours trains 1.33x
    the samples a second and reaches the worst of the arms' best NE first, after the run
    length where its start-up is repaid."""
    result = load_result(H100_RESULT, option="result")
    assert default_targets(result) == pytest.approx([0.90, 0.8735], abs=1e-4)
    easy, hard = (at_target(result, t) for t in default_targets(result))
    by_arm = {row.arm: row for row in easy}
    assert by_arm["off_the_shelf_compiled"].vs_ours < 1
    by_arm_hard = {row.arm: row for row in hard}
    assert by_arm_hard["off_the_shelf_compiled"].vs_ours > 1.1
    ours, base = (next(a for a in result.arms if a.name == n)
                  for n in ("ours", "off_the_shelf_compiled"))
    turn = break_even_samples(ours, base)
    assert by_arm["ours"].samples < turn < by_arm_hard["ours"].samples
    assert {r.arm: r.train_s is None for r in at_target(result, 0.87)} == {
        "ours": False, "off_the_shelf_compiled": True}


def test_the_committed_h200_result_meets_the_recipe_targets_at_its_speed():
    """docs/quality/quality_h200_gem.json (one H200, the recipe as shipped, 880 steps): ours
    learns to the recipe's targets (NE <= 0.90, >= 80% of the planted lift, better at every
    evaluation) at >= 38% E2E MFU, and reaches NE 0.90 sooner than the strong off-the-shelf
    build trained after it on the same machine and data."""
    result = load_result(H200_RESULT, option="result")
    assert result.environment["device"] == "NVIDIA H200"
    ours, base = (next(a for a in result.arms if a.name == n)
                  for n in ("ours", "off_the_shelf_compiled"))
    assert ours.final["eval/ne_ctr"] <= 0.90 and ours.final["eval/auc_lift_share_ctr"] >= 0.80
    for before, after in itertools.pairwise(ours.curve):
        assert after["ne_ctr"] < before["ne_ctr"] and after["auc_ctr"] > before["auc_ctr"]
    assert ours.mfu_e2e >= 0.38 and ours.samples_per_s > 1.3 * base.samples_per_s
    by_arm = {row.arm: row for row in at_target(result, 0.90)}
    assert by_arm["off_the_shelf_compiled"].vs_ours > 1.1


def test_the_command_prints_json_and_refuses_what_it_cannot_read(tmp_path):
    runner = CliRunner()
    out = runner.invoke(app, ["bench", "quality-targets", str(H100_RESULT), "--target-ne",
                              "0.88", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert list(data["targets"]) == ["0.8800"]
    assert data["ours_ahead_beyond_samples"]["off_the_shelf_compiled"] > 0
    missing = runner.invoke(app, ["bench", "quality-targets", str(tmp_path / "none.json")])
    assert missing.exit_code == 2 and "no such file" in missing.output
    (tmp_path / "bad.json").write_text("{}")
    bad = runner.invoke(app, ["bench", "quality-targets", str(tmp_path / "bad.json")])
    assert bad.exit_code == 2 and "no gemctl bench quality result" in bad.output
    unreachable = runner.invoke(app, ["bench", "quality-targets", str(H100_RESULT),
                                      "--target-ne", "-1"])
    assert unreachable.exit_code == 2 and "no NE a run can reach" in unreachable.output


def test_an_arm_without_its_speed_figures_is_unknown_not_never(tmp_path):
    """An arm whose samples/s was not measured has no start-up either: the view says the
    comparison is unknown, and its JSON holds null, not NaN."""
    from gem_bench.quality import QualityResult, write

    ours, theirs = _arm("ours", 200.0, 10.0), _arm("off_the_shelf", 100.0, 4.0)
    theirs.samples_per_s = float("nan")
    result = QualityResult(recipe="tiny", target_ne=0.95, target_source="given", ceiling={},
                           arms=[ours, theirs], resolved_recipe={"model": {"attention": "full"}},
                           environment={"device": "cpu"})
    path = write(result, tmp_path)
    runner = CliRunner()
    shown = runner.invoke(app, ["bench", "quality-targets", str(path)])
    assert shown.exit_code == 0 and "unknown" in shown.output, shown.output
    data = json.loads(runner.invoke(app, ["bench", "quality-targets", str(path), "--json"]
                                    ).output, parse_constant=pytest.fail)
    assert data["arms"]["off_the_shelf"]["samples_per_s"] is None
    assert data["ours_ahead_beyond_samples"] == {"off_the_shelf": None}
