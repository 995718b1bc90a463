"""Jagged flash attention (JFA) against the other ways to run attention on jagged batches,
forward, backward and forward+backward, on the same inputs in the same run.

Reproduce (H200; results committed as docs/bench/jfa.json):
    PYTHONPATH=kernels:platform:bench python -m gem_bench.kernels.jfa --out $OUT
(``gemctl bench attention`` calls :func:`main`.)

Variants:
- ours: ``jagged_attention`` with its defaults (Triton, ragged TMA loads, tiles by head dim;
  without causal/window masks one loop over all key tiles: d=128 masks every tile, d<=64 uses
  the fused boundary trick; with masks only band tiles are masked).
- The ablation, forward kernels that differ only in how the sequence end is handled:
  ours_trick (full tiles in an unmasked loop, then the partial tile in a second loop by the
  boundary trick: unmasked, the zero-filled keys' exp(0 - m) terms subtracted from the row
  sum), ours_where (that second loop with a ``tl.where`` mask instead), ours_mask_all (one
  loop with a ``tl.where`` mask on every tile) and ours_trick_fused (one unmasked loop over
  all tiles, the trick's subtraction on every tile, zero except on the partial one).
- ours_ptr, ours_tma_ragged, ours_tma_device: the three load paths (masked pointer loads; one
  host-side ragged tensor descriptor per tensor; per-sequence descriptors built in the kernel).
- varlen_attn: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention varlen), recorded as
  unavailable where this torch lacks it.
- nested_sdpa: ``F.scaled_dot_product_attention`` on nested jagged tensors.
- padded_sdpa: every sequence padded to the batch's longest, (B, H, Lmax, d), SDPA forced to
  its flash backend; only the SDPA call is timed (no pad/unpad, no key-padding mask: a lower
  bound on what padding costs).
- reference: the PyTorch reference (one sequence at a time).

Counting: useful FLOPs forward = 4 * d * H * (number of valid (query, key) pairs, real tokens
only: L^2 per sequence non-causal, L(L+1)/2 causal, the true count under a window); backward
2.5x that, forward+backward 3.5x. Fractions are of the measured 786 TFLOP/s bf16 ceiling.
"""

from __future__ import annotations

import argparse
import inspect
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from gem_bench.kernels.common import (
    H200_BF16_TFLOPS,
    BenchRow,
    add_ratios,
    fill_rates,
    host_us_per_call,
    print_table,
    time_ms,
    write_json,
)
from gem_kernels.testing import lognormal_lengths, offsets_from_lengths

DTYPE = torch.bfloat16


@dataclass
class Case:
    name: str
    lengths: list[int]
    heads: int
    dim: int = 128
    causal: bool = False
    window: tuple[int, int] | None = None
    with_reference: bool = False


def mix_lengths(batch: int) -> list[int]:
    """The brief's mix: 100, 300, 500 and 1000 tokens in equal shares, interleaved."""
    return [(100, 300, 500, 1000)[i % 4] for i in range(batch)]


def _cases(quick: bool) -> list[Case]:
    logn = lognormal_lengths(256, 620, 2048, min_len=1, sigma=1.0, seed=0)  # mean ~525
    tail = lognormal_lengths(256, 500, 4096, min_len=1, sigma=1.2, seed=1)
    if quick:
        return [Case("mix_B64_H8", mix_lengths(64), 8),
                Case("lognormal_B256_max2048_H4", logn, 4)]
    return [
        Case("mix_B256_H8", mix_lengths(256), 8, with_reference=True),
        Case("lognormal_B256_max2048_H4", logn, 4, with_reference=True),
        Case("lognormal_B256_max4096_H8", tail, 8),
        Case("lognormal_B256_max2048_H4_causal", logn, 4, causal=True),
        Case("lognormal_B256_max2048_H4_window63", logn, 4, causal=True, window=(63, 0)),
        Case("mix_B256_H8_d64", mix_lengths(256), 8, dim=64),
    ]


