"""gemctl bench repro: what train.deterministic costs and whether it holds; the step-1
gradient check names the first parameter, nearest the loss, whose gradient differs."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from gem_bench import repro
from gem_bench.repro import first_differing
from gemctl.main import app
from tests.tiny_training import TINY


@pytest.mark.slow
def test_repro_bench_reports_cost_and_agreement(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(TINY.format(data=tmp_path / "data"))
    # the gemctl app in this process; each gradient step trains in a fresh one
    proc = CliRunner().invoke(app, ["bench", "repro", "tiny.yaml", "--out", "out", "--set",
                                    "train.steps=2", "--set", "parallel.workers=1", "--grads"])
    assert proc.exit_code == 0, (proc.exception, proc.stderr)
    report = json.loads((tmp_path / "out" / "repro_bench.json").read_text())
    result = report["recipes"]["tiny.yaml"]
    assert result["bitwise_identical"] is True and result["differing"] == []
    assert set(result["runs"]) == {"plain", "deterministic", "deterministic_rerun"}
    assert result["runs"]["plain"]["summary"]["train/deterministic"] == 0.0
    assert result["runs"]["deterministic"]["summary"]["train/deterministic"] == 1.0
    assert result["qps_plain"] > 0 and math.isfinite(result["cost"])
    grads = result["step1_gradients"]
    assert grads["parameters"] > 10 and grads["differing"] == 0
    assert grads["nearest_the_loss"] is None


def test_first_differing_gradient_is_named_nearest_the_loss_first():
    a = {"embed.weight": "1", "block.weight": "2", "head.weight": "3", "head.bias": "4"}
    b = {**a, "embed.weight": "x", "block.weight": "y"}
    assert first_differing(a, b) == {"parameters": 4, "differing": 2,
                                     "nearest_the_loss": "block.weight",
                                     "differing_names": ["embed.weight", "block.weight"]}
    assert first_differing(a, dict(a))["nearest_the_loss"] is None


@pytest.mark.slow
def test_repro_bench_grads_only_is_a_predicate(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(TINY.format(data=tmp_path / "data"))
    # fresh processes for the gradient steps are checked above; here both steps in this one
    rc = repro.main(["tiny.yaml", "--out", "one", "--set", "parallel.workers=1",
                           "--grads-only", "--grads-in-one-process"])
    once = json.loads((tmp_path / "one" / "repro_bench.json").read_text())["recipes"]
    assert set(once["tiny.yaml"]) == {"step1_gradients"}
    assert rc == 0 and once["tiny.yaml"]["step1_gradients"]["in_one_process"] is True
    assert once["tiny.yaml"]["step1_gradients"]["differing"] == 0
    assert not repro._repeatable({"step1_gradients": {"differing": 3}})
    assert not repro._repeatable({"bitwise_identical": False})
    assert repro._repeatable({"bitwise_identical": True,
                                    "step1_gradients": {"differing": 0}})
