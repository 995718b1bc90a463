"""GDPA: reference semantics, schedule (tile skipping, snake balance), the GELU-tanh polynomial,
and the Triton kernels against the reference, forward and backward.

Without CUDA the Triton kernels run under the interpreter (fp32/fp16 only: its bf16 dot is
wrong); GPU tests (bf16 and fp16, head_dim 64/128, self / cross / pooled shapes) carry the gpu
marker.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

from gem_kernels.dispatch import interpreting  # noqa: E402
from gem_kernels.gdpa import gdpa, gdpa_reference  # noqa: E402
from gem_kernels.gdpa.activations import (  # noqa: E402
    GELU_POLY_VALID_RANGE,
    gelu_tanh_exact,
    gelu_tanh_exact_grad,
    gelu_tanh_poly,
    gelu_tanh_poly_grad,
)
from gem_kernels.gdpa.op import (  # noqa: E402
    STREAM_MAX_Q,
    BackwardMode,
    GDPAFunction,
    backward_mode,
    stream_balance,
)
from gem_kernels.gdpa.schedule import build_items, build_schedule, deal, imbalance  # noqa: E402
from gem_kernels.testing import lognormal_lengths, offsets_from_lengths  # noqa: E402

interpreter = pytest.mark.skipif(not interpreting(),
                                 reason="CPU Triton interpreter tests (CUDA present)")
ACTS = ["silu", "gelu", "gelu_tanh", "identity"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _loop_reference(q, k, v, ql, kl, act, scale, norm, max_kv):
    """Per-sample float64 loop: the definition, written independently of the padded one."""
    acts = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu,
            "gelu_tanh": gelu_tanh_exact, "identity": lambda x: x}
    outs, qs, ks = [], 0, 0
    for lq, lk in zip(ql, kl, strict=True):
        s = torch.einsum("ihd,jhd->hij", q[qs:qs + lq].double(), k[ks:ks + lk].double())
        o = torch.einsum("hij,jhd->ihd", acts[act](s * scale), v[ks:ks + lk].double())
        if norm == "kv_len":
            o = o / max(lk, 1)
        elif norm == "max_len":
            o = o / max_kv
        outs.append(o)
        qs, ks = qs + lq, ks + lk
    return torch.cat(outs)


def _inputs(ql, kl, heads, dim, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(ql), heads, dim, generator=g).to(device, dtype)
    k = torch.randn(sum(kl), heads, dim, generator=g).to(device, dtype)
    v = torch.randn(sum(kl), heads, dim, generator=g).to(device, dtype)
    return q, k, v, offsets_from_lengths(ql, device), offsets_from_lengths(kl, device)


# --- reference ---------------------------------------------------------------------------

@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("norm", ["none", "kv_len", "max_len"])
def test_reference_matches_per_sample_definition(act: str, norm: str) -> None:
    ql, kl = [3, 0, 5, 1, 4], [2, 4, 0, 1, 7]
    q, k, v, qo, ko = _inputs(ql, kl, 2, 8, torch.float32, "cpu")
    out = gdpa_reference(q, k, v, qo, ko, 5, 7, activation=act, norm=norm)
    want = _loop_reference(q, k, v, ql, kl, act, 1 / math.sqrt(8), norm, 7)
    assert out.shape == q.shape
    assert _rel(out, want) < 1e-6
    # Sample 2 has no KV: its rows are exactly 0.
    assert torch.equal(out[3:8], torch.zeros_like(out[3:8]))


def test_reference_empty_q_and_kv_and_gradients() -> None:
    q, k, v, _, ko = _inputs([0, 0], [3, 2], 2, 8, torch.float32, "cpu")
    for t in (q, k, v):
        t.requires_grad_(True)
    out = gdpa_reference(q, k, v, offsets_from_lengths([0, 0]), ko, 1, 3)
    assert out.shape == (0, 2, 8)
    out.sum().backward()
    assert torch.equal(k.grad, torch.zeros_like(k))
    q, k, v, qo, ko = _inputs([2, 3], [0, 0], 2, 8, torch.float32, "cpu")
    out = gdpa_reference(q, k, v, qo, ko, 3, 0, norm="kv_len")
    assert torch.equal(out, torch.zeros_like(out))


def test_reference_gradients_match_autograd_of_definition() -> None:
    ql, kl = [4, 1, 6], [3, 5, 1]
    q, k, v, qo, ko = _inputs(ql, kl, 2, 8, torch.float64, "cpu")
    for t in (q, k, v):
        t.requires_grad_(True)
    do = torch.randn(q.shape, dtype=torch.float64)
    out = gdpa_reference(q, k, v, qo, ko, 6, 5, activation="gelu")
    g = torch.autograd.grad(out, (q, k, v), do)
    want = torch.autograd.grad(_loop_reference(q, k, v, ql, kl, "gelu", 1 / math.sqrt(8),
                                               "none", 5), (q, k, v), do)
    for a, b in zip(g, want, strict=True):
        assert _rel(a, b) < 1e-5


def test_auto_dispatch_off_cuda_is_the_reference() -> None:
    q, k, v, qo, ko = _inputs([3, 2], [2, 2], 2, 8, torch.float32, "cpu")
    a = gdpa(q, k, v, qo, ko, 3, 2, activation="gelu", kernel=None)
    b = gdpa(q, k, v, qo, ko, 3, 2, activation="gelu", kernel="pytorch")
    assert torch.equal(a, b)
    with pytest.raises(ValueError):
        gdpa(q, k, v, qo, ko, 3, 2, activation="relu")


# --- GELU-tanh polynomial ----------------------------------------------------------------

def test_gelu_tanh_polynomial_below_bf16_resolution_over_documented_range() -> None:
    x = torch.linspace(-GELU_POLY_VALID_RANGE, GELU_POLY_VALID_RANGE, 1_000_001)
    exact = gelu_tanh_exact(x.double())
    err = (gelu_tanh_poly(x).double() - exact).abs()
    bound = exact.abs().clamp_min(2.0 ** -4) * 2.0 ** -9  # half a bf16 ulp
    assert (err <= bound).all(), float((err / bound).max())
    # and it really is below what bf16 itself can resolve: rounding exact to bf16 errs more
    assert err.max() < (exact.to(torch.bfloat16).double() - exact).abs().max()


def test_gelu_tanh_backward_derivative_close_to_exact() -> None:
    """The backward's g = s + t s (1 - s) from the polynomial's s stays within 3 half-ulps
    of bf16 of the exact derivative (it is then cast with dS to bf16 anyway)."""
    x = torch.linspace(-GELU_POLY_VALID_RANGE, GELU_POLY_VALID_RANGE, 1_000_001)
    exact = gelu_tanh_exact_grad(x.double())
    err = (gelu_tanh_poly_grad(x).double() - exact).abs()
    bound = exact.abs().clamp_min(2.0 ** -4) * 2.0 ** -9
    assert (err <= 3 * bound).all(), float((err / bound).max())
    assert err.max() < 4e-4


# --- schedule ------------------------------------------------------------------------------

def test_items_cover_exactly_the_valid_tiles() -> None:
    rows, cols = torch.tensor([130, 0, 64, 1]), torch.tensor([5, 7, 0, 300])
    items, work = build_items(rows, cols, 64, 32, heads=2)
    # row blocks: 3 + 0 + 1 + 1 = 5 per head; the empty-Q sample has no item
    assert items.shape == (10, 3)
    assert set(items[:, 0].tolist()) == {0, 2, 3}
    # work = column blocks of the sample + 1 (the row tile's load/store)
    by_sample = {int(s): int(w) for s, w in zip(items[:, 0], work, strict=True)}
    assert by_sample == {0: 2, 2: 1, 3: 11}


def test_snake_schedule_balances_long_tailed_work() -> None:
    lengths = torch.tensor(lognormal_lengths(256, 470, 2048, seed=1))
    items, work = build_items(lengths, lengths, 128, 128, heads=4)
    p = 132
    snake = imbalance(work, deal(work, p, snake=True), p)
    naive = imbalance(work, deal(work, p, snake=False), p)
    assert snake <= 1.1 < naive
    offs = offsets_from_lengths(lengths)
    sched = build_schedule(offs, offs, 128, 128, 4, p, "cpu")
    assert sched.prog_ptr[-1] == items.shape[0] and sched.num_programs == p
    # every item is scheduled exactly once, with its sample's row/column ranges
    got = sorted(map(tuple, sched.items.tolist()))
    s = items[:, 0]
    want = torch.stack([items[:, 1], items[:, 2], offs[:-1][s], lengths[s], offs[:-1][s],
                        lengths[s]], 1)
    assert got == sorted(map(tuple, want.to(torch.int32).tolist()))
    assert float(sched.work.max() / sched.work.mean()) <= 1.1


@pytest.mark.parametrize("n_samples", [1, 3, 7, 40])
def test_schedule_never_launches_an_empty_program(n_samples: int) -> None:
    lengths = torch.tensor(lognormal_lengths(n_samples, 40, 300, seed=n_samples))
    offs = offsets_from_lengths(lengths)
    sched = build_schedule(offs, offs, 64, 64, 2, max_programs=12, device="cpu", num_sms=4)
    counts = sched.prog_ptr[1:] - sched.prog_ptr[:-1]
    assert sched.num_programs == counts.numel() and (counts > 0).all()
    assert int(sched.prog_ptr[-1]) == sched.num_items


def test_snake_balances_per_sm_with_several_programs_per_sm() -> None:
    lengths = torch.tensor(lognormal_lengths(256, 470, 2048, seed=1))
    short = torch.full_like(lengths, 16)
    _, work = build_items(lengths, short, 64, 16, heads=4)  # cross attention, forward
    sms, p = 132, 4 * 132
    prog = deal(work, p, snake=True, num_sms=sms)
    assert torch.bincount(prog, minlength=p).min() > 0  # every program gets work
    assert imbalance(work, prog, p, sms) <= 1.1


# --- Triton kernels under the CPU interpreter --------------------------------------------

def _check_triton(ql, kl, heads, dim, dtype, device, act, norm, fwd_tol, bwd_tol,
                  bwd_mode=None, fwd_cfg=None):
    q, k, v, qo, ko = _inputs(ql, kl, heads, dim, dtype, device, seed=sum(ql) + len(kl))
    for t in (q, k, v):
        t.requires_grad_(True)
    max_q, max_kv = max(ql + [1]), max(kl + [1])
    if fwd_cfg is not None:
        out = GDPAFunction.apply(q, k, v, qo, ko, max_q, max_kv, act, 1 / math.sqrt(dim),
                                 {"none": 0, "kv_len": 1, "max_len": 2}[norm], fwd_cfg, None,
                                 None, bwd_mode)
    elif bwd_mode is None:
        out = gdpa(q, k, v, qo, ko, max_q, max_kv, activation=act, norm=norm,
                   kernel="triton")
    else:
        out = GDPAFunction.apply(q, k, v, qo, ko, max_q, max_kv, act, 1 / math.sqrt(dim),
                                 {"none": 0, "kv_len": 1, "max_len": 2}[norm], None, None,
                                 None, bwd_mode)
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(device, dtype)
    grads = torch.autograd.grad(out, (q, k, v), do)
    qf, kf, vf = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    ref = gdpa_reference(qf, kf, vf, qo, ko, max_q, max_kv, activation=act, norm=norm)
    ref_grads = torch.autograd.grad(ref, (qf, kf, vf), do.float())
    assert _rel(out, ref) < fwd_tol, (act, norm, _rel(out, ref))
    for name, a, b in zip("qkv", grads, ref_grads, strict=True):
        assert torch.isfinite(a).all()
        assert _rel(a, b) < bwd_tol, (name, act, norm, _rel(a, b))
    # rows of samples without KV are exactly 0
    qs = 0
    for lq, lk in zip(ql, kl, strict=True):
        if lk == 0 and lq:
            assert torch.equal(out[qs:qs + lq].float(),
                               torch.zeros(lq, heads, dim, device=out.device))
        qs += lq


@interpreter
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("ql,kl,norm,bwd_mode", [
    ([20, 0, 37, 1, 3], [5, 9, 0, 1, 17], "none", "two_kernel"),  # empty Q/KV, length 1
    ([70, 0, 5, 1], [66, 9, 0, 1], "none", None),                   # self: one pass (TMA)
    ([40, 17, 1, 0], [3, 1, 0, 2], "kv_len", None),                 # cross: fused, short KV
    ([1, 3, 2, 0], [70, 0, 21, 4], "max_len", None),                # pooled: fused, short Q
    ([1, 3, 2], [50, 0, 21], "max_len", "short_q"),
    ([1, 3, 0, 2, 0], [70, 0, 9, 21, 4], "kv_len", "short_q_stream"),  # KV-only samples
    ([40, 17, 1, 0, 9], [3, 1, 0, 2, 16], "kv_len", "short_kv_atomic"),
    ([70, 0, 5, 1, 33], [66, 9, 0, 1, 40], "kv_len", "one_pass"),
])
def test_triton_interpreter_fp32(act, ql, kl, norm, bwd_mode) -> None:
    tol = 2e-3 if act == "gelu_tanh" else 1e-5  # polynomial vs exact tanh
    _check_triton(ql, kl, 2, 16, torch.float32, "cpu", act, norm, tol, 10 * tol, bwd_mode)


@interpreter
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("norm", ["none", "kv_len"])
def test_triton_interpreter_kv_major_forward_and_one_pass_backward(act, norm) -> None:
    """Short KV: the KV-major forward and the atomic-free one-pass backward (query rows of a
    sample without KV get output and gradient exactly 0; several query tiles per item)."""
    from gem_kernels.gdpa.triton_common import TileConfig

    tol = 2e-3 if act == "gelu_tanh" else 1e-5
    cfg = TileConfig(16, 16, num_warps=4, num_stages=2, ctas_per_sm=1, kv_major=True)
    _check_triton([40, 17, 1, 0, 9, 5], [3, 1, 0, 2, 16, 0], 2, 16, torch.float32, "cpu", act,
                  norm, tol, 10 * tol, "short_kv", cfg)


@interpreter
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("flatten,prefetch", [(False, False), (True, False), (False, True)])
def test_triton_interpreter_tma_forward(act, flatten, prefetch) -> None:
    """Ragged TMA forward: rows past a sample read as 0 and are never written (samples with
    no KV, several query and key tiles, a tile straddling the end of the tensor)."""
    from gem_kernels.gdpa.triton_common import TileConfig

    cfg = TileConfig(16, 16, num_warps=4, num_stages=2, ctas_per_sm=1, prefetch=prefetch,
                     tma=True, flatten=flatten)
    # fp16: the TMA kernels take 16-bit inputs (the interpreter's fp16 dot is exact enough)
    _check_triton([20, 0, 37, 3, 70], [5, 9, 0, 17, 66], 2, 16, torch.float16, "cpu", act,
                  "kv_len", 3e-3, 1e-2, "two_kernel", cfg)


@interpreter
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_triton_interpreter_tma_one_pass_backward(act) -> None:
    """Ragged-TMA one-pass backward (dQ by atomics): empty samples, several tiles each."""
    from gem_kernels.gdpa.op import GDPAFunction
    from gem_kernels.gdpa.triton_common import TileConfig

    ql, kl = [20, 0, 37, 3, 70], [5, 9, 0, 17, 66]
    q, k, v, qo, ko = _inputs(ql, kl, 2, 16, torch.float16, "cpu", seed=5)
    for t in (q, k, v):
        t.requires_grad_(True)
    cfg = TileConfig(16, 16, num_warps=4, num_stages=2, tma=True)
    out = GDPAFunction.apply(q, k, v, qo, ko, 70, 66, act, 0.25, 1, None, cfg, None,
                             "one_pass")
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).half()
    grads = torch.autograd.grad(out, (q, k, v), do)
    qf, kf, vf = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    ref = gdpa_reference(qf, kf, vf, qo, ko, 70, 66, activation=act, norm="kv_len")
    ref_grads = torch.autograd.grad(ref, (qf, kf, vf), do.float())
    for a, b in zip(grads, ref_grads, strict=True):
        assert _rel(a, b) < 2e-2


@interpreter
@pytest.mark.parametrize("act,dtype", [("silu", torch.float32), ("gelu_tanh", torch.float32),
                                       ("gelu_tanh", torch.float16)])
def test_triton_interpreter_phased_one_pass_backward(act, dtype) -> None:
    """The phased one-pass backward (first / middle / last key blocks as three launches, dQ
    never zeroed nor cast separately): samples of 1, 2 and 5 key blocks, a query-only sample
    (its dQ must be written as 0), a key-only one; same gradients as the atomic one-pass,
    also with the last phase's partial-dQ load hoisted out of the software pipeline."""
    from gem_kernels.gdpa.triton_common import TileConfig

    ql, kl = [20, 0, 37, 3, 70, 6], [5, 9, 0, 17, 66, 16]
    q, k, v, qo, ko = _inputs(ql, kl, 2, 16, dtype, "cpu", seed=8)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    cfg = TileConfig(16, 16, num_warps=4, num_stages=2)
    got = {}
    for mode in ("one_pass_phased", "one_pass_phased_hoisted", "one_pass"):
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out = GDPAFunction.apply(*leaves, qo, ko, 70, 66, act, 0.25, 1, None, cfg, None, mode)
        got[mode] = torch.autograd.grad(out, leaves, do)
    qf, kf, vf = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    ref = gdpa_reference(qf, kf, vf, qo, ko, 70, 66, activation=act, scale=0.25,
                         norm="kv_len")
    ref_grads = torch.autograd.grad(ref, (qf, kf, vf), do.float())
    tol = 1e-5 if (act, dtype) == ("silu", torch.float32) else 1e-2
    for a, b, r in zip(got["one_pass_phased"], got["one_pass"], ref_grads, strict=True):
        assert torch.isfinite(a).all()
        assert _rel(a, r) < tol
        assert _rel(a, b) < 1e-3
    for a, b in zip(got["one_pass_phased_hoisted"], got["one_pass_phased"], strict=True):
        assert torch.equal(a, b)  # same sums in the same order
    assert torch.equal(got["one_pass_phased"][0][20:57].float(), torch.zeros(37, 2, 16))
    assert got["one_pass_phased"][0][57:60].abs().sum() > 0  # 2-block sample got its dQ


