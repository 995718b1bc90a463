"""The attention ops as torch.library custom ops: same values and gradients as the public ops,
consistent fake functions and autograd (torch.library.opcheck), and a compiled function that
calls them traces once for inputs whose token counts differ (no graph break, no recompile)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from gem_kernels import custom_ops
from gem_kernels.block_attention import RopeConfig, block_attention
from gem_kernels.gdpa import gdpa
from gem_kernels.jagged_attention import jagged_attention

H, D = 2, 16


def _jagged(lengths: list[int], seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths), 0)
    q, k, v = (torch.randn(t, H, D, generator=g, dtype=dtype) for _ in range(3))
    return q, k, v, offsets


def _grads(fn, q, k, v):
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = fn(*leaves)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(g)
    return out.detach(), [x.grad for x in leaves]


CASES = {
    "jfa_causal": (lambda q, k, v, o, n: jagged_attention(q, k, v, o, n, causal=True),
                   lambda q, k, v, o, n: custom_ops.jagged_attention(q, k, v, o, n, causal=True)),
    "jfa_window": (lambda q, k, v, o, n: jagged_attention(q, k, v, o, n, window=(3, 0)),
                   lambda q, k, v, o, n: custom_ops.jagged_attention(q, k, v, o, n,
                                                                     window=(3, 0))),
    "block_rope": (lambda q, k, v, o, n: block_attention(q, k, v, o, block=64,
                                                         rope=RopeConfig(base=10000.0)),
                   lambda q, k, v, o, n: custom_ops.block_attention(q, k, v, o, block=64,
                                                                    rope_base=10000.0)),
    "gdpa_self": (lambda q, k, v, o, n: gdpa(q, k, v, o, o, n, n, activation="silu",
                                             norm="kv_len"),
                  lambda q, k, v, o, n: custom_ops.gdpa(q, k, v, o, o, n, n, activation="silu",
                                                        norm="kv_len")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_custom_op_equals_public_op(case):
    public, custom = CASES[case]
    lengths = [5, 0, 70, 1]
    q, k, v, offsets = _jagged(lengths)
    n = max(lengths)
    want, want_g = _grads(lambda a, b, c: public(a, b, c, offsets, n), q, k, v)
    got, got_g = _grads(lambda a, b, c: custom(a, b, c, offsets, n), q, k, v)
    torch.testing.assert_close(got, want)
    for a, b in zip(got_g, want_g, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("causal", [False, True])
def test_jagged_attention_triton_path_keeps_the_forward_statistics(causal):
    """On its Triton path (here the interpreter, fp16) the custom op keeps the kernel's
    log-sum-exp and runs the Triton backward: values and gradients equal the public op's."""
    lengths = [3, 0, 40, 1]
    q, k, v, offsets = _jagged(lengths, seed=3, dtype=torch.float16)
    n = max(lengths)
    out, lse = torch.ops.gem.jagged_attention(q, k, v, offsets, n, causal, -1, -1, 0.25,
                                              "triton")
    assert lse.shape == (H, sum(lengths)) and lse.dtype == torch.float32
    want, want_g = _grads(lambda a, b, c: jagged_attention(
        a, b, c, offsets, n, causal=causal, scale=0.25, kernel="triton"), q, k, v)
    got, got_g = _grads(lambda a, b, c: custom_ops.jagged_attention(
        a, b, c, offsets, n, causal=causal, scale=0.25, kernel="triton"), q, k, v)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    for a, b in zip(got_g, want_g, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_opcheck_fake_and_autograd_registrations():
    q, k, v, offsets = _jagged([3, 6])
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    checks = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.gem.jagged_attention.default,
                          (q, k, v, offsets, 6, True, -1, -1, 0.25, "pytorch"), test_utils=checks)
    torch.library.opcheck(torch.ops.gem.block_attention.default,
                          (q, k, v, offsets, 64, 0.0, 0.25, False, "pytorch"), test_utils=checks)
    torch.library.opcheck(torch.ops.gem.gdpa.default,
                          (q, k, v, offsets, offsets, 6, 6, "silu", 0.25, "kv_len", "pytorch"),
                          test_utils=checks)


