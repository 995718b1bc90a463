"""Resuming a checkpoint under another parallel section: 4 ranks to 2 and 2 to 4, table-wise
to row-wise, another HSDP shard group and expert parallelism. DCP reshards the dense DTensors
and TorchRec's tables with their fused Adagrad state; after loading, every parameter and
optimizer state (gathered to full tensors) equals the saved one, and training continues from
the loaded state without a jump in loss. What can't be mapped is refused with the reason."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient

from gem_platform.checkpoint.reshard import (
    Layout,
    ReshardError,
    check_reshard,
    check_tables,
    fit_schedule,
    layout_changes,
    map_loader,
    read_layout,
)
from gem_platform.checkpoint.store import LocalStore
from gem_platform.data.prepare import prepare_dataset
from gem_platform.recipe import recipe_from_dict
from tests.checkpoint.stopped_training import train_until
from tests.conftest import gemctl_in_process

TABLE_WISE_2 = {"workers": 2, "embedding_sharding": "table_wise"}
EXPERTS_2 = {"workers": 2, "gpus_per_host": 2, "expert_parallel": 2,
             "embedding_sharding": "table_wise"}
HSDP_4 = {"workers": 4, "gpus_per_host": 2, "hsdp_shard_group": 2, "expert_parallel": 2,
          "embedding_sharding": "row_wise"}


# ----------------------------------------------------------------------------- the rules


def test_changes_name_each_setting_that_differs():
    saved = Layout(4, HSDP_4, True, epoch=0, position=2, steps_per_epoch=2)
    assert layout_changes(saved, TABLE_WISE_2, 2) == [
        "world size 4 -> 2", "embedding_sharding row_wise -> table_wise",
        "expert_parallel 2 -> None", "gpus_per_host 2 -> None", "hsdp_shard_group 2 -> None"]
    assert layout_changes(saved, HSDP_4, 4) == []
    assert Layout.from_json(saved.to_json()) == saved


def test_loader_maps_to_the_next_epoch_under_another_world():
    now = {"rank": 1, "num_samples": 500, "steps_per_epoch": 4, "epoch": 0, "position": 0}
    mine = {"rank": 1, "num_samples": 250, "steps_per_epoch": 2, "epoch": 3, "position": 2}
    ended = Layout(4, HSDP_4, True, epoch=3, position=2, steps_per_epoch=2)
    assert map_loader(ended, mine, now, 2) == {**now, "epoch": 4, "position": 0}
    started = Layout(4, HSDP_4, True, epoch=3, position=0, steps_per_epoch=2)
    assert map_loader(started, mine, now, 2) == {**now, "epoch": 3, "position": 0}
    assert map_loader(ended, mine, now, 4) is mine  # same world: each rank's own position


def test_schedule_state_fits_another_number_of_table_groups():
    saved = {"base_lrs": [0.1, 0.1], "_last_lr": [0.05, 0.05], "last_epoch": 4,
             "lr_lambdas": [None]}
    assert fit_schedule(saved, 3) == {"base_lrs": [0.1] * 3, "_last_lr": [0.05] * 3,
                                      "last_epoch": 4, "lr_lambdas": [None] * 3}
    assert fit_schedule(saved, 2)["base_lrs"] == [0.1, 0.1]


def test_mid_epoch_under_another_world_and_other_table_optimizer_are_refused():
    mid = Layout(4, HSDP_4, True, epoch=1, position=1, steps_per_epoch=2)
    with pytest.raises(ReshardError, match="batch 1 of 2 in epoch 1 by 4 worker") as err:
        check_reshard(mid, EXPERTS_2, 2, "ckpt/step_00000003")
    assert "parallel.workers=4" in err.value.fix
    check_reshard(mid, HSDP_4, 4, "ckpt/step_00000003")  # same world: any position maps
    ended = Layout(4, HSDP_4, True, epoch=1, position=2, steps_per_epoch=2)
    check_reshard(ended, EXPERTS_2, 2, "ckpt/step_00000004")  # 2 experts' holders of 4 -> 2
    with pytest.raises(ReshardError, match="written with expert parallelism") as err:
        check_reshard(ended, TABLE_WISE_2, 2, "ckpt/step_00000004")
    assert "expert_parallel above 1" in err.value.fix
    with pytest.raises(ReshardError, match="replicated with a torch optimizer"):
        check_tables(mid, False, "ckpt/step_00000003")


# ----------------------------------------------------------------------------- real runs


def _tree(tiny_recipe, parallel: dict, steps: int) -> dict:
    d, tree = tiny_recipe
    return {**tree, "model": {**tree["model"], "num_experts": 2},
            "loader": {**tree["loader"], "local_batch_size": 256},
            "train": {**tree["train"], "steps": steps, "log_every": 1, "eval_every": 0},
            "parallel": parallel}


def _train_until(tree: dict, root: str, stop_at: int, rank: int, world: int) -> list[float]:
    """A checkpoint every step, stopped after step ``stop_at``'s; rank 0's losses."""
    return train_until(tree, root, stop_at, rank)


def _resume_elsewhere(tree: dict, root: str, out: str, rank: int, world: int) -> dict:
    """Under ``tree``'s layout: load the newest checkpoint under ``root`` and save it again to
    ``out`` (the loaded state, for comparison), then train on from it to ``train.steps``.
    Returns the loader state it continued at, the lines rank 0 printed, its losses."""
    from gem_platform.train.loop import RankInfo, Reporter, pick_device, resume, setup, train
    from gem_platform.train.state import CheckpointExtras

    lines: list[str] = []
    recipe = recipe_from_dict(tree)
    run = setup(recipe, RankInfo.current(), pick_device(recipe), prepare_dataset(recipe.data))
    loop, epoch = resume(run, LocalStore(Path(root), every=0, keep=10),
                         Reporter(rank == 0, None, lambda event: lines.append(str(event))))
    loader = run.batcher.state_dict()
    run.state.save(Path(out), loop.step, rank, CheckpointExtras(loop, loader, []))
    del run
    losses: list[float] = []
    train(recipe_from_dict(tree), sink=lambda m, s: losses.append(m["train/loss"])
          if "train/loss" in m else None, echo=lambda event: lines.append(str(event)),
          checkpoints=LocalStore(Path(root), every=0, keep=10))
    return {"loader": loader, "epoch": epoch, "lines": lines, "losses": losses}


def _full_state(folder: Path) -> dict[str, object]:
    """A DCP checkpoint as plain full tensors (sharded tables and their states gathered),
    flattened to dotted keys."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = folder.parent / f"{folder.name}.pt"
    dcp_to_torch_save(folder, out)

    def flat(tree: object, prefix: str = "") -> dict[str, object]:
        if isinstance(tree, dict):
            return {k: v for key, sub in tree.items()
                    for k, v in flat(sub, f"{prefix}{key}.").items()}
        return {prefix.rstrip("."): tree}

    return flat(torch.load(out, weights_only=False))