@interpreter
@pytest.mark.parametrize("act,dtype", [("silu", torch.float32), ("gelu_tanh", torch.float16)])
@pytest.mark.parametrize("mode", ["one_pass", "one_pass_phased"])
def test_triton_interpreter_dq_transposed_backward(act, dtype, mode) -> None:
    """dQ computed as (K^T dS^T)^T (TileConfig.dq_transposed) gives the gradients of dS K, in
    the atomic and the phased plan: head_dim 32 differs from the 16-key blocks, so a swapped
    operand shape would not pass; samples of 1, 2 and 5 key blocks and empty ones."""
    from gem_kernels.gdpa.triton_common import TileConfig

    ql, kl = [20, 0, 37, 3, 70, 6], [5, 9, 0, 17, 66, 16]
    q, k, v, qo, ko = _inputs(ql, kl, 2, 32, dtype, "cpu", seed=9)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    got = []
    for dqt in (False, True):
        cfg = TileConfig(16, 16, num_warps=4, num_stages=2, dq_transposed=dqt)
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out = GDPAFunction.apply(*leaves, qo, ko, 70, 66, act, 0.2, 1, None, cfg, None, mode)
        got.append(torch.autograd.grad(out, leaves, do))
    qf, kf, vf = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    ref = gdpa_reference(qf, kf, vf, qo, ko, 70, 66, activation=act, scale=0.2,
                         norm="kv_len")
    ref_grads = torch.autograd.grad(ref, (qf, kf, vf), do.float())
    tol = 1e-5 if dtype is torch.float32 else 1e-2
    for a, b, r in zip(got[1], got[0], ref_grads, strict=True):
        assert torch.isfinite(a).all()
        assert _rel(a, r) < tol
        assert _rel(a, b) < (1e-6 if dtype is torch.float32 else 1e-3)
    assert torch.equal(got[1][0][20:57].float(), torch.zeros(37, 2, 32))


