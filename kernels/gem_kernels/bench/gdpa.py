"""GDPA benchmark: our Triton kernels vs the PyTorch reference on padded tensors, eager and
under torch.compile, on self (long Q = KV), cross (long Q, 16 KV tokens) and pooled (8 query
tokens, long KV) attention with log-normal jagged lengths; forward, backward and both.

docs/bench/gdpa.json was produced on the H200 (commit "GDPA defaults from the H200 tuning
run") by:
    PYTHONPATH=kernels:platform python -m gem_kernels.bench.gdpa --out $OUT --budget-s 120
(--budget-s only stops starting new variants after 120 s; every variant finished).
meta.cases.<case>.ours_host_us_per_call is the host time to issue one call of the public op
with the GPU kept busy: where it exceeds the GPU time (the short shapes' backward and
fwd+bwd, which go through autograd), the row measures the host, and it moves with the load on
the machine's CPU. Cross backward: the committed row is 0.218 ms with 243 us of host per
call; the same kernel's GPU time alone (CUDA graph replay, --tune) is 0.114 ms (69% of HBM),
and the public op timed 0.114 ms in a --tune run where the host took 126 us per call.

Self attention, what moved (same H200; ablation rows of the committed run unless noted): the
previous kernel (public op of the older checkout, same run) 0.572 ms forward; the GELU
polynomial constrained to s(R) = 1, s'(R) = 0 (no selects) 0.542 ("pointer_scores"); the
scale folded into compile-time coefficients 0.531 ("pointer"; folded at run time instead:
0.601 in a --tune run, cause not isolated); K, V by ragged TMA with the next query tile
prefetched by ordinary loads 0.474 ms (379 TF/s; without the prefetch 0.525). The same kernel
with the identity activation ("identity") runs 0.333 ms: the activation is ~30% of the
forward. The backward runs in one pass over key blocks (dQ by fp32 atomics; S and act'
computed once): 1.77 ms against 1.88 for the two-kernel backward and 2.03 for the previous
kernels. Its matmul pipeline alone (identity activation) takes 1.53 ms (236 TF/s); with
gelu_tanh fwd+bwd is 2.21 ms (244 TF/s) where 250 TF/s needs 2.16.

Reading the short shapes: their kernels run 70-250 us, so rows timed through autograd (every
backward and fwd+bwd row) include host-side launch and autograd overhead that the GPU does not
hide (--tune reports the autograd engine's own floor: a no-op Function's backward costs
55-85 us of host per call). The public op's no-grad forward ("ours" fwd) skips the autograd
node and times as the launcher does.

--tune times tile configs, scale modes, backward modes and the cross backward kernel's
graphed GPU time in one run (gdpa_tune.json); with --public-only it uses only the public op
and runs on an older checkout for a same-run before/after comparison:
    PYTHONPATH=<old>/kernels:platform python kernels/gem_kernels/bench/gdpa.py --tune \
        --public-only --cases self,cross --out $OUT/base

Counting: useful FLOPs = 4 * sum_b(Lq_b * Lkv_b) * H * d forward (two matmuls over real
tokens only), backward = 2x forward (four matmuls; ours runs five: S is recomputed),
fwd+bwd = 3x. Bytes = the fewest HBM bytes: forward reads q, k, v and writes o;
backward reads q, k, v, do and writes dq, dk, dv. The padded baselines are timed on
already-padded tensors (padding not counted against them) and counted with the same useful
FLOPs and bytes. Schedules are built once per batch (cached across calls, as across layers);
their CPU build time is reported separately.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import replace
from pathlib import Path

import torch

from gem_kernels.bench.common import (
    H200_BF16_TFLOPS,
    BenchRow,
    add_ratios,
    fill_rates,
    print_table,
    time_ms,
    write_json,
)
from gem_kernels.bench.jfa import host_us_per_call
from gem_kernels.testing import lognormal_lengths, offsets_from_lengths

ACTIVATION = "gelu_tanh"


def case_lengths(case: str, batch: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """Log-normal lengths (mean ~470, max 2048) for the long side; fixed short side."""
    long = lognormal_lengths(batch, 470, 2048, seed=seed)
    if case == "self":
        return long, long
    if case == "cross":
        return long, [16] * batch
    if case == "pooled":
        return [8] * batch, long
    raise ValueError(case)


class Case:
    """Jagged and padded bf16 inputs of one shape, with its useful FLOP and byte counts."""

    def __init__(self, name: str, batch: int, heads: int, dim: int, seed: int = 0,
                 device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> None:
        from gem_kernels.gdpa.reference import pad_jagged

        self.name = name
        self.ql, self.kl = case_lengths(name, batch, seed)
        self.heads, self.dim = heads, dim
        dev, dt = device, dtype
        g = torch.Generator(device=dev).manual_seed(seed)
        tq, tk = sum(self.ql), sum(self.kl)
        self.q = torch.randn(tq, heads, dim, device=dev, dtype=dt, generator=g)
        self.k = torch.randn(tk, heads, dim, device=dev, dtype=dt, generator=g)
        self.v = torch.randn(tk, heads, dim, device=dev, dtype=dt, generator=g)
        self.do = torch.randn(tq, heads, dim, device=dev, dtype=dt, generator=g)
        self.qo = offsets_from_lengths(self.ql, dev)
        self.ko = offsets_from_lengths(self.kl, dev)
        self.max_q, self.max_kv = max(self.ql), max(self.kl)
        self.qp, _ = pad_jagged(self.q, self.qo, self.max_q)
        self.kp, _ = pad_jagged(self.k, self.ko, self.max_kv)
        self.vp, _ = pad_jagged(self.v, self.ko, self.max_kv)
        self.dop, _ = pad_jagged(self.do, self.qo, self.max_q)
        pairs = sum(a * b for a, b in zip(self.ql, self.kl, strict=True))
        self.flops_fwd = 4.0 * pairs * heads * dim
        row = heads * dim * self.q.element_size()
        self.bytes = {"fwd": (2 * tq + 2 * tk) * row, "bwd": (3 * tq + 4 * tk) * row}
        self.bytes["fwd+bwd"] = self.bytes["fwd"] + self.bytes["bwd"]
        self.flops = {"fwd": self.flops_fwd, "bwd": 2 * self.flops_fwd,
                      "fwd+bwd": 3 * self.flops_fwd}

    def free_padded(self) -> None:
        del self.qp, self.kp, self.vp, self.dop


def _grad_fns(fwd, inputs, do):
    """(fwd, bwd-only, fwd+bwd) callables for an op taking ``inputs``."""
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    out = fwd(*leaves)

    def bwd():
        return torch.autograd.grad(out, leaves, do, retain_graph=True)

    def both():
        return torch.autograd.grad(fwd(*leaves), leaves, do)

    def fwd_only():
        with torch.no_grad():
            return fwd(*inputs)

    return fwd_only, bwd, both


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def check_against_reference(c: Case, ours, info: dict, samples: int = 16) -> None:
    """Ours on the full batch vs the fp32 reference on its first samples (rows of a sample
    depend on that sample only), forward and gradients."""
    from gem_kernels.gdpa import gdpa_reference

    nq, nk = int(c.qo[samples]), int(c.ko[samples])
    leaves = [t.detach().requires_grad_(True) for t in (c.q, c.k, c.v)]
    out = ours(*leaves)
    grads = torch.autograd.grad(out, leaves, c.do)
    sub = [t.detach()[:n].float().requires_grad_(True) for t, n in zip(
        (c.q, c.k, c.v), (nq, nk, nk), strict=True)]
    ref = gdpa_reference(*sub, c.qo[:samples + 1], c.ko[:samples + 1], c.max_q, c.max_kv,
                         activation=ACTIVATION)
    ref_grads = torch.autograd.grad(ref, sub, c.do[:nq].float())
    info["rel_err_fwd_vs_fp32_reference"] = _rel(out[:nq], ref)
    info["rel_err_bwd_vs_fp32_reference"] = {
        n: _rel(a[:m], r) for n, a, r, m in zip("qkv", grads, ref_grads, (nq, nk, nk),
                                                 strict=True)}


def sched_stats(c: Case, cfg, rows_are_q: bool, num_sms: int) -> dict:
    """Per-SM work max/mean of the persistent schedule, snake vs natural order."""
    from gem_kernels.gdpa.schedule import build_items, deal, imbalance

    rl, cl = (c.ql, c.kl) if rows_are_q else (c.kl, c.ql)
    items, work = build_items(torch.tensor(rl), torch.tensor(cl), cfg.block_rows,
                              cfg.block_cols, c.heads)
    p = max(1, min(num_sms * cfg.ctas_per_sm, items.shape[0]))
    t0 = time.perf_counter()
    from gem_kernels.gdpa.schedule import build_schedule

    build_schedule(c.qo if rows_are_q else c.ko, c.ko if rows_are_q else c.qo, cfg.block_rows,
                   cfg.block_cols, c.heads, p, c.q.device, num_sms=num_sms)
    build_ms = (time.perf_counter() - t0) * 1e3
    tiles = int((work - 1).sum())
    bm, bn = cfg.block_rows, cfg.block_cols
    padded_tiles = len(rl) * c.heads * math.ceil(max(rl) / bm) * math.ceil(max(cl) / bn)
    return {
        "programs": p, "items": int(items.shape[0]), "tiles_computed": tiles,
        "tiles_padded_grid": padded_tiles, "schedule_build_ms": round(build_ms, 3),
        "imbalance_snake_per_sm": imbalance(work, deal(work, p, True, num_sms), p, num_sms),
        "imbalance_natural_per_sm": imbalance(work, deal(work, p, False), p, num_sms),
        "imbalance_snake_per_program": imbalance(work, deal(work, p, True, num_sms), p),
        "imbalance_natural_per_program": imbalance(work, deal(work, p, False), p),
    }


def fwd_variants(case: str, quick: bool) -> list[tuple[str, dict]]:
    """(name, TileConfig overrides) forward ablations timed besides the default."""
    flip = [("flip_prefetch", {"prefetch": None})]  # None: the opposite of the default
    if quick:
        return flip
    if case == "self":
        # the default: K, V by ragged TMA, the next query tile prefetched by pointer loads;
        # "pointer" is the previous default (pointer loads throughout), "pointer_scores" that
        # kernel with the scale applied to every score (the activation before this change
        # minus its select); "identity" rows are the same kernels without the activation:
        # the matmul pipeline's ceiling
        return flip + [("identity", {"activation": "identity"}),
                       ("no_prefetch_identity", {"prefetch": False,
                                                 "activation": "identity"}),
                       ("pointer", {"tma": False}),
                       ("pointer_scores", {"tma": False, "scale_mode": "scores"}),
                       ("scores", {"scale_mode": "scores"}),
                       ("runtime_scale", {"scale_mode": "runtime"}),
                       ("s4", {"num_stages": 4}),
                       ("bn128_s2", {"block_cols": 128, "num_stages": 2}),
                       ("bm64_w4_cta2", {"block_rows": 64, "num_warps": 4,
                                         "ctas_per_sm": 2})]
    if case == "cross":
        # the default is KV-major (whole KV per item, query tiles streamed); the q-major rows
        # are the previous default (query-block items) and its variants
        qm = {"kv_major": False, "block_rows": 64, "block_cols": 16, "num_stages": 1,
              "ctas_per_sm": 4, "prefetch": False}
        return [("qmajor_bm64_cta4", qm),
                ("qmajor_bm64_cta4_prefetch", {**qm, "prefetch": True}),
                ("qmajor_bm64_cta8", {**qm, "ctas_per_sm": 8}),
                ("kvmajor_bm64_s2_cta4", {"num_stages": 2}),
                ("kvmajor_bm64_s3_cta2", {"ctas_per_sm": 2}),
                ("kvmajor_bm64_s4_cta4", {"num_stages": 4}),
                ("kvmajor_bm32_s3_cta4", {"block_cols": 32}),
                ("kvmajor_bm128_s3_w8", {"block_cols": 128, "num_warps": 8, "ctas_per_sm": 1})]
    return flip + [("bn128_s3", {"block_cols": 128}),
                   ("bn64_s4", {"num_stages": 4}),
                   ("bn64_s3_cta2_w8", {"ctas_per_sm": 2, "num_warps": 8})]


def bwd_variants(case: str, quick: bool, max_q: int, max_kv: int, dim: int):
    """(name, bwd_mode, dkdv config, dq config[, activation]) backward ablations."""
    from gem_kernels.gdpa.triton_bwd import (
        dkdv_config,
        dq_config,
        one_pass_config,
        short_kv_config,
        short_kv_stream_config,
        short_q_config,
    )

    kv, q = dkdv_config(max_q, max_kv, dim), dq_config(max_q, max_kv, dim)
    two = [("bwd_two_kernel", "two_kernel", replace(kv, prefetch=True),
            replace(q, prefetch=True))]
    if quick:
        return two if case != "self" else []
    if case == "self":
        op = one_pass_config(max_q, max_kv, dim)
        return [("bwd_two_kernel", "two_kernel", kv, q),
                ("bwd_one_pass_identity", "one_pass", op, None, "identity"),
                ("bwd_one_pass_prefetch", "one_pass", replace(op, prefetch=True), None),
                ("bwd_one_pass_tma", "one_pass", replace(op, tma=True), None),
                ("bwd_one_pass_s4", "one_pass", replace(op, num_stages=4), None),
                ("bwd_one_pass_scores", "one_pass", replace(op, scale_mode="scores"), None)]
    if case == "cross":
        f = short_kv_config(max_kv, dim)
        st = short_kv_stream_config(max_kv, dim)
        return two + [("bwd_atomic_default", "short_kv_atomic", None, f),
                      ("bwd_stream_bm64_s2", "short_kv", replace(st, block_cols=64,
                                                                 num_stages=2), None),
                      ("bwd_stream_bm32_s4", "short_kv", replace(st, num_stages=4), None)]
    f = short_q_config(max_q, dim)
    return two + [("bwd_fused_no_prefetch", "short_q", replace(f, prefetch=False), None),
                  ("bwd_fused_bn128_w8", "short_q", replace(f, block_rows=128, num_warps=8),
                   None),
                  ("bwd_fused_cta4", "short_q", replace(f, ctas_per_sm=4), None)]


def run_case(c: Case, phase: str, quick: bool, rows: list[BenchRow], meta: dict,
             deadline: float, baselines: bool = True) -> None:
    """phase 'main': correctness check, ours and both padded baselines; 'ablations': the
    schedule-order, prefetch and tile-shape variants."""
    from gem_kernels.gdpa import gdpa
    from gem_kernels.gdpa.activations import ACT_CODE
    from gem_kernels.gdpa.op import GDPAFunction, backward_mode, forward_schedule, num_sms
    from gem_kernels.gdpa.reference import gdpa_padded
    from gem_kernels.gdpa.schedule import build_schedule
    from gem_kernels.gdpa.triton_bwd import (
        dkdv_config,
        dq_config,
        one_pass_config,
        short_kv_stream_config,
        short_q_config,
    )
    from gem_kernels.gdpa.triton_fwd import fwd_config, launch_fwd

    scale = 1.0 / math.sqrt(c.dim)
    sms = num_sms(c.q.device)
    cfg = fwd_config(c.max_q, c.max_kv, c.dim)
    cfg_kv, cfg_q = dkdv_config(c.max_q, c.max_kv, c.dim), dq_config(c.max_q, c.max_kv, c.dim)
    mode = backward_mode(c.max_q, c.max_kv)
    if mode == "short_kv":
        cfg_kv = short_kv_stream_config(c.max_kv, c.dim)
    elif mode == "one_pass":
        cfg_kv = one_pass_config(c.max_q, c.max_kv, c.dim)
    elif mode == "short_q":
        cfg_kv = short_q_config(c.max_q, c.dim)
    if phase == "main":
        meta["cases"][c.name] = {
            "lengths_q": {"sum": sum(c.ql), "max": c.max_q},
            "lengths_kv": {"sum": sum(c.kl), "max": c.max_kv},
            "fwd_config": vars(cfg), "bwd_mode": mode, "dkdv_config": vars(cfg_kv),
            "dq_config": vars(cfg_q),
            "schedule_fwd": sched_stats(c, cfg, not cfg.kv_major, sms),
            "schedule_dkdv": sched_stats(c, cfg_kv, False, sms),
            "schedule_dq": sched_stats(c, cfg_q, True, sms), "errors": {}}
    info = meta["cases"][c.name]

    def record(variant: str, direction: str, fn, extra: dict | None = None) -> None:
        if time.monotonic() > deadline:
            info["errors"][f"{variant}/{direction}"] = "skipped: time budget"
            return
        try:
            ms = time_ms(fn)
        except Exception as e:  # one failing variant must not lose the others
            info["errors"][f"{variant}/{direction}"] = f"{type(e).__name__}: {e}"[:500]
            torch.cuda.empty_cache()
            return
        row = BenchRow(case=c.name, variant=variant, direction=direction, ms=ms,
                       extra=extra or {})
        rows.append(fill_rates(row, c.flops[direction], c.bytes[direction]))

    # --- ours: the public op (default configs) -----------------------------------------
    def ours(q, k, v):
        return gdpa(q, k, v, c.qo, c.ko, c.max_q, c.max_kv, activation=ACTIVATION,
                    kernel="triton")

    def padded(q, k, v):
        return gdpa_padded(q, k, v, None, activation=ACTIVATION, scale=scale)

    if phase == "main":
        try:
            check_against_reference(c, ours, info)
        except Exception as e:
            info["errors"]["check"] = f"{type(e).__name__}: {e}"[:500]
        torch.cuda.empty_cache()

        try:
            f, b, fb = _grad_fns(ours, (c.q, c.k, c.v), c.do)
            for direction, fn in (("fwd", f), ("bwd", b), ("fwd+bwd", fb)):
                record("ours", direction, fn)
            # host time to issue one call (GPU kept busy): a row whose GPU time is below it
            # is host-bound
            info["ours_host_us_per_call"] = {
                d: round(host_us_per_call(fn), 1)
                for d, fn in (("fwd", f), ("bwd", b), ("fwd+bwd", fb))}
            del f, b, fb
        except Exception as e:
            info["errors"]["ours"] = f"{type(e).__name__}: {e}"[:500]

        # --- baselines on padded tensors ----------------------------------------------------
        compiled = torch.compile(padded, dynamic=False)
        for variant, fn in (("padded_eager", padded), ("padded_compile", compiled)):
            if not baselines:
                break
            if time.monotonic() > deadline:
                info["errors"][variant] = "skipped: time budget"
                continue
            try:
                f, b, fb = _grad_fns(fn, (c.qp, c.kp, c.vp), c.dop)
            except Exception as e:
                info["errors"][variant] = f"{type(e).__name__}: {e}"[:500]
                continue
            for direction, g in (("fwd", f), ("bwd", b), ("fwd+bwd", fb)):
                record(variant, direction, g)
            del f, b, fb
            torch.cuda.empty_cache()
        return

    # --- forward ablations: schedule order, prefetch, tile shapes ----------------------
    act = ACT_CODE[ACTIVATION]
    rows_o, cols_o = (c.ko, c.qo) if cfg.kv_major else (c.qo, c.ko)
    natural = build_schedule(rows_o, cols_o, cfg.block_rows, cfg.block_cols, c.heads,
                             sms * cfg.ctas_per_sm, c.q.device, snake=False,
                             cover_empty_rows=cfg.kv_major)
    record("ours_no_snake", "fwd",
           lambda: launch_fwd(c.q, c.k, c.v, natural, cfg, act, 0, scale, c.max_kv))
    for name, over in fwd_variants(c.name, quick):
        if "prefetch" in over and over["prefetch"] is None:
            over = {**over, "prefetch": not cfg.prefetch}
        vact = ACT_CODE[over.pop("activation", ACTIVATION)]
        vcfg = replace(cfg, **over)
        sched = forward_schedule(c.qo, c.ko, c.heads, vcfg, c.max_kv, c.q.device)
        record(f"ours_{name}", "fwd",
               lambda vcfg=vcfg, sched=sched, vact=vact: launch_fwd(
                   c.q, c.k, c.v, sched, vcfg, vact, 0, scale, c.max_kv),
               {"config": vars(vcfg)})
    for name, mode, ckv, cq, *vact in bwd_variants(c.name, quick, c.max_q, c.max_kv,
                                                    c.dim):
        def op(q, k, v, ckv=ckv, cq=cq, mode=mode, a=(vact or [ACTIVATION])[0]):
            return GDPAFunction.apply(q, k, v, c.qo, c.ko, c.max_q, c.max_kv, a, scale, 0,
                                      None, ckv, cq, mode)

        try:
            _, b, _ = _grad_fns(op, (c.q, c.k, c.v), c.do)
        except Exception as e:
            info["errors"][f"ours_{name}"] = f"{type(e).__name__}: {e}"[:500]
            continue
        record(f"ours_{name}", "bwd", b, {"mode": mode, "dkdv": ckv and vars(ckv),
                                           "dq": cq and vars(cq)})
        del b


# --- tuning: many configs timed in one GPU run ---------------------------------------------

def _gpu_ms_graphed(fn) -> float:
    """GPU time of fn's launches alone: captured once in a CUDA graph, replays timed (no host
    launch cost inside the measurement)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return time_ms(g.replay)


