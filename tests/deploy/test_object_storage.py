"""Object storage end to end against a local S3-compatible server (moto's server mode, started
here as its own process): a dataset read from s3:// gives the same batches as the local copy,
both readers, and a two-worker Ray run with train.storage=s3://... writes its checkpoints to
the bucket and resumes from them, past a torn one; the same recipe with a Ray Train worker
killed mid-run is replaced from the last checkpoint and ends with the same final metrics."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import pyarrow.fs as pafs
import pytest
import torch

from gem_platform.balance import LoaderConfig, make_batcher
from gem_platform.data.config import DataConfig
from gem_platform.data.loader import iterate, open_table
from gem_platform.data.parquet import SampleTable
from gem_platform.data.prepare import prepare_dataset
from gem_platform.errors import DataError
from gem_platform.recipe import recipe_from_dict
from gem_platform.storage import StorageError, check_storage, latest_checkpoint

BUCKET = "gem-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3(tmp_path_factory) -> Iterator[pafs.S3FileSystem]:
    """A moto S3 server on a free local port, the environment pointing at it, one bucket."""
    port = _free_port()
    log = tmp_path_factory.mktemp("moto") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                                 "-p", str(port)], stdout=out, stderr=subprocess.STDOUT)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"moto server did not start: {log.read_text()}") from None
                time.sleep(0.2)
        fs = pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http",
                               access_key="test", secret_key="test", region="us-east-1",
                               allow_bucket_creation=True)
        fs.create_dir(BUCKET)
        yield fs
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def local_and_remote(tmp_path_factory, s3) -> tuple[str, str]:
    """A small generated dataset, and its copy in the bucket."""
    path = tmp_path_factory.mktemp("s3data") / "ds"
    prepare_dataset(DataConfig(source="synthetic", path=str(path), synthetic={
        "num_samples": 1500, "num_users": 200, "num_items": 300, "num_clusters": 10,
        "rows_per_shard": 400, "seq_len": {"mean": 20, "min": 2, "max": 64}}))
    pafs.copy_files(str(path), f"{BUCKET}/ds", source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=s3)
    return str(path), f"s3://{BUCKET}/ds"


def _batches(path: str, cfg: LoaderConfig, steps: int) -> list:
    table = open_table(path, "train", 1, 2, cfg)
    batcher = make_batcher(cfg, table.seq_lengths, steps_per_epoch=4, rank=1,
                           pieces=table.pieces)
    it = iterate(table, batcher, 0)
    out = [next(it)[0] for _ in range(steps)]
    it.close()
    return out


@pytest.mark.parametrize("window", [None, 256])
def test_dataset_in_object_storage_reads_like_the_local_copy(local_and_remote, window) -> None:
    local, remote = local_and_remote
    cfg = LoaderConfig(batching="bbs_v2", local_batch_size=64, window_samples=window)
    for a, b in zip(_batches(local, cfg, 12), _batches(remote, cfg, 12), strict=True):
        assert torch.equal(a.seq_item_ids, b.seq_item_ids)
        assert torch.equal(a.seq_offsets, b.seq_offsets)
        assert torch.equal(a.labels, b.labels)
        assert torch.equal(a.sparse.values(), b.sparse.values())
    eval_local = SampleTable.load(local, "eval")
    eval_remote = SampleTable.load(remote, "eval")
    assert np.array_equal(eval_local.seq_lengths, eval_remote.seq_lengths)


def test_missing_remote_dataset_is_a_clear_error(s3) -> None:
    with pytest.raises(DataError, match="meta.json is missing"):
        SampleTable.load(f"s3://{BUCKET}/nowhere", "train")


def test_storage_probe_names_the_field(s3) -> None:
    check_storage(recipe_from_dict({"train": {"storage": f"s3://{BUCKET}/runs"}}))
    with pytest.raises(StorageError, match="train.storage 's3://no-such-bucket/runs'"):
        check_storage(recipe_from_dict({"train": {"storage": "s3://no-such-bucket/runs"}}))


def _kill_one_train_worker() -> bool:
    """Kill one Ray Train worker of the Ray this process started (not another test's)."""
    for p in psutil.Process().children(recursive=True):
        try:
            cmd, name = " ".join(p.cmdline()), p.name()
        except psutil.Error:
            continue
        if "RayTrainWorker" in cmd or name.startswith("ray::RayTrainW"):
            p.kill()
            return True
    return False


@dataclass
class RayRun:
    """The module's uninterrupted two-worker Ray run, checkpointing to the bucket."""

    folder: Path  # where it ran (the tests' submits run there too)
    uri: str
    tree: dict
    run_id: str
    metrics: dict[str, float]  # its final metrics, read back as it finished


@pytest.fixture(scope="module")
def ray_run(local_and_remote, s3, tmp_path_factory) -> Iterator[RayRun]:
    """Two Ray Train workers train 10 steps and checkpoint to the bucket every 2. The module's
    submits share one embedded Ray, started here by this first one."""
    from mlflow.tracking import MlflowClient

    from gem_platform.launch import submit

    _, remote = local_and_remote
    folder = tmp_path_factory.mktemp("s3run")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    tree = {
        "name": "s3run",
        "model": {"d_model": 16, "num_heads": 2, "pooled_queries": 2, "dhen_layers": 1,
                  "expert_hidden": 32, "head_hidden": 32},
        "data": {"source": "parquet", "path": remote},
        "loader": {"batching": "bbs_v2", "local_batch_size": 64, "window_samples": 256},
        "train": {"steps": 10, "log_every": 2, "checkpoint_every": 2, "eval_max_samples": 64,
                  "max_failures": 2, "storage": f"s3://{BUCKET}/runs"},
        "parallel": {"workers": 2, "cpus_per_worker": 1},
        "tracking": {"uri": uri, "experiment": "s3"},
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        outcome = submit(recipe_from_dict(tree), echo=lambda _: None)
    run = MlflowClient(uri).get_run(outcome.run_id)
    yield RayRun(folder, uri, tree, outcome.run_id, dict(run.data.metrics))


@pytest.mark.slow
def test_killed_worker_recovers_with_same_final_metrics(ray_run, monkeypatch) -> None:
    """The same recipe again, with a Ray Train worker killed after step 4: Ray Train replaces
    the worker group, which resumes from the newest checkpoint in the bucket; the run's record
    has each step once and its final metrics equal the uninterrupted run's."""
    from mlflow.tracking import MlflowClient

    from gem_platform.launch import submit
    from tests.checkpoint.test_checkpoint import _history_steps, _wait_for_step

    monkeypatch.chdir(ray_run.folder)
    tree = {**ray_run.tree, "tracking": {"uri": ray_run.uri, "experiment": "s3-kill"}}
    outcome: dict = {}

    def killed_run() -> None:
        try:
            outcome["run"] = submit(recipe_from_dict(tree), echo=lambda _: None)
        except BaseException as err:  # re-raised in the test's thread below
            outcome["error"] = err

    thread = threading.Thread(target=killed_run, daemon=True)
    thread.start()
    try:
        run = _wait_for_step(ray_run.uri, "s3-kill", 4, thread.is_alive)
        if run is None:
            pytest.skip("the run finished before a worker could be killed")
        assert _kill_one_train_worker()
    finally:
        thread.join(timeout=600)  # Ray stays up while the run uses it
    if "error" in outcome:
        raise outcome["error"]
    assert outcome["run"].run_id == run.info.run_id
    killed = MlflowClient(ray_run.uri).get_run(run.info.run_id)
    assert killed.info.status == "FINISHED"
    assert _history_steps(ray_run.uri, run.info.run_id) == [2, 4, 6, 8, 10]
    for key in ("eval/auc_ctr", "eval/ne_ctr", "train/final_loss"):
        assert killed.data.metrics[key] == pytest.approx(ray_run.metrics[key], rel=1e-4), key


@pytest.mark.slow
def test_ray_run_checkpoints_to_object_storage_and_resumes_past_a_torn_one(
        ray_run, s3, monkeypatch) -> None:
    """The module's run checkpointed to the bucket; with rank 1's file of the newest
    checkpoint cut short there, the resume catches it by the manifest and continues from the
    one before."""
    from mlflow.tracking import MlflowClient

    from gem_platform.launch import ray_run_dir, submit

    monkeypatch.chdir(ray_run.folder)
    recipe = recipe_from_dict(ray_run.tree)
    folder = ray_run_dir(recipe, ray_run.run_id)
    assert folder.startswith(f"s3://{BUCKET}/runs/s3run-")
    newest = latest_checkpoint(folder)
    assert newest is not None and newest.startswith(f"s3://{BUCKET}/runs/")
    files = {i.base_name: i.path for i in s3.get_file_info(pafs.FileSelector(
        newest.removeprefix("s3://"), recursive=True))}
    assert {"gem_step.json", "rank0.pt", "rank1.pt"} <= set(files)
    with s3.open_input_stream(files["rank1.pt"]) as f:
        head = f.read(100)
    with s3.open_output_stream(files["rank1.pt"]) as f:
        f.write(head)

    lines: list[str] = []
    resumed = submit(recipe, echo=lambda event: lines.append(str(event)), resume=ray_run.run_id)
    assert resumed.run_id == ray_run.run_id
    said = "\n".join(lines)
    name = newest.rsplit("/", 1)[1]
    assert f"skipped checkpoint {name} (step 8): rank1.pt is 100 bytes" in said, said
    assert "resumed from step 6" in said, said
    client = MlflowClient(ray_run.uri)
    assert client.get_run(ray_run.run_id).info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(ray_run.run_id, "train/loss")]
    assert steps == [2, 4, 6, 8, 10]
