"""Trials of an in-process sweep trained side by side (``--parallel N``): a failed trial stops
new ones without losing those that finished, one out of memory beside others trains again
with fewer at a time, and the option's refusals. (Real trials trained
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
from gem_platform.sweep.results import CONCURRENT_TRIALS, load_results
from gem_platform.train.device_memory import DeviceMemoryError
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


def _fake_trials(out_of_memory: set[tuple[str, int]], times: int):
    """A stand-in for one trial's process that records how many trials ran when each
    started, and runs out of memory ``times`` times for the trials named."""
    lock = threading.Lock()
    log: dict[str, list] = {"starts": [], "running": [0]}

    def fake_train(plan, arm, seed, isolate, echo):
        with lock:
            log["running"][0] += 1
            log["starts"].append((arm, seed, log["running"][0]))
            failing = (arm, seed) in out_of_memory and sum(
                1 for a, s, _ in log["starts"] if (a, s) == (arm, seed)) <= times
        try:
            time.sleep(0.2)
            if failing:
                raise DeviceMemoryError("Recipe 'r' ran out of device memory while training",
                                        "lower the batch")
            return {"eval/ne_ctr": 0.9, "eval/auc_ctr": 0.7}, {}, 0.1
        finally:
            with lock:
                log["running"][0] -= 1

    return fake_train, log


def test_a_trial_out_of_memory_beside_others_trains_again_with_one_fewer_at_a_time(
        sweep_dir, monkeypatch):
    plan = narrowed(load_sweep("side.yaml"), [0, 1, 2], None)
    fake_train, log = _fake_trials({("bf16", 0)}, times=1)
    monkeypatch.setattr(inprocess, "_train", fake_train)
    lines: list = []
    out = sweep_dir / "retried.json"
    run_in_process(plan, out, echo=lines.append, parallel=3)
    assert len(_eval_metrics(out)) == 6  # nothing lost, nothing left out
    bf16_0 = [i for i, (a, s, _) in enumerate(log["starts"]) if (a, s) == ("bf16", 0)]
    assert len(bf16_0) == 2
    assert all(n <= 2 for _, _, n in log["starts"][bf16_0[1]:])  # two at a time from then on
    assert "trial bf16 seed 0 ran out of memory beside other trials: it trains again, 2 " \
           "trial(s) at a time from now on" in [str(x) for x in lines]
    trials, _ = load_results(out)
    company = {(t.arm, t.seed): t.metrics[CONCURRENT_TRIALS] for t in trials}
    assert company[("fp32", "0")] == 3 and company[("bf16", "0")] == 2


def test_a_trial_out_of_memory_alone_fails_the_sweep(sweep_dir, monkeypatch):
    plan = narrowed(load_sweep("side.yaml"), [0], None)
    fake_train, log = _fake_trials({("bf16", 0)}, times=2)
    monkeypatch.setattr(inprocess, "_train", fake_train)
    out = sweep_dir / "alone.json"
    with pytest.raises(GemError, match="Trial bf16 seed 0 failed: DeviceMemoryError"):
        run_in_process(plan, out, echo=lambda _: None, parallel=2)
    assert [(a, s) for a, s, _ in log["starts"]].count(("bf16", 0)) == 2  # then alone: fails
    assert sorted(_eval_metrics(out)) == [("fp32", "0")]


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
