"""The jagged batch every model block consumes: values + offsets, never padded."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torchrec import KeyedJaggedTensor

from gem_kernels import remember_host_copy

TASKS: tuple[str, ...] = ("ctr", "cvr")


@dataclass
class JaggedBatch:
    """One batch of B samples.

    The behaviour history of sample b is positions ``seq_offsets[b]:seq_offsets[b+1]`` of the
    ``seq_*`` tensors, oldest first. ``labels[:, 0]`` is the click, ``labels[:, 1]`` the
    conversion, which is only defined where the sample was clicked (``cvr_mask``).
    ``seq_item_categories`` and ``ad_category`` follow the item ids where items carry a
    category.
    """

    seq_offsets: torch.Tensor  # (B+1,) int64
    seq_item_ids: torch.Tensor  # (T,) int64, 1-based item ids (0 = none)
    seq_action_types: torch.Tensor  # (T,) int64
    seq_age: torch.Tensor  # (T,) float32, log1p(seconds between the event and the request)
    ad_item_id: torch.Tensor  # (B,) int64, the candidate ad's item id
    sparse: KeyedJaggedTensor  # non-sequence categorical features (single- and multi-hot)
    dense: torch.Tensor  # (B, D) float32
    labels: torch.Tensor  # (B, 2) float32: ctr, cvr
    # Item categories (datasets with meta.num_categories > 0; both None otherwise).
    seq_item_categories: torch.Tensor | None = None  # (T,) int64, category of each event
    ad_category: torch.Tensor | None = None  # (B,) int64, the candidate's category

    @property
    def num_samples(self) -> int:
        return int(self.seq_offsets.numel() - 1)

    @property
    def seq_lengths(self) -> torch.Tensor:
        return self.seq_offsets[1:] - self.seq_offsets[:-1]

    @property
    def max_seq_len(self) -> int:
        lengths = self.seq_lengths
        return int(lengths.max().item()) if lengths.numel() else 0

    @property
    def num_tokens(self) -> int:
        """T, the history events of the whole batch (read from the offsets: a device sync
        when they live on a GPU; prefetched batches answer from the host)."""
        return int(self.seq_offsets[-1].item()) if self.seq_offsets.numel() else 0

    @property
    def cvr_mask(self) -> torch.Tensor:
        """Samples on which the CVR task is defined (clicked ones)."""
        return self.labels[:, 0] > 0.5

    def to(self, device: torch.device | str, non_blocking: bool = False) -> JaggedBatch:
        moved = {}
        for f in fields(self):
            v = getattr(self, f.name)
            moved[f.name] = None if v is None else v.to(device, non_blocking=non_blocking)
        out = JaggedBatch(**moved)
        remember_seq_offsets(self, out)
        return out


def remember_seq_offsets(host: JaggedBatch, moved: JaggedBatch) -> None:
    """Record the host copy of a batch's seq_offsets once moved from the CPU to a GPU: GDPA
    builds its tile schedules on the host and would otherwise read them back (a stream sync per
    call). Only the offsets: nothing else is read on the host."""
    if host.seq_offsets.device.type == "cpu" and moved.seq_offsets.device.type == "cuda":
        remember_host_copy(moved.seq_offsets, host.seq_offsets)
