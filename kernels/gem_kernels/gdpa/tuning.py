"""In-run choice among GDPA kernel variants that compute the same gradients.

Like ``triton.autotune`` (time each candidate on the first call's real inputs, keep the
fastest for later calls with the same key), but over whole launch plans: a candidate may
change the persistent schedule (block sizes) or the number of launches, which one
``triton.autotune`` over a single kernel cannot express. Keys bucket the lengths to powers of
two, so a training run tunes once per shape class. GEM_GDPA_AUTOTUNE=0 turns it off (the
first candidate, the heuristic default, runs); it is also off under the Triton interpreter
and while a CUDA graph is being captured (a capture must be preceded by a warm-up call,
which tunes).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import triton

from gem_kernels.dispatch import interpreting


@dataclass
class TuneRecord:
    """What one key's tuning measured: milliseconds (or the error) per candidate."""

    choice: object
    timings: list[tuple[object, float | str]] = field(default_factory=list)


def tuning_enabled(device: torch.device) -> bool:
    return (device.type == "cuda" and os.environ.get("GEM_GDPA_AUTOTUNE", "1") != "0"
            and not interpreting()
            and not torch.cuda.is_current_stream_capturing())


def length_bucket(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


class Tuner:
    """Best candidate per key; ``records`` keeps the timings for reports, ``seconds`` the wall
    time spent tuning (the candidates' compiles included), a part of a run's start-up."""

    def __init__(self, warmup_ms: float = 10.0, rep_ms: float = 40.0) -> None:
        self.records: dict[tuple, TuneRecord] = {}
        self.seconds = 0.0
        self._warmup_ms, self._rep_ms = warmup_ms, rep_ms

    def pick(self, key: tuple, candidates: Sequence[object], run: Callable[[object], object],
             device: torch.device) -> object:
        """The cached choice for key, else time run(c) for each candidate (failures, e.g. a
        config that exceeds shared memory, are recorded and skipped) and cache the fastest."""
        rec = self.records.get(key)
        if rec is not None:
            return rec.choice
        if len(candidates) == 1 or not tuning_enabled(device):
            return candidates[0]
        import triton.testing

        started = time.perf_counter()
        rec = TuneRecord(choice=candidates[0])
        best = float("inf")
        for c in candidates:
            try:
                ms = float(triton.testing.do_bench(lambda c=c: run(c), warmup=self._warmup_ms,
                                                   rep=self._rep_ms, return_mode="median"))
            except Exception as e:  # noqa: BLE001 - a failing candidate is only not chosen
                rec.timings.append((c, f"{type(e).__name__}: {e}"[:300]))
                continue
            rec.timings.append((c, ms))
            if ms < best:
                best, rec.choice = ms, c
        self.records[key] = rec
        self.seconds += time.perf_counter() - started
        return rec.choice
