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

import functools
import heapq
from dataclasses import dataclass

import numpy as np
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


def _block_work(col_lengths: np.ndarray, block_cols: int) -> np.ndarray:
    """``item_work`` on numpy."""
    return (col_lengths + block_cols - 1) // block_cols + 1


BLOCK_SETS = ("all", "first", "middle", "last")


def _row_blocks(row_len: np.ndarray, col_len: np.ndarray, block_rows: int, cover: bool,
                blocks: str) -> tuple[np.ndarray, np.ndarray]:
    """(sample, block) of every (sample, row block) kept, in sample then block order
    (``build_items``' items before heads)."""
    if blocks not in BLOCK_SETS:
        raise ValueError(f"blocks must be one of {BLOCK_SETS}; got {blocks!r}")
    nblk = (row_len + block_rows - 1) // block_rows
    if cover:
        nblk = np.where((nblk == 0) & (col_len > 0), 1, nblk)
    sample = np.repeat(np.arange(nblk.size), nblk)
    blk = np.arange(sample.size) - (np.cumsum(nblk) - nblk)[sample]
    if blocks != "all":
        last = nblk[sample] - 1
        keep = {"first": blk == 0, "middle": (blk > 0) & (blk < last),
                "last": (blk == last) & (blk > 0)}[blocks]
        sample, blk = sample[keep], blk[keep]
    return sample, blk


def build_items(row_lengths: torch.Tensor, col_lengths: torch.Tensor, block_rows: int,
                block_cols: int, heads: int, cover_empty_rows: bool = False,
                blocks: str = "all") -> tuple[torch.Tensor, torch.Tensor]:
    """All (sample, row block, head) items with at least one row, and their work (CPU).
    cover_empty_rows: a sample with no rows but some columns still gets one (empty) item, for
    kernels that write per-column outputs (a one-pass backward must zero their gradient).
    blocks: which of a sample's row blocks: 'all', 'first' (block 0), 'middle' (neither the
    first nor the last) or 'last' (the last of two or more); the phased backward runs the
    three sets as three launches so that their order is the stream's."""
    rows = row_lengths.to("cpu", torch.int64).numpy()
    cols = col_lengths.to("cpu", torch.int64).numpy()
    sample, blk = _row_blocks(rows, cols, block_rows, cover_empty_rows, blocks)
    items = np.stack([np.repeat(sample, heads), np.repeat(blk, heads),
                      np.tile(np.arange(heads), sample.size)], 1).astype(np.int64)
    work = np.repeat(_block_work(cols[sample], block_cols), heads).astype(np.int64)
    return torch.from_numpy(items), torch.from_numpy(work)


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
    lane, index = _deal_lanes(work.double()[order].numpy(), lanes)
    prog = torch.empty(n, dtype=torch.int64)
    prog[order] = torch.from_numpy(_program_of(lane, index, num_programs, lanes))
    return prog


# Up to this many items per lane the deal is greedy (each item, largest first, to the
# least-loaded lane); beyond it the zig-zag, as balanced once every lane holds many items.
EXACT_GREEDY_ITEMS_PER_LANE = 8


def _deal_lanes(sorted_work: np.ndarray, lanes: int) -> tuple[np.ndarray, np.ndarray]:
    """(lane, index on its lane) of each item, items in descending work order.

    With few items per lane (short-side attention: one item per sample and head) a fixed
    zig-zag leaves the lane that drew the largest items ~16% over the mean, so each item goes
    to the least-loaded lane instead (longest-processing-time greedy; within a few percent).
    With many items per lane the zig-zag is already within ~1%: see ``_zigzag_lanes``."""
    n = sorted_work.size
    if n > EXACT_GREEDY_ITEMS_PER_LANE * lanes:
        return _zigzag_lanes(n, lanes)
    heap = [(0.0, ln) for ln in range(lanes)]  # (load, lane): ties go to the lower lane
    counts = [0] * lanes
    lane, index = [0] * n, [0] * n
    for t, w in enumerate(sorted_work.tolist()):
        load, ln = heapq.heappop(heap)
        lane[t], index[t] = ln, counts[ln]
        counts[ln] += 1
        heapq.heappush(heap, (load + w, ln))
    return np.array(lane, dtype=np.int64), np.array(index, dtype=np.int64)


def _zigzag_lanes(n: int, lanes: int) -> tuple[np.ndarray, np.ndarray]:
    """(lane, index on its lane) of the t-th dealt item: round r deals to lanes 0..L-1 when
    r is even and L-1..0 when odd."""
    rnd, lane_t = np.divmod(np.arange(n), lanes)
    return np.where(rnd % 2 == 0, lane_t, lanes - 1 - lane_t), rnd


