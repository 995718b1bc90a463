"""What a training process compiles while it trains: Dynamo graphs (compiled regions and their
recompiles) and Triton kernels (each new specialization of one is JIT-compiled on its first
launch).

Past the warm-up steps, a compile is a stall inside the measured run (seconds per kernel at
GEM width) and a sign that something is specialized on a value that changes from batch to
batch. The training loop reports each such step on a progress line and counts them in the
run summary (``perf/compiles_after_warmup``): QPS and MFU of a run whose count is above zero
include compile time.
"""

from __future__ import annotations

import contextlib
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
    previous ``take``. Chains any Triton post-compile hook already installed."""

    def __init__(self) -> None:
        self._kernels: list[str] = []
        self._graphs = 0
        self._knobs = None
        self._previous: Callable[..., Any] | None = None

    def __enter__(self) -> CompileWatch:
        self._graphs = _dynamo_graphs()
        self._knobs = _triton_knobs()
        if self._knobs is not None:
            self._previous = self._knobs.jit_post_compile_hook
            self._knobs.jit_post_compile_hook = self._on_triton_compile
        return self

    def _on_triton_compile(self, **kwargs: Any) -> Any:
        fn = kwargs.get("fn")
        self._kernels.append(getattr(fn, "name", None) or str(fn))
        return self._previous(**kwargs) if self._previous else None

    def take(self) -> CompileEvents:
        graphs = _dynamo_graphs()
        events = CompileEvents(graphs - self._graphs, self._kernels)
        self._graphs, self._kernels = graphs, []
        return events

    def __exit__(self, *exc: object) -> None:
        if self._knobs is not None and \
                self._knobs.jit_post_compile_hook == self._on_triton_compile:
            self._knobs.jit_post_compile_hook = self._previous
