"""Registers, spills and matrix instructions of the GDPA backward kernels on Hopper, read on any
machine: Triton compiles the kernel for sm_90 without a GPU and its bundled ptxas reports
the resources, so a tile or pipeline change can be judged before a GPU run. The ptxas figures
quoted in gdpa/DESIGN.md come from here:

    PYTHONPATH=kernels python -m gem_kernels.gdpa.resources [--short-q]

Needs TRITON_INTERPRET unset (under the interpreter the kernels are never compiled).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, replace

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from gem_kernels.dispatch import interpreting
from gem_kernels.gdpa.activations import ACT_CODE, scale_args
from gem_kernels.gdpa.triton_bwd import (
    DqMode,
    _gdpa_dkdv_kernel,
    _gdpa_dq_kernel,
    one_pass_config,
    short_q_stream_config,
)
from gem_kernels.gdpa.triton_common import TileConfig

HOPPER = ("cuda", 90, 64)  # triton GPUTarget(backend, arch, warp size)

_STRIDES = ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh",
            "stride_dot", "stride_doh")


@dataclass(frozen=True)
class KernelResources:
    """What ptxas (sm_90a) reports for one compiled kernel, and its MMA instructions."""

    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    shared_bytes: int
    wgmma: int  # warpgroup MMAs (wgmma.mma_async) in the PTX
    mma_sync: int  # warp-level MMAs (mma.sync), Hopper's slower path


def dkdv_resources(cfg: TileConfig, with_dq: DqMode, head_dim: int = 128,
                   activation: str = "gelu_tanh", scale: float | None = None,
                   stages: int | None = None) -> KernelResources:
    """Compiles _gdpa_dkdv_kernel for sm_90 with bf16 inputs, 16-byte aligned pointers and
    strides, as the launcher would for cfg and with_dq (see the kernel); stages overrides
    cfg.num_stages as the phased launcher does."""
    act = ACT_CODE[activation]
    scale = head_dim ** -0.5 if scale is None else scale
    stages = cfg.num_stages if stages is None else stages
    fold, cscale = scale_args(act, scale, torch.bfloat16, cfg.scale_mode)
    consts = dict(ACT=act, NORM=0, D=head_dim, BN=cfg.block_rows, BM=cfg.block_cols,
                  STAGES=stages, PREFETCH=cfg.prefetch, PREC="tf32", WITH_DQ=int(with_dq),
                  FOLD=fold, CSCALE=cscale, DQ_T=cfg.dq_transposed)
    pointers = {"Q": "bf16", "K": "bf16", "V": "bf16", "DO": "bf16", "DK": "bf16",
                "DV": "bf16", "DQ": "bf16", "DQ32": "fp32", "items": "i32", "prog_ptr": "i32"}
    return _resources(_gdpa_dkdv_kernel, consts, pointers, cfg.num_warps, stages)


def short_q_stream_resources(max_q: int, head_dim: int = 128,
                             activation: str = "gelu_tanh") -> KernelResources:
    """Compiles the SHORT_Q_STREAM backward (_gdpa_dq_kernel with WITH_DKDV) for sm_90 with
    bf16 inputs as the launcher would for short_q_stream_config(max_q, head_dim)."""
    cfg = short_q_stream_config(max_q, head_dim)
    act = ACT_CODE[activation]
    fold, cscale = scale_args(act, head_dim ** -0.5, torch.bfloat16, cfg.scale_mode)
    consts = dict(ACT=act, NORM=0, D=head_dim, BM=cfg.block_rows, BN=cfg.block_cols,
                  STAGES=cfg.num_stages, PREFETCH=cfg.prefetch, PREC="tf32", FOLD=fold,
                  CSCALE=cscale, WITH_DKDV=True)
    pointers = {"Q": "bf16", "K": "bf16", "V": "bf16", "DO": "bf16", "DQ": "bf16",
                "DK": "bf16", "DV": "bf16", "items": "i32", "prog_ptr": "i32"}
    return _resources(_gdpa_dq_kernel, consts, pointers, cfg.num_warps, cfg.num_stages)


def _resources(fn, consts: dict, pointers: dict, num_warps: int, stages: int
               ) -> KernelResources:
    """Compiles fn for sm_90 (16-byte aligned pointers and strides, fp32 scalars) and reads
    ptxas's report for sm_90a."""
    if interpreting():
        raise RuntimeError("the resource reports compile for the GPU: unset TRITON_INTERPRET")
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*" + pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in _STRIDES:
            signature[name] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32"
    src = ASTSource(fn, signature, constexprs=consts, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget(*HOPPER),
                            options=dict(num_warps=num_warps, num_stages=stages))
    ptx = kernel.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        log = subprocess.run([triton.knobs.nvidia.ptxas.path, "--gpu-name=sm_90a", "-v",
                              f.name, "-o", os.devnull], capture_output=True, text=True,
                             check=True)
    report = log.stdout + log.stderr
    regs = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    if regs is None or spills is None:
        raise RuntimeError(f"unexpected ptxas report:\n{report[-2000:]}")
    return KernelResources(int(regs.group(1)), int(spills.group(1)), int(spills.group(2)),
                           int(kernel.metadata.shared), len(re.findall(r"wgmma\.mma_async", ptx)),
                           len(re.findall(r"mma\.sync", ptx)))


