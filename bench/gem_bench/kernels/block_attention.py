"""Block attention (64-token blocks, RoPE fused) against the ways to get the same job done
without it, forward and forward+backward, on the same jagged inputs in the same run.

Reproduce (H200; results committed as docs/bench/block_attention.json):
    PYTHONPATH=kernels:platform:bench python -m gem_bench.kernels.block_attention --out $OUT

Variants (RoPE, base 10000, is part of every one except the *_norope rows):
- ours: ``block_attention(..., rope=RopeConfig())``, RoPE inside the kernels, launch settings
  tuned once per shape class (autograd.use_autotune); ``ours_norope`` shows what RoPE costs.
- sdpa_blocks: a separate RoPE op (rotate-half fused into one kernel per tensor by
  torch.compile), then every sequence padded to a multiple of 64 and reshaped into
  (num_blocks, H, 64, d) for F.scaled_dot_product_attention. When no block is partial the
  reshape is a view and SDPA runs unmasked (flash); otherwise the pad/unpad copies are timed
  and a key-padding mask is passed (which moves SDPA off its flash backend).
  ``sdpa_blocks_norope`` is the same without RoPE, for comparison with the issue's figure.
- flex_blocks: the same RoPE op, then compiled FlexAttention over the whole jagged batch as one
  (1, H, T, d) sequence with a block mask "same 64-block" (block mask built outside timing,
  as a model builds it once per batch for all layers).
- jfa_sliding: the same RoPE op, then the jagged flash attention op with window (32, 31), i.e.
  64 keys per query like a block; recorded as unavailable when its Triton path is absent.

Every measurement has two rows: eager (direction "fwd", "fwd+bwd": what a model sees,
host launch overhead included) and "[graph]" (the same calls replayed as one CUDA graph:
device time only). Our block plan is cached per offsets tensor, so it is built once per batch
and not inside the timed region, like the FlexAttention block mask.

Counting: useful FLOPs = 4 * sum over blocks of (real block length)^2 * H * d forward, 2.5x
that backward (3.5x for fwd+bwd); padding done by a baseline is never counted as useful.
jfa_sliding's useful FLOPs count its own window (64 keys per query, fewer at sequence ends).
HBM bytes are the op's minimum: forward reads q, k, v and writes o; backward reads q, k, v, dO
and writes dq, dk, dv (RoPE tables are tiny and L2-resident); the same count for every variant,
so frac_hbm is the fraction of the roofline each variant reaches.
The "layer" cases time a self-attention layer (QKV projection, attention, output projection),
forward+backward, with block64 (ours) against sliding-window JFA and SDPA on blocks.
The head_dim 64 case times ours (its launch settings tuned like the others) against SDPA only.
``--sweep`` times every launch setting the autotuner chooses from, per case and RoPE mode, next
to a device copy of the same byte count (the practical ceiling) and an empty graph replay.
"""

from __future__ import annotations

import argparse
import math
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from gem_bench.kernels.common import (
    BenchRow,
    add_ratios,
    fill_rates,
    graph_replay_ms,
    print_table,
    time_ms,
    write_json,
)
from gem_kernels.block_attention import (
    RopeConfig,
    RopeTables,
    block_attention,
    build_rope_tables,
)
from gem_kernels.testing import lognormal_lengths, offsets_from_lengths

BLOCK = 64
ROPE = RopeConfig(10000.0)
DTYPE = torch.bfloat16


@dataclass
class Case:
    name: str
    lengths: list[int]
    heads: int
    dim: int = 128


def _cases(quick: bool) -> list[Case]:
    if quick:
        return [Case("fixed_B4_L1024_H4", [1024] * 4, 4),
                Case("longtail_B16_H8", _multiple_of(lognormal_lengths(16, 400, 4096, 8), 128),
                     8)]
    tail = _multiple_of(lognormal_lengths(64, 1024, 4096, min_len=8, sigma=1.0, seed=0), 128)
    return [Case("fixed_B16_L4096_H4", [4096] * 16, 4),
            Case("longtail_B64_max4096_H4", tail, 4),
            Case("longtail_B64_max4096_H8", tail, 8),
            Case("longtail_B64_max4096_H8_d64", tail, 8, 64)]