def test_block_sets_partition_each_samples_row_blocks() -> None:
    rows, cols = torch.tensor([5, 0, 40, 17, 66]), torch.tensor([3, 4, 0, 9, 1])
    every, _ = build_items(rows, cols, 16, 16, 2, cover_empty_rows=True)
    parts = [build_items(rows, cols, 16, 16, 2, cover_empty_rows=(b == "first"),
                         blocks=b)[0] for b in ("first", "middle", "last")]
    assert sorted(map(tuple, torch.cat(parts).tolist())) == sorted(map(tuple, every.tolist()))
    first, middle, last = parts
    assert (first[:, 1] == 0).all() and (middle[:, 1] > 0).all() and (last[:, 1] > 0).all()
    assert sorted(set(last[:, 0].tolist())) == [2, 3, 4]  # the samples of 2+ blocks
    assert sorted(set(middle[:, 0].tolist())) == [2, 4]  # 3 and 5 blocks
    empty = build_schedule(torch.tensor([0, 5]), torch.tensor([0, 3]), 16, 16, 2, 4, "cpu",
                           blocks="middle")
    assert empty.num_items == 0 and empty.num_programs == 0
    with pytest.raises(ValueError, match="blocks must be one of"):
        build_items(rows, cols, 16, 16, 2, blocks="odd")


