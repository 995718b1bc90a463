"""Resuming a checkpoint under another ``parallel`` section (world size, HSDP shard group,
expert parallelism, embedding sharding).

Every checkpoint records the layout it was written under (``gem_layout.json``, listed in its
manifest): the world size, the parallel section, whether its tables trained through
TorchRec's fused optimizer, and where the loader stood in its epoch. torch.distributed.checkpoint
reshards the tensors themselves (dense DTensors, TorchRec's ShardedTensor tables and their
optimizer state) by their global offsets; what this module maps is the rest:

- the loader position. Each rank's share of the data and its permutation depend on the world
  size, so a checkpoint taken at an epoch's end (or start) continues in the new world at the
  next epoch's first batch, and every sample is still seen exactly once per epoch. A
  checkpoint taken in the middle of an epoch under another world size is refused: the samples
  the old ranks have not yet seen can't be handed to the new ranks' batches.
- tables that trained through TorchRec's fused optimizer and tables that trained replicated
  with a torch optimizer keep different optimizer state, and expert-parallel layers name
  their experts differently from plain ones: resuming across either boundary is refused.

No torch here: the driver checks a resume before it touches the run's record.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from gem_platform.errors import GemError

LAYOUT_FILE = "gem_layout.json"


class ReshardError(GemError):
    """A checkpoint can't be resumed under the layout asked for."""


@dataclass(frozen=True)
class Layout:
    """The layout a checkpoint was written under, and the loader's place in its epoch."""

    world: int
    parallel: dict[str, Any]
    sharded_tables: bool
    epoch: int = 0
    position: int = 0
    steps_per_epoch: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Layout:
        raw = json.loads(text)
        return cls(int(raw["world"]), dict(raw["parallel"]), bool(raw["sharded_tables"]),
                   int(raw.get("epoch", 0)), int(raw.get("position", 0)),
                   int(raw.get("steps_per_epoch", 0)))

    @property
    def at_epoch_boundary(self) -> bool:
        return self.position in (0, self.steps_per_epoch)


def read_layout(folder: str) -> Layout | None:
    """The layout recorded in the checkpoint ``folder`` (a local path or an object-store
    URI); None for a checkpoint written before layouts were recorded."""
    import pyarrow as pa

    from gem_platform.data.source import filesystem

    fs, path = filesystem(folder)
    try:
        with fs.open_input_stream(f"{path.rstrip('/')}/{LAYOUT_FILE}") as f:
            text = f.read().decode()
    except (FileNotFoundError, pa.ArrowException, OSError):
        return None
    try:
        return Layout.from_json(text)
    except (KeyError, TypeError, ValueError) as err:
        raise ReshardError(f"The checkpoint {folder} has a malformed {LAYOUT_FILE} ({err!r}).",
                           "Resume from another checkpoint of the run.") from None


def layout_changes(saved: Layout, parallel: dict[str, Any], world: int) -> list[str]:
    """What differs between the checkpoint's layout and the one asked for, one phrase each
    (e.g. ``world size 4 -> 2``, ``embedding_sharding table_wise -> row_wise``)."""
    changes = [f"world size {saved.world} -> {world}"] if saved.world != world else []
    for key in sorted(set(saved.parallel) | set(parallel)):
        before, now = saved.parallel.get(key), parallel.get(key)
        if before != now and key != "workers":
            changes.append(f"{key} {before} -> {now}")
    return changes


