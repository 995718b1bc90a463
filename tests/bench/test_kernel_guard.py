"""The kernel-speed guard: its verdicts on hand-made measurements, the committed figures it
compares with (read from committed bench rows, naming only shapes the bench modules define),
its refusal without a GPU, and, on a GPU, a real check of one shape."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from gem_bench.kernels.guard_figures import (
    FIGURES_PATH,
    SHAPES,
    Figure,
    compare,
    keys,
    load_figures,
    parse_slowdown,
    row_ms,
    updated,
)
from gem_platform.errors import GemError
from tests.cli.conftest import REPO, clean_exit, gemctl  # noqa: F401

BASE = {"gdpa_cross/fwd+bwd": Figure(0.380, "abc", "docs/bench/gdpa.json", "NVIDIA H200")}


def _one(measured_ms: float | None, key: str = "gdpa_cross/fwd+bwd"):
    [verdict] = compare({key: measured_ms}, BASE, max_slowdown=0.10)
    return verdict


def test_eleven_percent_slower_fails_nine_passes():
    slow, fine = _one(0.380 * 1.11), _one(0.380 * 1.09)
    assert slow.failed and slow.verdict == "slower by 11%"
    assert slow.ratio == pytest.approx(1.11)
    assert not fine.failed and fine.verdict == "ok"
    assert fine.committed_ms == 0.380 and fine.measured_ms == pytest.approx(0.4142)


def test_faster_passes():
    assert not _one(0.2).failed


def test_missing_baseline_is_reported_not_failed():
    v = _one(0.5, key="fp8_linear/fwd+bwd")
    assert (v.verdict, v.failed, v.committed_ms, v.ratio) == ("no baseline yet", False, None,
                                                               None)


@pytest.mark.parametrize("bad", [float("nan"), None, float("inf"), 0.0])
def test_unmeasured_or_nan_fails(bad):
    v = _one(bad)
    assert v.failed and v.verdict == "not measured" and v.measured_ms is None


def test_slowdown_threshold_parses_percent_and_fraction():
    assert parse_slowdown("10%") == pytest.approx(0.10)
    assert parse_slowdown("5") == pytest.approx(0.05)
    assert parse_slowdown("0.2") == pytest.approx(0.2)
    assert not compare({"gdpa_cross/fwd+bwd": 0.380 * 1.15}, BASE, 0.2)[0].failed
    for bad in ("abc", "-5%", "nan"):
        with pytest.raises(GemError, match="--max-slowdown"):
            parse_slowdown(bad)


def test_update_replaces_measured_figures_only():
    new = updated(BASE, {"gdpa_cross/fwd+bwd": 0.3, "gdpa_cross/fwd": float("nan"),
                         "fp8_linear/fwd+bwd": 1.2}, "def", "NVIDIA H200", "run.json")
    assert new["gdpa_cross/fwd+bwd"] == Figure(0.3, "def", "run.json", "NVIDIA H200")
    assert new["fp8_linear/fwd+bwd"].ms == 1.2
    assert "gdpa_cross/fwd" not in new


def test_committed_figures_name_existing_shapes_and_committed_rows():
    from gem_bench.kernels.guard import bench_cases

    figures = load_figures(REPO / FIGURES_PATH)
    assert figures and set(figures) <= set(keys())
    for shape in SHAPES.values():
        assert shape.case in bench_cases(shape.bench), shape
    for key, fig in figures.items():
        assert fig.ms > 0 and fig.commit and fig.device == "NVIDIA H200", key
        if fig.source.startswith("docs/bench/"):  # seeded: the very row of that file
            name, direction = key.split("/", 1)
            assert row_ms(REPO / fig.source, SHAPES[name], direction) == fig.ms, key
    # A key shape no committed file measured is left out, not made up.
    for key in set(keys()) - set(figures):
        name, direction = key.split("/", 1)
        assert row_ms(REPO / SHAPES[name].source, SHAPES[name], direction) is None, key


def test_unknown_shape_is_bad_input():
    with pytest.raises(GemError, match="nope"):
        keys(["gdpa_self", "nope"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_cli_refuses_without_cuda(gemctl, tmp_path):  # noqa: F811
    result = gemctl("bench", "kernels", "--check", "--out", str(tmp_path))
    clean_exit(result, 2)
    text = " ".join((result.output + result.stderr).split())
    assert "needs a CUDA GPU" in text and "H200" in text
    assert not list(tmp_path.iterdir())


@pytest.mark.gpu
def test_gpu_check_of_one_shape(tmp_path):
    from gem_bench.kernels.guard import run

    figures = tmp_path / "kernel_guard.json"
    shutil.copy(REPO / FIGURES_PATH, figures)
    report = run(["gdpa_cross"], str(figures), str(tmp_path / "out"), 0.10, update=True,
                 rep_ms=50)
    assert [v.key for v in report.verdicts] == ["gdpa_cross/fwd", "gdpa_cross/fwd+bwd"]
    assert all(v.measured_ms and math.isfinite(v.measured_ms) for v in report.verdicts)
    written = json.loads((tmp_path / "out" / "kernel_check.json").read_text())
    assert len(written["verdicts"]) == 2 and written["device"] == report.device
    after = load_figures(figures)
    assert after["gdpa_cross/fwd"].ms == report.verdicts[0].measured_ms
    assert after["gdpa_cross/fwd"].device == report.device
    assert after["gdpa_self/fwd"] == load_figures(REPO / FIGURES_PATH)["gdpa_self/fwd"]
