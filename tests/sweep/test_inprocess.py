"""An in-process sweep (no Ray, no MLflow): a tiny recipe, two precisions x two seeds trained
one after another here, results in a JSON file that survives a cut-short run and resumes; then
the real `gemctl compare FILE.json` (the app, run in this process) pairs the arms by seed and
applies the gates, and `gemctl sweep --in-process` narrowed to seed 0 trains those trials again,
bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from gem_platform.errors import GemError
from gem_platform.sweep.config import load_sweep
from gem_platform.sweep.inprocess import run_in_process
from gem_platform.sweep.merge import merge_results
from gem_platform.sweep.results import (
    CONCURRENT_TRIALS,
    load_results,
    looks_of,
    rounds_of,
    write_results,
)
from tests.conftest import gemctl_in_process, run_gemctl
from tests.sweep.test_provenance import in_history
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
# the two precisions, and a third arm (the CLI's narrowed sweep; tests/cli too)
TRI_SPEC = SPEC.replace("name: prec", "name: tri") + "  wide: [model.d_model=64]\n"


pytestmark = pytest.mark.slow  # every test reads the sweep the module trains (4 trials)

NO_RAY_NO_MLFLOW = """
import sys
sys.modules.update(ray=None, mlflow=None)  # importing either now raises ImportError
from gem_platform.sweep.inprocess import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("inprocess")
    (d / "base.yaml").write_text(BASE + "loader: {local_batch_size: 64, base_batch_size: 16}\n")
    (d / "prec.yaml").write_text(SPEC)
    out = d / "results.json"
    # the lone GPU box has neither Ray nor MLflow: the runner must not need them
    cmd = [sys.executable, "-c", NO_RAY_NO_MLFLOW, "prec.yaml", "--out", str(out)]
    # seed 0 first (as if the sweep had been cut short), its two trials side by side (each in
    # its own process: test_cli_sweep_narrowed_... trains them again one at a time and finds
    # them bit for bit the same), then the whole sweep resumes one trial at a time
    first = subprocess.run([*cmd, "--seeds", "0", "--parallel", "2"], cwd=d,
                           capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    assert len(load_results(out)[0]) == 2
    # --allow-code-change: this checkout may gain commits between the two launches
    second = subprocess.run([*cmd, "--allow-code-change"], cwd=d, capture_output=True,
                            text=True, timeout=600)
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


def test_each_call_that_trains_is_a_round(swept):
    """The file records which trials each call added: the points at which its gates could
    have been read (seed 0's pair, then seed 1's), which `gemctl bench looks` reads."""
    trials, header = load_results(swept / "results.json")
    assert [sorted(r) for r in header["rounds"]] == [["bf16/0", "fp32/0"], ["bf16/1", "fp32/1"]]
    assert looks_of(rounds_of(header, trials), "bf16", "fp32", ["0", "1"]) == [2]


def test_compare_reads_the_file_and_pairs_by_seed(swept):
    proc = gemctl_in_process("compare", "results.json", "--json", cwd=swept)
    assert proc.returncode == 0, proc.stderr
    body = json.loads(proc.stdout)
    assert body["baseline"] == "fp32"
    # the trials record their scores' standard errors, which are no task of their own
    trials, _ = load_results(swept / "results.json")
    assert all(t.metrics["eval_se/ne_ctr"] > 0 for t in trials)
    assert body["tasks"] == ["ctr", "cvr"]
    bf16 = next(a for a in body["arms"] if a["arm"] == "bf16")
    assert bf16["seeds"] == ["0", "1"] and bf16["deltas"]["eval/ne_ctr"]["method"] == "paired"
    proc = gemctl_in_process("compare", "results.json", "--max-ne-regression", "1000%", cwd=swept)
    assert proc.returncode == 0 and "gates passed" in proc.stdout, proc.stdout + proc.stderr
    assert not (swept / "mlflow.db").exists()


def test_bad_results_and_mismatched_resume(swept, tmp_path, monkeypatch):
    bad = tmp_path / "bad.json"
    bad.write_text('{"trials": []}')
    proc = gemctl_in_process("compare", str(bad), cwd=tmp_path)
    assert proc.returncode == 2 and "not a sweep results file" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    proc = gemctl_in_process("compare", "missing.json", cwd=tmp_path)
    assert proc.returncode == 2 and "Cannot read sweep results missing.json" in proc.stderr, \
        proc.stderr
    assert not (tmp_path / "mlflow.db").exists()  # a missing file is not looked up as a run id
    # the same file resumed with different recipes: refused, file untouched
    before = (swept / "results.json").read_text()
    monkeypatch.chdir(swept)
    plan = load_sweep("prec.yaml", ["train.steps=3"])
    with pytest.raises(GemError, match="other recipes"):
        run_in_process(plan, swept / "results.json")
    assert (swept / "results.json").read_text() == before


def test_results_file_records_provenance_and_determinism(swept, monkeypatch):
    monkeypatch.chdir(swept)  # where the sweep ran: data paths resolve as they did there
    trials, header = load_results(swept / "results.json")
    record = header["provenance"]
    commit = record["code"]["commit"]
    assert len(commit) == 40 and isinstance(record["code"]["dirty"], bool)
    assert record["fingerprint"] == load_sweep("prec.yaml").fingerprint()
    (data,) = record["datasets"].values()
    assert len(data["digest"]) == 16 and data["shards"] and data["num_train"] > 0
    assert record["environment"]["libraries"]["torch"]
    assert record["recipes"]["bf16"]["precision"]["mode"] == "bf16"
    assert record["deterministic"] == {"fp32": True, "bf16": True}  # sweeps default it on
    for t in trials:
        # seed 1's trials trained in the launch that wrote this header; seed 0's in the
        # first launch, which may have seen an earlier commit of this busy checkout
        assert in_history(t.commit) and (t.seed == "0" or t.commit == commit)
        assert t.metrics["train/deterministic"] == 1.0
        assert t.history["train/loss"]  # the step series the NE-vs-step chart draws
        assert t.history["eval/ne_ctr"][-1][1] == pytest.approx(t.metrics["eval/ne_ctr"])


def test_cli_sweep_narrowed_trains_its_trials_again_identically(swept):
    """`gemctl sweep --in-process` (a subprocess) narrowed with --arms/--seeds, in the folder
    of the module's sweep and on its dataset: a JSON result and a resumable results file, and
    each trial it trains again in a fresh process gives the metrics and step history the
    module's sweep recorded for it, bit for bit."""
    (swept / "tri.yaml").write_text(TRI_SPEC)
    args = ("sweep", "tri.yaml", "--in-process", "--arms", "fp32", "--arms", "bf16",
            "--seeds", "0", "--out", "res.json")
    proc = run_gemctl(*args, "--json", cwd=swept)
    assert proc.returncode == 0, proc.stderr[-3000:]
    body = json.loads(proc.stdout)
    assert body["trials"] == 2 and body["results"] == "res.json"
    assert {a["arm"] for a in body["comparison"]["arms"]} == {"fp32", "bf16"}
    assert "trials 2/2 done" in proc.stderr and "Traceback" not in proc.stderr
    results = json.loads((swept / "res.json").read_text())
    assert sorted((t["arm"], t["seed"]) for t in results["trials"]) == [("bf16", "0"),
                                                                      ("fp32", "0")]
    reruns, _ = load_results(swept / "res.json")
    firsts = {(t.arm, t.seed): t for t in load_results(swept / "results.json")[0]}
    for rerun in reruns:
        first = firsts[(rerun.arm, rerun.seed)]
        for key in ("eval/ne_ctr", "eval/ne_cvr", "eval/auc_ctr", "train/loss"):
            if key in first.metrics:
                assert rerun.metrics[key] == first.metrics[key], key  # bitwise, not approx
        assert rerun.history == first.history
    # resumes: nothing retrained (others may commit meanwhile: allow the code change)
    again = gemctl_in_process(*args, "--allow-code-change", cwd=swept)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("already in") == 2 and "quality per arm" in again.stdout


def test_a_sweep_narrowed_to_arms_without_its_baseline_ends_with_a_comparison(swept):
    """`--arms bf16` leaves out the spec's baseline (fp32): the sweep says so at its start,
    compares against fp32 where the results file holds it, and against bf16 where it holds
    only bf16, instead of failing after its trials."""
    body = json.loads((swept / "results.json").read_text())
    only = {**body, "trials": [t for t in body["trials"] if t["arm"] == "bf16"]}
    (swept / "bf16_only.json").write_text(json.dumps(only))
    for out, against in (("results.json", "fp32"), ("bf16_only.json", "bf16")):
        proc = run_gemctl("sweep", "prec.yaml", "--in-process", "--arms", "bf16",
                          "--allow-code-change", "--out", out, "--json", cwd=swept)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "baseline 'fp32' (not among --arms" in " ".join(proc.stderr.split())
        assert proc.stderr.count("already in") == 2  # nothing trained again
        assert json.loads(proc.stdout)["comparison"]["baseline"] == against


def test_trials_trained_side_by_side_say_so_and_their_qps_is_not_gated(swept):
    """Seed 0's trials trained two at a time (``--parallel 2``), seed 1's alone: each records
    how many shared the machine, compare marks the arms whose QPS is a share of it and holds
    a QPS gate on them inconclusive, while the quality gates are judged as ever."""
    trials, _ = load_results(swept / "results.json")
    assert {(t.seed, t.metrics[CONCURRENT_TRIALS]) for t in trials} == {("0", 2.0), ("1", 1.0)}
    proc = gemctl_in_process("compare", "results.json", "--max-ne-regression", "1000%",
                             "--max-qps-drop", "99%", cwd=swept)
    assert proc.returncode == 3, proc.stdout + proc.stderr  # inconclusive, not passed
    text = " ".join(proc.stdout.split())
    assert "QPS: INCONCLUSIVE, trials shared one machine ('bf16' 2 at a time, 'fp32' 2 at a " \
        "time)" in text and "trials trained alone" in text
    assert "‡ trained up to 2 trials at a time on one machine" in text
    assert "ne_ctr" in text and "PASS" in text  # the quality gates, judged as ever
    assert "gates INCONCLUSIVE (no gate failed)" in text


@pytest.mark.parametrize("field, other, refusal, allow, change", [
    ("commit", "0123456789abcdef0123456789abcdef01234567", "of other code than this commit",
     "allow_code_change", "with a code change"),
    ("device", "NVIDIA H200", "trained on another device than this one",
     "allow_device_change", "with a device change"),
])
def test_resume_from_another_commit_or_device_needs_allowing(swept, tmp_path, monkeypatch,
                                                             field, other, refusal, allow,
                                                             change):
    """Each trial records its commit and its device; the same seed of other code or on another
    card can train to other bits, so a file is resumed with either only when asked, and
    compare lists where each trial came from."""
    monkeypatch.chdir(swept)
    body = json.loads((swept / "results.json").read_text())
    assert {t["device"] for t in body["trials"]} == {body["device"]["device"]}
    body["trials"][0][field] = other  # as if its first trial ran at another commit / card
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps(body))
    plan = load_sweep("prec.yaml")
    first = body["trials"][0]
    with pytest.raises(GemError) as err:
        run_in_process(plan, path)
    text = f"{err.value.problem} {err.value.fix}"
    assert refusal in text and f"--{allow.replace('_', '-')}" in text
    assert f"{field} {other[:12]}" in text and f"{first['arm']} seed {first['seed']}" in text
    lines: list[str] = []
    kept = run_in_process(plan, path, echo=lines.append, **{allow: True})
    assert len(kept) == 4 and any(change in ln for ln in lines)
    assert [getattr(t, field) for t in kept] == [t[field] for t in body["trials"]]  # as were
    out = gemctl_in_process("compare", str(path), "--no-plot", cwd=tmp_path)
    assert f"runs from 2 {field}s" in " ".join(out.stdout.split())
    assert f"{other[:10]}" in out.stdout  # commits shown by their first 10 characters
    # a seed whose arm and baseline runs trained on different cards is left out of the pairs
    flat = " ".join(out.stdout.split())
    assert ("which trained on another device: " in flat) == (field == "device")
    if field == "device":
        assert "seed 0" in flat.split("which trained on another device: ")[1]