def tune_public(cases: list[Case], emit) -> None:
    """The public op's fwd / bwd / fwd+bwd as the benchmark times them, with the host time
    per call (GPU kept busy) and, for the backward, the engine's floor: the host time of a
    no-op autograd Function on the same inputs. Uses only the op's public API, so an older
    checkout of the package can run it for a same-run before/after comparison."""
    from gem_kernels.gdpa import gdpa

    class _Noop(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            ctx.kv = (k.detach(), v.detach())  # handed back as gradients: no allocation
            return q.clone()

        @staticmethod
        def backward(ctx, do):
            return (do, *ctx.kv)

    for c in cases:
        def ours(q, k, v, c=c):
            return gdpa(q, k, v, c.qo, c.ko, c.max_q, c.max_kv, activation=ACTIVATION,
                        kernel="triton")

        try:
            f, b, fb = _grad_fns(ours, (c.q, c.k, c.v), c.do)
        except Exception as e:
            emit({"case": c.name, "what": "public", "error": f"{type(e).__name__}: {e}"[:400]})
            continue
        for direction, fn in (("fwd", f), ("bwd", b), ("fwd+bwd", fb)):
            ms = time_ms(fn)
            row = fill_rates(BenchRow(c.name, "ours", direction, ms), c.flops[direction],
                             c.bytes[direction])
            emit({"case": c.name, "what": "public", "direction": direction, "ms": ms,
                  "tflops": row.useful_tflops, "frac_hbm": row.frac_hbm,
                  "host_us": host_us_per_call(fn)})
        _, nb, _ = _grad_fns(_Noop.apply, (c.q, c.k, c.v), c.q)
        emit({"case": c.name, "what": "autograd_noop_bwd", "host_us": host_us_per_call(nb)})


def tune_kernels(cases: dict[str, Case], emit, deadline: float) -> None:
    """Forward tile configs (pointer vs ragged-TMA loads, stages, flattened / warp-specialized
    pipelines) with gelu_tanh and with identity (the same kernel without the activation: the
    matmul pipeline's ceiling); backward modes and tiles; the cross backward kernel's GPU time
    alone and its host time per call."""
    from gem_kernels.gdpa.activations import ACT_CODE
    from gem_kernels.gdpa.op import GDPAFunction, forward_schedule, schedule_for
    from gem_kernels.gdpa.triton_bwd import (
        TileConfig,
        launch_bwd_short_kv_stream,
        short_kv_stream_config,
    )
    from gem_kernels.gdpa.triton_fwd import launch_fwd

    def timed(name: str, c: Case, direction: str, fn, **extra) -> None:
        if time.monotonic() > deadline:
            emit({"case": c.name, "what": name, "skipped": "time budget"})
            return
        try:
            ms = time_ms(fn)
        except Exception as e:  # one failing variant must not lose the others
            emit({"case": c.name, "what": name, "error": f"{type(e).__name__}: {e}"[:400]})
            torch.cuda.empty_cache()
            return
        row = fill_rates(BenchRow(c.name, name, direction, ms), c.flops[direction],
                         c.bytes[direction])
        emit({"case": c.name, "what": name, "direction": direction, "ms": ms,
              "tflops": row.useful_tflops, "frac_hbm": row.frac_hbm, **extra})

    c = cases["cross"]
    act = ACT_CODE[ACTIVATION]
    base = short_kv_stream_config(c.max_kv, c.dim)
    for name, cfg in (("default", base), ("bm64_s2", replace(base, block_cols=64,
                                                             num_stages=2)),
                      ("bm32_s4", replace(base, num_stages=4)),
                      ("bm16_s4", replace(base, block_cols=16, num_stages=4))):
        sched = schedule_for(c.ko, c.qo, c.heads, cfg, c.q.device, cover_empty_rows=True)

        def launch(cfg=cfg, sched=sched):
            return launch_bwd_short_kv_stream(c.q, c.k, c.v, c.do, sched, cfg, act, 0,
                                              1.0 / math.sqrt(c.dim), c.max_kv)

        try:
            gpu = _gpu_ms_graphed(launch)
            row = fill_rates(BenchRow(c.name, name, "bwd", gpu), c.flops["bwd"],
                             c.bytes["bwd"])
            emit({"case": c.name, "what": f"bwd_kernel_graphed_{name}", "direction": "bwd",
                  "ms": gpu, "frac_hbm": row.frac_hbm, "launcher_host_us":
                  host_us_per_call(launch)})
        except Exception as e:
            emit({"case": c.name, "what": f"bwd_kernel_graphed_{name}",
                  "error": f"{type(e).__name__}: {e}"[:400]})

    c = cases["self"]
    scale = 1.0 / math.sqrt(c.dim)
    T = TileConfig
    fwd = [
        ("ptr_128x64_w8_s3", T(128, 64, 8, 3, 1, True), ("gelu_tanh",)),
        ("ptr_128x64_w8_s3_runtime", T(128, 64, 8, 3, 1, True, scale_mode="runtime"),
         ("gelu_tanh",)),
        ("ptr_128x64_w8_s3_scores", T(128, 64, 8, 3, 1, True, scale_mode="scores"),
         ("gelu_tanh",)),
        ("tma_128x64_w8_s3", T(128, 64, 8, 3, 1, False, tma=True), ("gelu_tanh", "identity")),
        ("tma_128x64_w8_s3_runtime", T(128, 64, 8, 3, 1, False, tma=True,
                                       scale_mode="runtime"), ("gelu_tanh",)),
        ("tma_128x64_w8_s3_scores", T(128, 64, 8, 3, 1, False, tma=True,
                                      scale_mode="scores"), ("gelu_tanh", "identity")),
        ("tma_128x64_w8_s3_prefetch", T(128, 64, 8, 3, 1, True, tma=True), ("gelu_tanh",)),
        ("tma_128x64_w8_s4_prefetch", T(128, 64, 8, 4, 1, True, tma=True), ("gelu_tanh",)),
        ("tma_128x64_w8_s2_prefetch", T(128, 64, 8, 2, 1, True, tma=True), ("gelu_tanh",)),
    ]
    for name, cfg, acts in fwd:
        sched = forward_schedule(c.qo, c.ko, c.heads, cfg, c.max_kv, c.q.device)
        for act in acts:
            timed(f"fwd_{name}_{act}", c, "fwd",
                  lambda cfg=cfg, sched=sched, act=act: launch_fwd(
                      c.q, c.k, c.v, sched, cfg, ACT_CODE[act], 0, scale, c.max_kv),
                  config=vars(cfg))

    bwd = [
        ("two_kernel_64x32_s3", "two_kernel", T(64, 32, 4, 3, 2, False),
         T(64, 32, 4, 3, 2, False), ("gelu_tanh",)),
        ("two_kernel_64x32_s3_scores", "two_kernel",
         T(64, 32, 4, 3, 2, False, scale_mode="scores"),
         T(64, 32, 4, 3, 2, False, scale_mode="scores"), ("gelu_tanh",)),
        ("one_pass_128x32_w8_s3", "one_pass", T(128, 32, 8, 3, 1, False), None,
         ("gelu_tanh",)),
        ("one_pass_tma_128x32_w8_s3", "one_pass", T(128, 32, 8, 3, 1, False, tma=True), None,
         ("gelu_tanh", "identity")),
        ("one_pass_tma_128x32_w8_s3_scores", "one_pass",
         T(128, 32, 8, 3, 1, False, tma=True, scale_mode="scores"), None, ("gelu_tanh",)),
        ("one_pass_tma_128x32_w8_s2", "one_pass", T(128, 32, 8, 2, 1, False, tma=True), None,
         ("gelu_tanh",)),
        ("one_pass_tma_128x32_w8_s4", "one_pass", T(128, 32, 8, 4, 1, False, tma=True), None,
         ("gelu_tanh",)),
        ("one_pass_tma_128x64_w8_s2", "one_pass", T(128, 64, 8, 2, 1, False, tma=True), None,
         ("gelu_tanh",)),
        ("one_pass_tma_64x32_w4_s3_cta2", "one_pass", T(64, 32, 4, 3, 2, False, tma=True),
         None, ("gelu_tanh",)),
        ("one_pass_tma_64x64_w4_s3_cta2", "one_pass", T(64, 64, 4, 3, 2, False, tma=True),
         None, ("gelu_tanh",)),
    ]
    for name, mode, ckv, cq, acts in bwd:
        for act in acts:
            def op(q, k, v, ckv=ckv, cq=cq, mode=mode, act=act):
                return GDPAFunction.apply(q, k, v, c.qo, c.ko, c.max_q, c.max_kv, act,
                                          scale, 0, None, ckv, cq, mode)

            try:
                _, b, _ = _grad_fns(op, (c.q, c.k, c.v), c.do)
            except Exception as e:
                emit({"case": c.name, "what": f"bwd_{name}_{act}", "error": f"{e}"[:400]})
                continue
            timed(f"bwd_{name}_{act}", c, "bwd", b, mode=mode)
            del b

def tune(args) -> None:
    import json

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: list[dict] = []

    def emit(r: dict) -> None:
        print(json.dumps(r), flush=True)
        res.append(r)
        (out / "gdpa_tune.json").write_text(json.dumps(res, indent=1))

    deadline = time.monotonic() + args.budget_s
    names = args.cases.split(",")
    cases = {n: Case(n, 256, 4, 128) for n in names}
    for c in cases.values():
        c.free_padded()
    tune_public(list(cases.values()), emit)
    if not args.public_only:
        tune_kernels(cases, emit, deadline)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench-out", help="directory for gdpa.json")
    ap.add_argument("--quick", action="store_true", help="small batch, fewer variants")
    ap.add_argument("--cases", default="self,cross,pooled")
    ap.add_argument("--budget-s", type=float, default=1e9,
                    help="stop timing new variants after this many seconds")
    ap.add_argument("--no-baselines", action="store_true",
                    help="skip the padded baselines (tuning runs; not for published results)")
    ap.add_argument("--tune", action="store_true",
                    help="time tile configs, backward modes and host costs (gdpa_tune.json)")
    ap.add_argument("--public-only", action="store_true",
                    help="with --tune: only the public op's rows (runs on older checkouts)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the GDPA benchmark needs a CUDA GPU")
    if args.tune:
        tune(args)
        return
    deadline = time.monotonic() + args.budget_s
    batch, heads, dim = (64 if args.quick else 256), 4, 128
    rows: list[BenchRow] = []
    meta = {"activation": ACTIVATION, "batch": batch, "heads": heads, "head_dim": dim,
            "lengths": "log-normal mean 470, sigma 1, clipped to [1, 2048]",
            "flops": "fwd 4*sum(Lq*Lkv)*H*d, bwd 2x fwd, fwd+bwd 3x fwd",
            "bytes": "fwd q+k+v+o, bwd q+k+v+do+dq+dk+dv (bf16)",
            "ceilings": {"bf16_tflops": H200_BF16_TFLOPS, "hbm_tbs": 4.27}, "cases": {}}
    out = Path(args.out) / "gdpa.json"
    cases = [Case(name, batch, heads, dim) for name in args.cases.split(",")]
    for phase in ("main", "ablations"):
        for c in cases:
            run_case(c, phase, args.quick, rows, meta, deadline, not args.no_baselines)
            torch.cuda.empty_cache()
            add_ratios(rows, "ours", "padded_compile")
            write_json(rows, out, meta)
    for name, info in meta["cases"].items():
        sf = info["schedule_fwd"]
        print(f"{name}: fwd per-SM work max/mean snake {sf['imbalance_snake_per_sm']:.3f} vs "
              f"natural {sf['imbalance_natural_per_sm']:.3f}; rel err fwd "
              f"{info.get('rel_err_fwd_vs_fp32_reference')} bwd "
              f"{info.get('rel_err_bwd_vs_fp32_reference')}; errors {info['errors']}")
    print_table(rows, f"GDPA ({ACTIVATION}, B={batch}, H={heads}, d={dim}, bf16)")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
