"""gemctl bench e2e on CPU: both arms train the same tiny recipe in one run, the result has
samples/s, MFU, the ratio and the step by kind of operator; the CLI writes the JSON."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from gem_bench.e2e import ARMS, arm_recipe, bench, write
from gem_platform.errors import GemError
from gem_platform.recipe import recipe_from_dict
from gemctl.main import app
from tests.tiny_training import TINY


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tree = yaml.safe_load(TINY.format(data=tmp_path / "data"))
    tree["model"].update(attention="full", seq_layers=1)
    tree["parallel"]["workers"] = 1
    return tmp_path, tree


@pytest.mark.slow
def test_both_arms_in_one_run(tiny):
    tmp_path, tree = tiny
    result = bench(recipe_from_dict(tree), warmup=1, steps=2, profiled=1, echo=lambda _: None,
                   isolate=False)
    assert [a.name for a in result.arms] == ["ours", "off_the_shelf"]
    ours, off = result.arms
    assert off.overrides == list(ARMS["off_the_shelf"].overrides)
    for a in result.arms:
        assert a.samples_per_s > 0 and 0 < a.mfu_e2e < 1 and a.step_ms > 0
        # CPU training: the thread computes the step, so its CPU time is most of the wall time
        assert 0.3 * a.step_ms < a.host_thread_ms <= a.host_process_ms + 1e-6
        assert a.by_kind_ms and "matmul" in a.by_kind_ms
        assert a.peak_memory_gb is None  # CPU: no device memory to report
    # the same model and batches: the same useful FLOPs per step
    assert ours.train_tflops_per_step == pytest.approx(off.train_tflops_per_step)
    assert result.speedup == pytest.approx(ours.samples_per_s / off.samples_per_s)
    data = json.loads(write(result, tmp_path / "out").read_text())
    assert data["recipe"] == "tiny" and data["attention"] == "full"
    assert data["timed_steps"] == 2 and len(data["arms"]) == 2


def test_arm_recipe_and_bad_arguments(tiny):
    _, tree = tiny
    recipe = recipe_from_dict(tree)
    r = arm_recipe(recipe, list(ARMS["off_the_shelf"].overrides), total_steps=7, warmup=3)
    assert (r.model.kernel, r.train.compile, r.train.prefetch_batches) == ("baseline", False, 0)
    assert r.train.steps == 7 and r.train.perf_warmup_steps == 3
    assert recipe.model.kernel == "auto"  # the recipe itself is untouched
    with pytest.raises(GemError, match="Unknown arm"):
        bench(recipe, 1, 1, 1, arms=["fastest"])
    with pytest.raises(GemError, match="steps=0"):
        bench(recipe, 1, 0, 1)


@pytest.mark.slow
def test_cli_writes_json(tiny):
    tmp_path, tree = tiny
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(tree))
    # the gemctl app in this process (the fixture's folder); each arm trains in a fresh one
    proc = CliRunner().invoke(app, ["bench", "e2e", "tiny.yaml", "--quick", "--out", "res",
                                    "--arms", "ours,off_the_shelf,ours_eager"])
    assert proc.exit_code == 0, (proc.exception, proc.stderr)
    assert "samples/s" in proc.stdout and "off_the_shelf" in proc.stdout
    data = json.loads((tmp_path / "res" / "e2e_tiny_full.json").read_text())
    assert data["warmup_steps"] == 3 and data["speedup"] > 0
    assert [a["name"] for a in data["arms"]] == ["ours", "off_the_shelf", "ours_eager"]
    assert data["arms"][2]["overrides"] == ["train.compile=false"]


def test_a_failed_arm_is_recorded_not_lost(tmp_path):
    from dataclasses import replace

    from rich.console import Console

    from gem_bench.e2e import E2EResult, failed_arm, render

    err = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
    arm = failed_arm("off_the_shelf", list(ARMS["off_the_shelf"].overrides), err)
    assert arm.error == "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"
    result = E2EResult(recipe="r", attention="full", precision="bf16", device="cuda:0",
                       environment={}, warmup_steps=1, timed_steps=1, profiled_steps=1,
                       local_batch=8, fused_tables=False, arms=[arm], speedup=None,
                       resolved_recipe={})
    console = Console(record=True, width=200)
    render(result, console)
    assert "out of memory" in console.export_text()
    # in an 80-column log, beside arms with long names, every figure stays whole
    ok = replace(arm, name="ours_deterministic", error=None, samples_per_s=25862.0,
                 mfu_e2e=0.132, step_ms=39.6)
    wide = replace(result, arms=[replace(ok, name="ours"), ok, replace(ok, name="ours_fp8_wgrad"),
                                 arm])
    console = Console(record=True, width=80)
    render(wide, console)
    text = console.export_text()
    assert text.count("25,862") == 3 and text.count("13.2%") == 3 and "39.6" in text
    data = json.loads(write(result, tmp_path).read_text())
    assert data["arms"][0]["error"].startswith("RuntimeError")


@pytest.mark.slow
def test_repeats_report_the_median_run(tiny):
    from dataclasses import replace

    from rich.console import Console

    from gem_bench.e2e import failed_arm, median_run, ratios_by_round, render

    tmp_path, tree = tiny
    recipe = recipe_from_dict(tree)
    result = bench(recipe, warmup=1, steps=1, profiled=1, arms=["ours"], echo=lambda _: None,
                   isolate=False, repeats=2)
    (ours,) = result.arms
    assert result.repeats == 2 and ours.name == "ours" and len(ours.runs_samples_per_s) == 2
    assert ours.samples_per_s == min(ours.runs_samples_per_s)  # the lower middle of two
    assert len(ours.runs_host_thread_ms) == 2 and all(h > 0 for h in ours.runs_host_thread_ms)
    assert ours.vs_ours_by_round == [1.0, 1.0]
    console = Console(record=True, width=250)
    render(result, console)
    text = console.export_text()
    assert "median of 2 runs per arm" in text and "1.00x" in text
    assert "vs ours, same round" in text and "median" in text
    # three runs, one failed: the median of the two that finished, the failure left out
    runs = [replace(ours, name="ours (run 1 of 3)", samples_per_s=30.0),
            failed_arm("ours", [], RuntimeError("died")),
            replace(ours, name="ours (run 3 of 3)", samples_per_s=10.0)]
    mid = median_run("ours", runs)
    assert (mid.name, mid.samples_per_s, mid.runs_samples_per_s) == ("ours", 10.0, [30.0, 10.0])
    assert median_run("ours", runs[1:2]).error == "RuntimeError: died"
    # round by round: a round where either run failed is left out
    other = [replace(ours, samples_per_s=15.0), replace(ours, samples_per_s=20.0),
             failed_arm("b", [], RuntimeError("died"))]
    assert ratios_by_round(other, runs) == [0.5]
    assert ratios_by_round(runs, runs) == [1.0, 1.0]
    with pytest.raises(GemError, match="name one arm twice"):
        bench(recipe, 1, 1, 1, arms=["ours", "ours"])
    with pytest.raises(GemError, match="repeats=0"):
        bench(recipe, 1, 1, 1, repeats=0)
