"""Torn checkpoints: every checkpoint carries a manifest (each file's size and CRC-32) written
after all its files are durable; a resume checks it first, falls back to the newest intact
checkpoint naming what it skipped and why, and where none is intact refuses with the reasons
before the run's MLflow status is touched. Checkpoints written before manifests existed resume
when their files read back (legacy)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from gem_platform.checkpoint.intact import (
    MANIFEST_FILE,
    CheckpointError,
    check_checkpoint,
    find_resume_point,
)
from gem_platform.checkpoint.store import LocalStore, latest_checkpoint
from gem_platform.recipe import recipe_from_dict
from gem_platform.train.loop import train
from tests.conftest import gemctl_in_process
from tests.resume import losses_of

STEP2, STEP4 = "step_00000002", "step_00000004"


def _shard(folder: Path) -> Path:
    (shard,) = folder.glob("__0_*.distcp")
    return shard


def _truncate(path: Path, keep: int = 100) -> None:
    with open(path, "r+b") as f:
        f.truncate(keep)


def truncate_shard(folder: Path) -> str:
    _truncate(_shard(folder), 1000)
    return _shard(folder).name


def truncate_rank_file(folder: Path) -> str:
    _truncate(folder / "rank0.pt")
    return "rank0.pt"


def garble_step_file(folder: Path) -> str:
    (folder / "gem_step.json").write_text("xx{garbage")
    return "gem_step.json"


CORRUPTIONS = [truncate_shard, truncate_rank_file, garble_step_file]


def strip_manifest(folder: Path) -> None:
    """Make ``folder`` look like a checkpoint of the code before manifests."""
    (folder / MANIFEST_FILE).unlink()
    step = json.loads((folder / "gem_step.json").read_text())["step"]
    (folder / "gem_step.json").write_text(json.dumps({"step": step}))


@pytest.fixture(scope="module")
def trained(tiny_recipe):
    """(recipe, checkpoint root of a 6-step run with checkpoints at steps 2 and 4, its
    uninterrupted losses)."""
    d, tree = tiny_recipe
    cwd = os.getcwd()
    os.chdir(d)
    try:
        recipe = recipe_from_dict(tree)
        full, _ = losses_of(recipe)
        root = d / "ckpts-intact"
        train(recipe, echo=lambda _: None, checkpoints=LocalStore(root, every=2, keep=5))
    finally:
        os.chdir(cwd)
    assert sorted(p.name for p in root.glob("step_*")) == [STEP2, STEP4]
    return recipe, root, full


@pytest.fixture
def ckpts(trained, tmp_path):
    """A fresh copy of the trained run's checkpoints."""
    _, root, _ = trained
    copy = tmp_path / "ckpts"
    shutil.copytree(root, copy)
    return copy


def test_manifest_lists_every_file_and_is_written_last(ckpts):
    folder = ckpts / STEP4
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    assert manifest["step"] == 4
    listed = {f["name"]: f for f in manifest["files"]}
    on_disk = {p.name for p in folder.iterdir()} - {MANIFEST_FILE}
    assert set(listed) == on_disk == {".metadata", "gem_step.json", "gem_layout.json",
                                      "rank0.pt", _shard(folder).name}
    for name, entry in listed.items():
        data = (folder / name).read_bytes()
        assert entry["size"] == len(data)
        assert entry["crc32"] == f"{zlib.crc32(data):08x}"
    newest_file = max((folder / n).stat().st_mtime_ns for n in on_disk)
    assert (folder / MANIFEST_FILE).stat().st_mtime_ns >= newest_file
    verdict = check_checkpoint(str(folder))
    assert verdict.intact and not verdict.legacy and verdict.step == 4


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__)
def test_torn_newest_checkpoint_falls_back_and_says_why(ckpts, corrupt):
    name = corrupt(ckpts / STEP4)
    point = find_resume_point(str(ckpts))
    assert Path(point.folder).name == STEP2 and point.step == 2
    (skipped,) = point.skipped
    assert Path(skipped.folder).name == STEP4 and name in skipped.reason
    (line,) = point.skip_lines()
    assert line.startswith(f"skipped checkpoint {STEP4}") and name in line
    assert latest_checkpoint(ckpts).name == STEP2


def test_corrupt_bytes_of_the_same_size_are_caught(ckpts):
    shard = _shard(ckpts / STEP4)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    verdict = check_checkpoint(str(ckpts / STEP4))
    assert not verdict.intact and "checksum" in verdict.reason and shard.name in verdict.reason


def test_save_that_stopped_before_its_manifest_is_torn(ckpts):
    (ckpts / STEP4 / MANIFEST_FILE).unlink()
    verdict = check_checkpoint(str(ckpts / STEP4))
    assert not verdict.intact and MANIFEST_FILE in verdict.reason


