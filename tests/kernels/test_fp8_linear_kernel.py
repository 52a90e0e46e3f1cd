"""The small-M projection with an FP8 weight (W8A16) and an FP8 input too (W8A8), against float64 and the FP8
layer's reference path; the per-token quantization kernel against the torch reference; operands are views into
NaN buffers, K and N no multiples of the blocks."""
from __future__ import annotations

import pytest
import torch

from specserve.kernels.fp8_rows import quantize_rows
from specserve.kernels.fused_linear import fp8_linear
from specserve.kernels.small_m_configs import SmallMConfig
from specserve.models.layers import set_fused_kernels
from specserve.quantization.fp8 import quantize_per_channel, quantize_per_token
from specserve.quantization.fp8_linear import Fp8Activation, Fp8Linear

from .util import DEVICE, assert_close, poisoned_view

SMALL_M_ROWS = 32

K, N = 100, 70


def _weight(seed: int):
    w = poisoned_view(N, K, torch.float32, seed)
    q, scale = quantize_per_channel(w.float())
    buf = torch.full((N + 2, K + 8), float("nan"), device=DEVICE).to(q.dtype)
    buf[:N, :K] = q
    return buf[:N, :K], scale


def _dequantized(q, scale):
    return q.double() * scale.double().reshape(-1, 1)


@pytest.mark.parametrize("m", [1, 5, 16, 17, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_only(m, dtype):
    wq, ws = _weight(m)
    x = poisoned_view(m, K, dtype, m + 1)
    out = fp8_linear(x, wq, ws)
    assert out.dtype == dtype and not out.isnan().any()
    assert_close(out, x.double() @ _dequantized(wq, ws).T, terms=K)


@pytest.mark.parametrize("m", [1, 7, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_input(m, dtype):
    wq, ws = _weight(m + 10)
    xq, xs = quantize_per_token(poisoned_view(m, K, dtype, m + 11))
    out = fp8_linear(xq, wq, ws, xs, out_dtype=dtype)
    assert out.dtype == dtype
    assert_close(out, _dequantized(xq, xs) @ _dequantized(wq, ws).T, terms=K)


@pytest.mark.parametrize("m", [1, 7])
def test_fp8_input_with_k_split(m):
    """K split over three programs a column tile (split_parts.py), the scales applied once after the sum."""
    wq, ws = _weight(m + 20)
    xq, xs = quantize_per_token(poisoned_view(m, K, torch.bfloat16, m + 21))
    out = fp8_linear(xq, wq, ws, xs, out_dtype=torch.float32, config=SmallMConfig(16, 32, 4, 2, split_k=3))
    assert_close(out, _dequantized(xq, xs) @ _dequantized(wq, ws).T, terms=K)


def test_bad_operands_are_refused():
    wq, ws = _weight(0)
    x = torch.randn(2, K, device=DEVICE)
    with pytest.raises(ValueError, match="an FP8 x takes an x_scale"):
        fp8_linear(x, wq, ws, torch.ones(2, 1, device=DEVICE))
    with pytest.raises(ValueError, match="weight_scale"):
        fp8_linear(x, wq, ws[:-1])
    with pytest.raises(ValueError, match="M <= 32"):
        fp8_linear(torch.randn(33, K, device=DEVICE), wq, ws)


@pytest.mark.parametrize("activation", [Fp8Activation.DYNAMIC, Fp8Activation.NONE])
def test_the_layer_kernel_path_equals_its_reference(activation):
    """The FP8 layer on the fused path (the Triton kernel for at most 32 rows, as on a GPU for a float32 model)
    gives its reference path's result."""
    layer = Fp8Linear.quantize(torch.nn.Linear(K, N, bias=True).to(DEVICE))
    layer.activation = activation
    x = torch.randn(9, K, device=DEVICE)
    set_fused_kernels(layer, False)
    want = layer(x)
    set_fused_kernels(layer, True)
    assert_close(layer(x), want.double(), terms=K)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_row_quantization_equals_the_torch_reference(dtype):
    """Every value and scale of the one-kernel quantization equals quantize_per_token's: rows of very
    different ranges, an all-zero row (the least scale), values on rounding ties of e4m3's grid."""
    x = poisoned_view(6, 150, dtype, seed=4)
    x.mul_(torch.tensor([1e-4, 1e-2, 1.0, 30.0, 1e3, 0.0], device=DEVICE, dtype=dtype)[:, None])
    x[2, :9] = torch.tensor([448.0, -448.0, 1.0625, 1.1875, 0.0146484375, 3 * 2.0 ** -10, -0.0, 2.0 ** -12, 17.0])
    q, scale = quantize_rows(x)
    want_q, want_scale = quantize_per_token(x)
    if x.is_cuda:
        # torch divides by a Python number as a multiplication by its reciprocal on CUDA: a last-bit difference
        # in a scale that moves a value on an e4m3 tie to the other side.
        torch.testing.assert_close(scale, want_scale, rtol=2.0 ** -23, atol=0)
        step = torch.maximum(x.double().abs() * 2.0 ** -3, scale.double() * 2.0 ** -9)
        assert torch.all((q.double() - want_q.double()).abs() * scale.double() <= step)
        # (Values, not bits: a zero's sign may differ.)
        assert (q.float() != want_q.float()).float().mean() < 0.01
    else:
        assert torch.equal(scale, want_scale)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_the_layer_quantizes_past_the_small_m_rows_with_the_kernel():
    """Over more rows than the small-M kernel takes, the FP8 layer's fused path (the row-quantization kernel,
    then the reference GEMM for a float32 model) gives its reference path's result."""
    layer = Fp8Linear.quantize(torch.nn.Linear(K, N, bias=True).to(DEVICE))
    x = torch.randn(SMALL_M_ROWS + 8, K, device=DEVICE)
    set_fused_kernels(layer, False)
    want = layer(x)
    set_fused_kernels(layer, True)
    torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)
