"""What a training process compiles while it trains: Dynamo graphs (compiled regions and their
recompiles) and Triton kernels (each new specialization of one is JIT-compiled on its first
launch).

Past the warm-up steps, a compile is a stall inside the measured run (seconds per kernel at
GEM width) and a sign that something is specialized on a value that changes from batch to
batch. The training loop reports each such step on a progress line and counts them in the
run summary (``perf/compiles_after_warmup``): QPS and MFU of a run whose count is above zero
include compile time. Over the whole watch it also adds up the seconds spent compiling (Dynamo
and Inductor, forward and backward; each Triton kernel's JIT compile): with the kernels' own
tuning time, what a run's start-up is made of.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class CompileEvents:
    """What was compiled between two ``CompileWatch.take`` calls."""

    dynamo_graphs: int = 0
    triton_kernels: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        return self.dynamo_graphs + len(self.triton_kernels)

    def __bool__(self) -> bool:
        return self.count > 0

    def describe(self) -> str:
        parts = []
        if self.dynamo_graphs:
            parts.append(f"{self.dynamo_graphs} torch.compile graph(s)")
        if self.triton_kernels:
            names = sorted(set(self.triton_kernels))
            shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            parts.append(f"{len(self.triton_kernels)} Triton kernel(s) ({shown})")
        return " and ".join(parts) + " compiled"


@dataclass
class CompileTotals:
    """Compiles over a whole watch, and the seconds they took."""

    dynamo_graphs: int = 0
    torch_s: float = 0.0  # Dynamo + Inductor: graph capture and code generation, fwd and bwd
    triton_kernels: int = 0
    triton_s: float = 0.0  # JIT compiles of Triton kernels launched directly (not Inductor's)

    def summary(self, tuning_s: float) -> dict[str, float]:
        """Run-summary metrics; ``tuning_s``: the kernels' own tuning (GDPA's launch plans)."""
        return {"perf/compile_s_torch": self.torch_s,
                "perf/torch_graphs_compiled": float(self.dynamo_graphs),
                "perf/compile_s_triton": self.triton_s,
                "perf/triton_kernels_compiled": float(self.triton_kernels),
                "perf/tuning_s_gdpa": tuning_s}


# torch's compile timers (seconds, cumulative per process): the whole forward compile, and the
# backward's, which AOTAutograd compiles lazily at the first backward.
_TORCH_COMPILE_TIMERS = ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler")


def _torch_compile_s() -> float:
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return 0.0
    return float(sum(sum(compilation_time_metrics.get(k, ())) for k in _TORCH_COMPILE_TIMERS))


def _dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))


def _triton_knobs() -> Any | None:
    """Triton's runtime knobs, where this Triton has them (3.4 and later)."""
    try:
        import triton
    except ImportError:
        return None
    return getattr(getattr(triton, "knobs", None), "runtime", None)


class CompileWatch(contextlib.AbstractContextManager):
    """Counts compiles from ``__enter__`` to ``__exit__``; ``take()`` returns those since the
    previous ``take``, ``totals()`` those since ``__enter__`` with their seconds. Chains any
    Triton compile hooks already installed."""

    def __init__(self) -> None:
        self._kernels: list[str] = []
        self._graphs = 0
        self._knobs = None
        self._previous: Callable[..., Any] | None = None
        self._previous_start: Callable[..., Any] | None = None
        self._started: dict[str, float] = {}  # a Triton compile's repr -> when it started
        self._triton_kernels, self._triton_s = 0, 0.0
        self._first_graphs, self._first_torch_s = 0, 0.0

    def __enter__(self) -> CompileWatch:
        self._graphs = self._first_graphs = _dynamo_graphs()
        self._first_torch_s = _torch_compile_s()
        self._knobs = _triton_knobs()
        if self._knobs is not None:
            self._previous = self._knobs.jit_post_compile_hook
            self._previous_start = self._knobs.jit_cache_hook
            self._knobs.jit_post_compile_hook = self._on_triton_compile
            self._knobs.jit_cache_hook = self._on_triton_start
        return self

    def _on_triton_start(self, **kwargs: Any) -> Any:
        """Called before each Triton JIT compile; a true return would skip it, so pass on the
        chained hook's answer only."""
        self._started[str(kwargs.get("repr"))] = time.perf_counter()
        return self._previous_start(**kwargs) if self._previous_start else None

    def _on_triton_compile(self, **kwargs: Any) -> Any:
        fn = kwargs.get("fn")
        self._kernels.append(getattr(fn, "name", None) or str(fn))
        started = self._started.pop(str(kwargs.get("repr")), None)
        self._triton_kernels += 1
        if started is not None:
            self._triton_s += time.perf_counter() - started
        return self._previous(**kwargs) if self._previous else None

    def take(self) -> CompileEvents:
        graphs = _dynamo_graphs()
        events = CompileEvents(graphs - self._graphs, self._kernels)
        self._graphs, self._kernels = graphs, []
        return events

    def totals(self) -> CompileTotals:
        return CompileTotals(_dynamo_graphs() - self._first_graphs,
                             _torch_compile_s() - self._first_torch_s, self._triton_kernels,
                             self._triton_s)

    def __exit__(self, *exc: object) -> None:
        if self._knobs is None:
            return
        if self._knobs.jit_post_compile_hook == self._on_triton_compile:
            self._knobs.jit_post_compile_hook = self._previous
        if self._knobs.jit_cache_hook == self._on_triton_start:
            self._knobs.jit_cache_hook = self._previous_start