def test_tuner_off_the_gpu_runs_the_default_and_caches_nothing() -> None:
    from gem_kernels.gdpa.tuning import Tuner

    calls = []
    tuner = Tuner()
    assert tuner.pick(("k",), ["a", "b"], calls.append, torch.device("cpu")) == "a"
    assert calls == [] and tuner.records == {} and tuner.seconds == 0.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tuner_counts_the_seconds_it_tunes_once_per_key() -> None:
    """Tuning time is part of a run's start-up (perf/tuning_s_gdpa): a key's first pick times
    every candidate and adds the wall time; a cached pick adds nothing."""
    from gem_kernels.gdpa.tuning import Tuner

    x = torch.randn(256, 256, device="cuda")
    tuner = Tuner(warmup_ms=1.0, rep_ms=2.0)
    choice = tuner.pick(("k",), [1, 2], lambda n: (x @ x) * n, x.device)
    spent = tuner.seconds
    assert choice in (1, 2) and spent > 0
    assert tuner.pick(("k",), [1, 2], lambda n: (x @ x) * n, x.device) == choice
    assert tuner.seconds == spent


def test_kv_major_forward_refuses_long_kv() -> None:
    from gem_kernels.gdpa.op import forward_schedule
    from gem_kernels.gdpa.triton_common import TileConfig

    qo, ko = offsets_from_lengths([3, 4]), offsets_from_lengths([20, 2])
    with pytest.raises(ValueError, match="max_kv <= block_rows"):
        forward_schedule(qo, ko, 1, TileConfig(16, 16, kv_major=True), 20,
                         torch.device("cpu"))


