"""Deterministic vs fast backward of every attention op with a backward: time of the backward
alone (eager and graph-replayed GPU time) in both modes on the same inputs, whether repeated
backwards are bitwise identical, and how far the deterministic gradients are from the fast
ones.

    PYTHONPATH=kernels:platform:bench python -m gem_bench.kernels.deterministic --out $OUT [--quick]
    python -m gem_bench.kernels.deterministic --pooled-sweep --out $OUT   (same PYTHONPATH)

--pooled-sweep runs gem_bench.kernels.gdpa_pooled_sweep instead (every short-Q GDPA
backward plan over a grid of pooled shapes; gdpa_pooled_sweep.json).

Writes deterministic.json. Rows: case (gdpa_self, gdpa_cross, gdpa_pooled, jfa_causal,
jfa_sliding, block64_rope; gdpa_pooled_two_kernel: pooled with the two-kernel plan forced as
its deterministic row), variant "fast" (deterministic=False) or "deterministic"
(deterministic=True), direction "bwd". ratio_to_baseline on a deterministic row is fast ms /
deterministic ms (below 1: the deterministic backward is slower). extra: ms_gpu, the backward
plan, bitwise_repeatable over --repeats backwards, max_abs_diff_vs_fast. Inputs: bf16, head
dim 128, log-normal lengths (mean 470, max 2048) as in gem_bench.kernels.gdpa, and a
power-law batch for the jagged attention ops.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch

from gem_bench.kernels.common import (
    BenchRow,
    add_ratios,
    graph_replay_ms,
    print_table,
    time_ms,
    write_json,
)
from gem_bench.kernels.gdpa import case_lengths
from gem_kernels.testing import offsets_from_lengths, powerlaw_lengths

Op = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]


def _randn(rows: int, heads: int, dim: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(rows, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)


def cases(batch: int, heads: int, dim: int) -> dict[str, tuple[Op, tuple[torch.Tensor, ...]]]:
    """name -> (op(q, k, v, deterministic), (q, k, v, do)) on CUDA bf16 inputs."""
    from gem_kernels.block_attention import RopeConfig, block_attention
    from gem_kernels.gdpa import gdpa
    from gem_kernels.gdpa.op import GDPAFunction
    from gem_kernels.jagged_attention import jagged_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    out: dict[str, tuple[Op, tuple[torch.Tensor, ...]]] = {}
    for name in ("self", "cross", "pooled"):
        ql, kl = case_lengths(name, batch)
        qo, ko = offsets_from_lengths(ql, "cuda"), offsets_from_lengths(kl, "cuda")
        mq, mk = max(ql), max(kl)

        def op(q, k, v, det, qo=qo, ko=ko, mq=mq, mk=mk):  # noqa: ANN001, ANN202
            return gdpa(q, k, v, qo, ko, mq, mk, activation="gelu_tanh", kernel="triton",
                        deterministic=det)

        tensors = (_randn(sum(ql), heads, dim, g), _randn(sum(kl), heads, dim, g),
                   _randn(sum(kl), heads, dim, g), _randn(sum(ql), heads, dim, g))
        out[f"gdpa_{name}"] = (op, tensors)
        if name == "pooled":  # the deterministic plan it replaces, forced
            def op2(q, k, v, det, qo=qo, ko=ko, mq=mq, mk=mk, fast=op):  # noqa: ANN001, ANN202
                if not det:
                    return fast(q, k, v, det)
                return GDPAFunction.apply(q, k, v, qo, ko, mq, mk, "gelu_tanh", dim ** -0.5,
                                          0, None, None, None, "two_kernel", True)

            out["gdpa_pooled_two_kernel"] = (op2, tensors)
    lengths = powerlaw_lengths(batch // 4, alpha=1.2, max_len=2048, min_len=32)
    offs = offsets_from_lengths(lengths, "cuda")
    total, max_len = sum(lengths), max(lengths)
    seq = tuple(_randn(total, heads, dim, g) for _ in range(4))
    out["jfa_causal"] = (lambda q, k, v, det: jagged_attention(
        q, k, v, offs, max_len, causal=True, kernel="triton", deterministic=det), seq)
    out["jfa_sliding"] = (lambda q, k, v, det: jagged_attention(
        q, k, v, offs, max_len, causal=True, window=(256, 0), kernel="triton",
        deterministic=det), seq)
    out["block64_rope"] = (lambda q, k, v, det: block_attention(
        q, k, v, offs, block=64, rope=RopeConfig(), kernel="triton", deterministic=det), seq)
    return out


def _plan(out: torch.Tensor) -> str:
    """The GDPA backward plan an output's node will run, or 'single plan' for the other ops."""
    mode = getattr(out.grad_fn, "mode", None)
    return str(mode) if mode is not None else "single plan"


