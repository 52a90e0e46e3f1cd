"""RMSNorm in Triton, plain and fused with the residual add that precedes it.

One program per row. The rounding follows the unfused torch path (models/
layers.py RMSNorm): the sum is stored in the input dtype and normalised from
that stored value, and the normalised row is rounded to the input dtype
before the weight multiplies it, so the two paths differ only in reduction
order. Launches depend on shapes only (CUDA-graph capturable, no host sync).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    heads,  # rows are (token, head) pairs: a [tokens, heads, n] input is normed per head
    stride_xt, stride_xh, stride_rt, stride_rh,
    n, eps,
    ADD: tl.constexpr, BLOCK: tl.constexpr,
):
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
    out_ty = out_ptr.dtype.element_ty
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (x * rstd).to(out_ty).to(tl.float32) * w
    tl.store(out_ptr + row * n + cols, y.to(out_ty), mask=mask)


def _row_layout(t: torch.Tensor) -> tuple[int, int, int]:
    """(heads, token stride, head stride) of a [tokens, n] or [tokens, heads, n] tensor."""
    assert t.stride(-1) == 1, "rows must be contiguous"
    if t.dim() == 2:
        return 1, t.stride(0), 0
    assert t.dim() == 3, "expected [tokens, n] or [tokens, heads, n]"
    return t.shape[1], t.stride(0), t.stride(1)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    n = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = out.numel() // n if n else 0
    if rows == 0:
        return out
    heads, stride_xt, stride_xh = _row_layout(x)
    _, stride_rt, stride_rh = _row_layout(residual) if residual is not None else (1, 0, 0)
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows,)](
        x, x if residual is None else residual, weight, out,
        heads, stride_xt, stride_xh, stride_rt, stride_rh, n, eps,
        ADD=residual is not None, BLOCK=block, num_warps=min(max(block // 256, 1), 8),
    )
    return out


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