def valid_pairs(lengths: list[int], causal: bool, window: tuple[int, int] | None) -> int:
    total = 0
    for n in lengths:
        if window is None and not causal:
            total += n * n
            continue
        left = n if window is None else window[0]
        right = 0 if causal else (n if window is None else window[1])
        if causal and window is not None:
            right = min(right, window[1])
        # sum over i of |[max(0, i-left), min(n-1, i+right)]|
        for i in range(n):
            total += min(n - 1, i + right) - max(0, i - left) + 1
    return total


# ----------------------------------------------------------------------------- variants

def _varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:  # noqa: BLE001
        return None, "unavailable: torch.nn.attention.varlen not importable"
    params = inspect.signature(varlen_attn).parameters
    return (varlen_attn, params), None


def make_variants(case: Case, q, k, v, offsets) -> dict[str, Callable | str]:
    from gem_kernels.jagged_attention import jagged_attention, jagged_attention_reference
    from gem_kernels.jagged_attention.op import jagged_attention_triton

    lengths = case.lengths
    max_len = max(lengths)
    causal, window = case.causal, case.window
    out: dict[str, Callable | str] = {}

    out["ours"] = lambda q, k, v: jagged_attention(q, k, v, offsets, max_len, causal=causal,
                                                   window=window)
    if not causal and window is None:
        for name, boundary in (("ours_trick", "trick"), ("ours_trick_fused", "trick_fused"),
                               ("ours_where", "where"), ("ours_mask_all", "mask_all")):
            out[name] = (lambda q, k, v, b=boundary: jagged_attention_triton(
                q, k, v, offsets, max_len, causal=causal, window=window,
                options={"fwd": {"boundary": b}}))
    if not causal and window is None:
        for mode in ("ptr", "tma_ragged", "tma_device"):
            out[f"ours_{mode}"] = (lambda q, k, v, m=mode: jagged_attention_triton(
                q, k, v, offsets, max_len, causal=causal, window=window,
                options={"fwd": {"use_tma": m}, "bwd": {"use_tma": m}}))

    vf, why = _varlen_fn()
    if vf is None:
        out["varlen_attn"] = why
    else:
        fn, params = vf
        cu = offsets.to(torch.int32)
        kw = {}
        if "window_size" in params:
            left = -1 if window is None else window[0]
            right = (0 if causal else -1) if window is None else (0 if causal else window[1])
            kw["window_size"] = (left, right)
        elif window is not None:
            kw = None
        elif "is_causal" in params:
            kw["is_causal"] = causal
        elif causal:
            kw = None
        if kw is None:
            out["varlen_attn"] = "unavailable: this torch's varlen_attn has no window/causal arg"
        else:
            out["varlen_attn"] = lambda q, k, v: fn(q, k, v, cu, cu, max_len, max_len, **kw)

    if window is None:
        def nested(q, k, v):
            nq, nk, nv = (torch.nested.nested_tensor_from_jagged(x, offsets).transpose(1, 2)
                          for x in (q, k, v))
            o = F.scaled_dot_product_attention(nq, nk, nv, is_causal=causal)
            return o.transpose(1, 2).values()

        out["nested_sdpa"] = nested

        # padded flash SDPA: inputs padded outside the timing
        def padded_factory():
            b, h, d = len(lengths), case.heads, case.dim
            pads = []
            for x in (q, k, v):
                p = x.new_zeros(b, max_len, h, d)
                for i in range(b):
                    s, e = int(offsets[i]), int(offsets[i + 1])
                    p[i, : e - s] = x[s:e]
                pads.append(p.transpose(1, 2).contiguous().detach().requires_grad_(
                    x.requires_grad))
            return pads

        out["padded_sdpa"] = ("padded", padded_factory)
    else:
        out["nested_sdpa"] = "unavailable: no sliding window in SDPA on nested tensors"
        out["padded_sdpa"] = "unavailable: flash SDPA has no sliding window"

    if case.with_reference:
        out["reference"] = lambda q, k, v: jagged_attention_reference(
            q, k, v, offsets, max_len, causal=causal, window=window)
    return out