def print_short_q_stream(activation: str) -> None:
    """Resources of the SHORT_Q_STREAM backward per query tile and head dim."""
    print(f"{'short_q_stream':20s} {'d':>4s} {'regs':>5s} {'spill st/ld':>12s} {'shared':>7s}")
    for d in (64, 128):
        for max_q in (16, 32, 64):
            cfg = short_q_stream_config(max_q, d)
            r = short_q_stream_resources(max_q, d, activation)
            name = (f"{cfg.block_rows}x{cfg.block_cols} w{cfg.num_warps} s{cfg.num_stages}")
            print(f"{name:20s} {d:4d} {r.registers:5d} "
                  f"{r.spill_store_bytes:5d}/{r.spill_load_bytes:<6d} {r.shared_bytes:7d}",
                  flush=True)


def main(argv: list[str] | None = None) -> None:
    """Prints the resources of every phase of the long-KV backward plans the op tunes (or,
    with --short-q, of the short_q_stream backward)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--activation", default="gelu_tanh")
    ap.add_argument("--short-q", action="store_true",
                    help="the short_q_stream backward per query tile instead")
    args = ap.parse_args(argv)
    if args.short_q:
        print_short_q_stream(args.activation)
        return
    base = one_pass_config(2048, 2048, args.head_dim)
    phases = {DqMode.ATOMIC: "atomic / middle", DqMode.PHASE_FIRST: "first",
              DqMode.PHASE_LAST: "last", DqMode.PHASE_LAST_HOISTED: "last, hoisted"}
    print(f"{'config':34s} {'phase':16s} {'stages':>6s} {'regs':>5s} {'spill st/ld':>12s} "
          f"{'shared':>7s} {'wgmma':>6s} {'mma.sync':>8s}")
    for cfg in (base, replace(base, num_stages=4), replace(base, dq_transposed=False)):
        name = (f"{cfg.block_rows}x{cfg.block_cols} w{cfg.num_warps} s{cfg.num_stages}"
                f"{' dq_transposed' if cfg.dq_transposed else ''}")
        for with_dq, phase in phases.items():
            stages = min(cfg.num_stages, 2) if with_dq is DqMode.PHASE_LAST else cfg.num_stages
            r = dkdv_resources(cfg, with_dq, args.head_dim, args.activation, stages=stages)
            print(f"{name:34s} {phase:16s} {stages:6d} {r.registers:5d} "
                  f"{r.spill_store_bytes:5d}/{r.spill_load_bytes:<6d} {r.shared_bytes:7d} "
                  f"{r.wgmma:6d} {r.mma_sync:8d}", flush=True)


if __name__ == "__main__":
    main()
