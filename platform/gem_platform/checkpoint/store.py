"""Checkpoints of a training run: model and optimizer state through
torch.distributed.checkpoint (each rank writes its own shards; replicated tensors once), plus
one small file per rank with what is rank-specific (the loop's extras: loader position,
schedulers, running totals; and the RNG states).

Tables sharded by TorchRec train with its fused KeyedOptimizer, whose state
``get_state_dict`` cannot map (its parameters are not the model's). Its own ``state_dict``
(keyed by table name, ShardedTensor states) goes through DCP beside the model's; loading fills
those tensors in place and ``load_state_dict`` copies them into the fused kernels' buffers.

Every checkpoint records the layout it was written under (reshard.py): a resume under another
``parallel`` section loads it through DCP, which reshards every tensor by its global offsets,
and takes the loop's extras and RNG of rank 0 for ranks the saving run did not have.

Every checkpoint ends with a manifest (manifest.py): each file's size and CRC-32, written once
every rank's files are durable (the ranks gather their lists to rank 0). A resume loads the
newest checkpoint that matches its manifest (intact.py) and names the torn ones it passes over.

On Ray the folder is handed to Ray Train (``ray.train.report(checkpoint=...)``), which merges
every rank's files into one checkpoint in the run's storage and gives it back after a restart
(``ray.train.get_checkpoint()``). In-process runs keep the last K folders under
``gem_runs/local/<run id>/``.
"""

from __future__ import annotations

import contextlib
import random
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torchrec.optim.keyed import KeyedOptimizer

from gem_platform.checkpoint.intact import (
    DCP_INDEX,
    CheckpointError,
    ResumePoint,
    check_checkpoint,
    find_resume_point,
)
from gem_platform.checkpoint.manifest import (
    STEP_FILE,
    FileEntry,
    durable_entry,
    forget_completion,
    fsync_dir,
    write_manifest,
    write_step_file,
)
from gem_platform.checkpoint.reshard import (
    LAYOUT_FILE,
    Layout,
    ReshardError,
    check_reshard,
    check_tables,
    read_layout,
)
from gem_platform.file_lock import exclusive_lock

LOCAL_ROOT = Path("gem_runs/local")