def _time_variant(name, fn, case, q, k, v, do, directions, rep_ms):
    """{direction: ms}."""
    res = {}
    if isinstance(fn, tuple) and fn[0] == "padded":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        pq, pk, pv = fn[1]()
        pdo = torch.randn_like(pq)

        def run(a, b, c):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(a, b, c, is_causal=case.causal)

        args, g = (pq, pk, pv), pdo
        fn = run
    else:
        args, g = (q, k, v), do
    warm = 20 if name == "reference" else 50
    with torch.no_grad():
        if "fwd" in directions:
            res["fwd"] = time_ms(lambda: fn(*args), warmup_ms=warm, rep_ms=rep_ms)
    if "bwd" in directions or "fwd+bwd" in directions:
        o = fn(*args)
        if "bwd" in directions:
            res["bwd"] = time_ms(lambda: torch.autograd.grad(o, args, g, retain_graph=True),
                                 warmup_ms=warm, rep_ms=rep_ms)
        del o
        if "fwd+bwd" in directions:
            res["fwd+bwd"] = time_ms(lambda: torch.autograd.grad(fn(*args), args, g),
                                     warmup_ms=warm, rep_ms=rep_ms)
    return res


ABLATION_FWD_ONLY = ("ours_trick", "ours_trick_fused", "ours_where", "ours_mask_all")


