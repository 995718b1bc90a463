"""GDPA benchmark: our Triton kernels vs the PyTorch reference on padded tensors, eager and
under torch.compile, on self (long Q = KV), cross (long Q, 16 KV tokens) and pooled (8 query
tokens, long KV) attention with log-normal jagged lengths; forward, backward and both.

    PYTHONPATH=kernels:platform:bench python -m gem_bench.kernels.gdpa --out $OUT --budget-s 120
(--budget-s only stops starting new variants after that many seconds; the errors of each case
in gdpa.json name any variant it skipped. --cases self --ablations plans re-measures the self
main rows with both baselines, then only the backward plans the op tunes between, forced.)

What each row measures. Every main row (ours = the public op ``gdpa`` with its defaults, and
the two baselines: the padded reference eager and under torch.compile) times three callables:
fwd (the op under no_grad), bwd (torch.autograd.grad of an output made once, retained) and
fwd+bwd (forward and grad together). For each:
- ms (and useful_tflops, frac_hbm, ratio_to_baseline): median time of the callable as a
  program calls it (CUDA events around back-to-back calls), host work included: where the
  host needs longer to issue a call than the GPU needs to run it, this column measures the
  host.
- extra.ms_gpu (useful_tflops_gpu, frac_hbm_gpu, ratio_to_baseline_gpu): the same callable
  captured once in a CUDA graph (warmed up on the capture stream; for bwd the output is made
  on that stream, so its backward is captured too) and the replays timed: the GPU work alone,
  no host work inside the measurement. This is the kernels' bandwidth / throughput, and what
  a training step sees when the op's host work overlaps other GPU work or the step is
  graphed. A callable that cannot be captured has ms_gpu null and extra.gpu_note saying why.
- extra.host_us_per_call: host time to issue one call with the GPU kept busy (the floor
  under which the eager column cannot go).
The second printed table shows these columns side by side. Backward ablation rows of the
short shapes (cross, pooled) also carry ms_gpu (their eager rows are host-bound); the other
ablation rows are eager, launcher-level timings of one kernel variant.

Measured figures: docs/bench/gdpa.json and gdpa_self.json (docs/bench/README.md).

The self-attention backward: the op chooses in-run between plans with the same result
(gem_kernels.gdpa.tuning; meta.cases.self.backward_tuning lists what it timed): the atomic
one-pass kernel (one launch over key blocks, dQ summed into a zeroed fp32 buffer by atomics,
then cast) and the phased one (the first, middle and last key blocks of every sample as three
launches: no zeroing, no cast), each with dQ computed transposed (dQ^T = K^T dS^T: a
warpgroup MMA with head_dim rows) at 3 and 4 stages, and each as before (dS K, a 32-row
mma.sync product). Rows bwd_one_pass / bwd_phased time each plan; *_identity are the same
plans without the activation (the matmul pipeline's ceiling).

Counting: useful FLOPs = 4 * sum_b(Lq_b * Lkv_b) * H * d forward (two matmuls over real
tokens only), backward = 2x forward (four matmuls; ours runs five: S is recomputed),
fwd+bwd = 3x. Bytes = the fewest HBM bytes: forward reads q, k, v and writes o;
backward reads q, k, v, do and writes dq, dk, dv. The padded baselines are timed on
already-padded tensors (padding not counted against them) and counted with the same useful
FLOPs and bytes. Schedules are built once per batch (cached across calls, as across layers);
their CPU build time is reported separately.

--tune times tile configs, scale modes, backward modes and the cross backward kernel's
graphed GPU time in one run (gdpa_tune.json); with --public-only it uses only the public op
and runs on an older checkout for a same-run before/after comparison:
    PYTHONPATH=<old>/kernels:platform:bench python bench/gem_bench/kernels/gdpa.py --tune \
        --public-only --cases self,cross --out $OUT/base
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from gem_bench.kernels.common import (
    H200_BF16_TFLOPS,
    H200_HBM_TBS,
    BenchRow,
    add_ratios,
    fill_rates,
    graph_replay_ms,
    host_us_per_call,
    print_table,
    time_ms,
    write_json,
)
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


def graphed_ms(fwd, inputs, do, directions) -> dict[str, float | str]:
    """GPU time of the callables that the eager rows time (fwd under no_grad;
    torch.autograd.grad(out, leaves, do, retain_graph=True) of an output made beforehand;
    forward and grad together), each captured once in a CUDA graph and replayed: no host work
    inside the measurement. The output for bwd is made on the capture stream, so that its
    backward (which runs on its forward's stream) is captured. A callable that cannot be
    captured gets 'not captured: <why>' instead of a time."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    leaves = [t.detach().requires_grad_(True) for t in inputs]

    def make(direction: str):
        if direction == "fwd":
            def f():
                with torch.no_grad():
                    return fwd(*inputs)
            return f
        if direction == "bwd":
            out = fwd(*leaves)
            return lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)
        return lambda: torch.autograd.grad(fwd(*leaves), leaves, do)

    res: dict[str, float | str] = {}
    for direction in directions:
        try:
            with torch.cuda.stream(stream):
                fn = make(direction)
            res[direction] = graph_replay_ms(fn, stream, warmup_calls=2)
        except Exception as e:  # reported in the row instead of a time
            res[direction] = f"not captured: {type(e).__name__}: {e}"[:300]
        fn = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return res