def _multiple_of(lengths: list[int], m: int) -> list[int]:
    """Trim the longest sequence so the total is a multiple of m (FlexAttention wants it)."""
    lengths = list(lengths)
    i = max(range(len(lengths)), key=lengths.__getitem__)
    lengths[i] -= sum(lengths) % m
    return lengths


def block_flops(lengths: list[int], heads: int, dim: int) -> float:
    per_seq = 0
    for n in lengths:
        full, rest = divmod(n, BLOCK)
        per_seq += full * BLOCK * BLOCK + rest * rest
    return 4.0 * per_seq * heads * dim


def window_flops(lengths: list[int], heads: int, dim: int, left: int, right: int) -> float:
    pairs = 0
    for n in lengths:
        for i in range(n):
            pairs += min(n - 1, i + right) - max(0, i - left) + 1
    return 4.0 * pairs * heads * dim


def rope_eager(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Separate RoPE ops (rotate-half, as in the kernel); cos/sin: (T, 1, d/2) in x's dtype."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


_ROPE_FUSED: Callable | None = None


def rope_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The baselines' separate RoPE op: rope_eager fused into one kernel by torch.compile."""
    global _ROPE_FUSED
    if _ROPE_FUSED is None:
        _ROPE_FUSED = torch.compile(rope_eager)
    return _ROPE_FUSED(x, cos, sin)


class Inputs:
    """One jagged batch and everything a variant precomputes once per batch."""

    def __init__(self, case: Case, device: torch.device, seed: int = 0) -> None:
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.case = case
        self.total = sum(case.lengths)
        shape = (self.total, case.heads, case.dim)
        self.q, self.k, self.v, self.dout = (
            torch.randn(shape, generator=g).to(device=device, dtype=DTYPE) for _ in range(4))
        self.offsets = offsets_from_lengths(case.lengths, device)
        pos = torch.cat([torch.arange(n) for n in case.lengths]).to(device)
        tables = build_rope_tables(max(case.lengths), case.dim, ROPE.base, device)
        self.cos = tables.cos[pos][:, None, :].to(DTYPE)
        self.sin = tables.sin[pos][:, None, :].to(DTYPE)
        nblocks = [math.ceil(n / BLOCK) for n in case.lengths]
        self.num_blocks = sum(nblocks)
        self.partial = any(n % BLOCK for n in case.lengths)
        blk, slot, base, bb = [], [], 0, 0
        for n, nb in zip(case.lengths, nblocks, strict=True):
            j = torch.arange(n)
            blk.append(bb + j // BLOCK)
            slot.append(j % BLOCK)
            base += n
            bb += nb
        block_id = torch.cat(blk)
        self.flat = (block_id * BLOCK + torch.cat(slot)).to(device)
        valid = torch.zeros(self.num_blocks * BLOCK, dtype=torch.bool)
        valid[self.flat.cpu()] = True
        self.key_mask = valid.view(self.num_blocks, 1, 1, BLOCK).to(device)
        self.block_id = block_id.to(device=device, dtype=torch.int32)
        self._flex_mask = None

    def grads(self) -> tuple[torch.Tensor, ...]:
        return tuple(x.detach().requires_grad_() for x in (self.q, self.k, self.v))

    def flex_mask(self):  # noqa: ANN201
        if self._flex_mask is None:
            from torch.nn.attention.flex_attention import create_block_mask

            bid = self.block_id

            def same_block(b, h, qi, ki):  # noqa: ANN001, ANN202
                return bid[qi] == bid[ki]

            self._flex_mask = create_block_mask(same_block, 1, 1, self.total, self.total,
                                                device=self.q.device)
        return self._flex_mask


# ---- attention variants: (q, k, v) un-rotated (T, H, d) -> (T, H, d) -------------------------

def attn_ours(x: Inputs) -> Callable:
    return lambda q, k, v: block_attention(q, k, v, x.offsets, rope=ROPE)


def attn_ours_norope(x: Inputs) -> Callable:
    return lambda q, k, v: block_attention(q, k, v, x.offsets)


def attn_ours_abs(x: Inputs) -> Callable:
    """RoPE from precomputed RopeTables (bf16): the absolute-position path, one table tile per
    work item read at the block's positions in its sequence."""
    t = build_rope_tables(max(x.case.lengths), x.case.dim, ROPE.base, x.q.device)
    rope = RopeTables(t.cos.to(DTYPE), t.sin.to(DTYPE))
    return lambda q, k, v: block_attention(q, k, v, x.offsets, rope=rope)


def attn_sdpa_blocks(x: Inputs, rope: bool = True) -> Callable:
    nb, h, d = x.num_blocks, x.case.heads, x.case.dim

    def to_blocks(t: torch.Tensor) -> torch.Tensor:
        if not x.partial:
            return t.view(nb, BLOCK, h, d).transpose(1, 2)
        padded = t.new_zeros(nb * BLOCK, h, d).index_copy(0, x.flat, t)
        return padded.view(nb, BLOCK, h, d).transpose(1, 2)

    def fn(q, k, v):  # noqa: ANN001, ANN202
        if rope:
            q, k = rope_op(q, x.cos, x.sin), rope_op(k, x.cos, x.sin)
        mask = x.key_mask if x.partial else None
        o = F.scaled_dot_product_attention(to_blocks(q), to_blocks(k), to_blocks(v),
                                           attn_mask=mask)
        o = o.transpose(1, 2).reshape(nb * BLOCK, h, d)
        return o if not x.partial else o[x.flat]

    return fn


def attn_sdpa_blocks_norope(x: Inputs) -> Callable:
    return attn_sdpa_blocks(x, rope=False)


_FLEX = None


def attn_flex_blocks(x: Inputs) -> Callable:
    global _FLEX
    from torch.nn.attention.flex_attention import flex_attention

    if _FLEX is None:
        _FLEX = torch.compile(flex_attention, dynamic=False)
    mask = x.flex_mask()

    def fn(q, k, v):  # noqa: ANN001, ANN202
        q, k = rope_op(q, x.cos, x.sin), rope_op(k, x.cos, x.sin)
        o = _FLEX(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), block_mask=mask)
        return o[0].transpose(0, 1)

    return fn


JFA_WINDOW = (32, 31)


def attn_jfa_sliding(x: Inputs) -> Callable:
    from gem_kernels.jagged_attention import jagged_attention

    max_len = max(x.case.lengths)

    def fn(q, k, v):  # noqa: ANN001, ANN202
        q, k = rope_op(q, x.cos, x.sin), rope_op(k, x.cos, x.sin)
        return jagged_attention(q, k, v, x.offsets, max_len, window=JFA_WINDOW,
                                kernel="triton")

    return fn


def jfa_status(device: torch.device) -> str | None:
    """None when the sliding-window JFA Triton path runs and agrees with its reference."""
    try:
        from gem_kernels.jagged_attention import jagged_attention, jagged_attention_reference

        g = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(200, 2, 128, generator=g).to(device, DTYPE) for _ in range(3))
        off = offsets_from_lengths([70, 130], device)
        out = jagged_attention(q, k, v, off, 130, window=JFA_WINDOW, kernel="triton")
        ref = jagged_attention_reference(q.float(), k.float(), v.float(), off, 130,
                                         window=JFA_WINDOW)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        return None if err < 3e-2 else f"wrong result (rel err {err:.2e})"
    except Exception as e:  # noqa: BLE001 - any failure means the baseline is unavailable
        return f"unavailable: {type(e).__name__}: {str(e)[:200]}"


