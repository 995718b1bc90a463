"""train.deterministic: two runs of one recipe give bitwise-identical losses and final metrics,
the deterministic switches hold while it trains and are restored after, and a cuBLAS
workspace setting that defeats reproducibility is refused."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
import yaml

from gem_kernels import deterministic_backward
from gem_platform.errors import GemError
from gem_platform.recipe import recipe_from_dict
from gem_platform.train.determinism import CUBLAS_ENV, deterministic_mode
from gem_platform.train.loop import train
from tests.tiny_training import TINY


def _timing(key: str) -> bool:
    """Metrics that measure wall time (and the peak they are taken against) vary by nature."""
    return key.startswith("perf/") and key != "perf/train_flops_per_step"


def _untimed(summary: dict) -> dict:
    """The summary with its learning curve's training seconds left out."""
    curve = [{k: v for k, v in p.items() if k != "train_s"}
             for p in summary["quality/eval_curve"]]
    return {**summary, "quality/eval_curve": curve}


def test_two_deterministic_runs_are_bitwise_identical(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tree = yaml.safe_load(TINY.format(data=tmp_path / "data"))
    tree["train"].update(steps=4, log_every=1, deterministic=True, seed=3)
    tree["parallel"]["workers"] = 1
    recipe = recipe_from_dict(tree)

    def run() -> tuple[list[tuple[int, str, float]], dict]:
        logged: list[tuple[int, str, float]] = []
        switches: list[tuple[bool, bool, bool]] = []

        def sink(metrics: dict[str, float], step: int) -> None:
            logged.extend((step, k, v) for k, v in sorted(metrics.items()) if not _timing(k))

        def on_step(step: int, _model: object) -> None:
            switches.append((torch.are_deterministic_algorithms_enabled(),
                             deterministic_backward(), torch.backends.cudnn.deterministic))

        summary = train(recipe, sink=sink, echo=lambda _: None, on_step=on_step)
        assert switches == [(True, True, True)] * 4
        return logged, summary

    before = torch.are_deterministic_algorithms_enabled()
    first_log, first = run()
    # Whatever ran between the two (here: the first run) must not matter.
    random.random(), np.random.rand(), torch.rand(3)
    second_log, second = run()
    first, second = _untimed(first), _untimed(second)

    losses = [(s, v) for s, k, v in first_log if k == "train/loss"]
    assert [s for s, _ in losses] == [1, 2, 3, 4]
    # Bitwise: == on floats (NaN would fail it, and there should be none).
    assert first_log == second_log
    kept = {k: v for k, v in first.items() if not _timing(k) and k != "peak_source"}
    assert kept == {k: v for k, v in second.items() if not _timing(k) and k != "peak_source"}
    assert len(kept["quality/eval_curve"]) == 4  # evaluated at every step, the last included
    assert first["train/deterministic"] == 1.0
    assert "eval/ne_ctr" in kept and "train/final_loss" in kept
    # The switches are restored after the run.
    assert torch.are_deterministic_algorithms_enabled() == before


def test_plain_run_records_it_was_not_deterministic(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tree = yaml.safe_load(TINY.format(data=tmp_path / "data"))
    tree["train"].update(steps=1)
    tree["parallel"]["workers"] = 1
    summary = train(recipe_from_dict(tree), echo=lambda _: None)
    assert summary["train/deterministic"] == 0.0


def test_mode_restores_switches_and_seeds_every_rng(monkeypatch):
    import torch._inductor.config as inductor

    monkeypatch.delenv(CUBLAS_ENV, raising=False)
    monkeypatch.setattr(inductor, "deterministic", False)
    torch.use_deterministic_algorithms(False)
    with deterministic_mode(7):
        assert inductor.deterministic  # compiled regions pick kernels without benchmarking
        assert torch.are_deterministic_algorithms_enabled()
        assert deterministic_backward()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        # new allocations are not NaN-filled (a fill kernel each): nothing reads them unwritten
        assert not torch.utils.deterministic.fill_uninitialized_memory
        draws = (random.random(), float(np.random.rand()), float(torch.rand(1)))
        assert os.environ[CUBLAS_ENV] == ":4096:8"
    assert not torch.are_deterministic_algorithms_enabled()
    assert not deterministic_backward() and not inductor.deterministic
    assert torch.utils.deterministic.fill_uninitialized_memory  # torch's default, restored
    with deterministic_mode(7):
        assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == draws


@pytest.mark.parametrize("checks_every_call", [False, True])
def test_cublas_variable_is_unset_only_where_torch_keeps_its_check(monkeypatch,
                                                                    checks_every_call):
    """torch 2.11 checks the variable once (the GPU test runs that); a build that checks at
    every deterministic cuBLAS call would refuse one without it, so the variable is set back.
    torch's check is stood in for here: on CPU no matmul goes through cuBLAS."""
    from gem_platform.train.determinism import _unset_once_checked

    seen = []

    def matmul(a, b):  # noqa: ANN001, ANN202
        seen.append(os.environ.get(CUBLAS_ENV))
        if checks_every_call and CUBLAS_ENV not in os.environ:
            raise RuntimeError("this operation is not deterministic because it uses CuBLAS")
        return a

    monkeypatch.setattr(torch.Tensor, "__matmul__", matmul)
    monkeypatch.setenv(CUBLAS_ENV, ":4096:8")
    _unset_once_checked(torch.device("cpu"))
    assert seen == [":4096:8", None]
    assert os.environ.get(CUBLAS_ENV) == (":4096:8" if checks_every_call else None)


def test_a_nondeterministic_cublas_setting_is_refused(monkeypatch):
    monkeypatch.setenv(CUBLAS_ENV, ":0:0")
    with pytest.raises(GemError, match=r"CUBLAS_WORKSPACE_CONFIG=':0:0'.*Unset"):
        with deterministic_mode(0):
            pass
    assert not torch.are_deterministic_algorithms_enabled()


def test_tracked_run_records_it_was_deterministic(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from gem_platform.launch import submit

    monkeypatch.chdir(tmp_path)
    tree = yaml.safe_load(TINY.format(data=tmp_path / "data"))
    tree["train"].update(steps=2, deterministic=True)
    tree["parallel"]["workers"] = 1
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tree["tracking"].update(uri=uri)
    outcome = submit(recipe_from_dict(tree), local=True, echo=lambda _: None)
    run = MlflowClient(uri).get_run(outcome.run_id)
    assert run.data.tags["gem.deterministic"] == "true"
    assert run.data.params["train.deterministic"] == "True"
    assert run.data.metrics["train/deterministic"] == 1.0