def _assert_same_state(saved: dict[str, object], loaded: dict[str, object]) -> None:
    tensors = [k for k, v in saved.items() if isinstance(v, torch.Tensor)]
    assert any(k.startswith("keyed_optim0.state.") for k in tensors), "table Adagrad state"
    assert any(k.startswith("optim.state.") for k in tensors), "dense AdamW state"
    for key in tensors:
        assert key in loaded, key
        torch.testing.assert_close(loaded[key], saved[key], rtol=0, atol=0, msg=key)


def _reshard(tiny_recipe, tmp_path, before: dict, after: dict, epoch_end: int,
             ) -> tuple[list[float], dict, Path]:
    """Train under ``before`` to step ``epoch_end`` (an epoch's end there), resume under
    ``after``: the loaded state equals the saved one; returns the first run's losses, rank
    0's result of the resumed run and the root of the checkpoints."""
    from tests.parallel.harness import spawn

    tree_a = _tree(tiny_recipe, before, epoch_end + 1)  # the last step saves no checkpoint
    prepare_dataset(recipe_from_dict(tree_a).data)
    root = tmp_path / "run"
    first = spawn(functools.partial(_train_until, tree_a, str(root), epoch_end),
                  before["workers"])[0]
    saved = root / f"step_{epoch_end:08d}"
    layout = read_layout(str(saved))
    assert layout is not None and layout.position == layout.steps_per_epoch, layout
    tree_b = _tree(tiny_recipe, after, epoch_end + 2)
    out = tmp_path / "loaded"
    got = spawn(functools.partial(_resume_elsewhere, tree_b, str(root), str(out)),
                after["workers"])
    _assert_same_state(_full_state(saved), _full_state(out))
    # every new rank continues at the first batch of the next epoch
    assert {(r["epoch"], r["loader"]["epoch"], r["loader"]["position"]) for r in got} == {
        (layout.epoch + 1, layout.epoch + 1, 0)}
    return first, got[0], root


def _no_jump(first: list[float], resumed: list[float]) -> None:
    """The resumed run's losses continue the saved run's: no jump back to an untrained
    model's loss, nothing non-finite."""
    assert len(resumed) == 2 and all(torch.isfinite(torch.tensor(resumed)))
    assert first[-1] < first[0]  # the saved run learned something a reset would lose
    assert abs(resumed[0] - first[-1]) < 0.5 * (first[0] - first[-1]) + 0.05 * first[-1], (
        first, resumed)


def _gemctl(d: Path, uri: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gemctl.main", "submit", "ckpt.yaml", "--local",
                           *args], cwd=d, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "MLFLOW_TRACKING_URI": uri})