def test_a_trial_its_baseline_ran_elsewhere_is_named_before_it_trains(swept, tmp_path,
                                                                       monkeypatch):
    """Resuming on another device, a new trial whose seed the baseline ran on the old one
    would train only to be left out of the pairs: the sweep says so before training it, and
    compare names it too."""
    monkeypatch.chdir(swept)
    body = json.loads((swept / "results.json").read_text())
    body["trials"] = [t for t in body["trials"] if (t["arm"], t["seed"]) != ("bf16", "1")]
    for t in body["trials"]:
        if (t["arm"], t["seed"]) == ("fp32", "1"):
            t["device"] = "NVIDIA H200"
    path = tmp_path / "elsewhere.json"
    path.write_text(json.dumps(body))
    lines: list[str] = []
    run_in_process(load_sweep("prec.yaml"), path, echo=lambda e: lines.append(str(e)),
                   isolate=False, allow_code_change=True, allow_device_change=True)
    warning = next(ln for ln in lines if ln.startswith("warning: "))
    assert "bf16 seed 1 will train on" in warning and "will not pair them" in warning
    assert "seed 0" not in warning  # its baseline trained here
    out = gemctl_in_process("compare", str(path), "--no-plot", cwd=tmp_path)
    flat = " ".join(out.stdout.split())
    assert "which trained on another device: bf16 seed 1" in flat


