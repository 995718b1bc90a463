"""Checkpoints of a training run: model and optimizer state through
torch.distributed.checkpoint (each rank writes its own shards; replicated tensors once), plus
one small file per rank with what is rank-specific (the loop's extras: loader position,
schedulers, running totals; and the RNG states).

Tables sharded by TorchRec train with its fused KeyedOptimizer, whose state
``get_state_dict`` cannot map (its parameters are not the model's). Its own ``state_dict``
(keyed by table name, ShardedTensor states) goes through DCP beside the model's; loading fills
those tensors in place and ``load_state_dict`` copies them into the fused kernels' buffers.

On Ray the folder is handed to Ray Train (``ray.train.report(checkpoint=...)``), which merges
every rank's files into one checkpoint in the run's storage and gives it back after a restart
(``ray.train.get_checkpoint()``). In-process runs keep the last K folders under
``gem_runs/local/<run id>/``.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torchrec.optim.keyed import KeyedOptimizer

STEP_FILE = "gem_step.json"
LOCAL_ROOT = Path("gem_runs/local")


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class Stateful:
    """Everything a resumed run needs to continue exactly where the saved one stood.

    ``optimizers`` may mix torch optimizers (mapped onto the model by ``get_state_dict``) and
    TorchRec KeyedOptimizers (saved through their own ``state_dict``)."""

    model: nn.Module
    optimizers: list[torch.optim.Optimizer]

    def __post_init__(self) -> None:
        self._plain = [o for o in self.optimizers if not isinstance(o, KeyedOptimizer)]
        self._keyed = [o for o in self.optimizers if isinstance(o, KeyedOptimizer)]
        for opt in self._keyed:
            # The learning rate lives in the param groups, which KeyedOptimizer leaves out by
            # default; without it the first resumed step would use the scheduler's initial lr.
            opt.save_param_groups(True)

    def _state(self) -> tuple[dict[str, Any], list[Any]]:
        """The DCP state (globally keyed tensors) and the keyed optimizers' param groups.

        The param groups stay out of DCP: each rank's fused optimizer groups the tables it
        holds, so group i differs between ranks, and DCP keeps one copy of a non-tensor
        value per key. They go to the rank's own file instead."""
        model_sd, optim_sd = get_state_dict(self.model, self._plain)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        groups = []
        for i, opt in enumerate(self._keyed):
            sd = opt.state_dict()
            groups.append(sd.pop("param_groups"))
            state[f"keyed_optim{i}"] = sd
        return state, groups

    def save(self, directory: Path, step: int, rank: int, extras: object) -> None:
        """Collective over all ranks: write model + optimizer shards and this rank's extras
        (any picklable object; the training loop's is a ``CheckpointExtras``)."""
        directory.mkdir(parents=True, exist_ok=True)
        state, groups = self._state()
        dcp.save(state, checkpoint_id=str(directory))
        torch.save({"extras": extras, "rng": rng_state(), "keyed_param_groups": groups},
                   directory / f"rank{rank}.pt")
        if rank == 0:
            (directory / STEP_FILE).write_text(json.dumps({"step": step}))

    def load(self, directory: Path, rank: int) -> object:
        """Collective: restore model + optimizers, RNG states; return this rank's extras as
        ``save`` got them (None for a checkpoint written without an ``extras`` entry)."""
        path = directory / f"rank{rank}.pt"
        if not path.exists():
            raise RuntimeError(f"checkpoint {directory} has no state for rank {rank}: it was "
                               "saved with a different number of workers")
        try:
            saved = torch.load(path, weights_only=False)
        except (AttributeError, ModuleNotFoundError) as err:  # a class this code no longer has
            raise RuntimeError(
                f"checkpoint {directory} was written by another version of the training code "
                f"and can't be read by this one ({err}): resume it with the code that wrote "
                "it, or start a new run") from None
        groups = saved.get("keyed_param_groups", [])
        if len(groups) != len(self._keyed):
            raise RuntimeError(
                f"checkpoint {directory} holds {len(groups)} TorchRec-sharded optimizer(s), "
                f"this run has {len(self._keyed)}: resume with the parallel section of the run "
                "that saved it")
        state, _ = self._state()
        # A table-wise sharded table has no local shard on most ranks. The default planner
        # drops such ShardedTensors, then takes the dropped keys for a pre-2.4 checkpoint and
        # re-keys the whole state the old way, which fails (pytorch/pytorch#163480). Nothing
        # here nests ShardedTensors (that was FSDP1's 2-D layout), so the flattening is moot.
        dcp.load(state, checkpoint_id=str(directory),
                 planner=DefaultLoadPlanner(flatten_sharded_tensors=False))
        set_state_dict(self.model, self._plain, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        for i, (opt, param_groups) in enumerate(zip(self._keyed, groups, strict=True)):
            opt.load_state_dict({**state[f"keyed_optim{i}"], "param_groups": param_groups})
        set_rng_state(saved["rng"])
        return saved.get("extras")


def checkpoint_step(directory: Path) -> int:
    return int(json.loads((directory / STEP_FILE).read_text())["step"])


def latest_checkpoint(root: Path) -> Path | None:
    """The complete checkpoint with the highest step under root (searched recursively)."""
    found = [p.parent for p in root.rglob(STEP_FILE)] if root.exists() else []
    return max(found, key=checkpoint_step, default=None)


class LocalCheckpoints:
    """step_<N> folders of an in-process run, keeping the newest ``keep``."""

    def __init__(self, root: Path, keep: int) -> None:
        self.root, self.keep = root, keep

    def folder(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def prune(self) -> None:
        done = sorted((p for p in self.root.glob("step_*") if (p / STEP_FILE).exists()),
                      key=lambda p: int(re.sub(r"\D", "", p.name)))
        for old in done[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)


class LocalStore:
    """Checkpoint store of an in-process run: step folders under ``root``, newest K kept."""

    def __init__(self, root: Path, every: int, keep: int) -> None:
        self.every = every
        self.local = LocalCheckpoints(root, keep)

    def latest(self) -> Path | None:
        return latest_checkpoint(self.local.root)

    def folder(self, step: int) -> Path:
        return self.local.folder(step)

    def commit(self, folder: Path, step: int, metrics: dict[str, float]) -> None:
        del folder, step, metrics
        self.local.prune()


class RayStore:
    """Checkpoint store of a Ray Train worker: each rank writes into a scratch folder that Ray
    Train merges into the run's checkpoint (keeping the newest per its CheckpointConfig)."""

    def __init__(self, every: int) -> None:
        self.every = every

    def latest(self) -> Path | None:
        import ray.train

        ckpt = ray.train.get_checkpoint()
        return Path(ckpt.to_directory()) if ckpt is not None else None

    def folder(self, step: int) -> Path:
        import tempfile

        return Path(tempfile.mkdtemp(prefix=f"gem-ckpt-{step:08d}-"))

    def commit(self, folder: Path, step: int, metrics: dict[str, float]) -> None:
        import ray.train
        from ray.train import Checkpoint

        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(str(folder)))
        shutil.rmtree(folder, ignore_errors=True)
