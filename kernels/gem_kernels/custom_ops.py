"""The attention ops as torch.library custom ops, so that torch.compile sees each as one opaque
node instead of tracing into its host-side scheduling (graph breaks) and Triton launches.

    torch.ops.gem.jagged_attention  / jagged_attention(...)   (wraps jagged_attention)
    torch.ops.gem.block_attention   / block_attention(...)    (wraps block_attention)
    torch.ops.gem.gdpa              / gdpa(...)               (wraps gdpa)

Each op has a fake (meta) function, so a compiled region traces it with symbolic token counts
(no recompilation when the number of tokens changes), and autograd registered through
``register_autograd``: the backward is a custom op too. Jagged attention on its Triton path
keeps the kernel's log-sum-exp from the forward and runs the Triton backward on it; the other
ops (and every op on its PyTorch reference) rerun the public op under autograd in the
backward and return its input gradients: one extra forward, no saved state.

The wrappers below take the same arguments as the public ops; q, k and v are cast to one dtype
first (autocast's inside an autocast region, as the public ops do), outside the op, so the fake
functions only need the output's shape and dtype: those of q.
"""

from __future__ import annotations

import math

import torch

from gem_kernels.block_attention import RopeConfig
from gem_kernels.block_attention import block_attention as _block_attention
from gem_kernels.dispatch import Kernel, resolve_kernel, same_dtype
from gem_kernels.gdpa import gdpa as _gdpa
from gem_kernels.jagged_attention import jagged_attention as _jagged_attention
from gem_kernels.jagged_attention import op as _jfa_impl
from gem_kernels.jagged_attention.schedule import ScheduleCache

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

NO_WINDOW = -1  # window_left / window_right value meaning "no window"
NO_ROPE = 0.0  # rope_base value meaning "no RoPE"