def test_cover_empty_rows_gives_query_only_samples_an_item() -> None:
    items, _ = build_items(torch.tensor([0, 3, 0]), torch.tensor([5, 2, 0]), 16, 16, 1,
                           cover_empty_rows=True)
    assert items[:, 0].tolist() == [0, 1]


@interpreter
@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "identity"])
def test_triton_interpreter_fp16_d32(act) -> None:
    """fp16 keeps the scale on the scores (folds_scale is off): the other code path."""
    _check_triton([9, 33, 0], [33, 2, 4], 1, 32, torch.float16, "cpu", act, "none",
                  3e-3, 1e-2)


@interpreter
@pytest.mark.parametrize("scale", [0.01, 0.3, 40.0])
@pytest.mark.parametrize("mode", ["const", "runtime", "scores"])
def test_triton_interpreter_scale_folded_or_not(scale, mode) -> None:
    """gelu_tanh folds the scale into its coefficients (compile-time or run-time) inside
    [1/32, 32] and scales the scores outside it or when asked; all match the reference."""
    from gem_kernels.gdpa.activations import ACT_CODE, folds_scale
    from gem_kernels.gdpa.op import GDPAFunction
    from gem_kernels.gdpa.triton_common import TileConfig

    assert folds_scale(ACT_CODE["gelu_tanh"], scale, torch.float32) == (scale == 0.3)
    ql, kl = [20, 0, 37, 3], [5, 9, 0, 17]
    q, k, v, qo, ko = _inputs(ql, kl, 2, 16, torch.float32, "cpu", seed=3)
    q, k = q / 4, k / 4  # keep scale * q.k inside the polynomial's range at scale 40
    for t in (q, k, v):
        t.requires_grad_(True)
    fwd = TileConfig(16, 16, scale_mode=mode)
    bwd = TileConfig(16, 16, scale_mode=mode)
    out = GDPAFunction.apply(q, k, v, qo, ko, 37, 17, "gelu_tanh", scale, 0, fwd, bwd, bwd,
                             "two_kernel")
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref = gdpa_reference(q, k, v, qo, ko, 37, 17, activation="gelu_tanh", scale=scale)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do)
    assert _rel(out, ref) < 2e-3
    for a, b in zip(grads, ref_grads, strict=True):
        assert _rel(a, b) < 2e-2


