"""compile_check: step-1 gradients of the compiled model against the eager one, per
parameter; the verdict and the exit code follow the tolerance."""

from __future__ import annotations

import json
import math

import torch
from typer.testing import CliRunner

from gem_bench.compile_check import beyond_tolerance, relative_errors
from gemctl.main import app
from tests.tiny_training import TINY


def test_relative_errors_rank_the_worst_first():
    eager = {"a": torch.ones(4), "b": torch.full((2,), 2.0), "c": torch.zeros(3),
             "d": torch.ones(2)}
    compiled = {"a": torch.ones(4), "b": torch.tensor([2.0, 2.2]), "c": torch.zeros(3)}
    rows = relative_errors(compiled, eager)
    assert [r["parameter"] for r in rows[:2]] == ["d", "b"]  # missing: inf; then b
    assert math.isinf(rows[0]["relative_error"])
    assert math.isclose(rows[1]["relative_error"], 0.2 / math.sqrt(8), rel_tol=1e-6)
    assert {r["parameter"]: r["relative_error"] for r in rows[2:]} == {"a": 0.0, "c": 0.0}
    assert beyond_tolerance(rows, 0.1) == ["d"]
    assert beyond_tolerance(rows, 0.01) == ["d", "b"]
    assert beyond_tolerance([{"parameter": "n", "relative_error": math.nan}], 1.0) == ["n"]


def test_tiny_recipe_compiles_to_the_eager_gradients(tmp_path, monkeypatch):
    """Through the CLI, as a user runs it: the tiny recipe compiled (aot_eager, quick on CPU)
    computes the eager gradients; a missing recipe is a clear error with exit code 2. The
    gemctl app runs in this process (both runs train in a fresh process of their own)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(TINY.format(data=tmp_path / "data"))
    proc = CliRunner().invoke(app, ["bench", "compile-check", "tiny.yaml", "--out", "out",
                                    "--set", "parallel.workers=1",
                                    "--set", "train.compile_backend=aot_eager"])
    assert proc.exit_code == 0, (proc.exception, proc.stderr)
    assert "every gradient within tolerance" in proc.stdout
    report = json.loads((tmp_path / "out" / "compile_check.json").read_text())["recipes"][0]
    assert report["ok"] and report["beyond_tolerance"] == []
    assert report["precision"] == "fp32" and report["tolerance"] == 1e-3
    assert report["parameters"] > 10
    assert report["worst"][0]["relative_error"] <= 1e-3
    missing = CliRunner().invoke(app, ["bench", "compile-check", "nope.yaml"])
    assert missing.exit_code == 2 and "nope.yaml does not exist" in missing.stderr
