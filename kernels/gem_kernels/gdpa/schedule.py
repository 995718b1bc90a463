"""Work list and persistent schedule for the GDPA kernels.

A work item is one (sample, row block, head): a block of query rows in the forward and dQ
kernels, a block of key rows in the dK/dV kernel. Its inner loop visits exactly the column
blocks that hold that sample's data, so no (query block, key block) tile outside a sample is
ever computed: tile skipping comes from the offsets, not from masking.

Items are sorted by work (descending) and dealt to the programs of a persistent grid in
snake (zig-zag) order: round r gives items to programs 0..P-1 when r is even and P-1..0 when
odd, so one program's big item is followed by a small one and long samples spread over all
SMs; with only a few items per SM, each item (largest first) goes to the least-loaded SM
instead (greedy), since the zig-zag alone leaves ~16% imbalance there. Each program then runs
its items in that order.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from gem_kernels.host_offsets import host_offsets, host_to_device
from gem_kernels.identity_cache import IdentityCache


@dataclass
class Schedule:
    """items (n, 6) int32 [block, head, row_start, row_len, col_start, col_len] grouped by
    program (everything an item needs, so the kernel's next-item loads never chain);
    prog_ptr (P+1,) int32."""

    items: torch.Tensor
    prog_ptr: torch.Tensor
    num_programs: int
    work: torch.Tensor  # (P,) float64 work per program (CPU), for reporting

    @property
    def num_items(self) -> int:
        return int(self.items.shape[0])


def item_work(col_lengths: torch.Tensor, block_cols: int) -> torch.Tensor:
    """Cost of one item: its column blocks plus one for loading and storing its row tile."""
    return torch.div(col_lengths + block_cols - 1, block_cols, rounding_mode="floor") + 1


BLOCK_SETS = ("all", "first", "middle", "last")


def build_items(row_lengths: torch.Tensor, col_lengths: torch.Tensor, block_rows: int,
                block_cols: int, heads: int, cover_empty_rows: bool = False,
                blocks: str = "all") -> tuple[torch.Tensor, torch.Tensor]:
    """All (sample, row block, head) items with at least one row, and their work (CPU).
    cover_empty_rows: a sample with no rows but some columns still gets one (empty) item, for
    kernels that write per-column outputs (a one-pass backward must zero their gradient).
    blocks: which of a sample's row blocks: 'all', 'first' (block 0), 'middle' (neither the
    first nor the last) or 'last' (the last of two or more); the phased backward runs the
    three sets as three launches so that their order is the stream's."""
    if blocks not in BLOCK_SETS:
        raise ValueError(f"blocks must be one of {BLOCK_SETS}; got {blocks!r}")
    row_lengths = row_lengths.to("cpu", torch.int64)
    col_lengths = col_lengths.to("cpu", torch.int64)
    nblk = torch.div(row_lengths + block_rows - 1, block_rows, rounding_mode="floor")
    if cover_empty_rows:
        nblk = torch.where((nblk == 0) & (col_lengths > 0), 1, nblk)
    total = int(nblk.sum())
    sample = torch.repeat_interleave(torch.arange(nblk.numel()), nblk, output_size=total)
    first = torch.cumsum(nblk, 0) - nblk
    blk = torch.arange(total) - first[sample]
    if blocks != "all":
        last = nblk[sample] - 1
        keep = {"first": blk == 0, "middle": (blk > 0) & (blk < last),
                "last": (blk == last) & (blk > 0)}[blocks]
        sample, blk = sample[keep], blk[keep]
        total = int(sample.numel())
    work = item_work(col_lengths[sample], block_cols)
    h = torch.arange(heads).repeat(total)
    items = torch.stack([sample.repeat_interleave(heads), blk.repeat_interleave(heads), h], 1)
    return items, work.repeat_interleave(heads)


def by_work(work: torch.Tensor) -> torch.Tensor:
    """Item indices by descending work (ties in item order): the order items are dealt in."""
    return torch.argsort(-work.double(), stable=True)


