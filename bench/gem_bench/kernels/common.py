"""Timing, ceilings, tables and JSON output shared by every kernel benchmark."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from gem_platform.provenance import environment

# Ceilings measured on the H200 we benchmark on (bf16 dense matmul, FP8 tensorwise
# torch._scaled_mm, device-to-device copy counting read + write bytes).
H200_BF16_TFLOPS = 786.0
H200_FP8_TFLOPS = 1436.0
H200_HBM_TBS = 4.27


@dataclass
class BenchRow:
    """One measured variant on one input set."""

    case: str
    variant: str
    direction: str  # "fwd", "bwd" or "fwd+bwd"
    ms: float
    useful_tflops: float | None = None
    frac_bf16_peak: float | None = None
    hbm_tbs: float | None = None
    frac_hbm: float | None = None
    ratio_to_baseline: float | None = None
    baseline: str | None = None
    extra: dict = field(default_factory=dict)


def time_ms(fn: Callable[[], object], warmup_ms: float = 50, rep_ms: float = 300) -> float:
    """Median milliseconds per call of fn, timed with CUDA events by triton.testing.do_bench."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def graph_replay_ms(fn: Callable[[], object], stream: torch.cuda.Stream | None = None,
                    warmup_calls: int = 3, rep_ms: float = 300, warmup_ms: float = 50) -> float:
    """Median ms of fn replayed from one CUDA graph: its GPU time without the host's launch
    cost. fn is warmed up on the capture stream first (lazy initialization, allocator pools
    and autotuning happen outside the capture); pass ``stream`` when fn must run where an
    autograd graph it differentiates was recorded."""
    stream = stream or torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup_calls):
            fn()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    torch.cuda.synchronize()
    return time_ms(graph.replay, warmup_ms=warmup_ms, rep_ms=rep_ms)


def host_us_per_call(fn: Callable[[], object], n: int = 50) -> float:
    """Host time to issue one call, measured while the GPU is kept busy (so launches never
    wait on it): the floor under which the call's GPU time can no longer hide its host work."""
    import time

    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time ahead of the calls
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return host


def fill_rates(row: BenchRow, flops: float | None = None, bytes_moved: float | None = None,
               peak_tflops: float = H200_BF16_TFLOPS) -> BenchRow:
    """Fill useful TFLOP/s and HBM TB/s (and their fractions of the ceilings) from counts."""
    secs = row.ms / 1e3
    if flops is not None:
        row.useful_tflops = flops / secs / 1e12
        row.frac_bf16_peak = row.useful_tflops / peak_tflops
    if bytes_moved is not None:
        row.hbm_tbs = bytes_moved / secs / 1e12
        row.frac_hbm = row.hbm_tbs / H200_HBM_TBS
    return row


def add_ratios(rows: list[BenchRow], ours: str, baseline: str) -> None:
    """ratio_to_baseline = baseline time / our time, per (case, direction)."""
    base = {(r.case, r.direction): r.ms for r in rows if r.variant == baseline}
    for r in rows:
        if r.variant == ours and (r.case, r.direction) in base:
            r.ratio_to_baseline = base[(r.case, r.direction)] / r.ms
            r.baseline = baseline


def print_table(rows: list[BenchRow], title: str) -> None:
    """Plain fixed-width table (rich is not guaranteed on the GPU machine)."""
    cols = ["case", "variant", "direction", "ms", "useful_tflops", "frac_bf16_peak", "hbm_tbs",
            "frac_hbm", "ratio_to_baseline"]

    def fmt(v: object) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
        return str(v)

    data = [[fmt(getattr(r, c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(d[i]) for d in data)) if data else len(c)
              for i, c in enumerate(cols)]
    print(f"\n{title}")
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
    for d in data:
        print("  ".join(x.ljust(w) for x, w in zip(d, widths, strict=True)))


def write_json(rows: list[BenchRow], path: str | Path, meta: dict | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"device": environment(), "meta": meta or {}, "rows": [asdict(r) for r in rows]}
    path.write_text(json.dumps(payload, indent=2))
    return path