def _plan_name(plan) -> str:
    mode, cfg = plan
    return (f"{mode}_{cfg.block_rows}x{cfg.block_cols}_w{cfg.num_warps}_s{cfg.num_stages}"
            + (f"_c{cfg.ctas_per_sm}" if cfg.ctas_per_sm != 1 else "")
            + ("_tma" if cfg.tma else "") + ("_dqt" if cfg.dq_transposed else ""))


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
        # "pointer": pointer loads throughout; "scores": the scale applied to every score
        # instead of folded into the polynomial; "identity": the same kernel without the
        # activation (the matmul pipeline's ceiling)
        return flip + [("identity", {"activation": "identity"}),
                       ("pointer", {"tma": False}),
                       ("scores", {"scale_mode": "scores"}),
                       ("s4", {"num_stages": 4})]
    if case == "cross":
        # the default is KV-major (whole KV per item, query tiles streamed); the q-major rows
        # are the previous default (query-block items) and its variants
        qm = {"kv_major": False, "block_rows": 64, "block_cols": 16, "num_stages": 1,
              "ctas_per_sm": 4, "prefetch": False}
        return [("qmajor_bm64_cta4", qm),
                ("kvmajor_bm64_s3_cta2", {"ctas_per_sm": 2}),
                ("kvmajor_bm64_s4_cta4", {"num_stages": 4})]
    return flip + [("bn64_s4", {"num_stages": 4})]


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
        # the two plans the op chooses between (atomic dQ: the previous default; phased),
        # each also without the activation (the matmul pipeline's ceiling)
        return [("bwd_two_kernel", "two_kernel", kv, q),
                ("bwd_one_pass", "one_pass", op, None),
                ("bwd_one_pass_identity", "one_pass", op, None, "identity"),
                ("bwd_phased", "one_pass_phased", op, None),
                ("bwd_phased_hoisted", "one_pass_phased_hoisted", op, None),
                ("bwd_phased_s2", "one_pass_phased", replace(op, num_stages=2), None),
                ("bwd_one_pass_64x32", "one_pass", replace(op, block_rows=64), None),
                ("bwd_phased_64x32", "one_pass_phased", replace(op, block_rows=64), None),
                ("bwd_phased_identity", "one_pass_phased", op, None, "identity"),
                ("bwd_phased_dq_mma_sync", "one_pass_phased", replace(op, dq_transposed=False),
                 None),
                ("bwd_phased_dq_mma_sync_identity", "one_pass_phased",
                 replace(op, dq_transposed=False), None, "identity"),
                ("bwd_one_pass_tma", "one_pass", replace(op, tma=True), None)]
    if case == "cross":
        f = short_kv_config(max_kv, dim)
        st = short_kv_stream_config(max_kv, dim)
        return two + [("bwd_atomic_default", "short_kv_atomic", None, f),
                      ("bwd_stream_bm64_s2", "short_kv", replace(st, block_cols=64,
                                                                 num_stages=2), None),
                      ("bwd_stream_bm32_s4", "short_kv", replace(st, num_stages=4), None)]
    f = short_q_config(max_q, dim)
    return two + [("bwd_fused_bn128_w8", "short_q", replace(f, block_rows=128, num_warps=8),
                   None),
                  ("bwd_fused_cta4", "short_q", replace(f, ctas_per_sm=4), None)]


