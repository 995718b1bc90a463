"""A gate whose metric is NaN, infinite or missing in some run is never dropped: it is FAIL
(the arm's value is not finite where the baseline's is) or INCONCLUSIVE (a value is missing,
or the baseline's is not finite), naming the arm, the seeds and the values. Where no NE is
finite at all, compare neither crashes in plotting nor loses its --json verdicts, and arm names
that look like rich markup or matplotlib mathtext are shown as written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gem_platform.sweep.compare import compare
from gem_platform.sweep.gates import Gates
from gemctl.main import app
from tests.conftest import REPO

BASE_NE = [0.900, 0.910, 0.920]


def results(path: Path, arm_ne: list[float | None], base_ne: list[float | None] | None = None,
            arm: str = "arm") -> Path:
    """A results file (gem-sweep-results/1) of a baseline and one arm; None = not recorded."""
    trials = []
    for seed, (base, ne) in enumerate(zip(base_ne or BASE_NE, arm_ne, strict=True)):
        for name, value in (("base", base), (arm, ne)):
            metrics = {"eval/auc_ctr": 0.7, "perf/qps": 1000.0}
            if value is not None:
                metrics["eval/ne_ctr"] = value
            trials.append({"arm": name, "seed": str(seed), "run_id": f"{name}{seed}",
                           "metrics": metrics})
    path.write_text(json.dumps({"format": "gem-sweep-results/1", "sweep": path.stem,
                                "baseline": "base", "trials": trials}))
    return path


def gemctl(*args: str):
    return CliRunner().invoke(app, list(args), catch_exceptions=True, terminal_width=200,
                              prog_name="gemctl")


def no_traceback(result, code: int) -> str:
    out = result.output + result.stderr
    assert result.exit_code == code, (result.exit_code, out, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        repr(result.exception)
    assert "Traceback" not in out
    return " ".join(out.split())


NAN, INF = math.nan, math.inf
CASES = {  # arm's NE per seed, baseline's NE per seed, verdict, exit code, words it names
    "arm_nan": ([NAN, NAN, NAN], None, "fail", 1, ["seed 0: nan", "seed 2: nan"]),
    "arm_inf_one_seed": ([0.9, INF, 0.92], None, "fail", 1, ["seed 1: inf"]),
    "arm_missing": ([None, None, None], None, "inconclusive", 3, ["seed 0: missing"]),
    "arm_missing_one": ([0.9, 0.91, None], None, "inconclusive", 3, ["seed 2: missing"]),
    "base_nan": ([0.9, 0.91, 0.92], [NAN, 0.91, 0.92], "inconclusive", 3,
                 ["baseline 'base'", "seed 0: nan"]),
    "all_nan": ([NAN] * 3, [NAN] * 3, "inconclusive", 3, ["baseline 'base'"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_unmeasured_gate_is_judged_and_named(tmp_path: Path, name: str):
    arm_ne, base_ne, verdict, code, words = CASES[name]
    path = results(tmp_path / f"{name}.json", arm_ne, base_ne)
    cmp = compare("", [str(path)], gates=Gates(max_ne_regression_pct=0.1))
    (v,) = [v for v in cmp.verdicts if v.metric == "eval/ne_ctr"]
    assert (v.arm, v.verdict) == ("arm", verdict), v.message
    for word in words:
        assert word in v.message, v.message
    result = gemctl("compare", str(path), "--max-ne-regression", "0.1%", "--no-plot")
    out = no_traceback(result, code)
    assert "gates passed" not in out and f"gate {verdict.upper()}" in out
    body = json.loads(gemctl("compare", str(path), "--max-ne-regression", "0.1%", "--no-plot",
                             "--json").stdout)
    assert body["exit_code"] == code
    assert [v["verdict"] for v in body["verdicts"] if v["metric"] == "eval/ne_ctr"] == [verdict]


def test_no_quality_metric_recorded_at_all(tmp_path: Path, monkeypatch):
    """No run recorded any NE (an eval split without positives drops it): the NE gate is still
    judged, the plots are written, and --json prints the verdicts."""
    monkeypatch.chdir(tmp_path)
    path = results(tmp_path / "none.json", [None] * 3, [None] * 3)
    result = gemctl("compare", str(path), "--max-ne-regression", "0.1%", "--json")
    no_traceback(result, 3)
    body = json.loads(result.stdout)
    assert {v["metric"] for v in body["verdicts"]} >= {"eval/ne_ctr"}
    assert {v["verdict"] for v in body["verdicts"]} == {"inconclusive"}
    assert all(Path(p).is_file() for p in body["plots"])


def test_json_keeps_non_finite_values_and_reads_them_back(tmp_path: Path):
    """--json is strict JSON (no NaN/Infinity tokens) and a saved comparison reads back to the
    same verdict."""
    path = results(tmp_path / "r.json", [0.9, INF, 0.92])
    first = gemctl("compare", str(path), "--max-ne-regression", "0.1%", "--no-plot", "--json")
    no_traceback(first, 1)
    json.loads(first.stdout, parse_constant=lambda c: pytest.fail(f"non-JSON token {c}"))
    saved = tmp_path / "cmp.json"
    saved.write_text(first.stdout)
    again = gemctl("compare", str(saved), "--max-ne-regression", "0.1%", "--no-plot")
    assert "seed 1: inf" in no_traceback(again, 1)


@pytest.mark.parametrize("arm", ["[bold]x", "[/]", "a[/red]b", "$\\frac{$", "x\\"])
def test_arm_names_shown_as_written(tmp_path: Path, monkeypatch, arm: str):
    """Markup-like or mathtext-like arm names in tables, gate messages and plots."""
    monkeypatch.chdir(tmp_path)
    for i, ne in enumerate(([NAN] * 3, [0.91, 0.92, 0.93])):
        path = results(tmp_path / f"r{i}.json", ne, arm=arm)
        result = gemctl("compare", str(path), "--max-ne-regression", "0.1%")
        out = no_traceback(result, 1)
        assert f"arm '{arm}'" in out


def test_an_unwritable_plot_path_keeps_the_verdicts(tmp_path: Path):
    path = results(tmp_path / "r.json", [0.91, 0.92, 0.93])
    (tmp_path / "file").write_text("not a folder")
    result = gemctl("compare", str(path), "--max-ne-regression", "0.1%", "--json", "--plot",
                    str(tmp_path / "file" / "ne.png"))
    no_traceback(result, 1)
    assert "plots were not written" in " ".join(result.stderr.split())
    assert json.loads(result.stdout)["verdicts"][0]["verdict"] == "fail"


def evaluated_without_cvr_ne(path: Path) -> Path:
    """Every run evaluated both tasks, but the eval split holds no CVR positive: a run records
    eval/count_cvr and no eval/ne_cvr or eval/auc_cvr (NaN is not recorded)."""
    trials = [{"arm": arm, "seed": str(seed), "run_id": f"{arm}{seed}",
               "metrics": {"eval/ne_ctr": ne, "eval/auc_ctr": 0.7, "eval/count_ctr": 100.0,
                           "eval/count_cvr": 0.0, "eval/base_rate_cvr": 0.0,
                           "perf/qps": 1000.0}}
              for seed, ne in enumerate(BASE_NE) for arm in ("base", "arm")]
    path.write_text(json.dumps({"format": "gem-sweep-results/1", "sweep": path.stem,
                                "baseline": "base", "trials": trials}))
    return path


def test_a_task_no_run_could_measure_keeps_its_gate(tmp_path: Path, monkeypatch):
    """CTR passes, but no run could compute CVR's NE: the CVR gate is INCONCLUSIVE and says
    why, not dropped with "gates passed"; a saved comparison reads back to the same verdict."""
    monkeypatch.chdir(tmp_path)
    path = evaluated_without_cvr_ne(tmp_path / "r.json")
    result = gemctl("compare", str(path), "--max-ne-regression", "0.1%", "--max-auc-drop",
                    "0.01")
    out = no_traceback(result, 3)
    assert "gates passed" not in out and "gates INCONCLUSIVE" in out
    assert "NE cvr is not finite in every run" in out and "seed 0: missing" in out
    first = gemctl("compare", str(path), "--max-ne-regression", "0.1%", "--json", "--no-plot")
    body = json.loads(no_traceback(first, 3) and first.stdout)
    verdicts = {v["metric"]: v["verdict"] for v in body["verdicts"]}
    assert verdicts == {"eval/ne_ctr": "pass", "eval/ne_cvr": "inconclusive"}, verdicts
    saved = tmp_path / "cmp.json"
    saved.write_text(first.stdout)
    again = gemctl("compare", str(saved), "--max-ne-regression", "0.1%", "--no-plot")
    assert "NE cvr is not finite in every run" in no_traceback(again, 3)


def test_tracked_runs_without_a_computable_cvr_ne_keep_its_gate(tmp_path: Path):
    """The same through the MLflow store: tracked runs record no NaN, so a CVR NE no run
    could compute is absent from every run, and its gate is still judged."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("gates")
    ids = []
    for seed, ne in enumerate(BASE_NE):
        for arm in ("base", "arm"):
            run = client.create_run(experiment, tags={"gem.arm": arm, "gem.seed": str(seed)})
            for key, value in (("eval/ne_ctr", ne), ("eval/count_ctr", 100.0),
                               ("eval/count_cvr", 0.0), ("perf/qps", 1000.0)):
                client.log_metric(run.info.run_id, key, value)
            client.set_terminated(run.info.run_id)
            ids.append(run.info.run_id)
    result = gemctl("compare", *ids, "--baseline", "base", "--max-ne-regression", "0.1%",
                    "--no-plot", "--json", "--tracking-uri", uri)
    no_traceback(result, 3)
    verdicts = {v["metric"]: v["verdict"] for v in json.loads(result.stdout)["verdicts"]}
    assert verdicts == {"eval/ne_ctr": "pass", "eval/ne_cvr": "inconclusive"}, verdicts


