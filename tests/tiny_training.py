"""A tiny recipe (TINY) trained in-process: the shared set-up of tests of training options
(compiled and recomputed regions, saved activations, late compiles)."""

from __future__ import annotations

from pathlib import Path

import yaml

from gem_platform.recipe import recipe_from_dict
from gem_platform.train.loop import train

# The smallest recipe that trains every part of the model, data under {data} (str.format).
TINY = """
name: tiny
model: {{d_model: 16, num_heads: 2, pooled_queries: 2, dhen_layers: 1, expert_hidden: 32,
         head_hidden: 32, attention: block64}}
data:
  source: synthetic
  path: {data}
  synthetic: {{num_samples: 2400, num_users: 300, num_items: 300,
              seq_len: {{dist: lognormal, mean: 24, min: 1, max: 96}}}}
loader: {{batching: bbs, local_batch_size: 128, base_batch_size: 32, buffer_full_batches: 2}}
train: {{steps: 6, log_every: 2, warmup_steps: 2}}
parallel: {{workers: 2}}
tracking: {{experiment: cli-test}}
"""


def tiny_tree(data: Path, seq_layers: int = 2, **train_settings) -> dict:
    """The TINY recipe as a dict, one worker, full attention, data under ``data``; every step
    logged, no warm-up left out; ``train_settings`` override the train section."""
    tree = yaml.safe_load(TINY.format(data=data))
    tree["model"].update(seq_layers=seq_layers, attention="full")
    tree["train"].update({"log_every": 1, "perf_warmup_steps": 0, "eval_max_samples": 128,
                          **train_settings})
    tree["parallel"]["workers"] = 1
    return tree


def train_losses(tree: dict, echo=lambda _: None) -> tuple[list[float], dict]:
    """Every step's training loss and the run summary."""
    losses: list[float] = []
    summary = train(recipe_from_dict(tree), sink=lambda m, s: losses.append(m["train/loss"])
                    if "train/loss" in m else None, echo=echo)
    return losses, summary
