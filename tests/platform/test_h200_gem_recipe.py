"""recipes/h200_gem.yaml (the GEM-width model on one H200): it validates and plans on CPU at
full size (the model built on the meta device), and the same recipe shrunk by --set overrides
trains a couple of steps in-process."""

from __future__ import annotations

import math

from gem_platform.model.sizes import model_sizes, planning_model
from gem_platform.recipe import load_recipe
from tests.conftest import REPO

RECIPE = REPO / "recipes" / "h200_gem.yaml"


def test_recipe_is_gem_width_at_full_size():
    r = load_recipe(RECIPE)
    m = r.model
    assert (m.d_model, m.num_heads, m.seq_layers, m.num_experts, m.expert_hidden,
            m.head_hidden) == (1024, 8, 6, 4, 4096, 1024)
    assert m.attention == "full" and r.precision.mode == "bf16"
    syn = r.data.synthetic
    assert syn.num_items >= 1_000_000
    assert (syn.seq_len.dist, syn.seq_len.mean, syn.seq_len.min, syn.seq_len.max) == (
        "lognormal", 400, 16, 2048)
    assert r.loader.local_batch_size >= 512
    assert r.train.device == "cuda" and r.parallel.workers == 1


def test_recipe_plans_on_cpu_without_allocating():
    r = load_recipe(RECIPE)
    model = planning_model(r)
    assert all(p.is_meta for p in model.parameters())
    sizes = model_sizes(model, r)
    # ~1B dense parameters (the DHEN experts dominate), a 1M x 1024 item table
    assert sizes.dense_params + sizes.expert_params * sizes.num_experts > 5e8
    assert max(sizes.embedding_table_bytes) >= 1_000_001 * 1024 * 2


SHRINK = [
    "model.d_model=32", "model.num_heads=2", "model.seq_layers=2", "model.expert_hidden=32",
    "model.head_hidden=32", "model.pooled_queries=2", "model.sparse_dim=8",
    "data.synthetic.num_samples=1200", "data.synthetic.num_users=100",
    "data.synthetic.num_items=500",
    "data.synthetic.seq_len={dist: lognormal, mean: 24, sigma: 1.0, min: 16, max: 64}",
    "loader.local_batch_size=128", "loader.base_batch_size=32",
    "train.steps=2", "train.device=cpu", "train.log_every=1", "train.eval_max_samples=64",
    "train.perf_warmup_steps=0", "parallel.use_gpu=false",
]


def test_shrunk_recipe_trains_in_process(tmp_path):
    from gem_platform.train.loop import train

    r = load_recipe(RECIPE, [*SHRINK, f"data.path={tmp_path / 'data'}"])
    lines: list[str] = []
    summary = train(r, echo=lambda event: lines.append(str(event)))
    assert summary["train/steps"] == 2.0
    assert math.isfinite(summary["train/final_loss"])
    assert summary["perf/qps"] > 0 and summary["perf/train_flops_per_step"] > 0
    assert any(line.startswith("step     2/2") for line in lines), lines