def _add_children(uri: str, parent_id: str, sweep: str, finished: dict[str, list[float]],
                  failed: tuple[str, ...] | list[str] = ()) -> None:
    """Child runs of a sweep's parent: finished ones with these NE per seed, and failed ones
    (two seeds) of ``failed`` arms; then the parent is closed FINISHED."""
    from mlflow.tracking import MlflowClient

    from gem_platform.sweep import store

    c = MlflowClient(uri)
    exp = c.get_run(parent_id).info.experiment_id
    runs = [(arm, s, ne) for arm, nes in finished.items() for s, ne in enumerate(nes)]
    runs += [(arm, s, None) for arm in failed for s in (0, 1)]
    for arm, seed, ne in runs:
        child = c.create_run(exp, tags={store.TAG_PARENT: parent_id,
                                        store.TAG_SWEEP: sweep, store.TAG_ROLE: store.ROLE_CHILD,
                                        store.TAG_ARM: arm, store.TAG_SEED: str(seed)})
        if ne is not None:
            for name, value in (("eval/ne_ctr", ne), ("eval/auc_ctr", 0.7), ("perf/qps", 1e3)):
                c.log_metric(child.info.run_id, name, value)
        c.set_terminated(child.info.run_id, "FINISHED" if ne is not None else "FAILED")
    c.set_terminated(parent_id, "FINISHED")