def _warm_gpu(ms: float = 300.0) -> None:
    """Bring clocks up before the first timed variant of a case (it would be disadvantaged)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        for _ in range(10):
            a @ a
        end.record()
        end.synchronize()
        if start.elapsed_time(end) > ms:
            break


def run_case(case: Case, rows: list[BenchRow], rep_ms: float, skip: set[str],
             notes: dict) -> None:
    torch.manual_seed(0)
    total = sum(case.lengths)
    offsets = offsets_from_lengths(case.lengths, "cuda")
    q, k, v, do = (torch.randn(total, case.heads, case.dim, device="cuda", dtype=DTYPE)
                   for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    pairs = valid_pairs(case.lengths, case.causal, case.window)
    fwd_flops = 4.0 * pairs * case.heads * case.dim
    flops = {"fwd": fwd_flops, "bwd": 2.5 * fwd_flops, "fwd+bwd": 3.5 * fwd_flops}
    notes[case.name] = {"B": len(case.lengths), "total_tokens": total,
                        "max_len": max(case.lengths),
                        "mean_len": total / max(len(case.lengths), 1), "H": case.heads,
                        "d": case.dim, "causal": case.causal, "window": case.window,
                        "valid_pairs": pairs}
    _warm_gpu()
    for name, fn in make_variants(case, q, k, v, offsets).items():
        if name in skip:
            continue
        if isinstance(fn, str):
            rows.append(BenchRow(case.name, name, "fwd", float("nan"), extra={"status": fn}))
            print(f"  {case.name} {name}: {fn}", flush=True)
            continue
        directions = ("fwd",) if name in ABLATION_FWD_ONLY else ("fwd", "bwd", "fwd+bwd")
        try:
            res = _time_variant(name, fn, case, q, k, v, do, directions,
                                rep_ms=60 if name == "reference" else rep_ms)
        except Exception as e:  # noqa: BLE001
            msg = f"failed: {type(e).__name__}: {str(e)[:300]}"
            traceback.print_exc()
            rows.append(BenchRow(case.name, name, "fwd", float("nan"), extra={"status": msg}))
            continue
        for direction, ms in res.items():
            row = fill_rates(BenchRow(case.name, name, direction, ms), flops=flops[direction])
            rows.append(row)
            print(f"  {case.name:40s} {name:14s} {direction:8s} {ms:9.3f} ms "
                  f"{row.useful_tflops:7.1f} TFLOP/s", flush=True)
        torch.cuda.empty_cache()


def targets(rows: list[BenchRow]) -> dict:
    """ours vs varlen_attn and padded SDPA, per case and direction (time ratios)."""
    t = {(r.case, r.variant, r.direction): r.ms for r in rows}
    out = {}
    for (case, variant, direction), ms in t.items():
        if variant != "ours":
            continue
        d = out.setdefault(case, {})
        for base in ("varlen_attn", "padded_sdpa", "nested_sdpa"):
            b = t.get((case, base, direction))
            if b is not None and b == b:
                d[f"{direction}_speedup_vs_{base}"] = b / ms
    for d in out.values():
        d["fwd_ge_1.2x_varlen"] = d.get("fwd_speedup_vs_varlen_attn", 0) >= 1.2
        d["fwd+bwd_ge_1.0x_varlen"] = d.get("fwd+bwd_speedup_vs_varlen_attn", 0) >= 1.0
        d["fwd_ge_4x_padded"] = d.get("fwd_speedup_vs_padded_sdpa", 0) >= 4.0
    return out


FWD_SWEEP = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4)]
BWD_SWEEP = [(64, 64, 4, 2, 64, 64, 4, 2), (64, 64, 4, 2, 128, 64, 8, 2),
             (128, 64, 8, 2, 64, 64, 4, 2)]
LOAD_SWEEP = ("ptr", "tma_ragged", "tma_device")
FWD_SWEEP_D64 = [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3),
                 (128, 128, 8, 2)]
BWD_SWEEP_D64 = [(64, 64, 4, 2, 64, 64, 4, 2), (128, 64, 8, 2, 128, 64, 8, 2),
                 (64, 64, 4, 3, 64, 64, 4, 3)]
FWD_SWEEP_WINDOW = [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 3)]


def sweep(case: Case, rep_ms: float = 100, loads=LOAD_SWEEP) -> list[dict]:
    """Time our forward and backward under several tile configs (for retuning defaults)."""
    from gem_kernels.jagged_attention.op import (
        BwdConfig,
        FwdConfig,
        ScheduleCache,
        jfa_backward,
        jfa_forward,
    )

    torch.manual_seed(0)
    total = sum(case.lengths)
    offsets = offsets_from_lengths(case.lengths, "cuda")
    q, k, v, do = (torch.randn(total, case.heads, case.dim, device="cuda", dtype=DTYPE)
                   for _ in range(4))
    scale = case.dim ** -0.5
    fwd_flops = 4.0 * valid_pairs(case.lengths, case.causal, case.window) * case.heads * case.dim
    kw = dict(causal=case.causal, window=case.window, scale=scale)
    out = []
    o = lse = None
    fwd_sweep, bwd_sweep = FWD_SWEEP, BWD_SWEEP
    if case.dim == 64:
        fwd_sweep, bwd_sweep = FWD_SWEEP_D64, BWD_SWEEP_D64
    if case.window is not None:
        fwd_sweep = FWD_SWEEP_WINDOW
    for c in fwd_sweep:
        for tma in loads:
            cfg = FwdConfig(*c)
            try:
                sched = ScheduleCache(offsets, total)
                def fn(sched=sched, cfg=cfg, tma=tma):
                    return jfa_forward(q, k, v, offsets, sched=sched, config=cfg, use_tma=tma,
                                       **kw)
                o, lse = fn()
                ms = time_ms(fn, rep_ms=rep_ms)
                r = {"case": case.name, "dir": "fwd", "cfg": c, "tma": tma, "ms": ms,
                     "tflops": fwd_flops / ms / 1e9}
            except Exception as e:  # noqa: BLE001
                r = {"case": case.name, "dir": "fwd", "cfg": c, "tma": tma,
                     "error": f"{type(e).__name__}: {str(e)[:200]}"}
            print(r, flush=True)
            out.append(r)
    sched = ScheduleCache(offsets, total)
    o, lse = jfa_forward(q, k, v, offsets, sched=sched, **kw)
    for c in bwd_sweep:
        for tma in loads:
            cfg = BwdConfig(*c)
            try:
                def fn(cfg=cfg, tma=tma):
                    return jfa_backward(do, q, k, v, o, lse, offsets, sched=sched, config=cfg,
                                        use_tma=tma, **kw)
                fn()
                ms = time_ms(fn, rep_ms=rep_ms)
                r = {"case": case.name, "dir": "bwd", "cfg": c, "tma": tma, "ms": ms,
                     "tflops": 2.5 * fwd_flops / ms / 1e9}
            except Exception as e:  # noqa: BLE001
                r = {"case": case.name, "dir": "bwd", "cfg": c, "tma": tma,
                     "error": f"{type(e).__name__}: {str(e)[:200]}"}
            print(r, flush=True)
            out.append(r)
    return out


# --tune: forward (tile config x boundary mode) on the cases whose targets are open, the
# backward tiles for d=64, and where the windowed case's fwd+bwd time goes (GPU vs host).
TUNE_FWD = {
    "mix_B256_H8": [(128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 4), (128, 64, 8, 4),
                    (128, 128, 4, 3), (64, 128, 4, 3)],
    "lognormal_B256_max2048_H4": [(128, 128, 8, 3), (128, 64, 8, 3)],
    "mix_B256_H8_d64": [(128, 128, 8, 3), (128, 128, 4, 3), (128, 128, 4, 4), (128, 64, 4, 4),
                        (128, 64, 4, 3), (128, 128, 8, 4), (64, 128, 4, 3), (64, 64, 4, 4),
                        (128, 32, 4, 4), (256, 64, 8, 3), (256, 128, 8, 3)],
}
TUNE_BOUNDARIES = ("trick", "trick_fused", "mask_all")
TUNE_BWD_D64 = [(64, 64, 4, 2, 64, 64, 4, 2), (64, 64, 4, 3, 64, 64, 4, 3),
                (128, 64, 8, 2, 128, 64, 8, 2), (64, 128, 4, 2, 128, 64, 8, 2),
                (128, 64, 4, 2, 64, 128, 4, 2)]


def tune(out_dir: Path) -> list[dict]:
    res: list[dict] = []

    def emit(r: dict) -> None:
        print(r, flush=True)
        res.append(r)

    cases = {c.name: c for c in _cases(False)}
    for name in ("mix_B256_H8", "lognormal_B256_max2048_H4", "mix_B256_H8_d64",
                 "lognormal_B256_max2048_H4_window63"):
        _tune_case(cases[name], emit, out_dir)
        torch.cuda.empty_cache()
    return res


@dataclass
class _TuneInputs:
    """One case's random inputs and what every tuning row of it shares."""

    case: Case
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    offsets: torch.Tensor
    total: int
    max_len: int
    fwd_flops: float
    kw: dict
    varlen: tuple | None  # (function, its parameters) or None where torch lacks it
    varlen_kw: dict

    @classmethod
    def make(cls, case: Case) -> _TuneInputs:
        torch.manual_seed(0)
        total = sum(case.lengths)
        q, k, v, do = (torch.randn(total, case.heads, case.dim, device="cuda", dtype=DTYPE)
                       for _ in range(4))
        fwd_flops = 4.0 * valid_pairs(case.lengths, case.causal, case.window) * case.heads \
            * case.dim
        vf, _ = _varlen_fn()
        vkw = {}
        if vf is not None and "window_size" in vf[1]:
            vkw["window_size"] = (-1 if case.window is None else case.window[0],
                                  0 if case.causal else -1)
        return cls(case, q, k, v, do, offsets_from_lengths(case.lengths, "cuda"), total,
                   max(case.lengths), fwd_flops,
                   dict(causal=case.causal, window=case.window, scale=case.dim ** -0.5),
                   vf, vkw)

    def varlen_call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cu = self.offsets.to(torch.int32)
        return self.varlen[0](q, k, v, cu, cu, self.max_len, self.max_len, **self.varlen_kw)