def deal(work: torch.Tensor, num_programs: int, snake: bool = True,
         num_sms: int | None = None, order: torch.Tensor | None = None) -> torch.Tensor:
    """Program of each item. snake=True: sorted by work and dealt zig-zag; False: natural
    order, round-robin (what an unsorted persistent grid does). ``order``: ``by_work(work)``
    when the caller has it already.

    With num_sms < num_programs (several programs per SM; program p runs on SM p % num_sms)
    the snake deals over SMs first, then each SM's items over its own programs, so that the
    per-SM sums balance even when there are only a few items per program."""
    n = work.numel()
    if not snake:
        return torch.arange(n) % num_programs
    order = by_work(work) if order is None else order
    lanes = num_sms if num_sms is not None and num_sms < num_programs else num_programs
    sm, rnd = _deal_lanes(work.double()[order], lanes)
    if lanes == num_programs:
        prog_sorted = sm
    else:
        per_sm = torch.div(num_programs - sm + lanes - 1, lanes, rounding_mode="floor")
        i = rnd  # the item's index on its SM
        j = torch.where((i // per_sm) % 2 == 0, i % per_sm, per_sm - 1 - i % per_sm)
        prog_sorted = sm + lanes * j
    prog = torch.empty(n, dtype=torch.int64)
    prog[order] = prog_sorted
    return prog


# Up to this many items per lane the deal is greedy (each item, largest first, to the
# least-loaded lane); beyond it the zig-zag, as balanced once every lane holds many items.
EXACT_GREEDY_ITEMS_PER_LANE = 8


def _deal_lanes(sorted_work: torch.Tensor, lanes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(lane, index on its lane) of each item, items in descending work order.

    With few items per lane (short-side attention: one item per sample and head) a fixed
    zig-zag leaves the lane that drew the largest items ~16% over the mean, so each item goes
    to the least-loaded lane instead (longest-processing-time greedy; within a few percent).
    With many items per lane the zig-zag is already within ~1% and costs a few vectorised ops:
    round r deals to lanes 0..L-1 when r is even and L-1..0 when odd."""
    n = sorted_work.numel()
    if n <= EXACT_GREEDY_ITEMS_PER_LANE * lanes:
        heap = [(0.0, ln) for ln in range(lanes)]  # (load, lane): ties go to the lower lane
        counts = [0] * lanes
        lane, index = [0] * n, [0] * n
        for t, w in enumerate(sorted_work.tolist()):
            load, ln = heapq.heappop(heap)
            lane[t], index[t] = ln, counts[ln]
            counts[ln] += 1
            heapq.heappush(heap, (load + w, ln))
        return torch.tensor(lane, dtype=torch.int64), torch.tensor(index, dtype=torch.int64)
    rank = torch.arange(n)
    rnd = rank // lanes
    lane_t = rank % lanes
    return torch.where(rnd % 2 == 0, lane_t, lanes - 1 - lane_t), rnd


def imbalance(work: torch.Tensor, prog: torch.Tensor, num_programs: int,
              num_sms: int | None = None) -> float:
    """max/mean work per SM (program p runs on SM p % num_sms; per program if None)."""
    per_prog = torch.zeros(num_programs, dtype=torch.float64).index_add_(0, prog,
                                                                         work.double())
    if num_sms is not None and num_sms < num_programs:
        per_sm = torch.zeros(num_sms, dtype=torch.float64)
        per_sm.index_add_(0, torch.arange(num_programs) % num_sms, per_prog)
        per_prog = per_sm
    return float(per_prog.max() / per_prog.mean()) if per_prog.numel() else 1.0


def build_schedule(row_offsets: torch.Tensor, col_offsets: torch.Tensor, block_rows: int,
                   block_cols: int, heads: int, max_programs: int,
                   device: torch.device | str, snake: bool = True,
                   num_sms: int | None = None, cover_empty_rows: bool = False,
                   blocks: str = "all") -> Schedule:
    """snake=False keeps the natural item order dealt round-robin (the unbalanced baseline);
    num_sms: see ``deal``; cover_empty_rows, blocks: see ``build_items``. Device offsets are
    read through gem_kernels.host_offsets and the result is copied back from pinned memory,
    so neither direction syncs the stream when the offsets' host copy is known."""
    row_offsets = host_offsets(row_offsets).to(torch.int64)
    col_offsets = host_offsets(col_offsets).to(torch.int64)
    row_len = row_offsets[1:] - row_offsets[:-1]
    col_len = col_offsets[1:] - col_offsets[:-1]
    items, work = build_items(row_len, col_len, block_rows, block_cols, heads,
                              cover_empty_rows, blocks)
    n = items.shape[0]
    p = max(1, min(max_programs, n))
    dealt = by_work(work) if snake else None
    prog = deal(work, p, snake, num_sms, order=dealt)
    # Drop programs that got no item (a program must own at least one): renumber densely.
    used = torch.bincount(prog, minlength=p) > 0
    prog = (torch.cumsum(used.long(), 0) - 1)[prog]
    p = int(used.sum())
    # Within a program keep the dealt order (descending work with snake, natural without):
    # an item's rank is its place in that order (the inverse permutation of ``dealt``).
    rank = torch.arange(n)
    if dealt is not None:
        rank = torch.empty_like(dealt).index_put_((dealt,), rank)
    order = torch.argsort(prog * (n + 1) + rank)
    counts = torch.bincount(prog, minlength=p)
    prog_ptr = torch.zeros(p + 1, dtype=torch.int64)
    prog_ptr[1:] = torch.cumsum(counts, 0)
    per_prog = torch.zeros(p, dtype=torch.float64).index_add_(0, prog, work.double())
    sample = items[:, 0]
    meta = torch.stack([items[:, 1], items[:, 2], row_offsets[:-1][sample], row_len[sample],
                        col_offsets[:-1][sample], col_len[sample]], 1)[order]
    return Schedule(items=host_to_device(meta.to(torch.int32).contiguous(), device),
                    prog_ptr=host_to_device(prog_ptr.to(torch.int32), device), num_programs=p,
                    work=per_prog)


class ScheduleCache:
    """Reuses schedules while the same offsets tensors (same object, unmodified) come back,
    e.g. across the layers of one batch; a new batch rebuilds (gem_kernels.identity_cache).
    size: a training step holds up to 2 GDPA calls x (1 forward + 3 backward schedules), the
    backward's built during the forward, plus the tuner's 4 on a shape class's first
    backward; 32 leaves room for an eval step in between."""

    def __init__(self, size: int = 32) -> None:
        self._cache: IdentityCache[Schedule] = IdentityCache(size)

    def __len__(self) -> int:
        return len(self._cache)

    def get(self, key: tuple, rows: torch.Tensor, cols: torch.Tensor, build) -> Schedule:
        sched = self._cache.get(key, (rows, cols))
        if sched is None:
            sched = build()
            self._cache.put(key, (rows, cols), sched)
        return sched
