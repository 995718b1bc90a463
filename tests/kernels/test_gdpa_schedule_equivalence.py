"""GDPA schedules built the vectorised, batched way (schedule.SchedulePlanner, op.schedules_for:
several schedules of a call in one upload) equal the ones the earlier implementation built,
item for item and program for program, on many random jagged cases; and a GDPA training call
makes one host->device copy for its forward and prebuilt backward schedules.

``_ref_schedule`` is the earlier build_schedule (commit f9136a4), kept here verbatim but for
the device copy, as the reference.
"""

from __future__ import annotations

import heapq
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

from gem_kernels.gdpa import op  # noqa: E402
from gem_kernels.gdpa.schedule import (  # noqa: E402
    SchedulePlanner,
    ScheduleSpec,
    build_schedule,
    upload_schedules,
)
from gem_kernels.gdpa.triton_common import TileConfig  # noqa: E402
from gem_kernels.testing import lognormal_lengths, offsets_from_lengths  # noqa: E402

# --- the reference: schedule.py as of f9136a4 ------------------------------------------------


def _ref_items(row_lengths, col_lengths, block_rows, block_cols, heads, cover, blocks):
    nblk = torch.div(row_lengths + block_rows - 1, block_rows, rounding_mode="floor")
    if cover:
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
    work = torch.div(col_lengths[sample] + block_cols - 1, block_cols, rounding_mode="floor") + 1
    h = torch.arange(heads).repeat(total)
    items = torch.stack([sample.repeat_interleave(heads), blk.repeat_interleave(heads), h], 1)
    return items, work.repeat_interleave(heads)


def _ref_deal_lanes(sorted_work, lanes):
    n = sorted_work.numel()
    if n <= 8 * lanes:
        heap = [(0.0, ln) for ln in range(lanes)]
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