def _case_configs(c: Case) -> tuple[object, object, object, str]:
    """The forward config, the backward mode and its dK/dV (or single-kernel) and dQ configs
    the op picks for this case's shape."""
    from gem_kernels.gdpa.op import backward_mode
    from gem_kernels.gdpa.triton_bwd import (
        dkdv_config,
        dq_config,
        one_pass_config,
        short_kv_stream_config,
        short_q_config,
    )
    from gem_kernels.gdpa.triton_fwd import fwd_config

    cfg = fwd_config(c.max_q, c.max_kv, c.dim)
    cfg_kv, cfg_q = dkdv_config(c.max_q, c.max_kv, c.dim), dq_config(c.max_q, c.max_kv, c.dim)
    mode = backward_mode(c.max_q, c.max_kv)
    if mode == "short_kv":
        cfg_kv = short_kv_stream_config(c.max_kv, c.dim)
    elif mode == "one_pass":
        cfg_kv = one_pass_config(c.max_q, c.max_kv, c.dim)
    elif mode == "short_q":
        cfg_kv = short_q_config(c.max_q, c.dim)
    return cfg, cfg_kv, cfg_q, mode


def _describe_case(c: Case, sms: int) -> dict:
    """meta.cases[<case>]: lengths, the configs the op picks and their schedules' balance."""
    cfg, cfg_kv, cfg_q, mode = _case_configs(c)
    return {
        "lengths_q": {"sum": sum(c.ql), "max": c.max_q},
        "lengths_kv": {"sum": sum(c.kl), "max": c.max_kv},
        "fwd_config": vars(cfg), "bwd_mode": mode, "dkdv_config": vars(cfg_kv),
        "dq_config": vars(cfg_q),
        "schedule_fwd": sched_stats(c, cfg, not cfg.kv_major, sms),
        "schedule_dkdv": sched_stats(c, cfg_kv, False, sms),
        "schedule_dq": sched_stats(c, cfg_q, True, sms), "errors": {}}


class _Recorder:
    """Times callables of one case into ``rows``; a failure or the time budget is noted in
    ``info['errors']`` instead, so one failing variant never loses the others."""

    def __init__(self, c: Case, rows: list[BenchRow], info: dict, deadline: float) -> None:
        self.c, self.rows, self.info, self.deadline = c, rows, info, deadline

    def record(self, variant: str, direction: str, fn, extra: dict | None = None
               ) -> BenchRow | None:
        c, info = self.c, self.info
        if time.monotonic() > self.deadline:
            info["errors"][f"{variant}/{direction}"] = "skipped: time budget"
            return None
        try:
            ms = time_ms(fn)
        except Exception as e:  # one failing variant must not lose the others
            info["errors"][f"{variant}/{direction}"] = f"{type(e).__name__}: {e}"[:500]
            torch.cuda.empty_cache()
            return None
        row = BenchRow(case=c.name, variant=variant, direction=direction, ms=ms,
                       extra=extra or {})
        self.rows.append(fill_rates(row, c.flops[direction], c.bytes[direction]))
        return row

    def record_main(self, variant: str, fwd, inputs, do, host_calls: int) -> None:
        """Eager rows (as the op is called), then the same callables' host time per call
        and their graph-replay GPU time, added to each row's extra."""
        try:
            f, b, fb = _grad_fns(fwd, inputs, do)
        except Exception as e:
            self.info["errors"][variant] = f"{type(e).__name__}: {e}"[:500]
            return
        got = {}
        for direction, fn in (("fwd", f), ("bwd", b), ("fwd+bwd", fb)):
            row = self.record(variant, direction, fn)
            if row is not None:
                try:
                    row.extra["host_us_per_call"] = round(host_us_per_call(fn, host_calls), 1)
                except Exception as e:
                    row.extra["host_us_per_call"] = f"{type(e).__name__}: {e}"[:300]
                got[direction] = row
        del f, b, fb
        torch.cuda.empty_cache()
        if got:
            self._add_graphed(variant, fwd, inputs, do, got)

    def _add_graphed(self, variant: str, fwd, inputs, do, got: dict[str, BenchRow]) -> None:
        c = self.c
        for direction, ms in graphed_ms(fwd, inputs, do, list(got)).items():
            extra = got[direction].extra
            if isinstance(ms, str):
                extra["ms_gpu"] = None
                extra["gpu_note"] = ms
                continue
            gpu = fill_rates(BenchRow(c.name, variant, direction, ms), c.flops[direction],
                             c.bytes[direction])
            extra["ms_gpu"] = ms
            extra["useful_tflops_gpu"] = gpu.useful_tflops
            extra["frac_hbm_gpu"] = gpu.frac_hbm


