"""The device-gap analysis of a torch.profiler Chrome trace: a hand-built trace in kineto's
shape with every gap worked out by hand, and a real CPU trace (no device events)."""

from __future__ import annotations

import io
import json
from dataclasses import asdict

import pytest
import torch
from rich.console import Console

from gem_profile.gaps import (
    device_gaps,
    gaps_path,
    load_trace,
    render_gaps,
    report_trace_gaps,
)

HOST, MAIN, BWD = 4242, 4242, 4250  # pid, main thread, autograd's backward thread
GPU = 0  # kineto's device pid; its tids are streams


def _host(cat: str, name: str, ts: float, end: float, tid: int = MAIN, **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": HOST, "tid": tid, "ts": ts,
            "dur": end - ts, "args": {"External id": 1, **args}}


def _launch(name: str, ts: float, end: float, corr: int, tid: int = MAIN,
            cat: str = "cuda_runtime") -> dict:
    return _host(cat, name, ts, end, tid, cbid=211, correlation=corr)


def _dev(cat: str, name: str, ts: float, end: float, corr: int, stream: int = 7) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": GPU, "tid": stream, "ts": ts,
            "dur": end - ts, "args": {"External id": 1, "device": 0, "context": 1,
                                      "stream": stream, "correlation": corr}}