def test_backward_mode_follows_the_short_side() -> None:
    assert backward_mode(2048, 16) == "short_kv"
    assert backward_mode(8, 2048) == "short_q"
    assert backward_mode(2048, 2048) == "one_pass"
    assert backward_mode(2048, 2048, torch.float32) == "two_kernel"
    assert backward_mode(8, 2048, deterministic=True) == "short_q_stream"
    assert backward_mode(2048, 2048, deterministic=True) == "two_kernel"
    assert backward_mode(2048, 16, deterministic=True) == "short_kv"


def test_short_q_default_is_atomic_free_where_its_items_balance() -> None:
    """Short Q, fast request: SHORT_Q_STREAM (no atomics) for 16-bit inputs with at most
    STREAM_MAX_Q query rows when every SM's share of the (sample, head) items is at least
    STREAM_MIN_BALANCE longest items; SHORT_Q otherwise and when the batch is not given."""
    big = dict(batch=256, heads=4, total_kv=256 * 470, sms=132)  # balance ~1.75
    assert backward_mode(8, 2048, **big) is BackwardMode.SHORT_Q_STREAM
    assert backward_mode(STREAM_MAX_Q, 2048, torch.float16, **big) == "short_q_stream"
    few = dict(big, batch=64, total_kv=64 * 470)  # ~0.44: one long sample would dominate
    assert backward_mode(8, 2048, **few) is BackwardMode.SHORT_Q
    assert backward_mode(64, 2048, **big) is BackwardMode.SHORT_Q  # 64-row query tile
    assert backward_mode(8, 2048, torch.float32, **big) is BackwardMode.SHORT_Q
    assert backward_mode(8, 2048) is BackwardMode.SHORT_Q  # batch unknown
    for shape in (big, few):  # deterministic: unchanged
        assert backward_mode(64, 2048, deterministic=True, **shape) == "short_q_stream"
        assert backward_mode(2048, 2048, deterministic=True, **shape) == "two_kernel"
    # heads * (total_kv / 64 + batch) / sms over ceil(max_kv / 64) + 1
    assert stream_balance(4, 2, 256, 128, 3) == pytest.approx(2 * (4 + 4) / 3 / 3)
    assert stream_balance(1, 1, 0, 0, 1) == pytest.approx(0.5)
    assert backward_mode(8, 2048, **dict(big, batch=0, total_kv=0)) is BackwardMode.SHORT_Q
    with pytest.raises(ValueError, match="sms must be positive"):
        stream_balance(4, 2, 256, 128, 0)


@interpreter
def test_triton_interpreter_default_pooled_plan_is_atomic_free_and_matches_reference() -> None:
    """fp16 pooled shapes (the interpreter's 3 SMs): a batch whose items balance runs
    SHORT_Q_STREAM by default, a single long sample SHORT_Q; both, and SHORT_Q asked for
    explicitly, match the reference; the stream's gradients repeat bitwise."""
    dtype, heads, dim = torch.float16, 2, 32
    for ql, kl, expect in (([1, 4, 2, 0, 3, 1], [70, 30, 0, 5, 66, 21], "short_q_stream"),
                           ([4], [100], "short_q")):
        q, k, v, qo, ko = _inputs(ql, kl, heads, dim, dtype, "cpu", seed=len(ql))
        do = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
        max_q, max_kv = max(ql), max(kl)
        qf, kf, vf = (t.float().requires_grad_(True) for t in (q, k, v))
        ref = gdpa_reference(qf, kf, vf, qo, ko, max_q, max_kv, activation="gelu_tanh")
        ref_grads = torch.autograd.grad(ref, (qf, kf, vf), do.float())
        runs = {}
        for mode in (None, "short_q"):
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
            if mode is None:
                out = gdpa(*leaves, qo, ko, max_q, max_kv, activation="gelu_tanh",
                           kernel="triton", deterministic=False)
            else:
                out = GDPAFunction.apply(*leaves, qo, ko, max_q, max_kv, "gelu_tanh",
                                         dim ** -0.5, 0, None, None, None, mode, False)
            assert out.grad_fn.mode == (expect if mode is None else mode)
            grads = torch.autograd.grad(out, leaves, do, retain_graph=True)
            assert _rel(out, ref) < 3e-3
            for name, a, b in zip("qkv", grads, ref_grads, strict=True):
                assert _rel(a, b) < 1e-2, (expect, mode, name, _rel(a, b))
            runs[mode] = (out, leaves, grads)
        out, leaves, grads = runs[None]
        if expect == "short_q_stream":
            again = torch.autograd.grad(out, leaves, do)
            for a, b in zip(grads, again, strict=True):
                assert torch.equal(a, b)