@pytest.mark.slow
def test_four_hsdp_row_wise_ranks_resume_on_two_table_wise(tiny_recipe, tmp_path,
                                                             monkeypatch, mlflow_server):
    """4 ranks (HSDP 2x2, 2-way experts, row-wise tables) to 2 (2-way experts, table-wise,
    no HSDP). A
    mid-epoch checkpoint of the same run, resumed by gemctl in one process (the app run in this
    one), is refused with the reason (exit 2) before the run's record is touched."""
    d = tiny_recipe[0]
    monkeypatch.chdir(d)
    first, got, root = _reshard(tiny_recipe, tmp_path, HSDP_4, EXPERTS_2, epoch_end=2)
    assert any("resharded the checkpoint to this layout (world size 4 -> 2" in line
               for line in got["lines"]), got["lines"]
    _no_jump(first, got["losses"])

    tree = _tree(tiny_recipe, TABLE_WISE_2, 2)  # one process: world 1
    (d / "ckpt.yaml").write_text(yaml.safe_dump(tree))
    client = MlflowClient(mlflow_server)
    run = client.create_run(client.create_experiment("reshard-refused"))
    shutil.copytree(root / "step_00000001",
                    d / "gem_runs" / "local" / run.info.run_id / "step_00000001")
    proc = gemctl_in_process("submit", "ckpt.yaml", "--local", "--resume", run.info.run_id,
                             cwd=d, env={"MLFLOW_TRACKING_URI": mlflow_server})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "batch 1 of 2 in epoch 0 by 4 worker(s)" in proc.stderr
    assert "parallel.workers=4" in proc.stderr
    assert client.get_run(run.info.run_id).info.status == "RUNNING"  # as it was: untouched


@pytest.mark.slow
def test_submit_resume_says_what_changed(tiny_recipe, mlflow_server, monkeypatch):
    """gemctl submit --resume under another parallel section continues the run and says what
    changed and that the checkpoint was resharded, in the output and the run's record. (The
    run it resumes is trained here, in one process, as `gemctl submit --local` trains it.)"""
    from gem_platform.launch import submit

    d, tree = tiny_recipe
    tree = {**tree, "train": {**tree["train"], "steps": 4, "checkpoint_every": 2},
            "tracking": {**tree["tracking"], "experiment": "reshard-cli"}}
    (d / "ckpt.yaml").write_text(yaml.safe_dump(tree))
    monkeypatch.chdir(d)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    first = submit(recipe_from_dict(tree), local=True, echo=lambda _: None)
    client = MlflowClient(mlflow_server)
    exp = client.get_experiment_by_name("reshard-cli").experiment_id
    (run,) = client.search_runs([exp])
    assert run.info.run_id == first.run_id and run.info.status == "FINISHED"
    resumed = _gemctl(d, mlflow_server, "--resume", run.info.run_id,
                      "--set", "parallel.cpus_per_worker=2")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    said = "layout changed since the checkpoint (cpus_per_worker 1 -> 2): it is resharded"
    assert said in resumed.stdout
    assert "resharded the checkpoint to this layout (cpus_per_worker 1 -> 2)" in resumed.stdout
    logs = [a.path for a in client.list_artifacts(run.info.run_id)
            if a.path.startswith("resume-")]
    text = client.download_artifacts(run.info.run_id, logs[-1], str(d))
    assert said in Path(text).read_text()
    assert client.get_run(run.info.run_id).info.status == "FINISHED"


@pytest.mark.slow
def test_two_table_wise_ranks_resume_on_four_with_another_hsdp_group(tiny_recipe, tmp_path,
                                                                     monkeypatch):
    """2 ranks (table-wise) to 4 (HSDP with a shard group of 4, row-wise tables)."""
    monkeypatch.chdir(tiny_recipe[0])
    after = {"workers": 4, "gpus_per_host": 4, "hsdp_shard_group": 4,
             "embedding_sharding": "row_wise"}
    first, got, _ = _reshard(tiny_recipe, tmp_path, TABLE_WISE_2, after, epoch_end=4)
    assert any("world size 2 -> 4" in line and "table_wise -> row_wise" in line
               for line in got["lines"]), got["lines"]
    _no_jump(first, got["losses"])


@pytest.mark.slow
def test_tables_switched_between_fused_and_replicated_are_refused(tiny_recipe, tmp_path,
                                                                   monkeypatch):
    """One process: tables trained through TorchRec's fused Adagrad (a row-wise layout asked
    for) can't resume as plain replicated tables, whose Adagrad state is the torch one's."""
    from gem_platform.train.loop import train

    monkeypatch.chdir(tiny_recipe[0])
    fused = _tree(tiny_recipe, {"workers": 1, "embedding_sharding": "row_wise"}, 3)
    fused["loader"]["local_batch_size"] = 128
    train(recipe_from_dict(fused), echo=lambda _: None,
          checkpoints=LocalStore(tmp_path, every=2, keep=2))
    assert read_layout(str(tmp_path / "step_00000002")).sharded_tables
    plain = {**fused, "parallel": {"workers": 1}}
    with pytest.raises(ReshardError, match="sharded by TorchRec with its fused optimizer; "
                                           "this layout trains them replicated"):
        train(recipe_from_dict(plain), echo=lambda _: None,
              checkpoints=LocalStore(tmp_path, every=2, keep=2))
