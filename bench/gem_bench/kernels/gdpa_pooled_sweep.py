"""GDPA pooled-attention backward plans over a grid of shapes: every plan that takes a short Q
(short_q, short_q_stream, two_kernel) timed on the same inputs, eager and graph-replayed,
with a bitwise repeatability check, against the plan the op picks by default.

    PYTHONPATH=kernels:platform:bench python -m gem_bench.kernels.gdpa_pooled_sweep --out $OUT
    python -m gem_bench.kernels.deterministic --pooled-sweep --out $OUT   (same PYTHONPATH)

Writes gdpa_pooled_sweep.json. Rows: case "B{batch}_Q{q}_H{heads}_d{dim}", variant the plan,
direction "bwd", ms (eager, host launch included); extra: ms_gpu (graph-replayed GPU time),
bitwise_repeatable (two backwards equal), default (the op's plan for the shape), balance
(gem_kernels.gdpa.op.stream_balance) and the shape. Grid: batch {64, 256, 1024}, Q rows per
sample {1, 4, 16, 64}, heads {4, 8}, head_dim {128, 64}; bf16, gelu_tanh, K/V lengths
log-normal with mean 400 clipped to [16, 2048]. Timing is kept short (--warmup-ms, --rep-ms)
and the run stops starting new shapes after --budget-s (the JSON lists the ones skipped).
"""

from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gem_bench.kernels.common import BenchRow, graph_replay_ms, write_json
from gem_kernels.testing import lognormal_lengths, offsets_from_lengths

PLANS = ("short_q", "short_q_stream", "two_kernel")
BATCHES = (64, 256, 1024)
Q_ROWS = (1, 4, 16, 64)
HEADS = (4, 8)
DIMS = (128, 64)  # 128 first (deterministic.json's head dim): timed before any budget cut
KV_MEAN, KV_MIN, KV_MAX = 400, 16, 2048


@dataclass(frozen=True)
class Shape:
    """One pooled-attention shape: batch samples of q_rows queries against jagged K/V."""

    batch: int
    q_rows: int
    heads: int
    dim: int

    @property
    def name(self) -> str:
        return f"B{self.batch}_Q{self.q_rows}_H{self.heads}_d{self.dim}"


def grid() -> list[Shape]:
    """The sweep's shapes, grouped so that one K/V allocation serves all Q row counts."""
    return [Shape(b, q, h, d) for d, h, b, q in itertools.product(DIMS, HEADS, BATCHES, Q_ROWS)]


def kv_lengths(batch: int) -> list[int]:
    """K/V lengths of a batch (the same for every shape of that batch size)."""
    return lognormal_lengths(batch, KV_MEAN, KV_MAX, min_len=KV_MIN, seed=batch)


def summary(rows: list[BenchRow]) -> list[dict]:
    """Per shape: the default plan, the fastest plan by GPU time (eager time when no GPU time
    was taken) and the default's time over the fastest's (1.0: the default is the fastest)."""
    by_case: dict[str, list[BenchRow]] = {}
    for r in rows:
        by_case.setdefault(r.case, []).append(r)
    out = []
    for case, rs in by_case.items():
        def key(r: BenchRow) -> float:
            return r.extra.get("ms_gpu") or r.ms

        best = min(rs, key=key)
        default = next((r for r in rs if r.variant == r.extra["default"]), None)
        out.append({"case": case, "default": rs[0].extra["default"], "fastest": best.variant,
                    "default_over_fastest": key(default) / key(best) if default else None,
                    "balance": rs[0].extra["balance"]})
    return out


def measure_shape(shape: Shape, k: torch.Tensor, v: torch.Tensor, kv_offsets: torch.Tensor,
                  max_kv: int, warmup_ms: float, rep_ms: float) -> list[BenchRow]:
    """One row per plan on the same bf16 inputs (k, v: the batch's K/V for these heads/dim)."""
    import triton.testing

    from gem_kernels.gdpa.op import GDPAFunction, backward_mode, num_sms, stream_balance

    g = torch.Generator(device="cuda").manual_seed(shape.q_rows)
    rows_q = shape.batch * shape.q_rows
    q = torch.randn(rows_q, shape.heads, shape.dim, device="cuda", dtype=torch.bfloat16,
                    generator=g)
    do = torch.randn_like(q)
    q_offsets = offsets_from_lengths([shape.q_rows] * shape.batch, "cuda")
    sms = num_sms(q.device)
    total_kv = int(k.shape[0])
    default = str(backward_mode(shape.q_rows, max_kv, q.dtype, batch=shape.batch,
                                heads=shape.heads, total_kv=total_kv, sms=sms))
    balance = stream_balance(shape.batch, shape.heads, total_kv, max_kv, sms)
    out_rows = []
    for plan in PLANS:
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]

        def forward(leaves=leaves, plan=plan):  # noqa: ANN001, ANN202
            return GDPAFunction.apply(*leaves, q_offsets, kv_offsets, shape.q_rows, max_kv,
                                      "gelu_tanh", shape.dim ** -0.5, 0, None, None, None,
                                      plan, False)

        out = forward()
        first = torch.autograd.grad(out, leaves, do, retain_graph=True)
        again = torch.autograd.grad(out, leaves, do, retain_graph=True)
        repeatable = all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
        del first, again
        ms = float(triton.testing.do_bench(
            lambda out=out, leaves=leaves: torch.autograd.grad(out, leaves, do,
                                                               retain_graph=True),
            warmup=warmup_ms, rep=rep_ms, return_mode="median"))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out_g = forward()
        extra: dict = {}
        try:
            extra["ms_gpu"] = graph_replay_ms(
                lambda out_g=out_g, leaves=leaves: torch.autograd.grad(out_g, leaves, do,
                                                                       retain_graph=True),
                stream, warmup_calls=2, rep_ms=rep_ms, warmup_ms=warmup_ms)
        except Exception as e:  # reported in the row instead of a time
            extra["ms_gpu"] = None
            extra["gpu_note"] = f"not captured: {type(e).__name__}: {e}"[:300]
        extra.update(bitwise_repeatable=repeatable, default=default, balance=balance,
                     batch=shape.batch, q_rows=shape.q_rows, heads=shape.heads,
                     head_dim=shape.dim, total_kv=total_kv, max_kv=max_kv, sms=sms)
        out_rows.append(BenchRow(case=shape.name, variant=plan, direction="bwd", ms=ms,
                                 extra=extra))
        del out, out_g, leaves
    return out_rows