@interpreter
def test_triton_interpreter_all_empty() -> None:
    q, k, v, qo, ko = _inputs([0, 0], [0, 0], 2, 16, torch.float32, "cpu")
    assert gdpa(q, k, v, qo, ko, 1, 1, kernel="triton").shape == (0, 2, 16)


# --- GPU ---------------------------------------------------------------------------------

def _gpu_lengths(shape: str) -> tuple[list[int], list[int]]:
    """Long-tailed jagged lengths for the three uses; one empty Q and one empty KV sample."""
    long_q = lognormal_lengths(12, 150, 400, seed=3)
    long_kv = lognormal_lengths(12, 150, 400, seed=4)
    short = [1, 16, 64, 0, 7, 33, 2, 16, 16, 5, 64, 1]
    ql, kl = {"self": (long_q, long_q), "cross": (long_q, short),
              "pooled": ([min(x, 32) for x in short], long_kv)}[shape]
    ql, kl = list(ql), list(kl)
    ql[1], kl[3] = 0, 0
    return ql, kl


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", ["self", "cross", "pooled"])
@pytest.mark.parametrize("dtype,dim,act", [(torch.bfloat16, 128, a) for a in ACTS]
                         + [(torch.float16, 64, "silu"), (torch.bfloat16, 64, "gelu_tanh")])
def test_triton_gpu(shape, dtype, dim, act) -> None:
    ql, kl = _gpu_lengths(shape)
    tol = 2e-2 if dtype is torch.bfloat16 else 5e-3
    norm = {"self": "none", "cross": "kv_len", "pooled": "max_len"}[shape]
    _check_triton(ql, kl, 2, dim, dtype, "cuda", act, norm, tol, 2 * tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "identity"])
@pytest.mark.parametrize("flatten", [False, True])
def test_triton_gpu_tma_forward_and_one_pass_backward(act, flatten) -> None:
    """The ragged-TMA forward and the atomic-dQ one-pass backward on the self shape."""
    from gem_kernels.gdpa.op import GDPAFunction
    from gem_kernels.gdpa.triton_common import TileConfig

    ql, kl = _gpu_lengths("self")
    cfg = TileConfig(128, 64, num_warps=8, num_stages=3, ctas_per_sm=1, tma=True,
                     flatten=flatten)
    _check_triton(ql, kl, 2, 128, torch.bfloat16, "cuda", act, "kv_len", 2e-2, 4e-2,
                  "one_pass", cfg)
    # and the TMA one-pass backward (TMA reduce-add of dQ) against the pointer one
    q, k, v, qo, ko = _inputs(ql, kl, 2, 128, torch.bfloat16, "cuda", seed=11)
    do = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
    grads = []
    for tma in (False, True):
        bcfg = TileConfig(128, 32, num_warps=8, num_stages=3, ctas_per_sm=1, tma=tma)
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out = GDPAFunction.apply(*leaves, qo, ko, max(ql), max(kl), act, 128 ** -0.5, 1,
                                 None, bcfg, None, "one_pass")
        grads.append(torch.autograd.grad(out, leaves, do))
    for a, b in zip(*grads, strict=True):
        assert _rel(a, b) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_triton_gpu_phased_backward_and_tuner(act) -> None:
    """Every backward plan the op tunes between (atomic / phased, 128- and 64-key blocks, dQ
    transposed or not) and the hoisted phased one match the atomic default on the self
    shape (bf16, d=128: samples of 1-4 key blocks) and the fp32 reference; the op's first
    default call times every plan and records the timings."""
    from gem_kernels.gdpa.op import TUNER, one_pass_candidates

    ql, kl = _gpu_lengths("self")
    q, k, v, qo, ko = _inputs(ql, kl, 2, 128, torch.bfloat16, "cuda", seed=12)
    do = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
    plans = [("one_pass", None), ("one_pass_phased", None),
             ("one_pass_phased_hoisted", None), *one_pass_candidates(max(ql), max(kl), 128),
             (None, None)]
    grads = []
    for mode, cfg in plans:
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out = GDPAFunction.apply(*leaves, qo, ko, max(ql), max(kl), act, 128 ** -0.5, 0,
                                 None, cfg, None, mode)
        grads.append(torch.autograd.grad(out, leaves, do))
    qf, kf, vf = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    ref = gdpa_reference(qf, kf, vf, qo, ko, max(ql), max(kl), activation=act)
    ref_grads = torch.autograd.grad(ref, (qf, kf, vf), do.float())
    for (mode, cfg), g in zip(plans, grads, strict=True):
        for name, a, b, r in zip("qkv", g, grads[0], ref_grads, strict=True):
            assert _rel(a, b) < 1e-2, (mode, cfg, name, _rel(a, b))
            assert _rel(a, r) < 2e-2, (mode, cfg, name, _rel(a, r))
    assert _rel(grads[2][0], grads[1][0]) < 1e-3  # the hoisted load: the same sums
    recs = [r for key, r in TUNER.records.items() if key[0] == "one_pass" and act in key]
    assert recs and len(recs[0].timings) == len(one_pass_candidates(max(ql), max(kl), 128))
    assert any(isinstance(ms, float) for _, ms in recs[0].timings)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("act", ACTS)
