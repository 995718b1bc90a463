"""Flat blockwise FP8 (the saved-activation format): the Triton kernels against their PyTorch
references, bit for bit. CPU runs use the Triton interpreter at small lengths; the GPU test
(marked ``gpu``) runs the hardware conversions at real sizes.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported: CPU runs use the interpreter
    os.environ["TRITON_INTERPRET"] = "1"

from gem_kernels.fp8.blockwise import (  # noqa: E402
    FP8_MAX,
    dequantize_blocks,
    dequantize_blocks_reference,
    quantize_blocks,
    quantize_blocks_reference,
)

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
LENGTHS = [1, 127, 128, 129, 1000, 4096 + 5]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal, NaNs aside: NaN positions must agree, their sign and payload need not."""
    nan_a, nan_b = a.float().isnan(), b.float().isnan()
    if not torch.equal(nan_a, nan_b):
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.view(ints)[~nan_a], b.view(ints)[~nan_b])


def _wide(n: int, dtype: torch.dtype, seed: int = 0, device: str = DEV) -> torch.Tensor:
    """Normal values times magnitudes over many decades (subnormal fp32 scales included),
    with zeros, negative zeros, an all-zero block and one huge outlier block."""
    g = torch.Generator().manual_seed(seed)
    lo = -30 if dtype == torch.bfloat16 else (-6 if dtype == torch.float16 else -30)
    mag = 10.0 ** (torch.rand(n, generator=g) * (4 - lo) + lo)
    x = torch.randn(n, generator=g) * mag
    x[::11] = 0.0
    x[3::13] = -0.0
    if n > 300:
        x[128:256] = 0.0
        x[256:260] = torch.tensor([6e4, -6e4, 1.0, -1e-3])
    return x.to(dtype).to(device)


