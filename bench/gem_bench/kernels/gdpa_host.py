"""Host time of one GDPA training call: what GDPAFunction.forward does on the host before and
around its kernel launch (the forward's schedule and the backward's, prebuilt), at the shapes
of recipes/h200.yaml's cross and pooled attention, and how many host->device copies it makes.

    PYTHONPATH=kernels:platform:bench python -m gem_bench.kernels.gdpa_host --out $OUT

Shapes (gem_platform.model.interaction, recipes/h200.yaml): batch 1024, histories log-normal
with mean 400, sigma 1.0, clipped to 16..2048 (seed 0), heads 2, head_dim 128, bf16,
silu; 8 context tokens per sample (the ad, the dense features and 6 sparse features:
user_id plus the 5 default ones) and 8 pooled queries. cross: Q = the history, KV = the
context; pooled: Q = the queries, KV = the history.

Every call gets fresh offsets tensors (a new batch: the schedule cache misses, as in
training). On a CPU the kernels are not launched and the copies are not made (the CPU path's
``to`` is a no-op), but the schedules are the CUDA path's: the device's program count is the
H200's (``--sms``, 132) unless the device is a GPU. Baseline in the same run
(``one_by_one``): the same schedules, each built and uploaded alone through schedule_for, as
calls did before they were planned together. ``copies`` counts the host->device transfers
the call asks for (calls of gem_kernels.host_offsets.host_to_device, which every schedule
upload goes through); on CUDA the profiler's count of cudaMemcpyAsync per call is added
(``memcpy_async``). Writes gdpa_host.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from gem_bench.kernels.common import BenchRow, add_ratios, print_table, write_json
from gem_kernels.gdpa import op
from gem_kernels.testing import lognormal_lengths, offsets_from_lengths

BATCH, HEADS, HEAD_DIM = 1024, 2, 128
CONTEXT_TOKENS, POOLED_QUERIES = 8, 8
MEAN, SIGMA, MIN_LEN, MAX_LEN = 400, 1.0, 16, 2048
H200_SMS = 132
PROGRAMS_ENV = "GEM_GDPA_INTERPRET_PROGRAMS"  # op.num_sms off CUDA


def lengths(seed: int = 0) -> list[int]:
    return lognormal_lengths(BATCH, MEAN, MAX_LEN, MIN_LEN, SIGMA, seed=seed)


def shaped(rows: int, device: torch.device) -> torch.Tensor:
    """A (rows, H, d) bf16 tensor without the memory: GDPA's host side reads shapes only."""
    return torch.empty(1, 1, 1, dtype=torch.bfloat16, device=device).expand(rows, HEADS,
                                                                           HEAD_DIM)


def case_args(case: str, hist: list[int], device: torch.device) -> tuple:
    """(q, k, q_offsets, kv_offsets, max_q, max_kv) of one call, offsets freshly made."""
    hist_off = offsets_from_lengths(hist)
    total, longest = int(hist_off[-1]), max(hist)
    if case == "cross":
        short = torch.arange(BATCH + 1, dtype=torch.int64) * CONTEXT_TOKENS
        return (shaped(total, device), shaped(BATCH * CONTEXT_TOKENS, device),
                _on(hist_off, device), _on(short, device), longest, CONTEXT_TOKENS)
    short = torch.arange(BATCH + 1, dtype=torch.int64) * POOLED_QUERIES
    return (shaped(BATCH * POOLED_QUERIES, device), shaped(total, device), _on(short, device),
            _on(hist_off, device), POOLED_QUERIES, longest)