def check_reshard(saved: Layout, parallel: dict[str, Any], world: int, folder: str) -> None:
    """ReshardError when the checkpoint in ``folder`` can't continue under ``parallel`` in a
    world of ``world`` ranks: a mid-epoch loader position under another world size, or expert
    parallelism turned on or off."""
    if saved.world != world and not saved.at_epoch_boundary:
        raise ReshardError(
            f"The checkpoint {folder} was saved at batch {saved.position} of "
            f"{saved.steps_per_epoch} in epoch {saved.epoch} by {saved.world} worker(s); its "
            f"loader position can't be mapped to {world} worker(s): each worker's share of the "
            "data and its order depend on the world size, so the samples not yet seen this "
            "epoch can't be handed to the new workers exactly once.",
            f"Resume with parallel.workers={saved.world} (other parallel settings may change), "
            "or resume from a checkpoint saved at the end of an epoch (train.checkpoint_every "
            "a multiple of the steps per epoch).")
    _check_experts(saved, parallel, folder)


def _check_experts(saved: Layout, parallel: dict[str, Any], folder: str) -> None:
    """Expert-parallel layers name each expert by its index in the whole layer, under the
    layer's exchange module; plain layers name it in the layer's expert list. Between two
    expert-parallel layouts the names match (DCP moves each expert to its new holder), across
    the switch they do not."""
    before = int(saved.parallel.get("expert_parallel") or 1) > 1
    now = int(parallel.get("expert_parallel") or 1) > 1
    if before == now:
        return
    on = {True: "with", False: "without"}
    raise ReshardError(
        f"The checkpoint {folder} was written {on[before]} expert parallelism "
        f"(parallel.expert_parallel={saved.parallel.get('expert_parallel')}); this layout runs "
        f"{on[now]} it, and the experts' parameters and optimizer state are named differently "
        "in the two, so they can't be mapped onto each other.",
        "Resume with parallel.expert_parallel above 1 (any size that divides the experts and "
        "the ranks per host)" if before else
        "Resume with parallel.expert_parallel=1 (other parallel settings may change).")


def check_tables(saved: Layout, sharded_tables: bool, folder: str) -> None:
    """ReshardError when the checkpoint's tables trained under the other kind of optimizer
    (TorchRec's fused one vs. a replicated torch optimizer): their state does not map."""
    if saved.sharded_tables == sharded_tables:
        return
    kinds = {True: "sharded by TorchRec with its fused optimizer",
             False: "replicated with a torch optimizer"}
    raise ReshardError(
        f"The checkpoint {folder} holds embedding tables {kinds[saved.sharded_tables]}; this "
        f"layout trains them {kinds[sharded_tables]}, and the two keep different optimizer "
        "state, which can't be mapped onto each other.",
        "Resume with a parallel section that shards the tables the same way as the run that "
        f"saved it (it had {saved.parallel}).")


def resume_changes(folder: str | None, parallel: dict[str, Any], world: int
                   ) -> list[str] | None:
    """What a resume from the checkpoint ``folder`` changes in the layout (empty: nothing),
    after checking that it can be resharded (ReshardError); None when the checkpoint does not
    record its layout (written before layouts were recorded: only its own layout resumes)."""
    saved = read_layout(folder) if folder else None
    if saved is None:
        return None
    check_reshard(saved, parallel, world, folder or "")
    return layout_changes(saved, parallel, world)


def map_loader(saved: Layout | None, mine: dict[str, Any], now: dict[str, Any],
               world: int) -> dict[str, Any]:
    """The loader state to load: this rank's saved one (``mine``) in the same world, else the
    new batcher's own state (``now``) moved to the first batch of the epoch that follows the
    checkpoint's."""
    if saved is None or saved.world == world:
        return mine
    epoch = saved.epoch + (1 if saved.position and saved.position == saved.steps_per_epoch
                           else 0)
    return {**now, "epoch": epoch, "position": 0}


def fit_schedule(state: dict[str, Any], groups: int) -> dict[str, Any]:
    """An LR scheduler's saved state fitted to an optimizer with ``groups`` param groups.

    A fused table optimizer has one group per set of table shards a rank holds, so under
    another layout it has another number of them; its groups all share one schedule, so the
    first saved group's values stand for each."""
    return {k: [v[0]] * groups if isinstance(v, list) and v and len(v) != groups else v
            for k, v in state.items()}