def synthetic_trace() -> dict:
    """Two ProfilerSteps over [1000, 3000] us; device busy (streams 7 and 20 merged) in
    [1050,1200] [1300,1500] [1510,1600] [1700,1720] [1805,1810] [2040,2045] [2100,2900]."""
    ua, op, py = "user_annotation", "cpu_op", "python_function"
    events = [
        {"ph": "M", "name": "process_name", "pid": HOST, "tid": 0, "ts": 0,
         "args": {"name": "python"}},
        {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans",
         "tid": "PyTorch Profiler", "ts": 900, "dur": 2200, "args": {"Op count": 0}},
        _host(ua, "ProfilerStep#1", 1000, 2000),
        _host(ua, "ProfilerStep#2", 2000, 3000),
        # step 1, forward: two kernels launched in addmm, overlapping on two streams
        _host(ua, "fwd", 1010, 1400),
        _host(py, "nn.Module: Linear_0", 1015, 1105),
        _host(op, "aten::linear", 1020, 1100),
        _host(op, "aten::addmm", 1030, 1090),
        _launch("cudaLaunchKernel", 1040, 1045, 1),
        _launch("cudaLaunchKernel", 1080, 1084, 2),
        _dev("kernel", "nvjet_sm90_tst_128x128", 1050, 1150, 1),
        _dev("kernel", "void at::native::vectorized_elementwise_kernel", 1100, 1200, 2,
             stream=20),
        # .item(): the host waits on the stream, then launches the next kernel
        _host(op, "aten::item", 1185, 1290),
        _host(op, "aten::_local_scalar_dense", 1190, 1290),
        _launch("cudaStreamSynchronize", 1195, 1280, 9),
        _host(op, "aten::mul", 1291, 1299),
        _launch("cudaLaunchKernel", 1292, 1296, 3),
        _dev("kernel", "mul_kernel", 1300, 1500, 3),
        # the optimizer: a Triton kernel through the driver API (after a 10 us gap), a fill
        _host(ua, "Optimizer.step#AdamW.step", 1450, 1750),
        _host(op, "aten::_foreach_add_", 1495, 1509),
        _launch("cuLaunchKernelEx", 1500, 1505, 4, cat="cuda_driver"),
        _dev("kernel", "triton_poi_fused_add_0", 1510, 1600, 4),
        _host(op, "aten::zero_", 1685, 1698),
        _launch("cudaMemsetAsync", 1690, 1695, 6),
        _dev("gpu_memset", "Memset (Device)", 1700, 1720, 6, stream=20),
        # a copy to the host outside any region: an async copy that blocks
        _host(op, "aten::to", 1785, 1955),
        _host(op, "aten::copy_", 1790, 1950),
        _launch("cudaMemcpyAsync", 1800, 1900, 7),
        _dev("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 1805, 1810, 7),
        # step 2: a copy to the device (no sync), then backward launches on its own thread
        _host(ua, "fwd", 2010, 2500),
        _host(op, "aten::to", 2012, 2038),
        _host(op, "aten::copy_", 2015, 2035),
        _launch("cudaMemcpyAsync", 2020, 2030, 8),
        _dev("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 2040, 2045, 8),
        _host(op, "aten::sum", 2050, 2099),
        _host(op, "autograd::engine::evaluate_function: MmBackward0", 2040, 2098, tid=BWD),
        _host(op, "aten::mm", 2055, 2097, tid=BWD),
        _launch("cudaLaunchKernel", 2060, 2065, 5, tid=BWD),
        _dev("kernel", "nvjet_sm90_tst_256x128", 2100, 2900, 5),
        _launch("cudaDeviceSynchronize", 2200, 2300, 10),  # while busy: overlaps no gap
        # the device's own copy of the step annotation is not device activity
        {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#1", "pid": GPU,
         "tid": 7, "ts": 1050, "dur": 1000, "args": {"External id": 1}},
        {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 1, "pid": HOST, "tid": MAIN,
         "ts": 1040},
        {"ph": "f", "cat": "ac2g", "name": "ac2g", "id": 1, "pid": GPU, "tid": 7,
         "ts": 1050, "bp": "e"},
    ]
    return {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H200"}],
            "traceEvents": events}


def _by_site(report) -> dict:
    return {(r.op, r.region): r for r in report.top}


def test_gaps_of_a_kineto_trace():
    report = device_gaps(synthetic_trace())
    assert report.reason == "" and report.steps == 2
    # gaps: head 50, 100, (10 under 20 us), 100, 85, 230, 55, tail 100 = 720 us in 7
    assert report.window_ms_per_step == pytest.approx(1.0)
    assert report.busy_ms_per_step == pytest.approx(1.270 / 2)
    assert report.gap_ms_per_step == pytest.approx(0.720 / 2)
    assert report.gaps_per_step == pytest.approx(3.5)
    assert report.gap_fraction == pytest.approx(0.36)
    sites = _by_site(report)
    expected = {("aten::copy_", "fwd"): 230, ("aten::mul", "fwd"): 100,
                ("aten::zero_", "Optimizer.step#AdamW.step"): 100,
                ("(end of window)", None): 100, ("aten::copy_", None): 85,
                ("aten::mm", None): 55, ("aten::addmm", "fwd"): 50}
    assert {k: round(r.ms_per_step * 2e3, 6) for k, r in sites.items()} == expected
    assert report.top[0].op == "aten::copy_" and report.top[0].region == "fwd"
    ms = [r.ms_per_step for r in report.top]
    assert ms == sorted(ms, reverse=True)
    assert sum(r.share for r in report.top) == pytest.approx(1.0)
    assert all(r.gaps_per_step == pytest.approx(0.5) for r in report.top)
    # the launch call and the host stack of each site
    copy = sites[("aten::copy_", "fwd")]
    assert copy.launch == "cudaMemcpyAsync" and copy.largest_us == pytest.approx(230)
    assert copy.stack == ["ProfilerStep#2", "fwd", "aten::to", "aten::copy_"]
    assert sites[("aten::addmm", "fwd")].stack == [
        "ProfilerStep#1", "fwd", "nn.Module: Linear_0", "aten::linear", "aten::addmm"]
    assert sites[("aten::zero_", "Optimizer.step#AdamW.step")].launch == "cudaMemsetAsync"
    # backward launches on its own thread: its stack is that thread's, not the main one's
    assert sites[("aten::mm", None)].stack == [
        "autograd::engine::evaluate_function: MmBackward0", "aten::mm"]
    assert sites[("(end of window)", None)].launch == "-"
    # syncs: the D2H async copy (95 us of gaps) and the stream sync (80); not the H2D copy,
    # not the device sync that ran while the device was busy
    assert [(s.name, s.caller) for s in report.syncs] == [
        ("cudaMemcpyAsync", "aten::copy_"), ("cudaStreamSynchronize", "aten::_local_scalar_dense")]
    assert [s.overlap_ms_per_step for s in report.syncs] == pytest.approx([0.0475, 0.040])
    assert [s.calls_per_step for s in report.syncs] == pytest.approx([0.5, 0.5])
    assert report.sync_overlap_ms_per_step == pytest.approx(0.0875)
    assert all(r.queued_per_step == 0 for r in report.top)  # every launch came in its gap
    assert json.loads(json.dumps(asdict(report)))["top"][0]["op"] == "aten::copy_"


def test_work_queued_before_a_gap_is_told_apart():
    """A kernel launched before the device went idle waited on something other than the
    host (another stream, an event): the gap is counted as queued."""
    trace = synthetic_trace()
    launch = next(e for e in trace["traceEvents"]
                  if e.get("cat") == "cuda_runtime" and e["args"].get("correlation") == 3)
    launch["ts"] = 1150  # before the gap [1200, 1300] began; in fwd, outside any cpu_op
    site = _by_site(device_gaps(trace))[("(no cpu_op)", "fwd")]
    assert site.queued_per_step == pytest.approx(0.5) and site.largest_us == pytest.approx(100)


def test_min_gap_filters_gaps():
    small = device_gaps(synthetic_trace(), min_gap_us=5)
    assert small.gaps_per_step == pytest.approx(4.0)
    assert small.gap_ms_per_step == pytest.approx(0.730 / 2)
    driver = _by_site(small)[("aten::_foreach_add_", "Optimizer.step#AdamW.step")]
    assert driver.launch == "cuLaunchKernelEx" and driver.largest_us == pytest.approx(10)
    big = device_gaps(synthetic_trace(), min_gap_us=100)  # 100 us itself still counts
    assert big.gaps_per_step == pytest.approx(2.0)
    assert big.gap_ms_per_step == pytest.approx(0.530 / 2)
    assert set(_by_site(big)) == {("aten::copy_", "fwd"), ("aten::mul", "fwd"),
                                  ("aten::zero_", "Optimizer.step#AdamW.step"),
                                  ("(end of window)", None)}
    assert [s.overlap_ms_per_step for s in big.syncs] == pytest.approx([0.045, 0.040])
    top2 = device_gaps(synthetic_trace(), top=2)
    assert len(top2.top) == 2 and top2.gap_ms_per_step == pytest.approx(0.360)


def test_without_profiler_steps_the_device_span_is_the_window():
    trace = synthetic_trace()
    trace["traceEvents"] = [e for e in trace["traceEvents"]
                            if not e.get("name", "").startswith("ProfilerStep")]
    report = device_gaps(trace)
    assert report.steps == 1 and report.window_ms_per_step == pytest.approx(1.850)
    assert report.gap_ms_per_step == pytest.approx(0.570)  # no head, no tail
    assert ("(end of window)", None) not in _by_site(report)


def test_rendered_tables():
    out = io.StringIO()
    render_gaps(device_gaps(synthetic_trace()), Console(file=out, width=200))
    text = out.getvalue()
    assert "0.36 ms / step idle in 3.5 gaps" in text
    for shown in ("aten::copy_", "Optimizer.step#AdamW.step", "cudaStreamSynchronize",
                  "aten::_local_scalar_dense", "(end of window)"):
        assert shown in text


def test_a_real_cpu_trace_has_no_device_gaps(tmp_path):
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    layer = torch.nn.Linear(16, 16)
    opt = torch.optim.AdamW(layer.parameters())
    with profile(activities=[ProfilerActivity.CPU],
                 schedule=schedule(wait=1, warmup=1, active=2)) as prof:
        for _ in range(4):
            with record_function("fwd"):
                layer(torch.randn(8, 16)).sum().backward()
            opt.step()
            prof.step()
    path = tmp_path / "cpu.trace.json"
    prof.export_chrome_trace(str(path))
    trace = load_trace(path)
    assert any(e.get("cat") == "cpu_op" for e in trace["traceEvents"])
    report = device_gaps(trace)
    assert report.steps == 2 and report.top == [] and report.syncs == []
    assert report.gap_ms_per_step == 0 and "no device events" in report.reason
    out = io.StringIO()
    written = report_trace_gaps(path, tmp_path / "prof.json", Console(file=out, width=200))
    assert written == gaps_path(tmp_path / "prof.json") == tmp_path / "prof.gaps.json"
    assert json.loads(written.read_text())["reason"] == report.reason
    assert out.getvalue().splitlines()[0].strip() == f"device gaps: {report.reason}"
    # the host's time is read all the same: the "fwd" region, the optimizer, backward nodes
    host = {(r.thread, r.site): r for r in report.host}
    assert ("main", "fwd") in host and ("main", "Optimizer.step#AdamW.step") in host
    assert sum(r.share for r in report.host if r.thread == "main") == pytest.approx(1, abs=0.05)
    assert "host time by site" in out.getvalue()
    assert report_trace_gaps(path, None, Console(file=io.StringIO())) is None


def test_each_site_names_the_span_it_was_called_in():
    """Every aten::copy_ looks alike: the innermost non-ATen span around the launch (an
    autograd Function, a backward node) tells them apart."""
    trace = synthetic_trace()
    trace["traceEvents"].append(_host("cpu_op", "GDPAFunction", 2011, 2039))
    sites = {(r.op, r.caller): r for r in device_gaps(trace).top}
    assert sites[("aten::copy_", "GDPAFunction")].largest_us == pytest.approx(230)
    assert sites[("aten::copy_", None)].largest_us == pytest.approx(85)
    assert ("aten::mm", "autograd::engine::evaluate_function: MmBackward0") in sites
    assert ("aten::addmm", "fwd") in sites  # no span but the region: the region
    out = io.StringIO()
    render_gaps(device_gaps(trace), Console(file=out, width=250))
    assert "GDPAFunction" in out.getvalue() and "called in" in out.getvalue()


def test_host_time_by_site():
    """Each host span's own time goes to the innermost non-ATen span around it; worked out by
    hand over the two 1000 us steps of the synthetic trace."""
    report = device_gaps(synthetic_trace())
    host = {(r.thread, r.site): r.ms_per_step for r in report.host}
    # the fwd regions (390 + 490 us) with everything they enclose
    assert host[("main", "fwd")] == pytest.approx(0.44)
    assert host[("main", "Optimizer.step#AdamW.step")] == pytest.approx(0.15)
    assert host[("main", "aten::to (eager)")] == pytest.approx(0.085)  # no span around it
    # the rest of the 2000 us window: Python between ops
    assert host[("main", "(Python between ops)")] == pytest.approx(0.325)
    assert host[("backward", "autograd::engine::evaluate_function: MmBackward0")] == \
        pytest.approx(0.029)
    assert [r.site for r in report.host][:2] == ["fwd", "(Python between ops)"]  # largest first
    gdpa = synthetic_trace()
    gdpa["traceEvents"].append(_host("cpu_op", "GDPAFunction", 2011, 2039))
    sites = {r.site: r.ms_per_step for r in device_gaps(gdpa).host}
    assert sites["GDPAFunction"] == pytest.approx(0.014)
    assert sites["fwd"] == pytest.approx(0.44 - 0.014)