def print_sweep(rows: list[BenchRow]) -> None:
    """One line per shape: each plan's eager / GPU ms and repeatability, the default and the
    fastest plan by GPU time."""
    plans = "  ".join(f"{p + ' ms (gpu) rep':>30s}" for p in PLANS)
    print(f"\n{'case':20s} {plans}  {'balance':>7s}  {'default':14s}  {'fastest':14s}  "
          f"default/fastest")
    cells: dict[str, dict[str, BenchRow]] = {}
    for r in rows:
        cells.setdefault(r.case, {})[r.variant] = r
    for s in summary(rows):
        line = []
        for p in PLANS:
            r = cells[s["case"]].get(p)
            if r is None:
                line.append(f"{'-':>30s}")
                continue
            gpu = "-" if r.extra.get("ms_gpu") is None else f"{r.extra['ms_gpu']:.3f}"
            rep = "yes" if r.extra["bitwise_repeatable"] else "no"
            line.append(f"{r.ms:8.3f} ({gpu:>6s}) {rep:>3s}".rjust(30))
        ratio = s["default_over_fastest"]
        print(f"{s['case']:20s} {'  '.join(line)}  {s['balance']:7.2f}  {s['default']:14s}  "
              f"{s['fastest']:14s}  {'-' if ratio is None else f'{ratio:.2f}'}")


def run(out_dir: str | Path, budget_s: float = 80.0, warmup_ms: float = 5.0,
        rep_ms: float = 20.0) -> Path:
    """Times the grid on the current CUDA device and writes gdpa_pooled_sweep.json."""
    if not torch.cuda.is_available():
        raise SystemExit("the pooled-attention sweep needs a CUDA GPU")
    if budget_s <= 0 or warmup_ms <= 0 or rep_ms <= 0:
        raise SystemExit(f"--budget-s, --warmup-ms and --rep-ms must be positive; got "
                         f"{budget_s}, {warmup_ms}, {rep_ms}")
    path = Path(out_dir) / "gdpa_pooled_sweep.json"
    meta = {"plans": list(PLANS), "dtype": "bf16", "activation": "gelu_tanh",
            "kv_lengths": f"log-normal mean {KV_MEAN}, sigma 1, clipped to [{KV_MIN}, "
                          f"{KV_MAX}], seed = batch",
            "warmup_ms": warmup_ms, "rep_ms": rep_ms, "budget_s": budget_s, "skipped": []}
    rows: list[BenchRow] = []
    t0 = time.monotonic()
    kv_key, kv = None, None
    for shape in grid():
        if time.monotonic() - t0 > budget_s:
            meta["skipped"].append(shape.name)
            continue
        if kv_key != (shape.batch, shape.heads, shape.dim):
            kv = k = v = None  # free the previous batch's K/V before allocating this one's
            torch.cuda.empty_cache()
            lengths = kv_lengths(shape.batch)
            g = torch.Generator(device="cuda").manual_seed(shape.batch)
            k, v = (torch.randn(sum(lengths), shape.heads, shape.dim, device="cuda",
                                dtype=torch.bfloat16, generator=g) for _ in range(2))
            kv = (k, v, offsets_from_lengths(lengths, "cuda"), max(lengths))
            kv_key = (shape.batch, shape.heads, shape.dim)
        rows += measure_shape(shape, *kv, warmup_ms=warmup_ms, rep_ms=rep_ms)
        meta["summary"] = summary(rows)
        write_json(rows, path, meta)
        print(f"{shape.name}: " + ", ".join(
            f"{r.variant} {r.ms:.3f}/{r.extra['ms_gpu'] or float('nan'):.3f}"
            for r in rows[-len(PLANS):]) + f" [{time.monotonic() - t0:.0f} s]", flush=True)
    meta["summary"] = summary(rows)
    meta["elapsed_s"] = time.monotonic() - t0
    write_json(rows, path, meta)
    print_sweep(rows)
    if meta["skipped"]:
        print(f"\nbudget of {budget_s:.0f} s spent; skipped {len(meta['skipped'])} shapes: "
              f"{meta['skipped']}")
    print(f"\nwrote {path}")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench-out", help="directory for gdpa_pooled_sweep.json")
    ap.add_argument("--budget-s", type=float, default=80.0,
                    help="start no new shape after this many seconds")
    ap.add_argument("--warmup-ms", type=float, default=5.0, help="do_bench warmup per plan")
    ap.add_argument("--rep-ms", type=float, default=20.0, help="do_bench repetitions per plan")
    args = ap.parse_args(argv)
    run(args.out, args.budget_s, args.warmup_ms, args.rep_ms)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
