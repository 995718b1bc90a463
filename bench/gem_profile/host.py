"""Where the host's time goes during a step, read from a torch.profiler Chrome trace.

A launch-bound step (the GPU idles while the host prepares the next kernels) gets faster only
by cutting host work, and the device-gap report says which launches came late, not what the
host was doing meanwhile. This charges every microsecond of each host thread inside the
profiled steps to one site: each ``cpu_op`` or ``user_annotation`` span keeps its own
(exclusive) time, which goes to the innermost enclosing span that is not an ATen op (an autograd
Function, a compiled graph's call, a backward node, an optimizer step, a TorchRec lookup).
ATen ops called straight from Python are charged to their outermost op, marked "(eager)", and
the step annotation's own time, spent in Python between ops, to "(Python between ops)". Only
``cpu_op`` and ``user_annotation`` spans count (a trace recorded with Python stacks holds
Python functions too: they are left out so a site means the same with or without them).
"""

from __future__ import annotations

from dataclasses import dataclass

STEP_PREFIX = "ProfilerStep#"
SPAN_CATS = ("cpu_op", "user_annotation")
BETWEEN_OPS = "(Python between ops)"


@dataclass
class HostEntry:
    """Host time of one thread charged to one site, per step."""

    thread: str  # "main" (the one that runs the steps), "backward" (autograd's) or "tid N"
    site: str
    ms_per_step: float
    share: float  # of the thread's spans' time inside the steps


def host_time(events: list[dict], lo: float, hi: float, steps: int,
              top: int = 20) -> list[HostEntry]:
    """Host time by (thread, site) over the window [lo, hi] (us) of ``steps`` profiled steps,
    largest first. ``events``: the trace's complete host events."""
    spans = [e for e in events if e.get("cat") in SPAN_CATS and e.get("ph") == "X"
             and float(e["ts"]) < hi and float(e["ts"]) + float(e["dur"]) > lo]
    by_thread: dict[tuple, list[dict]] = {}
    for e in spans:
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    rows: list[HostEntry] = []
    for key, evs in by_thread.items():
        label = _thread_label(key, evs)
        sites = _exclusive_by_site(evs, lo, hi)
        total = sum(sites.values()) or 1.0
        rows += [HostEntry(label, site, us / 1e3 / steps, us / total)
                 for site, us in sites.items()]
    rows.sort(key=lambda r: -r.ms_per_step)
    return rows[:top]


def _thread_label(key: tuple, evs: list[dict]) -> str:
    if any(e["name"].startswith(STEP_PREFIX) for e in evs):
        return "main"
    if any(e["name"].startswith("autograd::engine") for e in evs):
        return "backward"
    return f"tid {key[1]}"


def _exclusive_by_site(evs: list[dict], lo: float, hi: float) -> dict[str, float]:
    """Each span's own time (its clipped duration less its children's), summed per site."""
    evs = sorted(evs, key=lambda e: (float(e["ts"]), -float(e["dur"])))
    own: list[float] = []
    site: list[str] = []
    open_: list[int] = []  # indices of the spans enclosing the current one, outermost first
    for i, e in enumerate(evs):
        ts, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        while open_ and float(evs[open_[-1]]["ts"]) + float(evs[open_[-1]]["dur"]) <= ts:
            open_.pop()
        clipped = max(0.0, min(end, hi) - max(ts, lo))
        own.append(clipped)
        if open_:
            own[open_[-1]] -= clipped
        site.append(_site(e, [evs[j] for j in open_]))
        open_.append(i)
    out: dict[str, float] = {}
    for s, us in zip(site, own, strict=True):
        out[s] = out.get(s, 0.0) + max(us, 0.0)
    return out


def _site(e: dict, enclosing: list[dict]) -> str:
    """The site a span's own time is charged to (see the module docstring)."""
    chain = [x for x in [*enclosing, e] if not x["name"].startswith(STEP_PREFIX)]
    if not chain:
        return BETWEEN_OPS
    callers = [x["name"] for x in chain if not x["name"].startswith("aten::")]
    if callers:
        return callers[-1]
    return f"{chain[0]['name']} (eager)"


def render_host(rows: list[HostEntry], steps: int, console) -> None:  # noqa: ANN001 (rich)
    """The host-time table (nothing when the trace had no profiled steps)."""
    from rich.table import Table

    from gem_platform.markup import escape_text as escape

    if not rows:
        return
    console.print(f"host time by site, per step over {steps} steps (exclusive time of each "
                  "span, charged to the innermost non-ATen span around it)")
    table = Table("thread", "site", "host ms / step", "share of thread")
    for r in rows:
        site = r.site if len(r.site) <= 70 else r.site[:67] + "..."
        table.add_row(escape(r.thread), escape(site), f"{r.ms_per_step:.3f}", f"{r.share:.1%}")
    console.print(table)
