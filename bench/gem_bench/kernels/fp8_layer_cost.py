"""Benchmark: what one FP8 linear layer costs per training call at a recipe's narrow shapes.

A layer is trained once per call (forward, then backward for the input and the weight), with
a bias, under bf16 autocast, as the models use it. Per shape (tokens x in -> out), same run:
- ``bf16``: nn.Linear (cuBLAS addmm, bias in the epilogue), the baseline;
- ``fp8_b128`` / ``fp8_b32``: Fp8BlockLinear on the same parameters.

Columns: ``ms`` the call's wall time with both host and GPU working as in training (the
larger of the two wins); ``extra.gpu_us`` the same call replayed from a CUDA graph (GPU time
alone); ``extra.host_us`` the time the host needs to issue the call (the GPU kept busy, so
no launch waits on it); ``extra.kernels`` the kernels (and memsets and copies) it launches;
``extra.host_top`` the Python functions where the host time goes (cProfile, own time per
call). When ``host_us`` exceeds ``gpu_us`` the
layer is launch-bound: narrow layers gain nothing from a faster GEMM until they launch less.

Command for docs/bench/fp8_layer_cost.json (on the H200):
    gemctl bench fp8-cost --out docs/bench
or where gemctl is not installed:
    PYTHONPATH=kernels:platform:bench python -m gem_bench.kernels.fp8_layer_cost --out docs/bench
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import traceback
from collections.abc import Callable

import torch

from gem_bench.kernels.common import (
    H200_BF16_TFLOPS,
    BenchRow,
    add_ratios,
    fill_rates,
    graph_replay_ms,
    host_us_per_call,
    print_table,
    time_ms,
    write_json,
)

# The H200 recipe's layers (d_model 256, FFN and expert hidden 1024, ~260K tokens a step in the
# sequence layers, 8K pooled queries), and one wide layer where FP8 pays (hidden 2048).
CASES = [  # (tokens, in_features, out_features)
    (262144, 256, 768),
    (262144, 256, 1024),
    (262144, 1024, 256),
    (8192, 256, 256),
    (8192, 1024, 256),
    (65536, 2048, 2048),
]
QUICK = [(262144, 256, 1024), (8192, 256, 256)]
VARIANTS = ("bf16", "fp8_b128", "fp8_b32")


def _layer(variant: str, lin: torch.nn.Linear) -> torch.nn.Module:
    if variant == "bf16":
        return lin
    from gem_kernels.fp8 import Fp8BlockLinear, Fp8Config

    return Fp8BlockLinear.from_linear(lin, Fp8Config(block=int(variant.removeprefix("fp8_b"))))


def _train_call(layer: torch.nn.Module, x: torch.Tensor, gy: torch.Tensor
                ) -> Callable[[], object]:
    params = list(layer.parameters())

    def call() -> object:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        return torch.autograd.grad(y, [x, *params], gy)

    return call


def kernels_per_call(fn: Callable[[], object]) -> int:
    """Device launches of one call (kernels, memsets, copies), counted by the profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA)


def host_top(fn: Callable[[], object], calls: int = 50, top: int = 12) -> list[dict]:
    """The functions with the most own host time per call (cProfile), costliest first."""
    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (cc, nc, tottime, cumtime, ...)}
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [{"function": f"{file.rsplit('/', 2)[-1] if '/' in file else file}:{line}:{name}",
             "own_us_per_call": round(v[2] / calls * 1e6, 2),
             "calls_per_call": round(v[1] / calls, 2)}
            for (file, line, name), v in rows]


def _case_rows(m: int, k: int, n: int, rep_ms: float, errors: dict) -> list[BenchRow]:
    case = f"{m}x{k}->{n}"
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    lin = torch.nn.Linear(k, n, device="cuda")  # fp32 master weights and bias, as trained
    flops = 6.0 * m * k * n
    rows = []
    for variant in VARIANTS:
        try:
            fn = _train_call(_layer(variant, lin), x, gy)
            ms = time_ms(fn, warmup_ms=25, rep_ms=rep_ms)
            extra = {"gpu_us": round(graph_replay_ms(fn, rep_ms=rep_ms) * 1e3, 1),
                     "host_us": round(host_us_per_call(fn), 1), "kernels": kernels_per_call(fn),
                     "host_top": host_top(fn)}
        except Exception as e:  # a variant that cannot run here is reported, not fatal
            errors[f"{case}/{variant}"] = f"{type(e).__name__}: {e}"[:400]
            traceback.print_exc()
            continue
        extra["launch_bound"] = extra["host_us"] > extra["gpu_us"]
        rows.append(fill_rates(BenchRow(case, variant, "fwd+bwd", ms, extra=extra), flops,
                               peak_tflops=H200_BF16_TFLOPS))
    return rows


def main(argv: list[str] | None = None) -> list[BenchRow]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=".", help="directory for fp8_layer_cost.json")
    p.add_argument("--quick", action="store_true", help="two shapes, short timing")
    p.add_argument("--name", default="fp8_layer_cost", help="JSON file name (no suffix)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the FP8 layer cost benchmark needs a CUDA GPU (H200)")
    cases = QUICK if args.quick else CASES
    rep = 50 if args.quick else 200
    rows: list[BenchRow] = []
    errors: dict[str, str] = {}
    meta = {"cases": cases, "errors": errors,
            "note": "ratio_to_baseline = bf16 ms / this ms for the whole training call; "
                    "useful_tflops counts 6*M*K*N (forward, input and weight gradients)"}
    for m, k, n in cases:
        rows += _case_rows(m, k, n, rep, errors)
        torch.cuda.empty_cache()
        for ours in VARIANTS[1:]:
            add_ratios(rows, ours, "bf16")
        path = write_json(rows, f"{args.out}/{args.name}.json", meta)
    print_table(rows, "FP8 linear layer, one training call, on " + torch.cuda.get_device_name())
    print(f"\n{'case':<20} {'variant':<9} {'host_us':>8} {'gpu_us':>8} {'kernels':>7}")
    for r in rows:
        print(f"{r.case:<20} {r.variant:<9} {r.extra['host_us']:>8} {r.extra['gpu_us']:>8} "
              f"{r.extra['kernels']:>7}")
    if errors:
        print("errors:", errors)
    print("wrote", path)
    return rows


if __name__ == "__main__":
    main()