def run_case(c: Case, phase: str, quick: bool, rows: list[BenchRow], meta: dict,
             deadline: float, baselines: bool = True,
             checkpoint: Callable[[], object] | None = None) -> None:
    """phase 'main': correctness check, ours and both padded baselines; 'ablations': the
    schedule-order, prefetch and tile-shape variants; 'plans': only the backward plans the op
    tunes between (128-key blocks), each forced, bwd and fwd+bwd, eager and graphed.
    checkpoint (e.g. writing the JSON) runs after each main variant, so that a run cut short
    keeps what it measured."""
    from gem_kernels.gdpa.op import num_sms

    scale = 1.0 / math.sqrt(c.dim)
    sms = num_sms(c.q.device)
    if phase == "main":
        meta["cases"][c.name] = _describe_case(c, sms)
    info = meta["cases"][c.name]
    rec = _Recorder(c, rows, info, deadline)
    if phase == "main":
        _run_main(c, rec, scale, baselines, checkpoint or (lambda: None))
    elif phase == "plans":
        run_plans(c, rows, info, rec.record, scale)
    else:
        _forward_ablations(c, rec, quick, sms, scale)
        _backward_ablations(c, rec, quick, scale)


def _run_main(c: Case, rec: _Recorder, scale: float, baselines: bool,
              checkpoint: Callable[[], object]) -> None:
    """Ours (the public op, default configs) checked against the fp32 reference and timed,
    the plans its backward tuner chose, then both padded baselines and the ratios to them."""
    from gem_kernels.gdpa import gdpa
    from gem_kernels.gdpa.op import TUNER
    from gem_kernels.gdpa.reference import gdpa_padded

    rows, info = rec.rows, rec.info

    def ours(q, k, v):
        return gdpa(q, k, v, c.qo, c.ko, c.max_q, c.max_kv, activation=ACTIVATION,
                    kernel="triton")

    def padded(q, k, v):
        return gdpa_padded(q, k, v, None, activation=ACTIVATION, scale=scale)

    try:
        check_against_reference(c, ours, info)
    except Exception as e:
        info["errors"]["check"] = f"{type(e).__name__}: {e}"[:500]
    torch.cuda.empty_cache()
    rec.record_main("ours", ours, (c.q, c.k, c.v), c.do, 50)
    info["ours_host_us_per_call"] = {
        r.direction: r.extra.get("host_us_per_call") for r in rows
        if r.case == c.name and r.variant == "ours"}
    info["backward_tuning"] = [
        {"key": [str(x) for x in key], "choice": _plan_name(rec_.choice),
         "timings_ms": {_plan_name(cand): ms for cand, ms in rec_.timings}}
        for key, rec_ in TUNER.records.items()]
    checkpoint()
    if not baselines:
        return
    compiled = torch.compile(padded, dynamic=False)
    for variant, fn in (("padded_eager", padded), ("padded_compile", compiled)):
        if time.monotonic() > rec.deadline:
            info["errors"][variant] = "skipped: time budget"
            continue
        rec.record_main(variant, fn, (c.qp, c.kp, c.vp), c.dop, 10)
        torch.cuda.empty_cache()
        add_ratios(rows, "ours", "padded_compile")
        checkpoint()
    base = {r.direction: r.extra.get("ms_gpu") for r in rows
            if r.case == c.name and r.variant == "padded_compile"}
    for r in rows:
        if r.case == c.name and r.variant == "ours" and base.get(r.direction) \
                and r.extra.get("ms_gpu"):
            r.extra["ratio_to_baseline_gpu"] = base[r.direction] / r.extra["ms_gpu"]


