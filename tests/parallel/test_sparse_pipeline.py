"""The sparse input pipelined: with tables sharded by TorchRec over 2 gloo ranks, the training
loop starts batch i+1's embedding input all-to-all before batch i's backward ends, and the
losses equal those of the unpipelined loop."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.profiler import ProfilerActivity, profile

from gem_platform.data.prepare import prepare_dataset
from gem_platform.errors import RecipeError
from gem_platform.parallel.sparse_pipeline import SPARSE_INPUT_DIST
from gem_platform.recipe import recipe_from_dict
from gem_platform.train.loop import BACKWARD, train, with_upcoming
from tests.parallel.harness import spawn
from tests.tiny_training import tiny_tree

WORLD, STEPS = 2, 4


def _tree(data: Path, pipelined: bool) -> dict:
    tree = tiny_tree(data, seq_layers=1, steps=STEPS, eval_every=0, eval_max_samples=64,
                     pipeline_sparse=pipelined)
    tree["parallel"].update(workers=WORLD, embedding_sharding="row_wise")
    return tree


def _spans(prof: profile, name: str) -> list[tuple[float, float]]:
    """(start, end) in µs of every ``name`` range on this rank, in time order."""
    return sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                  if e.name == name)


def _keep_loss(losses: list[float], metrics: dict[str, float], step: int) -> None:
    if "train/loss" in metrics:
        losses.append(metrics["train/loss"])


def _train_both(data: str, trace_dir: str, rank: int, world: int) -> dict:
    """Train pipelined and unpipelined under the profiler; the losses (rank 0) and the spans
    of the input distributions and backwards."""
    out: dict = {}
    for pipelined in (True, False):
        losses: list[float] = []
        recipe = recipe_from_dict(_tree(Path(data), pipelined))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            train(recipe, sink=functools.partial(_keep_loss, losses), echo=lambda line: None)
        if pipelined and rank == 0:
            prof.export_chrome_trace(str(Path(trace_dir) / "pipelined.json"))
        out[pipelined] = {"losses": losses, "dist": _spans(prof, SPARSE_INPUT_DIST),
                          "backward": _spans(prof, BACKWARD)}
    return out


@pytest.mark.slow
def test_pipelined_sparse_input_overlaps_the_step_and_keeps_the_losses(tmp_path):
    prepare_dataset(recipe_from_dict(_tree(tmp_path / "data", True)).data)
    results = spawn(functools.partial(_train_both, str(tmp_path / "data"), str(tmp_path)),
                    WORLD)
    chief = results[0]
    assert len(chief[True]["losses"]) == STEPS
    assert chief[True]["losses"] == chief[False]["losses"]  # bit for bit
    for rank in results:
        dist, backward = rank[True]["dist"], rank[True]["backward"]
        assert len(dist) == len(backward) == STEPS
        for i in range(STEPS - 1):  # batch i+1's input dist starts inside step i
            assert dist[i + 1][0] < backward[i][1], (i, dist, backward)
        for i in range(1, STEPS - 1):  # and not earlier: one batch ahead
            assert dist[i + 1][0] > backward[i - 1][1], (i, dist, backward)
        assert rank[False]["dist"] == []  # unpipelined: each forward distributes its own
        assert len(rank[False]["backward"]) == STEPS
    trace = json.loads((tmp_path / "pipelined.json").read_text())
    names = [e.get("name") for e in trace["traceEvents"]]
    assert names.count(SPARSE_INPUT_DIST) == STEPS and names.count(BACKWARD) == STEPS


def test_pipeline_is_on_by_default_and_can_be_turned_off():
    assert recipe_from_dict({"parallel": {"workers": 2}}).train.pipeline_sparse is True
    off = recipe_from_dict({"train": {"pipeline_sparse": False}})
    assert off.train.pipeline_sparse is False
    with pytest.raises(RecipeError, match="pipeline_sparse"):
        recipe_from_dict({"train": {"pipeline_sparse": "sometimes"}})



def test_the_loader_state_is_that_of_the_batch_handed_out():
    """Looking one batch ahead must not move the state a checkpoint records."""
    holder = SimpleNamespace(loader_state=None)

    def stream():
        for i in range(3):
            holder.loader_state = {"after": i}
            yield f"batch{i}", i

    seen = [(batch, upcoming, dict(holder.loader_state))
            for batch, _, upcoming in with_upcoming(holder, stream())]
    assert seen == [("batch0", "batch1", {"after": 0}), ("batch1", "batch2", {"after": 1}),
                    ("batch2", None, {"after": 2})]
