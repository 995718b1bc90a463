"""Where the device waits during a step: the idle gaps in a torch.profiler Chrome trace.

Kernel busy time says how much of a step the GPU works, not why it idles the rest. This reads
the trace ``prof.export_chrome_trace`` writes (kineto's format), merges the device's kernels,
copies and fills over all streams, and finds the holes inside the profiled steps. A hole ends
when the host launches again, so each gap is charged to the launch of the first device event
after it (matched through ``args["correlation"]``) and to the host stack around that launch:
the innermost ``cpu_op``, the innermost span around it that is not an ATen op (an autograd
Function such as GDPAFunction, a compiled graph's call, a backward node: where in the model the
launch came from, since every ``aten::copy_`` looks alike) and the outermost
``record_function`` region below ``ProfilerStep``.
Host synchronizations that overlap the gaps (stream/device/event syncs, blocking copies to
the host) are listed apart: a sync is the usual cause of a gap, the host waits for the device
to drain and only then launches again. The report also carries the host threads' time by
site over the same steps (``gem_profile.host``).

    gemctl profile recipes/h200.yaml --trace step.trace.json --out prof.json
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gem_profile.host import HostEntry, host_time

DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
RUNTIME_CATS = frozenset({"cuda_runtime", "cuda_driver"})
HOST_CATS = frozenset({"cpu_op", "user_annotation", "python_function"})
STEP_PREFIX = "ProfilerStep#"
# Calls that block the host until the device drains (runtime and driver API spellings).
SYNC_NAMES = re.compile(r"^(cuda|cu)(Stream|Device|Event|Ctx)Synchroni[sz]e$")
BLOCKING_COPY = re.compile(r"^(cudaMemcpy|cuMemcpy(DtoH)?(_v2)?)$")
ASYNC_COPY = re.compile(r"^(cudaMemcpyAsync|cuMemcpy(DtoH)?Async(_v2)?)$")
D2H = re.compile(r"dtoh|d2h|devicetohost|device -> (pinned|pageable)", re.IGNORECASE)
NO_OP = "(no cpu_op)"


@dataclass
class GapEntry:
    """Idle device time charged to one host site: the launch stack that ended the gaps."""

    op: str  # innermost cpu_op around the launch, e.g. aten::mm
    region: str | None  # outermost user annotation below ProfilerStep, e.g. AdamW.step
    caller: str | None  # innermost non-ATen span around op, e.g. GDPAFunction
    ms_per_step: float
    gaps_per_step: float
    share: float  # of all gap time
    largest_us: float
    launch: str  # the runtime call, e.g. cudaLaunchKernel
    # gaps whose next work was launched before they began: the device waited on something
    # else (another stream's event, a dependency), not on a late host
    queued_per_step: float = 0.0
    stack: list[str] = field(default_factory=list)  # of the largest gap, outermost first


@dataclass
class SyncEntry:
    """A host synchronization site and how much of the gaps it overlaps."""

    name: str  # e.g. cudaStreamSynchronize
    caller: str  # innermost cpu_op around the call
    overlap_ms_per_step: float
    calls_per_step: float


@dataclass
class GapReport:
    """The device's idle gaps over the profiled steps, per step, and who they wait on."""

    steps: int
    min_gap_us: float
    window_ms_per_step: float = 0.0  # the span of the ProfilerStep spans, per step
    busy_ms_per_step: float = 0.0  # device busy time (streams merged) inside the window
    gap_ms_per_step: float = 0.0  # idle holes of at least min_gap_us
    gaps_per_step: float = 0.0
    gap_fraction: float = 0.0  # of the window
    sync_overlap_ms_per_step: float = 0.0
    top: list[GapEntry] = field(default_factory=list)
    # the host threads' time inside the steps, by site (gem_profile.host)
    host: list[HostEntry] = field(default_factory=list)
    syncs: list[SyncEntry] = field(default_factory=list)
    reason: str = ""  # one line when nothing could be analyzed (a CPU-only trace)


@dataclass
class _Gap:
    start: float
    end: float
    next_event: dict | None  # the first device event after the gap