@contextlib.contextmanager
def interrupts_kept() -> Iterator[None]:
    """Let a Ctrl-C or SIGTERM during a DCP save or load stay an interrupt.

    DCP wraps whatever a rank raised, KeyboardInterrupt included, in a CheckpointException, so
    a run stopped while it wrote a checkpoint would be recorded FAILED instead of KILLED.
    Where every failing rank was interrupted, the interrupt is raised instead."""
    try:
        yield
    except CheckpointException as err:
        causes = [exc for exc, _ in err.failures.values()]
        if causes and all(isinstance(c, KeyboardInterrupt | SystemExit) for c in causes):
            raise causes[0] from err
        raise


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
    parallel: dict[str, Any] = field(default_factory=dict)  # the recipe's parallel section
    world: int = 1
    # set by ``load``: the layout the loaded checkpoint was written under (None: not recorded)
    loaded_layout: Layout | None = field(default=None, init=False)

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
        (any picklable object; the training loop's is a ``CheckpointExtras``), then, on rank
        0 once every rank's files are durable, the manifest that marks the folder complete."""
        directory.mkdir(parents=True, exist_ok=True)
        if rank == 0:
            forget_completion(directory)
        state, groups = self._state()
        with interrupts_kept():
            dcp.save(state, checkpoint_id=str(directory))
        rank_file = directory / f"rank{rank}.pt"
        torch.save({"extras": extras, "rng": rng_state(), "keyed_param_groups": groups},
                   rank_file)
        mine = [rank_file, *sorted(directory.glob(f"__{rank}_*.distcp"))]
        if rank == 0:
            write_step_file(directory, step)
            self._write_layout(directory, extras)
            mine += [directory / DCP_INDEX, directory / STEP_FILE, directory / LAYOUT_FILE]
        entries = [durable_entry(path) for path in mine]
        fsync_dir(directory)
        every = _gather_to_first(entries)
        if rank == 0:
            write_manifest(directory, step, every)

    def _write_layout(self, directory: Path, extras: object) -> None:
        loader = getattr(extras, "loader", None) or {}
        layout = Layout(self.world, self.parallel, bool(self._keyed),
                        int(loader.get("epoch", 0)), int(loader.get("position", 0)),
                        int(loader.get("steps_per_epoch", 0)))
        (directory / LAYOUT_FILE).write_text(layout.to_json(), encoding="utf-8")

    def _rank_file(self, directory: Path, rank: int) -> Path:
        """This rank's file, or rank 0's where the checkpoint was written by fewer ranks."""
        path = directory / f"rank{rank}.pt"
        saved = self.loaded_layout
        if saved is not None:
            check_reshard(saved, self.parallel, self.world, str(directory))
            check_tables(saved, bool(self._keyed), str(directory))
            if rank >= saved.world:
                return directory / "rank0.pt"
        if not path.exists():
            raise RuntimeError(f"checkpoint {directory} has no state for rank {rank}: it was "
                               "saved with a different number of workers")
        return path

    def load(self, directory: Path, rank: int) -> object:
        """Collective: restore model + optimizers, RNG states; return this rank's extras as
        ``save`` got them (None for a checkpoint written without an ``extras`` entry).

        Under another layout than the checkpoint's (``loaded_layout`` says which), DCP
        reshards the tensors; a rank the saving run did not have takes rank 0's extras and
        RNG. ReshardError when the layout can't be mapped (see reshard.py)."""
        self.loaded_layout = read_layout(str(directory))
        path = self._rank_file(directory, rank)
        try:
            saved = torch.load(path, weights_only=False)
        except (AttributeError, ModuleNotFoundError) as err:  # a class this code no longer has
            raise RuntimeError(
                f"checkpoint {directory} was written by another version of the training code "
                f"and can't be read by this one ({err}): resume it with the code that wrote "
                "it, or start a new run") from None
        groups = saved.get("keyed_param_groups", [])
        if len(groups) != len(self._keyed):
            raise ReshardError(
                f"The checkpoint {directory} holds {len(groups)} TorchRec-sharded "
                f"optimizer(s), this run has {len(self._keyed)}.",
                "Resume with a parallel section that shards the tables the same way as the "
                "run that saved it.")
        state, _ = self._state()
        # A table-wise sharded table has no local shard on most ranks. The default planner
        # drops such ShardedTensors, then takes the dropped keys for a pre-2.4 checkpoint and
        # re-keys the whole state the old way, which fails (pytorch/pytorch#163480). Nothing
        # here nests ShardedTensors (that was FSDP1's 2-D layout), so the flattening is moot.
        with interrupts_kept():
            dcp.load(state, checkpoint_id=str(directory),
                     planner=DefaultLoadPlanner(flatten_sharded_tensors=False))
        set_state_dict(self.model, self._plain, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        for i, (opt, param_groups) in enumerate(zip(self._keyed, groups, strict=True)):
            opt.load_state_dict({**state[f"keyed_optim{i}"],
                                 "param_groups": _regroup(opt, param_groups)})
        set_rng_state(saved["rng"])
        return saved.get("extras")


def _regroup(opt: KeyedOptimizer, saved: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The saved param groups of a fused optimizer, fitted to the tables this rank holds now.

    Each rank's fused optimizer groups the table shards it holds, so under another layout the
    groups name other tables; their settings (learning rate and the rest) are the same in
    every group of a fused optimizer, so the saved first group's settings go onto each of the
    groups this rank has now."""
    now = opt.state_dict()["param_groups"]
    if [g["params"] for g in now] == [g["params"] for g in saved] or not saved:
        return saved
    settings = {k: v for k, v in saved[0].items() if k != "params"}
    return [{**group, **settings, "params": group["params"]} for group in now]


def _gather_to_first(entries: list[FileEntry]) -> list[FileEntry]:
    """Every rank's file entries on rank 0 (a rank's own elsewhere); returns once all ranks
    have described their durable files, so rank 0's manifest comes after all of them."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return entries
    gathered: list[list[FileEntry]] | None = (
        [[] for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None)
    dist.gather_object(entries, gathered, dst=0)
    return [e for part in gathered for e in part] if gathered is not None else entries


def latest_checkpoint(root: Path) -> Path | None:
    """The newest intact checkpoint under root (searched recursively), or None."""
    try:
        point = find_resume_point(str(root))
    except CheckpointError:
        return None
    return Path(point.folder) if point.folder else None


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
    """Checkpoint store of an in-process run: step folders under ``root``, newest K kept.

    ``start``: the resume point the driver chose (and reported) before it reopened the run;
    without it the store picks the newest intact checkpoint itself (CheckpointError when
    there are checkpoints and none is intact)."""

    def __init__(self, root: Path, every: int, keep: int, start: ResumePoint | None = None
                 ) -> None:
        self.every = every
        self.local = LocalCheckpoints(root, keep)
        self.start = start

    def latest(self) -> Path | None:
        point = self.start or find_resume_point(str(self.local.root))
        return Path(point.folder) if point.folder else None

    def folder(self, step: int) -> Path:
        return self.local.folder(step)

    def commit(self, folder: Path, step: int, metrics: dict[str, float]) -> None:
        del folder, step, metrics
        self.local.prune()


def host_copy(checkpoint: Any) -> Path:
    """A local copy of a Ray Train ``Checkpoint`` that every process of this host reads and
    none rewrites: the first process downloads it, the others wait for it and reuse it.

    ``Checkpoint.to_directory()`` downloads into one folder per checkpoint and host, and its
    lock only keeps two downloads from running at once: a rank that asks after another has
    finished downloads again into the same folder, rewriting the files in place while that
    rank may be reading them, so a restart's ranks now and then load torn files."""
    import hashlib
    import tempfile

    key = hashlib.sha256(f"{checkpoint.filesystem.type_name}:{checkpoint.path}".encode())
    folder = Path(tempfile.gettempdir()) / f"gem-checkpoint-{key.hexdigest()[:24]}"
    done = Path(f"{folder}.copied")
    with exclusive_lock(Path(f"{folder}.lock")):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # a copy a killed process left
            checkpoint.to_directory(str(folder))
            done.touch()
    return folder


class RayStore:
    """Checkpoint store of a Ray Train worker: each rank writes into a scratch folder that Ray
    Train merges into the run's checkpoint (keeping the newest per its CheckpointConfig).

    Ray Train hands back the newest checkpoint it registered, torn or not; ``fallback`` (the
    folder or URI the driver found to be the newest intact one) replaces a torn one."""

    def __init__(self, every: int, fallback: str | None = None) -> None:
        self.every = every
        self.fallback = fallback

    def latest(self) -> Path | None:
        import ray.train
        from ray.train import Checkpoint

        ckpt = ray.train.get_checkpoint()
        if ckpt is not None:
            folder = host_copy(ckpt)
            verdict = check_checkpoint(str(folder))
            if verdict.intact:
                return folder
            if self.fallback is None:
                raise CheckpointError(f"The run's latest checkpoint ({ckpt.path}) is torn: "
                                      f"{verdict.reason}.",
                                      "Resume the run (gemctl submit --resume RUN_ID), which "
                                      "falls back to its newest intact checkpoint.")
        if self.fallback is None:
            return None
        return host_copy(Checkpoint(self.fallback))

    def folder(self, step: int) -> Path:
        import tempfile

        return Path(tempfile.mkdtemp(prefix=f"gem-ckpt-{step:08d}-"))

    def commit(self, folder: Path, step: int, metrics: dict[str, float]) -> None:
        import ray.train
        from ray.train import Checkpoint

        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(str(folder)))
        shutil.rmtree(folder, ignore_errors=True)