def measure(name: str, op: Op, tensors: tuple[torch.Tensor, ...], det: bool, repeats: int,
            ref: tuple[torch.Tensor, ...] | None) -> tuple[BenchRow, tuple[torch.Tensor, ...]]:
    """One mode's row: backward ms (eager and graphed), repeatability and distance to ref."""
    q, k, v, do = tensors
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out = op(*leaves, det)

    def bwd() -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(out, leaves, do, retain_graph=True)

    first = tuple(x.clone() for x in bwd())
    repeatable = all(all(torch.equal(a, b) for a, b in zip(first, bwd(), strict=True))
                     for _ in range(repeats - 1))
    ms = time_ms(bwd)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out_g = op(*leaves, det)
    try:
        ms_gpu: float | None = graph_replay_ms(
            lambda: torch.autograd.grad(out_g, leaves, do, retain_graph=True), stream)
        note = None
    except Exception as e:  # reported in the row instead of a time
        ms_gpu, note = None, f"not captured: {type(e).__name__}: {e}"[:300]
    extra: dict = {"ms_gpu": ms_gpu, "plan": _plan(out), "repeats": repeats,
                   "bitwise_repeatable": repeatable}
    if note:
        extra["gpu_note"] = note
    if ref is not None:
        extra["max_abs_diff_vs_fast"] = max(float((a.float() - b.float()).abs().max())
                                            for a, b in zip(first, ref, strict=True))
    variant = "deterministic" if det else "fast"
    return BenchRow(case=name, variant=variant, direction="bwd", ms=ms, extra=extra), first


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench-out", help="directory for deterministic.json")
    ap.add_argument("--quick", action="store_true", help="batch 64 instead of 256")
    ap.add_argument("--repeats", type=int, default=5, help="backwards compared bitwise")
    ap.add_argument("--cases", default=None, help="comma-separated subset of the case names")
    ap.add_argument("--pooled-sweep", action="store_true",
                    help="instead: every short-Q GDPA backward plan over a grid of pooled "
                         "shapes (gem_bench.kernels.gdpa_pooled_sweep)")
    ap.add_argument("--budget-s", type=float, default=80.0,
                    help="--pooled-sweep: start no new shape after this many seconds")
    args = ap.parse_args(argv)
    if args.pooled_sweep:
        from gem_bench.kernels.gdpa_pooled_sweep import run

        run(args.out, budget_s=args.budget_s)
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("the deterministic-backward benchmark needs a CUDA GPU")
    if args.repeats < 2:
        raise SystemExit(f"--repeats must be at least 2 to compare backwards; got {args.repeats}")
    batch, heads, dim = (64 if args.quick else 256), 4, 128
    all_cases = cases(batch, heads, dim)
    names = args.cases.split(",") if args.cases else list(all_cases)
    unknown = sorted(set(names) - set(all_cases))
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; choose from {sorted(all_cases)}")
    rows: list[BenchRow] = []
    meta = {"batch": batch, "heads": heads, "head_dim": dim, "dtype": "bf16",
            "gdpa_lengths": "log-normal mean 470, sigma 1, clipped to [1, 2048] (long side)",
            "jagged_lengths": "power-law alpha 1.2 in [32, 2048], batch/4 sequences",
            "repeats": args.repeats}
    out = Path(args.out) / "deterministic.json"
    t0 = time.monotonic()
    for name in names:
        op, tensors = all_cases[name]
        fast, grads = measure(name, op, tensors, False, args.repeats, None)
        det, _ = measure(name, op, tensors, True, args.repeats, grads)
        rows += [fast, det]
        torch.cuda.empty_cache()
        add_ratios(rows, "deterministic", "fast")
        write_json(rows, out, meta)
        print(f"{name}: fast {fast.ms:.3f} ms ({fast.extra['plan']}), deterministic "
              f"{det.ms:.3f} ms ({det.extra['plan']}), repeatable "
              f"{fast.extra['bitwise_repeatable']}/{det.extra['bitwise_repeatable']} "
              f"[{time.monotonic() - t0:.0f} s]", flush=True)
    print_table(rows, f"backward, fast vs deterministic (B={batch}, H={heads}, d={dim}, bf16)")
    print(f"\nwrote {out}")
    failed = [r.case for r in rows
              if r.variant == "deterministic" and not r.extra["bitwise_repeatable"]]
    if failed:
        print(f"NOT bitwise repeatable in deterministic mode: {failed}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
