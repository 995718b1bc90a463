"""Model FLOP utilization: useful FLOPs per second over the device's peak.

    E2E MFU   = useful train FLOPs of all ranks / (step wall time x ranks x peak)
    Local MFU = the same FLOPs over compute time alone (forward + backward + optimizer,
                no communication): what each rank would reach on its own
    Scaling ratio = E2E / Local
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

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
    if configured is not None:
        return Peak(configured, "configured")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, table in GPU_PEAK_TFLOPS.items():
            if key in name:
                kind = "fp8" if dtype_name == "fp8_block" else dtype_name
                if kind in table:
                    return Peak(table[kind], f"table:{key}/{kind}")
        raise ValueError(f"no peak known for {name}: set train.peak_tflops")
    return Peak(measure_cpu_matmul_tflops(), "measured:cpu-fp32-matmul")


def mfu(flops: float, seconds: float, peak: Peak, ranks: int = 1) -> float:
    if seconds <= 0:
        return float("nan")
    return flops / seconds / (peak.tflops * 1e12 * ranks)