def _tracked_sweep(uri: str, finished: dict[str, list[float]], failed: list[str],
                   sweep: str = "unjudged-20261205-000000",
                   overrides: dict[str, str] | None = None) -> str:
    """A sweep in a live MLflow store (sqlite): a parent whose baseline is 'base' (and whose
    params say what each arm in ``overrides`` is, as a parent recorded before arms' recipe
    fingerprints did), and its child runs (``_add_children``)."""
    from mlflow.tracking import MlflowClient

    from gem_platform.sweep import store
    from gem_platform.sweep.runner import arm_param

    c = MlflowClient(uri)
    exp = (c.get_experiment_by_name("gates-unjudged")
           or c.get_experiment(c.create_experiment("gates-unjudged"))).experiment_id
    parent = c.create_run(exp, tags={store.TAG_SWEEP: sweep, store.TAG_ROLE: store.ROLE_PARENT,
                                     store.TAG_BASELINE: "base", store.TAG_RECIPE: "demo"})
    for arm, value in (overrides or {}).items():
        c.log_param(parent.info.run_id, arm_param(arm), value)
    _add_children(uri, parent.info.run_id, sweep, finished, failed)
    return sweep


def test_an_arm_whose_runs_all_failed_is_not_passed_by_omission(tmp_path: Path):
    """A tracked sweep whose fp8 runs all failed: its finished arm passes, but the gates are
    INCONCLUSIVE (exit 3) with fp8 named, not "passed"; and where the baseline's own runs
    failed, the comparison says so instead of quietly judging against another arm."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    sweep = _tracked_sweep(uri, {"base": BASE_NE, "same": BASE_NE}, failed=["fp8"])
    cmp = compare(uri, [sweep], gates=Gates(max_ne_regression_pct=0.1))
    words = {(v.arm, v.verdict) for v in cmp.verdicts}
    assert words == {("same", "pass"), ("fp8", "inconclusive")}
    (fp8,) = [v for v in cmp.verdicts if v.arm == "fp8"]
    assert "no finished run to judge (its runs failed)" in fp8.message
    assert len(cmp.skipped) == 2

    lone = _tracked_sweep(f"sqlite:///{tmp_path / 'lone.db'}", {"same": BASE_NE}, ["base"])
    cmp = compare(f"sqlite:///{tmp_path / 'lone.db'}", [lone],
                  gates=Gates(max_ne_regression_pct=0.1))
    assert [(v.arm, v.verdict) for v in cmp.verdicts] == [("base", "inconclusive")]


def test_two_sweeps_that_mean_two_recipes_by_one_arm_are_refused(tmp_path: Path):
    """Two tracked sweeps whose arm 'same' has other overrides: pooled, the gate would judge
    two recipes as one arm, so compare refuses, naming both sweeps; two sweeps of one spec
    (the same overrides) compare as one."""
    from gem_platform.sweep.config import SweepError

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    one = _tracked_sweep(uri, {"base": BASE_NE, "same": BASE_NE}, [], "s-1",
                         {"base": "(base)", "same": "model.attention=full"})
    two = _tracked_sweep(uri, {"base": BASE_NE, "same": BASE_NE}, [], "s-2",
                         {"base": "(base)", "same": "model.attention=block64"})
    again = _tracked_sweep(uri, {"base": BASE_NE, "same": BASE_NE}, [], "s-3",
                           {"base": "(base)", "same": "model.attention=full"})
    with pytest.raises(SweepError, match="Arm 'same' is one recipe in s-1 and another in s-2"):
        compare(uri, [one, two])
    assert [a.arm for a in compare(uri, [one, again]).arms] == ["base", "same"]


def test_two_base_recipes_of_one_name_under_one_arm_are_refused(tmp_path: Path):
    """Two sweeps whose bases are both named 'demo' and whose arms have the same overrides,
    but one base trains a wider model: their parents (written by the sweep runner itself)
    carry each arm's recipe fingerprint, so compare refuses to pool them; a results file of
    one of those recipes compares with its own sweep and is refused beside the other."""
    from gem_platform.sweep.config import SweepError, load_sweep
    from gem_platform.sweep.results import TrialRun, write_results
    from gem_platform.sweep.runner import _open_parent

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    demo = (REPO / "recipes" / "demo.yaml").read_text()
    plans = {}
    for name, width in (("narrow", "32"), ("wide", "64")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "demo.yaml").write_text(
            demo.replace("  d_model: 32\n", f"  d_model: {width}\n"))
        (tmp_path / name / "spec.yaml").write_text(
            f"name: {name}\nbase: demo.yaml\nbaseline: base\n"
            "arms: {base: [model.attention=full], same: [model.attention=block64]}\n")
        plans[name] = load_sweep(tmp_path / name / "spec.yaml", tracking_uri=uri)
    sweeps = {}
    for name, plan in plans.items():
        tracker, sweeps[name], _, _ = _open_parent(plan, uri, new=True, echo=lambda line: None)
        _add_children(uri, tracker.run_id, sweeps[name], {"base": BASE_NE, "same": BASE_NE})
    assert plans["narrow"].arms[1].recipe.name == plans["wide"].arms[1].recipe.name == "demo"
    with pytest.raises(SweepError, match=f"Arm 'base' is one recipe in {sweeps['narrow']} "
                                         f"and another in {sweeps['wide']}"):
        compare(uri, [sweeps["narrow"], sweeps["wide"]])

    trials = [TrialRun(f"f/{arm}/{seed}", arm, str(seed), {"eval/ne_ctr": ne}, commit="c0")
              for arm in ("base", "same") for seed, ne in enumerate(BASE_NE)]
    narrow = write_results(tmp_path / "narrow.json", {
        "sweep": "narrow", "baseline": "base",
        "recipes": plans["narrow"].arm_fingerprints()}, trials)
    assert [a.arm for a in compare(uri, [str(narrow), sweeps["narrow"]]).arms] == [
        "base", "same"]
    with pytest.raises(SweepError, match="Arm 'base' is one recipe in .*narrow.json and "
                                         f"another in {sweeps['wide']}"):
        compare(uri, [str(narrow), sweeps["wide"]])
