"""Resuming sharded state: TorchRec-sharded tables with their fused optimizer, HSDP and expert
parallelism. Processes stopped after a checkpoint and resumed in fresh ones train on exactly
as an uninterrupted run does (kept apart from test_checkpoint.py so the two files' slow tests
run on different test workers)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from gem_platform.checkpoint.manifest import MANIFEST_FILE
from gem_platform.checkpoint.store import latest_checkpoint
from gem_platform.data.prepare import prepare_dataset
from gem_platform.recipe import recipe_from_dict
from tests.checkpoint.stopped_training import train_until

STEPS, STOP_AT = 5, 2  # straight: 5 steps; interrupted after the step-2 checkpoint, resumed
LAYOUTS = {
    "table_wise": {"workers": 2, "embedding_sharding": "table_wise"},
    # recipes/hsdp_cpu.yaml's layout: HSDP 2x2, 2-way experts, row-wise tables (row-wise
    # sharding is covered here; a 2-worker row-wise case added ~40 s of CI and nothing else)
    "hsdp_experts_row_wise": {"workers": 4, "gpus_per_host": 2, "hsdp_shard_group": 2,
                              "expert_parallel": 2, "embedding_sharding": "row_wise"},
}


def _train_rank(tree: dict, root: str, stop_at: int, rank: int, world: int) -> list[float]:
    """Checkpoints every 2 steps; see stopped_training.train_until."""
    return train_until(tree, root, stop_at, rank, every=2)


def _straight_then_stopped(tree: dict, straight_root: str, stopped_root: str, rank: int,
                          world: int) -> tuple[list[float], list[float]]:
    """The uninterrupted run, then (in the same processes) the run stopped after its step-2
    checkpoint: rank 0's losses of each. Only the resume needs fresh processes."""
    return (_train_rank(tree, straight_root, 0, rank, world),
            _train_rank(tree, stopped_root, STOP_AT, rank, world))


def _full_state(folder: Path) -> dict:
    """A DCP checkpoint as plain full tensors (sharded tables and their states gathered)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = folder.parent / f"{folder.name}.pt"
    dcp_to_torch_save(folder, out)
    return torch.load(out, weights_only=False)


def _flat(tree: object, prefix: str = "") -> dict[str, object]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): tree}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded_resume_equals_uninterrupted(tiny_recipe, tmp_path, monkeypatch, layout):
    """Fresh processes load the step-2 checkpoint and train 3 more steps: losses, tables,
    their Adagrad state, dense weights and AdamW state equal the uninterrupted run's."""
    from tests.parallel.harness import spawn

    d, tree = tiny_recipe
    monkeypatch.chdir(d)
    tree = {**tree, "model": {**tree["model"], "num_experts": 2},
            "train": {**tree["train"], "steps": STEPS, "log_every": 1},
            "parallel": LAYOUTS[layout]}
    prepare_dataset(recipe_from_dict(tree).data)
    world = tree["parallel"]["workers"]

    straight, first = spawn(functools.partial(_straight_then_stopped, tree, str(tmp_path / "a"),
                                              str(tmp_path / "b")), world)[0]
    assert latest_checkpoint(tmp_path / "b").name == f"step_{STOP_AT:08d}"
    # rank 0's manifest lists every rank's files, and only them
    folder = tmp_path / "b" / f"step_{STOP_AT:08d}"
    listed = {f["name"] for f in json.loads((folder / MANIFEST_FILE).read_text())["files"]}
    assert listed == {p.name for p in folder.iterdir()} - {MANIFEST_FILE}
    assert {f"rank{r}.pt" for r in range(world)} <= listed
    resumed = spawn(functools.partial(_train_rank, tree, str(tmp_path / "b"), 0), world)[0]

    assert len(straight) == STEPS and len(set(straight)) == STEPS
    assert first == straight[:STOP_AT]
    assert resumed == pytest.approx(straight[STOP_AT:], rel=1e-5, abs=1e-6)

    saved = _flat(_full_state(tmp_path / "b" / f"step_{STOP_AT:08d}"))
    want = _flat(_full_state(tmp_path / "a" / "step_00000004"))
    got = _flat(_full_state(tmp_path / "b" / "step_00000004"))
    assert got.keys() == want.keys()
    sparse = [k for k in want if k.startswith("keyed_optim0.state.")]
    assert sparse, "the sharded tables' optimizer state is in the checkpoint"
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-7, msg=key)
        else:
            assert got[key] == value, key
    # the resumed steps moved tables and their Adagrad sums away from the loaded state
    assert any(not torch.equal(got[k], saved[k]) for k in sparse)
