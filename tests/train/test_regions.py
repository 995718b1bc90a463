"""Model regions: compiled (one graph over changing token counts) and recomputed within an
activation budget (cheapest first, same training, recomputed FLOPs not counted as useful)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from gem_platform.model import GemModel
from gem_platform.model.flops import FlopMeter
from gem_platform.recipe import ModelConfig, recipe_from_dict
from gem_platform.train.loop import train
from gem_platform.train.regions import (
    Region,
    RegionCost,
    apply_regions,
    batch_units,
    compile_backend,
    compile_enabled,
    measure_cost,
    model_regions,
    plan_checkpointing,
)
from tests.tiny_training import tiny_tree as tiny_tree_at
from tests.tiny_training import train_losses


def _regions() -> list[Region]:
    m = torch.nn.Linear(1, 1)
    return [Region("seq0", m, "token"), Region("seq1", m, "token"), Region("dhen", m, "sample")]


def test_plan_recomputes_cheapest_first_until_the_budget_fits():
    costs = {"seq0": RegionCost(100.0, 20.0, 800.0), "seq1": RegionCost(100.0, 20.0, 800.0),
             "dhen": RegionCost(1e4, 1e3, 1e9)}
    units = {"token": 1e7, "sample": 1e3}  # seq: 1 GB each, dhen: 0.01 GB
    assert plan_checkpointing(_regions(), costs, units, None).recompute == []
    plan = plan_checkpointing(_regions(), costs, units, 1.5)
    assert plan.full_gb == pytest.approx(2.01)
    assert plan.recompute == ["seq0"] and plan.fits
    assert plan.kept_gb == pytest.approx(2.01 - 0.8)
    assert 0 < plan.recompute_flops_fraction < 0.5
    tight = plan_checkpointing(_regions(), costs, units, 0.1)
    assert tight.recompute == ["seq0", "seq1", "dhen"] and not tight.fits
    assert "over budget" in tight.describe()


def test_measured_costs_per_token_and_sample(tiny_meta):
    torch.manual_seed(0)
    model = GemModel(ModelConfig(d_model=16, num_heads=2, seq_layers=2, dhen_layers=1),
                     tiny_meta)
    regions = {r.name: r for r in model_regions(model)}
    assert list(regions) == ["sequence.blocks.0", "sequence.blocks.1", "dhen.0", "head"]
    cpu = torch.device("cpu")
    block = measure_cost(model, regions["sequence.blocks.0"], cpu, torch.enable_grad, units=128)
    again = measure_cost(model, regions["sequence.blocks.0"], cpu, torch.enable_grad, units=256)
    assert block.saved_bytes > block.input_bytes == 16 * 4  # an fp32 token of width 16
    assert again.saved_bytes == pytest.approx(block.saved_bytes, rel=0.1)
    dhen = measure_cost(model, regions["dhen.0"], cpu, torch.enable_grad, units=8)
    assert dhen.freed_bytes > 0 and dhen.recompute_flops > block.recompute_flops
    units = batch_units([10, 20, 30], local_batch=4)
    assert units["sample"] == 4 and units["token"] > 80


def test_regions_keep_parameter_names(tiny_meta):
    model = GemModel(ModelConfig(d_model=16, num_heads=2), tiny_meta)
    names = list(model.state_dict())
    apply_regions(model_regions(model), compile=True, backend="aot_eager",
                  recompute=["sequence.blocks.0", "head"])
    assert list(model.state_dict()) == names
    with pytest.raises(ValueError, match="no region named"):
        apply_regions(model_regions(model), compile=False, recompute=["blocks.7"])
    assert compile_enabled(None, torch.device("cpu")) is False
    assert compile_enabled(None, torch.device("cuda")) is True
    assert compile_enabled(False, torch.device("cuda")) is False
    assert compile_enabled(True, torch.device("cpu")) is True


def test_compiled_region_compiles_once_for_every_batch_size_and_never_for_eval() -> None:
    torch._dynamo.reset()
    counters.clear()
    head = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    apply_regions([Region("head", head, "sample")], compile=True, backend="aot_eager")
    for rows in (512, 515, 514, 7):  # a BBS batch's sample count moves from step to step
        head(torch.randn(rows, 16)).sum().backward()
    assert counters["stats"]["unique_graphs"] == 1
    with torch.no_grad():
        head(torch.randn(33, 16))
    assert counters["stats"]["unique_graphs"] == 1


def test_compile_backend_defaults_to_inductor_deterministic_runs_included() -> None:
    assert compile_backend(None) == "inductor"
    assert compile_backend("aot_eager") == "aot_eager"
    assert compile_backend("inductor") == "inductor"


@pytest.fixture
def tiny_tree(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tiny_tree_at(tmp_path / "data", steps=3)


def test_compiled_training_traces_each_region_kind_once(tiny_tree):
    """Three steps whose batches hold different token counts: the sequence layers' graph is
    traced once (dynamic token count), the DHEN and head graphs once each; no graph break.
    Training matches the eager run."""
    eager, eager_summary = train_losses(tiny_tree)
    torch._dynamo.reset()
    counters.clear()
    tree = {**tiny_tree, "train": {**tiny_tree["train"], "compile": True, "perf_warmup_steps": 1,
                                   "compile_backend": "aot_eager", "eval_max_samples": 1}}
    compiled, summary = train_losses(tree)
    assert compiled == pytest.approx(eager, rel=1e-4, abs=1e-5)
    assert summary["perf/train_flops_per_step"] == pytest.approx(
        eager_summary["perf/train_flops_per_step"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    # training graphs: sequence layer (shared by both layers), DHEN layer, head; evaluation
    # (no grad) runs the regions eager, so traces nothing
    assert counters["stats"]["unique_graphs"] == 3, dict(counters["stats"])
    # steps 2 and 3 (past the one warm-up step) hold other token and sample counts
    assert summary["perf/compiles_after_warmup"] == 0


def test_recompute_budget_trains_the_same_and_counts_no_extra_flops(tiny_tree):
    plain, plain_summary = train_losses(tiny_tree)
    tree = {**tiny_tree, "train": {**tiny_tree["train"], "activation_memory_gb": 1e-9}}
    lines: list[str] = []
    recomputed: list[float] = []
    summary = train(recipe_from_dict(tree), sink=lambda m, s: recomputed.append(m["train/loss"])
                    if "train/loss" in m else None, echo=lambda event: lines.append(str(event)))
    assert recomputed == pytest.approx(plain, rel=1e-5, abs=1e-6)
    assert summary["perf/train_flops_per_step"] == pytest.approx(
        plain_summary["perf/train_flops_per_step"])
    assert any("recompute: sequence.blocks.0" in line for line in lines), lines
    assert math.isfinite(summary["perf/activations_kept_gb"])


def test_flop_meter_counts_a_recomputed_region_once(tiny_meta, batch_factory):
    torch.manual_seed(0)
    model = GemModel(ModelConfig(d_model=16, num_heads=2, seq_layers=2), tiny_meta)
    batch = batch_factory(tiny_meta, [4, 9, 30])
    with FlopMeter(model) as plain:
        model(batch).sum().backward()
    apply_regions(model_regions(model), compile=False,
                  recompute=[r.name for r in model_regions(model)])
    with FlopMeter(model) as recomputed:
        model(batch).sum().backward()
    assert recomputed.forward_flops == pytest.approx(plain.forward_flops)


def test_compile_regions_narrows_what_compiles(tiny_meta):
    """train.compile_regions: a name or a prefix of whole dotted parts selects regions; the
    rest keep their eager forward; a pattern that selects nothing names the regions there are."""
    from gem_platform.errors import GemError
    from gem_platform.train.regions import selected_regions

    model = GemModel(ModelConfig(d_model=16, num_heads=2, dhen_layers=2), tiny_meta)
    regions = model_regions(model)
    names = [r.name for r in regions]
    assert selected_regions(regions, None) == set(names)
    assert selected_regions(regions, ["dhen"]) == {"dhen.0", "dhen.1"}
    assert selected_regions(regions, ["sequence.blocks.0", "head"]) == \
        {"sequence.blocks.0", "head"}
    with pytest.raises(GemError, match="'dhen.7', which is no region") as err:
        selected_regions(regions, ["dhen.7"])
    assert "sequence.blocks.0" in err.value.problem
    with pytest.raises(GemError):
        selected_regions(regions, ["dhe"])  # a prefix of whole parts only
    eager = {r.name: r.module.forward for r in regions}
    apply_regions(regions, compile=True, backend="aot_eager", compile_only=["dhen"])
    changed = {r.name for r in regions if r.module.forward != eager[r.name]}
    assert changed == {"dhen.0", "dhen.1"}


def test_blocks_with_an_attention_read_and_category_keys_compile_and_recompute(tiny_tree):
    """model.newest_attention: the last sequence layer returns (output, attention update), a
    tuple out of a compiled and recomputed region; model.attention_qk=category: every layer
    takes the category rows as a fourth input (here with one projection for queries and keys,
    model.shared_qk). Training matches the eager run."""
    tree = {**tiny_tree, "model": {**tiny_tree["model"], "newest_attention": True,
                                   "attention_qk": "category", "shared_qk": True}}
    eager, _ = train_losses(tree)
    torch._dynamo.reset()
    counters.clear()
    regional = {**tree, "train": {**tree["train"], "compile": True, "perf_warmup_steps": 1,
                                  "compile_backend": "aot_eager", "eval_max_samples": 1,
                                  "activation_memory_gb": 1e-9}}
    lines: list[str] = []
    compiled, summary = train_losses(regional, echo=lambda event: lines.append(str(event)))
    assert compiled == pytest.approx(eager, rel=1e-4, abs=1e-5)
    assert any("recompute:" in line and "sequence.blocks.1" in line for line in lines), lines
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert summary["perf/compiles_after_warmup"] == 0
