"""gemctl bench quality: each arm's learning curve from a real (tiny) training, the target
every arm reached, and the training seconds and samples to it."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from gem_bench.quality import QualityArm, pick_target, place_target
from gemctl.main import app
from tests.tiny_training import tiny_tree


def _arm(name: str, nes: list[float], error: str | None = None) -> QualityArm:
    curve = [{"step": 10 * (i + 1), "samples": 100.0 * (i + 1), "train_s": 2.0 * (i + 1),
              "ne_ctr": ne} for i, ne in enumerate(nes)]
    return QualityArm(name=name, overrides=[], curve=curve, error=error)


def test_default_target_is_the_worst_of_the_arms_best():
    arms = [_arm("ours", [0.99, 0.90, 0.85]), _arm("off_the_shelf", [1.0, 0.95, 0.93]),
            _arm("broken", [], error="RuntimeError: out of memory")]
    assert pick_target(arms, None) == (0.93, "worst of the arms' best")
    assert pick_target(arms, 0.9) == (0.9, "given")
    assert pick_target([_arm("x", [], "boom")], None) == (None, "no arm evaluated")


def test_time_to_target_is_interpolated_and_never_where_not_reached():
    fast, slow = _arm("ours", [0.99, 0.90, 0.85]), _arm("base", [1.0, 0.95, 0.93])
    place_target([fast, slow], 0.94)
    # ours crosses 0.94 between its first two evaluations: (0.99 - 0.94) / (0.99 - 0.90)
    frac = 0.05 / 0.09
    assert fast.train_s_to_target == pytest.approx(2.0 + 2.0 * frac)
    assert fast.samples_to_target == pytest.approx(100 + 100 * frac)
    assert slow.train_s_to_target == pytest.approx(4.0 + 2.0 * 0.5)
    place_target([slow], 0.5)
    assert slow.train_s_to_target is None and slow.samples_to_target is None


def test_memory_cell_shows_the_peak_and_what_a_budget_kept():
    from gem_bench.quality import _memory

    assert _memory({}) == "-"
    assert _memory({"peak_memory_gb": 68.34}) == "68.3"
    assert _memory({"peak_memory_gb": 68.34, "activations_kept_gb": 41.66}) == "68.3 (41.7)"


def test_start_up_and_steady_time_split_the_time_to_target():
    arm = _arm("ours", [0.99, 0.90, 0.85])  # 300 samples in 6 training seconds
    arm.train_s, arm.samples_per_s = 6.0, 100.0  # steady: the 300 samples alone take 3 s
    assert arm.startup_s == pytest.approx(3.0)
    place_target([arm], 0.90)
    assert arm.samples_to_target == pytest.approx(200)
    assert arm.steady_s_to_target == pytest.approx(2.0)  # 200 samples at 100/s
    unreached = _arm("base", [1.0])
    assert unreached.steady_s_to_target is None and math.isnan(unreached.startup_s)


@pytest.mark.slow
def test_quality_bench_trains_each_arm_and_writes_its_curve(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tree = tiny_tree(tmp_path / "data", seq_layers=1, steps=8, log_every=2, eval_sample=64)
    (tmp_path / "tiny.yaml").write_text(json.dumps(tree))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["bench", "quality", "tiny.yaml", "--arms",
                                      "ours,off_the_shelf", "--evals", "4", "--same-process",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "train s to target" in result.output and "steady s to target" in result.output
    assert "GDPA tuning s" in result.output
    (path,) = out.glob("quality_tiny_*.json")
    record = json.loads(path.read_text())
    assert [a["name"] for a in record["arms"]] == ["ours", "off_the_shelf"]
    for arm in record["arms"]:
        assert arm["error"] is None
        assert [p["step"] for p in arm["curve"]] == [2, 4, 6, 8]  # the last: the final eval
        assert all(math.isfinite(p["ne_ctr"]) for p in arm["curve"])
        assert arm["samples_per_s"] > 0
        assert arm["steady_s_to_target"] == pytest.approx(
            arm["samples_to_target"] / arm["samples_per_s"])
        assert arm["startup_s"] == pytest.approx(
            arm["train_s"] - arm["curve"][-1]["samples"] / arm["samples_per_s"])
        # what the start-up was made of (no Triton or GDPA tuning on CPU)
        assert set(arm["compiling"]) == {"compile_s_torch", "compile_s_triton",
                                         "triton_kernels_compiled", "tuning_s_gdpa"}
        assert arm["compiling"]["triton_kernels_compiled"] == 0
        assert arm["memory"] == {}  # no device peak on CPU, no activation budget set
    # the default target is reached by every arm, by construction
    assert all(a["train_s_to_target"] is not None for a in record["arms"])
    assert record["ceiling"]["ctr"] > 0.5


def test_quality_bench_refuses_a_target_no_run_can_reach(tmp_path):
    result = CliRunner().invoke(app, ["bench", "quality", "recipes/demo.yaml",
                                      "--target-ne", "-1"])
    assert result.exit_code == 2
    assert "--target-ne" in result.output


@pytest.mark.slow
def test_arms_added_to_an_earlier_result_share_its_target(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tree = tiny_tree(tmp_path / "data", seq_layers=1, steps=4, log_every=2, eval_sample=64)
    (tmp_path / "tiny.yaml").write_text(json.dumps(tree))
    first, second = tmp_path / "first", tmp_path / "second"
    run = CliRunner().invoke
    args = ["bench", "quality", "tiny.yaml", "--evals", "2", "--same-process"]
    assert run(app, [*args, "--arms", "ours", "--out", str(first)]).exit_code == 0
    (earlier,) = first.glob("quality_tiny_*.json")
    result = run(app, [*args, "--arms", "off_the_shelf", "--add-to", str(earlier),
                       "--out", str(second)])
    assert result.exit_code == 0, result.output
    record = json.loads((second / earlier.name).read_text())
    assert [a["name"] for a in record["arms"]] == ["ours", "off_the_shelf"]
    kept = json.loads(earlier.read_text())["arms"][0]
    assert record["arms"][0]["curve"] == kept["curve"]  # not trained again
    assert record["target_source"] == "worst of the arms' best"
    assert record["target_ne"] == pytest.approx(max(
        min(p["ne_ctr"] for p in a["curve"]) for a in record["arms"]))
    # another recipe (here another schedule) cannot join: its curve answers another question
    refused = run(app, [*args, "--arms", "off_the_shelf", "--add-to", str(earlier),
                        "--set", "train.steps=6", "--out", str(second)])
    assert refused.exit_code == 2 and "train" in refused.output
    missing = run(app, [*args, "--add-to", "nowhere.json"])
    assert missing.exit_code == 2 and "no such file" in missing.output
