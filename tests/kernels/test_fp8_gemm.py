"""The FP8 dot kernel (kernels/fp8_gemm.py) against float64 and torch._scaled_mm: rows past the small-M
kernel's, K and N no multiples of the tile, K split, operands views into NaN buffers."""
from __future__ import annotations

import pytest
import torch

from specserve.kernels.fp8_gemm import Fp8DotTile, fp8_dot
from specserve.kernels.split_parts import split_counters
from specserve.quantization.fp8 import quantize_per_channel, quantize_per_token

from .util import DEVICE, assert_close, poisoned_view

K, N = 200, 90
TILES = [Fp8DotTile(64, 64, 128, 4, 4), Fp8DotTile(16, 32, 32, 4, 2), Fp8DotTile(32, 16, 64, 4, 3, split_k=3),
         Fp8DotTile(64, 32, 128, 4, 3, promote_k=128)]


def _quantized_view(rows: int, cols: int, seed: int, quantize):
    """An e4m3 [rows, cols] view into a NaN buffer, and its scale."""
    q, scale = quantize(poisoned_view(rows, cols, torch.float32, seed))
    buf = torch.full((rows + 2, cols + 8), float("nan"), device=DEVICE).to(q.dtype)
    buf[:rows, :cols] = q
    return buf[:rows, :cols], scale


def _dequantized(q, scale):
    return q.double() * scale.double().reshape(q.shape[0], 1)


@pytest.mark.parametrize("tile", TILES, ids=str)
@pytest.mark.parametrize("m", [1, 33, 64, 80])
def test_against_float64(m, tile):
    wq, ws = _quantized_view(N, K, m, quantize_per_channel)
    xq, xs = _quantized_view(m, K, m + 1, quantize_per_token)
    out = fp8_dot(xq, wq, ws, xs, out_dtype=torch.float32, tile=tile)
    # The interpreter sums exact e4m3 products in float32; a GPU's FP8 MMA sums each 32 in fewer bits (its
    # precision is test_as_precise_as_cublas's), so there the tolerance is bfloat16's: a wrong index or
    # mask still shows.
    assert_close(out if DEVICE == "cpu" else out.bfloat16(), _dequantized(xq, xs) @ _dequantized(wq, ws).T,
                 terms=K)
    assert not split_counters(out.device, 1).any(), "every output tile's count is back at zero"


def test_bfloat16_output_agrees_with_scaled_mm():
    """The same operands and scales as torch._scaled_mm's rowwise path (what the choice table compares it with):
    both round once to bfloat16 sums that differ in order (and on a GPU in the FP8 MMA's own rounding of each 32
    products), so they differ by a bfloat16 ulp of the value, or of the largest output where sums cancel.
    cuBLAS's FP8 GEMM takes N and K in multiples of 16 only: 96 and 208 (K still ends in a partial tile)."""
    n, k = 96, 208
    wq, ws = _quantized_view(n, k, 7, quantize_per_channel)
    xq, xs = _quantized_view(64, k, 8, quantize_per_token)
    got = fp8_dot(xq.contiguous(), wq.contiguous(), ws, xs, out_dtype=torch.bfloat16)
    want = torch._scaled_mm(xq.contiguous(), wq.contiguous().t(), scale_a=xs, scale_b=ws.view(1, -1),
                            out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -8 * want.float().abs().max().item())


@pytest.mark.skipif(DEVICE != "cuda", reason="the FP8 MMA's accumulation precision is the GPU's")
@pytest.mark.parametrize("split_k", [1, 4])
def test_as_precise_as_cublas(split_k):
    """Over a long K (an 8B model's down_proj reads 14,336), the kernel's largest error against float64 with its
    sums promoted after every MMA (the default tile's) is no more than 1.25 times torch._scaled_mm's (cuBLAS, which promotes its FP8 sums to float32 as it goes) on
    the same operands: sums left in the MMA's own precision over all of K drift several times further."""
    k = 14336
    wq, ws = quantize_per_channel(torch.randn(256, k, device=DEVICE))
    xq, xs = quantize_per_token(torch.randn(64, k, device=DEVICE))
    want = _dequantized(xq, xs) @ _dequantized(wq, ws).T
    ours = fp8_dot(xq, wq, ws, xs, out_dtype=torch.bfloat16, tile=Fp8DotTile(64, 64, 128, 4, 4, split_k=split_k))
    cublas = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16)
    err, cublas_err = ((o.double() - want).abs().max().item() for o in (ours, cublas))
    print(f"largest error: FP8 dot {err:.4g}, cuBLAS {cublas_err:.4g}")
    assert err <= 1.25 * cublas_err


def test_bad_operands_and_tiles_are_refused():
    wq, ws = _quantized_view(N, K, 0, quantize_per_channel)
    xq, xs = _quantized_view(4, K, 1, quantize_per_token)
    with pytest.raises(ValueError, match="x \\[M, K\\] and weight \\[N, K\\]"):
        fp8_dot(xq.float(), wq, ws, xs)
    with pytest.raises(ValueError, match="x_scale \\[4, 1\\]"):
        fp8_dot(xq, wq, ws, xs[:3])
    with pytest.raises(ValueError, match="power of two"):
        Fp8DotTile(64, 48, 128, 4, 4)
    with pytest.raises(ValueError, match="at least 16 x 16"):
        Fp8DotTile(64, 8, 128, 4, 4)
    with pytest.raises(ValueError, match="promote_k must be a multiple of 32 up to block_k"):
        Fp8DotTile(64, 64, 128, 4, 4, promote_k=256)
    with pytest.raises(ValueError, match="promote_k must be a multiple of 32"):
        Fp8DotTile(64, 64, 128, 4, 4, promote_k=48)
