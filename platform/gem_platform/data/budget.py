"""What a synthetic dataset will cost before any of it is made, against what this machine has:
the bytes of its shards on disk and the generator's peak memory. A recipe that asks for more is
refused at once, with the estimate and what is free, instead of after writing gigabytes.

The disk estimate is the uncompressed size of the columns (shards are zstd-compressed, so the
real size is smaller): samples x mean history length x bytes per event, plus bytes per sample.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from gem_platform.data.config import SyntheticConfig
from gem_platform.data.staging import existing_ancestor
from gem_platform.errors import DataError

EVENT_BYTES = 8 + 4 + 4 + 8  # item id, action type, age, item category
SAMPLE_BYTES = 4 + 4 * 4 + 8 + 8 + 8 + 4 + 2  # length, list offsets, ad, category, user, dense
# Generator memory (numpy arrays and their temporaries), per item and user of the planted
# world, per sparse id, per event and sample of the shard in hand, per eval sample kept.
ITEM_MEMORY, USER_MEMORY, ID_MEMORY = 400, 128, 16
EVENT_MEMORY, SAMPLE_MEMORY, EVAL_MEMORY = 160, 512, 18
PILOT_ROWS = 8192  # samples drawn to calibrate the base rates (synthetic.py)
MAX_MARGIN = 1 << 30  # disk kept free: 5% of the filesystem, at most this much
MEMORY_SHARE = 0.8  # of the available memory the generator may plan to use
GIB = float(1 << 30)


@dataclass(frozen=True)
class SyntheticCost:
    """The estimate, with the figures it comes from (for the message)."""

    num_samples: int
    mean_len: float
    sample_bytes: float
    disk_bytes: int
    memory_bytes: int


def synthetic_cost(syn: SyntheticConfig, mean_len: float) -> SyntheticCost:
    """Disk and memory of generating ``syn`` whose histories average ``mean_len`` events."""
    sparse = sum(4 + 8 * (1 + f.max_ids) / 2 if f.multi_hot else 8
                 for f in syn.sparse_features)
    per_sample = SAMPLE_BYTES + 4 * syn.dense_dim + sparse
    disk = syn.num_samples * (mean_len * EVENT_BYTES + per_sample)
    ids = syn.num_users + sum(f.vocab_size for f in syn.sparse_features)
    rows = max(min(syn.rows_per_shard, syn.num_samples), PILOT_ROWS)
    memory = (syn.num_items * ITEM_MEMORY + syn.num_users * USER_MEMORY + ids * ID_MEMORY
              + rows * (mean_len * EVENT_MEMORY + SAMPLE_MEMORY) + syn.num_eval * EVAL_MEMORY)
    return SyntheticCost(syn.num_samples, mean_len, per_sample, int(disk), int(memory))


def size(nbytes: float) -> str:
    """``nbytes`` for a message, in the largest binary unit that keeps it at 1 or more."""
    for unit, scale in (("GiB", GIB), ("MiB", float(1 << 20)), ("KiB", 1024.0)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes:,.0f} bytes"


def available_memory() -> int | None:
    """Bytes this process may still allocate: MemAvailable, capped by a cgroup limit."""
    found: list[int] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = Path("/sys/fs/cgroup/memory.current").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int(used))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def check_affordable(out: Path, cost: SyntheticCost) -> None:
    """Refuse (DataError) a dataset that would not fit on the disk of ``out`` (keeping a
    margin) or in this machine's memory."""
    where = existing_ancestor(out)
    usage = shutil.disk_usage(where)
    margin = min(MAX_MARGIN, usage.total // 20)
    if cost.disk_bytes + margin > usage.free:
        raise DataError(
            f"data.synthetic asks for about {size(cost.disk_bytes)} of shards "
            f"({cost.num_samples:,} samples x {cost.mean_len:,.0f} events of history x "
            f"{EVENT_BYTES} bytes, plus {cost.sample_bytes:,.0f} bytes a sample), but {where} "
            f"has {size(usage.free)} free and {size(margin)} is kept spare; nothing was "
            "written.",
            "Lower data.synthetic.num_samples (or data.synthetic.seq_len), free disk space, "
            "or point data.path at a bigger disk.")
    memory = available_memory()
    if memory is not None and cost.memory_bytes > MEMORY_SHARE * memory:
        raise DataError(
            f"data.synthetic needs about {size(cost.memory_bytes)} of memory to generate (its "
            f"items, users, sparse ids and one shard of rows), but {size(memory)} is "
            "available; nothing was written.",
            "Lower data.synthetic.num_items, num_users, sparse_features' vocab_size or "
            "rows_per_shard.")


__all__ = ["SyntheticCost", "available_memory", "check_affordable", "size", "synthetic_cost"]
