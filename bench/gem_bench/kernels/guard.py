"""The kernel-speed guard: each kernel's key shapes timed forward and forward+backward on the
GPU, the way their own bench modules time them, and compared with the committed figures."""

from __future__ import annotations

import importlib
import json
import math
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gem_bench.kernels.guard_figures import (
    SHAPES,
    Figure,
    KeyShape,
    Verdict,
    compare,
    keys,
    load_figures,
    save_figures,
    updated,
)
from gem_platform.errors import GemError

Runner = Callable[[KeyShape], dict[str, Callable[[], object]]]


@dataclass
class GuardReport:
    """What one run measured and decided; ``written`` names the files it wrote."""

    device: str
    commit: str | None
    max_slowdown: float
    verdicts: list[Verdict]
    errors: dict[str, str] = field(default_factory=dict)
    written: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return any(v.failed for v in self.verdicts)


def require_cuda() -> str:
    """The GPU's name; bad input (exit 2) where there is no CUDA GPU."""
    import torch

    if not torch.cuda.is_available():
        raise GemError("`gemctl bench kernels` needs a CUDA GPU: it times each kernel's key "
                       "shapes on the GPU, and the committed figures it compares with are "
                       "NVIDIA H200 figures, so no CPU or interpreter run can stand in for it.",
                       "Run it on the H200 (e.g. `gemctl bench kernels --check`).")
    return torch.cuda.get_device_name()


def bench_cases(bench: str) -> set[str]:
    """The case names a bench module defines (what a key shape may name)."""
    mod = importlib.import_module(bench)
    if bench.endswith(".fp8_linear"):
        return {f"{m}x{k}->{n}" for m, k, n in mod.CASES}
    if bench.endswith(".gdpa"):
        return {"self", "cross", "pooled"}
    return {c.name for c in mod._cases(False)}


def _jagged(shape: KeyShape) -> dict[str, Callable[[], object]]:
    import torch

    from gem_bench.kernels import jfa
    from gem_kernels.jagged_attention import jagged_attention
    from gem_kernels.testing import offsets_from_lengths

    case = next(c for c in jfa._cases(False) if c.name == shape.case)
    torch.manual_seed(0)
    total, max_len = sum(case.lengths), max(case.lengths)
    offsets = offsets_from_lengths(case.lengths, "cuda")
    q, k, v, do = (torch.randn(total, case.heads, case.dim, device="cuda", dtype=jfa.DTYPE)
                   for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def fn(a, b, c):  # noqa: ANN001, ANN202
        return jagged_attention(a, b, c, offsets, max_len, causal=case.causal,
                                window=case.window)

    def fwd():  # noqa: ANN202
        with torch.no_grad():
            return fn(q, k, v)

    return {"fwd": fwd, "fwd+bwd": lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do)}


def _gdpa(shape: KeyShape) -> dict[str, Callable[[], object]]:
    from gem_bench.kernels import gdpa as bench
    from gem_kernels.gdpa import gdpa

    c = bench.Case(shape.case, 256, 4, 128)
    c.free_padded()

    def ours(q, k, v):  # noqa: ANN001, ANN202
        return gdpa(q, k, v, c.qo, c.ko, c.max_q, c.max_kv, activation=bench.ACTIVATION,
                    kernel="triton")

    fwd, _, both = bench._grad_fns(ours, (c.q, c.k, c.v), c.do)
    return {"fwd": fwd, "fwd+bwd": both}


def _block(shape: KeyShape) -> dict[str, Callable[[], object]]:
    import torch

    from gem_bench.kernels import block_attention as bench

    case = next(c for c in bench._cases(False) if c.name == shape.case)
    x = bench.Inputs(case, torch.device("cuda"))
    attn = bench.attn_ours(x)
    return {"fwd": bench._fwd(attn, x), "fwd+bwd": bench._fwd_bwd(attn, x)}


