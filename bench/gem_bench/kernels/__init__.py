"""Kernel benchmarks: each module times ours against named baselines in the same run and writes
a table plus JSON. Run on CUDA: ``python -m gem_bench.kernels.<name> --out DIR``."""
