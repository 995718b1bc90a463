"""CompileWatch: what a training process compiles, and the loop's report of compiles past the
warm-up steps (a stall inside the measured run)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
import triton

from gem_platform.train.compile_watch import CompileEvents, CompileWatch
from tests.tiny_training import tiny_tree, train_losses


def test_counts_dynamo_graphs_and_triton_kernels_and_chains_the_previous_hook():
    torch._dynamo.reset()
    seen_before: list[str] = []
    previous = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = lambda **kw: seen_before.append(kw["fn"].name)
    try:
        f = torch.compile(lambda x: x * 2 + 1, backend="aot_eager", dynamic=False)
        with CompileWatch() as watch:
            f(torch.ones(3))
            f(torch.ones(3))  # cached: nothing new
            assert watch.take().dynamo_graphs == 1
            f(torch.ones(4, dtype=torch.float64))  # a new dtype: a recompile
            # what Triton calls after JIT-compiling a kernel
            triton.knobs.runtime.jit_post_compile_hook(fn=SimpleNamespace(name="_jfa_fwd_kernel"))
            events = watch.take()
            assert events.dynamo_graphs == 1 and events.triton_kernels == ["_jfa_fwd_kernel"]
            assert "1 torch.compile graph(s) and 1 Triton kernel(s) (_jfa_fwd_kernel)" in \
                events.describe()
            assert not watch.take()
        assert seen_before == ["_jfa_fwd_kernel"]  # the hook found installed still ran
        assert triton.knobs.runtime.jit_post_compile_hook is not None
        triton.knobs.runtime.jit_post_compile_hook(fn=SimpleNamespace(name="k"))
        assert seen_before[-1] == "k"  # restored on exit
    finally:
        triton.knobs.runtime.jit_post_compile_hook = previous


def test_totals_time_each_triton_compile_and_pass_on_the_chained_skip_answer():
    """Triton calls jit_cache_hook before a JIT compile (a true answer skips it) and
    jit_post_compile_hook after: the watch times the compile between the two, answers what
    the hook it chained answers, and puts both hooks back on exit."""
    previous = (triton.knobs.runtime.jit_cache_hook, triton.knobs.runtime.jit_post_compile_hook)
    triton.knobs.runtime.jit_cache_hook = lambda **kw: kw["repr"] == "cached[...]"
    try:
        with CompileWatch() as watch:
            hooks = triton.knobs.runtime
            assert not hooks.jit_cache_hook(repr="_gdpa_fwd[num_warps=4](...)")
            time.sleep(0.05)  # the compile
            hooks.jit_post_compile_hook(repr="_gdpa_fwd[num_warps=4](...)",
                                        fn=SimpleNamespace(name="_gdpa_fwd"))
            assert hooks.jit_cache_hook(repr="cached[...]") is True  # the chained hook's skip
            totals = watch.totals()
        assert totals.triton_kernels == 1 and 0.05 <= totals.triton_s < 5
        assert totals.summary(2.5) == {"perf/compile_s_torch": totals.torch_s,
                                       "perf/torch_graphs_compiled":
                                       float(totals.dynamo_graphs),
                                       "perf/compile_s_triton": totals.triton_s,
                                       "perf/triton_kernels_compiled": 1.0,
                                       "perf/tuning_s_gdpa": 2.5}
        assert triton.knobs.runtime.jit_cache_hook(repr="cached[...]") is True  # restored
    finally:
        triton.knobs.runtime.jit_cache_hook, triton.knobs.runtime.jit_post_compile_hook = previous


def test_totals_add_up_torch_compile_seconds_forward_and_backward():
    torch._dynamo.reset()
    layer = torch.nn.Linear(4, 4)
    f = torch.compile(lambda x: torch.sin(layer(x)), backend="aot_eager", dynamic=False)
    with CompileWatch() as watch:
        f(torch.ones(2, 4)).sum().backward()
        totals = watch.totals()
    assert totals.dynamo_graphs == 1 and 0 < totals.torch_s < 120


def test_events_describe_many_kernels_briefly():
    e = CompileEvents(0, [f"k{i}" for i in range(6)])
    assert e.count == 6 and e.describe() == "6 Triton kernel(s) (k0, k1, k2, k3, ...) compiled"


@pytest.mark.parametrize("warmup", [0, 1])
def test_training_reports_compiles_past_the_warm_up(tmp_path, monkeypatch, warmup):
    monkeypatch.chdir(tmp_path)
    torch._dynamo.reset()
    tree = tiny_tree(tmp_path / "data", seq_layers=1, steps=3, log_every=3, eval_max_samples=64,
                     perf_warmup_steps=warmup, compile=True, compile_backend="aot_eager")
    lines: list[str] = []
    _, summary = train_losses(tree, echo=lambda event: lines.append(str(event)))
    late = [line for line in lines if "after the warm-up" in line]
    if warmup == 0:  # the first step's compiles count: no step was left to warm up
        assert summary["perf/compiles_after_warmup"] >= 3
        assert late and late[0].startswith("step 1: 3 torch.compile graph(s)"), late
    else:
        assert summary["perf/compiles_after_warmup"] == 0 and not late, late
    # what the start-up was made of: torch.compile's seconds; no Triton or tuning on CPU
    assert summary["perf/compile_s_torch"] > 0
    assert summary["perf/triton_kernels_compiled"] == summary["perf/tuning_s_gdpa"] == 0