def test_no_intact_checkpoint_refuses_with_every_reason(ckpts):
    truncate_rank_file(ckpts / STEP4)
    truncate_shard(ckpts / STEP2)
    with pytest.raises(CheckpointError) as err:
        find_resume_point(str(ckpts))
    text = str(err.value)
    assert STEP4 in text and "rank0.pt" in text and STEP2 in text and ".distcp" in text
    assert latest_checkpoint(ckpts) is None


def test_legacy_checkpoint_without_manifest_resumes_when_its_files_read(ckpts):
    strip_manifest(ckpts / STEP4)
    point = find_resume_point(str(ckpts))
    assert Path(point.folder).name == STEP4 and point.legacy and not point.skipped
    (note,) = point.notes()
    assert STEP4 in note and "no manifest" in note


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__)
def test_torn_legacy_checkpoint_falls_back(ckpts, corrupt):
    strip_manifest(ckpts / STEP4)
    strip_manifest(ckpts / STEP2)
    name = corrupt(ckpts / STEP4)
    point = find_resume_point(str(ckpts))
    assert Path(point.folder).name == STEP2
    (skipped,) = point.skipped
    assert name in skipped.reason


def test_resume_after_fallback_trains_on_exactly(trained, ckpts, monkeypatch):
    recipe, _, full = trained
    monkeypatch.chdir(ckpts.parent)
    garble_step_file(ckpts / STEP4)
    lines: list[str] = []
    logged: list[tuple[int, float]] = []
    train(recipe, sink=lambda m, s: logged.append((s, m["train/loss"]))
          if "train/loss" in m else None, echo=lambda event: lines.append(str(event)),
          checkpoints=LocalStore(ckpts, every=2, keep=5), published_through=2)
    assert any(line.startswith("resumed from step 2") for line in lines)
    assert [s for s, _ in logged] == [3, 4, 5, 6]
    for (_, a), (_, b) in zip(logged, full[2:], strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    # the replay saved step 4 again, whole
    assert check_checkpoint(str(ckpts / STEP4)).intact


def _gemctl(args: list[str], cwd: Path, uri: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run([sys.executable, "-m", "gemctl.main", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600,
                          env={**env, "MLFLOW_TRACKING_URI": uri})


@pytest.mark.slow
def test_failed_resume_leaves_a_finished_run_finished(tiny_recipe, tmp_path):
    d, tree = tiny_recipe
    tree = {**tree, "data": {**tree["data"], "path": str(d / "data")},
            "train": {**tree["train"], "steps": 8, "keep_checkpoints": 3}}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(tree))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = ["submit", "r.yaml", "--local", "--json"]
    first = _gemctl(args, tmp_path, uri)
    assert first.returncode == 0, first.stderr[-2000:]
    run_id = json.loads(first.stdout)["run_id"]
    client = MlflowClient(uri)
    assert client.get_run(run_id).info.status == "FINISHED"
    root = tmp_path / "gem_runs" / "local" / run_id
    assert sorted(p.name for p in root.glob("step_*")) == [STEP2, STEP4, "step_00000006"]
    backup = tmp_path / "backup"
    shutil.copytree(root / STEP2, backup)

    # The three torn checkpoints of the report, one in each folder: nothing to resume from.
    garble_step_file(root / "step_00000006")
    truncate_rank_file(root / STEP4)
    shard = truncate_shard(root / STEP2)
    # refused before anything starts: the app, run in this process
    refused = gemctl_in_process(*args, "--resume", run_id, cwd=tmp_path,
                                env={"MLFLOW_TRACKING_URI": uri})
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert "Traceback" not in refused.stderr
    for part in ("no intact checkpoint", "step_00000006", "gem_step.json", STEP4, "rank0.pt",
                 STEP2, shard):
        assert part in refused.stderr, part
    assert client.get_run(run_id).info.status == "FINISHED"

    # The oldest restored: the resume falls back to it, saying which it skipped and why.
    shutil.rmtree(root / STEP2)
    shutil.copytree(backup, root / STEP2)
    resumed = _gemctl([*args, "--resume", run_id], tmp_path, uri)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    skipped = [line for line in resumed.stderr.splitlines()
               if line.startswith("skipped checkpoint")]
    assert len(skipped) == 2, resumed.stderr[-3000:]
    assert "step_00000006" in skipped[0] and "gem_step.json" in skipped[0]
    assert STEP4 in skipped[1] and "rank0.pt" in skipped[1]
    assert "resumed from step 2" in resumed.stderr
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    log = Path(json.loads(resumed.stdout)["log"])
    assert all(line in (tmp_path / log).read_text() for line in skipped)
    (note,) = [a.path for a in client.list_artifacts(run_id) if a.path.startswith("resume-")]
    text = Path(client.download_artifacts(run_id, note, str(tmp_path))).read_text()
    assert all(line in text for line in skipped) and f"resuming from {STEP2}" in text