# ---- timing -----------------------------------------------------------------------------------

def _fwd(fn: Callable, x: Inputs) -> Callable:
    return lambda: fn(x.q, x.k, x.v)


def _fwd_bwd(fn: Callable, x: Inputs) -> Callable:
    q, k, v = x.grads()

    def run():  # noqa: ANN202
        out = fn(q, k, v)
        return torch.autograd.grad(out, (q, k, v), x.dout)

    return run


def _measure(fn: Callable[[], object], case: str, variant: str, direction: str, flops: float,
             nbytes: float | None, rows: list[BenchRow], notes: dict) -> None:
    """One eager row (as a model calls it) and one [graph] row (launch overhead removed)."""
    t0 = time.time()
    fn()
    torch.cuda.synchronize()
    row = fill_rates(BenchRow(case, variant, direction, time_ms(fn)), flops, nbytes)
    row.extra["setup_s"] = round(time.time() - t0, 1)
    rows.append(row)
    try:
        rows.append(fill_rates(BenchRow(case, variant, direction + "[graph]", graph_replay_ms(fn)),
                               flops, nbytes))
    except Exception as e:  # noqa: BLE001 - not every baseline can be captured
        notes.setdefault("errors", []).append(f"{case}/{variant}/{direction}[graph]: "
                                              f"{type(e).__name__}: {str(e)[:200]}")