def _tune_case(case: Case, emit, out_dir: Path) -> None:
    t = _TuneInputs.make(case)
    _warm_gpu()
    if t.varlen is not None:
        ms = time_ms(lambda: t.varlen_call(t.q, t.k, t.v), rep_ms=200)
        emit({"case": case.name, "dir": "fwd", "variant": "varlen_attn", "ms": ms,
              "tflops": t.fwd_flops / ms / 1e9})
    _tune_forward(t, emit)
    if case.dim == 64:
        _tune_backward_d64(t, emit)
    if case.window is not None:
        _tune_window(t, emit, out_dir)


def _tune_forward(t: _TuneInputs, emit) -> None:
    """Each forward config of TUNE_FWD at each tile boundary handling."""
    from gem_kernels.jagged_attention.op import FwdConfig, ScheduleCache, jfa_forward

    name = t.case.name
    for c in TUNE_FWD.get(name, []):
        for boundary in TUNE_BOUNDARIES:
            cfg = FwdConfig(*c)
            try:
                sched = ScheduleCache(t.offsets, t.total)

                def f(sched=sched, cfg=cfg, b=boundary):
                    return jfa_forward(t.q, t.k, t.v, t.offsets, sched=sched, config=cfg,
                                       boundary=b, **t.kw)
                f()
                ms = time_ms(f, rep_ms=150)
                r = {"case": name, "dir": "fwd", "cfg": c, "boundary": boundary, "ms": ms,
                     "tflops": t.fwd_flops / ms / 1e9}
            except Exception as e:  # noqa: BLE001
                r = {"case": name, "dir": "fwd", "cfg": c, "boundary": boundary,
                     "error": f"{type(e).__name__}: {str(e)[:200]}"}
            emit(r)