def _unaliased(grads: Grads, *inputs: torch.Tensor) -> Grads:
    """``grads`` with every tensor that shares storage with an input or an earlier gradient
    copied: a custom op's outputs may alias neither its inputs nor each other (backward
    implementations may hand back views of one buffer, or ``grad_out`` itself)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
    out = []
    for g in grads:
        ptr = g.untyped_storage().data_ptr() if g.numel() else None
        if ptr is not None and ptr in seen:
            g = g.clone()
            ptr = g.untyped_storage().data_ptr()
        if ptr is not None:
            seen.add(ptr)
        out.append(g)
    return tuple(out)  # type: ignore[return-value]


def _regrad(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            grad_out: torch.Tensor) -> Grads:
    """Input gradients of ``fn(q, k, v)`` for ``grad_out``, by rerunning it under autograd.

    A custom op's implementation runs with the autograd dispatch keys excluded; they are let
    back in (the rest of the dispatch state kept) for the rerun."""
    exclude = torch._C._dispatch_tls_local_exclude_set().remove(
        torch._C.DispatchKey.AutogradFunctionality)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), \
            torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out = fn(*leaves)
        dq, dk, dv = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
    grads = tuple(torch.zeros_like(x) if g is None else g.to(x.dtype)
                  for g, x in zip((dq, dk, dv), (q, k, v), strict=True))
    return _unaliased(grads, q, k, v, grad_out)  # type: ignore[arg-type]


def _window(left: int, right: int) -> tuple[int, int] | None:
    return None if left == NO_WINDOW else (left, right)


# --- jagged (flash) attention -----------------------------------------------------------------
# On the Triton path the forward returns the kernel's log-sum-exp beside the output and the
# backward runs the Triton backward on them (no recomputed forward); on the reference path the
# log-sum-exp is empty and the backward reruns the reference under autograd.

def _jfa_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str) -> bool:
    """Whether the public op would take its Triton kernels for these inputs (fake ones too)."""
    return resolve_kernel(kernel, q, k, v, unsupported=_jfa_impl.triton_unsupported(q),
                          op="jagged_attention") is Kernel.TRITON


def _jfa_triton_args(q, k, v, offsets):
    q, k, v = _jfa_impl._rows_ok(q), _jfa_impl._rows_ok(k), _jfa_impl._rows_ok(v)
    offsets = offsets.to(device=q.device, dtype=torch.int64).contiguous()
    return q, k, v, offsets, ScheduleCache(offsets, q.shape[0])


@torch.library.custom_op("gem::jagged_attention", mutates_args=())
def _jfa_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
            max_len: int, causal: bool, window_left: int, window_right: int, scale: float,
            kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    window = _window(window_left, window_right)
    with torch.no_grad():
        if _jfa_triton(q, k, v, kernel):
            q, k, v, offsets, sched = _jfa_triton_args(q, k, v, offsets)
            return _jfa_impl.jfa_forward(q, k, v, offsets, causal=causal, window=window,
                                         scale=scale, sched=sched)
        out = _jagged_attention(q, k, v, offsets, max_len, causal=causal, window=window,
                                scale=scale, kernel=kernel)
        return out, q.new_empty((0,), dtype=torch.float32)


@_jfa_op.register_fake
def _(q, k, v, offsets, max_len, causal, window_left, window_right, scale, kernel):
    if _jfa_triton(q, k, v, kernel):
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    else:
        lse = q.new_empty((0,), dtype=torch.float32)
    return torch.empty_like(q), lse


@torch.library.custom_op("gem::jagged_attention_backward", mutates_args=())
def _jfa_bwd_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                out: torch.Tensor, lse: torch.Tensor, offsets: torch.Tensor, max_len: int,
                causal: bool, window_left: int, window_right: int, scale: float, kernel: str
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    window = _window(window_left, window_right)
    if _jfa_triton(q, k, v, kernel):
        q, k, v, offsets, sched = _jfa_triton_args(q, k, v, offsets)
        grads = _jfa_impl.jfa_backward(grad_out, q, k, v, out, lse, offsets, causal=causal,
                                       window=window, scale=scale, sched=sched)
        return _unaliased(tuple(grads), grad_out, q, k, v, out, lse)  # type: ignore[arg-type]
    return _regrad(lambda a, b, c: _jagged_attention(a, b, c, offsets, max_len, causal=causal,
                                                     window=window, scale=scale, kernel=kernel),
                   q, k, v, grad_out)


@_jfa_bwd_op.register_fake
def _(grad_out, q, k, v, out, lse, offsets, max_len, causal, window_left, window_right, scale,
      kernel):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _jfa_setup(ctx, inputs, output) -> None:
    q, k, v, offsets, max_len, causal, wl, wr, scale, kernel = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, offsets)
    ctx.args = (max_len, causal, wl, wr, scale, kernel)


def _jfa_backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, offsets = ctx.saved_tensors
    dq, dk, dv = _jfa_bwd_op(grad_out.contiguous(), q, k, v, out, lse, offsets, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None


_jfa_op.register_autograd(_jfa_backward, setup_context=_jfa_setup)


def jagged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                     max_len: int, *, causal: bool = False,
                     window: tuple[int, int] | None = None, scale: float | None = None,
                     kernel: str | None = None) -> torch.Tensor:
    """``gem_kernels.jagged_attention`` as the custom op ``gem::jagged_attention``."""
    q, k, v = same_dtype(q, k, v)
    wl, wr = (NO_WINDOW, NO_WINDOW) if window is None else (int(window[0]), int(window[1]))
    out, _ = _jfa_op(q, k, v, offsets, max_len, bool(causal), wl, wr,
                     float(scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])),
                     str(kernel or "auto"))
    return out


# --- 64-token block attention -----------------------------------------------------------------

def _rope(base: float) -> RopeConfig | None:
    return None if base == NO_ROPE else RopeConfig(base=base)


@torch.library.custom_op("gem::block_attention", mutates_args=())
def _block_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
              block: int, rope_base: float, scale: float, causal: bool,
              kernel: str) -> torch.Tensor:
    with torch.no_grad():
        return _block_attention(q, k, v, offsets, block=block, rope=_rope(rope_base),
                                scale=scale, causal=causal, kernel=kernel)


@_block_op.register_fake
def _(q, k, v, offsets, block, rope_base, scale, causal, kernel):
    return torch.empty_like(q)


@torch.library.custom_op("gem::block_attention_backward", mutates_args=())
def _block_bwd_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  offsets: torch.Tensor, block: int, rope_base: float, scale: float,
                  causal: bool, kernel: str
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rope = _rope(rope_base)
    return _regrad(lambda a, b, c: _block_attention(a, b, c, offsets, block=block, rope=rope,
                                                    scale=scale, causal=causal, kernel=kernel),
                   q, k, v, grad_out)


@_block_bwd_op.register_fake
def _(grad_out, q, k, v, offsets, block, rope_base, scale, causal, kernel):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _block_setup(ctx, inputs, output) -> None:
    q, k, v, offsets, *rest = inputs
    ctx.save_for_backward(q, k, v, offsets)
    ctx.args = tuple(rest)


def _block_backward(ctx, grad_out):
    q, k, v, offsets = ctx.saved_tensors
    dq, dk, dv = _block_bwd_op(grad_out.contiguous(), q, k, v, offsets, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


_block_op.register_autograd(_block_backward, setup_context=_block_setup)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                    *, block: int = 64, rope_base: float | None = None,
                    scale: float | None = None, causal: bool = False,
                    kernel: str | None = None) -> torch.Tensor:
    """``gem_kernels.block_attention`` as ``gem::block_attention``; RoPE by its base (None: no
    RoPE)."""
    q, k, v = same_dtype(q, k, v)
    return _block_op(q, k, v, offsets, int(block),
                     NO_ROPE if rope_base is None else float(rope_base),
                     float(scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])),
                     bool(causal), str(kernel or "auto"))


# --- GDPA ---------------------------------------------------------------------------------------

@torch.library.custom_op("gem::gdpa", mutates_args=())
def _gdpa_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor,
             kv_offsets: torch.Tensor, max_q: int, max_kv: int, activation: str, scale: float,
             norm: str, kernel: str) -> torch.Tensor:
    with torch.no_grad():
        return _gdpa(q, k, v, q_offsets, kv_offsets, max_q, max_kv, activation=activation,
                     scale=scale, norm=norm, kernel=kernel)


@_gdpa_op.register_fake
def _(q, k, v, q_offsets, kv_offsets, max_q, max_kv, activation, scale, norm, kernel):
    return torch.empty_like(q)


@torch.library.custom_op("gem::gdpa_backward", mutates_args=())
def _gdpa_bwd_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 q_offsets: torch.Tensor, kv_offsets: torch.Tensor, max_q: int, max_kv: int,
                 activation: str, scale: float, norm: str, kernel: str
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _regrad(lambda a, b, c: _gdpa(a, b, c, q_offsets, kv_offsets, max_q, max_kv,
                                         activation=activation, scale=scale, norm=norm,
                                         kernel=kernel),
                   q, k, v, grad_out)


@_gdpa_bwd_op.register_fake
def _(grad_out, q, k, v, q_offsets, kv_offsets, max_q, max_kv, activation, scale, norm, kernel):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _gdpa_setup(ctx, inputs, output) -> None:
    q, k, v, q_offsets, kv_offsets, *rest = inputs
    ctx.save_for_backward(q, k, v, q_offsets, kv_offsets)
    ctx.args = tuple(rest)


def _gdpa_backward(ctx, grad_out):
    q, k, v, q_offsets, kv_offsets = ctx.saved_tensors
    dq, dk, dv = _gdpa_bwd_op(grad_out.contiguous(), q, k, v, q_offsets, kv_offsets, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None, None


_gdpa_op.register_autograd(_gdpa_backward, setup_context=_gdpa_setup)


def gdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor,
         kv_offsets: torch.Tensor, max_q: int, max_kv: int, *, activation: str = "silu",
         scale: float | None = None, norm: str = "none",
         kernel: str | None = None) -> torch.Tensor:
    """``gem_kernels.gdpa`` as the custom op ``gem::gdpa``."""
    q, k, v = same_dtype(q, k, v)
    return _gdpa_op(q, k, v, q_offsets, kv_offsets, max_q, max_kv, activation,
                    float(scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])),
                    norm, str(kernel or "auto"))


__all__ = ["block_attention", "gdpa", "jagged_attention"]