def _program_of(lane: np.ndarray, index: np.ndarray, num_programs: int, lanes: int
                ) -> np.ndarray:
    """Program of each dealt item: its lane when lanes are programs, else (lanes are SMs)
    one of its SM's programs, zig-zag over that SM's items."""
    if lanes == num_programs:
        return lane
    per_sm = (num_programs - lane + lanes - 1) // lanes
    j = np.where((index // per_sm) % 2 == 0, index % per_sm, per_sm - 1 - index % per_sm)
    return lane + lanes * j


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
    read through gem_kernels.host_offsets and the result is copied in from pinned memory, so
    neither direction syncs the stream when the offsets' host copy is known. One schedule of
    ``SchedulePlanner`` (which builds several from one offsets pair), uploaded by
    ``upload_schedules``."""
    spec = ScheduleSpec(block_rows, block_cols, heads, max_programs, num_sms,
                        cover_empty_rows, blocks, snake)
    planner = SchedulePlanner(row_offsets, col_offsets)
    return upload_schedules([planner.plan(spec)], device)[0]


@dataclass(frozen=True)
class ScheduleSpec:
    """What build_schedule builds from an offsets pair (its arguments but the offsets)."""

    block_rows: int
    block_cols: int
    heads: int
    max_programs: int
    num_sms: int | None = None
    cover_empty_rows: bool = False
    blocks: str = "all"
    snake: bool = True


@dataclass
class HostSchedule:
    """A schedule on the host, before upload: meta (n, 6) int32, prog_ptr (P+1,) int32."""

    meta: np.ndarray
    prog_ptr: np.ndarray
    num_programs: int
    work: np.ndarray  # (P,) float64


class SchedulePlanner:
    """Builds schedules from one (row, column) offsets pair in numpy, the same items, order
    and programs as ``build_items`` / ``by_work`` / ``deal`` give. What several schedules of
    one pair have in common (lengths, row blocks, the work order for a column block) is
    computed once: a GDPA call's forward and backward schedules differ mostly in their
    program counts."""

    def __init__(self, row_offsets: torch.Tensor, col_offsets: torch.Tensor) -> None:
        rows = _host_np(row_offsets)
        cols = _host_np(col_offsets)
        self.row_start, self.row_len = rows[:-1], np.diff(rows)
        self.col_start, self.col_len = cols[:-1], np.diff(cols)
        self._columns = [a.astype(np.int32) for a in (self.row_start, self.row_len,
                                                      self.col_start, self.col_len)]
        self._blocks: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._orders: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def row_blocks(self, block_rows: int, cover: bool, blocks: str
                   ) -> tuple[np.ndarray, np.ndarray]:
        """(sample, block) of every (sample, row block), in sample then block order."""
        key = (block_rows, cover, blocks)
        hit = self._blocks.get(key)
        if hit is None:
            hit = self._blocks[key] = _row_blocks(self.row_len, self.col_len, block_rows,
                                                  cover, blocks)
        return hit

    def work_order(self, block_rows: int, cover: bool, blocks: str, block_cols: int,
                   snake: bool) -> tuple[np.ndarray, np.ndarray]:
        """(order, work in that order) of the (sample, row block)s: by descending work, ties
        in item order (snake), else the natural order. A head's items share their block's
        work and follow each other, so the items' order is this one with heads expanded."""
        key = (block_rows, cover, blocks, block_cols, snake)
        hit = self._orders.get(key)
        if hit is None:
            sample, _ = self.row_blocks(block_rows, cover, blocks)
            work = _block_work(self.col_len[sample], block_cols)
            order = np.argsort(-work, kind="stable") if snake else np.arange(work.size)
            hit = self._orders[key] = (order, work[order])
        return hit

    def plan(self, spec: ScheduleSpec) -> HostSchedule:
        sample, blk = self.row_blocks(spec.block_rows, spec.cover_empty_rows, spec.blocks)
        order, work = self.work_order(spec.block_rows, spec.cover_empty_rows, spec.blocks,
                                      spec.block_cols, spec.snake)
        heads = spec.heads
        n = order.size * heads
        p = max(1, min(spec.max_programs, n))
        lanes = spec.num_sms if spec.num_sms is not None and spec.num_sms < p else p
        if spec.snake and n <= EXACT_GREEDY_ITEMS_PER_LANE * lanes:
            lay = _layout(_deal_lanes(np.repeat(work, heads).astype(np.float64), lanes),
                          p, lanes, heads)
        else:  # zig-zag or round-robin: the layout depends on the counts only
            lay = _zigzag_layout(n, p, lanes, heads, spec.snake)
        # the items in program order, each program's in dealt order (descending work with
        # snake, natural without)
        base = order[lay.base_pos]
        s = sample[base]
        meta = np.empty((n, 6), dtype=np.int32)
        meta[:, 0] = blk[base]
        meta[:, 1] = lay.head
        for col, a in enumerate(self._columns, 2):
            meta[:, col] = a[s]
        per_prog = np.bincount(lay.prog, weights=np.repeat(work, heads),
                               minlength=lay.num_programs).astype(np.float64)
        return HostSchedule(meta, lay.prog_ptr, lay.num_programs, per_prog)


@dataclass(frozen=True)
class _Layout:
    """Where the dealt items go: prog (n,) the program of the t-th dealt item; base_pos and
    head (n,) for the k-th item in program order, the dealt position of its (sample, row
    block) and its head; prog_ptr (P+1,) int32; programs that got no item dropped."""

    prog: np.ndarray
    base_pos: np.ndarray
    head: np.ndarray
    prog_ptr: np.ndarray
    num_programs: int


def _layout(sm: tuple[np.ndarray, np.ndarray] | np.ndarray, num_programs: int, lanes: int,
            heads: int) -> _Layout:
    """_Layout of dealt items given (lane, index on its lane) from the snake's deal over
    lanes, or (round-robin) the program of each item."""
    prog = _program_of(*sm, num_programs, lanes) if isinstance(sm, tuple) else sm
    counts = np.bincount(prog, minlength=num_programs)
    if not counts.all():  # a program must own at least one item: renumber densely
        used = counts > 0
        prog = (np.cumsum(used) - 1)[prog]
        counts = counts[used]
    by_prog = np.argsort(prog.astype(np.int32, copy=False), kind="stable")
    base_pos, head = np.divmod(by_prog, heads)
    head = head.astype(np.int32)
    prog_ptr = np.zeros(counts.size + 1, dtype=np.int32)
    np.cumsum(counts, out=prog_ptr[1:])
    for arr in (prog, base_pos, head, prog_ptr):
        arr.flags.writeable = False  # shared through the cache below
    return _Layout(prog, base_pos, head, prog_ptr, int(counts.size))


@functools.lru_cache(maxsize=64)
def _zigzag_layout(n: int, num_programs: int, lanes: int, heads: int, snake: bool
                   ) -> _Layout:
    """The zig-zag deal (and round-robin without snake) places the t-th dealt item by t
    alone: its layout is cached per count (a short side's schedules keep theirs)."""
    if not snake:
        return _layout(np.arange(n) % num_programs, num_programs, lanes, heads)
    return _layout(_zigzag_lanes(n, lanes), num_programs, lanes, heads)


def _host_np(offsets: torch.Tensor) -> np.ndarray:
    """int64 numpy offsets from the host copy (gem_kernels.host_offsets: no sync if known)."""
    return host_offsets(offsets).numpy().astype(np.int64, copy=False)


SEGMENT_ALIGN = 32  # int32 elements (128 bytes) between the uploaded arrays' starts


def upload_schedules(hosts: list[HostSchedule], device: torch.device | str) -> list[Schedule]:
    """The schedules on ``device`` through ONE host buffer (pinned on CUDA) and ONE
    non-blocking copy (gem_kernels.host_offsets.host_to_device); each items / prog_ptr is a
    view of the device buffer, starting 128-byte aligned."""
    device = torch.device(device)
    arrays = [a for h in hosts for a in (h.meta, h.prog_ptr)]
    starts, end = [], 0
    for a in arrays:
        starts.append(end)
        end += -(-a.size // SEGMENT_ALIGN) * SEGMENT_ALIGN
    pin = device.type == "cuda" and not torch.cuda.is_current_stream_capturing()
    buf = torch.empty(max(end, 1), dtype=torch.int32, pin_memory=pin)
    flat = buf.numpy()
    for a, s in zip(arrays, starts, strict=True):
        flat[s:s + a.size] = a.reshape(-1)
    dev = host_to_device(buf, device)
    out = []
    for i, h in enumerate(hosts):
        m0, p0 = starts[2 * i], starts[2 * i + 1]
        out.append(Schedule(items=dev[m0:m0 + h.meta.size].view(-1, 6),
                            prog_ptr=dev[p0:p0 + h.prog_ptr.size], num_programs=h.num_programs,
                            work=torch.from_numpy(h.work)))
    return out


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

    def lookup(self, key: tuple, rows: torch.Tensor, cols: torch.Tensor) -> Schedule | None:
        return self._cache.get(key, (rows, cols))

    def put(self, key: tuple, rows: torch.Tensor, cols: torch.Tensor, sched: Schedule) -> None:
        self._cache.put(key, (rows, cols), sched)