def _forward_ablations(c: Case, rec: _Recorder, quick: bool, sms: int, scale: float) -> None:
    """The forward without the snake schedule order, and each of fwd_variants."""
    from gem_kernels.gdpa.activations import ACT_CODE
    from gem_kernels.gdpa.op import forward_schedule
    from gem_kernels.gdpa.schedule import build_schedule
    from gem_kernels.gdpa.triton_fwd import launch_fwd

    cfg = _case_configs(c)[0]
    act = ACT_CODE[ACTIVATION]
    rows_o, cols_o = (c.ko, c.qo) if cfg.kv_major else (c.qo, c.ko)
    natural = build_schedule(rows_o, cols_o, cfg.block_rows, cfg.block_cols, c.heads,
                             sms * cfg.ctas_per_sm, c.q.device, snake=False,
                             cover_empty_rows=cfg.kv_major)
    rec.record("ours_no_snake", "fwd",
               lambda: launch_fwd(c.q, c.k, c.v, natural, cfg, act, 0, scale, c.max_kv))
    for name, over in fwd_variants(c.name, quick):
        if "prefetch" in over and over["prefetch"] is None:
            over = {**over, "prefetch": not cfg.prefetch}
        vact = ACT_CODE[over.pop("activation", ACTIVATION)]
        vcfg = replace(cfg, **over)
        sched = forward_schedule(c.qo, c.ko, c.heads, vcfg, c.max_kv, c.q.device)
        rec.record(f"ours_{name}", "fwd",
                   lambda vcfg=vcfg, sched=sched, vact=vact: launch_fwd(
                       c.q, c.k, c.v, sched, vcfg, vact, 0, scale, c.max_kv),
                   {"config": vars(vcfg)})


def _backward_ablations(c: Case, rec: _Recorder, quick: bool, scale: float) -> None:
    """Each of bwd_variants forced through GDPAFunction; the short shapes' rows also carry
    their graph-replay GPU time (their eager rows are host-bound)."""
    from gem_kernels.gdpa.op import GDPAFunction

    for name, mode, ckv, cq, *vact in bwd_variants(c.name, quick, c.max_q, c.max_kv,
                                                    c.dim):
        def op(q, k, v, ckv=ckv, cq=cq, mode=mode, a=(vact or [ACTIVATION])[0]):
            return GDPAFunction.apply(q, k, v, c.qo, c.ko, c.max_q, c.max_kv, a, scale, 0,
                                      None, ckv, cq, mode)

        try:
            _, b, _ = _grad_fns(op, (c.q, c.k, c.v), c.do)
        except Exception as e:
            rec.info["errors"][f"ours_{name}"] = f"{type(e).__name__}: {e}"[:500]
            continue
        row = rec.record(f"ours_{name}", "bwd", b, {"mode": mode, "dkdv": ckv and vars(ckv),
                                                     "dq": cq and vars(cq)})
        del b
        if row is not None and c.name != "self":  # short kernels: the eager row is host-bound
            ms = graphed_ms(op, (c.q, c.k, c.v), c.do, ["bwd"])["bwd"]
            row.extra["ms_gpu"] = ms if isinstance(ms, float) else None
            if isinstance(ms, float):
                row.extra["frac_hbm_gpu"] = c.bytes["bwd"] / (ms / 1e3) / 1e12 / H200_HBM_TBS
            else:
                row.extra["gpu_note"] = ms


def print_gpu_table(rows: list[BenchRow]) -> None:
    """Eager vs graph-replay columns of every row that has both (see the module docstring)."""
    def f(x, nd=3):
        return "-" if not isinstance(x, float) else f"{x:.{nd}f}"

    print("\neager (as called) vs GPU (CUDA graph replay of the same callable); host us per "
          "call")
    print(f"{'case':7}{'variant':26}{'dir':9}{'ms':>8}{'ms_gpu':>8}{'host_us':>9}"
          f"{'TF/s':>8}{'TF/s_gpu':>9}{'hbm':>7}{'hbm_gpu':>8}{'x_base':>8}{'x_base_gpu':>11}")
    for r in rows:
        e = r.extra
        if "ms_gpu" not in e and "gpu_note" not in e:
            continue
        host = e.get("host_us_per_call")
        print(f"{r.case:7}{r.variant:26}{r.direction:9}{f(r.ms):>8}{f(e.get('ms_gpu')):>8}"
              f"{f(host, 1) if isinstance(host, float) else '-':>9}"
              f"{f(r.useful_tflops, 1):>8}{f(e.get('useful_tflops_gpu'), 1):>9}"
              f"{f(r.frac_hbm):>7}{f(e.get('frac_hbm_gpu')):>8}"
              f"{f(r.ratio_to_baseline, 2):>8}{f(e.get('ratio_to_baseline_gpu'), 2):>11}"
              + (f"  {e['gpu_note'][:60]}" if e.get("gpu_note") else ""))


