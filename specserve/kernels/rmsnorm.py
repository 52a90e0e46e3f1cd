"""RMSNorm in Triton, plain and fused with the residual add that precedes it, and either of these writing
its output quantized to FP8 per row for the projection after it (docs/design.md, 'FP8 weights').

One program per row. The rounding follows the unfused torch path (models/
layers.py RMSNorm): the sum is stored in the input dtype and normalised from
that stored value, and the normalised row is rounded to the input dtype
before the weight multiplies it, so the two paths differ only in reduction
order. The FP8 output is that rounded row quantized as kernels/fp8_rows.py does (its scale rule and
e4m3 rounding), so it is bit-equal to quantize_rows of the norm's output. Launches depend on shapes only
(CUDA-graph capturable, no host sync).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.fp8_rows import store_quantized_row
from specserve.kernels.pdl import pdl_args, wait_for_previous
from specserve.quantization.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, Fp8Rows


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    scale_ptr,  # QUANTIZE: a float32 scale per row, out_ptr's rows are e4m3
    heads,  # rows are (token, head) pairs: a [tokens, heads, n] input is normed per head
    stride_xt, stride_xh, stride_rt, stride_rh,
    n, eps, fp8_max, min_scale,
    ADD: tl.constexpr, QUANTIZE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    tok, head = row // heads, row % heads
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + tok * stride_xt + head * stride_xh + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        r_ptrs = residual_ptr + tok * stride_rt + head * stride_rh + cols
        total = (x + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)).to(residual_ptr.dtype.element_ty)
        tl.store(r_ptrs, total, mask=mask)
        x = total.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    dtype = x_ptr.dtype.element_ty
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype)  # 0 past n (w is)
    if QUANTIZE:
        store_quantized_row(y, out_ptr + row * n + cols, mask, scale_ptr + row, fp8_max, min_scale)
    else:
        tl.store(out_ptr + row * n + cols, y, mask=mask)


def _row_layout(t: torch.Tensor) -> tuple[int, int, int]:
    """(heads, token stride, head stride) of a [tokens, n] or [tokens, heads, n] tensor."""
    assert t.stride(-1) == 1, "rows must be contiguous"
    if t.dim() == 2:
        return 1, t.stride(0), 0
    assert t.dim() == 3, "expected [tokens, n] or [tokens, heads, n]"
    return t.shape[1], t.stride(0), t.stride(1)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            quantize: bool = False) -> torch.Tensor | Fp8Rows:
    n = x.shape[-1]
    out = torch.empty(x.shape, dtype=FP8_DTYPE if quantize else x.dtype, device=x.device)
    rows = out.numel() // n if n else 0
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device) if quantize else out
    if rows:
        heads, stride_xt, stride_xh = _row_layout(x)
        _, stride_rt, stride_rh = _row_layout(residual) if residual is not None else (1, 0, 0)
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows,)](
            x, x if residual is None else residual, weight, out, scale,
            heads, stride_xt, stride_xh, stride_rt, stride_rh, n, eps, FP8_MAX, MIN_SCALE,
            ADD=residual is not None, QUANTIZE=quantize, BLOCK=block, num_warps=min(max(block // 256, 1), 8),
            **pdl_args(x.device),
        )
    return Fp8Rows(out, scale, x.dtype) if quantize else out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dimension, into a new contiguous tensor of x's dtype.

    x is [tokens, n] or [tokens, heads, n] (per-head q/k norm) with contiguous rows.
    """
    return _launch(x, None, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x in place; returns (rms_norm(residual) as a new tensor, residual). x is left as it was."""
    assert x.shape == residual.shape and x.dtype == residual.dtype
    return _launch(x, residual, weight, eps), residual


def rms_norm_fp8_rows(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> Fp8Rows:
    """quantize_rows(rms_norm(x)) of a [tokens, n] x in one kernel; given residual, residual += x in place first
    and the sum is normed, as fused_add_rms_norm."""
    if x.dim() != 2 or (residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype)):
        raise ValueError(f"x must be [tokens, n] and residual None or of x's shape and dtype, got x {x.dtype} "
                         f"{tuple(x.shape)}, residual {None if residual is None else (residual.dtype, residual.shape)}")
    return _launch(x, residual, weight, eps, quantize=True)
