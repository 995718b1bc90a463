"""gemctl plan and gemctl profile-data through the real CLI, without training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import gemctl_in_process
from tests.tiny_training import TINY

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("inspect")
    (d / "tiny.yaml").write_text(TINY.format(data=d / "data"))
    return d


def test_plan_4096_gpus_json(workdir):
    proc = gemctl_in_process(
        "plan", str(REPO / "recipes/demo.yaml"), "--world", "4096", "--gpus-per-host", "8",
        "--hosts-per-zone", "32", "--set", "parallel.hsdp_shard_group=128",
        "--set", "parallel.expert_parallel=2", "--set", "parallel.expert_shard_hosts=16",
        "--set", "parallel.embedding_group=256", "--out", "plan.json", cwd=workdir)
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads((workdir / "plan.json").read_text())
    groups = plan["groups"]
    assert (groups["hsdp_shard"]["count"], groups["hsdp_shard"]["size"]) == (32, 128)
    assert groups["hsdp_shard"]["tier"] == "zone"
    assert groups["hsdp_replicate"]["tier"] == "cross_zone"
    assert (groups["expert"]["size"], groups["expert"]["tier"]) == (2, "nvlink")
    assert (groups["embedding"]["count"], groups["embedding"]["size"]) == (16, 256)
    grouped = plan["bytes_per_rank_by_tier"]["cross_zone"]
    flat = plan["baseline_bytes_per_rank_by_tier"]["cross_zone"]
    assert 0 < grouped < flat  # HSDP + grouped embeddings move less across zones
    assert "hsdp_shard" in proc.stdout and "cross_zone" in proc.stdout


def test_plan_rejects_sizes_that_do_not_divide(workdir):
    proc = gemctl_in_process("plan", str(REPO / "recipes/demo.yaml"), "--world", "4096",
                      "--set", "parallel.hsdp_shard_group=3", cwd=workdir)
    assert proc.returncode == 2
    assert "hsdp_shard_group=3" in proc.stderr and "Traceback" not in proc.stderr


def test_profile_data_reports_three_methods(workdir):
    proc = gemctl_in_process("profile-data", "tiny.yaml", "--world", "4", "--local-batch", "128",
                      "--out", "prof", cwd=workdir)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((workdir / "prof/profile.json").read_text())
    rows = {r["method"]: r for r in report["rows"]}
    assert {"none", "bbs", "global"} <= set(rows)
    none, bbs, best = (rows[m]["straggler_mean"] for m in ("none", "bbs", "global"))
    assert best <= bbs <= none
    assert 0.0 < rows["none"]["padding_waste"] < 1.0
    png = workdir / "prof/rank_work.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_shows_the_training_state_activations_come_on_top_of(workdir):
    """GEM width on one GPU: ~1.25B dense parameters at 16 bytes (fp32 weight, gradient,
    AdamW's moments) and a 1M x 1024 item table at 8 (rows, Adagrad): ~26 GiB before any
    activation, what an activation budget must leave room for on an 80 GB card."""
    proc = gemctl_in_process("plan", str(REPO / "recipes/h200_gem.yaml"), "--out",
                             "gem_plan.json", cwd=workdir)
    assert proc.returncode == 0, proc.stderr[-2000:]
    state = json.loads((workdir / "gem_plan.json").read_text())["training_state_per_rank"]
    gib = 2**30
    assert 18 * gib < state["dense"] < 19 * gib
    assert 7.5 * gib < state["embedding_tables"] < 7.9 * gib
    assert state["total"] == state["dense"] + state["experts"] + state["embedding_tables"]
    assert "training state per rank" in " ".join(proc.stdout.split())
