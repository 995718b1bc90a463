"""A tiny recipe trained in-process: the shared set-up of tests of training options
(compiled and recomputed regions, saved activations, late compiles)."""

from __future__ import annotations

from pathlib import Path

import yaml

from gem_platform.recipe import recipe_from_dict
from gem_platform.train.loop import train
from tests.platform.test_cli import TINY


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