def _check(x: torch.Tensor) -> None:
    """Triton == reference for both directions, and the output geometry."""
    n = x.numel()
    data, scale = quantize_blocks(x, kernel="triton")
    ref_data, ref_scale = quantize_blocks(x, kernel="pytorch")
    nblocks = -(-n // 128)
    assert data.shape == (nblocks * 128,) and data.dtype == torch.float8_e4m3fn
    assert scale.shape == (nblocks, 1) and scale.dtype == torch.float32
    assert _same(data, ref_data) and _same(scale, ref_scale)
    assert not data.view(torch.uint8)[n:].any()  # padded tail: zeros
    y = dequantize_blocks(data, scale, n, x.dtype, kernel="triton")
    ref_y = dequantize_blocks(data, scale, n, x.dtype, kernel="pytorch")
    assert y.shape == (n,) and y.dtype == x.dtype
    assert _same(y, ref_y)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", LENGTHS)
def test_triton_equals_reference_bit_for_bit(dtype, n):
    _check(_wide(n, dtype, seed=n))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_round_to_even_and_zeros_keep_their_sign(dtype):
    # block amax 448 -> scale 1: values land on the e4m3 grid's midpoints as they are
    ties = [448.0, 1.0625, 1.1875, -1.0625, -1.1875, 2.0**-10, 3 * 2.0**-10, -(2.0**-10),
            -(2.0**-11), 0.0, -0.0, 240.0 + 8.0, 2.0**-7 + 2.0**-10]
    x = torch.tensor(ties + [0.0] * (128 - len(ties)) + [-0.0] * 128, dtype=dtype, device=DEV)
    _check(x)
    data, scale = quantize_blocks(x, kernel="triton")
    assert scale[1].item() == 1.0  # a block of (negative) zeros gets scale 1
    bits = data.view(torch.uint8).tolist()
    assert bits[1] == 0x38 and bits[2] == 0x3A  # 1.0625 -> 1.0, 1.1875 -> 1.25 (even)
    assert bits[5] == 0x00 and bits[7] == 0x80 and bits[10] == 0x80  # 2^-10 -> +0; -0 kept
    assert bits[128:256] == [0x80] * 128


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf / inf
@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values_follow_the_reference(dtype):
    """NaN block: scale 1, NaN stays NaN, the rest is clamped to +-448. Inf block: scale inf,
    finite elements 0, the inf NaN, and every element comes back NaN."""
    x = torch.zeros(4 * 128 + 7, dtype=torch.float32)
    x[:128] = torch.linspace(-1000, 1000, 128)
    x[5] = float("nan")
    x[128:256] = torch.linspace(-3, 3, 128)
    x[130] = float("inf")
    x[300] = float("-inf")
    x[384:] = torch.linspace(-1, 1, x.numel() - 384)
    x = x.to(dtype).to(DEV)
    _check(x)
    data, scale = quantize_blocks(x, kernel="triton")
    assert scale[0].item() == 1.0 and scale[1].item() == float("inf")
    q = data.float()
    assert q[5].isnan() and q[:128].nan_to_num().abs().max().item() == FP8_MAX
    assert q[130].isnan() and (q[128:256].nan_to_num() == 0).all()
    y = dequantize_blocks(data, scale, x.numel(), dtype, kernel="triton")
    assert y[128:256].isnan().all() and not y[384:].isnan().any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_round_trip_error_is_bounded(dtype):
    """Each element within 2^-4 of itself (3 mantissa bits), or 2^-10 of its block's scale
    below e4m3's normal range, plus the final 16-bit rounding."""
    x = _wide(4096 + 5, dtype, seed=3)
    data, scale = quantize_blocks(x, kernel="triton")
    y = dequantize_blocks(data, scale, x.numel(), dtype, kernel="triton")
    per_elem = scale.expand(-1, 128).reshape(-1)[: x.numel()]
    xf, yf = x.float(), y.float()
    bound = xf.abs() * (2.0**-4 + 2.0**-7) + per_elem * 2.0**-10
    assert ((xf - yf).abs() <= bound).all()
    assert torch.equal(y[x == 0], x[x == 0])
    assert torch.equal(y.abs().max(), x.abs().max())  # a block's largest value comes back exact


@pytest.mark.parametrize("step", [2, 3])
def test_strided_input_reads_in_place(step):
    """A saved tensor's memory order can flatten to a strided 1-D view (e.g. x[:, ::2])."""
    base = _wide(1000 * step, torch.bfloat16, seed=step)
    _check(base[::step])
    assert not base[::step].is_contiguous()


def test_dequantize_writes_into_out_and_auto_uses_the_reference_off_cuda():
    x = _wide(1000, torch.bfloat16)
    data, scale = quantize_blocks(x)  # kernel=None: reference on CPU, Triton on CUDA
    ref_data, ref_scale = quantize_blocks_reference(x)
    assert _same(data, ref_data) and _same(scale, ref_scale)
    out = torch.empty(1000, dtype=torch.bfloat16, device=DEV)
    y = dequantize_blocks(data, scale, 1000, torch.bfloat16, out=out, kernel="triton")
    assert y.data_ptr() == out.data_ptr()
    assert _same(out, dequantize_blocks_reference(data, scale, 1000, torch.bfloat16))


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="1-D"):
        quantize_blocks(torch.zeros(4, 4, device=DEV))
    with pytest.raises(ValueError, match="1-D"):
        quantize_blocks(torch.zeros(8, dtype=torch.int32, device=DEV))
    data, scale = quantize_blocks(torch.ones(200, device=DEV))
    with pytest.raises(ValueError, match="cannot hold"):
        dequantize_blocks(data, scale, 300, torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("n,dtype", [(50_000_000, torch.bfloat16),
                                     (50_000_000 + 77, torch.bfloat16),
                                     (3_000_001, torch.float16), (3_000_001, torch.float32)])
def test_gpu_triton_equals_reference_at_scale(n, dtype):
    """The hardware e4m3 / 16-bit conversions and div_rn against the eager reference."""
    g = torch.Generator(device="cuda").manual_seed(n)
    mag = 10.0 ** (torch.rand(n, device="cuda", generator=g) * 8 - 5)
    x = (torch.randn(n, device="cuda", generator=g) * mag).to(dtype)
    x[1000:1128] = 0.0
    x[2000:2100] = -0.0
    _check(x)
