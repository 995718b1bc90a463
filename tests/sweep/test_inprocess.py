"""An in-process sweep (no Ray, no MLflow): a tiny recipe, two precisions x two seeds trained
one after another here, results in a JSON file that survives a cut-short run and resumes; then
the real `gemctl compare FILE.json` pairs the arms by seed and applies the gates."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gem_platform.errors import GemError
from gem_platform.sweep.config import load_sweep
from gem_platform.sweep.inprocess import run_in_process
from gem_platform.sweep.results import load_results
from tests.conftest import run_gemctl
from tests.sweep.test_spec import BASE

SPEC = """
name: prec
base: base.yaml
seeds: [0, 1]
baseline: fp32
arms:
  fp32: [precision.mode=fp32]
  bf16: [precision.mode=bf16]
"""


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("inprocess")
    (d / "base.yaml").write_text(BASE + "loader: {local_batch_size: 64, base_batch_size: 16}\n")
    (d / "prec.yaml").write_text(SPEC)
    out = d / "results.json"
    cmd = [sys.executable, "-m", "gem_platform.sweep.inprocess", "prec.yaml", "--out", str(out)]
    # seed 0 first (as if the sweep had been cut short), then the whole sweep resumes
    first = subprocess.run([*cmd, "--seeds", "0"], cwd=d, capture_output=True, text=True,
                           timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    assert len(load_results(out)[0]) == 2
    second = subprocess.run(cmd, cwd=d, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-2000:]
    assert second.stdout.count("already in") == 2  # seed 0's trials kept, not retrained
    return d


def test_results_hold_every_trial_once(swept):
    trials, header = load_results(swept / "results.json")
    assert sorted((t.arm, t.seed) for t in trials) == [("bf16", "0"), ("bf16", "1"),
                                                       ("fp32", "0"), ("fp32", "1")]
    assert header["baseline"] == "fp32" and header["sweep"] == "prec"
    for t in trials:
        assert 0 < t.metrics["eval/ne_ctr"] < 2 and 0 <= t.metrics["eval/auc_ctr"] <= 1
        assert t.metrics["perf/qps"] > 0 and t.metrics["trial/wall_s"] > 0
    assert not (swept / "mlflow.db").exists()  # nothing tracked


def test_compare_reads_the_file_and_pairs_by_seed(swept):
    proc = run_gemctl("compare", "results.json", "--json", cwd=swept)
    assert proc.returncode == 0, proc.stderr
    body = json.loads(proc.stdout)
    assert body["baseline"] == "fp32"
    bf16 = next(a for a in body["arms"] if a["arm"] == "bf16")
    assert bf16["seeds"] == ["0", "1"] and bf16["deltas"]["eval/ne_ctr"]["method"] == "paired"
    proc = run_gemctl("compare", "results.json", "--max-ne-regression", "1000%", cwd=swept)
    assert proc.returncode == 0 and "gates passed" in proc.stdout, proc.stdout + proc.stderr
    assert not (swept / "mlflow.db").exists()


def test_bad_results_and_mismatched_resume(swept, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"trials": []}')
    proc = run_gemctl("compare", str(bad), cwd=tmp_path)
    assert proc.returncode == 2 and "not a sweep results file" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_gemctl("compare", "missing.json", cwd=tmp_path)
    assert proc.returncode == 2 and "Cannot read sweep results missing.json" in proc.stderr, \
        proc.stderr
    assert not (tmp_path / "mlflow.db").exists()  # a missing file is not looked up as a run id
    # the same file resumed with different recipes: refused, file untouched
    before = (swept / "results.json").read_text()
    plan = load_sweep(swept / "prec.yaml", ["train.steps=3"])
    with pytest.raises(GemError, match="other recipes"):
        run_in_process(plan, swept / "results.json")
    assert (swept / "results.json").read_text() == before
