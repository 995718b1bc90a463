"""Trials of an in-process sweep trained side by side (``--parallel N``): a failed trial stops
new ones without losing those that finished, and the option's refusals. (Real trials trained
side by side, bit for bit the same as alone, and the QPS gate that knows they shared the
machine: tests/sweep/test_inprocess.py.)"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from gem_platform.errors import GemError
from gem_platform.sweep import inprocess
from gem_platform.sweep.config import load_sweep
from gem_platform.sweep.inprocess import narrowed, run_in_process
from gem_platform.sweep.results import load_results
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
    proc = gemctl_in_process("sweep", "side.yaml", "--allow-device-change", cwd=sweep_dir)
    assert proc.returncode == 2 and "--allow-device-change applies to --in-process sweeps" in \
        " ".join(proc.stderr.split()), proc.stdout + proc.stderr
    assert not (sweep_dir / "x.json").exists() and not (sweep_dir / "mlflow.db").exists()