def _fp8(shape: KeyShape) -> dict[str, Callable[[], object]]:
    import torch

    from gem_kernels.fp8 import Fp8BlockLinear, Fp8Config

    m, rest = shape.case.split("x")
    k, n = (int(s) for s in rest.split("->"))
    torch.manual_seed(0)
    x = torch.randn(int(m), k, device="cuda", dtype=torch.bfloat16)
    gy = torch.randn(int(m), n, device="cuda", dtype=torch.bfloat16)
    lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    layer = Fp8BlockLinear.from_linear(lin, Fp8Config(block=int(shape.variant[len("fp8_b"):])))
    xr = x.detach().requires_grad_()
    return {"fwd": lambda: layer(x),
            "fwd+bwd": lambda: torch.autograd.grad(layer(xr), (xr, lin.weight), gy)}


RUNNERS: dict[str, Runner] = {
    "gem_bench.kernels.jfa": _jagged, "gem_bench.kernels.gdpa": _gdpa,
    "gem_bench.kernels.block_attention": _block, "gem_bench.kernels.fp8_linear": _fp8}


def measure(names: list[str], rep_ms: float, errors: dict[str, str]
            ) -> dict[str, float | None]:
    """{'shape/direction': median ms}; a shape that fails to build or run is recorded in
    ``errors`` and measured as None (a failing verdict), and the others still run."""
    import torch

    from gem_bench.kernels.common import time_ms
    from gem_bench.kernels.jfa import _warm_gpu

    out: dict[str, float | None] = {}
    _warm_gpu()  # clocks up before the first, smallest timings
    for name in names:
        shape = SHAPES[name]
        try:
            fns = RUNNERS[shape.bench](shape)
        except Exception as e:  # noqa: BLE001 - reported as this shape's failure
            errors[name] = f"{type(e).__name__}: {e}"[:400]
            traceback.print_exc()
            fns = {}
        for direction in ("fwd", "fwd+bwd"):
            key = f"{name}/{direction}"
            out[key] = None
            if direction not in fns:
                continue
            try:
                fns[direction]()  # compilation and autotuning outside the timing
                torch.cuda.synchronize()
                out[key] = time_ms(fns[direction], rep_ms=rep_ms)
            except Exception as e:  # noqa: BLE001
                errors[key] = f"{type(e).__name__}: {e}"[:400]
                traceback.print_exc()
        del fns
        torch.cuda.empty_cache()
    return out


def run(names: list[str] | None, figures_path: str, out_dir: str, max_slowdown: float,
        update: bool, rep_ms: float = 300) -> GuardReport:
    """Time the named shapes (all when None), compare them with the committed figures, write
    the run's JSON into ``out_dir`` and, with ``update``, the figures file from this run."""
    from gem_platform.provenance import code_version, environment

    device = require_cuda()
    chosen = sorted({k.split("/")[0] for k in keys(names)}, key=list(SHAPES).index)
    figures = load_figures(figures_path)
    errors: dict[str, str] = {}
    measured = measure(chosen, rep_ms, errors)
    commit = code_version()["commit"]
    report = GuardReport(device, commit, max_slowdown, compare(measured, figures, max_slowdown),
                         errors)
    out = Path(out_dir) / "kernel_check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"environment": environment(), "commit": commit,
                               "figures_file": figures_path, **_jsonable(report)}, indent=2))
    report.written.append(str(out))
    if update:
        new = updated(figures, measured, commit, device, str(out))
        report.written.append(str(save_figures(figures_path, new)))
    return report


def _jsonable(report: GuardReport) -> dict:
    """The report with NaN-free numbers (JSON has no NaN)."""
    def clean(v: object) -> object:
        return None if isinstance(v, float) and not math.isfinite(v) else v

    verdicts = [{k: clean(v) for k, v in asdict(x).items()} for x in report.verdicts]
    return {"device": report.device, "max_slowdown": report.max_slowdown,
            "failed": report.failed, "verdicts": verdicts, "errors": report.errors}


__all__ = ["Figure", "GuardReport", "bench_cases", "require_cuda", "run"]