def bench_attention(x: Inputs, variants: dict[str, Callable], rows: list[BenchRow],
                    notes: dict) -> None:
    c = x.case
    fl = block_flops(c.lengths, c.heads, c.dim)
    tok_bytes = x.total * c.heads * c.dim * 2
    for name, make in variants.items():
        flops = fl if name != "jfa_sliding" else window_flops(c.lengths, c.heads, c.dim,
                                                              *JFA_WINDOW)
        try:
            fn = make(x)
            for direction, wrap, mult, nbytes in (("fwd", _fwd, 1.0, 4 * tok_bytes),
                                                  ("fwd+bwd", _fwd_bwd, 3.5, 11 * tok_bytes)):
                _measure(wrap(fn, x), c.name, name, direction, flops * mult, nbytes, rows,
                         notes)
        except Exception as e:  # noqa: BLE001 - record and go on with the other variants
            notes.setdefault("errors", []).append(f"{c.name}/{name}: {type(e).__name__}: {e}")
            traceback.print_exc()


def bench_layer(x: Inputs, attn: dict[str, Callable], rows: list[BenchRow], notes: dict
                ) -> None:
    """Self-attention layer fwd+bwd: x -> QKV projection -> attention -> output projection."""
    c = x.case
    model = c.heads * c.dim
    g = torch.Generator().manual_seed(2)
    dev = x.q.device
    hid = torch.randn(x.total, model, generator=g).to(dev, DTYPE).requires_grad_()
    w_qkv = (torch.randn(3 * model, model, generator=g) / math.sqrt(model)).to(dev, DTYPE)
    w_out = (torch.randn(model, model, generator=g) / math.sqrt(model)).to(dev, DTYPE)
    w_qkv.requires_grad_()
    w_out.requires_grad_()
    dy = torch.randn(x.total, model, generator=g).to(dev, DTYPE)
    proj_flops = 2.0 * x.total * model * 4 * model * 3  # fwd + bwd of both projections
    for name, make in attn.items():
        try:
            fn = make(x)

            def run(fn=fn):  # noqa: ANN001, ANN202
                qkv = F.linear(hid, w_qkv).view(x.total, 3, c.heads, c.dim)
                o = fn(qkv[:, 0], qkv[:, 1], qkv[:, 2])
                y = F.linear(o.reshape(x.total, model), w_out)
                return torch.autograd.grad(y, (hid, w_qkv, w_out), dy)

            af = (block_flops(c.lengths, c.heads, c.dim) if name != "jfa_sliding"
                  else window_flops(c.lengths, c.heads, c.dim, *JFA_WINDOW))
            _measure(run, c.name + "/layer", name, "fwd+bwd", proj_flops + 3.5 * af, None,
                     rows, notes)
        except Exception as e:  # noqa: BLE001
            notes.setdefault("errors", []).append(f"{c.name}/layer/{name}: {type(e).__name__}: {e}")
            traceback.print_exc()


def _sweep_cases(quick: bool) -> list[Case]:
    return _cases(quick) + ([] if quick else [Case("fixed_B16_L4096_H8_d64", [4096] * 16, 8,
                                                     64)])


def _name(meta: dict) -> str:
    name = f"c{meta['CTAS']}w{meta['num_warps']}s{meta['num_stages']}"
    return name + "".join(f"_{k.lower()}" for k in ("STRIDE", "VEC_PLAN", "HOIST", "SPLIT_PV")
                          if meta.get(k))


