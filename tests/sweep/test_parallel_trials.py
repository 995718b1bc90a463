"""Trials of an in-process sweep trained side by side (``--parallel N``): each in its own
process, the same results as one after another, a QPS gate that knows they shared the machine,
and a failed trial that stops new ones without losing those that finished."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from gem_platform.errors import GemError
from gem_platform.sweep import inprocess
from gem_platform.sweep.config import load_sweep
from gem_platform.sweep.inprocess import narrowed, run_in_process
from gem_platform.sweep.results import CONCURRENT_TRIALS, load_results
from tests.conftest import gemctl_in_process
from tests.sweep.test_spec import BASE

SPEC = """
name: side
base: base.yaml
seeds: [0]
baseline: fp32
arms:
  fp32: [precision.mode=fp32]
  bf16: [precision.mode=bf16]
"""


@pytest.fixture
def sweep_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "base.yaml").write_text(BASE + "loader: {local_batch_size: 64, "
                                        "base_batch_size: 16}\n")
    (tmp_path / "side.yaml").write_text(SPEC)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _eval_metrics(path: Path) -> dict[tuple[str, str], dict[str, float]]:
    trials, _ = load_results(path)
    return {(t.arm, t.seed): {k: v for k, v in t.metrics.items() if k.startswith("eval/")}
            for t in trials}


@pytest.mark.slow
def test_side_by_side_trials_equal_those_trained_alone_and_their_qps_is_not_gated(sweep_dir):
    plan = load_sweep("side.yaml")
    run_in_process(plan, sweep_dir / "side_by_side.json", parallel=2)
    run_in_process(plan, sweep_dir / "alone.json", isolate=False)
    together, alone = _eval_metrics(sweep_dir / "side_by_side.json"), \
        _eval_metrics(sweep_dir / "alone.json")
    assert sorted(together) == [("bf16", "0"), ("fp32", "0")]
    assert together == alone  # deterministic trials: the company a trial keeps changes nothing
    for trials, n in ((load_results(sweep_dir / "side_by_side.json")[0], 2.0),
                      (load_results(sweep_dir / "alone.json")[0], 1.0)):
        assert {t.metrics[CONCURRENT_TRIALS] for t in trials} == {n}

    gates = ("--max-ne-regression", "1000%", "--max-qps-drop", "99%")
    shared = gemctl_in_process("compare", "side_by_side.json", *gates, cwd=sweep_dir)
    assert shared.returncode == 3, shared.stdout + shared.stderr  # inconclusive, not passed
    text = " ".join(shared.stdout.split())
    assert "QPS: INCONCLUSIVE, trials shared one machine ('bf16' 2 at a time, 'fp32' 2 at a " \
        "time)" in text
    assert "‡ trained up to 2 trials at a time on one machine" in text
    assert "trials trained alone" in text  # what would settle the QPS gate
    assert "NE ctr regression" in text  # the quality gates are judged as ever
    solo = gemctl_in_process("compare", "alone.json", *gates, cwd=sweep_dir)
    assert "shared one machine" not in solo.stdout and "‡" not in solo.stdout
    assert "QPS regression" in " ".join(solo.stdout.split())


def test_a_failed_trial_starts_no_other_and_a_rerun_trains_only_the_missing(sweep_dir,
                                                                          monkeypatch):
    plan = narrowed(load_sweep("side.yaml"), [0, 1, 2], None)
    started: list[tuple[str, int]] = []
    lock = threading.Lock()

    def fake_train(plan, arm, seed, isolate, echo):
        assert isolate  # side by side means each trial in its own process
        with lock:
            started.append((arm, seed))
        if (arm, seed) == ("bf16", 0):
            raise RuntimeError("CUDA out of memory")
        time.sleep(0.3 if (arm, seed) == ("fp32", 0) else 0.0)
        return {"eval/ne_ctr": 0.9, "eval/auc_ctr": 0.7}, {}, 0.1

    monkeypatch.setattr(inprocess, "_train", fake_train)
    out = sweep_dir / "cut.json"
    with pytest.raises(GemError, match=r"Trial bf16 seed 0 failed: RuntimeError: CUDA out of "
                       r"memory") as err:
        run_in_process(plan, out, parallel=2)
    assert "lower N" in err.value.as_text()
    # fp32 seed 0 was running when bf16 seed 0 failed: it finished and was kept; the
    # trials queued behind them never started
    assert sorted(started) == [("bf16", 0), ("fp32", 0)]
    assert sorted(_eval_metrics(out)) == [("fp32", "0")]

    started.clear()
    monkeypatch.setattr(inprocess, "_train", lambda plan, arm, seed, isolate, echo: (
        started.append((arm, seed)) or ({"eval/ne_ctr": 0.9}, {}, 0.1)))
    run_in_process(plan, out, parallel=2)
    assert sorted(started) == [("bf16", 0), ("bf16", 1), ("bf16", 2), ("fp32", 1),
                               ("fp32", 2)]
    assert len(_eval_metrics(out)) == 6


def test_parallel_needs_a_process_per_trial_and_an_in_process_sweep(sweep_dir):
    plan = load_sweep("side.yaml")
    with pytest.raises(GemError, match="only each in its own process"):
        run_in_process(plan, sweep_dir / "x.json", isolate=False, parallel=2)
    proc = gemctl_in_process("sweep", "side.yaml", "--parallel", "2", cwd=sweep_dir)
    assert proc.returncode == 2 and "--parallel 2 applies to --in-process sweeps" in \
        " ".join(proc.stderr.split()), proc.stdout + proc.stderr
    proc = gemctl_in_process("sweep", "side.yaml", "--in-process", "--parallel", "0",
                             cwd=sweep_dir)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert not (sweep_dir / "x.json").exists() and not (sweep_dir / "mlflow.db").exists()
