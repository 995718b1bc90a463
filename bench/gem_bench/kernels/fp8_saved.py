"""Benchmark: FP8 saved activations' format (1x128 blocks of a flat tensor), Triton vs the eager
PyTorch chain it replaced, per length.

Variants, per direction:
- ``eager``: the reference (``quantize_blocks_reference`` / ``dequantize_blocks_reference``):
  padded copy, abs, amax, where, div, clamp, cast; widen, multiply, cast.
- ``triton``: ``quantize_blocks`` / ``dequantize_blocks`` (one read, one write per element).
- ``dequant_into``: the dequantizer writing into a preallocated tensor (what
  ``Fp8Tensor.dequantize`` does for a dense saved tensor).
HBM bytes: quantize 2 + 1 per element + 4 per block; dequantize 1 + 2 per element + 4 per
block; fraction of the H200's 4.27 TB/s. The eager chain is charged the same (useful) bytes.

Command (on the H200):
    PYTHONPATH=kernels:platform:bench python -m gem_bench.kernels.fp8_saved --out $OUT
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from gem_bench.kernels.common import (
    BenchRow,
    add_ratios,
    fill_rates,
    print_table,
    time_ms,
    write_json,
)
from gem_kernels.fp8.blockwise import (
    dequantize_blocks,
    dequantize_blocks_reference,
    quantize_blocks,
    quantize_blocks_reference,
)

LENGTHS = [2**24, 2**27 + 77, 2**30 + 5, 3 * 2**30]  # up to a 6 GB bf16 activation
QUICK = [2**24, 2**28 + 77]


def _rows(n: int, rep_ms: float) -> list[BenchRow]:
    """Both directions, all variants, for one bf16 length (same input for every variant)."""
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    data, scale = quantize_blocks(x)
    out = torch.empty_like(x)
    nb = scale.numel()
    variants: list[tuple[str, str, Callable[[], object], float]] = [
        ("fwd", "eager", lambda: quantize_blocks_reference(x), 3 * n + 4 * nb),
        ("fwd", "triton", lambda: quantize_blocks(x), 3 * n + 4 * nb),
        ("bwd", "eager", lambda: dequantize_blocks_reference(data, scale, n, x.dtype),
         3 * n + 4 * nb),
        ("bwd", "triton", lambda: dequantize_blocks(data, scale, n, x.dtype), 3 * n + 4 * nb),
        ("bwd", "dequant_into",
         lambda: dequantize_blocks(data, scale, n, x.dtype, out=out), 3 * n + 4 * nb),
    ]
    rows = []
    for direction, name, fn, nbytes in variants:
        row = BenchRow(case=f"n={n}", variant=name, direction=direction,
                       ms=time_ms(fn, rep_ms=rep_ms))
        rows.append(fill_rates(row, bytes_moved=nbytes))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench-out", help="directory for fp8_saved.json")
    ap.add_argument("--quick", action="store_true", help="two lengths")
    ap.add_argument("--rep-ms", type=float, default=300)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fp8_saved: needs a CUDA GPU")
    rows: list[BenchRow] = []
    for n in QUICK if args.quick else LENGTHS:
        rows += _rows(n, args.rep_ms)
        torch.cuda.empty_cache()
    add_ratios(rows, "triton", "eager")
    print_table(rows, "FP8 saved activations: 1x128 blocks, bf16 <-> e4m3 (ms, TB/s)")
    path = write_json(rows, f"{args.out}/fp8_saved.json", {"lengths": [r.case for r in rows]})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
