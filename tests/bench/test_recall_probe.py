"""gemctl bench recall-probe: both readers train on the recall sign of a tiny recall-world
dataset and land in one table and JSON; a dataset of another world is refused with the fix;
and the positive control at a small size: full attention learns the sign, block64 cannot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from gem_bench.recall_probe import BareReader, epochs_of, signs
from gem_platform.data.config import RECALL_GAP
from gem_platform.data.parquet import SampleTable
from gemctl.main import app
from tests.tiny_training import TINY

REPO = Path(__file__).resolve().parents[2]
RECALL = ["--set", "data.synthetic.world=recall", "--set", "data.synthetic.num_clusters=20",
          "--set", "data.synthetic.seq_len.mean=88", "--set", "data.synthetic.seq_len.min=81",
          "--set", "data.synthetic.seq_len.max=96"]


def test_command_writes_a_curve_per_reader(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(TINY.format(data="data"))
    proc = CliRunner().invoke(app, ["bench", "recall-probe", "tiny.yaml", *RECALL, "--steps",
                                    "4", "--every", "2", "--out", "res", "--readers",
                                    "bare,tower,tower_prenorm,tower_attention,model,model_read",
                                    "--seeds", "0,1", "--reached", "0.5"])
    assert proc.exit_code == 0, (proc.exception, proc.stdout)
    assert "held-out AUC of the recall sign" in " ".join(proc.stdout.split())
    result = json.loads((tmp_path / "res" / "recall_probe.json").read_text())
    assert set(result["curves"]) == {"bare", "tower", "tower_prenorm", "tower_attention",
                                     "model", "model_read"}
    curves = result["curves"]  # the tower's three readings train different heads: they differ
    assert len({c["0"][-1]["auc"] for k, c in curves.items() if k.startswith("tower")}) == 3
    for by_seed in result["curves"].values():
        assert set(by_seed) == {"0", "1"}
        assert by_seed["0"] != by_seed["1"]  # another initialization and batch order
        for points in by_seed.values():
            assert [p["step"] for p in points] == [2, 4]
            assert all(0.0 <= p["auc"] <= 1.0 and p["loss"] > 0 for p in points)
    first = result["first_step_reaching"]
    for reader, by_seed in curves.items():
        for seed, points in by_seed.items():
            want = next((p["step"] for p in points if p["auc"] >= 0.5), None)
            assert first[reader][seed] == want
    assert "first evaluated step at held-out AUC >= 0.5" in " ".join(proc.stdout.split())
    # the labels are the planted sign: about half the histories recur
    batch = SampleTable.load("data", "eval").collate(range(200))
    assert 0.3 < float(signs(batch).mean()) < 0.7


def test_batches_see_every_sample_once_an_epoch():
    """No sample comes back before every one has been seen (a per-id model would otherwise
    recall repeats); a split smaller than a batch is one batch of all of it."""
    batches = epochs_of(10, 3)
    first = [next(batches) for _ in range(3)]
    assert sorted(int(i) for b in first for i in b) == sorted(set(int(i) for b in first for i in b))
    assert all(len(b) == 3 for b in first)
    assert sorted(next(epochs_of(2, 5)).tolist()) == [0, 1]


def test_bare_reader_sees_an_event_past_the_gap():
    """The bare reader's output for the newest token moves when an event RECALL_GAP back
    changes: nothing in it is block-local."""
    torch.manual_seed(0)
    reader = BareReader(16, 2).eval()
    x = torch.randn(RECALL_GAP + 10, 16)
    offsets = torch.tensor([0, RECALL_GAP + 10])
    y = x.clone()
    y[0] = torch.randn(16)
    with torch.no_grad():
        assert not torch.equal(reader(x, offsets)[0], reader(y, offsets)[0])


def test_another_world_is_refused_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(TINY.format(data="data"))
    proc = CliRunner().invoke(app, ["bench", "recall-probe", "tiny.yaml", "--steps", "2"])
    assert proc.exit_code == 2
    out = " ".join(proc.output.split())
    assert "world recall" in out and "data.synthetic.world=recall" in out
    assert not (tmp_path / "data").exists()  # refused before generating anything
    bad = CliRunner().invoke(app, ["bench", "recall-probe", "tiny.yaml", *RECALL,
                                   "--init", "zeros"])
    assert bad.exit_code == 2 and "pass unit or normal" in " ".join(bad.output.split())
    bad = CliRunner().invoke(app, ["bench", "recall-probe", "tiny.yaml", *RECALL,
                                   "--readers", "bare,towr"])
    assert bad.exit_code == 2 and "tower_attention" in " ".join(bad.output.split())
    bad = CliRunner().invoke(app, ["bench", "recall-probe", "tiny.yaml", *RECALL,
                                   "--seeds", "0,x"])
    assert bad.exit_code == 2 and "comma-separated seeds" in " ".join(bad.output.split())


@pytest.mark.slow
def test_the_positive_control_at_a_small_size(tmp_path, monkeypatch):
    """The demo's GemModel, queries and keys from the category rows through one shared
    projection (model.attention_qk=category, model.shared_qk), trained on the recall sign:
    full attention learns it within 200 steps of 128 samples; block64, whose blocks never hold
    the newest event with its match, stays at chance. What recipes/ablations/
    recall_controls.yaml measures with click labels, at a size a test affords."""
    monkeypatch.chdir(tmp_path)
    small = [*RECALL, "--set", "data.synthetic.num_clusters=100", "--set",
             "data.synthetic.num_samples=40000", "--set", "data.path=data",
             "--set", "model.attention_qk=category", "--set", "model.shared_qk=true"]
    final = {}
    for attention in ("full", "block64"):
        proc = CliRunner().invoke(app, ["bench", "recall-probe", str(REPO / "recipes/demo.yaml"),
                                        *small, "--set", f"model.attention={attention}",
                                        "--readers", "model", "--steps", "200", "--every",
                                        "200", "--out", attention])
        assert proc.exit_code == 0, (proc.exception, proc.stdout)
        result = json.loads((tmp_path / attention / "recall_probe.json").read_text())
        final[attention] = result["curves"]["model"]["0"][-1]["auc"]
    assert final["full"] > 0.95 and final["block64"] < 0.6, final
