"""Model FLOP utilization: useful FLOPs per second over the device's peak.

Measured per rank (the run reports rank 0's), from the FLOPs of the rank's real jagged
lengths (gem_platform.model.flops):

    E2E MFU   = the rank's useful train FLOPs / (step wall time x peak)
    Local MFU = the same FLOPs over the step's time less the sync of replicated gradients
                (see gem_platform.train.loop for what that time still holds under sharding)
    Scaling ratio = E2E / Local
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from gem_platform.errors import RecipeError

# Dense peak TFLOP/s by GPU name fragment and dtype (vendor datasheet figures).
GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.0, "fp8": 1979.0, "fp32": 67.0},
    "H100": {"bf16": 989.0, "fp8": 1979.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp32": 19.5},
}


@dataclass(frozen=True)
class Peak:
    tflops: float
    source: str  # where the figure came from: "configured", "table:H200/bf16", "measured:cpu"


def measure_cpu_matmul_tflops(size: int = 512, seconds: float = 0.3) -> float:
    """fp32 matmul throughput of this process's CPU threads: the honest CPU 'peak'."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    for _ in range(3):
        a @ b
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        n += 1
    return 2.0 * size**3 * n / (time.perf_counter() - start) / 1e12


def resolve_peak(device: torch.device, dtype_name: str, configured: float | None) -> Peak:
    """The peak MFU is taken against: ``train.peak_tflops`` when set; on CUDA the datasheet
    figure for the GPU and precision (RecipeError for a GPU not in the table); on CPU a
    measured fp32 matmul rate."""
    if configured is not None:
        return Peak(configured, "configured")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, table in GPU_PEAK_TFLOPS.items():
            if key in name:
                kind = "fp8" if dtype_name == "fp8_block" else dtype_name
                if kind in table:
                    return Peak(table[kind], f"table:{key}/{kind}")
        raise RecipeError(f"No peak TFLOP/s is known for {name} at precision {dtype_name}, so "
                          "MFU can't be computed.",
                          "Set train.peak_tflops to the GPU's dense peak for that precision "
                          "(vendor datasheet).")
    return Peak(measure_cpu_matmul_tflops(), "measured:cpu-fp32-matmul")


def mfu(flops: float, seconds: float, peak: Peak) -> float:
    """``flops`` done in ``seconds`` as a fraction of ``peak``; NaN for no time."""
    if seconds <= 0:
        return float("nan")
    return flops / seconds / (peak.tflops * 1e12)