def _on(offsets: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Device offsets whose host copy is remembered (as the model's are)."""
    from gem_kernels.host_offsets import host_to_device

    return host_to_device(offsets, device, remember=True)


def host_call(q, k, q_offsets, kv_offsets, max_q, max_kv, activation="silu"):
    """GDPAFunction.forward's host work for a call that needs gradients, without the
    launches (op.plan_call, the function GDPAFunction.forward runs)."""
    return op.plan_call(q, k, q_offsets, kv_offsets, max_q, max_kv, activation, None, None,
                        None, None, False, True)


def one_by_one(q, k, q_offsets, kv_offsets, max_q, max_kv, activation="silu"):
    """The baseline: the schedules plan_call asks for, each built and uploaded alone."""
    q_offsets = op._as_offsets(q_offsets, q.device)
    kv_offsets = op._as_offsets(kv_offsets, q.device)
    cfg = op._fwd_config(max_q, max_kv, q.shape[-1])
    mode = op._call_mode(q, k, q_offsets, max_q, max_kv, None, False)
    reqs = [op.forward_request(q_offsets, kv_offsets, cfg, max_kv),
            *op._prebuild_requests(mode, None, None, True, q, q_offsets, kv_offsets, max_q,
                                   max_kv, activation)]
    return [op.schedule_for(r.rows, r.cols, q.shape[1], r.cfg, q.device, r.cover, r.blocks)
            for r in reqs]


VARIANTS = {"plan_call": host_call, "one_by_one": one_by_one}


@contextmanager
def counting_copies(counter: list[int]):
    """Count host->device transfers requested through host_to_device (every module that
    imported it by name) while inside."""
    import sys

    from gem_kernels import host_offsets as ho

    orig = ho.host_to_device

    def counted(*args, **kwargs):
        counter[0] += 1
        return orig(*args, **kwargs)

    patched = [m for m in list(sys.modules.values())
               if m is not None and getattr(m, "__name__", "").startswith("gem_kernels")
               and getattr(m, "host_to_device", None) is orig]
    for m in patched:
        m.host_to_device = counted
    try:
        yield
    finally:
        for m in patched:
            m.host_to_device = orig


@contextmanager
def h200_programs(device: torch.device, sms: int):
    """On a CPU, schedules with the H200's program counts (op.num_sms reads them from
    GEM_GDPA_INTERPRET_PROGRAMS there)."""
    if device.type == "cuda":
        yield
        return
    before = os.environ.get(PROGRAMS_ENV)
    os.environ[PROGRAMS_ENV] = str(sms)
    try:
        yield
    finally:
        if before is None:
            del os.environ[PROGRAMS_ENV]
        else:
            os.environ[PROGRAMS_ENV] = before


def time_case(case: str, variant: str, device: torch.device, calls: int, warmup: int
              ) -> dict:
    hist, call = lengths(), VARIANTS[variant]
    ms, copies = [], []
    for i in range(warmup + calls):
        args = case_args(case, hist, device)  # fresh offsets: the cache misses
        counter = [0]
        if device.type == "cuda":
            torch.cuda.synchronize()
        with counting_copies(counter):
            t0 = time.perf_counter()
            call(*args)
            t1 = time.perf_counter()
        if i >= warmup:
            ms.append((t1 - t0) * 1e3)
            copies.append(counter[0])
    out = {"ms": statistics.median(ms), "ms_min": min(ms), "copies": max(copies),
           "calls": calls}
    if device.type == "cuda":
        out["memcpy_async"] = _cuda_memcpy_per_call(case, hist, device, call)
    return out


def _cuda_memcpy_per_call(case: str, hist: list[int], device: torch.device,
                          call=host_call) -> float:
    from torch.profiler import ProfilerActivity, profile

    n = 5
    argsets = [case_args(case, hist, device) for _ in range(n)]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for args in argsets:
            call(*args)
        torch.cuda.synchronize()
    count = sum(e.count for e in prof.key_averages() if e.key == "cudaMemcpyAsync")
    return count / n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for gdpa_host.json")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sms", type=int, default=H200_SMS,
                   help="SMs the CPU run schedules for (the H200's by default)")
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--label", default="", help="a note stored with the rows (e.g. a commit)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's); a loaded machine times "
                        "steadier with 1")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    rows = []
    with h200_programs(device, args.sms):
        for case in ("cross", "pooled"):
            for variant in VARIANTS:
                r = time_case(case, variant, device, args.calls, args.warmup)
                extra = {k: v for k, v in r.items() if k != "ms"}
                extra.update(label=args.label, threads=torch.get_num_threads(),
                             sms=args.sms if device.type != "cuda" else None,
                             batch=BATCH, heads=HEADS, head_dim=HEAD_DIM, device=str(device))
                rows.append(BenchRow(case=case, variant=variant, direction="fwd+bwd schedules",
                                     ms=r["ms"], extra=extra))
    add_ratios(rows, "plan_call", "one_by_one")
    print_table(rows, "GDPA host time per training call (forward + prebuilt backward)")
    for r in rows:
        print(f"{r.case} {r.variant}: {r.ms:.3f} ms/call (min {r.extra['ms_min']:.3f}), "
              f"{r.extra['copies']} host->device copies/call"
              + (f", {r.extra['memcpy_async']} cudaMemcpyAsync/call"
                 if "memcpy_async" in r.extra else ""))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(rows, out / "gdpa_host.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