def _ceilings(x: Inputs, rows: list[BenchRow]) -> None:
    """What the memory system gives this case's byte count: one device copy of the same bytes
    (read + write = the forward's q, k, v, o), and the replay floor of a one-kernel graph."""
    c = x.case
    tok_bytes = x.total * c.heads * c.dim * 2
    src = torch.empty(tok_bytes, dtype=DTYPE, device=x.q.device).normal_()  # 2 x q's bytes
    dst = torch.empty_like(src)
    rows.append(fill_rates(BenchRow(c.name, "copy_same_bytes", "fwd[graph]",
                                    graph_replay_ms(lambda: dst.copy_(src))), None, 4 * tok_bytes))
    tiny = torch.empty(1, device=x.q.device)
    rows.append(BenchRow(c.name, "one_tiny_kernel", "fwd[graph]", graph_replay_ms(tiny.zero_)))
    print(f"{c.name:30s} copy of the same bytes {rows[-2].ms * 1e3:7.1f} us "
          f"(hbm {rows[-2].frac_hbm:.3f}); one tiny kernel {rows[-1].ms * 1e3:5.1f} us",
          flush=True)


def sweep(cases: list[Case], out: Path) -> None:
    """Time the forward under every setting of the autotuner's space (autograd.TUNE_SPACE)
    per RoPE mode, and the backward likewise (fwd+bwd minus the default forward), with longer
    timing than the autotuner, next to the copy ceiling of each case."""
    from gem_kernels.block_attention import autograd as ba

    ba.use_autotune(True)
    rows: list[BenchRow] = []
    modes = {"rel": (attn_ours, True, True), "norope": (attn_ours_norope, False, False),
             "abs": (attn_ours_abs, True, False)}
    for case in cases:
        x = Inputs(case, torch.device("cuda"))
        tok_bytes = x.total * case.heads * case.dim * 2
        fl = block_flops(case.lengths, case.heads, case.dim)
        _ceilings(x, rows)
        for mode, (make, rope, rel) in modes.items():
            if case.dim == 64 and mode == "abs":
                continue
            fn = make(x)
            key = ("fwd", case.dim, case.heads, rope, rel, False, DTYPE)
            for meta in ba.TUNE_SPACE["fwd"][case.dim]:
                meta = {k: v for k, v in meta.items() if k != "HOIST" or (rope and rel)}
                if meta in [r.extra.get("meta") for r in rows if r.case == case.name
                            and r.variant.startswith(mode + "_")]:
                    continue
                ba.TUNED[key] = meta
                name = f"{mode}_{_name(meta)}"
                try:
                    ms = graph_replay_ms(lambda fn=fn, x=x: fn(x.q, x.k, x.v), rep_ms=100)
                except Exception as e:  # noqa: BLE001 - out of resources and the like
                    print(case.name, name, "failed:", type(e).__name__, str(e)[:160])
                    continue
                row = fill_rates(BenchRow(case.name, name, "fwd[graph]", ms), fl, 4 * tok_bytes)
                row.extra["meta"] = meta
                rows.append(row)
                print(f"{case.name:30s} {name:40s} {ms * 1e3:8.1f} us  hbm {row.frac_hbm:.3f}",
                      flush=True)
            ba.TUNED.pop(key, None)
        fn = attn_ours(x)
        ba.TUNED[("fwd", case.dim, case.heads, True, True, False, DTYPE)] = \
            ba.DEFAULT_META[case.dim][0]
        fwd_ms = graph_replay_ms(_fwd(fn, x), rep_ms=100)
        key = ("bwd", case.dim, case.heads, True, True, False, DTYPE)
        if case.heads == 8 or case.dim == 128 and case.name.startswith("fixed"):
            for meta in ba.TUNE_SPACE["bwd"][case.dim]:
                ba.TUNED[key] = meta
                name = f"rel_bwd_{_name(meta)}"
                try:
                    ms = graph_replay_ms(_fwd_bwd(fn, x), rep_ms=100) - fwd_ms
                except Exception as e:  # noqa: BLE001
                    print(case.name, name, "failed:", type(e).__name__, str(e)[:160])
                    continue
                row = fill_rates(BenchRow(case.name, name, "bwd[graph]", ms), 2.5 * fl,
                                 7 * tok_bytes)
                row.extra["meta"] = meta
                rows.append(row)
                print(f"{case.name:30s} {name:40s} {ms * 1e3:8.1f} us  hbm {row.frac_hbm:.3f}",
                      flush=True)
            ba.TUNED.pop(key, None)
        write_json(rows, out / "block_attention_sweep.json",
                   {w: {str(d): v for d, v in sp.items()} for w, sp in ba.TUNE_SPACE.items()})
        del x, fn
        torch.cuda.empty_cache()
    for case in cases:
        mine = [r for r in rows if r.case == case.name]
        for mode in ("rel", "norope", "abs", "rel_bwd"):
            best = min((r for r in mine if r.variant.startswith(mode + "_")
                        and (mode == "rel_bwd") == ("_bwd_" in r.variant)),
                       key=lambda r: r.ms, default=None)
            if best is not None:
                print(f"best {case.name} {mode}: {best.variant} {best.ms * 1e3:.1f} us "
                      f"frac_hbm {best.frac_hbm:.3f}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench_out", help="directory for block_attention.json")
    p.add_argument("--quick", action="store_true", help="small inputs, fewer cases")
    p.add_argument("--no-layer", action="store_true", help="skip the self-attention layer")
    p.add_argument("--sweep", action="store_true",
                   help="only time every launch setting of the autotuner's space per case, "
                        "head_dim 64 included (no baselines)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    if args.sweep:
        sweep(_sweep_cases(args.quick), Path(args.out))
        return
    from gem_kernels.block_attention import autograd as ba_autograd

    dev = torch.device("cuda")
    notes: dict = {"block": BLOCK, "dtype": str(DTYPE), "rope_base": ROPE.base,
                   "jfa_window": list(JFA_WINDOW), "default_meta": {
                       str(k): v for k, v in ba_autograd.DEFAULT_META.items()}}
    jfa = jfa_status(dev)
    notes["jfa_sliding"] = jfa or "available"
    rows: list[BenchRow] = []
    out = Path(args.out) / "block_attention.json"

    ba_autograd.use_autotune(True)
    variants = {"ours": attn_ours, "ours_norope": attn_ours_norope, "ours_abs": attn_ours_abs,
                "sdpa_blocks": attn_sdpa_blocks, "sdpa_blocks_norope": attn_sdpa_blocks_norope,
                "flex_blocks": attn_flex_blocks}
    if jfa is None:
        variants["jfa_sliding"] = attn_jfa_sliding
    layer = {k: variants[k] for k in ("ours", "sdpa_blocks", "jfa_sliding") if k in variants}
    for case in _cases(args.quick):
        x = Inputs(case, dev)
        notes.setdefault("cases", {})[case.name] = {
            "B": len(case.lengths), "H": case.heads, "d": case.dim, "tokens": x.total,
            "blocks": x.num_blocks, "max_len": max(case.lengths),
            "mean_len": round(x.total / len(case.lengths), 1),
            "partial_blocks": sum(1 for n in case.lengths if n % BLOCK)}
        if case.dim == 64:  # launch settings for head_dim 64: ours against SDPA only
            bench_attention(x, {k: variants[k] for k in ("ours", "ours_norope", "sdpa_blocks")},
                            rows, notes)
        else:
            bench_attention(x, variants, rows, notes)
            if not args.no_layer:
                bench_layer(x, layer, rows, notes)
        notes["tuned_launch"] = {str(k): v for k, v in ba_autograd.TUNED.items()}
        write_json(rows, out, notes)  # after every case, so a cut-off run still reports
        del x
        torch.cuda.empty_cache()
    for base in ("sdpa_blocks", "flex_blocks", "jfa_sliding"):
        for r in rows:
            r.ratio_to_baseline = None
        add_ratios(rows, "ours", base)
        notes[f"ours_vs_{base}"] = {f"{r.case}/{r.direction}": round(r.ratio_to_baseline, 3)
                                    for r in rows if r.variant == "ours"
                                    and r.ratio_to_baseline is not None}
    for r in rows:
        r.ratio_to_baseline = None
    add_ratios(rows, "ours", "sdpa_blocks")
    write_json(rows, out, notes)
    print_table(rows, "block attention (bf16, RoPE in every variant; ratio = sdpa_blocks / ours)")
    for base in ("flex_blocks", "jfa_sliding"):
        print(f"ours speed-up vs {base}: {notes[f'ours_vs_{base}']}")
    if notes.get("errors"):
        print("errors:", *notes["errors"], sep="\n  ")
    print("jfa_sliding:", notes["jfa_sliding"])


if __name__ == "__main__":
    main()