def _ref_deal(work, num_programs, snake, num_sms, order):
    n = work.numel()
    if not snake:
        return torch.arange(n) % num_programs
    lanes = num_sms if num_sms is not None and num_sms < num_programs else num_programs
    sm, rnd = _ref_deal_lanes(work.double()[order], lanes)
    if lanes == num_programs:
        prog_sorted = sm
    else:
        per_sm = torch.div(num_programs - sm + lanes - 1, lanes, rounding_mode="floor")
        i = rnd
        j = torch.where((i // per_sm) % 2 == 0, i % per_sm, per_sm - 1 - i % per_sm)
        prog_sorted = sm + lanes * j
    prog = torch.empty(n, dtype=torch.int64)
    prog[order] = prog_sorted
    return prog


def _ref_schedule(row_offsets, col_offsets, block_rows, block_cols, heads, max_programs,
                  snake=True, num_sms=None, cover_empty_rows=False, blocks="all"):
    """(items int32, prog_ptr int32, num_programs, work per program) on the CPU."""
    row_len = row_offsets[1:] - row_offsets[:-1]
    col_len = col_offsets[1:] - col_offsets[:-1]
    items, work = _ref_items(row_len, col_len, block_rows, block_cols, heads,
                             cover_empty_rows, blocks)
    n = items.shape[0]
    p = max(1, min(max_programs, n))
    dealt = torch.argsort(-work.double(), stable=True) if snake else None
    prog = _ref_deal(work, p, snake, num_sms, dealt)
    used = torch.bincount(prog, minlength=p) > 0
    prog = (torch.cumsum(used.long(), 0) - 1)[prog]
    p = int(used.sum())
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
    return meta.to(torch.int32), prog_ptr.to(torch.int32), p, per_prog


# --- random cases ----------------------------------------------------------------------------


def _random_lengths(g: torch.Generator, batch: int) -> list[int]:
    """Mixed jagged lengths: zeros, short, tile-sized and long-tailed."""
    kind = int(torch.randint(0, 4, (1,), generator=g))
    hi = (1, 9, 70, 700)[kind]
    lengths = torch.randint(0, hi + 1, (batch,), generator=g)
    lengths[torch.rand(batch, generator=g) < 0.15] = 0
    return lengths.tolist()


def _random_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    batch = int(torch.randint(0, 300, (1,), generator=g))
    rows = offsets_from_lengths(_random_lengths(g, batch))
    cols = offsets_from_lengths(_random_lengths(g, batch))
    pick = lambda xs: xs[int(torch.randint(0, len(xs), (1,), generator=g))]  # noqa: E731
    sms = pick([1, 3, 4, 7, 16, 132])
    spec = ScheduleSpec(block_rows=pick([16, 32, 64, 128]), block_cols=pick([16, 32, 64]),
                        heads=pick([1, 2, 3, 8]), max_programs=sms * pick([1, 2, 4]),
                        num_sms=pick([None, sms]), cover_empty_rows=pick([False, True]),
                        blocks=pick(["all", "all", "first", "middle", "last"]),
                        snake=pick([True, True, True, False]))
    return rows, cols, spec


def _assert_same(got, ref) -> None:
    items, prog_ptr, p, work = ref
    assert got.num_programs == p
    assert got.items.dtype == torch.int32 and got.prog_ptr.dtype == torch.int32
    assert torch.equal(got.items, items), "items differ"
    assert torch.equal(got.prog_ptr, prog_ptr), "prog_ptr differs"
    assert torch.equal(got.work, work), "work per program differs"


@pytest.mark.parametrize("chunk", range(8))
def test_planned_schedules_equal_the_reference_on_random_jagged_cases(chunk: int) -> None:
    for seed in range(chunk * 60, (chunk + 1) * 60):
        rows, cols, s = _random_case(seed)
        ref = _ref_schedule(rows, cols, s.block_rows, s.block_cols, s.heads, s.max_programs,
                            s.snake, s.num_sms, s.cover_empty_rows, s.blocks)
        got = build_schedule(rows, cols, s.block_rows, s.block_cols, s.heads, s.max_programs,
                             "cpu", s.snake, s.num_sms, s.cover_empty_rows, s.blocks)
        _assert_same(got, ref)


def test_one_planner_many_specs_in_one_upload_equal_the_reference() -> None:
    """Specs sharing an offsets pair (and its intermediate results) uploaded together."""
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        batch = int(torch.randint(1, 200, (1,), generator=g))
        rows = offsets_from_lengths(_random_lengths(g, batch))
        cols = offsets_from_lengths(_random_lengths(g, batch))
        specs = [ScheduleSpec(br, bc, h, sms * c, sms, cover, blocks)
                 for br, bc in ((16, 64), (16, 32), (64, 64), (128, 64))
                 for h, sms, c in ((2, 132, 4), (2, 132, 2), (3, 4, 1))
                 for cover, blocks in ((False, "all"), (True, "all"), (True, "first"),
                                       (False, "middle"), (False, "last"))]
        planner = SchedulePlanner(rows, cols)
        got = upload_schedules([planner.plan(s) for s in specs], "cpu")
        for s, sched in zip(specs, got, strict=True):
            _assert_same(sched, _ref_schedule(rows, cols, s.block_rows, s.block_cols, s.heads,
                                              s.max_programs, s.snake, s.num_sms,
                                              s.cover_empty_rows, s.blocks))


@pytest.mark.parametrize("seed", range(3))
def test_h200_shapes_equal_the_reference(seed: int) -> None:
    """Batch 1024, log-normal histories (mean 400, 16..2048), 8 context tokens / 8 queries,
    2 heads, the H200's 132 SMs: every schedule a cross and a pooled call builds."""
    hist = offsets_from_lengths(lognormal_lengths(1024, 400, 2048, 16, 1.0, seed=seed))
    short = torch.arange(1025, dtype=torch.int64) * 8
    cases = [(short, hist, TileConfig(16, 64, ctas_per_sm=4), True),   # cross fwd, kv_major
             (short, hist, TileConfig(16, 32, ctas_per_sm=2), True),   # cross bwd, short_kv
             (short, hist, TileConfig(16, 64, ctas_per_sm=4), False),  # pooled fwd
             (short, hist, TileConfig(16, 64, ctas_per_sm=2), True),   # pooled short_q_stream
             (short, hist, TileConfig(64, 16, ctas_per_sm=2), False),  # hist x short, short_q
             (hist, short, TileConfig(128, 64, ctas_per_sm=1), False)]  # long rows
    for rows, cols, cfg, cover in cases:
        sms = 132
        ref = _ref_schedule(rows, cols, cfg.block_rows, cfg.block_cols, 2,
                            sms * cfg.ctas_per_sm, True, sms, cover)
        got = build_schedule(rows, cols, cfg.block_rows, cfg.block_cols, 2,
                             sms * cfg.ctas_per_sm, "cpu", num_sms=sms, cover_empty_rows=cover)
        _assert_same(got, ref)


@pytest.fixture
def h200_sms(monkeypatch):
    monkeypatch.setattr(op, "num_sms", lambda device: 132)


@pytest.mark.parametrize("case", ["cross", "pooled", "self", "self_det"])
def test_a_training_call_uploads_all_its_schedules_in_one_copy(case, h200_sms, monkeypatch):
    """op.plan_call (GDPAFunction.forward's host work) builds the forward's schedule and the
    backward's with one host->device copy, each equal to the reference, and the backward
    then finds every one of its schedules in the cache."""
    copies = []
    upload = op.upload_schedules
    monkeypatch.setattr(op, "upload_schedules",
                        lambda hosts, device: copies.append(len(hosts)) or upload(hosts, device))
    hist_l = lognormal_lengths(256, 400, 2048, 16, 1.0, seed=7)
    hist = offsets_from_lengths(hist_l)
    short = torch.arange(257, dtype=torch.int64) * 8
    qo, ko, max_q, max_kv = {"cross": (hist, short, max(hist_l), 8),
                             "pooled": (short, hist, 8, max(hist_l))}.get(
        case, (hist, hist, max(hist_l), max(hist_l)))
    q = torch.empty(1, 1, 1, dtype=torch.bfloat16).expand(int(qo[-1]), 2, 128)
    k = torch.empty(1, 1, 1, dtype=torch.bfloat16).expand(int(ko[-1]), 2, 128)
    det = case == "self_det"
    qo, ko, cfg, sched, mode = op.plan_call(q, k, qo, ko, max_q, max_kv, "silu",
                                            deterministic=det)
    req = op.forward_request(qo, ko, cfg, max_kv)
    _, _, reqs = op.backward_requests(mode, None, None, qo, ko, max_q, max_kv, 128)
    distinct = {(op._cache_key(r, 2, q.device), id(r.rows), id(r.cols)) for r in [req, *reqs]}
    assert copies == [len(distinct)]  # one upload, every distinct schedule in it
    ref = _ref_schedule(req.rows, req.cols, cfg.block_rows, cfg.block_cols, 2,
                        132 * cfg.ctas_per_sm, True, 132, req.cover, req.blocks)
    _assert_same(sched, ref)
    _, _, scheds = op.backward_plan(mode, None, None, qo, ko, max_q, max_kv, 128, 2, q.device)
    assert len(copies) == 1  # the backward built nothing
    for r, s in zip(reqs, scheds, strict=True):
        _assert_same(s, _ref_schedule(r.rows, r.cols, r.cfg.block_rows, r.cfg.block_cols, 2,
                                      132 * r.cfg.ctas_per_sm, True, 132, r.cover, r.blocks))