def _tune_backward_d64(t: _TuneInputs, emit) -> None:
    """Each backward config of TUNE_BWD_D64 (head_dim 64 cases)."""
    from gem_kernels.jagged_attention.op import BwdConfig, ScheduleCache, jfa_backward, jfa_forward

    name = t.case.name
    sched = ScheduleCache(t.offsets, t.total)
    o, lse = jfa_forward(t.q, t.k, t.v, t.offsets, sched=sched, **t.kw)
    for c in TUNE_BWD_D64:
        try:
            def b(cfg=BwdConfig(*c)):
                return jfa_backward(t.do, t.q, t.k, t.v, o, lse, t.offsets, sched=sched,
                                    config=cfg, **t.kw)
            b()
            ms = time_ms(b, rep_ms=150)
            r = {"case": name, "dir": "bwd", "cfg": c, "ms": ms,
                 "tflops": 2.5 * t.fwd_flops / ms / 1e9}
        except Exception as e:  # noqa: BLE001
            r = {"case": name, "dir": "bwd", "cfg": c,
                 "error": f"{type(e).__name__}: {str(e)[:200]}"}
        emit(r)


def _tune_window(t: _TuneInputs, emit, out_dir: Path) -> None:
    """Sliding-window cases: the public op with ragged-TMA vs pointer loads (time and host
    time per call), varlen_attn's fwd+bwd, and a kernel-by-kernel profile of one fwd+bwd."""
    from gem_kernels.jagged_attention.op import jagged_attention_triton

    case, name, do = t.case, t.case.name, t.do
    qg, kg, vg = (x.clone().requires_grad_() for x in (t.q, t.k, t.v))

    def ours(opts=None):
        return jagged_attention_triton(qg, kg, vg, t.offsets, t.max_len, causal=case.causal,
                                       window=case.window, options=opts)
    for load in ("tma_ragged", "ptr"):
        opts = {"fwd": {"use_tma": load}, "bwd": {"use_tma": load}}

        def fo(opts=opts):
            with torch.no_grad():
                return ours(opts)
        out = ours(opts)
        timed = (("fwd", fo),
                 ("bwd", lambda out=out: torch.autograd.grad(out, (qg, kg, vg), do,
                                                              retain_graph=True)),
                 ("fwd+bwd", lambda opts=opts: torch.autograd.grad(ours(opts), (qg, kg, vg),
                                                                   do)))
        for d, f in timed:
            emit({"case": name, "dir": d, "load": load, "ms": time_ms(f, rep_ms=200),
                  "host_us": host_us_per_call(f)})
    if t.varlen is not None:
        def vfb():
            return torch.autograd.grad(t.varlen_call(qg, kg, vg), (qg, kg, vg), do)
        emit({"case": name, "dir": "fwd+bwd", "variant": "varlen_attn",
              "ms": time_ms(vfb, rep_ms=200), "host_us": host_us_per_call(vfb)})
    _profile_one_step(lambda: torch.autograd.grad(ours(), (qg, kg, vg), do),
                      out_dir / "jfa_window_profile.txt")