def test_triton_gpu_fp32_gradients(act) -> None:
    tol = 2e-3 if act == "gelu_tanh" else 1e-4
    _check_triton([70, 1, 130, 0, 3], [9, 200, 1, 5, 0], 2, 64, torch.float32, "cuda", act,
                  "kv_len", tol, 10 * tol)


def test_few_items_per_sm_are_dealt_greedily() -> None:
    """Short-side attention (one item per sample and head, ~8 per SM): the greedy deal keeps
    every SM within 5% of the mean where the zig-zag alone left ~16%."""
    long = torch.tensor(lognormal_lengths(256, 470, 2048, seed=0))
    items, work = build_items(torch.full((256,), 16), long, 16, 64, 4)
    p, sms = 132 * 4, 132
    assert imbalance(work, deal(work, p, True, sms), p, sms) < 1.05


def _compiled_report(code: str) -> str:
    """Stdout of ``code`` run in a fresh Python without the Triton interpreter, so that it can
    compile kernels for sm_90 and read their resources (no GPU needed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


def test_hopper_resources_dq_transposed_runs_every_product_as_warpgroup_mma() -> None:
    """Compiled for sm_90 without a GPU (gem_kernels.gdpa.resources, in a process without the
    interpreter): the default one-pass kernel runs its five products as warpgroup MMAs and
    spills nothing in the atomic / middle phase; dQ as dS K (32 rows) was a mma.sync product."""
    code = ("from dataclasses import replace\n"
            "from gem_kernels.gdpa.resources import dkdv_resources\n"
            "from gem_kernels.gdpa.triton_bwd import DqMode, one_pass_config\n"
            "c = one_pass_config(2048, 2048, 128)\n"
            "a = dkdv_resources(c, DqMode.ATOMIC)\n"
            "b = dkdv_resources(replace(c, dq_transposed=False), DqMode.ATOMIC)\n"
            "print(a.wgmma, a.mma_sync, a.spill_store_bytes, a.registers, b.mma_sync)\n")
    wgmma, mma_sync, spilled, regs, old_mma_sync = map(int, _compiled_report(code).split())
    assert wgmma > 0 and mma_sync == 0 and spilled == 0 and regs <= 255
    assert old_mma_sync > 0


def test_hopper_resources_short_q_stream_spills_nothing_up_to_its_default_tile() -> None:
    """The short_q_stream backward compiled for sm_90 (no GPU needed): no spills at head dim
    128 for the query tiles the fast default uses (up to STREAM_MAX_Q rows), with registers
    to spare below the 255 cap (which the 64-row tile reached: gdpa/DESIGN.md)."""
    code = ("from gem_kernels.gdpa.resources import short_q_stream_resources\n"
            "for q in (16, 32, 64):\n"
            "    r = short_q_stream_resources(q, 128)\n"
            "    print(q, r.registers, r.spill_store_bytes)\n")
    for line in _compiled_report(code).split("\n"):
        if line:
            q, regs, spilled = map(int, line.split())
            if q <= STREAM_MAX_Q:
                assert spilled == 0 and regs < 240, (q, regs, spilled)


@pytest.mark.parametrize("kernel", ["pytorch", "triton"])
def test_mixed_dtypes_meet_in_one_dtype(kernel: str) -> None:
    """A learned fp32 query against fp16 keys (what a model's pooled attention hands over
    inside autocast): promoted to fp32 outside autocast, autocast's dtype inside; gradients
    reach the fp32 query in fp32."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ql, kl = [3, 1, 4], [5, 0, 9]
    q, k, v, qo, ko = _inputs(ql, kl, 2, 32, torch.float32, dev, seed=3)
    k16, v16 = k.half(), v.half()
    q.requires_grad_()
    want = _loop_reference(q.detach(), k16.float(), v16.float(), ql, kl, "silu",
                           1 / math.sqrt(32), "none", 9)
    out = gdpa(q, k16, v16, qo, ko, 4, 9, activation="silu", kernel=kernel)
    assert out.dtype == torch.float32 and _rel(out, want) < 1e-5
    with torch.autocast(dev, dtype=torch.float16):
        out16 = gdpa(q, k16, v16, qo, ko, 4, 9, activation="silu", kernel=kernel)
    assert out16.dtype == torch.float16 and _rel(out16, want) < 5e-3
    out16.float().sum().backward()
    assert q.grad is not None and q.grad.dtype == torch.float32 and q.grad.isfinite().all()
