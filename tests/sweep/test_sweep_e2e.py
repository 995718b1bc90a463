"""A 2-arm x 2-seed sweep of a tiny demo recipe on CPU, through the real CLI against a live
MLflow server: interrupted (SIGTERM) after its first trial, resumed by the same command,
ending with 1 parent + 4 child runs and no duplicates; then `gemctl compare` (table, JSON,
gates, plot), `gemctl runs` and the finished sweep's re-run over it (those read runs only: the
app runs in this process)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.conftest import gemctl_in_process, run_gemctl
from tests.tiny_training import TINY

pytestmark = pytest.mark.slow

SPEC = """
name: ablate
base: tiny.yaml
seeds: [0, 1]
max_concurrent: 1
baseline: padded
arms:
  padded: [model.attention=padded]
  sliding: [model.attention=sliding, model.window=8]
"""

ARMS_SEEDS = {("padded", "0"), ("padded", "1"), ("sliding", "0"), ("sliding", "1")}


@dataclass
class Swept:
    dir: Path
    uri: str
    env: dict[str, str]
    first_rc: int
    first_log: str
    first_child: str
    second: subprocess.CompletedProcess[str]


def sweep_runs(uri: str) -> tuple[list, list]:
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("sweep-e2e")
    if exp is None:
        return [], []
    runs = client.search_runs([exp.experiment_id], "tags.`gem.sweep` LIKE 'ablate-%'")
    parents = [r for r in runs if r.data.tags.get("gem.sweep_role") == "parent"]
    return parents, [r for r in runs if r.data.tags.get("gem.sweep_role") == "child"]


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory, mlflow_server: str) -> Swept:
    d = tmp_path_factory.mktemp("sweep")
    tree = yaml.safe_load(TINY.format(data=d / "data"))
    # one worker per trial, and full attention (the CLI test's tiny recipe uses block64)
    tree["model"].pop("attention")
    tree["parallel"]["workers"] = 1
    tree["tracking"]["experiment"] = "sweep-e2e"
    (d / "tiny.yaml").write_text(yaml.safe_dump(tree))
    (d / "ablate.yaml").write_text(SPEC)
    env = {"MLFLOW_TRACKING_URI": mlflow_server}
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
    full_env.pop("RAY_ADDRESS", None)
    log_path = d / "first.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gemctl.main", "sweep", "ablate.yaml"],
                                cwd=d, env=full_env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 400
        first_child = ""
        while time.time() < deadline and proc.poll() is None and not first_child:
            done = [r for r in sweep_runs(mlflow_server)[1] if r.info.status == "FINISHED"]
            first_child = done[0].info.run_id if done else ""
            time.sleep(0.5)
        assert first_child, f"no trial finished: {log_path.read_text()[-3000:]}"
        proc.send_signal(signal.SIGTERM)
        first_rc = proc.wait(timeout=180)
    second = run_gemctl("sweep", "ablate.yaml", cwd=d, env=env)
    return Swept(d, mlflow_server, env, first_rc, log_path.read_text(), first_child, second)


def no_traceback(text: str) -> None:
    assert "Traceback" not in text, text[-3000:]


def test_interrupted_sweep_resumes_without_duplicates(swept):
    assert swept.first_rc == 130, swept.first_log[-3000:]
    assert "Sweep interrupted" in swept.first_log and "run the same command again" in \
        swept.first_log.lower()
    no_traceback(swept.first_log)
    out = swept.second.stdout
    assert swept.second.returncode == 0, swept.second.stderr[-3000:] + out[-3000:]
    assert "resuming sweep ablate-" in out and "already recorded" in out
    # the trials' step events reach the display through the Ray queue, drawn per trial
    assert any(line.startswith("[sliding seed 1] step ") for line in out.splitlines()), out
    assert "trial sliding seed 1 finished: NE ctr" in out
    parents, children = sweep_runs(swept.uri)
    assert len(parents) == 1 and len(children) == 4
    pairs = [(c.data.tags["gem.arm"], c.data.tags["gem.seed"]) for c in children]
    assert sorted(pairs) == sorted(ARMS_SEEDS)  # one child per (arm, seed): no duplicates
    assert swept.first_child in {c.info.run_id for c in children}  # kept, not retrained


def test_one_parent_four_children_with_tags(swept):
    parents, children = sweep_runs(swept.uri)
    (parent,) = parents
    tags = parent.data.tags
    assert parent.info.status == "FINISHED"
    assert tags["gem.baseline"] == "padded" and tags["gem.sweep"].startswith("ablate-")
    assert parent.data.params["sweep.arm.sliding"] == "model.attention=sliding model.window=8"
    for child in children:
        t, p = child.data.tags, child.data.params
        assert child.info.status == "FINISHED"
        assert t["mlflow.parentRunId"] == parent.info.run_id
        assert t["gem.sweep"] == tags["gem.sweep"]
        assert p["model.attention"] == t["gem.arm"] and p["train.seed"] == t["gem.seed"]
        assert p["data.synthetic.seed"] == "0"  # every arm and seed sees the same data
        assert 0 < child.data.metrics["eval/ne_ctr"] < 2
    c = MlflowClient(swept.uri)
    artifacts = c.list_artifacts(parent.info.run_id, "compare")
    assert sorted(a.path for a in artifacts) == [f"compare/{tags['gem.sweep']}-ne-deltas.png",
                                                 f"compare/{tags['gem.sweep']}-ne.png"]
    # provenance: the parent's fingerprint record, each trial's commit and dataset input
    top = {a.path for a in c.list_artifacts(parent.info.run_id)}
    assert {"fingerprint.json", "comparison.json", "comparison_table.json"} <= top
    assert tags["gem.git_commit"] and tags["gem.dataset_digest"]
    for child in children:
        assert child.data.tags["gem.dataset_digest"] == tags["gem.dataset_digest"]
        assert len(child.data.tags["gem.git_commit"]) == 40
        assert child.data.tags["gem.device"].startswith("cpu (")
        assert child.data.params["train.deterministic"] == "True"  # sweeps default it on
        assert child.inputs.dataset_inputs[0].dataset.digest == tags["gem.dataset_digest"]
    # the comparison on the parent: baseline means, the other arm's delta and its verdict
    m = parent.data.metrics
    assert m["eval/ne_ctr"] == pytest.approx(m["arm/padded/eval/ne_ctr"])
    assert "delta/sliding/eval/ne_ctr" in m and m["gate/sliding/eval/ne_ctr"] in (0, 1, 3)
    assert tags["gem.gates"] in ("pass", "fail", "inconclusive")
    assert "quality per arm" in swept.second.stdout and "FINISHED: 4/4" in swept.second.stdout


def test_compare_table_json_and_gates(swept):
    (parent,), _ = sweep_runs(swept.uri)
    sweep_id = parent.data.tags["gem.sweep"]
    proc = gemctl_in_process("compare", sweep_id, "--json", "--no-plot", cwd=swept.dir,
                      env=swept.env)
    assert proc.returncode == 0, proc.stderr
    body = json.loads(proc.stdout)
    assert body["baseline"] == "padded" and body["sweep_ids"] == [sweep_id]
    means = {a["arm"]: a["metrics"]["eval/ne_ctr"]["mean"] for a in body["arms"]}
    assert all(a["metrics"]["eval/ne_ctr"]["n"] == 2 for a in body["arms"])
    # each trial's device, from its run's tag (one device here: no runs-by-device line)
    assert all(set(a["devices"]) == set(a["seeds"]) and a["devices"][a["seeds"][0]]
               .startswith("cpu (") for a in body["arms"])
    # Gate against the better arm, so the observed difference is a regression of the other.
    better, worse = sorted(means, key=means.get)
    observed = (means[worse] - means[better]) / means[better] * 100
    assert observed > 0
    # a limit below the observed mean: two seeds either put the whole interval beyond it
    # (FAIL, exit 1) or straddle it (INCONCLUSIVE, exit 3); never a pass
    tight = gemctl_in_process("compare", sweep_id, "--baseline", better, "--no-plot",
                       "--max-ne-regression", f"{observed / 2:.6f}%", cwd=swept.dir,
                       env=swept.env)
    word = {1: "FAIL", 3: "INCONCLUSIVE"}.get(tight.returncode)
    assert word, tight.stdout + tight.stderr
    assert f"gate {word}: arm '{worse}': NE ctr" in " ".join((tight.stdout + tight.stderr)
                                                              .split())
    no_traceback(tight.stderr)
    loose = gemctl_in_process("compare", sweep_id, "--baseline", better, "--plot", "ne.png",
                       "--max-ne-regression", "1000%",
                       "--max-auc-drop", "0.5", cwd=swept.dir, env=swept.env)
    assert loose.returncode == 0, loose.stderr
    assert "gates passed" in loose.stdout
    for needle in (f"{better}*", worse, "ΔNE %", "ΔAUC", "QPS", "MFU E2E", "straggler"):
        assert needle in loose.stdout
    assert (swept.dir / "ne.png").read_bytes()[:4] == b"\x89PNG"
    assert (swept.dir / "ne-deltas.png").read_bytes()[:4] == b"\x89PNG"


def test_compare_run_ids_and_bad_ids(swept):
    _, children = sweep_runs(swept.uri)
    ids = [c.info.run_id for c in children if c.data.tags["gem.seed"] == "0"]
    proc = gemctl_in_process("compare", *ids, "--json", "--no-plot", cwd=swept.dir, env=swept.env)
    assert proc.returncode == 0, proc.stderr
    assert sorted(a["arm"] for a in json.loads(proc.stdout)["arms"]) == ["padded", "sliding"]
    proc = gemctl_in_process("compare", "no-such-sweep", cwd=swept.dir, env=swept.env)
    assert proc.returncode == 2 and "No sweep or run 'no-such-sweep'" in proc.stderr
    no_traceback(proc.stderr)


def test_rerun_of_finished_sweep_is_a_no_op_and_runs_lists_it(swept):
    # a finished sweep is found complete before Ray starts: the app, run in this process
    proc = gemctl_in_process("sweep", "ablate.yaml", cwd=swept.dir, env=swept.env)
    assert proc.returncode == 0, proc.stderr
    assert "already complete" in proc.stdout
    parents, children = sweep_runs(swept.uri)
    assert len(parents) == 1 and len(children) == 4
    sweep_id = parents[0].data.tags["gem.sweep"]
    proc = gemctl_in_process("runs", "--sweep", sweep_id, cwd=swept.dir, env=swept.env)
    assert proc.returncode == 0, proc.stderr
    for run in [*parents, *children]:
        assert run.info.run_id in proc.stdout
    assert f"sweep {sweep_id}" in proc.stdout and "sliding seed 1" in proc.stdout
    proc = gemctl_in_process("runs", "--sweeps", cwd=swept.dir, env=swept.env)
    row = next(ln for ln in proc.stdout.splitlines() if sweep_id in ln)
    assert f"{parents[0].data.metrics['eval/ne_ctr']:.4f}" in row  # the sweep shows its NE


def test_a_sweep_narrowed_to_arms_without_its_baseline_compares_against_its_first(swept):
    """On Ray, `--arms sliding` leaves out the spec's baseline (padded): the sweep says so at
    its start, records sliding as its parent's baseline and ends with a comparison against
    it, and `gemctl compare` of that sweep reads it so, instead of failing after the trials."""
    (swept.dir / "narrow.yaml").write_text(SPEC.replace("name: ablate", "name: narrow"))
    proc = run_gemctl("sweep", "narrow.yaml", "--arms", "sliding", "--seeds", "0", "--json",
                      cwd=swept.dir, env=swept.env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "baseline 'padded' (not among --arms" in " ".join(proc.stderr.split())
    client = MlflowClient(swept.uri)
    exp = client.get_experiment_by_name("sweep-e2e")
    parent = client.search_runs([exp.experiment_id], "tags.`gem.sweep` LIKE 'narrow-%' and "
                                "tags.`gem.sweep_role` = 'parent'")[0]
    assert parent.data.tags["gem.baseline"] == "sliding"
    again = gemctl_in_process("compare", parent.data.tags["gem.sweep"], "--json",
                              cwd=swept.dir, env=swept.env)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["baseline"] == "sliding"