def _profile_one_step(fbd: Callable[[], object], path: Path) -> None:
    """Kernel-by-kernel view of one fwd+bwd (GPU time per kernel, CPU time per op)."""
    from torch.profiler import ProfilerActivity, profile

    fbd()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fbd()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    print(table, flush=True)
    path.write_text(table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gem_bench.kernels.jfa", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_results", help="folder for jfa.json")
    ap.add_argument("--quick", action="store_true", help="two small cases, shorter timing")
    ap.add_argument("--skip", default="", help="comma-separated variants to leave out")
    ap.add_argument("--cases", default="", help="comma-separated case names to keep")
    ap.add_argument("--sweep", action="store_true",
                    help="time our kernels under several tile configs instead")
    ap.add_argument("--sweep-loads", default=",".join(LOAD_SWEEP),
                    help="load paths the sweep tries")
    ap.add_argument("--tune", action="store_true",
                    help="time tile configs x boundary modes on the open targets' cases and "
                         "profile the windowed fwd+bwd, instead of the bench")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("jfa bench needs CUDA")
        return 1
    if args.tune:
        import json

        Path(args.out).mkdir(parents=True, exist_ok=True)
        res = tune(Path(args.out))
        (Path(args.out) / "jfa_tune.json").write_text(json.dumps(res, indent=1))
        return 0
    if args.sweep:
        import json

        res = []
        for case in _cases(False):
            if not args.cases or case.name in args.cases.split(","):
                res += sweep(case, loads=tuple(args.sweep_loads.split(",")))
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "jfa_sweep.json").write_text(json.dumps(res, indent=1))
        return 0
    rows: list[BenchRow] = []
    notes: dict = {}
    skip = {s for s in args.skip.split(",") if s}
    cases = _cases(args.quick)
    if args.cases:
        keep = set(args.cases.split(","))
        cases = [c for c in cases if c.name in keep]
    out_path = Path(args.out) / "jfa.json"
    for case in cases:
        print(f"case {case.name}", flush=True)
        run_case(case, rows, rep_ms=100 if args.quick else 200, skip=skip, notes=notes)
        write_json(rows, out_path, meta={"cases": notes, "partial": True})
    add_ratios(rows, "ours", "varlen_attn")
    print_table(rows, "jagged attention (bf16, useful TFLOP/s over real (q,k) pairs)")
    tg = targets(rows)
    for case, d in tg.items():
        print(case, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in d.items()})
    path = write_json(rows, out_path,
                      meta={"cases": notes, "targets": tg, "dtype": str(DTYPE),
                            "peak_tflops": H200_BF16_TFLOPS})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