def load_trace(path: str | Path) -> dict:
    """A Chrome trace file as written by ``prof.export_chrome_trace``."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _complete(events: Iterable[dict], cats: frozenset[str]) -> list[dict]:
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in cats
            and "ts" in e and "dur" in e]


def _end(e: dict) -> float:
    return float(e["ts"]) + float(e["dur"])


def _corr(e: dict) -> object:
    return (e.get("args") or {}).get("correlation")


def _merge(device: list[dict]) -> list[tuple[float, float, dict]]:
    """Busy intervals over all streams, each with its first event (the one that opened it)."""
    merged: list[tuple[float, float, dict]] = []
    for e in sorted(device, key=lambda e: (float(e["ts"]), -float(e["dur"]))):
        ts, end = float(e["ts"]), _end(e)
        if merged and ts <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end, merged[-1][2])
        else:
            merged.append((ts, end, e))
    return merged


def _find_gaps(merged: list[tuple[float, float, dict]], lo: float, hi: float,
               min_us: float) -> tuple[list[_Gap], float]:
    """The holes of at least ``min_us`` in [lo, hi] (head and tail included), and the busy
    time inside it."""
    gaps, busy, cursor = [], 0.0, lo
    for ts, end, first in merged:
        if end <= lo:
            continue
        if ts >= hi:
            if hi - cursor >= min_us:
                gaps.append(_Gap(cursor, hi, first))
            return gaps, busy
        if ts - cursor >= min_us:
            gaps.append(_Gap(cursor, ts, first))
        busy += min(end, hi) - max(ts, lo)
        cursor = max(cursor, end)
    if hi - cursor >= min_us:
        gaps.append(_Gap(cursor, hi, None))
    return gaps, busy


class _HostStacks:
    """The host events of each thread, nested, to answer "what encloses time t on thread x"
    in O(depth) after one sort (traces with Python stacks hold hundreds of thousands)."""

    def __init__(self, host: list[dict]) -> None:
        self.threads: dict[tuple, tuple[list[float], list[dict], list[int]]] = {}
        by_thread: dict[tuple, list[dict]] = {}
        for e in host:
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
        for key, evs in by_thread.items():
            evs.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
            parent: list[int] = []
            open_: list[int] = []
            for i, e in enumerate(evs):
                while open_ and _end(evs[open_[-1]]) < float(e["ts"]):
                    open_.pop()
                parent.append(open_[-1] if open_ else -1)
                open_.append(i)
            self.threads[key] = ([float(e["ts"]) for e in evs], evs, parent)

    def enclosing(self, pid: object, tid: object, t: float) -> list[dict]:
        """The events on (pid, tid) whose [ts, ts + dur] holds ``t``, outermost first."""
        if (pid, tid) not in self.threads:
            return []
        starts, evs, parent = self.threads[(pid, tid)]
        i = bisect.bisect_right(starts, t) - 1
        chain = []
        while i >= 0:
            if _end(evs[i]) >= t:
                chain.append(evs[i])
            i = parent[i]
        return chain[::-1]


def _site(stack: list[dict]) -> tuple[str, str | None, str | None]:
    """(innermost cpu_op, outermost user annotation below ProfilerStep, innermost non-ATen
    span around that op) of a host stack."""
    spans = [e for e in stack if e.get("cat") in ("cpu_op", "user_annotation")
             and not e["name"].startswith(STEP_PREFIX)]
    ops = [e["name"] for e in spans if e.get("cat") == "cpu_op"]
    regions = [e["name"] for e in spans if e.get("cat") == "user_annotation"]
    op = ops[-1] if ops else NO_OP
    inner = spans[:-1] if ops and spans[-1]["name"] == op else spans
    callers = [e["name"] for e in inner if not e["name"].startswith("aten::")]
    return op, (regions[0] if regions else None), (callers[-1] if callers else None)


def _is_sync(e: dict, memcpy_by_corr: dict[object, dict]) -> bool:
    """A runtime call that blocks the host on the device: syncs, blocking copies, and async
    copies to the host (kineto's runtime events carry no copy kind: the correlated device
    copy's name, "Memcpy DtoH (Device -> Pageable)", says it)."""
    name = e.get("name", "")
    if SYNC_NAMES.match(name) or BLOCKING_COPY.match(name):
        return True
    if not ASYNC_COPY.match(name):
        return False
    args = e.get("args") or {}
    copy = memcpy_by_corr.get(_corr(e))
    shown = " ".join(str(v) for v in args.values()) + " " + (copy or {}).get("name", "")
    return bool(D2H.search(shown)) or args.get("kind") == 2  # cudaMemcpyDeviceToHost


def _step_window(host: list[dict]) -> tuple[float, float, int] | None:
    steps = [e for e in host if e.get("cat") in ("user_annotation", "cpu_op")
             and e.get("name", "").startswith(STEP_PREFIX)]
    if not steps:
        return None
    return (min(float(e["ts"]) for e in steps), max(_end(e) for e in steps),
            len({e["name"] for e in steps}))


def device_gaps(trace: dict, min_gap_us: float = 20.0, top: int = 15) -> GapReport:
    """The device's idle gaps of at least ``min_gap_us`` inside the profiled steps of a kineto
    Chrome trace, charged to the host sites that ended them, per step."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else []
    device = _complete(events, DEVICE_CATS)
    host = _complete(events, HOST_CATS)
    window = _step_window(host)
    steps = window[2] if window else 1
    report = GapReport(steps=steps, min_gap_us=min_gap_us)
    if window is not None:
        report.host = host_time(host, window[0], window[1], steps, top)
    if not device:
        report.reason = ("no device events (kernel, gpu_memcpy, gpu_memset) in the trace: a "
                         "CPU-only profile has no device gaps")
        return report
    if window is None:
        window = (min(float(e["ts"]) for e in device), max(_end(e) for e in device), 1)
    lo, hi = window[0], window[1]
    gaps, busy = _find_gaps(_merge(device), lo, hi, min_gap_us)
    total_gap = sum(g.end - g.start for g in gaps)
    report.window_ms_per_step = (hi - lo) / 1e3 / steps
    report.busy_ms_per_step = busy / 1e3 / steps
    report.gap_ms_per_step = total_gap / 1e3 / steps
    report.gaps_per_step = len(gaps) / steps
    report.gap_fraction = total_gap / (hi - lo) if hi > lo else 0.0
    runtime = _complete(events, RUNTIME_CATS)
    stacks = _HostStacks(host)
    report.top = _attribute(gaps, runtime, stacks, steps, total_gap)[:top]
    memcpy_by_corr = {_corr(e): e for e in device if e.get("cat") == "gpu_memcpy"}
    syncs = [e for e in runtime if _is_sync(e, memcpy_by_corr)]
    report.syncs = _sync_overlaps(syncs, gaps, stacks, steps)[:top]
    report.sync_overlap_ms_per_step = sum(s.overlap_ms_per_step for s in report.syncs)
    return report


def _attribute(gaps: list[_Gap], runtime: list[dict], stacks: _HostStacks, steps: int,
               total_gap: float) -> list[GapEntry]:
    """Gap time by the host site whose launch ended each gap, largest first."""
    launch_by_corr = {_corr(e): e for e in runtime if _corr(e) is not None}
    rows: dict[tuple[str, str | None, str | None], GapEntry] = {}
    for g in sorted(gaps, key=lambda g: g.end - g.start, reverse=True):
        us = g.end - g.start
        launch = launch_by_corr.get(_corr(g.next_event)) if g.next_event else None
        if launch is None:
            why = "(end of window)" if g.next_event is None else "(launch not in trace)"
            key, stack, call = (why, None, None), [], "-"
        else:
            stack = stacks.enclosing(launch.get("pid"), launch.get("tid"), float(launch["ts"]))
            key, call = _site(stack), launch.get("name", "?")
        row = rows.get(key)
        if row is None:  # gaps come largest first: the first one seen is the largest
            row = rows[key] = GapEntry(key[0], key[1], key[2], 0.0, 0.0, 0.0, us, call,
                                       stack=[e["name"] for e in stack])
        row.ms_per_step += us / 1e3 / steps
        row.gaps_per_step += 1 / steps
        if launch is not None and _end(launch) <= g.start:
            row.queued_per_step += 1 / steps
        row.share += us / total_gap if total_gap else 0.0
    return sorted(rows.values(), key=lambda r: r.ms_per_step, reverse=True)


def _sync_overlaps(syncs: list[dict], gaps: list[_Gap], stacks: _HostStacks,
                   steps: int) -> list[SyncEntry]:
    """Host syncs by (call, innermost cpu_op), with the gap time each overlaps."""
    ends = [g.end for g in gaps]
    rows: dict[tuple[str, str], SyncEntry] = {}
    for e in syncs:
        ts, end = float(e["ts"]), _end(e)
        overlap = 0.0
        for g in gaps[bisect.bisect_right(ends, ts):]:
            if g.start >= end:
                break
            overlap += min(end, g.end) - max(ts, g.start)
        if overlap <= 0:
            continue
        op, _, _ = _site(stacks.enclosing(e.get("pid"), e.get("tid"), ts))
        row = rows.setdefault((e["name"], op), SyncEntry(e["name"], op, 0.0, 0.0))
        row.overlap_ms_per_step += overlap / 1e3 / steps
        row.calls_per_step += 1 / steps
    return sorted(rows.values(), key=lambda r: r.overlap_ms_per_step, reverse=True)


def render_gaps(report: GapReport, console=None) -> None:  # noqa: ANN001 (a rich Console)
    """Print the gap summary line, the gaps by launching site, the overlapping syncs, then
    the host threads' time by site."""
    from rich.console import Console

    from gem_platform.markup import escape_text as escape
    from gem_profile.host import render_host

    console = console or Console()
    if report.reason:
        console.print(f"device gaps: {escape(report.reason)}")
    else:
        _render_device(report, console)
    render_host(report.host, report.steps, console)


def _render_device(report: GapReport, console) -> None:  # noqa: ANN001 (a rich Console)
    from rich.table import Table

    from gem_platform.markup import escape_text as escape

    console.print(f"device gaps: {report.gap_ms_per_step:.2f} ms / step idle in "
                  f"{report.gaps_per_step:.1f} gaps >= {report.min_gap_us:g} us "
                  f"({report.gap_fraction:.1%} of {report.window_ms_per_step:.1f} ms; device "
                  f"busy {report.busy_ms_per_step:.1f} ms) over {report.steps} steps")
    table = Table("launched by (cpu_op)", "called in", "region", "gap ms / step", "gaps / step",
                  "share", "largest us", "launch", "queued / step")
    for r in report.top:
        table.add_row(escape(_short(r.op)), escape(_short(r.caller or "-", 40)),
                      escape(_short(r.region or "-", 40)),
                      f"{r.ms_per_step:.3f}", f"{r.gaps_per_step:.1f}", f"{r.share:.1%}",
                      f"{r.largest_us:.0f}", escape(r.launch), f"{r.queued_per_step:.1f}")
    console.print(table)
    if not report.syncs:
        console.print("no host synchronization overlaps the gaps")
        return
    syncs = Table("host sync", "called in (cpu_op)", "overlap ms / step", "calls / step")
    for s in report.syncs:
        syncs.add_row(escape(s.name), escape(_short(s.caller)),
                      f"{s.overlap_ms_per_step:.3f}", f"{s.calls_per_step:.1f}")
    console.print(syncs)


def _short(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def write_gaps(report: GapReport, path: str | Path) -> Path:
    """The gap report as JSON (parent folders created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(report), indent=1))
    return path


def gaps_path(profile_out: str | Path) -> Path:
    """Where the gap report goes beside a profile's JSON: ``prof.json`` -> ``prof.gaps.json``."""
    p = Path(profile_out)
    return p.with_name(p.stem + ".gaps.json")


def report_trace_gaps(trace: str | Path, profile_out: str | Path | None, console=None,  # noqa: ANN001
                      min_gap_us: float = 20.0) -> Path | None:
    """Analyze a written trace, print its gaps and, beside ``profile_out``, write them; the
    path written, if any."""
    report = device_gaps(load_trace(trace), min_gap_us=min_gap_us)
    render_gaps(report, console)
    return write_gaps(report, gaps_path(profile_out)) if profile_out else None