# --- tuning: many configs timed in one GPU run ---------------------------------------------

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

    _tune_cross_backward(cases["cross"], emit)
    _tune_self_forward(cases["self"], timed)
    _tune_self_backward(cases["self"], timed, emit)


def _tune_cross_backward(c: Case, emit) -> None:
    """The cross backward kernel's tiles: graph-replayed GPU time and launcher host time."""
    from gem_kernels.gdpa.activations import ACT_CODE
    from gem_kernels.gdpa.op import schedule_for
    from gem_kernels.gdpa.triton_bwd import launch_bwd_short_kv_stream, short_kv_stream_config

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
            gpu = graph_replay_ms(launch, warmup_calls=1)
            row = fill_rates(BenchRow(c.name, name, "bwd", gpu), c.flops["bwd"],
                             c.bytes["bwd"])
            emit({"case": c.name, "what": f"bwd_kernel_graphed_{name}", "direction": "bwd",
                  "ms": gpu, "frac_hbm": row.frac_hbm, "launcher_host_us":
                  host_us_per_call(launch)})
        except Exception as e:
            emit({"case": c.name, "what": f"bwd_kernel_graphed_{name}",
                  "error": f"{type(e).__name__}: {e}"[:400]})


def _tune_self_forward(c: Case, timed) -> None:
    """Forward tile configs of the self case, each with the activations listed."""
    from gem_kernels.gdpa.activations import ACT_CODE
    from gem_kernels.gdpa.op import forward_schedule
    from gem_kernels.gdpa.triton_common import TileConfig as T
    from gem_kernels.gdpa.triton_fwd import launch_fwd

    scale = 1.0 / math.sqrt(c.dim)
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


def _tune_self_backward(c: Case, timed, emit) -> None:
    """Backward modes and tiles of the self case, each forced through GDPAFunction."""
    from gem_kernels.gdpa.op import GDPAFunction
    from gem_kernels.gdpa.triton_common import TileConfig as T

    scale = 1.0 / math.sqrt(c.dim)
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


def run_plans(c: Case, rows: list[BenchRow], info: dict, record, scale: float) -> None:
    """Rows ours_plan_<plan>: the long-KV backward plans the op times on its first call
    (gdpa.op.one_pass_candidates), each forced, so that the chosen one and the others
    compare in one run on bwd and fwd+bwd, eager and as graph replays."""
    from gem_kernels.gdpa.op import GDPAFunction, backward_mode, one_pass_candidates

    if backward_mode(c.max_q, c.max_kv) != "one_pass":
        return
    plans = one_pass_candidates(c.max_q, c.max_kv, c.dim)
    for mode, cfg in plans:
        name = f"ours_plan_{_plan_name((mode, cfg))}"

        def op(q, k, v, cfg=cfg, mode=mode):
            return GDPAFunction.apply(q, k, v, c.qo, c.ko, c.max_q, c.max_kv, ACTIVATION,
                                      scale, 0, None, cfg, None, mode)

        try:
            _, b, fb = _grad_fns(op, (c.q, c.k, c.v), c.do)
        except Exception as e:
            info["errors"][name] = f"{type(e).__name__}: {e}"[:500]
            continue
        got = {d: record(name, d, fn, {"mode": mode, "dkdv": vars(cfg)})
               for d, fn in (("bwd", b), ("fwd+bwd", fb))}
        del b, fb
        torch.cuda.empty_cache()
        done = [d for d, r in got.items() if r is not None]
        if not done:
            continue
        for d, ms in graphed_ms(op, (c.q, c.k, c.v), c.do, done).items():
            extra = got[d].extra
            if isinstance(ms, str):
                extra["ms_gpu"], extra["gpu_note"] = None, ms
                continue
            gpu = fill_rates(BenchRow(c.name, name, d, ms), c.flops[d], c.bytes[d])
            extra["ms_gpu"], extra["useful_tflops_gpu"] = ms, gpu.useful_tflops


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
    ap.add_argument("--ablations", choices=("all", "plans", "none"), default="all",
                    help="after the main rows: every ablation, only the backward plans the "
                         "op tunes between (forced, bwd and fwd+bwd), or none")
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
    phases = {"all": ("main", "ablations"), "plans": ("main", "plans"),
              "none": ("main",)}[args.ablations]
    for phase in phases:
        for c in cases:
            run_case(c, phase, args.quick, rows, meta, deadline, not args.no_baselines,
                     lambda: write_json(rows, out, meta))
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
    print_gpu_table(rows)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
