"""Provenance against a real MLflow sqlite store: a run records its commit, dirty flag,
dataset fingerprint (as an MLflow dataset input), environment and system metrics; a sweep's
parent run records its fingerprint with what it stands for, refuses to resume under another
commit unless told to (naming which trials came from which commit), and carries the
comparison as metrics and a table that `gemctl runs --sweeps` and `gemctl compare` read."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from gem_platform.launch import submit
from gem_platform.provenance import dataset_fingerprint
from gem_platform.recipe import recipe_from_dict
from gem_platform.sweep import store
from gem_platform.sweep.compare import compare_trials
from gem_platform.sweep.config import SweepError, load_sweep
from gem_platform.sweep.gates import Gates, check_gates
from gem_platform.sweep.results import TrialRun
from gem_platform.sweep.runner import _close, _open_parent, _prepare_data, run_sweep
from gem_platform.sweep.summary import log_comparison
from tests.conftest import REPO, gemctl_in_process
from tests.sweep.test_spec import BASE

SMALL = BASE + "loader: {local_batch_size: 64, base_batch_size: 16}\n"
SPEC = """
name: prov
base: base.yaml
seeds: [0, 1]
arms:
  fp32: [precision.mode=fp32]
  bf16: [precision.mode=bf16]
"""
OTHER = "0123456789abcdef0123456789abcdef01234567"


def in_history(sha: str) -> bool:
    """Whether ``sha`` is a commit of this checkout's branch (others may commit meanwhile, so
    HEAD itself can move during a test)."""
    return subprocess.run(["git", "-C", str(REPO), "merge-base", "--is-ancestor", sha, "HEAD"],
                          capture_output=True).returncode == 0


@pytest.fixture
def sweep_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "base.yaml").write_text(SMALL)
    (tmp_path / "prov.yaml").write_text(SPEC)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    return tmp_path


def test_a_run_records_code_data_environment_and_system_metrics(sweep_dir, monkeypatch):
    import yaml

    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "1")
    tree = yaml.safe_load(SMALL)
    tree["data"]["path"] = str(sweep_dir / "data")
    outcome = submit(recipe_from_dict(tree, "tiny"), local=True, echo=lambda line: None)
    c = MlflowClient(outcome.tracking_uri)
    run = c.get_run(outcome.run_id)
    tags = run.data.tags
    assert in_history(tags["gem.git_commit"]) and tags["gem.git_dirty"] in ("true", "false")
    assert tags["gem.device"].startswith("cpu (") and outcome.summary["device"] == \
        tags["gem.device"]  # what rank 0 trained on
    digest = dataset_fingerprint(sweep_dir / "data")["digest"]
    assert tags["gem.dataset_digest"] == digest
    (inp,) = run.inputs.dataset_inputs
    assert inp.dataset.digest == digest and inp.tags[0].value == "training"
    assert json.loads(inp.dataset.profile)["num_train"] == 540
    record = json.loads(Path(c.download_artifacts(outcome.run_id, "provenance.json",
                                                  str(sweep_dir))).read_text())
    assert record["code"]["commit"] == tags["gem.git_commit"]
    shards = record["dataset"]["shards"]
    assert shards and all(len(s["sha256"]) == 64 and s["bytes"] > 0 for s in shards)
    assert record["environment"]["libraries"]["torch"] and record["environment"]["python"]
    assert run.data.params["precision.mode"] == "fp32"  # the resolved recipe, as params
    assert any(k.startswith("system/cpu_utilization") for k in run.data.metrics)


def test_sweep_fingerprint_records_provenance_and_resume_needs_the_same_commit(sweep_dir):
    plan = load_sweep(sweep_dir / "prov.yaml")
    uri = plan.arms[0].recipe.tracking.uri
    _prepare_data(plan)
    tracker, sweep_id, _, resumed = _open_parent(plan, uri, new=True, echo=lambda line: None)
    assert not resumed
    c = MlflowClient(uri)
    parent = c.get_run(tracker.run_id)
    head = parent.data.tags["gem.git_commit"]
    assert in_history(head)
    record = json.loads(Path(c.download_artifacts(tracker.run_id, "fingerprint.json",
                                                  str(sweep_dir))).read_text())
    assert record["fingerprint"] == plan.fingerprint() == parent.data.tags[
        store.TAG_FINGERPRINT]
    assert record["code"]["commit"] == head and isinstance(record["code"]["dirty"], bool)
    (data,) = record["datasets"].values()
    assert data["digest"] == dataset_fingerprint(sweep_dir / "data")["digest"] == \
        parent.data.tags["gem.dataset_digest"]
    assert set(record["recipes"]) == {"fp32", "bf16"}
    assert record["recipes"]["bf16"]["precision"]["mode"] == "bf16"
    assert set(record["deterministic"]) == {"fp32", "bf16"}
    assert record["environment"]["libraries"]["mlflow"]
    assert parent.inputs.dataset_inputs[0].dataset.digest == data["digest"]

    # As if the sweep had been launched, and stopped after one trial, at another commit.
    _close(tracker, "KILLED", "interrupted")
    c.set_tag(tracker.run_id, "gem.git_commit", OTHER)
    child = c.create_run(parent.info.experiment_id, tags={
        store.TAG_PARENT: tracker.run_id, store.TAG_SWEEP: sweep_id,
        store.TAG_ROLE: store.ROLE_CHILD, store.TAG_ARM: "fp32", store.TAG_SEED: "0",
        "gem.git_commit": OTHER})
    c.set_terminated(child.info.run_id, "FINISHED")
    with pytest.raises(SweepError) as err:
        run_sweep(plan, echo=lambda line: None)
    text = f"{err.value.problem} {err.value.fix}"
    now = re.search(r"this code is commit ([0-9a-f]{12})", text)
    assert f"started with commit {OTHER[:12]}" in text and now and in_history(now.group(1))
    assert f"commit {OTHER[:12]}: fp32 seed 0" in text and "--allow-code-change" in text
    assert c.get_run(tracker.run_id).info.status == "KILLED"  # nothing resumed
    lines: list[str] = []
    tracker, again, _, resumed = _open_parent(plan, uri, new=False, echo=lines.append,
                                              allow_code_change=True)
    assert resumed and again == sweep_id
    assert any("with a code change" in ln and f"commit {OTHER[:12]}: fp32 seed 0" in ln
               for ln in lines)
    _close(tracker, "KILLED", "test over")


def test_parent_run_carries_the_comparison(sweep_dir):
    plan = load_sweep(sweep_dir / "prov.yaml")
    uri = plan.arms[0].recipe.tracking.uri
    _prepare_data(plan)
    tracker, sweep_id, _, _ = _open_parent(plan, uri, new=True, echo=lambda line: None)
    trials = [TrialRun(f"{arm}{s}", arm, str(s),
                       {"eval/ne_ctr": ne + 0.001 * s, "eval/auc_ctr": 0.7,
                        "eval/calibration_ctr": 1.01}, commit=OTHER)
              for arm, ne in (("fp32", 0.90), ("bf16", 0.91)) for s in (0, 1, 2)]
    cmp = compare_trials(trials, "fp32")
    cmp.verdicts = check_gates(cmp, Gates(max_ne_regression_pct=0.1))
    log_comparison(uri, tracker.run_id, cmp)
    _close(tracker, "FINISHED")
    c = MlflowClient(uri)
    parent = c.get_run(tracker.run_id)
    m = parent.data.metrics
    assert m["eval/ne_ctr"] == pytest.approx(0.901)  # the baseline arm's mean
    assert m["arm/bf16/eval/ne_ctr"] == pytest.approx(0.911)
    assert m["delta/bf16/eval/ne_ctr"] == pytest.approx(0.01 / 0.901 * 100)
    assert m["delta/bf16/eval/ne_ctr_low"] == pytest.approx(m["delta/bf16/eval/ne_ctr"])
    assert m["gate/bf16/eval/ne_ctr"] == 1.0  # fail: the whole interval beyond 0.1%
    assert parent.data.tags["gem.gates"] == "fail"
    assert parent.data.tags["gem.git_commits"] == OTHER
    table = json.loads(Path(c.download_artifacts(tracker.run_id, "comparison_table.json",
                                                 str(sweep_dir))).read_text())
    rows = dict(zip(table["columns"], zip(*table["data"], strict=True), strict=True))
    assert "fail" in rows["verdict"] and "eval/calibration_ctr" in rows["metric"]
    report = Path(c.download_artifacts(tracker.run_id, "quality.md", str(sweep_dir)))
    assert report.read_text().startswith("| arm | seeds | NE ctr | ΔNE ctr [95% CI] | verdict")
    assert "| bf16 | 3 | 0.9110±0.0010 | +1.110%" in report.read_text()
    assert "**FAIL**" in report.read_text()
    proc = gemctl_in_process("runs", "--sweeps", cwd=sweep_dir)
    assert proc.returncode == 0, proc.stderr
    row = next(ln for ln in proc.stdout.splitlines() if sweep_id in ln)
    assert "0.9010" in row  # NE ctr of the sweep itself
    saved = c.download_artifacts(tracker.run_id, "comparison.json", str(sweep_dir))
    proc = gemctl_in_process("compare", saved, "--json", "--no-plot", cwd=sweep_dir)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["arms"][1]["per_seed"]["eval/ne_ctr"] == \
        pytest.approx([0.91, 0.911, 0.912])


def test_an_exported_tree_names_its_own_commit_over_the_enclosing_checkout(monkeypatch) -> None:
    """Code exported into a folder of another checkout records the commit it was exported from,
    not that checkout's HEAD, when GEM_GIT_COMMIT says so."""
    from gem_platform.provenance import code_version

    monkeypatch.setenv("GEM_GIT_COMMIT", "b" * 40)
    monkeypatch.setenv("GEM_GIT_DIRTY", "0")
    assert code_version() == {"commit": "b" * 40, "dirty": False}
    monkeypatch.delenv("GEM_GIT_COMMIT")
    monkeypatch.delenv("GEM_GIT_DIRTY")
    assert len(code_version()["commit"] or "") == 40


def test_empty_commit_variables_count_as_unknown_not_clean(monkeypatch, tmp_path) -> None:
    """An image built without its GEM_GIT_* build arguments sets both to "": outside a checkout
    the code is then unknown (never "clean"), inside one git answers."""
    from gem_platform.provenance import code_version

    monkeypatch.setenv("GEM_GIT_COMMIT", "")
    monkeypatch.setenv("GEM_GIT_DIRTY", "")
    assert code_version(root=tmp_path) == {"commit": None, "dirty": None}
    assert len(code_version()["commit"] or "") == 40