def test_a_trial_written_before_devices_were_recorded_takes_the_files(swept, tmp_path):
    body = json.loads((swept / "results.json").read_text())
    for t in body["trials"]:
        del t["device"]
    body["device"]["device"] = "NVIDIA H100 80GB HBM3"
    path = tmp_path / "older.json"
    path.write_text(json.dumps(body))
    trials, _ = load_results(path)
    assert {t.device for t in trials} == {"NVIDIA H100 80GB HBM3"}


def test_results_of_parallel_processes_merge_into_one_file(swept, tmp_path):
    """One file per process (an arm and seed each) merges back into the sweep's file: the same
    trials and verdicts; a disagreeing duplicate or another sweep is refused, nothing written."""
    trials, header = load_results(swept / "results.json")
    header.pop("format")
    header.pop("rounds")  # parts as written before rounds were recorded: each is one round
    parts = []
    for i, t in enumerate(trials):
        part = tmp_path / f"part{i}.json"
        write_results(part, header, [t])
        parts.append(str(part))
    merged = tmp_path / "merged.json"
    proc = subprocess.run([sys.executable, "-c", NO_RAY_NO_MLFLOW, "--merge", *parts, parts[0],
                           "--out", str(merged)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    again, merged_header = load_results(merged)
    assert sorted(again, key=lambda t: (t.arm, t.seed)) == \
        sorted(trials, key=lambda t: (t.arm, t.seed))  # the repeated part is kept once
    assert merged_header["seeds"] == [0, 1] and merged_header["recipes"] == header["recipes"]
    assert merged_header["rounds"] == [[f"{t.arm}/{t.seed}"] for t in trials]

    bent = replace(trials[0], metrics={**trials[0].metrics, "eval/ne_ctr": 0.5})
    write_results(tmp_path / "bent.json", header, [bent])
    with pytest.raises(GemError, match=f"trial {bent.arm} seed {bent.seed} differs"):
        merge_results([parts[0], tmp_path / "bent.json"], tmp_path / "never.json")
    write_results(tmp_path / "other.json", {**header, "sweep": "other"}, [trials[0]])
    with pytest.raises(GemError, match="holds sweep 'other'"):
        merge_results([parts[0], tmp_path / "other.json"], tmp_path / "never.json")
    assert not (tmp_path / "never.json").exists()