def test_compiled_caller_traces_once_over_changing_token_counts():
    """A compiled function around the op: three batches of different token counts (and
    different longest sequences) compile one graph, with no graph break."""
    proj = torch.nn.Linear(D, D)

    def layer(x, offsets, max_len):
        q = proj(x)
        return custom_ops.jagged_attention(q, x, x, offsets, max_len, causal=True).sum(-1)

    compiled = torch.compile(layer, backend="aot_eager", dynamic=True, fullgraph=True)
    torch._dynamo.reset()
    counters.clear()
    for i, lengths in enumerate(([5, 9, 3], [17, 2, 30], [1, 40, 8])):
        x, _, _, offsets = _jagged(lengths, seed=i)
        out = compiled(x, offsets, max(lengths))
        out.sum().backward()
        torch.testing.assert_close(out, layer(x, offsets, max(lengths)))
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_custom_op_equals_public_op_on_cuda_compiled(case):
    """On CUDA (Triton kernels, bf16): the custom op inside an inductor-compiled function gives
    the public op's values and gradients."""
    public, custom = CASES[case]
    lengths = [5, 0, 200, 1, 64]
    q, k, v, offsets = (x.cuda() for x in _jagged(lengths, dtype=torch.bfloat16))
    n = max(lengths)
    compiled = torch.compile(lambda a, b, c, o: custom(a, b, c, o, n), dynamic=True,
                             fullgraph=True)

    def grads(fn):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        out = fn(*leaves)
        out.backward(torch.ones_like(out))
        return out.detach().float(), [x.grad.float() for x in leaves]

    want, want_g = grads(lambda a, b, c: public(a, b, c, offsets, n))
    got, got_g = grads(lambda a, b, c: compiled(a, b, c, offsets))
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    for a, b in zip(got_g, want_g, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_backward_outputs_never_alias_inputs_or_each_other() -> None:
    """A custom op may not return an input or two views of one buffer (torch raises on CUDA
    when a backward hands back such gradients); _unaliased copies exactly those."""
    from gem_kernels.custom_ops import _unaliased

    grad_out = torch.randn(6, 2, 4)
    packed = torch.randn(3, 6, 2, 4)
    own = torch.randn(6, 2, 4)
    dq, dk, dv = _unaliased((packed[0], packed[1], grad_out), grad_out)
    assert dq.data_ptr() == packed[0].data_ptr()  # the first view is kept as it is
    assert dk.untyped_storage().data_ptr() != dq.untyped_storage().data_ptr()
    assert dv.untyped_storage().data_ptr() != grad_out.untyped_storage().data_ptr()
    assert torch.equal(dk, packed[1]) and torch.equal(dv, grad_out)
    assert _unaliased((own, own + 1, own + 2))[0] is own


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_custom_op_is_bitwise_repeatable_in_deterministic_mode(case):
    """Under the deterministic backward (train.deterministic), an inductor-compiled caller of
    each custom op gives bitwise-identical outputs and gradients call after call: where
    compiled RoPE block attention stops being repeatable, this names the op."""
    from gem_kernels.dispatch import set_deterministic_backward

    _, custom = CASES[case]
    lengths = [5, 0, 700, 1, 64, 300]
    q, k, v, offsets = (x.cuda() for x in _jagged(lengths, dtype=torch.bfloat16))
    n = max(lengths)
    compiled = torch.compile(lambda a, b, c, o: custom(a, b, c, o, n), dynamic=True)
    before = torch.are_deterministic_algorithms_enabled()
    set_deterministic_backward(True)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        runs = []
        for _ in range(3):
            leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
            out = compiled(*leaves, offsets)
            out.backward(torch.cos(torch.arange(out.numel(), device=out.device)
                                   .view(out.shape)).to(out.dtype))
            runs.append([out.detach(), *(x.grad for x in leaves)])
    finally:
        set_deterministic_backward(None)
        torch.use_deterministic_algorithms(before)
    for later in runs[1:]:
        for a, b in zip(runs[0], later, strict=True):
            assert torch.equal(a, b)
